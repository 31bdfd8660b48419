//! Positional file I/O with a queue depth: io_uring, or — when io_uring is unavailable (ENOSYS,
//! EPERM, `kernel.io_uring_disabled`) or forced off — a pool of threads doing `pread`/`pwrite`.
//!
//! Requests point straight into the caller's memory (no bounce copy): with O_DIRECT that memory
//! and every length must be 4 KiB aligned. Memory registered with [`IoEngine::register`] is used
//! through `ReadFixed`/`WriteFixed` (the kernel skips pinning pages per request). [`IoEngine::run`]
//! keeps `queue_depth` requests in flight — each completion immediately makes room for the next
//! request, as fio does — and blocks in `io_uring_enter` while waiting (no busy polling).

use crate::{Error, Result};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Which engine to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// io_uring if it works here, else the fallback (with a warning).
    Auto,
    /// io_uring or an error.
    Uring,
    /// The pread/pwrite thread pool.
    Sync,
}

impl std::str::FromStr for EngineKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(EngineKind::Auto),
            "uring" | "io_uring" => Ok(EngineKind::Uring),
            "sync" | "pread" => Ok(EngineKind::Sync),
            _ => Err(Error::bad_input(
                "I/O engine",
                s,
                "unknown",
                Some("use auto, uring or sync"),
            )),
        }
    }
}

/// One request: `len` bytes at `addr` to or from `fd` at `offset`.
#[derive(Debug, Clone, Copy)]
pub struct Request {
    /// File descriptor.
    pub fd: RawFd,
    /// Write (else read).
    pub write: bool,
    /// Byte offset in the file.
    pub offset: u64,
    /// Memory the data goes to or comes from.
    pub addr: *mut u8,
    /// Bytes.
    pub len: usize,
}

/// Why [`IoEngine::register`] left the buffers unregistered (requests then use plain reads and
/// writes).
#[derive(Debug, thiserror::Error)]
pub enum NotRegistered {
    /// The thread-pool engine has no ring to register with.
    #[error("the fallback engine has no fixed buffers")]
    NoRing,
    /// More pieces than the kernel accepts.
    #[error("{pieces} pieces exceed the kernel's {MAX_FIXED} registered buffers")]
    TooManyPieces {
        /// Pieces the ranges were cut into.
        pieces: usize,
    },
    /// `io_uring_register(IORING_REGISTER_BUFFERS)` failed.
    #[error("register_buffers: {0} (memlock limit?)")]
    Refused(#[source] std::io::Error),
}

/// The engine: a ring (or the fallback's thread count) and the registered memory.
pub struct IoEngine {
    ring: Option<io_uring::IoUring>,
    /// Registered buffers as (start address, length), in registration order (= buffer index).
    fixed: Vec<(usize, usize)>,
    queue_depth: usize,
    /// Why the fallback is in use, if it is.
    pub fallback_reason: Option<String>,
}

impl std::fmt::Debug for IoEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoEngine")
            .field("uring", &self.ring.is_some())
            .field("fixed_buffers", &self.fixed.len())
            .field("queue_depth", &self.queue_depth)
            .finish()
    }
}

/// The kernel's limit on registered buffers per ring.
const MAX_FIXED: usize = 1 << 14;

impl IoEngine {
    /// A ring of `queue_depth` entries (or a fallback pool of that many threads, at most 32).
    pub fn new(kind: EngineKind, queue_depth: usize) -> Result<Self> {
        let queue_depth = queue_depth.max(1);
        let (ring, fallback_reason) = match kind {
            EngineKind::Sync => (None, Some("forced by configuration".to_owned())),
            EngineKind::Uring | EngineKind::Auto => {
                match io_uring::IoUring::new(queue_depth.next_power_of_two() as u32) {
                    Ok(r) => (Some(r), None),
                    Err(e) if kind == EngineKind::Auto => (
                        None,
                        Some(format!(
                            "io_uring unavailable ({e}); using pread/pwrite threads"
                        )),
                    ),
                    Err(e) => {
                        return Err(Error::system("io_uring", "set up a ring", e).with_fix(
                            "enable io_uring (sysctl kernel.io_uring_disabled=0, container \
                             seccomp) or choose the pread/pwrite engine",
                        ))
                    }
                }
            }
        };
        Ok(IoEngine {
            ring,
            fixed: Vec::new(),
            queue_depth,
            fallback_reason,
        })
    }

    /// True when io_uring is in use.
    pub fn is_uring(&self) -> bool {
        self.ring.is_some()
    }

    /// Requests kept in flight.
    pub fn queue_depth(&self) -> usize {
        self.queue_depth
    }

    /// Registered buffers in use.
    pub fn fixed_buffers(&self) -> usize {
        self.fixed.len()
    }

