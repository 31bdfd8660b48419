//! The NVMe tier (in progress): batched io_uring I/O with registered buffers and a pread/pwrite
//! fallback ([`io`]), and a checksummed, double-slotted extent store striped over directories
//! ([`extents`]). Not yet wired into the host store or the trainer.

pub mod extents;
pub mod io;
