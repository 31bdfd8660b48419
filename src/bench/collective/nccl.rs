//! `megatrain bench collective --device cuda`: NCCL's reduce-scatter, all-gather, all-reduce
//! and broadcast between the ranks' GPUs (each rank on its own, as in training: local rank `i`
//! takes visible GPU `i` mod their count), in bus GB/s by nccl-tests' formulas, every result
//! checked. The communicator is made the NCCL way: rank 0's unique id broadcast over MPI.
//!
//! Times are wall time around the enqueue and the stream's synchronisation (nccl-tests' own
//! method), the median of the repetitions after a warm-up, the slowest rank's. Under the CUDA
//! emulator they are host times, and the report says so.

use serde::{Deserialize, Serialize};

/// One buffer size.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NcclRow {
    /// Bytes per rank: the all-reduce's buffer, the reduce-scatter's input, the all-gather's
    /// output (nccl-tests' "size").
    pub bytes: u64,
    /// `ncclReduceScatter`: seconds and bus GB/s (`bytes / time × (N−1)/N`).
    pub reduce_scatter_s: f64,
    /// Its bus GB/s.
    pub reduce_scatter_busbw_gbs: f64,
    /// `ncclAllGather`: seconds.
    pub all_gather_s: f64,
    /// Its bus GB/s (`bytes / time × (N−1)/N`).
    pub all_gather_busbw_gbs: f64,
    /// `ncclAllReduce`: seconds.
    pub all_reduce_s: f64,
    /// Its bus GB/s (`bytes / time × 2(N−1)/N`).
    pub all_reduce_busbw_gbs: f64,
    /// `ncclBroadcast` from rank 0 (how stage 3's GPUs gather a unit's params): seconds.
    #[serde(default)]
    pub broadcast_s: f64,
    /// Its bus GB/s (`bytes / time`: a broadcast's bus bandwidth is its algorithm bandwidth).
    #[serde(default)]
    pub broadcast_busbw_gbs: f64,
}

/// What the NCCL side measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NcclReport {
    /// The library: version and file.
    pub library: String,
    /// Each rank's GPU (`name`, in rank order).
    pub gpus: Vec<String>,
    /// Whether the GPUs are the CUDA emulator's (the times are host times).
    pub emulated: bool,
    /// Per buffer size.
    pub rows: Vec<NcclRow>,
}

/// Bus GB/s of a reduce-scatter or all-gather of `bytes` per rank (nccl-tests' formula).
pub fn scatter_gather_bus_gbs(bytes: u64, ranks: usize, secs: f64) -> f64 {
    let n = ranks.max(1) as f64;
    bytes as f64 / secs.max(1e-12) / 1e9 * (n - 1.0) / n
}

#[cfg(feature = "cuda")]
pub use measure::run;

#[cfg(feature = "cuda")]
mod measure {
    use super::{scatter_gather_bus_gbs, NcclReport, NcclRow};
    use crate::bench::collective::slowest;
    use crate::device::cuda::nccl::{self, NcclComm};
    use crate::device::cuda::{drv, CudaRuntime};
    use crate::dist::{Collective, HostShare};
    use crate::{Error, Result};
    use std::time::Instant;

    /// Rank r's value at global index i: small integers, exact in f32 whatever the summing order.
    fn value(i: usize, rank: usize) -> f32 {
        ((i % 61) * (rank + 1)) as f32
    }

    fn mismatch(what: &str, i: usize, got: f32, want: f32) -> Error {
        Error::internal(
            "bench collective",
            format!("{what}: element {i} is {got}, not {want}"),
        )
    }

