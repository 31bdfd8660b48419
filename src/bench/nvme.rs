//! `megatrain bench nvme`: sequential write and read GB/s of the spill I/O engine (io_uring with
//! registered buffers and O_DIRECT, or the fallback) for block sizes 128 KiB / 1 MiB / 4 MiB and
//! queue depths 1–64, striped over the given directories; median of N passes, like fio's summary.

use crate::host::{PageKind, Region, RegionSpec};
use crate::spill::io::{EngineKind, IoEngine, Request};
use crate::util::median;
use crate::{Error, Result};
use serde::Serialize;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::time::Instant;

/// One measured case.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct NvmeCase {
    /// Block size, bytes.
    pub block_bytes: usize,
    /// Requests in flight per batch.
    pub queue_depth: usize,
    /// Median write GB/s.
    pub write_gbps: f64,
    /// Median read GB/s.
    pub read_gbps: f64,
    /// fio's figures for the same case, when asked for.
    pub fio: Option<FioCase>,
}

/// fio on the same directories, block size and queue depth.
#[derive(Debug, Clone, Copy, Serialize, serde::Deserialize)]
pub struct FioCase {
    /// Median write GB/s.
    pub write_gbps: f64,
    /// Median read GB/s.
    pub read_gbps: f64,
}

/// The report.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct NvmeReport {
    /// Directories (one file each).
    pub dirs: Vec<PathBuf>,
    /// Bytes per pass.
    pub bytes_per_pass: u64,
    /// io_uring in use.
    pub uring: bool,
    /// Registered (fixed) buffers in use.
    pub fixed_buffers: bool,
    /// Pages backing the I/O buffers.
    pub pages: PageKind,
    /// O_DIRECT in use.
    pub direct: bool,
    /// Passes per case (median reported).
    pub reps: usize,
    /// Cases.
    pub cases: Vec<NvmeCase>,
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct NvmeBench {
    /// One directory per device; blocks are striped over them.
    pub dirs: Vec<PathBuf>,
    /// Bytes per pass.
    pub size: u64,
    /// Passes per case (median reported).
    pub reps: usize,
    /// io_uring or the pread/pwrite threads.
    pub engine: EngineKind,
    /// Block sizes.
    pub blocks: Vec<usize>,
    /// Queue depths.
    pub depths: Vec<usize>,
    /// Pages backing the I/O buffers.
    pub pages: PageKind,
    /// Run fio on every case too, passes interleaved with ours.
    pub with_fio: bool,
}

