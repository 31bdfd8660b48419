//! The host state store: every unit's shards in NUMA-bound regions, as placed by
//! [`placement::place`], with exclusive per-unit access.
//!
//! Ownership: a unit's shards are reachable only through a [`UnitGuard`], and at most one guard
//! per unit exists at a time ([`HostStore::take`] fails while one is out). A guard can be moved
//! into an AdamW job or a device copy; the memory stays mapped while any guard or the store
//! lives (regions are reference-counted), so a job that outlives its submitter is still sound.

pub mod hf;
pub mod layout;
mod master;
mod mxfp4;
pub mod placement;
pub mod planes;
mod snapshot;

use crate::host::{HostRegistrar, PageKind, Region, RegionSpec};
use crate::spill::extents::SpillConfig;
use crate::spill::io::EngineKind;
use crate::spill::tier::{Lease, SpillStats, SpillTier, TierConfig, TierUnit};
use crate::util::progress::{Meter, Unit};
use crate::{Error, Result};
use layout::{MasterFormat, ShardKind, StateLayout};
pub use master::{Master, MasterRef};
use placement::Placement;
pub use snapshot::{FrozenUnit, Snapshot};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Options for allocating the store.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreOptions {
    /// Page kind of every region.
    pub pages: PageKind,
    /// mlock every region.
    pub lock: bool,
    /// Bind regions to their planned node (off only for tests of unbound placement).
    pub unbound: bool,
    /// The NVMe tier's files and I/O settings; required when the placement spills.
    pub spill: Option<SpillOptions>,
    /// Page-lock the regions the device copies from and to (params, grads) with
    /// it, so its copies are asynchronous DMA.
    pub registrar: Option<SharedRegistrar>,
}

/// A device that page-locks host memory, shared by the store's options.
#[derive(Clone)]
pub struct SharedRegistrar(pub Arc<dyn HostRegistrar + Send + Sync>);

impl std::fmt::Debug for SharedRegistrar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedRegistrar")
    }
}

impl PartialEq for SharedRegistrar {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for SharedRegistrar {}

/// Where and how spilled shards are written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpillOptions {
    /// One directory per NVMe device.
    pub dirs: Vec<std::path::PathBuf>,
    /// io_uring, the pread/pwrite threads, or automatic.
    pub engine: EngineKind,
    /// O_DIRECT (off: buffered I/O).
    pub direct: bool,
    /// Requests in flight.
    pub queue_depth: usize,
    /// Extent (and request) size in bytes.
    pub extent_bytes: usize,
    /// The run the spill files belong to (named after it); `None`: a fresh id.
    pub run_id: Option<String>,
}