    /// Time NCCL's collectives over `sizes` bytes per rank, `reps` times each.
    pub fn run(world: &dyn Collective, sizes: &[u64], reps: usize) -> Result<NcclReport> {
        let (rank, n) = (world.rank(), world.size());
        let visible = CudaRuntime::visible_gpus()?;
        let rt = CudaRuntime::open_context(HostShare::of(world).gpu(visible.len()))?;
        let mut id = if rank == 0 {
            nccl::unique_id()?
        } else {
            [0; 128]
        };
        world.broadcast_bytes(0, &mut id)?;
        let comm = NcclComm::join(&rt.ctx, id, rank, n)?;
        let stream = rt.stream.clone();
        let gpus = world
            .all_gather_bytes(rt.name.as_bytes())?
            .iter()
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect();
        let mut rows = Vec::new();
        for &bytes in sizes {
            // Whole f32 elements, a multiple of the ranks (each rank's part of the scatter).
            let count = usize::try_from(bytes / 4).unwrap_or(usize::MAX) / n * n;
            if count == 0 {
                return Err(Error::bad_input(
                    "benchmark size",
                    format!("--sizes {bytes}"),
                    format!(
                        "NCCL's rows need at least one f32 per rank: {} bytes for {n} ranks",
                        4 * n
                    ),
                    Some("pass larger --sizes"),
                ));
            }
            let part = count / n;
            let need = (count as u64)
                .checked_mul(4)
                .and_then(|b| b.checked_mul(2))
                .and_then(|b| b.checked_add(part as u64 * 4));
            let (free, _) = drv(
                cudarc::driver::result::mem_get_info(),
                "read the free GPU memory",
            )?;
            if need.is_none_or(|b| b > free as u64) {
                return Err(Error::bad_input(
                    "benchmark size",
                    format!("a collective of {}", crate::util::human_bytes(bytes)),
                    format!(
                        "needs {} of GPU memory on rank {rank}, and {} is free",
                        need.map_or_else(
                            || "more than 2^64 bytes".into(),
                            crate::util::human_bytes
                        ),
                        crate::util::human_bytes(free as u64)
                    ),
                    Some("pass smaller --sizes"),
                ));
            }
            crate::bench::check_memory(
                &format!("a collective of {}", crate::util::human_bytes(bytes)),
                (count as u64).checked_mul(4 * 2),
                "pass smaller --sizes",
            )?;
            let whole: Vec<f32> = (0..count).map(|i| value(i, rank)).collect();
            let mine: Vec<f32> = (0..part).map(|i| value(rank * part + i, rank)).collect();
            let send = drv(stream.clone_htod(&whole), "copy the buffer to the GPU")?;
            let send_part = drv(stream.clone_htod(&mine), "copy the buffer to the GPU")?;
            let mut full = drv(stream.alloc_zeros::<f32>(count), "allocate the GPU buffer")?;
            let mut part_out = drv(stream.alloc_zeros::<f32>(part), "allocate the GPU buffer")?;
            let scale = (n * (n + 1) / 2) as f32;
            let time = |op: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
                let mut t = Vec::with_capacity(reps);
                for rep in 0..=reps {
                    let t0 = Instant::now();
                    op()?;
                    drv(stream.synchronize(), "wait for the collective")?;
                    if rep > 0 {
                        t.push(t0.elapsed().as_secs_f64());
                    }
                }
                slowest(world, crate::util::median(t))
            };
            let reduce_scatter_s =
                time(&mut || comm.reduce_scatter_sum(&send, &mut part_out, &stream))?;
            let got = drv(stream.clone_dtoh(&part_out), "copy the result to the host")?;
            for (i, &g) in got.iter().enumerate() {
                let want = ((rank * part + i) % 61) as f32 * scale;
                if g != want {
                    return Err(mismatch("ncclReduceScatter", i, g, want));
                }
            }
            let all_gather_s = time(&mut || comm.all_gather(&send_part, &mut full, &stream))?;
            let got = drv(stream.clone_dtoh(&full), "copy the result to the host")?;
            for (i, &g) in got.iter().enumerate() {
                let want = value(i, i / part.max(1));
                if g != want {
                    return Err(mismatch("ncclAllGather", i, g, want));
                }
            }
            let all_reduce_s = time(&mut || comm.all_reduce_sum(&send, &mut full, &stream))?;
            let got = drv(stream.clone_dtoh(&full), "copy the result to the host")?;
            for (i, &g) in got.iter().enumerate() {
                let want = (i % 61) as f32 * scale;
                if g != want {
                    return Err(mismatch("ncclAllReduce", i, g, want));
                }
            }
            // Rank 0's buffer to every rank's (what stage 3's gathers do).
            if rank == 0 {
                drv(
                    stream.memcpy_htod(&whole, &mut full),
                    "copy the buffer to the GPU",
                )?;
            }
            let broadcast_s = time(&mut || comm.broadcast(0, &mut full, &stream))?;
            let got = drv(stream.clone_dtoh(&full), "copy the result to the host")?;
            for (i, &g) in got.iter().enumerate() {
                if g != value(i, 0) {
                    return Err(mismatch("ncclBroadcast", i, g, value(i, 0)));
                }
            }
            let size = count as u64 * 4;
            rows.push(NcclRow {
                bytes: size,
                reduce_scatter_s,
                reduce_scatter_busbw_gbs: scatter_gather_bus_gbs(size, n, reduce_scatter_s),
                all_gather_s,
                all_gather_busbw_gbs: scatter_gather_bus_gbs(size, n, all_gather_s),
                all_reduce_s,
                all_reduce_busbw_gbs: crate::bench::collective::bus_gbs(size, n, all_reduce_s),
                broadcast_s,
                broadcast_busbw_gbs: size as f64 / broadcast_s.max(1e-12) / 1e9,
            });
        }
        let lib = comm.library();
        Ok(NcclReport {
            library: format!(
                "NCCL {} ({}, {})",
                lib.version,
                lib.found.path.display(),
                lib.found.origin
            ),
            gpus,
            emulated: rt.emulated(),
            rows,
        })
    }
}