/// Run the sweep.
pub fn run(b: &NvmeBench) -> Result<NvmeReport> {
    if b.dirs.is_empty() {
        return Err(Error::bad_input(
            "--dir",
            "",
            "no directory given",
            Some("pass --dir DIR (one per NVMe device)"),
        ));
    }
    super::check_count("--reps", b.reps, 1, super::MAX_REPS)?;
    if b.blocks.is_empty() || b.depths.is_empty() {
        return Err(Error::bad_input(
            if b.blocks.is_empty() {
                "--block"
            } else {
                "--qd"
            },
            "",
            "no value given",
            Some("pass a comma-separated list, e.g. --block 1Mi --qd 1,16"),
        ));
    }
    for &bs in &b.blocks {
        // O_DIRECT needs whole 4 KiB blocks on most devices.
        if bs == 0 || !bs.is_multiple_of(4096) || bs > 1 << 30 {
            return Err(Error::bad_input(
                "--block",
                bs.to_string(),
                "must be a positive multiple of 4 KiB, at most 1 GiB (direct I/O moves whole blocks)",
                Some("pass e.g. --block 128Ki,1Mi,4Mi"),
            ));
        }
    }
    for &qd in &b.depths {
        super::check_count("--qd", qd, 1, 4096)?;
    }
    let (max_bs, max_qd) = (
        b.blocks.iter().copied().max().unwrap_or(0),
        b.depths.iter().copied().max().unwrap_or(0),
    );
    if b.size < max_bs as u64 {
        return Err(Error::bad_input(
            "--size",
            b.size.to_string(),
            format!("is less than one block ({max_bs} bytes): nothing to measure"),
            Some("pass a --size of at least the largest --block (e.g. 512M)"),
        ));
    }
    super::check_memory(
        &format!("I/O buffers (--qd {max_qd} × --block {max_bs})"),
        (max_qd as u64).checked_mul(max_bs as u64),
        "pass a smaller --qd or --block",
    )?;
    let files = BenchFiles::create(&b.dirs, b.size)?;
    let mut cases = Vec::new();
    let (mut uring, mut fixed) = (false, false);
    for &bs in &b.blocks {
        for &qd in &b.depths {
            let mut eng = IoEngine::new(b.engine, qd)?;
            uring = eng.is_uring();
            // One buffer per in-flight request (request i uses buffer i mod qd).
            let buf = Region::allocate(RegionSpec {
                pages: b.pages,
                ..RegionSpec::scratch(format!("bench buffers ({qd} x {bs} bytes)"), qd * bs)
            })?;
            // SAFETY: the region outlives `eng` (dropped at the end of this iteration, after
            // `eng`, which `run_case` consumes).
            fixed = unsafe { eng.register(&[(buf.as_ptr(), qd * bs)], bs) }.is_ok();
            // SAFETY: fresh region of qd·bs bytes.
            unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), qd * bs) }.fill(0x5a);
            cases.push(run_case(b, &files, eng, &buf, bs, qd)?);
        }
    }
    let direct = files.direct;
    drop(files);
    if b.with_fio {
        for (k, d) in b.dirs.iter().enumerate() {
            let _ = std::fs::remove_file(d.join(fio_file(k)));
        }
    }
    Ok(NvmeReport {
        dirs: b.dirs.clone(),
        bytes_per_pass: b.size,
        uring,
        fixed_buffers: fixed,
        pages: b.pages,
        direct,
        reps: b.reps,
        cases,
    })
}

/// The bench's files, one per directory, preallocated to its share of the pass; removed on
/// drop, whether the bench finished or failed.
struct BenchFiles {
    files: Vec<(PathBuf, std::fs::File)>,
    /// Opened with O_DIRECT (refused by some filesystems, then buffered).
    direct: bool,
}

impl BenchFiles {
    fn create(dirs: &[PathBuf], size: u64) -> Result<Self> {
        let mut out = BenchFiles {
            files: Vec::new(),
            direct: true,
        };
        for (k, d) in dirs.iter().enumerate() {
            std::fs::create_dir_all(d).map_err(|e| Error::io("create directory", d, e))?;
            let p = d.join(format!(".megatrain-bench-{k}-{}.bin", std::process::id()));
            let f = out.open(&p)?;
            out.files.push((p.clone(), f));
            let share = size.div_ceil(dirs.len() as u64) as libc::off_t;
            // SAFETY: fallocate on our own descriptor.
            if unsafe { libc::fallocate(out.files[k].1.as_raw_fd(), 0, 0, share) } != 0 {
                let e = std::io::Error::last_os_error();
                return Err(Error::io("preallocate", &p, e).with_fix("free space or lower --size"));
            }
        }
        Ok(out)
    }

    /// Open `p` with O_DIRECT, or buffered (for good) once a filesystem refuses it.
    fn open(&mut self, p: &std::path::Path) -> Result<std::fs::File> {
        let open = |direct: bool| {
            let mut o = std::fs::OpenOptions::new();
            o.read(true).write(true).create(true).truncate(true);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(p)
        };
        match open(self.direct) {
            Err(e) if self.direct && e.raw_os_error() == Some(libc::EINVAL) => {
                self.direct = false;
                open(false).map_err(|e| Error::io("open", p, e))
            }
            other => other.map_err(|e| Error::io("open", p, e)),
        }
    }
}