impl SpillOptions {
    /// Defaults for `dirs`: automatic engine, O_DIRECT, 4 MiB requests, 32 in flight.
    pub fn new(dirs: Vec<std::path::PathBuf>) -> Self {
        SpillOptions {
            dirs,
            engine: EngineKind::Auto,
            direct: true,
            queue_depth: 32,
            extent_bytes: 4 << 20,
            run_id: None,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct ShardLoc {
    region: usize,
    offset: usize,
}

#[derive(Debug)]
struct Inner {
    layout: StateLayout,
    placement: Placement,
    regions: Vec<Region>,
    /// `locs[unit][kind]`.
    locs: Vec<UnitLocs>,
    busy: Vec<AtomicBool>,
    /// Units a [`Snapshot`] is reading: their params and moments are not written until thawed.
    frozen: snapshot::Frozen,
    spill: Option<SpillTier>,
}

/// The host state store.
#[derive(Debug, Clone)]
pub struct HostStore {
    inner: Arc<Inner>,
}

impl HostStore {
    /// Allocate, bind and prefault every shard as `placement` says. Shards start zeroed.
    pub fn allocate(
        layout: StateLayout,
        placement: Placement,
        opts: &StoreOptions,
    ) -> Result<Self> {
        if placement.shard_node.len() != layout.units.len() {
            return Err(Error::bad_input(
                "placement",
                "shard_node",
                format!(
                    "{} units placed, layout has {}",
                    placement.shard_node.len(),
                    layout.units.len()
                ),
                None,
            ));
        }
        let (regions, locs) = allocate_regions(&layout, &placement, opts)?;
        let busy = (0..layout.units.len())
            .map(|_| AtomicBool::new(false))
            .collect();
        let spill = open_spill_tier(&layout, &placement, opts)?;
        let frozen = snapshot::Frozen::new(layout.units.len());
        Ok(HostStore {
            inner: Arc::new(Inner {
                layout,
                placement,
                regions,
                locs,
                busy,
                frozen,
                spill,
            }),
        })
    }

    /// The NVMe tier, when the placement spills.
    pub fn spill(&self) -> Option<&SpillTier> {
        self.inner.spill.as_ref()
    }

    /// The NVMe tier's counters (zero without one).
    pub fn spill_stats(&self) -> SpillStats {
        self.spill().map(SpillTier::stats).unwrap_or_default()
    }

    /// True when `unit` has shards on NVMe.
    pub fn is_spilled(&self, unit: usize) -> bool {
        self.spill().is_some_and(|t| t.holds(unit))
    }

    /// Start reading `unit`'s spilled shards into a free staging slot (a hint; no-op for units
    /// in RAM or when no slot is free).
    pub fn prefetch(&self, unit: usize) {
        if let Some(t) = self.spill() {
            t.prefetch(unit);
        }
    }

    /// Fail if a write-back to NVMe has failed.
    pub fn check_spill(&self) -> Result<()> {
        self.spill().map_or(Ok(()), SpillTier::check)
    }

    /// The layout.
    pub fn layout(&self) -> &StateLayout {
        &self.inner.layout
    }

    /// The placement.
    pub fn placement(&self) -> &Placement {
        &self.inner.placement
    }

    /// Number of units.
    pub fn num_units(&self) -> usize {
        self.inner.layout.units.len()
    }

    /// Bytes mapped for the state (all regions).
    pub fn mapped_bytes(&self) -> u64 {
        self.inner.regions.iter().map(|r| r.len() as u64).sum()
    }

    /// The NUMA node that actually holds the first page of `unit`'s `kind` shard (from the
    /// kernel, not from the plan).
    pub fn resident_node(&self, unit: usize, kind: ShardKind) -> Result<u32> {
        let loc = self.loc(unit, kind)?;
        self.inner.regions[loc.region].node_of(loc.offset)
    }

    fn loc(&self, unit: usize, kind: ShardKind) -> Result<ShardLoc> {
        self.inner
            .locs
            .get(unit)
            .and_then(|l| l[kind.index()])
            .ok_or_else(|| {
                Error::bad_input(
                    "shard",
                    format!("unit {unit}"),
                    format!("has no {} shard", kind.name()),
                    None,
                )
            })
    }

    /// Time writers of frozen units have waited for a snapshot to thaw them, in total.
    pub fn snapshot_wait(&self) -> Duration {
        self.inner.frozen.waited()
    }

    /// The start of `unit`'s `kind` shard in RAM (`None`: spilled, or no such shard).
    fn shard_ptr(&self, unit: usize, kind: ShardKind) -> Option<*mut u8> {
        let loc = self.loc(unit, kind).ok()?;
        let region = &self.inner.regions[loc.region];
        // SAFETY: offset + shard bytes ≤ region length by construction in `allocate`.
        Some(unsafe { region.as_ptr().add(loc.offset) })
    }

    /// Where `unit`'s Adam moment `kind` lies: its RAM shard, else its slot in `lease` (its
    /// staged NVMe shards); `None` for a unit without that shard.
    fn moment_ptr(
        &self,
        unit: usize,
        kind: ShardKind,
        lease: Option<&Lease>,
    ) -> Result<Option<*mut u8>> {
        if let Some(p) = self.shard_ptr(unit, kind) {
            return Ok(Some(p));
        }
        match lease {
            Some(l) => Ok(self
                .placement()
                .spill
                .as_ref()
                .and_then(|p| p.kinds.iter().position(|k| *k == kind))
                .and_then(|i| l.shard_ptr(i))
                .map(|p| p.cast())),
            None if self.is_spilled(unit) => Err(Error::system(
                "host store",
                format!("access unit {unit}"),
                "its optimizer state is on NVMe and not staged",
            )),
            None => Ok(None),
        }
    }

    /// Exclusive access to `unit`'s shards. Fails if another guard for it is out. A guard of a
    /// unit a [`Snapshot`] holds frozen may read its params ([`UnitGuard::master_ref`]); what
    /// writes them waits for the thaw.
    pub fn take(&self, unit: usize) -> Result<UnitGuard> {
        let flag = self.inner.busy.get(unit).ok_or_else(|| {
            Error::bad_input(
                "unit",
                unit.to_string(),
                format!("the store has {} units", self.num_units()),
                None,
            )
        })?;
        if flag
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return Err(Error::bad_input(
                "unit",
                unit.to_string(),
                "is already in use (a guard for it is out)",
                None,
            ));
        }
        Ok(UnitGuard {
            store: self.clone(),
            unit,
            lease: None,
        })
    }
}

/// A NUMA-bound, device-registered host buffer of fp32 words (or twice as many bf16 values): a lean-mode gradient buffer (the device
/// drains one unit's gradients into it, the AdamW pool consumes it) or a host-kept layer
/// activation.
#[derive(Debug)]
pub struct HostBuffer {
    region: Region,
    len: usize,
}

impl HostBuffer {
    /// A zeroed buffer of `len` elements on `node` (prefaulted by `cpus`); `label` names it in
    /// errors ("lean gradient buffer", "activation of layer 3").
    pub fn allocate(label: &str, len: usize, node: Option<u32>, cpus: Vec<usize>) -> Result<Self> {
        let region = Region::allocate(RegionSpec {
            label: format!("{label} ({len} elements)"),
            bytes: len * 4,
            node,
            prefault_cpus: cpus,
            pages: PageKind::Transparent,
            lock: false,
        })?;
        Ok(HostBuffer { region, len })
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the buffer.
    pub fn as_ptr(&self) -> *const f32 {
        self.region.as_ptr().cast()
    }

    /// Page-lock it for a device's copies.
    pub fn register_with(&mut self, registrar: &dyn HostRegistrar) -> Result<()> {
        self.region.register_with(registrar)
    }

    /// The buffer as a slice.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: the region holds ≥ len·4 bytes, is page aligned, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.region.as_ptr().cast(), self.len) }
    }

    /// The buffer as `2 · len` 16-bit values (bf16 data: a layer input stored in bf16).
    pub fn as_mut_halves(&mut self) -> &mut [u16] {
        // SAFETY: the region holds ≥ len·4 bytes = 2·len u16, page aligned (so u16 aligned),
        // and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.region.as_ptr().cast(), 2 * self.len) }
    }
}

/// Exclusive access to one unit's shards; releases the unit on drop.
#[derive(Debug)]
pub struct UnitGuard {
    store: HostStore,
    unit: usize,
    /// The staged NVMe shards while staged.
    lease: Option<Lease>,
}

/// Mutable views of all of a unit's shards at once.
#[derive(Debug)]
pub struct UnitShards<'a> {
    /// The fp32 master params.
    pub params: Master<'a>,
    /// fp32 grads (exact mode).
    pub grads: Option<&'a mut [f32]>,
    /// Adam m, stored as the layout's [`AdamState`](layout::AdamState) says (fp32, bf16, or
    /// int8 codes followed by block scales): its bytes.
    pub m: &'a mut [u8],
    /// Adam v, likewise.
    pub v: &'a mut [u8],
    /// How m and v are stored.
    pub adam: layout::AdamState,
}

impl UnitShards<'_> {
    /// m and v as fp32 (`--adam-state fp32`), `None` for a compact format.
    pub fn moments_f32(&mut self) -> Option<(&mut [f32], &mut [f32])> {
        if self.adam != layout::AdamState::Fp32 {
            return None;
        }
        let as_f32 = |b: &mut [u8]| -> Option<&mut [f32]> {
            // SAFETY: shards are 4 KiB aligned; the length is whole f32s; `b` is borrowed
            // mutably for the view's life.
            ((b.as_ptr() as usize).is_multiple_of(4) && b.len().is_multiple_of(4)).then(|| unsafe {
                std::slice::from_raw_parts_mut(b.as_mut_ptr().cast(), b.len() / 4)
            })
        };
        Some((as_f32(self.m)?, as_f32(self.v)?))
    }
}

