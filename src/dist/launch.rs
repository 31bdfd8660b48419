//! Where a launcher put this process: its rank, the job's size and its rank on this node, read
//! from the environment the launcher sets, as the launchers users already run document it.

use crate::{Error, Result};

/// This process's place in a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// Which launcher's variables said so.
    pub launcher: &'static str,
    /// Rank in the job, 0-based.
    pub rank: usize,
    /// Ranks in the job.
    pub size: usize,
    /// Rank among the ranks of this node (which GPU a rank takes).
    pub local_rank: usize,
}

/// The name of torchrun's entry in [`Launch::launcher`].
pub const TORCHRUN: &str = "torchrun";

/// Each launcher's variables: (launcher, rank, size, local rank), in the order they are tried.
/// An MPI launcher's are tried first: `srun` under `mpirun` (or the reverse) leaves both, and the
/// one that started this process is the innermost, MPI's.
const SOURCES: [(&str, &str, &str, &str); 4] = [
    (
        "mpirun (Open MPI)",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
    ),
    ("mpirun (MPICH)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    (
        "srun (Slurm)",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
    ),
    (TORCHRUN, "RANK", "WORLD_SIZE", "LOCAL_RANK"),
];

impl Launch {
    /// From this process's environment; `None` when no launcher's variables are set.
    pub fn from_env() -> Result<Option<Launch>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// From the variables `var` looks up (the environment, or a test's map).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>> {
        for (launcher, rank, size, local) in SOURCES {
            let (Some(r), Some(s)) = (var(rank), var(size)) else {
                continue;
            };
            let number = |name: &str, v: &str| -> Result<usize> {
                v.trim().parse::<usize>().map_err(|_| {
                    Error::bad_input(
                        "launch environment",
                        format!("{name}={v}"),
                        format!("set by {launcher}, is not a non-negative integer"),
                        Some("start megatrain from the launcher itself, without overriding its variables"),
                    )
                })
            };
            let rank_n = number(rank, &r)?;
            let size_n = number(size, &s)?;
            let local_n = match var(local) {
                Some(v) => number(local, &v)?,
                None => 0,
            };
            if size_n == 0 || rank_n >= size_n {
                return Err(Error::bad_input(
                    "launch environment",
                    format!("{rank}={r}, {size}={s}"),
                    format!("set by {launcher}: the rank must be below a non-zero size"),
                    Some("start megatrain from the launcher itself, without overriding its variables"),
                ));
            }
            return Ok(Some(Launch {
                launcher,
                rank: rank_n,
                size: size_n,
                local_rank: local_n,
            }));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn from(pairs: &[(&str, &str)]) -> Result<Option<Launch>> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Launch::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn reads_each_launcher() {
        assert_eq!(from(&[]).unwrap(), None);
        let l = from(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((l.rank, l.size, l.local_rank), (2, 3, 0));
        let l = from(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (l.launcher, l.rank, l.size, l.local_rank),
            ("srun (Slurm)", 5, 8, 1)
        );
        let l = from(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")])
            .unwrap()
            .unwrap();
        assert_eq!(l.launcher, "torchrun");
        // MPI's variables win over Slurm's when both are set.
        let l = from(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((l.launcher, l.rank, l.size), ("mpirun (MPICH)", 1, 2));
    }

    #[test]
    fn refuses_nonsense() {
        let e = from(&[("RANK", "x"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(e.to_string().contains("RANK=x"), "{e}");
        let e = from(&[("RANK", "2"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(e.to_string().contains("below"), "{e}");
        assert!(from(&[("RANK", "0"), ("WORLD_SIZE", "0")]).is_err());
    }
}
