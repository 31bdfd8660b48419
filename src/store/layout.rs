//! The layer-major state layout: the model's units ([`crate::model::units`]) and, for each, the
//! shards the host store keeps (fp32 params, fp32 grads in exact mode, Adam m, Adam v), with their
//! byte sizes. The tensors sit at the same offsets in every shard kind, so one index addresses a
//! parameter, its gradient and its moments. Every shard starts on a 4 KiB boundary (DMA and
//! O_DIRECT).

use crate::host::SHARD_ALIGN;
use crate::model::config::ModelConfig;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub use crate::model::units::{
    block_tensors, units, TensorSpec, UnitKind, UnitLayout, TENSOR_ALIGN_ELEMS,
};

/// Gradient-exact or lean.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// fp32 gradients of every unit are kept until the step's global norm is known: exact
    /// global-norm clipping, 16 B/param.
    #[default]
    Exact,
    /// Each unit's gradients are consumed by AdamW as they land, from a few reused buffers:
    /// 12 B/param, clipping is not global.
    Lean,
}

impl Mode {
    /// The name the flag takes.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Exact => "exact",
            Mode::Lean => "lean",
        }
    }
}

/// How the Adam moments m and v are stored (`--adam-state`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum AdamState {
    /// fp32 moments: exactly `torch.optim.AdamW`, 8 B/param of moments.
    #[default]
    Fp32,
    /// bf16 moments written with stochastic rounding (seeded, reproducible per element):
    /// 4 B/param of moments.
    Bf16,
    /// 8-bit blockwise dynamic quantisation (Dettmers et al., bitsandbytes' 8-bit Adam): one
    /// code per element and one fp32 absmax per block of [`INT8_BLOCK`] elements, ≈ 2 B/param
    /// of moments.
    Int8,
}

/// Elements per quantisation block of [`AdamState::Int8`] moments (blocks run over the unit's
/// flat shard, from its start).
pub const INT8_BLOCK: usize = 2048;

impl AdamState {
    /// The name the flag takes.
    pub fn name(self) -> &'static str {
        match self {
            AdamState::Fp32 => "fp32",
            AdamState::Bf16 => "bf16",
            AdamState::Int8 => "int8",
        }
    }

    /// The formats more compact than this one, least compact first.
    pub fn more_compact(self) -> Vec<AdamState> {
        let all: &[AdamState] = clap::ValueEnum::value_variants();
        all.iter()
            .skip_while(|s| **s != self)
            .skip(1)
            .copied()
            .collect()
    }

    /// Bytes one moment of `numel` elements takes (before shard alignment).
    pub fn moment_bytes_unaligned(self, numel: usize) -> usize {
        match self {
            AdamState::Fp32 => 4 * numel,
            AdamState::Bf16 => 2 * numel,
            AdamState::Int8 => Self::int8_scales_offset(numel) + 4 * numel.div_ceil(INT8_BLOCK),
        }
    }

    /// [`AdamState::Int8`]: where a moment shard's fp32 block scales start (after its codes).
    pub fn int8_scales_offset(numel: usize) -> usize {
        numel.div_ceil(64) * 64
    }
}

/// How the fp32 master parameters are stored (the precision the device streams decides).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum MasterFormat {
    /// One fp32 array: the device streams fp32.
    #[default]
    Fp32,
    /// Two 16-bit planes ([`crate::store::planes`]): the bf16-rounded high halves, which the
    /// device streams, then the low halves that make each value exact fp32. Same 4 B/param.
    Planes,
}

impl MasterFormat {
    /// The name the flag takes.
    pub fn name(self) -> &'static str {
        match self {
            MasterFormat::Fp32 => "fp32",
            MasterFormat::Planes => "planes",
        }
    }
}

/// The kinds of per-unit shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardKind {
    /// fp32 master parameters.
    Params,
    /// fp32 gradients (exact mode).
    Grads,
    /// Adam first moment.
    AdamM,
    /// Adam second moment.
    AdamV,
}

impl ShardKind {
    /// All kinds, in storage order.
    pub const ALL: [ShardKind; 4] = [
        ShardKind::Params,
        ShardKind::Grads,
        ShardKind::AdamM,
        ShardKind::AdamV,
    ];