impl UnitGuard {
    /// Which unit.
    pub fn unit(&self) -> usize {
        self.unit
    }

    /// The unit's element count (length of every shard view).
    pub fn numel(&self) -> usize {
        self.store.inner.layout.units[self.unit].numel
    }

    /// The store this guard belongs to.
    pub fn store(&self) -> &HostStore {
        &self.store
    }

    fn ptr(&self, kind: ShardKind) -> Option<*mut u8> {
        self.store.shard_ptr(self.unit, kind)
    }

    /// Stage the unit's spilled shards (Adam m/v on NVMe) into RAM, waiting for the read.
    /// No-op for a unit whose shards are all in RAM or that is already staged.
    pub fn stage(&mut self) -> Result<()> {
        // Staging is the first step of an update: it waits, like the update, for a snapshot
        // reading the unit (which also leases its staged shards).
        self.store.inner.frozen.wait(self.unit);
        if self.lease.is_none() {
            if let Some(t) = self.store.spill().filter(|t| t.holds(self.unit)) {
                self.lease = Some(t.lease(self.unit)?);
            }
        }
        Ok(())
    }

    /// Release staged shards, writing them back to NVMe (asynchronously).
    pub fn unstage(&mut self) {
        self.lease = None;
    }

    /// Release staged shards that were only read (no write-back).
    pub fn unstage_clean(&mut self) {
        if let Some(l) = self.lease.take() {
            l.release_clean();
        }
    }