    /// Register `ranges`, each cut into pieces of `chunk` bytes, as the ring's fixed buffers.
    /// Best effort: returns why not (no ring, too many pieces, the memlock limit), in which case
    /// requests use plain reads and writes.
    ///
    /// # Safety
    /// The ranges must stay mapped until this engine is dropped.
    pub unsafe fn register(
        &mut self,
        ranges: &[(*mut u8, usize)],
        chunk: usize,
    ) -> std::result::Result<(), NotRegistered> {
        let Some(ring) = self.ring.as_ref() else {
            return Err(NotRegistered::NoRing);
        };
        let chunk = chunk.clamp(4096, 1 << 30);
        let mut iov = Vec::new();
        for &(p, len) in ranges {
            let mut off = 0;
            while off < len {
                let n = chunk.min(len - off);
                iov.push(libc::iovec {
                    // SAFETY: off < len: inside the caller's range.
                    iov_base: unsafe { p.add(off) }.cast(),
                    iov_len: n,
                });
                off += n;
            }
        }
        if iov.len() > MAX_FIXED {
            return Err(NotRegistered::TooManyPieces { pieces: iov.len() });
        }
        // SAFETY: the caller keeps the ranges mapped for the ring's life; the ring is dropped
        // before anything else in `Drop`.
        unsafe { ring.submitter().register_buffers(&iov) }.map_err(NotRegistered::Refused)?;
        self.fixed = iov
            .iter()
            .map(|v| (v.iov_base as usize, v.iov_len))
            .collect();
        Ok(())
    }

    fn fixed_index(&self, addr: *mut u8, len: usize) -> Option<u16> {
        let a = addr as usize;
        // Pieces are registered in address order within a range, ranges in the caller's order:
        // a linear scan over ≤16k entries is cheap next to the I/O itself, but binary search
        // covers the common sorted case.
        let i = self.fixed.partition_point(|&(s, _)| s <= a);
        let hit = |j: usize| {
            let (s, l) = self.fixed[j];
            (s <= a && a + len <= s + l).then_some(j as u16)
        };
        if i > 0 {
            if let Some(j) = hit(i - 1) {
                return Some(j);
            }
        }
        (0..self.fixed.len()).find_map(hit)
    }

    /// Run `reqs` with up to `queue_depth` in flight. `before(i)` runs just before request i is
    /// submitted (fill or checksum its memory), `after(i, result)` once it completed (bytes
    /// transferred or the OS error). Returns when every request has completed.
    ///
    /// # Safety
    /// Every request's memory must be valid for `len` bytes (writable for reads) and untouched by
    /// anyone else from its `before` until its `after`.
    pub unsafe fn run(
        &mut self,
        reqs: &[Request],
        before: impl Fn(usize) + Sync,
        after: impl Fn(usize, std::io::Result<usize>) + Sync,
    ) {
        if self.ring.is_none() {
            self.run_threads(reqs, &before, &after);
            return;
        }
        let fixed: Vec<Option<u16>> = reqs
            .iter()
            .map(|r| self.fixed_index(r.addr, r.len))
            .collect();
        let qd = self.queue_depth;
        let Some(ring) = self.ring.as_mut() else {
            return;
        };
        let (mut next, mut inflight, mut done) = (0usize, 0usize, 0usize);
        while done < reqs.len() {
            while inflight < qd && next < reqs.len() {
                let r = &reqs[next];
                before(next);
                let fd = io_uring::types::Fd(r.fd);
                let e = match (r.write, fixed[next]) {
                    (true, Some(b)) => {
                        io_uring::opcode::WriteFixed::new(fd, r.addr, r.len as u32, b)
                            .offset(r.offset)
                            .build()
                    }
                    (false, Some(b)) => {
                        io_uring::opcode::ReadFixed::new(fd, r.addr, r.len as u32, b)
                            .offset(r.offset)
                            .build()
                    }
                    (true, None) => io_uring::opcode::Write::new(fd, r.addr, r.len as u32)
                        .offset(r.offset)
                        .build(),
                    (false, None) => io_uring::opcode::Read::new(fd, r.addr, r.len as u32)
                        .offset(r.offset)
                        .build(),
                };
                // SAFETY: the entry points at memory the caller keeps valid and untouched until
                // its completion is reaped below (this function's contract).
                if unsafe { ring.submission().push(&e.user_data(next as u64)) }.is_err() {
                    break; // queue full: reap first
                }
                inflight += 1;
                next += 1;
            }
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                    ) =>
                {
                    if e.raw_os_error() != Some(libc::EINTR) {
                        std::thread::sleep(std::time::Duration::from_micros(50));
                    }
                }
                Err(e) => {
                    // The ring refuses more work: fail what was never submitted and keep reaping
                    // what is in flight (its memory must not be released before it completes).
                    for i in next..reqs.len() {
                        after(
                            i,
                            Err(std::io::Error::new(e.kind(), format!("not submitted: {e}"))),
                        );
                        done += 1;
                    }
                    next = reqs.len();
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            for cqe in ring.completion() {
                let i = cqe.user_data() as usize;
                // A short transfer of our preallocated files means EOF or a device problem: the
                // caller checks the byte count and reports it with file and offset.
                after(i, completion_result(cqe.result()));
                inflight -= 1;
                done += 1;
            }
        }
    }