    /// How many kinds there are (the length of per-kind arrays).
    pub const COUNT: usize = 4;

    /// Index into per-kind arrays.
    pub fn index(self) -> usize {
        self as usize
    }

    /// Short name for messages.
    pub fn name(self) -> &'static str {
        match self {
            ShardKind::Params => "params",
            ShardKind::Grads => "grads",
            ShardKind::AdamM => "adam_m",
            ShardKind::AdamV => "adam_v",
        }
    }
}

/// Where a named tensor lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorLoc {
    /// Index into [`StateLayout::units`].
    pub unit: usize,
    /// Index into that unit's `tensors`.
    pub index: usize,
}

/// ZeRO stage 3: host buffers another rank's params are gathered into (one per device weight
/// buffer).
pub const GATHER_BUFFERS: usize = 2;

/// ZeRO stage 3 with sharded gradients: host buffers another rank's unit's gradients land in.
pub const LANDING_BUFFERS: usize = 2;

/// The whole layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateLayout {
    /// The model.
    pub config: ModelConfig,
    /// Exact or lean.
    pub mode: Mode,
    /// How Adam m and v are stored.
    #[serde(default)]
    pub adam: AdamState,
    /// How the fp32 master parameters are stored.
    #[serde(default)]
    pub master: MasterFormat,
    /// Units in streaming order: embedding, blocks 0..L-1, head.
    pub units: Vec<UnitLayout>,
    /// HF tensor name → location.
    pub manifest: BTreeMap<String, TensorLoc>,
    /// Data parallel with the state sharded (`--zero-stage 1|3`): which rank holds and
    /// updates each unit's moments (and params, stage 3); `None`: this process holds every
    /// unit's.
    #[serde(default)]
    pub owners: Option<UnitOwners>,
}

/// ZeRO across data-parallel ranks, unit by unit: each unit's Adam moments live on one rank,
/// which alone updates the unit. Stage 1 ([`UnitOwners::params`] false): every rank keeps every
/// unit's params, and the owner sends the others its update at the end of a step. Stage 3: the
/// params live on the owner only, and every rank takes a unit's params from it each time its
/// device needs them ([`crate::engine::schedule::Op::Gather`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitOwners {
    /// This process's rank.
    pub rank: usize,
    /// The rank that holds each unit's moments.
    pub owner: Vec<usize>,
    /// Stage 3: the params live only on their unit's owner too.
    #[serde(default)]
    pub params: bool,
    /// Stage 3 in exact mode: the gradient shards too (each micro-batch's gradients of a unit
    /// land in one of [`LANDING_BUFFERS`] host buffers, are summed across the ranks there,
    /// added to the owner's shard and dropped elsewhere).
    #[serde(default)]
    pub grads: bool,
    /// Stage 3: the devices gather the params themselves — the owner copies a unit to its
    /// device and the device's collective engine (NCCL) broadcasts it to the others' — so no
    /// host buffer receives another rank's params ([`StateLayout::gather_buffer_bytes`] is
    /// zero). Else every rank takes them through host memory.
    #[serde(default)]
    pub device_gather: bool,
}

impl UnitOwners {
    /// `layout`'s units dealt to `ranks` ranks, as rank `rank` sees it: largest unit first
    /// (ties: the lower index), each to the rank holding the fewest moment elements so far
    /// (ties: the lower rank) — every rank computes the same deal.
    pub fn deal(layout: &StateLayout, ranks: usize, rank: usize) -> Self {
        let ranks = ranks.max(1);
        let mut order: Vec<usize> = (0..layout.units.len()).collect();
        order.sort_by_key(|&u| (std::cmp::Reverse(layout.units[u].numel), u));
        let mut load = vec![0usize; ranks];
        let mut owner = vec![0usize; layout.units.len()];
        for u in order {
            let r = (0..ranks).min_by_key(|&r| (load[r], r)).unwrap_or(0);
            owner[u] = r;
            load[r] += layout.units[u].numel;
        }
        UnitOwners {
            rank,
            owner,
            params: false,
            grads: false,
            device_gather: false,
        }
    }

    /// These owners with the params gathered by the devices (stage 3 on GPUs with NCCL).
    pub fn with_device_gather(self) -> Self {
        UnitOwners {
            device_gather: self.params,
            ..self
        }
    }

