//! A checksummed extent store on spill files striped over directories (one per NVMe device).
//!
//! Extent i lives in file i mod n, with two copies: a write goes to the copy not holding the last
//! good copy and becomes current only when every byte of it is on disk, so a failed write (EIO,
//! ENOSPC, a crash) never destroys the last good copy. Each extent's crc32c is kept beside it and
//! checked on every read; a mismatch or a short read is an error naming file, offset and label.

use super::io::{EngineKind, IoEngine, Request};
use crate::{Error, Result};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

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
    /// Names this run's files (`megatrain-spill-{id}-{k}.bin`); `None`: a fresh random id.
    pub run_id: Option<String>,
}

/// Spill files are named `megatrain-spill-{run id}-{k}.bin`.
pub const FILE_PREFIX: &str = "megatrain-spill-";

/// A spill file: created by this store, locked (`flock`) while open, deleted when dropped.
#[derive(Debug)]
struct SpillFile {
    path: PathBuf,
    file: std::fs::File,
}

impl Drop for SpillFile {
    fn drop(&mut self) {
        // Scratch: the training state is in the checkpoints, never only here.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Delete the spill files in `dir` that no live process holds (left by a run that was killed);
/// one note per file removed. A file another run holds locked is left alone.
fn remove_stale_files(dir: &std::path::Path) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut notes = Vec::new();
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(FILE_PREFIX) else {
            continue;
        };
        // Only this version's names: {16 hex}-{k}.bin.
        let ours = rest.len() > 17
            && rest.as_bytes()[16] == b'-'
            && rest[..16].bytes().all(|b| b.is_ascii_hexdigit())
            && rest.ends_with(".bin");
        if !ours {
            continue;
        }
        let path = e.path();
        let Ok(f) = std::fs::OpenOptions::new().read(true).open(&path) else {
            continue;
        };
        if crate::util::lock::try_flock(&f).unwrap_or(false) {
            let size = f.metadata().map(|m| m.len()).unwrap_or(0);
            if std::fs::remove_file(&path).is_ok() {
                notes.push(format!(
                    "spill: removed {} ({}), left by a run that is gone",
                    path.display(),
                    crate::util::human_bytes(size)
                ));
            }
        }
    }
    notes
}