/// The NCCL side as a table.
pub fn render(r: &NcclReport, ranks: usize) -> String {
    let mut gpus = r.gpus.clone();
    gpus.dedup();
    let mut s = format!(
        "NCCL between the ranks' GPUs ({}), {}{}\n(bus bandwidth as nccl-tests reports it: reduce-scatter and all-gather bytes / time × (N−1)/N, all-reduce × 2(N−1)/N, broadcast bytes / time, N = {ranks}; the slowest rank's median)\n{:>10}  {:>22}  {:>22}  {:>22}  {:>22}\n",
        gpus.join(", "),
        r.library,
        if r.emulated {
            "\nEMULATED: the CUDA emulator's GPUs; these are host times, not GPU figures"
        } else {
            ""
        },
        "bytes",
        "ncclReduceScatter",
        "ncclAllGather",
        "ncclAllReduce",
        "ncclBroadcast"
    );
    for row in &r.rows {
        s.push_str(&format!(
            "{:>10}  {:>9.3} ms {:>6.2} GB/s  {:>9.3} ms {:>6.2} GB/s  {:>9.3} ms {:>6.2} GB/s  {:>9.3} ms {:>6.2} GB/s\n",
            crate::util::human_bytes(row.bytes),
            row.reduce_scatter_s * 1e3,
            row.reduce_scatter_busbw_gbs,
            row.all_gather_s * 1e3,
            row.all_gather_busbw_gbs,
            row.all_reduce_s * 1e3,
            row.all_reduce_busbw_gbs,
            row.broadcast_s * 1e3,
            row.broadcast_busbw_gbs,
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scatter_and_gather_bus_bandwidth_is_nccl_tests_formula() {
        // 1 GB in 1 s over 4 ranks: each link carries 3/4 of it.
        assert!((scatter_gather_bus_gbs(1_000_000_000, 4, 1.0) - 0.75).abs() < 1e-12);
        assert_eq!(scatter_gather_bus_gbs(1_000_000_000, 1, 1.0), 0.0);
    }
}
