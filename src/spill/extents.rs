//! A checksummed extent store on spill files striped over directories (one per NVMe device).
//!
//! Extent i lives in file i mod n, with two slots: a write goes to the slot not holding the last
//! good copy and becomes current only when every byte of it is on disk, so a failed write (EIO,
//! ENOSPC, a crash) never destroys the last good copy. Each extent's crc32c is kept beside it and
//! checked on every read; a mismatch or a short read is an error naming file, offset and label.

use super::io::{EngineKind, IoEngine, Request};
use crate::{Error, Result};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

/// How to set up the store.
#[derive(Debug, Clone)]
pub struct SpillConfig {
    /// One directory per device; extents are striped over them.
    pub dirs: Vec<PathBuf>,
    /// Extent size in bytes (a multiple of 4 KiB).
    pub extent_bytes: usize,
    /// Extents the store holds.
    pub extents: usize,
    /// io_uring, the fallback, or automatic.
    pub engine: EngineKind,
    /// Try O_DIRECT (falls back to buffered I/O where refused, e.g. tmpfs).
    pub direct: bool,
    /// In-flight requests per batch.
    pub queue_depth: usize,
}

#[derive(Debug)]
struct SpillFile {
    path: PathBuf,
    file: std::fs::File,
}

/// The store.
#[derive(Debug)]
pub struct ExtentStore {
    files: Vec<SpillFile>,
    extent_bytes: usize,
    slot: Vec<u8>,
    crc: Vec<Option<u32>>,
    engine: IoEngine,
    /// One line per fallback taken (io_uring, O_DIRECT).
    pub warnings: Vec<String>,
    /// Test seam: fail the next write batch with this OS error after writing half of it.
    pub inject_write_error: Option<i32>,
}