    fn run_threads(
        &self,
        reqs: &[Request],
        before: &(impl Fn(usize) + Sync),
        after: &(impl Fn(usize, std::io::Result<usize>) + Sync),
    ) {
        struct Reqs<'a>(&'a [Request]);
        // SAFETY: the raw addresses are only dereferenced by the kernel inside pread/pwrite, each
        // request by exactly one thread; the caller guarantees validity (see `run`).
        unsafe impl Sync for Reqs<'_> {}
        let shared = Reqs(reqs);
        let next = AtomicUsize::new(0);
        let threads = self.queue_depth.min(32).min(reqs.len()).max(1);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    let reqs = &shared;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(r) = reqs.0.get(i) else { break };
                        before(i);
                        after(i, pio(r));
                    }
                });
            }
        });
    }
}

fn completion_result(r: i32) -> std::io::Result<usize> {
    if r < 0 {
        Err(std::io::Error::from_raw_os_error(-r))
    } else {
        Ok(r as usize)
    }
}

/// One whole pread/pwrite (retrying EINTR and partial transfers).
fn pio(r: &Request) -> std::io::Result<usize> {
    let mut done = 0usize;
    while done < r.len {
        // SAFETY: addr..addr+len is valid per `run`'s contract; this thread alone uses it.
        let n = unsafe {
            let p = r.addr.add(done);
            let off = (r.offset + done as u64) as libc::off_t;
            if r.write {
                libc::pwrite(r.fd, p.cast(), r.len - done, off)
            } else {
                libc::pread(r.fd, p.cast(), r.len - done, off)
            }
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            break; // EOF
        }
        done += n as usize;
    }
    Ok(done)
}

impl Drop for IoEngine {
    fn drop(&mut self) {
        // The ring (and its buffer registration) goes first.
        self.ring = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::{Region, RegionSpec};
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    use std::sync::Mutex;

    fn region(bytes: usize) -> Region {
        Region::allocate(RegionSpec::scratch("io test", bytes)).unwrap()
    }

    /// Both engines, registered and not, O_DIRECT: write 64 blocks, read them back.
    #[test]
    fn sliding_window_round_trip_on_every_engine() {
        let bs = 16 << 10;
        let n = 64;
        let src = region(n * bs);
        let dst = region(n * bs);
        // SAFETY: fresh regions of n·bs bytes.
        let (s, d) = unsafe {
            (
                std::slice::from_raw_parts_mut(src.as_ptr(), n * bs),
                std::slice::from_raw_parts_mut(dst.as_ptr(), n * bs),
            )
        };
        for (i, b) in s.iter_mut().enumerate() {
            *b = (i * 7 + i / 4096) as u8;
        }
        for (kind, register) in [
            (EngineKind::Auto, true),
            (EngineKind::Auto, false),
            (EngineKind::Sync, false),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .custom_flags(libc::O_DIRECT)
                .open(dir.path().join("f"))
                .unwrap();
            let mut e = IoEngine::new(kind, 8).unwrap();
            if register && e.is_uring() {
                // SAFETY: both regions outlive `e`.
                unsafe { e.register(&[(src.as_ptr(), n * bs), (dst.as_ptr(), n * bs)], bs) }
                    .unwrap();
                assert_eq!(e.fixed_buffers(), 2 * n);
                assert_eq!(e.fixed_index(dst.as_ptr(), bs), Some(n as u16));
            }
            d.fill(0);
            let mk = |write: bool, base: *mut u8| -> Vec<Request> {
                (0..n)
                    .map(|i| Request {
                        fd: f.as_raw_fd(),
                        write,
                        // Reverse file order: offsets and addresses are independent.
                        offset: ((n - 1 - i) * bs) as u64,
                        // SAFETY: i < n: inside the region.
                        addr: unsafe { base.add(i * bs) },
                        len: bs,
                    })
                    .collect()
            };
            let results = Mutex::new(vec![0usize; n]);
            // SAFETY: regions stay valid; nobody else touches them during the run.
            unsafe {
                e.run(
                    &mk(true, src.as_ptr()),
                    |_| {},
                    |i, r| results.lock().unwrap()[i] = r.unwrap(),
                );
                e.run(
                    &mk(false, dst.as_ptr()),
                    |_| {},
                    |i, r| results.lock().unwrap()[i] = r.unwrap(),
                );
            }
            assert!(results.lock().unwrap().iter().all(|&x| x == bs));
            assert!(s == d, "{kind:?} registered={register}");
        }
    }
}
