//! The emulator's settings, read once from the environment (`tools/cuemu.sh` sets the paths).

use crate::profile::Profile;
use std::path::PathBuf;
use std::sync::OnceLock;

/// A fault to inject: the `nth` call (1-based) to `function` (made on a thread named `thread`,
/// when given) fails with `code`.
#[derive(Debug, Clone)]
pub struct FailPoint {
    pub function: String,
    pub thread: Option<String>,
    pub nth: u64,
    pub code: i32,
}

#[derive(Debug)]
pub struct Config {
    /// `CUEMU_DEVICE`: h100 (default), h200, gh200.
    pub profile: Profile,
    /// `CUEMU_MEMORY`: device memory in bytes (`2GiB`, `512MiB`), else the profile's.
    pub memory: u64,
    /// `CUEMU_CUDA`: the CUDA release the emulator presents itself as, 12 (default) or 13: the
    /// sonames `tools/cuemu.sh` gives it (`.so.12` or `.so.13`), the driver's default version
    /// (12.9 or 13.0) and cuBLAS' (12.9.1 or 13.1.0).
    pub cuda: u32,
    /// `CUEMU_DRIVER`: the driver's CUDA version (`12080` = 12.8), else the release's.
    pub driver: i32,
    /// `CUEMU_MEMORY_POOLS=0` turns off the stream-ordered allocator (`cuMemAllocAsync`,
    /// `cuMemFreeAsync`, `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`); on by default, as on an
    /// H100.
    pub memory_pools: bool,
    /// `CUEMU_SCHEDULES`: the thread schedules every launch runs under (1–3: forward, then
    /// reverse, then seeded random); more than one compares their results.
    pub schedules: Vec<u32>,
    /// `CUEMU_SEED`: seeds the random schedule and the random delays.
    pub seed: u64,
    /// `CUEMU_DELAYS`: sleep up to this many microseconds before each stream command (0: none).
    pub delay_us: u64,
    /// `CUEMU_THREADS`: host threads running a launch's blocks.
    pub threads: usize,
    /// `CUEMU_REPORT`: a file every error report is appended to.
    pub report: Option<PathBuf>,
    /// `CUEMU_LOG=1`: log every unimplemented call and every note.
    pub log: bool,
    /// `CUEMU_REAL_NVRTC`: the real libnvrtc the emulated one forwards to.
    pub real_nvrtc: Option<PathBuf>,
    /// `CUEMU_INCLUDE`: `:`-separated include directories for the host build of kernels (the
    /// CUDA runtime, nvcc and CCCL headers from the PyPI wheels).
    pub include: Vec<PathBuf>,
    /// `CUEMU_SIMT`: the directory holding `cuemu_simt.h`, `cuemu_abi.h`, `runtime.cpp`.
    pub simt: PathBuf,
    /// `CUEMU_CACHE`: where host builds are kept (keyed by a hash of everything they depend on).
    pub cache: PathBuf,
    /// `CUEMU_CXX`: the host C++ compiler.
    pub cxx: String,
    /// `CUEMU_FAIL`: `NAME[@THREAD][:N][=CODE],…` faults to inject.
    pub fail: Vec<FailPoint>,
    /// `CUEMU_CLOCK_SKIP`: seconds added to the timestamps of events recorded after the
    /// program's first `cuEventSynchronize` — as if it had been running that long (what hours
    /// of uptime do to a timeline kept in f32 milliseconds).
    pub clock_skip: f64,
    /// `CUEMU_COUNTS=1`: count every call by entry point and print the counts at exit
    /// (host functions, synchronisations, stream waits: what a pipeline costs the host).
    pub counts: bool,
    /// `CUEMU_NCCL_TIMEOUT`: seconds an emulated NCCL rank waits for the others (to join a
    /// communicator, or to reach a collective) before its call fails (600).
    pub nccl_timeout: std::time::Duration,
}

