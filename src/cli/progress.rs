//! The long phases' progress (`megatrain::util::progress`) on stderr: on a terminal a bar with
//! the rate and an ETA, elsewhere a plain line every 10 s; either way a line when a phase that
//! took a second or more is done. Phases shorter than a second show nothing, unless
//! `MEGATRAIN_PROGRESS=all` (every phase's end, e.g. for a log).

use megatrain::util::human_bytes;
use megatrain::util::progress::{Event, State, Unit};
use std::collections::HashMap;
use std::io::{IsTerminal, Write as _};
use std::sync::Mutex;
use std::time::Duration;

/// A phase is shown once it has run this long.
const SHOW_AFTER: Duration = Duration::from_secs(1);
/// Plain lines (not a terminal) at most this often per phase.
const PLAIN_EVERY: Duration = Duration::from_secs(10);

/// What is on screen for a phase.
enum View {
    Bar(indicatif::ProgressBar),
    /// Plain lines: when the last was printed.
    Lines(Duration),
}

/// Install the sink (once, first thing).
pub fn install() {
    let terminal = std::io::stderr().is_terminal();
    let show_after = match std::env::var("MEGATRAIN_PROGRESS").as_deref() {
        Ok("all") => Duration::ZERO,
        _ => SHOW_AFTER,
    };
    let views: Mutex<HashMap<String, View>> = Mutex::new(HashMap::new());
    megatrain::util::progress::set_sink(move |e: &Event<'_>| {
        let mut views = views.lock().unwrap_or_else(|p| p.into_inner());
        if e.state != State::Running {
            if let Some(View::Bar(b)) = views.remove(e.phase) {
                b.finish_and_clear();
            }
            if e.state == State::Done && e.elapsed >= show_after {
                say(&format!(
                    "{}: {} in {:.1} s ({})",
                    e.phase,
                    amount(e.unit, e.done),
                    e.elapsed.as_secs_f64(),
                    rate(e)
                ));
            }
            return;
        }
        if e.elapsed < show_after.max(Duration::from_millis(1)) {
            return;
        }
        match views.get_mut(e.phase) {
            Some(View::Bar(b)) => b.set_position(e.done),
            Some(View::Lines(last)) if e.elapsed.saturating_sub(*last) >= PLAIN_EVERY => {
                *last = e.elapsed;
                say(&line(e));
            }
            Some(View::Lines(_)) => {}
            None if terminal => {
                let b = bar(e);
                b.set_position(e.done);
                views.insert(e.phase.to_owned(), View::Bar(b));
            }
            None => {
                say(&line(e));
                views.insert(e.phase.to_owned(), View::Lines(e.elapsed));
            }
        }
    });
}

/// `eprintln!` that never panics (a closed terminal).
fn say(s: &str) {
    let _ = writeln!(std::io::stderr(), "{s}");
}

fn bar(e: &Event<'_>) -> indicatif::ProgressBar {
    let b = if e.total > 0 {
        indicatif::ProgressBar::new(e.total)
    } else {
        indicatif::ProgressBar::new_spinner()
    };
    let template = match (e.unit, e.total > 0) {
        (Unit::Bytes, true) => {
            "{msg} {bar:30} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}"
        }
        (Unit::Bytes, false) => "{msg} {spinner} {bytes} {binary_bytes_per_sec}",
        (Unit::Records, true) => "{msg} {bar:30} {human_pos}/{human_len} {per_sec} eta {eta}",
        (Unit::Records, false) => "{msg} {spinner} {human_pos} {per_sec}",
    };
    if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
        b.set_style(style);
    }
    b.set_message(e.phase.to_owned());
    b.set_draw_target(indicatif::ProgressDrawTarget::stderr());
    b
}

fn amount(unit: Unit, n: u64) -> String {
    match unit {
        Unit::Bytes => human_bytes(n),
        Unit::Records => format!("{n} records"),
    }
}

fn rate(e: &Event<'_>) -> String {
    let per_s = e.done as f64 / e.elapsed.as_secs_f64().max(1e-9);
    match e.unit {
        Unit::Bytes => format!("{}/s", human_bytes(per_s as u64)),
        Unit::Records => format!("{per_s:.0} records/s"),
    }
}

/// "checkpoint write: 1.2 GiB of 6.0 GiB (20%), 1.1 GiB/s, eta 4 s".
fn line(e: &Event<'_>) -> String {
    let mut s = format!("{}: {}", e.phase, amount(e.unit, e.done));
    if e.total > 0 {
        let left = e.total.saturating_sub(e.done) as f64;
        let per_s = e.done as f64 / e.elapsed.as_secs_f64().max(1e-9);
        s += &format!(
            " of {} ({:.0}%), {}",
            amount(e.unit, e.total),
            100.0 * e.done as f64 / e.total as f64,
            rate(e)
        );
        if per_s > 0.0 {
            s += &format!(", eta {:.0} s", left / per_s);
        }
    } else {
        s += &format!(", {}", rate(e));
    }
    s
}
