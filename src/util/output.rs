//! Writing a file the user named: atomically where the path is a regular file (or nothing yet),
//! through a symlink to what it points at, in place for a character device or a FIFO
//! (`/dev/null`, `/dev/stdout`, a pipe), and never by replacing a device node, a socket or a
//! directory. Files made inside a directory others may write to are created exclusively and
//! without following a symlink planted at their name.

use crate::{Error, Result};
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Symlinks followed before a chain is called a loop (Linux's own limit).
const MAX_LINKS: usize = 40;

/// `path` with every symlink at its end followed (a dangling one gives where it points; its
/// parent directories are left as they are: a rename there lands in the same place), and
/// whether the chain passed through a process's descriptors (`/dev/stdout` → `/proc/self/fd/1`:
/// links the kernel resolves to an open file, not to a path one may rename over).
fn follow(path: &Path) -> Result<(PathBuf, bool)> {
    let mut p = path.to_owned();
    let mut via_descriptor = false;
    for _ in 0..MAX_LINKS {
        via_descriptor |= p.starts_with("/proc") || p.starts_with("/dev/fd");
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let to = std::fs::read_link(&p).map_err(|e| Error::io("read symlink", &p, e))?;
                p = match p.parent() {
                    Some(dir) if to.is_relative() => dir.join(to),
                    _ => to,
                };
            }
            _ => return Ok((p, via_descriptor)),
        }
    }
    Err(Error::io(
        "follow symlinks",
        path,
        std::io::Error::from_raw_os_error(libc::ELOOP),
    ))
}

/// `path` with every symlink at its end followed (see [`follow`]).
pub fn follow_symlinks(path: &Path) -> Result<PathBuf> {
    follow(path).map(|(p, _)| p)
}

/// What kind of thing `path` (symlinks followed) is, for writing into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Nothing there yet, or a regular file: replaced atomically.
    File,
    /// A character device, a FIFO, or a descriptor this process was given (`/dev/stdout`, also
    /// when the shell pointed it at a file): written in place, appended, never replaced.
    Stream,
}

/// Check that `path` may be written as a file and say how; a directory, a block device or a
/// socket is refused (replacing a device node with a file, or writing a disk, is never meant).
/// The kind is the kernel's (`stat` follows `/proc/self/fd/N` to the open file itself).
pub fn target(path: &Path) -> Result<Target> {
    classify(path).map(|(t, _)| t)
}

/// [`target`], with the path a [`Target::File`] is renamed over (symlinks followed).
fn classify(path: &Path) -> Result<(Target, PathBuf)> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok((Target::File, follow_symlinks(path)?))
        }
        Err(e) => return Err(Error::io("inspect", path, e)),
    };
    let t = meta.file_type();
    let refuse = |kind: &str| {
        Err(Error::bad_input(
            "output path",
            path.display().to_string(),
            format!("is {kind}; megatrain writes files"),
            Some("name a regular file (a new one, or one megatrain wrote)"),
        ))
    };
    if t.is_file() {
        match follow(path)? {
            (real, true) => Ok((Target::Stream, real)),
            (real, false) => Ok((Target::File, real)),
        }
    } else if t.is_char_device() || t.is_fifo() {
        Ok((Target::Stream, path.to_owned()))
    } else if t.is_dir() {
        refuse("a directory")
    } else if t.is_block_device() {
        refuse("a block device (a disk)")
    } else {
        refuse("a socket or another special file")
    }
}

/// Open `path`, a [`Target::Stream`], for writing in place: appending (a file behind
/// `/dev/stdout` keeps what the shell's `>>` or earlier writes put there), never truncating.
pub fn open_stream(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new().append(true).open(path)
}

/// Create `path` for writing, exclusively and without following a symlink at its name: a file
/// (or link) left there by someone else is removed first, never written through.
pub fn create_exclusive(path: &Path) -> std::io::Result<std::fs::File> {
    let open = || {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .mode(0o644)
            .open(path)
    };
    match open() {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            std::fs::remove_file(path)?;
            open()
        }
        r => r,
    }
}

/// Write `bytes` to `path`. A regular file (or a new one) is written atomically: a temporary
/// file in the same directory, fsync, rename; an existing file is untouched unless the whole
/// write succeeds. A symlink is written through (the file it points at is replaced, the link
/// stays); a character device or FIFO is written in place; see [`target`] for what is refused.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = AtomicFile::create(path)?;
    f.write_all(bytes)
        .map_err(|e| Error::io("write", f.writing(), e))?;
    f.commit()
}

/// A file written piece by piece as [`write_atomic`] writes it whole: into a temporary file
/// beside `path` renamed over it by [`AtomicFile::commit`] (dropped uncommitted, the temporary
/// file is removed and `path` is untouched), or in place for a stream.
#[derive(Debug)]
pub struct AtomicFile {
    file: std::fs::File,
    /// The temporary file and where it goes; `None`: a stream written in place.
    rename: Option<(PathBuf, PathBuf)>,
    path: PathBuf,
}