    /// All shards as slices, to write them: waits while a [`Snapshot`] holds the unit frozen.
    /// Spilled shards must be staged first ([`UnitGuard::stage`]).
    pub fn shards(&mut self) -> Result<UnitShards<'_>> {
        self.store.inner.frozen.wait(self.unit);
        let n = self.numel();
        let f32s = |p: Option<*mut u8>| {
            // SAFETY: the shard holds ≥ n elements (shard_bytes rounds numel·size up), is 4 KiB
            // aligned, lives as long as the store (or the lease, for a staged shard), and this
            // guard is the unit's only accessor (no snapshot reads it: it is thawed); distinct
            // kinds are distinct, non-overlapping shards.
            p.map(|p| unsafe { std::slice::from_raw_parts_mut(p.cast::<f32>(), n) })
        };
        let moment = |kind| self.store.moment_ptr(self.unit, kind, self.lease.as_ref());
        let (pm, pv) = (moment(ShardKind::AdamM)?, moment(ShardKind::AdamV)?);
        let params = self.master_at(self.ptr(ShardKind::Params));
        let grads = f32s(self.ptr(ShardKind::Grads));
        let adam = self.store.layout().adam;
        let moment_bytes = adam.moment_bytes_unaligned(n);
        let bytes = |p: Option<*mut u8>| {
            // SAFETY: a moment shard holds ≥ moment_bytes (its shard bytes round that up); the
            // rest as for `f32s`.
            p.map(|p| unsafe { std::slice::from_raw_parts_mut(p, moment_bytes) })
        };
        let m = bytes(pm).unwrap_or_default();
        let v = bytes(pv).unwrap_or_default();
        Ok(UnitShards {
            params,
            grads,
            m,
            v,
            adam,
        })
    }

    fn f32_view(&mut self, kind: ShardKind) -> Option<&mut [f32]> {
        let n = self.numel();
        // SAFETY: as in `shards`; `&mut self` makes the view exclusive.
        self.ptr(kind)
            .map(|p| unsafe { std::slice::from_raw_parts_mut(p.cast::<f32>(), n) })
    }

    /// The params shard at `p` (none: an empty view) in the layout's master format.
    fn master_at<'a>(&self, p: Option<*mut u8>) -> Master<'a> {
        let Some(p) = p else {
            return Master::Fp32(Default::default());
        };
        let n = self.numel();
        match self.store.layout().master {
            MasterFormat::Fp32 => {
                // SAFETY: the params shard holds ≥ n f32s, is 4 KiB aligned, lives as long as
                // the store, and this guard is the unit's only accessor.
                let p = unsafe { std::slice::from_raw_parts_mut(p.cast::<f32>(), n) };
                Master::Fp32(p)
            }
            MasterFormat::Planes => {
                let lo_at = self.store.layout().lo_plane_offset(self.unit);
                // SAFETY: the shard is two planes of `lo_at` ≥ 2·n bytes each (shard_bytes), 4
                // KiB aligned, so the two u16 views are in bounds, aligned and disjoint; the
                // rest as for fp32.
                unsafe {
                    Master::Planes {
                        hi: std::slice::from_raw_parts_mut(p.cast::<u16>(), n),
                        lo: std::slice::from_raw_parts_mut(p.add(lo_at).cast::<u16>(), n),
                    }
                }
            }
        }
    }

    /// The fp32 master params, to write them: waits while a [`Snapshot`] holds the unit frozen.
    pub fn master(&mut self) -> Master<'_> {
        self.store.inner.frozen.wait(self.unit);
        self.master_at(self.ptr(ShardKind::Params))
    }

    /// The params shard's bytes as stored (fp32, or both planes with their padding), to read or
    /// replace them whole (ZeRO stage 1: a unit's updated params from the rank that updated
    /// it): waits while a [`Snapshot`] holds the unit frozen.
    pub fn params_bytes(&mut self) -> &mut [u8] {
        self.store.inner.frozen.wait(self.unit);
        let len = self
            .store
            .layout()
            .shard_bytes(self.unit, ShardKind::Params);
        match self.ptr(ShardKind::Params) {
            // SAFETY: the params shard is `len` bytes (`shard_bytes`), lives as long as the
            // store, and this guard is the unit's only accessor (`&mut self`; no snapshot reads
            // it: it is thawed).
            Some(p) => unsafe { std::slice::from_raw_parts_mut(p, len) },
            None => &mut [],
        }
    }

    /// The fp32 master params, to read them (a device copy of the weights): no wait, since a
    /// snapshot only reads them too.
    pub fn master_ref(&self) -> MasterRef<'_> {
        self.store.master_ref(self.unit)
    }

    /// The fp32 grads, in exact mode.
    pub fn grads(&mut self) -> Option<&mut [f32]> {
        self.f32_view(ShardKind::Grads)
    }
}