    /// These owners holding the gradients too (ZeRO stage 3, exact mode).
    pub fn with_grads(self) -> Self {
        UnitOwners {
            grads: true,
            ..self
        }
    }

    /// The owners of the rank that holds the most bytes of `layout` (its moments, its params
    /// when `params`, its gradients when `grads`): where a sharded job fits if it fits at all.
    pub fn fullest(layout: &StateLayout, ranks: usize, (params, grads): (bool, bool)) -> Self {
        let deal = |r: usize| {
            let o = UnitOwners::deal(layout, ranks, r);
            let o = if params { o.with_params() } else { o };
            if grads {
                o.with_grads()
            } else {
                o
            }
        };
        let held = |o: &UnitOwners| -> u64 {
            let l = layout.clone().with_owners(o.clone());
            l.total_bytes()
        };
        (1..ranks.max(1))
            .map(deal)
            .fold(deal(0), |best, o| match held(&o) > held(&best) {
                true => o,
                false => best,
            })
    }

    /// These owners holding the params too (ZeRO stage 3).
    pub fn with_params(self) -> Self {
        UnitOwners {
            params: true,
            ..self
        }
    }

    /// Whether this rank holds `unit`'s moments.
    pub fn holds(&self, unit: usize) -> bool {
        self.owner.get(unit) == Some(&self.rank)
    }
}

impl StateLayout {
    /// Lay out `config`'s state.
    pub fn new(config: &ModelConfig, mode: Mode) -> Self {
        let units = units(config);
        let manifest = units
            .iter()
            .enumerate()
            .flat_map(|(u, unit)| {
                unit.tensors
                    .iter()
                    .enumerate()
                    .map(move |(index, t)| (t.name.clone(), TensorLoc { unit: u, index }))
            })
            .collect();
        StateLayout {
            config: config.clone(),
            mode,
            adam: AdamState::Fp32,
            master: MasterFormat::Fp32,
            units,
            manifest,
            owners: None,
        }
    }

    /// This layout with each unit's moments held only by the rank `owners` names.
    pub fn with_owners(self, owners: UnitOwners) -> Self {
        StateLayout {
            owners: Some(owners),
            ..self
        }
    }

    /// Whether this process holds (and updates) `unit`'s Adam moments.
    pub fn holds_moments(&self, unit: usize) -> bool {
        self.owners.as_ref().is_none_or(|o| o.holds(unit))
    }

    /// Whether this process holds `unit`'s params (all but another rank's under ZeRO stage 3).
    pub fn holds_params(&self, unit: usize) -> bool {
        self.owners
            .as_ref()
            .is_none_or(|o| !o.params || o.holds(unit))
    }

    /// Whether this process keeps `unit`'s gradient shard (exact mode; all but another rank's
    /// when the gradients are sharded).
    pub fn holds_grads(&self, unit: usize) -> bool {
        self.mode == Mode::Exact
            && self
                .owners
                .as_ref()
                .is_none_or(|o| !o.grads || o.holds(unit))
    }

    /// Whether a unit's gradients land in a landing buffer each micro-batch and are summed
    /// there (ZeRO stage 3, exact mode).
    pub fn lands_grads(&self) -> bool {
        self.mode == Mode::Exact && self.owners.as_ref().is_some_and(|o| o.grads)
    }

    /// Whether the params are sharded across ranks (ZeRO stage 3): a unit another rank holds
    /// is gathered from it each time the device needs it.
    pub fn gathers_params(&self) -> bool {
        self.owners.as_ref().is_some_and(|o| o.params)
    }

    /// Whether the devices gather the params ([`UnitOwners::device_gather`]).
    pub fn gathers_on_device(&self) -> bool {
        self.owners
            .as_ref()
            .is_some_and(|o| o.params && o.device_gather)
    }

    /// The rank holding `unit`'s moments (and, stage 3, params); 0 where nothing is sharded.
    pub fn owner(&self, unit: usize) -> usize {
        self.owners
            .as_ref()
            .and_then(|o| o.owner.get(unit).copied())
            .unwrap_or(0)
    }

