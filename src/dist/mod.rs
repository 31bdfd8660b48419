//! Data parallelism across processes: where this process stands in a job its launcher started
//! (`mpirun`, `srun`: [`launch`]), and the few collectives the trainer needs, each with a fixed
//! reduction order so every rank and every run computes the same bits.
//!
//! The trainer sees one trait, [`Collective`]: [`Solo`] for a process on its own, and the MPI
//! world (feature `mpi`, [`join`]) for a job of several. The engine moves bytes through the
//! engine it is given and does every sum itself, in rank order: MPI only transports, so the
//! result does not depend on which algorithm the MPI library picks for a message size.

pub mod launch;
#[cfg(feature = "mpi")]
mod mpi;
mod order;
#[cfg(feature = "mpi")]
mod shared;
pub mod store;

pub use launch::Launch;
pub use order::{sum_in_rank_order, sum_in_rank_order_in_place, totals_in_rank_order};

use crate::{Error, Result};
use std::sync::Arc;

/// The collectives of a data-parallel job. Every rank calls the same ones in the same order
/// (the schedule and the training loop are the same on every rank); a call blocks until every
/// rank made it.
pub trait Collective: Send + Sync + std::fmt::Debug {
    /// This process's rank, 0-based.
    fn rank(&self) -> usize;
    /// How many ranks the job has.
    fn size(&self) -> usize;
    /// The host this rank runs on (for messages naming a rank).
    fn host(&self) -> &str;
    /// Every rank's host, in rank order (learnt when the job was joined).
    fn hosts(&self) -> &[String];
    /// Replace `buf` on every rank by the element-wise sum of every rank's `buf`, added in rank
    /// order: `((x₀ + x₁) + x₂) + …` in f32, the same bits on every rank and in every run. Every
    /// rank passes the same length.
    fn sum_f32(&self, buf: &mut [f32]) -> Result<()>;
    /// Rank `root`'s `buf` replaced by the sum [`Collective::sum_f32`] gives — every rank's
    /// `buf`, element-wise, in rank order, the same bits — and the other ranks' `buf` left
    /// holding anything (a unit's gradients, summed for the one rank that updates it: the
    /// others skip receiving the sums). Every rank passes the same length and root. By default
    /// the sum itself, on every rank.
    fn reduce_f32(&self, root: usize, buf: &mut [f32]) -> Result<()> {
        let _ = root;
        self.sum_f32(buf)
    }
    /// The same for a few f64 values (losses, token counts, flags).
    fn sum_f64(&self, buf: &mut [f64]) -> Result<()>;
    /// Every rank's `bytes`, in rank order, on every rank (small values: settings, identities).
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Replace `buf` on every rank by rank `root`'s `buf` (a unit's updated params from the rank
    /// that updated it, a unit's moments for a checkpoint). Every rank passes the same length.
    fn broadcast_bytes(&self, root: usize, buf: &mut [u8]) -> Result<()>;
    /// Send `buf` to rank `to`, which takes it with [`Collective::recv_bytes`] of the same
    /// length (a unit's moments, to the rank writing a checkpoint). Not collective: only the two
    /// ranks take part.
    fn send_bytes(&self, to: usize, buf: &[u8]) -> Result<()>;
    /// Receive into `buf` what rank `from` sends with [`Collective::send_bytes`].
    fn recv_bytes(&self, from: usize, buf: &mut [u8]) -> Result<()>;
    /// End every rank of the job with exit status `code` (a failed rank's last act, so no other
    /// rank waits for it forever). Only the binary calls this, after printing its error.
    fn abort(&self, code: i32) -> !;
    /// The transport library's own all-reduce of f32 sums (its order and algorithm, so its bits
    /// may differ by rank count and size): the peer `megatrain bench collective` times
    /// [`Collective::sum_f32`] against. Not used in training.
    fn library_sum_f32(&self, buf: &mut [f32]) -> Result<()>;
    /// The transport library and its version ("none" alone).
    fn library(&self) -> String;
    /// How [`Collective::sum_f32`] moves the ranks' buffers (for reports).
    fn sum_path(&self) -> &'static str {
        "none (one process)"
    }
    /// What this rank is waiting in, for a watchdog on another thread (a rank that hangs
    /// without dying leaves the others waiting in a collective). The handle does not keep the
    /// job open.
    fn watch(&self) -> StallWatch {
        StallWatch::default()
    }
    /// Answer the other ranks' [`Collective::roll_call`]s: "I wait in a collective too". A
    /// watchdog calls it while this rank waits in one. Nothing where there is no roll call.
    fn answer_roll_calls(&self) {}
    /// Ask every other rank whether it waits in a collective too, answering theirs meanwhile,
    /// for up to `within`: the ranks that did not answer — hung, stopped or dead — with their
    /// hosts. `None` where the library cannot be called while a collective is in progress (an
    /// MPI without `MPI_THREAD_MULTIPLE`), or for one process. From a watchdog's thread only.
    fn roll_call(&self, _within: std::time::Duration) -> Option<Vec<(usize, String)>> {
        None
    }
    /// Why [`Collective::roll_call`] gives `None` (for the watchdog's message).
    fn no_roll_call(&self) -> &'static str {
        "one process has no other ranks to ask"
    }
    /// Whether the collectives run between the ranks' GPUs (NCCL, under torchrun): then a
    /// second communicator on the device's streams is not taken unless asked for.
    fn on_gpus(&self) -> bool {
        false
    }
}

