//! `megatrain train`: the configuration (TOML, demo, flags), progress on the terminal, signals,
//! and what the run wrote.

/// `eprintln!` that never panics: after SIGHUP the terminal is gone and a write to it fails;
/// losing a progress line must not end the run.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

use clap::Args;
use megatrain::train::config::{TrainConfig, TrainOverrides};
use megatrain::util::human_bytes;
use megatrain::Result;
use std::path::PathBuf;

#[derive(Debug, Args)]
#[command(after_help = "Examples:
  megatrain train --demo --steps 200 --sample-every 100 --sample-prompt 'fn main'
  megatrain train run.toml --resume auto
  megatrain train --init-from ./Qwen2.5-0.5B --data sft.bin --seq-len 1024 --batch-size 4 \\
      --grad-accum 8 --steps 500 --lr 2e-5 --checkpoint-dir ckpt --checkpoint-every 100 \\
      --metrics metrics.jsonl --tensorboard tb --export-hf out/hf")]
pub struct TrainArgs {
    /// TOML file with any of the settings below (keys use `_`).
    config: Option<PathBuf>,
    /// Train the embedded default: a 3M-parameter byte-level Llama on this repository's own docs
    /// and source, through the full streaming pipeline, about 3 minutes on 2 cores. Its outputs
    /// go to DEMO_DIR/demo; `--demo --resume` continues it.
    #[arg(long)]
    demo: bool,
    /// Where the demo writes its outputs (in a `demo` directory inside).
    #[arg(long, value_name = "DIR", default_value = "out")]
    demo_dir: PathBuf,
    #[command(flatten)]
    settings: TrainOverrides,
    /// Buffered spill I/O (the same as `--direct-io false`).
    #[arg(long, hide = true)]
    no_direct_io: bool,
}

/// The progress of a rank other than 0: nothing (rank 0 reports the job's).
struct Quiet;

impl megatrain::train::Progress for Quiet {}

struct Reporter {
    bar: Option<indicatif::ProgressBar>,
    total: u64,
    last_plain: std::time::Instant,
}

impl megatrain::train::Progress for Reporter {
    fn start(&mut self, first: u64, total: u64, params: usize) {
        self.total = total;
        if first > total {
            say!("{params} parameters, already trained to step {total}: no step to run");
        } else {
            say!("training {params} parameters, steps {first}..={total}");
        }
        if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            let bar = indicatif::ProgressBar::new(total);
            bar.set_position(first.saturating_sub(1));
            if let Ok(style) =
                indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} eta {eta}")
            {
                bar.set_style(style);
            }
            self.bar = Some(bar);
        }
    }
    fn step(&mut self, m: &megatrain::engine::StepMetrics, val: Option<f64>) {
        // A mixture of experts: its aux loss and the least balanced layer's load.
        let routing = m.aux_loss.map_or(String::new(), |aux| {
            let worst = m
                .expert_load
                .iter()
                .max_by(|a, b| a.max_over_mean.total_cmp(&b.max_over_mean));
            format!(
                " · aux {aux:.4}{}",
                worst.map_or(String::new(), |l| format!(
                    " (layer {} load max/mean {:.2})",
                    l.layer, l.max_over_mean
                ))
            )
        });
        let msg = format!(
            "loss {:.4}{}{routing} · {:.0} tok/s · lr {:.2e}",
            m.loss,
            val.map_or(String::new(), |v| format!(" (val {v:.4})")),
            m.tokens as f64 / m.wall_s,
            m.lr
        );
        match &self.bar {
            Some(b) => {
                b.set_position(m.step);
                b.set_message(msg);
            }
            None => {
                if m.step == 1
                    || m.step == self.total
                    || val.is_some()
                    || self.last_plain.elapsed().as_secs() >= 5
                {
                    say!("step {}/{} {msg}", m.step, self.total);
                    self.last_plain = std::time::Instant::now();
                }
            }
        }
    }
    fn checkpoint(&mut self, d: &std::path::Path) {
        let line = format!("checkpoint {}", d.display());
        match &self.bar {
            Some(b) => b.println(line),
            None => say!("{line}"),
        }
    }
    fn note(&mut self, line: &str) {
        say!("{line}");
    }
}

