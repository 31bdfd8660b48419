//! Host memory: NUMA-bound regions and thread placement.

pub mod affinity;
pub mod region;

pub use region::{HostRegistrar, PageKind, Region, RegionSpec, SHARD_ALIGN};