/// The collective a rank is waiting in and since when, readable from any thread.
#[derive(Debug, Clone, Default)]
pub struct StallWatch(Arc<std::sync::Mutex<Option<(&'static str, std::time::Instant)>>>);

impl StallWatch {
    /// The collective being waited in, and for how long; `None` outside collectives.
    pub fn stalled(&self) -> Option<(&'static str, std::time::Duration)> {
        crate::util::lock(&self.0).map(|(what, t0)| (what, t0.elapsed()))
    }

    /// Mark the start (`Some`) or the end (`None`) of a wait.
    #[cfg_attr(not(any(feature = "mpi", feature = "cuda")), allow(dead_code))]
    pub(crate) fn set(&self, what: Option<&'static str>) {
        *crate::util::lock(&self.0) = what.map(|w| (w, std::time::Instant::now()));
    }
}

/// Where this rank stands among the ranks on its host: which of them it is (in rank order)
/// and how many there are. Ranks sharing a host share its CPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostShare {
    /// This rank's index among its host's ranks.
    pub index: usize,
    /// Ranks on this host.
    pub count: usize,
}

impl HostShare {
    /// The ranks' host names, in rank order, into each rank's share.
    pub fn of(world: &dyn Collective) -> HostShare {
        Self::among(world.hosts(), world.rank())
    }

    /// Rank `rank`'s share, from every rank's host name in rank order.
    pub fn among(hosts: &[String], rank: usize) -> HostShare {
        let mine = hosts.get(rank);
        let same: Vec<usize> = (0..hosts.len())
            .filter(|&r| Some(&hosts[r]) == mine)
            .collect();
        HostShare {
            index: same.iter().position(|&r| r == rank).unwrap_or(0),
            count: same.len().max(1),
        }
    }

    /// Bind this process to its part of the CPUs it may use, and size the global thread pool to
    /// it (unless `RAYON_NUM_THREADS` says otherwise), when ranks share the host — as `torchrun`
    /// users set `OMP_NUM_THREADS` to the cores per process. Threads started from here on
    /// inherit the binding (the CPU device's kernels, the AdamW workers, the shared-memory
    /// sum's threads). Alone on the host: nothing.
    pub fn bind(&self) -> Result<()> {
        if self.count == 1 {
            return Ok(());
        }
        let cpus = self.cpus(&crate::host::affinity::current_affinity()?);
        crate::host::affinity::pin_current_thread(&cpus)?;
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            // Fails only if the pool already started, which no caller does before this.
            let _ = rayon::ThreadPoolBuilder::new()
                .num_threads(cpus.len())
                .build_global();
        }
        Ok(())
    }

    /// The GPU this rank takes among the `visible` ones of its host: local rank `i` takes GPU
    /// `i mod visible`, as torchrun's `cuda:LOCAL_RANK` does where there are enough. A
    /// launcher that gives each rank its own GPU (`CUDA_VISIBLE_DEVICES`, Slurm's
    /// `--gpus-per-task`) leaves each one GPU 0.
    pub fn gpu(&self, visible: usize) -> usize {
        self.index % visible.max(1)
    }

    /// This rank's part of `cpus` (a host's, or a node's): contiguous, in order, at least one.
    pub fn cpus(&self, cpus: &[usize]) -> Vec<usize> {
        if cpus.len() < self.count {
            return cpus
                .get(self.index % cpus.len().max(1))
                .map_or_else(Vec::new, |c| vec![*c]);
        }
        cpus[order::slice_of(cpus.len(), self.count, self.index)].to_vec()
    }
}

/// A process on its own: rank 0 of 1; every collective is the identity.
#[derive(Debug, Clone)]
pub struct Solo {
    host: String,
}

impl Default for Solo {
    fn default() -> Self {
        Solo { host: hostname() }
    }
}

impl Collective for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn host(&self) -> &str {
        &self.host
    }
    fn hosts(&self) -> &[String] {
        std::slice::from_ref(&self.host)
    }
    fn sum_f32(&self, _buf: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn sum_f64(&self, _buf: &mut [f64]) -> Result<()> {
        Ok(())
    }
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(vec![bytes.to_vec()])
    }
    fn broadcast_bytes(&self, _root: usize, _buf: &mut [u8]) -> Result<()> {
        Ok(())
    }
    fn send_bytes(&self, to: usize, _buf: &[u8]) -> Result<()> {
        Err(Error::internal(
            "collective",
            format!("a process alone has no rank {to} to send to"),
        ))
    }
    fn recv_bytes(&self, from: usize, _buf: &mut [u8]) -> Result<()> {
        Err(Error::internal(
            "collective",
            format!("a process alone has no rank {from} to receive from"),
        ))
    }
    fn library_sum_f32(&self, _buf: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn library(&self) -> String {
        "none (one process)".into()
    }
    fn abort(&self, code: i32) -> ! {
        std::process::exit(code)
    }
}