/// Watch SIGINT, SIGTERM (what SLURM and Kubernetes send before SIGKILL) and SIGHUP (a closed
/// ssh session or terminal): the first sets `interrupt` (the trainer finishes its step,
/// checkpoints and returns), a second SIGINT or SIGTERM exits at once (the last checkpoint on
/// disk is intact); SIGHUP never does (a closed session often sends it twice: the shell passes
/// it on, then the kernel sends its own). After SIGHUP the terminal is gone: the descriptors that
/// were terminals when the run started go to /dev/null from then on (a write to a hung-up
/// terminal fails, and printing must not end the run). Returns the signal received, 0 while
/// none.
fn watch_signals(
    interrupt: std::sync::Arc<std::sync::atomic::AtomicBool>,
    saves: bool,
    speaks: bool,
) -> Result<std::sync::Arc<std::sync::atomic::AtomicI32>> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    use std::sync::atomic::Ordering;
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .map_err(|e| megatrain::Error::system("signal-hook", "install signal handlers", e))?;
    // Asked now: after a hangup `isatty` fails on the dead terminal.
    // SAFETY: isatty only inspects a descriptor number.
    let terminals: Vec<i32> = [1, 2]
        .into_iter()
        .filter(|&fd| unsafe { libc::isatty(fd) } == 1)
        .collect();
    let which = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(0));
    let seen = which.clone();
    std::thread::spawn(move || {
        for sig in signals.forever() {
            let name = match sig {
                SIGTERM => "SIGTERM",
                SIGHUP => {
                    detach(&terminals);
                    "SIGHUP (the terminal closed)"
                }
                _ => "interrupt",
            };
            if interrupt.swap(true, Ordering::SeqCst) {
                if sig == SIGHUP {
                    continue;
                }
                std::process::exit(128 + sig);
            }
            seen.store(sig, Ordering::SeqCst);
            if !speaks {
                continue;
            }
            say!(
                "\n{name}: finishing this step, then {} (send it again to stop now)",
                if saves {
                    "writing a checkpoint and stopping"
                } else {
                    "stopping; nothing will be saved (no --checkpoint-dir)"
                }
            );
        }
    });
    Ok(which)
}