/// The store.
#[derive(Debug)]
pub struct ExtentStore {
    files: Vec<SpillFile>,
    extent_bytes: usize,
    direct: bool,
    /// Which of its two on-disk copies (0 or 1) holds each extent's current data.
    current: Vec<u8>,
    /// crc32c and byte length of each extent's current copy (`None`: never written).
    crc: Vec<Option<(u32, u32)>>,
    engine: IoEngine,
    /// One line per fallback taken (io_uring, O_DIRECT).
    pub warnings: Vec<String>,
    /// Test seam: fail the second half of the next write with this OS error.
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
        let engine = IoEngine::new(cfg.engine, cfg.queue_depth.max(1))?;
        let mut warnings: Vec<String> = engine
            .fallback_reason
            .iter()
            .map(|r| format!("spill I/O: {r}"))
            .collect();
        let n = cfg.dirs.len();
        let per_file = cfg.extents.div_ceil(n);
        let id = cfg
            .run_id
            .clone()
            .unwrap_or_else(crate::util::lock::random_id);
        let mut files: Vec<SpillFile> = Vec::new();
        let mut direct = cfg.direct;
        for (k, d) in cfg.dirs.iter().enumerate() {
            std::fs::create_dir_all(d).map_err(|e| Error::io("create spill directory", d, e))?;
            warnings.extend(remove_stale_files(d));
            let path = d.join(format!("{FILE_PREFIX}{id}-{k}.bin"));
            let bytes = (per_file * 2 * cfg.extent_bytes) as u64;
            let free = crate::util::free_space(d)?;
            if free < bytes {
                return Err(Error::bad_input(
                    "spill directory",
                    d.display().to_string(),
                    format!(
                        "the spill file needs {} but the filesystem has {} free",
                        crate::util::human_bytes(bytes),
                        crate::util::human_bytes(free)
                    ),
                    Some("free space on that device, add another --nvme directory, or raise --ram-budget so less spills"),
                ));
            }
            let open = |direct: bool| {
                let mut o = std::fs::OpenOptions::new();
                // A new file only: another run's file is never truncated.
                o.read(true).write(true).create_new(true);
                if direct {
                    o.custom_flags(libc::O_DIRECT);
                }
                o.open(&path)
            };
            let file = match open(direct) {
                Ok(f) => f,
                Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
                    warnings.push(format!(
                        "spill I/O: O_DIRECT refused on {} (tmpfs?); using buffered I/O",
                        path.display()
                    ));
                    direct = false;
                    // Files opened earlier keep O_DIRECT; that is fine, alignment is kept anyway.
                    let _ = std::fs::remove_file(&path);
                    open(false).map_err(|e| Error::io("create spill file", &path, e))?
                }
                Err(e) => return Err(Error::io("create spill file", &path, e)),
            };
            // From here the file is ours: dropped (and deleted) with `files` on any error.
            files.push(SpillFile {
                path: path.clone(),
                file,
            });
            let file = &files[k].file;
            if !crate::util::lock::try_flock(file).map_err(|e| Error::io("lock", &path, e))? {
                return Err(Error::system(
                    "spill",
                    format!("lock {}", path.display()),
                    "a file this run just created is locked by another process",
                ));
            }
            // SAFETY: fallocate on our own open file descriptor.
            if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, bytes as libc::off_t) } != 0 {
                let e = std::io::Error::last_os_error();
                let fix = if e.raw_os_error() == Some(libc::ENOSPC) {
                    "free space on that device, add another --nvme directory, or spill less"
                } else {
                    "check the directory's filesystem and permissions"
                };
                return Err(Error::io("preallocate spill file", &path, e)
                    .with_fix(format!("{fix} (needs {})", crate::util::human_bytes(bytes))));
            }
        }
        Ok(ExtentStore {
            files,
            extent_bytes: cfg.extent_bytes,
            direct,
            current: vec![0; cfg.extents],
            crc: vec![None; cfg.extents],
            engine,
            warnings,
            inject_write_error: None,
        })
    }

    /// Bytes the spill files occupy on disk (their preallocated blocks).
    pub fn disk_bytes(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        self.files
            .iter()
            .filter_map(|f| f.file.metadata().ok())
            .map(|m| m.blocks() * 512)
            .sum()
    }

    /// The spill files.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.files.iter().map(|f| f.path.clone()).collect()
    }

    /// True when io_uring is in use.
    pub fn uses_uring(&self) -> bool {
        self.engine.is_uring()
    }

    /// True when every spill file uses O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Extent size in bytes.
    pub fn extent_bytes(&self) -> usize {
        self.extent_bytes
    }

    /// Register memory the store reads into and writes from (staging) as fixed buffers, cut at
    /// extent boundaries. Best effort; returns why not.
    ///
    /// # Safety
    /// The ranges must stay mapped for the store's life.
    pub unsafe fn register(
        &mut self,
        ranges: &[(*mut u8, usize)],
    ) -> std::result::Result<(), super::io::NotRegistered> {
        // SAFETY: forwarded contract.
        unsafe { self.engine.register(ranges, self.extent_bytes) }
    }

    fn place(&self, extent: usize, copy: u8) -> (usize, u64) {
        let n = self.files.len();
        (
            extent % n,
            ((extent / n) * 2 + usize::from(copy)) as u64 * self.extent_bytes as u64,
        )
    }

    fn check_range(&self, first: usize, addr: *const u8, bytes: usize) -> Result<usize> {
        let count = bytes.div_ceil(self.extent_bytes);
        if first + count > self.current.len() {
            return Err(Error::bad_input(
                "spill range",
                format!("extents {first}..{}", first + count),
                format!("the store holds {}", self.current.len()),
                None,
            ));
        }
        if !(addr as usize).is_multiple_of(4096) || !bytes.is_multiple_of(4096) {
            return Err(Error::system(
                "spill",
                "direct I/O",
                format!("buffer at {addr:p} of {bytes} bytes is not 4 KiB aligned"),
            ));
        }
        Ok(count)
    }

    fn chunk(&self, e: usize, total: usize) -> (usize, usize) {
        let start = e * self.extent_bytes;
        (start, self.extent_bytes.min(total - start))
    }

    /// Write `data` (4 KiB aligned, a multiple of 4 KiB) to extents `first..`; `label` (e.g.
    /// "adam_m of layer 3") names it in errors. Each extent goes to its spare copy and becomes
    /// current only once the whole call succeeded.
    pub fn write(&mut self, first: usize, data: &[u8], label: &str) -> Result<()> {
        let count = self.check_range(first, data.as_ptr(), data.len())?;
        let mut reqs = Vec::with_capacity(count);
        for e in 0..count {
            let (start, len) = self.chunk(e, data.len());
            let (f, off) = self.place(first + e, 1 - self.current[first + e]);
            reqs.push(Request {
                fd: self.files[f].file.as_raw_fd(),
                write: true,
                offset: off,
                // The kernel only reads through this pointer for a write.
                addr: data[start..].as_ptr().cast_mut(),
                len,
            });
        }
        let crcs: Vec<AtomicU32> = (0..count).map(|_| AtomicU32::new(0)).collect();
        let results: Mutex<Vec<Option<std::io::Result<usize>>>> =
            Mutex::new((0..count).map(|_| None).collect());
        let run = match self.inject_write_error {
            Some(_) => count.div_ceil(2),
            None => count,
        };
        let eb = self.extent_bytes;
        // SAFETY: `data` is borrowed for the whole call (valid, not mutated by anyone).
        unsafe {
            self.engine.run(
                &reqs[..run],
                |i| {
                    let (start, len) = (i * eb, eb.min(data.len() - i * eb));
                    crcs[i].store(crc32c::crc32c(&data[start..start + len]), Ordering::Relaxed);
                },
                |i, r| {
                    if let Ok(mut v) = results.lock() {
                        v[i] = Some(r);
                    }
                },
            );
        }
        let mut results = results.into_inner().unwrap_or_else(|e| e.into_inner());
        if let Some(errno) = self.inject_write_error.take() {
            for r in results.iter_mut().skip(run) {
                *r = Some(Err(std::io::Error::from_raw_os_error(errno)));
            }
        }
        for (k, r) in results.into_iter().enumerate() {
            let (f, off) = self.place(first + k, 1 - self.current[first + k]);
            let path = &self.files[f].path;
            let len = reqs[k].len;
            match r {
                Some(Ok(n)) if n == len => {}
                Some(Ok(n)) => {
                    return Err(Error::io(
                        "write spill extent",
                        path,
                        std::io::Error::other(format!(
                            "short write of {n} of {len} bytes at offset {off} ({label})"
                        )),
                    )
                    .with_fix("check the device and free space; the previous copy is intact"))
                }
                Some(Err(e)) => {
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
                None => {
                    return Err(Error::system(
                        "spill",
                        "write",
                        format!("no completion for {label} at offset {off}"),
                    ))
                }
            }
        }
        // Every extent is on disk: make the new copies current.
        for (k, c) in crcs.into_iter().enumerate() {
            let e = first + k;
            self.current[e] = 1 - self.current[e];
            self.crc[e] = Some((c.into_inner(), reqs[k].len as u32));
        }
        Ok(())
    }

    /// Read extents `first..` into `out` (4 KiB aligned, a multiple of 4 KiB), verifying every
    /// checksum.
    pub fn read(&mut self, first: usize, out: &mut [u8], label: &str) -> Result<()> {
        let count = self.check_range(first, out.as_ptr(), out.len())?;
        let total = out.len();
        let mut reqs = Vec::with_capacity(count);
        for e in 0..count {
            let (start, len) = self.chunk(e, total);
            let (f, off) = self.place(first + e, self.current[first + e]);
            reqs.push(Request {
                fd: self.files[f].file.as_raw_fd(),
                write: false,
                offset: off,
                addr: out[start..].as_mut_ptr(),
                len,
            });
        }
        for (k, r) in reqs.iter().enumerate() {
            match self.crc[first + k] {
                Some((_, l)) if l as usize == r.len => {}
                Some((_, l)) => {
                    return Err(self.read_error(
                        first + k,
                        label,
                        format!("extent holds {l} bytes, the read asks {}", r.len),
                    ))
                }
                None => return Err(self.read_error(first + k, label, "was never written".into())),
            }
        }
        let base = out.as_ptr() as usize;
        let spans: Vec<(usize, usize)> = reqs
            .iter()
            .map(|r| (r.addr as usize - base, r.len))
            .collect();
        let want: Vec<Option<(u32, u32)>> = self.crc[first..first + count].to_vec();
        let failures: Mutex<Vec<(usize, String)>> = Mutex::new(Vec::new());
        let after = |i: usize, r: std::io::Result<usize>| {
            let (start, len) = spans[i];
            let why = match r {
                Ok(n) if n == len => {
                    // SAFETY: the read completed; this range of `out` is ours until `run`
                    // returns and no other request overlaps it.
                    let got =
                        unsafe { std::slice::from_raw_parts((base + start) as *const u8, len) };
                    match want[i] {
                        Some((c, _)) if c == crc32c::crc32c(got) => None,
                        _ => Some("crc32c mismatch: the spill file is corrupt".to_owned()),
                    }
                }
                Ok(n) => Some(format!("short read of {n} of {len} bytes")),
                Err(e) => Some(e.to_string()),
            };
            if let (Some(w), Ok(mut f)) = (why, failures.lock()) {
                f.push((i, w));
            }
        };
        // SAFETY: `out` is exclusively borrowed for the whole call; requests cover disjoint
        // parts of it.
        unsafe { self.engine.run(&reqs, |_| {}, after) };
        let mut failures = failures.into_inner().unwrap_or_else(|e| e.into_inner());
        failures.sort();
        match failures.into_iter().next() {
            Some((i, why)) => Err(self.read_error(first + i, label, why)),
            None => Ok(()),
        }
    }

    fn read_error(&self, e: usize, label: &str, why: String) -> Error {
        let (f, off) = self.place(e, self.current[e]);
        Error::io(
            "read spill extent",
            &self.files[f].path,
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{why} at offset {off} ({label})"),
            ),
        )
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
    use crate::host::{Region, RegionSpec};

    fn cfg(dirs: Vec<PathBuf>, engine: EngineKind) -> SpillConfig {
        SpillConfig {
            dirs,
            extent_bytes: 64 << 10,
            extents: 40,
            engine,
            direct: true,
            queue_depth: 8,
            run_id: Some(ID.into()),
        }
    }

    const ID: &str = "00000000000000aa";

    /// Page-aligned random bytes (O_DIRECT needs aligned memory).
    pub(crate) struct Buf(Region, usize);

    impl Buf {
        pub(crate) fn new(n: usize, seed: u64) -> Buf {
            let r = Region::allocate(RegionSpec::scratch("test data", n)).unwrap();
            let mut b = Buf(r, n);
            for (d, x) in b.bytes().iter_mut().zip(crate::util::uniform(n, seed, 1.0)) {
                *d = (x.to_bits() >> 7) as u8;
            }
            b
        }
        pub(crate) fn bytes(&mut self) -> &mut [u8] {
            // SAFETY: the region holds ≥ n bytes and `&mut self` is exclusive.
            unsafe { std::slice::from_raw_parts_mut(self.0.as_ptr(), self.1) }
        }
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
            let mut d1 = Buf::new(20 * (64 << 10) + 3 * 4096, 1); // 21 extents, the last partial
            s.write(3, d1.bytes(), "test").unwrap();
            let mut d2 = Buf::new(5 * (64 << 10), 2);
            s.write(30, d2.bytes(), "test").unwrap();
            let mut out = Buf::new(d1.1, 9);
            s.read(3, out.bytes(), "test").unwrap();
            assert!(out.bytes() == d1.bytes());
            // Overwrite: the other copy becomes current; reads see the new data.
            let mut d3 = Buf::new(d1.1, 3);
            s.write(3, d3.bytes(), "test").unwrap();
            s.read(3, out.bytes(), "test").unwrap();
            assert!(out.bytes() == d3.bytes());
            s.sync().unwrap();
            // A read of a different length than was written is refused, not misread.
            let mut short = Buf::new(4096, 0);
            let e = s.read(23, short.bytes(), "tail").unwrap_err().to_string();
            assert!(e.contains("holds") && e.contains("tail"), "{e}");
        }
    }

    #[test]
    fn unaligned_buffers_are_refused() {
        let a = tempfile::tempdir().unwrap();
        let mut s = ExtentStore::create(&cfg(vec![a.path().into()], EngineKind::Auto)).unwrap();
        let mut d = Buf::new(3 * 4096, 1);
        let e = s.write(0, &d.bytes()[1..4097], "x").unwrap_err();
        assert!(e.to_string().contains("aligned"), "{e}");
    }

    #[test]
    fn a_flipped_byte_is_detected_and_named() {
        let a = tempfile::tempdir().unwrap();
        let mut s = ExtentStore::create(&cfg(vec![a.path().into()], EngineKind::Auto)).unwrap();
        let mut d = Buf::new(2 * (64 << 10), 4);
        s.write(0, d.bytes(), "adam_v of layer 7").unwrap();
        let path = a.path().join(format!("megatrain-spill-{ID}-0.bin"));
        // Extent 1's current copy: copy 1 (the first write went to the copy after 0) at ((1*2)+1)*64K.
        let off = 3 * (64 << 10) + 100;
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[off] ^= 0x10;
        std::fs::write(&path, bytes).unwrap();
        let mut out = Buf::new(d.1, 0);
        let e = s
            .read(0, out.bytes(), "adam_v of layer 7")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("crc32c")
                && e.contains(&format!("megatrain-spill-{ID}-0.bin"))
                && e.contains("layer 7")
                && e.contains(&format!("offset {}", 3 * (64 << 10))),
            "{e}"
        );
    }

    #[test]
    fn a_failed_write_keeps_the_previous_copy() {
        let a = tempfile::tempdir().unwrap();
        let mut s = ExtentStore::create(&cfg(vec![a.path().into()], EngineKind::Auto)).unwrap();
        let mut good = Buf::new(6 * (64 << 10), 5);
        s.write(0, good.bytes(), "m").unwrap();
        s.inject_write_error = Some(libc::ENOSPC);
        let e = s
            .write(0, Buf::new(good.1, 6).bytes(), "adam_m of layer 2")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("No space left") && e.contains("layer 2") && e.contains("intact"),
            "{e}"
        );
        let mut out = Buf::new(good.1, 0);
        s.read(0, out.bytes(), "m").unwrap();
        assert!(
            out.bytes() == good.bytes(),
            "the last good copy survives a failed write"
        );
    }

    #[test]
    fn preallocation_beyond_the_free_space_is_a_clear_error() {
        let a = tempfile::tempdir().unwrap();
        let mut c = cfg(vec![a.path().into()], EngineKind::Auto);
        c.extent_bytes = 1 << 30;
        c.extents = 1 << 16; // 128 TiB with both copies: more than any test machine's disk
        let e = ExtentStore::create(&c).unwrap_err().to_string();
        assert!(
            e.contains("needs 128.0 TiB")
                && e.contains("free")
                && e.contains(&a.path().display().to_string()),
            "{e}"
        );
        assert_eq!(
            std::fs::read_dir(a.path()).unwrap().count(),
            0,
            "nothing is left behind"
        );
    }

    /// Two stores (two runs) on one directory: each has its own locked file, neither
    /// truncates the other's, and each file is deleted when its store is dropped.
    #[test]
    fn two_runs_on_one_directory_keep_their_own_files() {
        let a = tempfile::tempdir().unwrap();
        let mut one = cfg(vec![a.path().into()], EngineKind::Auto);
        one.run_id = Some("1111111111111111".into());
        let mut two = one.clone();
        two.run_id = Some("2222222222222222".into());
        let mut s1 = ExtentStore::create(&one).unwrap();
        let mut d = Buf::new(2 * (64 << 10), 9);
        s1.write(0, d.bytes(), "m").unwrap();
        let s2 = ExtentStore::create(&two).unwrap();
        let mut out = Buf::new(d.1, 0);
        s1.read(0, out.bytes(), "m").unwrap();
        assert!(
            out.bytes() == d.bytes(),
            "the second run did not touch the first's file"
        );
        assert_eq!(std::fs::read_dir(a.path()).unwrap().count(), 2);
        // Reported bytes are what the disk holds: both copies of every extent, preallocated.
        assert!(
            s2.disk_bytes() >= 2 * 40 * (64 << 10),
            "{}",
            s2.disk_bytes()
        );
        let p1 = s1.paths();
        drop(s1);
        assert!(!p1[0].exists(), "a dropped store deletes its file");
        drop(s2);
        assert_eq!(std::fs::read_dir(a.path()).unwrap().count(), 0);
    }

    /// A file left by a killed run (no one holds its lock) is removed by the next store; a
    /// file another live store holds is not.
    #[test]
    fn stale_files_of_dead_runs_are_removed_and_live_ones_kept() {
        let a = tempfile::tempdir().unwrap();
        let stale = a.path().join("megatrain-spill-3333333333333333-0.bin");
        std::fs::write(&stale, vec![0u8; 8192]).unwrap();
        let mut live_cfg = cfg(vec![a.path().into()], EngineKind::Auto);
        live_cfg.run_id = Some("4444444444444444".into());
        let live = ExtentStore::create(&live_cfg).unwrap();
        assert!(!stale.exists(), "the dead run's file is gone");
        assert!(live
            .warnings
            .iter()
            .any(|w| w.contains("left by a run that is gone")));
        let s = ExtentStore::create(&cfg(vec![a.path().into()], EngineKind::Auto)).unwrap();
        assert!(live.paths()[0].exists(), "a live run's file is kept");
        drop((s, live));
    }

    #[test]
    #[allow(clippy::print_stderr)]
    fn buffered_io_when_o_direct_is_off_or_refused() {
        // The config switch forces buffered I/O on any filesystem.
        let a = tempfile::tempdir().unwrap();
        let mut c = cfg(vec![a.path().into()], EngineKind::Auto);
        c.direct = false;
        let mut s = ExtentStore::create(&c).unwrap();
        assert!(!s.is_direct());
        let mut x = Buf::new(64 << 10, 7);
        s.write(0, x.bytes(), "t").unwrap();
        let mut out = Buf::new(x.1, 0);
        s.read(0, out.bytes(), "t").unwrap();
        assert!(out.bytes() == x.bytes());
        // tmpfs: modern kernels accept O_DIRECT there; where refused, the warning says so.
        let shm = std::path::Path::new("/dev/shm");
        if !shm.is_dir() {
            eprintln!("SKIP (part): no /dev/shm tmpfs to try O_DIRECT on");
            return;
        }
        let d = tempfile::tempdir_in(shm).unwrap();
        let mut s = ExtentStore::create(&cfg(vec![d.path().into()], EngineKind::Auto)).unwrap();
        s.write(0, x.bytes(), "t").unwrap();
        s.read(0, out.bytes(), "t").unwrap();
        assert!(out.bytes() == x.bytes());
        assert!(
            s.warnings
                .iter()
                .all(|w| w.contains("O_DIRECT") || w.contains("io_uring")),
            "{:?}",
            s.warnings
        );
        assert_eq!(
            s.is_direct(),
            !s.warnings.iter().any(|w| w.contains("O_DIRECT"))
        );
    }
}