/// The collective of a process on its own.
pub fn solo() -> Arc<dyn Collective> {
    Arc::new(Solo::default())
}

/// Join the job `launch` describes: initialise MPI (its launcher's rendezvous, PMI/PMIx) and
/// check that MPI sees the world the launcher announced.
#[cfg(feature = "mpi")]
pub fn join(launch: &Launch) -> Result<Arc<dyn Collective>> {
    let world = mpi::MpiWorld::init()?;
    if world.size() != launch.size || world.rank() != launch.rank {
        return Err(Error::bad_input(
            "launch",
            launch.launcher,
            format!(
                "announced rank {} of {}, but MPI sees rank {} of {}: the processes were not started by an MPI launcher",
                launch.rank,
                launch.size,
                world.rank(),
                world.size()
            ),
            Some("start the job with `mpirun -np N megatrain train …` or `srun --mpi=pmix megatrain train …`"),
        ));
    }
    Ok(Arc::new(world))
}

/// Join the job `launch` describes: this build has no MPI, so a job of several ranks is refused.
#[cfg(not(feature = "mpi"))]
pub fn join(launch: &Launch) -> Result<Arc<dyn Collective>> {
    Err(Error::bad_input(
        "launch",
        launch.launcher,
        format!(
            "started this process as rank {} of {}, but this megatrain was built without MPI",
            launch.rank, launch.size
        ),
        Some("build with `cargo build --release --features mpi` (needs libopenmpi-dev or libmpich-dev and libclang-dev), or run one process"),
    ))
}

/// Check that every rank agrees on `what`'s value `mine` (a setting that decides the
/// collectives' order or sizes): the first rank that differs from rank 0 is named.
pub fn check_same(world: &dyn Collective, what: &str, mine: &str) -> Result<()> {
    let all = world.all_gather_bytes(mine.as_bytes())?;
    let first = all.first().map(|b| String::from_utf8_lossy(b).into_owned());
    for (r, b) in all.iter().enumerate().skip(1) {
        let theirs = String::from_utf8_lossy(b);
        if Some(theirs.as_ref()) != first.as_deref() {
            return Err(Error::bad_input(
                "data-parallel ranks",
                format!("rank {r}"),
                format!(
                    "has {what} {theirs}, rank 0 has {}",
                    first.as_deref().unwrap_or("")
                ),
                Some("give every rank the same command line and inputs (each rank's free memory can pick a different mode: pass --mode and --activations)"),
            ));
        }
    }
    Ok(())
}

/// Whether any rank says yes (an interrupt seen by one rank stops all after the same step).
pub fn any(world: &dyn Collective, mine: bool) -> Result<bool> {
    let mut v = [f64::from(u8::from(mine))];
    world.sum_f64(&mut v)?;
    Ok(v[0] > 0.0)
}

/// This machine's host name (empty if it has none).
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its length; gethostname writes at most that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_on_a_host_split_its_cpus() {
        let cpus: Vec<usize> = (0..10).collect();
        let parts: Vec<Vec<usize>> = (0..3)
            .map(|index| HostShare { index, count: 3 }.cpus(&cpus))
            .collect();
        assert_eq!(parts, [vec![0, 1, 2, 3], vec![4, 5, 6], vec![7, 8, 9]]);
        // More ranks than CPUs: one each, shared round-robin.
        assert_eq!(HostShare { index: 3, count: 4 }.cpus(&[5, 6]), [6]);
        assert_eq!(
            HostShare::of(&Solo::default()),
            HostShare { index: 0, count: 1 }
        );
    }

    #[test]
    fn solo_is_the_identity() {
        let s = Solo::default();
        let mut x = vec![1.5f32, -2.0];
        s.sum_f32(&mut x).unwrap();
        assert_eq!(x, [1.5, -2.0]);
        assert_eq!(s.all_gather_bytes(b"ab").unwrap(), vec![b"ab".to_vec()]);
        assert!(any(&s, true).unwrap());
        assert!(!any(&s, false).unwrap());
        check_same(&s, "mode", "exact").unwrap();
    }

    /// A build without MPI refuses a job of several ranks, naming the launcher and the build
    /// flag (run by the default-feature builds: the aarch64 tests).
    #[cfg(not(feature = "mpi"))]
    #[test]
    fn a_build_without_mpi_refuses_several_ranks() {
        let l = Launch {
            launcher: "torchrun",
            rank: 1,
            size: 2,
            local_rank: 1,
        };
        let e = join(&l).err().unwrap().to_string();
        assert!(
            e.contains("torchrun") && e.contains("rank 1 of 2") && e.contains("--features mpi"),
            "{e}"
        );
    }
}