impl ExtentStore {
    /// Create (or truncate) the spill files and preallocate them.
    pub fn create(cfg: &SpillConfig) -> Result<Self> {
        if cfg.dirs.is_empty() {
            return Err(Error::bad_input(
                "spill",
                "directories",
                "none given",
                Some("pass at least one --nvme DIR"),
            ));
        }
        if cfg.extent_bytes == 0 || !cfg.extent_bytes.is_multiple_of(4096) {
            return Err(Error::bad_input(
                "spill extent size",
                cfg.extent_bytes.to_string(),
                "must be a positive multiple of 4096",
                None,
            ));
        }
        let qd = cfg.queue_depth.max(1);
        let engine = IoEngine::new(cfg.engine, qd, qd, cfg.extent_bytes)?;
        let mut warnings: Vec<String> = engine
            .fallback_reason
            .iter()
            .map(|r| format!("spill I/O: {r}"))
            .collect();
        let n = cfg.dirs.len();
        let per_file = cfg.extents.div_ceil(n);
        let mut files = Vec::new();
        for (k, d) in cfg.dirs.iter().enumerate() {
            std::fs::create_dir_all(d).map_err(|e| Error::io("create spill directory", d, e))?;
            let path = d.join(format!("megatrain-spill-{k}.bin"));
            let open = |direct: bool| {
                let mut o = std::fs::OpenOptions::new();
                o.read(true).write(true).create(true).truncate(true);
                if direct {
                    o.custom_flags(libc::O_DIRECT);
                }
                o.open(&path)
            };
            let file = match open(cfg.direct) {
                Ok(f) => f,
                Err(e) if cfg.direct && e.raw_os_error() == Some(libc::EINVAL) => {
                    warnings.push(format!(
                        "spill I/O: O_DIRECT refused on {} (tmpfs?); using buffered I/O",
                        path.display()
                    ));
                    open(false).map_err(|e| Error::io("open spill file", &path, e))?
                }
                Err(e) => return Err(Error::io("open spill file", &path, e)),
            };
            let bytes = (per_file * 2 * cfg.extent_bytes) as libc::off_t;
            // SAFETY: fallocate on our own open file descriptor.
            if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, bytes) } != 0 {
                let e = std::io::Error::last_os_error();
                let fix = if e.raw_os_error() == Some(libc::ENOSPC) {
                    "free space on that device, add another --nvme directory, or spill less"
                } else {
                    "check the directory's filesystem and permissions"
                };
                return Err(Error::io("preallocate spill file", &path, e)
                    .with_fix(format!("{fix} (needs {} bytes)", bytes)));
            }
            files.push(SpillFile { path, file });
        }
        Ok(ExtentStore {
            files,
            extent_bytes: cfg.extent_bytes,
            slot: vec![0; cfg.extents],
            crc: vec![None; cfg.extents],
            engine,
            warnings,
            inject_write_error: None,
        })
    }

    /// True when io_uring is in use.
    pub fn uses_uring(&self) -> bool {
        self.engine.is_uring()
    }

    fn place(&self, extent: usize, slot: u8) -> (usize, u64) {
        let n = self.files.len();
        (
            extent % n,
            ((extent / n) * 2 + usize::from(slot)) as u64 * self.extent_bytes as u64,
        )
    }

    fn check_range(&self, first: usize, bytes: usize) -> Result<usize> {
        let count = bytes.div_ceil(self.extent_bytes);
        if first + count > self.slot.len() {
            return Err(Error::bad_input(
                "spill range",
                format!("extents {first}..{}", first + count),
                format!("the store holds {}", self.slot.len()),
                None,
            ));
        }
        Ok(count)
    }

    /// Write `data` to extents `first..`; `label` (e.g. "adam_m of layer 3") names it in errors.
    pub fn write(&mut self, first: usize, data: &[u8], label: &str) -> Result<()> {
        let count = self.check_range(first, data.len())?;
        let eb = self.extent_bytes;
        let batch = self.engine.buffers();
        for b0 in (0..count).step_by(batch) {
            let b1 = (b0 + batch).min(count);
            let mut reqs = Vec::new();
            let mut crcs = Vec::new();
            for (k, e) in (b0..b1).enumerate() {
                let src = &data[e * eb..((e + 1) * eb).min(data.len())];
                let buf = self.engine.buf(k);
                buf[..src.len()].copy_from_slice(src);
                buf[src.len()..].fill(0);
                crcs.push(crc32c::crc32c(buf));
                let (f, off) = self.place(first + e, 1 - self.slot[first + e]);
                reqs.push(Request {
                    fd: self.files[f].file.as_raw_fd(),
                    write: true,
                    offset: off,
                    buf: k,
                    len: eb,
                });
            }
            let mut results = self.engine.run(
                &reqs[..if self.inject_write_error.is_some() {
                    reqs.len().div_ceil(2)
                } else {
                    reqs.len()
                }],
            );
            if let Some(errno) = self.inject_write_error.take() {
                results.resize_with(reqs.len(), || Err(std::io::Error::from_raw_os_error(errno)));
            }
            for (k, r) in results.into_iter().enumerate() {
                let (f, off) = self.place(first + b0 + k, 1 - self.slot[first + b0 + k]);
                let path = &self.files[f].path;
                match r {
                    Ok(n) if n == eb => {}
                    Ok(n) => {
                        return Err(Error::io(
                            "write spill extent",
                            path,
                            std::io::Error::other(format!(
                                "short write of {n} of {eb} bytes at offset {off} ({label})"
                            )),
                        ))
                    }
                    Err(e) => {
                        let fix = if e.raw_os_error() == Some(libc::ENOSPC) {
                            "free space or add a spill directory; the previous copy is intact"
                        } else {
                            "check the device; the previous copy is intact"
                        };
                        return Err(Error::io(
                            "write spill extent",
                            path,
                            std::io::Error::new(e.kind(), format!("{e} at offset {off} ({label})")),
                        )
                        .with_fix(fix));
                    }
                }
            }
            // Every extent of the batch is written: make the new copies current.
            for (k, c) in crcs.into_iter().enumerate() {
                let e = first + b0 + k;
                self.slot[e] = 1 - self.slot[e];
                self.crc[e] = Some(c);
            }
        }
        Ok(())
    }

    /// Read extents `first..` into `out`, verifying every checksum.
    pub fn read(&mut self, first: usize, out: &mut [u8], label: &str) -> Result<()> {
        let count = self.check_range(first, out.len())?;
        let eb = self.extent_bytes;
        let batch = self.engine.buffers();
        for b0 in (0..count).step_by(batch) {
            let b1 = (b0 + batch).min(count);
            let mut reqs = Vec::new();
            for (k, e) in (b0..b1).enumerate() {
                let (f, off) = self.place(first + e, self.slot[first + e]);
                reqs.push(Request {
                    fd: self.files[f].file.as_raw_fd(),
                    write: false,
                    offset: off,
                    buf: k,
                    len: eb,
                });
            }
            let results = self.engine.run(&reqs);
            for (k, r) in results.into_iter().enumerate() {
                let e = first + b0 + k;
                let (f, off) = self.place(e, self.slot[e]);
                let path = self.files[f].path.clone();
                let err = |why: String| {
                    Error::io(
                        "read spill extent",
                        &path,
                        std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            format!("{why} at offset {off} ({label})"),
                        ),
                    )
                };
                match r {
                    Ok(n) if n == eb => {}
                    Ok(n) => return Err(err(format!("short read of {n} of {eb} bytes"))),
                    Err(x) => return Err(err(x.to_string())),
                }
                let buf = self.engine.buf(k);
                match self.crc[e] {
                    Some(c) if c == crc32c::crc32c(buf) => {}
                    Some(_) => {
                        return Err(err("crc32c mismatch: the spill file is corrupt".into()))
                    }
                    None => return Err(err("extent was never written".into())),
                }
                let end = ((b0 + k + 1) * eb).min(out.len());
                let dst = &mut out[(b0 + k) * eb..end];
                let n = dst.len();
                dst.copy_from_slice(&buf[..n]);
            }
        }
        Ok(())
    }

    /// Durability point: fdatasync every spill file.
    pub fn sync(&self) -> Result<()> {
        for f in &self.files {
            // SAFETY: fdatasync on our own descriptor.
            if unsafe { libc::fdatasync(f.file.as_raw_fd()) } != 0 {
                return Err(Error::io(
                    "fdatasync spill file",
                    &f.path,
                    std::io::Error::last_os_error(),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(dirs: Vec<PathBuf>, engine: EngineKind) -> SpillConfig {
        SpillConfig {
            dirs,
            extent_bytes: 64 << 10,
            extents: 40,
            engine,
            direct: true,
            queue_depth: 8,
        }
    }

    fn data(n: usize, seed: u64) -> Vec<u8> {
        crate::util::uniform(n, seed, 1.0)
            .iter()
            .map(|x| (x.to_bits() >> 7) as u8)
            .collect()
    }

    #[test]
    fn round_trip_striped_with_both_engines_and_ragged_lengths() {
        for engine in [EngineKind::Auto, EngineKind::Sync] {
            let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
            let mut s =
                ExtentStore::create(&cfg(vec![a.path().into(), b.path().into()], engine)).unwrap();
            assert_eq!(
                s.uses_uring(),
                engine == EngineKind::Auto && crate::topology::linux::io_uring_status().available
            );
            let d1 = data(20 * (64 << 10) + 1234, 1); // 21 extents, the last partial
            s.write(3, &d1, "test").unwrap();
            let d2 = data(5 * (64 << 10), 2);
            s.write(30, &d2, "test").unwrap();
            let mut out = vec![0u8; d1.len()];
            s.read(3, &mut out, "test").unwrap();
            assert!(out == d1);
            // Overwrite: the other slot becomes current; reads see the new data.
            let d3 = data(d1.len(), 3);
            s.write(3, &d3, "test").unwrap();
            s.read(3, &mut out, "test").unwrap();
            assert!(out == d3);
            s.sync().unwrap();
        }
    }

    #[test]
    fn a_flipped_byte_is_detected_and_named() {
        let a = tempfile::tempdir().unwrap();
        let mut s = ExtentStore::create(&cfg(vec![a.path().into()], EngineKind::Auto)).unwrap();
        let d = data(2 * (64 << 10), 4);
        s.write(0, &d, "adam_v of layer 7").unwrap();
        let path = a.path().join("megatrain-spill-0.bin");
        // Extent 1's current copy: slot 1 (first write went to the slot after 0) at ((1*2)+1)*64K.
        let off = 3 * (64 << 10) + 100;
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[off] ^= 0x10;
        std::fs::write(&path, bytes).unwrap();
        let mut out = vec![0u8; d.len()];
        let e = s
            .read(0, &mut out, "adam_v of layer 7")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("crc32c")
                && e.contains("megatrain-spill-0.bin")
                && e.contains("layer 7")
                && e.contains("offset"),
            "{e}"
        );
    }

    #[test]
    fn a_failed_write_keeps_the_previous_copy() {
        let a = tempfile::tempdir().unwrap();
        let mut s = ExtentStore::create(&cfg(vec![a.path().into()], EngineKind::Auto)).unwrap();
        let good = data(6 * (64 << 10), 5);
        s.write(0, &good, "m").unwrap();
        s.inject_write_error = Some(libc::ENOSPC);
        let e = s
            .write(0, &data(good.len(), 6), "adam_m of layer 2")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("No space left") && e.contains("layer 2") && e.contains("intact"),
            "{e}"
        );
        let mut out = vec![0u8; good.len()];
        s.read(0, &mut out, "m").unwrap();
        assert!(out == good, "the last good copy survives a failed write");
    }

    #[test]
    #[allow(clippy::print_stderr)]
    fn o_direct_refused_falls_back_to_buffered_with_a_warning() {
        let shm = std::path::Path::new("/dev/shm");
        if !shm.is_dir() {
            eprintln!("SKIP: no /dev/shm tmpfs to test the O_DIRECT fallback");
            return;
        }
        let d = tempfile::tempdir_in(shm).unwrap();
        let mut s = match ExtentStore::create(&cfg(vec![d.path().into()], EngineKind::Auto)) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        };
        let x = data(64 << 10, 7);
        s.write(0, &x, "t").unwrap();
        let mut out = vec![0u8; x.len()];
        s.read(0, &mut out, "t").unwrap();
        assert!(out == x);
        // Modern tmpfs accepts O_DIRECT; where it does not, the warning says so.
        assert!(
            s.warnings
                .iter()
                .all(|w| w.contains("O_DIRECT") || w.contains("io_uring")),
            "{:?}",
            s.warnings
        );
    }
}