impl Drop for UnitGuard {
    fn drop(&mut self) {
        self.store.inner.busy[self.unit].store(false, Ordering::Release);
    }
}

/// Where each of a unit's shards lies (by [`ShardKind::index`]); `None` when spilled.
type UnitLocs = [Option<ShardLoc>; ShardKind::COUNT];

/// One region per (NUMA node, shard kind) holding that kind's resident shards on that node back
/// to back (streamed kinds registered with the device), and where each unit's shards lie.
fn allocate_regions(
    layout: &StateLayout,
    placement: &Placement,
    opts: &StoreOptions,
) -> Result<(Vec<Region>, Vec<UnitLocs>)> {
    // One region per (node, kind): each kind's shards for that node, back to back.
    let mut sizes: BTreeMap<(u32, ShardKind), usize> = BTreeMap::new();
    let mut locs = vec![[None; ShardKind::COUNT]; layout.units.len()];
    let mut pending: Vec<(usize, ShardKind, (u32, ShardKind), usize)> = Vec::new();
    let spill_plan = &placement.spill;
    let spilled = |u: usize, k: ShardKind| {
        spill_plan
            .as_ref()
            .is_some_and(|p| p.kinds.contains(&k) && p.units.contains(&u))
    };
    for u in 0..layout.units.len() {
        for k in layout.kinds() {
            if spilled(u, k) || !layout.holds(u, k) {
                continue;
            }
            let node = placement.node_of(u, k).ok_or_else(|| {
                Error::bad_input(
                    "placement",
                    format!("unit {u}"),
                    format!("no node for {}", k.name()),
                    None,
                )
            })?;
            let size = sizes.entry((node, k)).or_insert(0);
            pending.push((u, k, (node, k), *size));
            *size += layout.shard_bytes(u, k);
        }
    }
    let keys: Vec<(u32, ShardKind)> = sizes.keys().copied().collect();
    let mut regions = Vec::with_capacity(keys.len());
    let total = sizes.values().map(|&b| b as u64).sum();
    let meter = Meter::start("placement", total, Unit::Bytes);
    for &(node, kind) in &keys {
        let cpus = placement
            .nodes
            .iter()
            .find(|n| n.node == node)
            .map(|n| n.adam_cpus.clone())
            .unwrap_or_default();
        let mut region = Region::allocate(RegionSpec {
            label: format!("{} on NUMA node {node}", kind.name()),
            bytes: sizes[&(node, kind)],
            node: (!opts.unbound).then_some(node),
            prefault_cpus: cpus,
            pages: opts.pages,
            lock: opts.lock,
        })?;
        let streamed = matches!(kind, ShardKind::Params | ShardKind::Grads);
        if let (Some(r), true) = (&opts.registrar, streamed) {
            // Copies are per shard: the region is page-locked in pieces cut at shard starts.
            let cuts: Vec<usize> = pending
                .iter()
                .filter(|(_, _, key, _)| *key == (node, kind))
                .map(|(_, _, _, offset)| *offset)
                .collect();
            region.register_pieces(r.0.as_ref(), &cuts)?;
        }
        meter.add(sizes[&(node, kind)] as u64);
        regions.push(region);
    }
    meter.finish();
    for (u, k, key, offset) in pending {
        let region = keys.iter().position(|x| *x == key).unwrap_or(0);
        locs[u][k.index()] = Some(ShardLoc { region, offset });
    }
    Ok((regions, locs))
}

