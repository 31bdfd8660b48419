//! Batched positional file I/O: io_uring with registered (fixed) buffers, or — when io_uring is
//! unavailable (ENOSYS, EPERM, `kernel.io_uring_disabled`) or forced off — a plain
//! `pread`/`pwrite` loop on the calling thread. One batch is submitted at once and the caller
//! blocks until every completion arrives (no busy-waiting).

use crate::host::{PageKind, Region, RegionSpec};
use crate::{Error, Result};
use std::os::fd::RawFd;

/// Which engine to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    /// io_uring if it works here, else the fallback (with a warning).
    Auto,
    /// io_uring or an error.
    Uring,
    /// The pread/pwrite fallback.
    Sync,
}

/// One request of a batch: `len` bytes of staging buffer `buf` to or from `fd` at `offset`.
#[derive(Debug, Clone, Copy)]
pub struct Request {
    /// File descriptor.
    pub fd: RawFd,
    /// Write (else read).
    pub write: bool,
    /// Byte offset in the file.
    pub offset: u64,
    /// Staging buffer index.
    pub buf: usize,
    /// Bytes.
    pub len: usize,
}

/// The engine plus its staging buffers (page-aligned, registered with the ring).
pub struct IoEngine {
    ring: Option<io_uring::IoUring>,
    buffers: Vec<Region>,
    buf_bytes: usize,
    queue_depth: usize,
    /// Why the fallback is in use, if it is.
    pub fallback_reason: Option<String>,
}

impl std::fmt::Debug for IoEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoEngine")
            .field("uring", &self.ring.is_some())
            .field("buffers", &self.buffers.len())
            .field("buf_bytes", &self.buf_bytes)
            .field("queue_depth", &self.queue_depth)
            .finish()
    }
}

impl IoEngine {
    /// `buffers` staging buffers of `buf_bytes` each, and a ring of `queue_depth` entries.
    pub fn new(
        kind: EngineKind,
        queue_depth: usize,
        buffers: usize,
        buf_bytes: usize,
    ) -> Result<Self> {
        let mut bufs = Vec::with_capacity(buffers);
        for i in 0..buffers {
            bufs.push(Region::allocate(RegionSpec {
                label: format!("I/O staging buffer {i}"),
                bytes: buf_bytes,
                node: None,
                prefault_cpus: Vec::new(),
                pages: PageKind::Transparent,
                lock: false,
            })?);
        }
        let (ring, fallback_reason) = match kind {
            EngineKind::Sync => (None, Some("forced by configuration".to_owned())),
            EngineKind::Uring | EngineKind::Auto => match Self::ring(queue_depth, &bufs) {
                Ok(r) => (Some(r), None),
                Err(e) if kind == EngineKind::Auto => (None, Some(format!("io_uring unavailable ({e}); using pread/pwrite"))),
                Err(e) => {
                    return Err(Error::system("io_uring", "set up a ring", e).with_fix(
                        "enable io_uring (sysctl kernel.io_uring_disabled=0, container seccomp) or use the pread/pwrite fallback",
                    ))
                }
            },
        };
        Ok(IoEngine {
            ring,
            buffers: bufs,
            buf_bytes,
            queue_depth: queue_depth.max(1),
            fallback_reason,
        })
    }