impl AtomicFile {
    /// Start writing `path` (its directory must exist).
    pub fn create(path: &Path) -> Result<Self> {
        let (kind, real) = classify(path)?;
        if kind == Target::Stream {
            let file = open_stream(path).map_err(|e| Error::io("open", path, e))?;
            return Ok(AtomicFile {
                file,
                rename: None,
                path: path.to_owned(),
            });
        }
        let dir = match real.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let name = real
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .ok_or_else(|| {
                Error::bad_input(
                    "output path",
                    path.display().to_string(),
                    "names no file",
                    None,
                )
            })?;
        if !dir.is_dir() {
            return Err(Error::io(
                "write",
                path,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("directory `{}` does not exist", dir.display()),
                ),
            )
            .with_fix("create the directory first, or choose another path"));
        }
        let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
        // A replaced file keeps its permissions (a 0600 file stays private).
        let mode = std::fs::metadata(&real).ok().map(|m| m.permissions());
        let file = create_exclusive(&tmp).map_err(|e| Error::io("create", &tmp, e))?;
        let out = AtomicFile {
            file,
            rename: Some((tmp, real)),
            path: path.to_owned(),
        };
        if let Some(mode) = mode {
            out.file
                .set_permissions(mode)
                .map_err(|e| Error::io("set permissions", out.writing(), e))?;
        }
        Ok(out)
    }

    /// The file being written (the temporary one), for messages.
    pub fn writing(&self) -> &Path {
        self.rename.as_ref().map_or(&self.path, |(tmp, _)| tmp)
    }

    /// Make the file whole at `path`: fsync and rename (a stream: flushed).
    pub fn commit(mut self) -> Result<()> {
        let Some((tmp, real)) = self.rename.take() else {
            return self
                .file
                .flush()
                .map_err(|e| Error::io("write", &self.path, e));
        };
        let done = self
            .file
            .sync_all()
            .map_err(|e| Error::io("fsync", &tmp, e))
            .and_then(|()| {
                std::fs::rename(&tmp, &real)
                    .map_err(|e| Error::io("rename into place", &self.path, e))
            });
        if done.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        done
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.file.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if let Some((tmp, _)) = &self.rename {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

/// Check that the directory `dir` accepts new files: create and remove a probe file in it.
pub fn check_writable_dir(dir: &Path) -> std::io::Result<()> {
    let probe = dir.join(format!(".megatrain-write-test-{}", std::process::id()));
    create_exclusive(&probe)?;
    std::fs::remove_file(&probe)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn atomic_write_replaces_only_on_success() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.txt");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let bad = dir.path().join("missing-dir/out.txt");
        assert!(write_atomic(&bad, b"x").is_err());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_symlink_is_written_through_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real.txt");
        std::fs::write(&real, b"old").unwrap();
        let link = dir.path().join("link.txt");
        symlink("real.txt", &link).unwrap();
        write_atomic(&link, b"new").unwrap();
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(std::fs::read(&real).unwrap(), b"new");
        // A dangling link makes the file it names.
        let dangling = dir.path().join("dangling");
        symlink("made.txt", &dangling).unwrap();
        write_atomic(&dangling, b"x").unwrap();
        assert_eq!(std::fs::read(dir.path().join("made.txt")).unwrap(), b"x");
        // A loop is an error, not a hang.
        symlink("loop-b", dir.path().join("loop-a")).unwrap();
        symlink("loop-a", dir.path().join("loop-b")).unwrap();
        assert!(write_atomic(&dir.path().join("loop-a"), b"x").is_err());
    }

    #[test]
    fn device_nodes_and_fifos_are_written_in_place_never_replaced() {
        write_atomic(Path::new("/dev/null"), b"discarded").unwrap();
        let meta = std::fs::metadata("/dev/null").unwrap();
        assert!(meta.file_type().is_char_device());
        let e = write_atomic(Path::new("/dev/full"), b"x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("/dev/full"), "{e}");
        assert!(std::fs::metadata("/dev/full")
            .unwrap()
            .file_type()
            .is_char_device());
        let dir = tempfile::tempdir().unwrap();
        let e = write_atomic(dir.path(), b"x").unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        // A FIFO with a reader gets the bytes.
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::read(fifo).unwrap())
        };
        write_atomic(&fifo, b"through the pipe").unwrap();
        assert_eq!(reader.join().unwrap(), b"through the pipe");
        assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    }

    #[test]
    fn a_descriptor_path_is_appended_to_in_place_and_permissions_are_kept() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log");
        std::fs::write(&log, b"earlier\n").unwrap();
        let f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        use std::os::fd::AsRawFd;
        let via = PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd()));
        assert_eq!(target(&via).unwrap(), Target::Stream);
        write_atomic(&via, b"appended\n").unwrap();
        assert_eq!(std::fs::read(&log).unwrap(), b"earlier\nappended\n");
        let private = dir.path().join("private");
        std::fs::write(&private, b"x").unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o600)).unwrap();
        write_atomic(&private, b"y").unwrap();
        let mode = std::fs::metadata(&private).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn a_planted_symlink_at_a_temporary_name_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim.txt");
        std::fs::write(&victim, b"precious").unwrap();
        let tmp = dir
            .path()
            .join(format!(".out.txt.tmp-{}", std::process::id()));
        symlink(&victim, &tmp).unwrap();
        write_atomic(&dir.path().join("out.txt"), b"output").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        let probe = dir
            .path()
            .join(format!(".megatrain-write-test-{}", std::process::id()));
        symlink(&victim, &probe).unwrap();
        check_writable_dir(dir.path()).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }
}