/// A data-parallel rank's watchdog: when this rank has waited `timeout_s` seconds in one
/// collective (another rank hangs, or died without its launcher noticing), say so and end this
/// process at once; its launcher then ends the others. First it asks the other ranks which of
/// them still answer (a roll call on its own communicator, under `MPI_THREAD_MULTIPLE`), to name
/// the ranks that hang; meanwhile it answers theirs. `_exit`: the main thread is inside MPI,
/// which must not be finalised from here. The checkpoints on disk are whole (each is written
/// beside, then renamed).
///
/// It holds the world until the returned guard drops, which stops and joins it: MPI is then
/// finalised by the main thread, as it must be.
fn watch_collectives(
    world: std::sync::Arc<dyn megatrain::dist::Collective>,
    timeout_s: u64,
) -> Watchdog {
    let watch = world.watch();
    let (rank, size, host) = (world.rank(), world.size(), world.host().to_owned());
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    let thread = std::thread::spawn(move || loop {
        match stopped.recv_timeout(std::time::Duration::from_millis(250)) {
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        let Some((what, waited)) = watch.stalled() else {
            continue;
        };
        // A rank waiting a while tells the ranks that time out which ranks still take part.
        if waited.as_secs() >= 1 {
            world.answer_roll_calls();
        }
        if waited.as_secs() >= timeout_s {
            let cause = match world.roll_call(std::time::Duration::from_secs(ROLL_CALL_S)) {
                Some(gone) if !gone.is_empty() => {
                    let named: Vec<String> = gone
                        .iter()
                        .map(|(r, h)| format!("rank {r} (on {h})"))
                        .collect();
                    format!(
                        "{} did not answer within {ROLL_CALL_S} s while the others wait: hung, stopped or dead",
                        named.join(", ")
                    )
                }
                Some(_) => "every rank answered, waiting too: the ranks disagree on the collectives' order (a bug: please report it)".to_owned(),
                None => format!("a rank hangs or died ({})", world.no_roll_call()),
            };
            say!(
                "error: rank {rank} of {size} (on {host}): waited {} s in {what} for the other ranks (--collective-timeout {timeout_s}): {cause}; ending the job (the checkpoints on disk are whole: continue with --resume auto)",
                waited.as_secs()
            );
            // SAFETY: _exit ends the process without running handlers or touching MPI.
            unsafe { libc::_exit(1) }
        }
    });
    Watchdog {
        stop: Some(stop),
        thread: Some(thread),
    }
}

/// A running [`watch_collectives`]: stopped and joined when dropped.
struct Watchdog {
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How long a rank that timed out waits for the others to answer its roll call.
const ROLL_CALL_S: u64 = 2;

/// Point the descriptors `fds` (those that were terminals) at /dev/null.
fn detach(fds: &[i32]) {
    use std::os::fd::AsRawFd;
    let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") else {
        return;
    };
    for &fd in fds {
        // SAFETY: dup2 replaces a descriptor this process owns, atomically, with one of
        // /dev/null, which stays valid after `null` drops.
        unsafe {
            libc::dup2(null.as_raw_fd(), fd);
        }
    }
}

/// The configuration: the TOML file, the demo's, or the defaults, with the flags over it.
fn configuration(args: &TrainArgs, speaks: bool) -> Result<TrainConfig> {
    let base = match (&args.config, args.demo) {
        (Some(p), _) => TrainConfig::from_toml_file(p)?,
        (None, true) => {
            let d = megatrain::train::corpus::demo(&args.demo_dir)?;
            if speaks {
                say!(
                "demo: {} bytes of this repository's docs and source as byte tokens ({} train / {} validation) in {}",
                d.split.0 + d.split.1,
                d.split.0,
                d.split.1,
                d.dir.display()
                );
            }
            d.config
        }
        (None, false) => TrainConfig::default(),
    };
    let mut cfg = base.apply(args.settings.clone());
    if args.no_direct_io {
        cfg.direct_io = false;
    }
    Ok(cfg)
}

/// Train; the exit status is 0, or 128+signal when a signal stopped the run.
pub fn run(args: &TrainArgs) -> Result<u8> {
    // A launcher (mpirun, srun, torchrun) may have started this process as one rank of
    // several; how the ranks meet depends on the device they train on.
    let launch = megatrain::dist::Launch::from_env()?;
    let cfg = configuration(args, launch.as_ref().is_none_or(|l| l.rank == 0))?;
    let world = megatrain::train::join(launch.as_ref(), cfg.device)?;
    if world.size() == 1 {
        return run_rank(cfg, world);
    }
    let (rank, size) = (world.rank(), world.size());
    match run_rank(cfg, world.clone()) {
        Ok(code) => Ok(code),
        Err(e) => {
            // Every other rank would wait for this one forever: end the job, naming the rank.
            say!("error: rank {rank} of {size} (on {}): {e}", world.host());
            world.abort(i32::from(e.exit_code()))
        }
    }
}

/// Train as rank `world.rank()`: rank 0 prints the progress and the summary, the others only
/// their errors.
fn run_rank(
    cfg: TrainConfig,
    world: std::sync::Arc<dyn megatrain::dist::Collective>,
) -> Result<u8> {
    cfg.validate()?;
    let _watchdog =
        (world.size() > 1).then(|| watch_collectives(world.clone(), cfg.collective_timeout));
    if world.rank() != 0 {
        let interrupt = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        watch_signals(interrupt.clone(), false, false)?;
        let s = megatrain::train::run_in(&cfg, world, interrupt, &mut Quiet)?;
        return Ok(if s.interrupted { 130 } else { 0 });
    }
    eprint!("{}", cfg.table());
    if world.size() > 1 {
        say!(
            "data parallel: {} ranks ({}), each {} micro-batch(es) a step: {} sequences of {} tokens a step",
            world.size(),
            megatrain::dist::Launch::from_env()?.map_or("?", |l| l.launcher),
            cfg.grad_accum,
            cfg.grad_accum * cfg.batch_size * world.size(),
            cfg.seq_len
        );
    }
    let interrupt = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let signal = watch_signals(interrupt.clone(), cfg.checkpoint_dir.is_some(), true)?;
    let mut rep = Reporter {
        bar: None,
        total: 0,
        last_plain: std::time::Instant::now(),
    };
    let s = megatrain::train::run_in(&cfg, world, interrupt, &mut rep)?;
    if let Some(b) = &rep.bar {
        b.finish();
    }
    say!(
        "\n{}: {} steps, loss {} → {}{}, {:.0} tokens/s",
        if s.interrupted { "stopped" } else { "done" },
        s.steps,
        s.first_loss.map_or("-".into(), |l| format!("{l:.4}")),
        s.last_loss.map_or("-".into(), |l| format!("{l:.4}")),
        s.val_loss
            .map_or(String::new(), |v| format!(" (validation {v:.4})")),
        s.tokens_per_s
    );
    if let Some(rss) = s.peak_rss {
        let m = s.host_memory;
        say!(
            "  memory      peak RSS {} = host state {} + buffers {} + CPU device {} + {} other",
            human_bytes(rss),
            human_bytes(m.state),
            human_bytes(m.buffers),
            human_bytes(m.device),
            human_bytes(rss.saturating_sub(m.total()))
        );
    }
    for (what, p) in [
        ("checkpoint", &s.checkpoint),
        ("HF export", &s.export),
        ("metrics", &s.metrics),
        ("tensorboard", &s.tensorboard),
        ("loss curve", &s.plot),
        ("trace", &s.trace),
    ] {
        if let Some(p) = p {
            say!("  {what:<11} {}", p.display());
        }
    }
    if s.metrics_failures > 0 {
        say!(
            "  warning: {} metrics line(s) could not be written",
            s.metrics_failures
        );
    }
    if s.tensorboard_failures > 0 {
        say!(
            "  warning: {} TensorBoard event(s) could not be written",
            s.tensorboard_failures
        );
    }
    if s.interrupted {
        let sig = signal.load(std::sync::atomic::Ordering::SeqCst);
        let sig = if sig == 0 {
            signal_hook::consts::SIGINT
        } else {
            sig
        };
        say!(
            "interrupted after step {}: {}",
            s.steps,
            match (&s.checkpoint, cfg.checkpoint_dir.is_some()) {
                (Some(c), _) => format!("checkpoint {} (continue with --resume)", c.display()),
                (None, true) => "no checkpoint was written".to_owned(),
                (None, false) => "nothing was saved (no --checkpoint-dir)".to_owned(),
            }
        );
        return Ok(u8::try_from(128 + sig).unwrap_or(130));
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use clap::Parser;
    use megatrain::train::config::Resume;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        train: TrainArgs,
    }

    fn parse(args: &[&str]) -> TrainConfig {
        let mut v = vec!["megatrain"];
        v.extend_from_slice(args);
        configuration(&Cli::try_parse_from(v).unwrap().train, false).unwrap()
    }

    /// Flags land in the configuration: values, switches with and without a value, optional
    /// `--resume [WHEN]`, repeated lists, sizes with units, negative numbers (refused later by
    /// validation, not by the parser).
    #[test]
    fn flags_set_the_configuration() {
        let d = TrainConfig::default();
        assert_eq!(parse(&[]), d);
        let c = parse(&[
            "--seq-len",
            "7",
            "--lr",
            "0.5",
            "--shuffle",
            "--decay-norms",
            "false",
            "--resume",
            "--nvme",
            "/a",
            "--nvme",
            "/b",
            "--device-memory",
            "64MiB",
            "--ram-budget",
            "2G",
            "--weight-decay",
            "-1",
            "--mode",
            "lean",
            "--io-engine",
            "sync",
            "--no-direct-io",
        ]);
        assert_eq!(
            (c.seq_len, c.lr, c.shuffle, c.decay_norms),
            (7, 0.5, true, false)
        );
        assert_eq!(c.resume, Resume::Always);
        assert_eq!(c.nvme, vec![PathBuf::from("/a"), PathBuf::from("/b")]);
        assert_eq!(
            (c.device_memory, c.ram_budget),
            (64 << 20, Some(2_000_000_000))
        );
        assert_eq!(c.weight_decay, -1.0);
        assert_eq!(c.mode, Some(megatrain::store::layout::Mode::Lean));
        assert!(!c.direct_io);
        assert_eq!(parse(&["--resume", "auto"]).resume, Resume::Auto);
        assert!(Cli::try_parse_from(["megatrain", "--no-such-flag"]).is_err());
    }

    /// Every setting is a TOML key and the flags win over the file.
    #[test]
    fn toml_then_flags() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("run.toml");
        std::fs::write(
            &p,
            "seq_len = 9\nlr = 0.25\nresume = \"auto\"\ndevice_memory = \"1GiB\"\n",
        )
        .unwrap();
        let c = parse(&[p.to_str().unwrap(), "--lr", "0.5"]);
        assert_eq!(
            (c.seq_len, c.lr, c.resume, c.device_memory),
            (9, 0.5, Resume::Auto, 1 << 30)
        );
        // Every setting round-trips through a file: a configuration with each one off its
        // default, written as TOML, read back over the defaults, is the same configuration.
        let full = TrainConfig {
            init_from: Some("/i".into()),
            data: Some("/d".into()),
            val_data: Some("/v".into()),
            metrics: Some("/m".into()),
            checkpoint_dir: Some("/c".into()),
            export_hf: Some("/e".into()),
            trace: Some("/t".into()),
            nvme: vec!["/n".into()],
            ram_budget: Some(12345),
            activations: Some(megatrain::train::config::Activations::Host),
            mode: Some(megatrain::store::layout::Mode::Lean),
            resume: Resume::Auto,
            shuffle: true,
            tf32: true,
            lock_memory: true,
            direct_io: false,
            decay_norms: false,
            device_memory: 777,
            ..TrainConfig::default()
        };
        let text = toml::to_string(&full).unwrap();
        let back = TrainConfig::default().apply(TrainOverrides::from_toml_str(&text, "t").unwrap());
        assert_eq!(back, full, "{text}");
    }
}
