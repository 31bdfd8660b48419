//! The gradients' sum of ranks that all run on one host, through memory every rank maps (an
//! MPI-3 shared window, `MPI_Win_allocate_shared`): each rank copies its chunk into its own
//! segment, adds its slice of every rank's segment in rank order into its own, and copies every
//! summed slice back. That is DRAM traffic at the cores' speed, where MPI's messages between
//! processes of one host go through the library's own buffers (1–2 GB/s of bus bandwidth
//! measured on a 16-core host, its `MPI_Allreduce` 0.6). The sum is the same left fold in rank
//! order as [`super::sum_in_rank_order`], element by element: the same bits as the exchange
//! through MPI and as one process accumulating, for any number of threads.

use super::order::{slice_of, sum_in_rank_order};
use crate::{Error, Result};
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Communicator, SimpleCommunicator};
use rayon::prelude::*;
use std::ops::Range;
use std::os::raw::{c_int, c_void};

/// Elements a thread adds or copies at a time.
const BLOCK: usize = 1 << 14;

/// `r` in consecutive blocks of at most [`BLOCK`] elements.
fn blocks(r: Range<usize>) -> impl Iterator<Item = Range<usize>> {
    (r.start..r.end)
        .step_by(BLOCK)
        .map(move |a| a..(a + BLOCK).min(r.end))
}

/// Every rank's segment of one shared window, and the communicator of the ranks (the world's,
/// in its rank order).
pub(super) struct SharedSum {
    comm: SimpleCommunicator,
    win: ffi::MPI_Win,
    /// Every rank's segment, in rank order, `capacity` f32 each.
    segments: Vec<Segment>,
    capacity: usize,
    rank: usize,
}

impl std::fmt::Debug for SharedSum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SharedSum({} ranks, {} elements each)",
            self.segments.len(),
            self.capacity
        )
    }
}

/// An MPI return code as the crate's error.
fn check(rc: c_int, op: &str) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::system(
            "mpi",
            op.to_owned(),
            format!("error code {rc}"),
        ))
    }
}

/// A raw segment pointer that may cross to rayon's threads: each thread touches its own blocks
/// (see the SAFETY notes where it is used).
#[derive(Clone, Copy)]
struct Segment(*mut f32);
// SAFETY: the pointers name shared memory that lives as long as the window; which elements a
// thread reads or writes is fixed by the block it took, and the phases are separated by
// barriers (`SharedSum::phase`), so no element is written by one thread while another uses it.
unsafe impl Send for Segment {}
// SAFETY: as for `Send`.
unsafe impl Sync for Segment {}

impl Segment {
    /// The address of element `i` (taken through a method, so closures capture the `Segment`
    /// and not its raw pointer).
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

impl SharedSum {
    /// Map a window of `capacity` f32 per rank, when every rank of `world` runs on this host
    /// (`MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)` keeps them all together); `None` for a job
    /// across hosts, which exchanges through MPI. Collective over `world`: every rank calls it,
    /// and all come to the same answer.
    pub(super) fn map(world: &SimpleCommunicator, capacity: usize) -> Result<Option<SharedSum>> {
        let comm = world.split_shared(world.rank());
        if comm.size() != world.size() || world.size() < 2 {
            return Ok(None);
        }
        let bytes = ffi::MPI_Aint::try_from(capacity * 4)
            .map_err(|_| Error::internal("mpi", format!("a window of {capacity} f32")))?;
        let mut base: *mut f32 = std::ptr::null_mut();
        // SAFETY: MPI_WIN_NULL is a constant handle the library exports.
        let mut win = unsafe { ffi::RSMPI_WIN_NULL };
        // SAFETY: `base` receives a pointer and `win` a handle; `comm` is a live communicator
        // and MPI_INFO_NULL a constant. Collective over `comm`, which every rank calls here.
        let rc = unsafe {
            ffi::MPI_Win_allocate_shared(
                bytes,
                4,
                ffi::RSMPI_INFO_NULL,
                comm.as_raw(),
                (&raw mut base).cast::<c_void>(),
                &raw mut win,
            )
        };
        check(rc, "MPI_Win_allocate_shared")?;
        let mut segments = Vec::with_capacity(usize::try_from(comm.size()).unwrap_or(0));
        for r in 0..comm.size() {
            let (mut size, mut unit, mut at): (ffi::MPI_Aint, c_int, *mut f32) =
                (0, 0, std::ptr::null_mut());
            // SAFETY: `win` is the window just made; the three outputs are written.
            let rc = unsafe {
                ffi::MPI_Win_shared_query(
                    win,
                    r,
                    &raw mut size,
                    &raw mut unit,
                    (&raw mut at).cast::<c_void>(),
                )
            };
            check(rc, "MPI_Win_shared_query")?;
            if usize::try_from(size).ok() != Some(capacity * 4) || at.is_null() {
                return Err(Error::internal(
                    "mpi",
                    format!(
                        "rank {r}'s shared segment is {size} bytes, not {}",
                        capacity * 4
                    ),
                ));
            }
            segments.push(Segment(at));
        }
        // One passive epoch for the window's life: loads and stores, ordered by `phase`.
        // SAFETY: `win` is live; MPI_MODE_NOCHECK: no rank locks it otherwise.
        let rc = unsafe { ffi::MPI_Win_lock_all(ffi::MPI_MODE_NOCHECK as c_int, win) };
        check(rc, "MPI_Win_lock_all")?;
        Ok(Some(SharedSum {
            rank: usize::try_from(comm.rank()).unwrap_or(0),
            comm,
            win,
            segments,
            capacity,
        }))
    }

