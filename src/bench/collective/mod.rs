//! `megatrain bench collective`: the data-parallel gradient sum ([`Collective::sum_f32`]: a
//! reduce-scatter then an all-gather, summed by us in rank order — through a shared-memory
//! window when every rank runs on one host, else through MPI's messages) against the transport library's
//! own all-reduce (`MPI_Allreduce`) on the same buffers in the same run, as bus bandwidth the
//! way nccl-tests reports it (`busbw = bytes / time × 2(N−1)/N`: what each rank's link carries).
//! Run under the job's launcher (`mpirun -np N megatrain bench collective`); every rank times,
//! the slowest rank's median is the figure. The sums are checked, not only timed. With
//! `--device cuda` ([`nccl`]) NCCL's collectives between the ranks' GPUs are measured too.

pub mod nccl;

use crate::dist::Collective;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// One buffer size.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CollectiveRow {
    /// Bytes per rank.
    pub bytes: u64,
    /// The rank-order sum: seconds (median, slowest rank) and bus GB/s.
    pub ours_s: f64,
    /// Bus GB/s of the rank-order sum.
    pub ours_busbw_gbs: f64,
    /// The library's all-reduce: seconds (median, slowest rank).
    pub library_s: f64,
    /// Bus GB/s of the library's all-reduce.
    pub library_busbw_gbs: f64,
    /// The rank-order sum delivered to rank 0 alone ([`Collective::reduce_f32`]: a unit's
    /// gradients for its owner): seconds (median, slowest rank).
    #[serde(default)]
    pub reduce_s: f64,
}

/// What `bench collective` measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CollectiveReport {
    /// Ranks in the job.
    pub ranks: usize,
    /// Hosts they ran on.
    pub hosts: usize,
    /// The transport library.
    pub library: String,
    /// How the rank-order sum moves the buffers ([`Collective::sum_path`]).
    pub ours_path: String,
    /// Per buffer size.
    pub rows: Vec<CollectiveRow>,
    /// NCCL between the ranks' GPUs (`--device cuda`), as `megatrain bench collective
    /// --device cuda --json` writes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nccl: Option<nccl::NcclReport>,
}

/// Bus bandwidth in GB/s of an all-reduce of `bytes` per rank over `ranks` in `secs`.
pub fn bus_gbs(bytes: u64, ranks: usize, secs: f64) -> f64 {
    let n = ranks.max(1) as f64;
    bytes as f64 / secs.max(1e-12) / 1e9 * 2.0 * (n - 1.0) / n
}

/// The slowest rank's value.
pub(crate) fn slowest(world: &dyn Collective, mine: f64) -> Result<f64> {
    let all = world.all_gather_bytes(&mine.to_le_bytes())?;
    Ok(all
        .iter()
        .filter_map(|b| <[u8; 8]>::try_from(b.as_slice()).ok())
        .map(f64::from_le_bytes)
        .fold(0.0, f64::max))
}

/// Rank r's values: small integers, so every order of summing them gives the same exact sum.
fn fill(buf: &mut [f32], rank: usize) {
    for (i, x) in buf.iter_mut().enumerate() {
        *x = ((i % 61) * (rank + 1)) as f32;
    }
}

fn check_sum(buf: &[f32], ranks: usize, what: &str) -> Result<()> {
    let scale = (ranks * (ranks + 1) / 2) as f32;
    match buf
        .iter()
        .enumerate()
        .find(|(i, x)| **x != (i % 61) as f32 * scale)
    {
        None => Ok(()),
        Some((i, x)) => Err(Error::internal(
            "bench collective",
            format!(
                "{what}: element {i} is {x}, not {}",
                (i % 61) as f32 * scale
            ),
        )),
    }
}

