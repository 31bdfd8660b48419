//! Failure injection for tests of the paths real faults take (a full disk, a refused write),
//! in the spirit of TiKV's `fail` crate but always compiled: a process started with
//! `MEGATRAIN_FAILPOINTS=export=ENOSPC,checkpoint=EIO:1` fails those named points with that OS
//! error (`:N`: only the first N times); `checkpoint-unit=sleep40` makes a [`pause`] point wait
//! 40 ms (a slow disk, to test what overlaps it). Unset (every normal run), a point costs one
//! lookup in an empty list.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The environment variable that arms failure points.
pub const ENV: &str = "MEGATRAIN_FAILPOINTS";

/// An armed point: its name, the OS error (or, negative, the milliseconds a [`pause`] waits),
/// and how many more times it fires.
type Point = (String, i32, AtomicU64);

fn armed() -> &'static [Point] {
    static ARMED: OnceLock<Vec<Point>> = OnceLock::new();
    ARMED.get_or_init(|| {
        std::env::var(ENV)
            .unwrap_or_default()
            .split(',')
            .filter_map(|item| {
                let (name, spec) = item.split_once('=')?;
                let (err, times) = match spec.split_once(':') {
                    Some((e, n)) => (e, n.trim().parse().ok()?),
                    None => (spec, u64::MAX),
                };
                let code = match err.trim() {
                    sleep if sleep.starts_with("sleep") => -sleep[5..].parse::<i32>().ok()?.abs(),
                    "ENOSPC" => libc::ENOSPC,
                    "EIO" => libc::EIO,
                    "EACCES" => libc::EACCES,
                    "EROFS" => libc::EROFS,
                    other => other.parse().ok()?,
                };
                Some((name.trim().to_owned(), code, AtomicU64::new(times)))
            })
            .collect()
    })
}

/// `Err` with the armed OS error if point `name` is armed (and has firings left), else `Ok`.
pub fn check(name: &str) -> std::io::Result<()> {
    let Some((_, code, left)) = armed().iter().find(|(n, code, _)| n == name && *code >= 0) else {
        return Ok(());
    };
    let fire = left
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok();
    if fire {
        Err(std::io::Error::from_raw_os_error(*code))
    } else {
        Ok(())
    }
}

/// Wait as long as point `name` is armed to (`sleepMS`), if it is.
pub fn pause(name: &str) {
    if let Some((_, code, _)) = armed().iter().find(|(n, code, _)| n == name && *code < 0) {
        std::thread::sleep(std::time::Duration::from_millis(code.unsigned_abs().into()));
    }
}
