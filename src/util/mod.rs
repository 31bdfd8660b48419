//! Small helpers shared by several modules.

pub mod contain;
pub mod direct;
pub mod failpoint;
pub mod lock;
pub mod output;
pub mod paths;
pub mod progress;
pub mod size;

use crate::{Error, Result};
use std::path::Path;

pub use output::{check_writable_dir, write_atomic};

/// Lock `m`, recovering the data of a mutex poisoned by a panicking holder: every holder here
/// leaves the data consistent at each await point, so a panic elsewhere must not cascade.
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// This process's peak resident set so far, in bytes (`getrusage`'s `ru_maxrss`), if the
/// kernel reports it.
pub fn peak_rss_bytes() -> Option<u64> {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a `rusage` into the pointed-to, properly sized and aligned
    // buffer; RUSAGE_SELF is a valid `who`.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: initialised by the successful call above (and zeroed before it).
    let ru = unsafe { ru.assume_init() };
    // Linux reports kilobytes.
    u64::try_from(ru.ru_maxrss).ok().map(|kb| kb * 1024)
}

/// The median (upper median for an even count; 0 for none).
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Bytes in binary units with one decimal: "503.9 GiB".
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// `n` deterministic pseudo-random values, uniform in [-scale, scale) (xorshift64): reproducible
/// data for tests and benchmarks without an RNG dependency.
pub fn uniform(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
        })
        .collect()
}

/// splitmix64's increment: the `n`-th draw from `seed` is a function of `seed + n·γ` alone.
pub const SPLITMIX64_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64: a tiny, well-known deterministic generator (the data's shuffle, the random init,
/// sampling), advancing `state`.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(SPLITMIX64_GAMMA);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Compressed formats by their first bytes: (magic, name, the command that decompresses).
const COMPRESSED: [(&[u8], &str, &str); 4] = [
    (&[0x1f, 0x8b], "gzip", "gunzip -k"),
    (&[0x28, 0xb5, 0x2f, 0xfd], "zstd", "zstd -d"),
    (b"BZh", "bzip2", "bunzip2 -k"),
    (&[0xfd, b'7', b'z', b'X', b'Z', 0], "xz", "unxz -k"),
];

/// The compression format whose magic `head` (a file's first bytes) starts with, with the
/// command that decompresses it.
pub fn compression(head: &[u8]) -> Option<(&'static str, &'static str)> {
    COMPRESSED
        .iter()
        .find(|(magic, _, _)| head.starts_with(magic))
        .map(|&(_, name, cmd)| (name, cmd))
}

/// Bytes available to an unprivileged writer on the filesystem holding `path` (`statvfs`).
pub fn free_space(path: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        Error::bad_input(
            "path",
            path.display().to_string(),
            "contains a NUL byte",
            None,
        )
    })?;
    // SAFETY: statvfs is plain data; all-zero is a valid value that the call overwrites.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid out-pointer for the call.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(Error::io(
            "query free space",
            path,
            std::io::Error::last_os_error(),
        ));
    }
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(2 * 1024 * 1024), "2.0 MiB");
        assert_eq!(human_bytes(541_165_879_296), "504.0 GiB");
    }

    #[test]
    fn free_space_and_writability_of_a_temp_dir() {
        let d = tempfile::tempdir().unwrap();
        assert!(free_space(d.path()).unwrap() > 0);
        check_writable_dir(d.path()).unwrap();
        assert!(free_space(&d.path().join("missing")).is_err());
        assert!(check_writable_dir(&d.path().join("missing")).is_err());
    }
}