    /// Elements one call sums at most.
    pub(super) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Every rank's stores so far are seen by every rank's loads from here on (the shared
    /// window's memory model: sync, barrier, sync).
    fn phase(&self) -> Result<()> {
        // SAFETY: `win` is live and locked (`map`); `comm` is live. Collective over `comm`:
        // every rank runs the same phases of the same sums.
        unsafe {
            check(ffi::MPI_Win_sync(self.win), "MPI_Win_sync")?;
            check(ffi::MPI_Barrier(self.comm.as_raw()), "MPI_Barrier")?;
            check(ffi::MPI_Win_sync(self.win), "MPI_Win_sync")
        }
    }

    /// Replace `chunk` (at most [`SharedSum::capacity`] elements, the same length on every
    /// rank) by the sum of every rank's, added in rank order — on every rank, or (`to`) on that
    /// rank alone.
    pub(super) fn sum(&self, chunk: &mut [f32], to: Option<usize>) -> Result<()> {
        let (m, n) = (chunk.len(), self.segments.len());
        if m > self.capacity {
            return Err(Error::internal(
                "mpi",
                format!("{m} elements in a window of {}", self.capacity),
            ));
        }
        let segs = &self.segments;
        let mine = segs[self.rank];
        // 1. This rank's chunk into its segment (no rank reads it before the phase).
        chunk.par_chunks(BLOCK).enumerate().for_each(|(b, src)| {
            // SAFETY: block b of this rank's segment, inside its `capacity` (m ≤ capacity);
            // only this thread writes it, and no other rank reads it until the phase below.
            let dst = unsafe { std::slice::from_raw_parts_mut(mine.at(b * BLOCK), src.len()) };
            dst.copy_from_slice(src);
        });
        self.phase()?;
        // 2. This rank's slice: Σ over ranks in order, into its own segment.
        let mine_blocks: Vec<Range<usize>> = blocks(slice_of(m, n, self.rank)).collect();
        mine_blocks.par_iter().for_each(|r| {
            let parts: Vec<&[f32]> = segs
                .iter()
                .map(|seg| {
                    // SAFETY: elements `r` of every segment lie in this rank's slice: in this
                    // phase the other ranks read and write only their own slices, and of this
                    // rank's threads only this one touches `r` (the blocks are disjoint).
                    unsafe { std::slice::from_raw_parts(seg.at(r.start), r.len()) }
                })
                .collect();
            // Into a buffer of its own: this rank's elements `r` are one of the parts.
            let mut acc = vec![0.0f32; r.len()];
            sum_in_rank_order(&parts, &mut acc);
            // SAFETY: this rank's elements `r`, which only this thread writes, now that no
            // part is read any more.
            unsafe { std::slice::from_raw_parts_mut(mine.at(r.start), r.len()) }
                .copy_from_slice(&acc);
        });
        self.phase()?;
        // 3. Every rank's summed slice back into the chunk (a reduce's root alone: the other
        // ranks' chunks are left as they are).
        let every_block: Vec<(usize, Range<usize>)> = match to.is_none_or(|r| r == self.rank) {
            true => 0..n,
            false => 0..0,
        }
        .flat_map(|k| blocks(slice_of(m, n, k)).map(move |r| (k, r)))
        .collect();
        let out = Segment(chunk.as_mut_ptr());
        every_block.par_iter().for_each(|(k, r)| {
            // SAFETY: rank k's summed elements `r`, written before the phase and by no one
            // after it until the next call's first phase; `out` is `chunk`, whose elements `r`
            // only this thread writes (the blocks do not overlap).
            unsafe {
                let src = std::slice::from_raw_parts(segs[*k].at(r.start), r.len());
                std::slice::from_raw_parts_mut(out.at(r.start), r.len()).copy_from_slice(src);
            }
        });
        // No rank writes its segment again (the next call) until every rank has read them.
        self.phase()
    }
}

impl Drop for SharedSum {
    fn drop(&mut self) {
        // SAFETY: the window is live and locked; freeing is collective, and every rank drops
        // its world (and with it this) at the end of the job, before MPI is finalised.
        unsafe {
            ffi::MPI_Win_unlock_all(self.win);
            ffi::MPI_Win_free(&raw mut self.win);
        }
    }
}