/// Time both sums over buffers of `sizes` bytes per rank, `reps` times each.
pub fn run(world: &dyn Collective, sizes: &[u64], reps: usize) -> Result<CollectiveReport> {
    super::check_count("--reps", reps, 1, super::MAX_REPS)?;
    let hosts = {
        let all = world.all_gather_bytes(world.host().as_bytes())?;
        let mut h = all;
        h.sort();
        h.dedup();
        h.len()
    };
    let mut rows = Vec::new();
    for &bytes in sizes {
        let n = usize::try_from(bytes / 4).unwrap_or(usize::MAX);
        super::check_memory(
            &format!("a collective of {}", crate::util::human_bytes(bytes)),
            (bytes).checked_mul(3),
            "pass smaller --sizes",
        )?;
        let mut buf = vec![0.0f32; n];
        #[derive(Clone, Copy, PartialEq)]
        enum Which {
            Ours,
            Library,
            Reduce,
        }
        let mut time = |which: Which| -> Result<f64> {
            let mut t = Vec::with_capacity(reps);
            for rep in 0..=reps {
                fill(&mut buf, world.rank());
                // Every rank starts together: a rank's time is not another's check of the
                // last result (a reduce's root checks alone).
                world.sum_f64(&mut [0.0])?;
                let t0 = Instant::now();
                match which {
                    Which::Library => world.library_sum_f32(&mut buf)?,
                    Which::Ours => world.sum_f32(&mut buf)?,
                    Which::Reduce => world.reduce_f32(0, &mut buf)?,
                }
                let secs = t0.elapsed().as_secs_f64();
                let what = match which {
                    Which::Library => "the library's all-reduce",
                    Which::Ours => "the rank-order sum",
                    Which::Reduce => "the rank-order sum to rank 0",
                };
                // A reduce's sum is rank 0's alone.
                if which != Which::Reduce || world.rank() == 0 {
                    check_sum(&buf, world.size(), what)?;
                }
                // The first is a warm-up (pages faulted, connections made).
                if rep > 0 {
                    t.push(secs);
                }
            }
            slowest(world, crate::util::median(t))
        };
        let ours_s = time(Which::Ours)?;
        let library_s = time(Which::Library)?;
        let reduce_s = time(Which::Reduce)?;
        rows.push(CollectiveRow {
            bytes,
            ours_s,
            ours_busbw_gbs: bus_gbs(bytes, world.size(), ours_s),
            library_s,
            library_busbw_gbs: bus_gbs(bytes, world.size(), library_s),
            reduce_s,
        });
    }
    Ok(CollectiveReport {
        ranks: world.size(),
        hosts,
        library: world.library(),
        ours_path: world.sum_path().to_owned(),
        rows,
        nccl: None,
    })
}

/// The report as a table.
pub fn render(r: &CollectiveReport) -> String {
    let mut s = format!(
        "all-reduce of f32 sums, {} ranks on {} host(s), {}\nours through {}\n(bus bandwidth as nccl-tests reports it: bytes / time × 2(N−1)/N; the slowest rank's median)\n{:>10}  {:>22}  {:>22}  {:>6}  {:>14}\n",
        r.ranks, r.hosts, r.library, r.ours_path, "bytes", "rank-order sum (ours)", "library all-reduce", "ratio", "ours to rank 0"
    );
    for row in &r.rows {
        s.push_str(&format!(
            "{:>10}  {:>9.3} ms {:>6.2} GB/s  {:>9.3} ms {:>6.2} GB/s  {:>5.2}×  {:>11.3} ms\n",
            crate::util::human_bytes(row.bytes),
            row.ours_s * 1e3,
            row.ours_busbw_gbs,
            row.library_s * 1e3,
            row.library_busbw_gbs,
            row.library_s / row.ours_s.max(1e-12),
            row.reduce_s * 1e3
        ));
    }
    if let Some(n) = &r.nccl {
        s.push('\n');
        s.push_str(&nccl::render(n, r.ranks));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_bandwidth_is_nccl_tests_formula() {
        // 1 GB in 1 s over 4 ranks: each link carries 2·3/4 of it.
        assert!((bus_gbs(1_000_000_000, 4, 1.0) - 1.5).abs() < 1e-12);
        assert_eq!(bus_gbs(1_000_000_000, 1, 1.0), 0.0);
    }

    #[test]
    fn one_process_runs_and_checks_its_sums() {
        let r = run(&crate::dist::Solo::default(), &[4096, 1 << 20], 2).unwrap();
        assert_eq!(r.rows.len(), 2);
        assert!(render(&r).contains("1 ranks"));
        let mut bad = vec![1.0f32; 8];
        assert!(check_sum(&bad, 1, "x").is_err());
        fill(&mut bad, 0);
        check_sum(&bad, 1, "x").unwrap();
    }
}
