//! Failure injection for tests of the paths real faults take (a full disk, a refused write),
//! in the spirit of TiKV's `fail` crate but always compiled: a process started with
//! `MEGATRAIN_FAILPOINTS=export=ENOSPC,checkpoint=EIO` fails those named points with that OS
//! error. Unset (every normal run), a point costs one lookup in an empty list.

use std::sync::OnceLock;

/// The environment variable that arms failure points.
pub const ENV: &str = "MEGATRAIN_FAILPOINTS";

fn armed() -> &'static [(String, i32)] {
    static ARMED: OnceLock<Vec<(String, i32)>> = OnceLock::new();
    ARMED.get_or_init(|| {
        std::env::var(ENV)
            .unwrap_or_default()
            .split(',')
            .filter_map(|item| {
                let (name, err) = item.split_once('=')?;
                let code = match err.trim() {
                    "ENOSPC" => libc::ENOSPC,
                    "EIO" => libc::EIO,
                    "EACCES" => libc::EACCES,
                    "EROFS" => libc::EROFS,
                    other => other.parse().ok()?,
                };
                Some((name.trim().to_owned(), code))
            })
            .collect()
    })
}

/// `Err` with the armed OS error if point `name` is armed, else `Ok`.
pub fn check(name: &str) -> std::io::Result<()> {
    match armed().iter().find(|(n, _)| n == name) {
        Some((_, code)) => Err(std::io::Error::from_raw_os_error(*code)),
        None => Ok(()),
    }
}
