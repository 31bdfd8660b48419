//! `megatrain bench nvme`: sequential write and read GB/s of the spill I/O engine (io_uring with
//! registered buffers and O_DIRECT, or the fallback) for block sizes 128 KiB / 1 MiB / 4 MiB and
//! queue depths 1–64, striped over the given directories; median of N passes, like fio's summary.

use crate::spill::io::{EngineKind, IoEngine, Request};
use crate::{Error, Result};
use serde::Serialize;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::time::Instant;

/// One measured case.
#[derive(Debug, Clone, Serialize)]
pub struct NvmeCase {
    /// Block size, bytes.
    pub block_bytes: usize,
    /// Requests in flight per batch.
    pub queue_depth: usize,
    /// Median write GB/s.
    pub write_gbps: f64,
    /// Median read GB/s.
    pub read_gbps: f64,
}

/// The report.
#[derive(Debug, Clone, Serialize)]
pub struct NvmeReport {
    /// Directories (one file each).
    pub dirs: Vec<PathBuf>,
    /// Bytes per pass.
    pub bytes_per_pass: u64,
    /// io_uring in use.
    pub uring: bool,
    /// O_DIRECT in use.
    pub direct: bool,
    /// Passes per case (median reported).
    pub reps: usize,
    /// Cases.
    pub cases: Vec<NvmeCase>,
}

/// Run the sweep: `size` bytes per pass over `dirs`.
pub fn run(
    dirs: &[PathBuf],
    size: u64,
    reps: usize,
    engine: EngineKind,
    blocks: &[usize],
    depths: &[usize],
) -> Result<NvmeReport> {
    if dirs.is_empty() {
        return Err(Error::bad_input(
            "--dir",
            "",
            "no directory given",
            Some("pass --dir DIR (one per NVMe device)"),
        ));
    }
    let mut files = Vec::new();
    let mut direct = true;
    for (k, d) in dirs.iter().enumerate() {
        std::fs::create_dir_all(d).map_err(|e| Error::io("create directory", d, e))?;
        let p = d.join(format!(".megatrain-bench-{k}-{}.bin", std::process::id()));
        let open = |dir: bool| {
            let mut o = std::fs::OpenOptions::new();
            o.read(true).write(true).create(true).truncate(true);
            if dir {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(&p)
        };
        let f = match open(true) {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                direct = false;
                open(false).map_err(|e| Error::io("open", &p, e))?
            }
            Err(e) => return Err(Error::io("open", &p, e)),
        };
        // SAFETY: fallocate on our own descriptor.
        if unsafe {
            libc::fallocate(
                f.as_raw_fd(),
                0,
                0,
                size.div_ceil(dirs.len() as u64) as libc::off_t,
            )
        } != 0
        {
            let e = std::io::Error::last_os_error();
            let _ = std::fs::remove_file(&p);
            return Err(Error::io("preallocate", &p, e).with_fix("free space or lower --size"));
        }
        files.push((p, f));
    }
    let mut cases = Vec::new();
    let mut uring = false;
    for &bs in blocks {
        for &qd in depths {
            let mut eng = IoEngine::new(engine, qd, qd, bs)?;
            uring = eng.is_uring();
            for i in 0..qd {
                eng.buf(i).fill(i as u8 | 1);
            }
            let blocks_total = (size as usize / bs).max(qd);
            let mut pass = |write: bool| -> Result<f64> {
                let t0 = Instant::now();
                let mut b = 0;
                while b < blocks_total {
                    let n = qd.min(blocks_total - b);
                    let reqs: Vec<Request> = (0..n)
                        .map(|k| {
                            let blk = b + k;
                            let (f, per) = (blk % files.len(), blk / files.len());
                            Request {
                                fd: files[f].1.as_raw_fd(),
                                write,
                                offset: (per * bs) as u64,
                                buf: k,
                                len: bs,
                            }
                        })
                        .collect();
                    for r in eng.run(&reqs) {
                        match r {
                            Ok(x) if x == bs => {}
                            Ok(x) => {
                                return Err(Error::system(
                                    "bench nvme",
                                    "I/O",
                                    format!("short transfer of {x} bytes"),
                                ))
                            }
                            Err(e) => return Err(Error::system("bench nvme", "I/O", e)),
                        }
                    }
                    b += n;
                }
                if write {
                    for (p, f) in &files {
                        f.sync_data().map_err(|e| Error::io("fdatasync", p, e))?;
                    }
                }
                Ok((blocks_total * bs) as f64 / t0.elapsed().as_secs_f64() / 1e9)
            };
            pass(true)?; // warm-up: allocate the blocks
            let (mut w, mut r) = (Vec::new(), Vec::new());
            for _ in 0..reps.max(1) {
                w.push(pass(true)?);
                r.push(pass(false)?);
            }
            let med = |mut v: Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            cases.push(NvmeCase {
                block_bytes: bs,
                queue_depth: qd,
                write_gbps: med(w),
                read_gbps: med(r),
            });
        }
    }
    for (p, _) in &files {
        let _ = std::fs::remove_file(p);
    }
    Ok(NvmeReport {
        dirs: dirs.to_vec(),
        bytes_per_pass: size,
        uring,
        direct,
        reps,
        cases,
    })
}

/// Text table.
pub fn render(r: &NvmeReport) -> String {
    let mut s = format!(
        "megatrain bench nvme — {} dir(s), {} per pass, {}, {}, median of {}\n\n{:>9} {:>4} {:>11} {:>11}\n",
        r.dirs.len(),
        crate::util::human_bytes(r.bytes_per_pass),
        if r.uring { "io_uring (registered buffers)" } else { "pread/pwrite fallback" },
        if r.direct { "O_DIRECT" } else { "buffered (O_DIRECT refused)" },
        r.reps,
        "block",
        "qd",
        "write GB/s",
        "read GB/s"
    );
    for c in &r.cases {
        s += &format!(
            "{:>9} {:>4} {:>11.2} {:>11.2}\n",
            crate::util::human_bytes(c.block_bytes as u64),
            c.queue_depth,
            c.write_gbps,
            c.read_gbps
        );
    }
    s
}