    /// Whether this process keeps `unit`'s shard of `kind`.
    pub fn holds(&self, unit: usize, kind: ShardKind) -> bool {
        self.has(kind)
            && match kind {
                ShardKind::AdamM | ShardKind::AdamV => self.holds_moments(unit),
                ShardKind::Params => self.holds_params(unit),
                ShardKind::Grads => self.holds_grads(unit),
            }
    }

    /// Bytes of unit `unit`'s params the device streams: fp32, or the high plane of
    /// [`MasterFormat::Planes`] (what a stage-3 gather moves).
    pub fn streamed_bytes(&self, unit: usize) -> usize {
        let n = self.units[unit].numel;
        match self.master {
            MasterFormat::Fp32 => 4 * n,
            MasterFormat::Planes => 2 * n,
        }
    }

    /// This layout with the moments stored as `adam`.
    pub fn with_adam_state(self, adam: AdamState) -> Self {
        StateLayout { adam, ..self }
    }

    /// This layout with the master parameters stored as `master`.
    pub fn with_master(self, master: MasterFormat) -> Self {
        StateLayout { master, ..self }
    }

    /// [`MasterFormat::Planes`]: the byte offset of unit `unit`'s low plane in its params shard
    /// (the high plane starts the shard; each plane starts on a [`SHARD_ALIGN`] boundary).
    pub fn lo_plane_offset(&self, unit: usize) -> usize {
        (2 * self.units[unit].numel).div_ceil(SHARD_ALIGN).max(1) * SHARD_ALIGN
    }

    /// Bytes of unit `unit`'s shard of `kind` (a multiple of [`SHARD_ALIGN`]; 0 for moments,
    /// or stage 3 params, another rank holds).
    pub fn shard_bytes(&self, unit: usize, kind: ShardKind) -> usize {
        let u = &self.units[unit];
        match kind {
            // Another rank's (ZeRO stage 3).
            ShardKind::Params if !self.holds_params(unit) => 0,
            ShardKind::Grads if !self.holds_grads(unit) => 0,
            ShardKind::Params if self.master == MasterFormat::Planes => {
                2 * self.lo_plane_offset(unit)
            }
            ShardKind::Params | ShardKind::Grads => u.shard_bytes(),
            // Another rank's (ZeRO stage 1).
            ShardKind::AdamM | ShardKind::AdamV if !self.holds_moments(unit) => 0,
            ShardKind::AdamM | ShardKind::AdamV => {
                self.adam
                    .moment_bytes_unaligned(u.numel)
                    .div_ceil(SHARD_ALIGN)
                    .max(1)
                    * SHARD_ALIGN
            }
        }
    }

    /// Bytes of unit `unit`'s two moments (what spilling it moves to NVMe).
    pub fn moment_bytes(&self, unit: usize) -> u64 {
        (self.shard_bytes(unit, ShardKind::AdamM) + self.shard_bytes(unit, ShardKind::AdamV)) as u64
    }

    /// Whether shards of `kind` exist in this layout.
    pub fn has(&self, kind: ShardKind) -> bool {
        match kind {
            ShardKind::Grads => self.mode == Mode::Exact,
            _ => true,
        }
    }