pub fn get() -> &'static Config {
    static C: OnceLock<Config> = OnceLock::new();
    C.get_or_init(read)
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn read() -> Config {
    let profile = Profile::by_name(var("CUEMU_DEVICE").as_deref().unwrap_or("h100"));
    let memory = var("CUEMU_MEMORY")
        .and_then(|v| parse_size(&v))
        .unwrap_or(profile.memory);
    let cuda: u32 = match var("CUEMU_CUDA").as_deref() {
        None | Some("12") => 12,
        Some("13") => 13,
        Some(other) => {
            crate::report::warning(&format!(
                "CUEMU_CUDA={other}: the emulator presents CUDA 12 or 13; using 12"
            ));
            12
        }
    };
    let driver = var("CUEMU_DRIVER")
        .and_then(|v| v.parse().ok())
        .unwrap_or(if cuda == 13 { 13000 } else { profile.driver });
    let n: u32 = var("CUEMU_SCHEDULES")
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
        .clamp(1, 3);
    let home = var("HOME").unwrap_or_else(|| "/tmp".into());
    let cache = var("CUEMU_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(home).join(".cache/megatrain/cuemu"));
    Config {
        memory,
        cuda,
        driver,
        memory_pools: var("CUEMU_MEMORY_POOLS").is_none_or(|v| v != "0"),
        schedules: (0..n).collect(),
        seed: var("CUEMU_SEED").and_then(|v| v.parse().ok()).unwrap_or(1),
        delay_us: var("CUEMU_DELAYS")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        threads: var("CUEMU_THREADS")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
            .max(1),
        report: var("CUEMU_REPORT").map(PathBuf::from),
        log: var("CUEMU_LOG").is_some_and(|v| v != "0"),
        real_nvrtc: var("CUEMU_REAL_NVRTC").map(PathBuf::from),
        include: var("CUEMU_INCLUDE")
            .map(|v| {
                v.split(':')
                    .filter(|s| !s.is_empty())
                    .map(PathBuf::from)
                    .collect()
            })
            .unwrap_or_default(),
        simt: var("CUEMU_SIMT").map(PathBuf::from).unwrap_or_default(),
        cache,
        cxx: var("CUEMU_CXX").unwrap_or_else(|| "g++".into()),
        fail: var("CUEMU_FAIL")
            .map(|v| parse_fail(&v))
            .unwrap_or_default(),
        clock_skip: var("CUEMU_CLOCK_SKIP")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0),
        counts: var("CUEMU_COUNTS").is_some_and(|v| v == "1"),
        nccl_timeout: std::time::Duration::from_secs_f64(
            var("CUEMU_NCCL_TIMEOUT")
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|s| s.is_finite() && *s > 0.0)
                .unwrap_or(600.0),
        ),
        profile,
    }
}

/// `2GiB`, `512MiB`, `1G`, `4096`.
fn parse_size(s: &str) -> Option<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().ok()?;
    let mult: u64 = match unit.trim().trim_end_matches('B') {
        "" => 1,
        "K" => 1000,
        "M" => 1000 * 1000,
        "G" => 1000 * 1000 * 1000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        _ => return None,
    };
    n.checked_mul(mult)
}

fn parse_fail(s: &str) -> Vec<FailPoint> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (rest, code) = match p.split_once('=') {
                Some((r, c)) => (r, c.trim().parse().unwrap_or(999)),
                None => (p, 999),
            };
            let (rest, nth) = match rest.split_once(':') {
                Some((r, n)) => (r, n.trim().parse().unwrap_or(1)),
                None => (rest, 1),
            };
            let (function, thread) = match rest.split_once('@') {
                Some((f, t)) => (f.trim().to_owned(), Some(t.trim().to_owned())),
                None => (rest.trim().to_owned(), None),
            };
            FailPoint {
                function,
                thread,
                nth,
                code,
            }
        })
        .collect()
}