/// The NVMe tier for the units and kinds `placement` spills (only Adam m and v may), or none.
fn open_spill_tier(
    layout: &StateLayout,
    placement: &Placement,
    opts: &StoreOptions,
) -> Result<Option<SpillTier>> {
    match (&placement.spill, &opts.spill) {
        (None, _) => Ok(None),
        (Some(_), None) => Err(Error::bad_input(
            "placement",
            "NVMe spill",
            "the placement spills optimizer state but no spill directory was given",
            Some("pass --nvme DIR (one per NVMe device)"),
        )),
        (Some(p), Some(o)) => {
            let cpus = placement
                .nodes
                .iter()
                .find(|n| n.node == p.node)
                .map(|n| n.adam_cpus.clone())
                .unwrap_or_default();
            if let Some(k) = p
                .kinds
                .iter()
                .find(|k| !matches!(k, ShardKind::AdamM | ShardKind::AdamV))
            {
                return Err(Error::bad_input(
                    "spill",
                    k.name(),
                    "only Adam m and v can spill (the GPU streams the other shards every step)",
                    Some("spill m and v"),
                ));
            }
            let tier_units: Vec<TierUnit> = p
                .units
                .iter()
                .map(|&u| {
                    let unit = &layout.units[u];
                    TierUnit {
                        unit: u,
                        label: unit.kind.describe(),
                        shards: p
                            .kinds
                            .iter()
                            .map(|&k| (k.name(), layout.shard_bytes(u, k)))
                            .collect(),
                    }
                })
                .collect();
            Ok(Some(SpillTier::create(
                &tier_units,
                layout.units.len(),
                &TierConfig {
                    io: SpillConfig {
                        dirs: o.dirs.clone(),
                        extent_bytes: o.extent_bytes,
                        extents: 0,
                        engine: o.engine,
                        direct: o.direct,
                        queue_depth: o.queue_depth,
                        run_id: o.run_id.clone(),
                    },
                    slots: p.slots,
                    node: (!opts.unbound).then_some(p.node),
                    cpus,
                    pages: opts.pages,
                },
            )?))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::layout::Mode;
    use super::placement::{place, RamBudget};
    use super::*;
    use crate::model::config::ModelConfig;
    use crate::topology::{probe, TopologySource};

    /// A 3-layer store of `mode`, placed on this machine.
    pub(super) fn store(mode: Mode) -> HostStore {
        let cfg = ModelConfig::from_json_str(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":300}"#,
            "t",
        )
        .unwrap();
        let layout = StateLayout::new(&cfg, mode);
        let machine = probe(&TopologySource::Live).unwrap();
        let p = place(&machine, &layout, None, RamBudget::default()).unwrap();
        HostStore::allocate(layout, p, &StoreOptions::default()).unwrap()
    }

    /// ZeRO stage 1: a rank maps only the moments of the units it holds; another rank's units
    /// have no moment views, and their params are whole (what a broadcast replaces).
    #[test]
    fn a_rank_maps_only_the_moments_it_holds() {
        let whole = store(Mode::Exact);
        let layout = whole.layout().clone();
        let mut mapped = 0u64;
        for rank in 0..2 {
            let owners = layout::UnitOwners::deal(&layout, 2, rank);
            let mine = layout.clone().with_owners(owners.clone());
            let machine = probe(&TopologySource::Live).unwrap();
            let p = place(&machine, &mine, None, RamBudget::default()).unwrap();
            let s = HostStore::allocate(mine, p, &StoreOptions::default()).unwrap();
            assert!(s.mapped_bytes() < whole.mapped_bytes());
            mapped += s.mapped_bytes();
            for u in 0..s.num_units() {
                let mut g = s.take(u).unwrap();
                let sh = g.shards().unwrap();
                let n = s.layout().adam.moment_bytes_unaligned(sh.params.len());
                match owners.holds(u) {
                    true => assert_eq!((sh.m.len(), sh.v.len()), (n, n)),
                    false => assert!(sh.m.is_empty() && sh.v.is_empty()),
                }
            }
        }
        // The two ranks together map the moments once and the rest twice.
        let moments = whole.layout().kind_bytes(ShardKind::AdamM)
            + whole.layout().kind_bytes(ShardKind::AdamV);
        assert_eq!(mapped, 2 * whole.mapped_bytes() - moments);
    }

    /// A params shard's bytes carry the whole master: copied into another store's (what the
    /// ZeRO stage 1 broadcast does), both planes of a bf16-planes master arrive, every bit.
    #[test]
    fn params_bytes_carry_both_planes() {
        let planes = |seed: u64| {
            let l = store(Mode::Exact)
                .layout()
                .clone()
                .with_master(MasterFormat::Planes);
            let machine = probe(&TopologySource::Live).unwrap();
            let p = place(&machine, &l, None, RamBudget::default()).unwrap();
            let s = HostStore::allocate(l, p, &StoreOptions::default()).unwrap();
            for u in 0..s.num_units() {
                let mut g = s.take(u).unwrap();
                let n = g.numel();
                g.master()
                    .write(0, &crate::util::uniform(n, seed + u as u64, 3.0));
            }
            s
        };
        let (from, to) = (planes(1), planes(2));
        for u in 0..from.num_units() {
            let (mut a, mut b) = (from.take(u).unwrap(), to.take(u).unwrap());
            assert_ne!(a.master().to_vec(), b.master().to_vec());
            b.params_bytes().copy_from_slice(a.params_bytes());
            let (x, y) = (a.master().to_vec(), b.master().to_vec());
            assert!(
                x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()),
                "unit {u}"
            );
        }
    }

    /// A registrar that records each registration's start, length and liveness (the CUDA one
    /// cannot run here).
    #[derive(Debug, Default)]
    struct Recorder(Arc<std::sync::Mutex<Vec<(usize, usize, bool)>>>);
    #[derive(Debug)]
    struct Rec(Arc<std::sync::Mutex<Vec<(usize, usize, bool)>>>, usize);
    impl crate::host::region::Registration for Rec {}
    impl Drop for Rec {
        fn drop(&mut self) {
            self.0.lock().unwrap()[self.1].2 = false;
        }
    }
    impl HostRegistrar for Recorder {
        unsafe fn register(
            &self,
            ptr: std::ptr::NonNull<u8>,
            len: usize,
        ) -> Result<Box<dyn crate::host::region::Registration>> {
            let mut v = self.0.lock().unwrap();
            v.push((ptr.as_ptr() as usize, len, true));
            Ok(Box::new(Rec(self.0.clone(), v.len() - 1)))
        }
    }

    /// With a device registrar, exactly the regions the device copies from and to are
    /// page-locked — every params and grads shard, no Adam moment — and released
    /// with the store.
    #[test]
    fn streamed_regions_are_registered_and_moments_are_not() {
        let cfg = ModelConfig::from_json_str(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":300}"#,
            "t",
        )
        .unwrap();
        let layout = StateLayout::new(&cfg, Mode::Exact);
        let machine = probe(&TopologySource::Live).unwrap();
        let p = place(&machine, &layout, None, RamBudget::default()).unwrap();
        let rec = Arc::new(Recorder::default());
        let log = rec.0.clone();
        let s = HostStore::allocate(
            layout.clone(),
            p,
            &StoreOptions {
                registrar: Some(SharedRegistrar(rec)),
                ..StoreOptions::default()
            },
        )
        .unwrap();
        let inside = |addr: usize| {
            log.lock()
                .unwrap()
                .iter()
                .any(|(a, l, live)| *live && addr >= *a && addr < a + l)
        };
        for u in 0..s.num_units() {
            let mut g = s.take(u).unwrap();
            let mut sh = g.shards().unwrap();
            assert!(
                inside(sh.params.as_fp32().unwrap().as_ptr() as usize),
                "params of unit {u}"
            );
            assert!(
                inside(sh.grads.unwrap().as_ptr() as usize),
                "grads of unit {u}"
            );
            assert!(
                !inside(sh.m.as_ptr() as usize),
                "Adam m of unit {u} is not streamed"
            );
            assert!(
                !inside(sh.v.as_ptr() as usize),
                "Adam v of unit {u} is not streamed"
            );
        }
        drop(s);
        assert!(
            log.lock().unwrap().iter().all(|r| !r.2),
            "every registration released with the store"
        );
    }

    #[test]
    fn guards_are_exclusive_and_shards_disjoint() {
        let s = store(Mode::Exact);
        let mut g = s.take(1).unwrap();
        assert!(s.take(1).is_err());
        let other = s.take(2).unwrap();
        let mut sh = g.shards().unwrap();
        let n = sh.params.len();
        sh.params.write(0, &vec![1.0; n]);
        sh.grads.unwrap().fill(2.0);
        sh.m.fill(3);
        sh.v.fill(4);
        let sh = g.shards().unwrap();
        assert!(sh.params.to_vec().iter().all(|x| *x == 1.0));
        assert!(sh.v.iter().all(|x| *x == 4));
        assert_eq!(n, g.numel());
        drop(g);
        assert!(s.take(1).is_ok());
        drop(other);
        assert!(s.take(99).is_err());
    }

    /// A planes master holds any fp32 values exactly, its two planes lie inside the params
    /// shard without touching the next unit's, and the high plane is the bf16 rounding.
    #[test]
    fn planes_master_holds_fp32_exactly() {
        let cfg = ModelConfig::from_json_str(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":300}"#,
            "t",
        )
        .unwrap();
        let layout = StateLayout::new(&cfg, Mode::Exact).with_master(MasterFormat::Planes);
        let machine = probe(&TopologySource::Live).unwrap();
        let p = place(&machine, &layout, None, RamBudget::default()).unwrap();
        let s = HostStore::allocate(layout, p, &StoreOptions::default()).unwrap();
        let values: Vec<Vec<f32>> = (0..s.num_units())
            .map(|u| crate::util::uniform(s.layout().units[u].numel, u as u64, 5.0))
            .collect();
        for (u, x) in values.iter().enumerate() {
            let mut g = s.take(u).unwrap();
            let mut m = g.master();
            assert!(m.as_fp32().is_none());
            m.write(0, x);
            // Every other shard of the unit written over: the planes share no byte with them.
            let sh = g.shards().unwrap();
            sh.m.fill(0xff);
            sh.v.fill(0xff);
            sh.grads.unwrap().fill(f32::NAN);
        }
        for (u, x) in values.iter().enumerate() {
            let mut g = s.take(u).unwrap();
            let mut m = g.master();
            assert_eq!(&m.to_vec(), x, "unit {u}");
            let mut part = vec![0f32; 10];
            m.read(7, &mut part);
            assert_eq!(part, x[7..17]);
            let hi = m.hi_plane().unwrap();
            for (h, v) in hi.iter().zip(x) {
                assert_eq!(*h, planes::split(*v).0);
            }
        }
    }

    #[test]
    fn shards_are_resident_where_planned() {
        let s = store(Mode::Lean);
        for u in 0..s.num_units() {
            for k in s.layout().kinds() {
                let planned = s.placement().node_of(u, k).unwrap();
                assert_eq!(s.resident_node(u, k).unwrap(), planned);
            }
        }
        assert!(s.take(0).unwrap().grads().is_none());
    }
}