    /// The shard kinds this layout keeps.
    pub fn kinds(&self) -> impl Iterator<Item = ShardKind> + '_ {
        ShardKind::ALL.into_iter().filter(|k| self.has(*k))
    }

    /// Look up a tensor by HF name.
    pub fn tensor(&self, name: &str) -> Result<(usize, &TensorSpec)> {
        let loc = self.manifest.get(name).ok_or_else(|| {
            Error::bad_input("tensor name", name, "not a parameter of this model", None)
        })?;
        Ok((loc.unit, &self.units[loc.unit].tensors[loc.index]))
    }

    /// Real parameters of the model.
    pub fn num_params(&self) -> usize {
        self.units.iter().map(|u| u.params).sum()
    }

    /// Bytes of all shards of `kind`.
    pub fn kind_bytes(&self, kind: ShardKind) -> u64 {
        if !self.has(kind) {
            return 0;
        }
        (0..self.units.len())
            .map(|u| self.shard_bytes(u, kind) as u64)
            .sum()
    }

    /// Largest unit, in elements.
    pub fn max_unit_numel(&self) -> usize {
        self.units.iter().map(|u| u.numel).max().unwrap_or(0)
    }

    /// Lean mode's gradient piece, in elements: the largest decoder block (a multiple of
    /// [`INT8_BLOCK`], so pieces start on whole int8 blocks), or the largest unit when that is
    /// smaller. A unit larger than this (a big vocabulary's embedding or head) leaves the device
    /// and is updated piece by piece, so the lean buffers never hold more than a block.
    pub fn lean_piece_elems(&self) -> usize {
        let block = self.units[1..self.units.len().saturating_sub(1).max(1)]
            .iter()
            .map(|u| u.numel)
            .max()
            .unwrap_or(0);
        block
            .div_ceil(INT8_BLOCK)
            .max(1)
            .saturating_mul(INT8_BLOCK)
            .min(self.max_unit_numel())
            .max(1)
    }

    /// How many lean pieces unit `unit` is updated in (1 for every unit in exact mode).
    pub fn lean_pieces(&self, unit: usize) -> usize {
        match self.mode {
            Mode::Exact => 1,
            Mode::Lean => self.units[unit]
                .numel
                .div_ceil(self.lean_piece_elems())
                .max(1),
        }
    }

    /// The elements of piece `piece` of unit `unit` ([`StateLayout::lean_pieces`]).
    pub fn lean_piece(&self, unit: usize, piece: usize) -> std::ops::Range<usize> {
        let numel = self.units[unit].numel;
        let size = match self.mode {
            Mode::Exact => numel,
            Mode::Lean => self.lean_piece_elems(),
        };
        (piece * size).min(numel)..((piece + 1) * size).min(numel)
    }

    /// Lean mode's reusable gradient buffers: two of one piece (one being filled by the device,
    /// one being consumed by AdamW). Zero in exact mode.
    pub fn lean_grad_buffer_bytes(&self) -> u64 {
        match self.mode {
            Mode::Exact => 0,
            Mode::Lean => {
                2 * ((self.lean_piece_elems() * 4).div_ceil(SHARD_ALIGN) * SHARD_ALIGN) as u64
            }
        }
    }

    /// Bytes of a checkpoint's tensor files: fp32 params (whatever the master's format) and
    /// Adam m and v as held — the job's, every unit's, whichever rank holds its moments.
    pub fn checkpoint_bytes(&self) -> u64 {
        self.units
            .iter()
            .map(|u| 4 * u.numel as u64 + 2 * self.adam.moment_bytes_unaligned(u.numel) as u64)
            .sum()
    }

    /// ZeRO stage 3: the host buffers another rank's params are gathered into, one per device
    /// weight buffer, each of the largest unit's streamed bytes. Zero otherwise, and where the
    /// devices gather.
    pub fn gather_buffer_bytes(&self) -> u64 {
        if !self.gathers_params() || self.gathers_on_device() {
            return 0;
        }
        let largest = (0..self.units.len())
            .map(|u| self.streamed_bytes(u))
            .max()
            .unwrap_or(0);
        (GATHER_BUFFERS * largest.div_ceil(SHARD_ALIGN).max(1) * SHARD_ALIGN) as u64
    }

    /// ZeRO stage 3 with sharded gradients: the host buffers another rank's unit's gradients
    /// land in, each of the largest unit's fp32 bytes. Zero otherwise.
    pub fn landing_buffer_bytes(&self) -> u64 {
        match self.lands_grads() {
            true => {
                (LANDING_BUFFERS
                    * (4 * self.max_unit_numel()).div_ceil(SHARD_ALIGN).max(1)
                    * SHARD_ALIGN) as u64
            }
            false => 0,
        }
    }

    /// All host bytes the state needs.
    pub fn total_bytes(&self) -> u64 {
        self.kinds().map(|k| self.kind_bytes(k)).sum::<u64>()
            + self.lean_grad_buffer_bytes()
            + self.gather_buffer_bytes()
            + self.landing_buffer_bytes()
    }

    /// Host bytes per parameter.
    pub fn bytes_per_param(&self) -> f64 {
        self.total_bytes() as f64 / self.num_params().max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(tied: bool, layers: usize) -> ModelConfig {
        let json = format!(
            r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":4096,"intermediate_size":14336,
            "num_hidden_layers":{layers},"num_attention_heads":32,"num_key_value_heads":8,
            "vocab_size":128256,"tie_word_embeddings":{tied}}}"#
        );
        ModelConfig::from_json_str(&json, "t").unwrap()
    }

    #[test]
    fn compact_formats_follow_in_order() {
        use AdamState::*;
        assert_eq!(Fp32.more_compact(), [Bf16, Int8]);
        assert_eq!(Bf16.more_compact(), [Int8]);
        assert!(Int8.more_compact().is_empty());
    }

    #[test]
    fn manifest_covers_every_parameter_once() {
        let c = cfg(false, 4);
        let l = StateLayout::new(&c, Mode::Exact);
        assert_eq!(l.num_params(), c.num_params());
        assert_eq!(l.units.len(), 4 + 2);
        assert_eq!(l.manifest.len(), 1 + 4 * 9 + 2);
        let (u, t) = l.tensor("model.layers.2.mlp.down_proj.weight").unwrap();
        assert_eq!(u, 3);
        assert_eq!(t.shape, vec![4096, 14336]);
        assert!(l.tensor("lm_head.bias").is_err());
        for unit in &l.units {
            for w in unit.tensors.windows(2) {
                assert!(w[0].offset + w[0].numel() <= w[1].offset);
                assert_eq!(w[1].offset % TENSOR_ALIGN_ELEMS, 0);
            }
            assert_eq!(unit.shard_bytes() % SHARD_ALIGN, 0);
        }
    }

    #[test]
    fn bytes_per_param_exact_and_lean() {
        let c = cfg(false, 32);
        let exact = StateLayout::new(&c, Mode::Exact).bytes_per_param();
        let lean = StateLayout::new(&c, Mode::Lean);
        assert!((exact - 16.0).abs() < 0.01, "{exact}");
        // 12 B/param plus two buffers of one block (218M params), not of the 0.5B-param
        // embedding: Llama-3-8B lean is 12.22 B/param.
        let block = lean.units[1].numel;
        assert_eq!(
            lean.lean_piece_elems(),
            block.div_ceil(INT8_BLOCK) * INT8_BLOCK
        );
        let b = lean.bytes_per_param();
        assert!(b > 12.0 && b < 12.3, "{b}");
        // The embedding and head go in three pieces that tile them; blocks in one.
        for u in [0, 33] {
            let n = lean.lean_pieces(u);
            assert_eq!(n, 3, "unit {u}");
            let pieces: Vec<_> = (0..n).map(|p| lean.lean_piece(u, p)).collect();
            assert_eq!(pieces[0].start, 0);
            assert_eq!(pieces[n - 1].end, lean.units[u].numel);
            for w in pieces.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert_eq!(w[1].start % INT8_BLOCK, 0);
            }
        }
        assert_eq!(lean.lean_pieces(5), 1);
        assert_eq!(lean.lean_piece(5, 0), 0..block);
        let exact = StateLayout::new(&c, Mode::Exact);
        assert_eq!(exact.lean_pieces(0), 1);
        assert_eq!(exact.lean_piece(0, 0), 0..exact.units[0].numel);
    }

    #[test]
    fn planes_take_the_bytes_of_fp32() {
        let c = cfg(false, 32);
        for mode in [Mode::Exact, Mode::Lean] {
            let fp32 = StateLayout::new(&c, mode);
            let planes = fp32.clone().with_master(MasterFormat::Planes);
            for u in 0..fp32.units.len() {
                let (a, b) = (
                    fp32.shard_bytes(u, ShardKind::Params),
                    planes.shard_bytes(u, ShardKind::Params),
                );
                // At most one alignment page more per unit (each plane starts on a page).
                assert!(b >= a && b <= a + SHARD_ALIGN, "unit {u}: {a} vs {b}");
                assert_eq!(planes.lo_plane_offset(u) % SHARD_ALIGN, 0);
                assert!(planes.lo_plane_offset(u) >= 2 * planes.units[u].numel);
            }
            let d = planes.bytes_per_param() - fp32.bytes_per_param();
            assert!((0.0..1e-4).contains(&d), "{mode:?}: {d}");
        }
    }

    /// Every rank deals the same owners; each unit's moments are held once; the ranks' loads
    /// differ by at most the largest unit; a layout's moment bytes are its held units'.
    #[test]
    fn owners_deal_every_unit_once_and_balance_the_moments() {
        let l = StateLayout::new(&cfg(false, 6), Mode::Exact);
        let moments =
            |l: &StateLayout| l.kind_bytes(ShardKind::AdamM) + l.kind_bytes(ShardKind::AdamV);
        let largest = l.max_unit_numel();
        for ranks in 1..=9 {
            let deals: Vec<UnitOwners> =
                (0..ranks).map(|r| UnitOwners::deal(&l, ranks, r)).collect();
            let mut sum = 0;
            let mut loads = Vec::new();
            for d in &deals {
                assert_eq!(d.owner, deals[0].owner);
                let mine = l.clone().with_owners(d.clone());
                sum += moments(&mine);
                loads.push(
                    (0..l.units.len())
                        .filter(|&u| d.holds(u))
                        .map(|u| l.units[u].numel)
                        .sum::<usize>(),
                );
                for u in 0..l.units.len() {
                    assert_eq!(mine.holds(u, ShardKind::AdamM), d.holds(u));
                    assert!(mine.holds(u, ShardKind::Params) && mine.holds(u, ShardKind::Grads));
                }
            }
            for u in 0..l.units.len() {
                assert_eq!(deals.iter().filter(|d| d.holds(u)).count(), 1, "unit {u}");
            }
            assert_eq!(sum, moments(&l), "{ranks} ranks");
            let (lo, hi) = (loads.iter().min().unwrap(), loads.iter().max().unwrap());
            assert!(hi - lo <= largest, "{ranks} ranks: {loads:?}");
        }
    }

    /// Stage 3: a rank keeps its units' params (and, exact mode with sharded gradients, their
    /// gradients) and none of the others', each kept by exactly one rank; its buffers are two of
    /// the largest unit's (gathered params as streamed, landed fp32 gradients).
    #[test]
    fn stage_3_ranks_keep_their_units_and_buffers_for_the_others() {
        for (mode, master) in [
            (Mode::Exact, MasterFormat::Fp32),
            (Mode::Exact, MasterFormat::Planes),
            (Mode::Lean, MasterFormat::Fp32),
        ] {
            let l = StateLayout::new(&cfg(false, 5), mode).with_master(master);
            let whole = |k: ShardKind| l.kind_bytes(k);
            let ranks = 3;
            let mine: Vec<StateLayout> = (0..ranks)
                .map(|r| {
                    let o = UnitOwners::deal(&l, ranks, r).with_params();
                    let o = if mode == Mode::Exact {
                        o.with_grads()
                    } else {
                        o
                    };
                    l.clone().with_owners(o)
                })
                .collect();
            for k in ShardKind::ALL {
                let sum: u64 = mine.iter().map(|m| m.kind_bytes(k)).sum();
                assert_eq!(sum, whole(k), "{mode:?} {master:?} {k:?}");
                for u in 0..l.units.len() {
                    let held = mine.iter().filter(|m| m.holds(u, k)).count();
                    assert_eq!(held, l.has(k) as usize, "{mode:?} unit {u} {k:?}");
                }
            }
            let m = &mine[0];
            assert!(m.gathers_params());
            assert_eq!(m.lands_grads(), mode == Mode::Exact);
            let streamed = match master {
                MasterFormat::Fp32 => 4,
                MasterFormat::Planes => 2,
            } * l.max_unit_numel();
            let aligned = |b: usize| (b.div_ceil(SHARD_ALIGN) * SHARD_ALIGN) as u64;
            assert_eq!(m.gather_buffer_bytes(), 2 * aligned(streamed));
            let on_device = l
                .clone()
                .with_owners(m.owners.clone().unwrap().with_device_gather());
            assert!(on_device.gathers_on_device());
            assert_eq!(on_device.gather_buffer_bytes(), 0);
            let landing = match mode {
                Mode::Exact => 2 * aligned(4 * l.max_unit_numel()),
                Mode::Lean => 0,
            };
            assert_eq!(m.landing_buffer_bytes(), landing);
            assert!(m.total_bytes() < l.total_bytes());
        }
    }

    #[test]
    fn tied_embedding_has_no_lm_head() {
        let l = StateLayout::new(&cfg(true, 2), Mode::Exact);
        assert!(l.tensor("lm_head.weight").is_err());
        assert_eq!(l.units.last().unwrap().tensors.len(), 1);
    }
}
