//! The NVMe tier: positional I/O with a queue depth on io_uring (registered buffers) or a
//! pread/pwrite thread pool ([`io`]); a checksummed, double-copied extent store striped over
//! directories ([`extents`]); and the tier the host store keeps spilled shards in, staged through
//! a bounded set of RAM staging slots by one I/O thread ([`tier`]).

pub mod extents;
pub mod io;
pub mod tier;
