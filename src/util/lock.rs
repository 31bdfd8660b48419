//! Exclusive ownership of a directory or file for the life of a process: an advisory `flock`
//! held on an open descriptor. The kernel drops it when the process exits, however it exits
//! (`kill -9` included), so a lock is never stale; the holder's PID, host and start time are
//! written into the lock file so a refused second process can name who holds it.

use crate::{Error, Result};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// Name of the lock file inside a locked directory.
pub const LOCK_FILE: &str = ".megatrain.lock";

/// An exclusive lock, released on drop (or at process exit).
#[derive(Debug)]
pub struct DirLock {
    path: PathBuf,
    _file: std::fs::File,
}

/// Who holds a lock, as its lock file says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// Process id.
    pub pid: u32,
    /// Host name.
    pub host: String,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PID {} on host {}", self.pid, self.host)
    }
}

/// This machine's host name (`gethostname`), or "unknown".
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its whole length; gethostname NUL-terminates or
    // truncates within it.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Try to take an exclusive `flock` on `file` without waiting. `Ok(false)`: someone holds it.
pub fn try_flock(file: &std::fs::File) -> std::io::Result<bool> {
    // SAFETY: flock on a descriptor we own; no memory is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

fn parse_holder(text: &str) -> Option<Holder> {
    let mut pid = None;
    let mut host = None;
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("pid ") {
            pid = v.trim().parse().ok();
        } else if let Some(v) = line.strip_prefix("host ") {
            host = Some(v.trim().to_owned());
        }
    }
    Some(Holder {
        pid: pid?,
        host: host.unwrap_or_else(|| "unknown".into()),
    })
}

impl DirLock {
    /// Lock directory `dir` (which must exist) for this process. `what` names the directory's
    /// role in the refusal ("checkpoint directory"), `fix` says what to do instead.
    pub fn acquire(dir: &Path, what: &'static str, fix: &str) -> Result<DirLock> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join(LOCK_FILE);
        // Never through a symlink planted at the name: the holder's line would overwrite
        // whatever it points at.
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_NOFOLLOW)
            .mode(0o644)
            .open(&path)
            .map_err(|e| {
                let link = e.raw_os_error() == Some(libc::ELOOP);
                let e = Error::io("create lock file", &path, e);
                if link {
                    e.with_fix("it is a symlink, which megatrain never writes through: remove it (`rm` removes the link, not its target)")
                } else {
                    e
                }
            })?;
        if !file.metadata().is_ok_and(|m| m.is_file()) {
            return Err(Error::bad_input(
                what,
                dir.display().to_string(),
                format!("its lock file {LOCK_FILE} is not a regular file"),
                Some("remove it; megatrain makes a new one"),
            ));
        }
        let got = try_flock(&file).map_err(|e| Error::io("lock", &path, e))?;
        if !got {
            let mut text = String::new();
            let _ = file.read_to_string(&mut text);
            let holder = parse_holder(&text).map_or_else(
                || "another process (its lock file names no holder yet)".to_owned(),
                |h| format!("megatrain {h}"),
            );
            return Err(Error::bad_input(
                what,
                dir.display().to_string(),
                format!("is in use by {holder}"),
                Some(fix),
            ));
        }
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let me = format!(
            "pid {}\nhost {}\nsince {since}\n",
            std::process::id(),
            hostname()
        );
        // Best effort: the lock itself is the flock; the text only names the holder.
        let _ = file.set_len(0);
        let _ = file.rewind();
        let _ = file.write_all(me.as_bytes());
        let _ = file.sync_data();
        Ok(DirLock { path, _file: file })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A fresh random identifier (16 hex digits) from the kernel's generator, falling back to the
/// clock and the PID where `getrandom` is unavailable.
pub fn random_id() -> String {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most `len` bytes into the buffer we pass.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    let v = if n == 8 {
        u64::from_le_bytes(b)
    } else {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        t ^ (u64::from(std::process::id()) << 32)
    };
    format!("{v:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_lock_is_refused_naming_the_holder_and_released_on_drop() {
        let d = tempfile::tempdir().unwrap();
        let a = DirLock::acquire(d.path(), "checkpoint directory", "use another").unwrap();
        let e = DirLock::acquire(d.path(), "checkpoint directory", "use another")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("PID {}", std::process::id())) && e.contains("use another"),
            "{e}"
        );
        assert!(e.contains(&hostname()), "{e}");
        drop(a);
        DirLock::acquire(d.path(), "checkpoint directory", "use another").unwrap();
    }

    #[test]
    fn a_planted_lock_symlink_is_never_written_through() {
        let d = tempfile::tempdir().unwrap();
        let victim = d.path().join("victim.txt");
        std::fs::write(&victim, b"precious").unwrap();
        let run = d.path().join("run");
        std::fs::create_dir(&run).unwrap();
        std::os::unix::fs::symlink("../victim.txt", run.join(LOCK_FILE)).unwrap();
        let e = DirLock::acquire(&run, "checkpoint directory", "x")
            .unwrap_err()
            .to_string();
        assert!(e.contains(LOCK_FILE) && e.contains("symlink"), "{e}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }

    #[test]
    fn ids_differ() {
        let (a, b) = (random_id(), random_id());
        assert_eq!(a.len(), 16);
        assert_ne!(a, b);
    }
}