impl Drop for BenchFiles {
    fn drop(&mut self) {
        for (p, _) in &self.files {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Block size `bs` at queue depth `qd` through `eng` with buffers in `buf`: a warm-up write,
/// then `reps` write and read passes, interleaved with fio's when asked.
fn run_case(
    b: &NvmeBench,
    files: &BenchFiles,
    mut eng: IoEngine,
    buf: &Region,
    bs: usize,
    qd: usize,
) -> Result<NvmeCase> {
    let blocks_total = (b.size as usize / bs).max(qd);
    let requests = |write: bool| -> Vec<Request> {
        (0..blocks_total)
            .map(|blk| {
                let (f, per) = (blk % files.files.len(), blk / files.files.len());
                Request {
                    fd: files.files[f].1.as_raw_fd(),
                    write,
                    offset: (per * bs) as u64,
                    // SAFETY: (blk mod qd)·bs + bs ≤ qd·bs.
                    addr: unsafe { buf.as_ptr().add((blk % qd) * bs) },
                    len: bs,
                }
            })
            .collect()
    };
    let (writes, reads) = (requests(true), requests(false));
    let mut pass = |write: bool| pass(&mut eng, if write { &writes } else { &reads }, files);
    let fio = |rw: &str| fio_pass(&b.dirs, b.size, bs, qd, rw);
    pass(true)?; // warm-up: lays the blocks out, as fio's first pass does
    if b.with_fio {
        fio("write")?;
    }
    // Passes alternate between the tools, so drift of the device (or of a VM host's cache)
    // hits both alike; which tool goes first alternates too, so neither always reads the file
    // written last (a host cache would favour it).
    let (mut w, mut r, mut fw, mut fr) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for rep in 0..b.reps.max(1) {
        let fio_first = b.with_fio && rep % 2 == 1;
        if fio_first {
            fw.push(fio("write")?);
        }
        w.push(pass(true)?);
        if b.with_fio && !fio_first {
            fw.push(fio("write")?);
        }
        if fio_first {
            fr.push(fio("read")?);
        }
        r.push(pass(false)?);
        if b.with_fio && !fio_first {
            fr.push(fio("read")?);
        }
    }
    Ok(NvmeCase {
        block_bytes: bs,
        queue_depth: qd,
        write_gbps: median(w),
        read_gbps: median(r),
        fio: b.with_fio.then(|| FioCase {
            write_gbps: median(fw),
            read_gbps: median(fr),
        }),
    })
}

/// One pass of `reqs` (all reads or all writes, each of the same length); GB/s, writes made
/// durable before the clock stops.
fn pass(eng: &mut IoEngine, reqs: &[Request], files: &BenchFiles) -> Result<f64> {
    let (write, len) = (reqs[0].write, reqs[0].len);
    let failure = std::sync::Mutex::new(None::<String>);
    let t0 = Instant::now();
    // SAFETY: the buffer region stays valid; the bench data is never read back, so requests
    // sharing a buffer only race on bytes nobody looks at.
    unsafe {
        eng.run(
            reqs,
            |_| {},
            |_, r| {
                let bad = match r {
                    Ok(x) if x == len => None,
                    Ok(x) => Some(format!("short transfer of {x} of {len} bytes")),
                    Err(e) => Some(e.to_string()),
                };
                if let Some(b) = bad {
                    crate::util::lock(&failure).get_or_insert(b);
                }
            },
        )
    };
    if write {
        for (p, f) in &files.files {
            f.sync_data().map_err(|e| Error::io("fdatasync", p, e))?;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    if let Some(f) = failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(Error::system("bench nvme", "I/O", f));
    }
    Ok((reqs.len() * len) as f64 / secs / 1e9)
}

fn fio_file(k: usize) -> String {
    format!(".megatrain-fio-{k}-{}.bin", std::process::id())
}

/// One fio pass on the same case: one job per directory, O_DIRECT, io_uring, the same block size
/// and (summed over jobs) queue depth, `size` bytes in all, fdatasync at the end of writes.
/// Returns GB/s.
fn fio_pass(dirs: &[PathBuf], size: u64, bs: usize, qd: usize, rw: &str) -> Result<f64> {
    let mut cmd = std::process::Command::new("fio");
    cmd.args([
        "--output-format=json",
        "--group_reporting",
        "--ioengine=io_uring",
        "--direct=1",
        "--end_fsync=1",
        "--thread",
    ]);
    let n = dirs.len();
    for (k, d) in dirs.iter().enumerate() {
        cmd.arg(format!("--name=megatrain-fio-{k}"))
            .arg(format!("--directory={}", d.display()))
            .arg(format!("--filename={}", fio_file(k)))
            .arg(format!("--rw={rw}"))
            .arg(format!("--bs={bs}"))
            .arg(format!("--iodepth={}", qd.div_ceil(n).max(1)))
            .arg(format!("--size={}", size.div_ceil(n as u64)));
    }
    let out = cmd.output().map_err(|e| {
        Error::system("fio", "run", e).with_fix("install fio (`apt install fio`) or drop --fio")
    })?;
    if !out.status.success() {
        return Err(Error::system(
            "fio",
            "run",
            String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // fio may print notices before the JSON object.
    let json = text.find('{').map_or("", |i| &text[i..]);
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| Error::system("fio", "parse its JSON output", e))?;
    let bw: f64 = v["jobs"]
        .as_array()
        .map(|jobs| jobs.iter().filter_map(|j| j[rw]["bw_bytes"].as_f64()).sum())
        .unwrap_or(0.0);
    Ok(bw / 1e9)
}

/// Text table.
pub fn render(r: &NvmeReport) -> String {
    let with_fio = r.cases.iter().any(|c| c.fio.is_some());
    let mut s = format!(
        "megatrain bench nvme — {} dir(s), {} per pass, {}, {}, {} buffers, median of {}\n\n{:>9} {:>4} {:>11} {:>11}",
        r.dirs.len(),
        crate::util::human_bytes(r.bytes_per_pass),
        match (r.uring, r.fixed_buffers) {
            (true, true) => "io_uring (registered buffers)",
            (true, false) => "io_uring",
            _ => "pread/pwrite threads (fallback)",
        },
        if r.direct { "O_DIRECT" } else { "buffered (O_DIRECT refused)" },
        match r.pages {
            PageKind::Small => "4 KiB-page",
            PageKind::Transparent => "THP",
            PageKind::Huge2M => "2 MiB hugetlb",
            PageKind::Huge1G => "1 GiB hugetlb",
        },
        r.reps,
        "block",
        "qd",
        "write GB/s",
        "read GB/s"
    );
    if with_fio {
        s += &format!(
            " {:>10} {:>10} {:>8} {:>8}",
            "fio write", "fio read", "write %", "read %"
        );
    }
    s += "\n";
    for c in &r.cases {
        s += &format!(
            "{:>9} {:>4} {:>11.2} {:>11.2}",
            crate::util::human_bytes(c.block_bytes as u64),
            c.queue_depth,
            c.write_gbps,
            c.read_gbps
        );
        if let Some(f) = c.fio {
            s += &format!(
                " {:>10.2} {:>10.2} {:>7.0}% {:>7.0}%",
                f.write_gbps,
                f.read_gbps,
                100.0 * c.write_gbps / f.write_gbps.max(1e-9),
                100.0 * c.read_gbps / f.read_gbps.max(1e-9)
            );
        }
        s += "\n";
    }
    if with_fio {
        s += "fio: --direct=1 --ioengine=io_uring --end_fsync=1, one job per directory, same block size, queue depth and bytes; its buffers are malloc'd (4 KiB pages)\n";
    }
    s
}