    fn ring(qd: usize, bufs: &[Region]) -> std::io::Result<io_uring::IoUring> {
        let ring = io_uring::IoUring::new(qd.next_power_of_two() as u32)?;
        let iov: Vec<libc::iovec> = bufs
            .iter()
            .map(|b| libc::iovec {
                iov_base: b.as_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        // SAFETY: the buffers live in `self.buffers` for as long as the ring (both are dropped
        // together, the ring first: field order in IoEngine).
        unsafe { ring.submitter().register_buffers(&iov)? };
        Ok(ring)
    }

    /// True when io_uring is in use.
    pub fn is_uring(&self) -> bool {
        self.ring.is_some()
    }

    /// Bytes per staging buffer.
    pub fn buf_bytes(&self) -> usize {
        self.buf_bytes
    }

    /// Staging buffers.
    pub fn buffers(&self) -> usize {
        self.buffers.len()
    }

    /// Staging buffer `i`.
    pub fn buf(&mut self, i: usize) -> &mut [u8] {
        let b = &self.buffers[i];
        // SAFETY: the region is ours, `&mut self` is exclusive, and no I/O is in flight outside
        // `run` (which returns only after every completion).
        unsafe { std::slice::from_raw_parts_mut(b.as_ptr(), self.buf_bytes) }
    }

    /// Run a batch; one result per request (bytes transferred, or the OS error).
    pub fn run(&mut self, reqs: &[Request]) -> Vec<std::io::Result<usize>> {
        for r in reqs {
            assert!(
                r.buf < self.buffers.len() && r.len <= self.buf_bytes,
                "request outside the staging buffers"
            );
        }
        match self.ring.as_mut() {
            None => reqs
                .iter()
                .map(|r| {
                    let p = self.buffers[r.buf].as_ptr();
                    // SAFETY: p..p+len is inside our staging buffer (asserted above).
                    let n = unsafe {
                        if r.write {
                            libc::pwrite(r.fd, p.cast(), r.len, r.offset as libc::off_t)
                        } else {
                            libc::pread(r.fd, p.cast(), r.len, r.offset as libc::off_t)
                        }
                    };
                    if n < 0 {
                        Err(std::io::Error::last_os_error())
                    } else {
                        Ok(n as usize)
                    }
                })
                .collect(),
            Some(ring) => {
                let mut out: Vec<Option<std::io::Result<usize>>> =
                    (0..reqs.len()).map(|_| None).collect();
                for chunk_start in (0..reqs.len()).step_by(self.queue_depth) {
                    let chunk =
                        &reqs[chunk_start..(chunk_start + self.queue_depth).min(reqs.len())];
                    for (k, r) in chunk.iter().enumerate() {
                        let p = self.buffers[r.buf].as_ptr();
                        let fd = io_uring::types::Fd(r.fd);
                        let e = if r.write {
                            io_uring::opcode::WriteFixed::new(fd, p, r.len as u32, r.buf as u16)
                                .offset(r.offset)
                                .build()
                        } else {
                            io_uring::opcode::ReadFixed::new(fd, p, r.len as u32, r.buf as u16)
                                .offset(r.offset)
                                .build()
                        };
                        // SAFETY: the entry points into a registered staging buffer that stays
                        // alive and untouched until its completion is reaped below.
                        if unsafe {
                            ring.submission()
                                .push(&e.user_data((chunk_start + k) as u64))
                        }
                        .is_err()
                        {
                            out[chunk_start + k] =
                                Some(Err(std::io::Error::other("submission queue full")));
                        }
                    }
                    let want = chunk.len();
                    let mut got = 0;
                    while got < want {
                        if let Err(e) = ring.submit_and_wait(want - got) {
                            if e.raw_os_error() == Some(libc::EINTR) {
                                continue;
                            }
                            for o in out
                                .iter_mut()
                                .skip(chunk_start)
                                .take(want)
                                .filter(|o| o.is_none())
                            {
                                *o = Some(Err(std::io::Error::new(e.kind(), e.to_string())));
                            }
                            break;
                        }
                        for cqe in ring.completion() {
                            let i = cqe.user_data() as usize;
                            let r = cqe.result();
                            out[i] = Some(if r < 0 {
                                Err(std::io::Error::from_raw_os_error(-r))
                            } else {
                                Ok(r as usize)
                            });
                            got += 1;
                        }
                    }
                }
                out.into_iter()
                    .map(|o| o.unwrap_or_else(|| Err(std::io::Error::other("no completion"))))
                    .collect()
            }
        }
    }
}

impl Drop for IoEngine {
    fn drop(&mut self) {
        // The ring (and its buffer registration) goes before the buffers it points into.
        self.ring = None;
    }
}
