//! Adam moments in compact formats ([`AdamState`]): bf16 written with stochastic rounding, and
//! 8-bit blockwise dynamic quantisation (Dettmers et al., arXiv 2110.02861, the algorithm of
//! bitsandbytes' 8-bit Adam). The master weights stay exact fp32; only m and v are compact.
//!
//! The update of a compact range goes tile by tile ([`INT8_BLOCK`] elements from the unit's
//! start): the tile's moments are expanded to fp32 in a scratch buffer, the fp32 AdamW kernel of
//! [`super::adamw`] (scalar or SIMD, bit-identical to each other) updates params and moments, and
//! the moments are compressed back. Expansion and compression are the same code for every ISA,
//! so every ISA's compact update is bit-identical to the scalar one; the scratch stays in L1, so
//! memory traffic is the compact bytes.
//!
//! - **bf16**: `bits + r16 >> 16`, `r16` the high 16 bits of a counter hash of (the element's
//!   index in the unit, a salt of seed, step, unit and moment): stochastic rounding that is
//!   unbiased and reproducible element by element (resumed runs are bit-identical).
//! - **int8**: per block, one fp32 absmax and one code per element into bitsandbytes' dynamic
//!   map (signed for m, unsigned for v); dequantise, update in fp32, take the block's new absmax,
//!   requantise each element to the nearest map value (ties to the lower), except that a positive
//!   v never becomes 0 ([`unsigned`]: the algorithm's known blow-up on rarely seen rows). A block
//!   whose absmax is 0 is all zeros, so zeroed memory is zero moments in every format.

use super::adamw::{self, AdamSlices, Isa, StepScalars};
use crate::store::layout::{AdamState, INT8_BLOCK};
use crate::store::Master;
use std::ops::Range;
use std::sync::OnceLock;

mod codec;

/// Elements per tile of a bf16 update.
const BF16_TILE: usize = 512;

/// bitsandbytes' `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`, computed in
/// f64 and rounded to f32, sorted: 127 magnitudes per sign (2^i linearly spaced means of
/// [0.1, 1] per decade 10^-6 … 10^0), 0 and 1 for the signed map; 254 magnitudes, 0 and 1 for the
/// unsigned one.
fn dynamic_map(signed: bool) -> [f32; 256] {
    let mut data: Vec<f64> = Vec::with_capacity(256);
    for i in 0..7i32 {
        let items = if signed {
            (1usize << i) + 1
        } else {
            (1usize << (i + 1)) + 1
        };
        let bounds: Vec<f64> = (0..items)
            .map(|k| 0.1 + 0.9 * k as f64 / (items - 1) as f64)
            .collect();
        let scale = 10f64.powi(i - 6);
        for w in bounds.windows(2) {
            let mean = (w[0] + w[1]) / 2.0;
            data.push(scale * mean);
            if signed {
                data.push(-scale * mean);
            }
        }
    }
    data.push(0.0);
    data.push(1.0);
    let mut v: Vec<f32> = data.iter().map(|&x| x as f32).collect();
    v.resize(256, 0.0);
    v.sort_by(f32::total_cmp);
    let mut out = [0f32; 256];
    out.copy_from_slice(&v);
    out
}

/// Nearest-value quantisation into one sorted 256-entry map.
#[derive(Debug)]
pub struct Quantizer {
    values: [f32; 256],
    /// Midpoints between consecutive values, then +∞: the code of `x` is how many are below it.
    mids: [f32; 256],
    /// For the top 16 bits of `x`'s order-preserving key: the midpoints below that bucket.
    /// No bucket holds more than one midpoint (tested), so one comparison finishes the search.
    /// Three bytes of padding let a 32-bit gather read the last entry.
    lut: Vec<u8>,
}

/// `x`'s bits, mapped so that unsigned order is float order.
fn order_key(x: f32) -> u32 {
    let b = x.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

impl Quantizer {
    /// `zero_is_exact`: only 0 itself takes the code of 0 (`values[0]`); the smallest positive
    /// value rounds up to `values[1]` instead of down to 0.
    fn new(values: [f32; 256], zero_is_exact: bool) -> Self {
        let mut mids = [f32::INFINITY; 256];
        for i in 0..255 {
            mids[i] = ((f64::from(values[i]) + f64::from(values[i + 1])) / 2.0) as f32;
        }
        if zero_is_exact {
            mids[0] = 0.0;
        }
        let mut lut: Vec<u8> = (0..1u32 << 16)
            .map(|k| mids[..255].partition_point(|m| order_key(*m) < k << 16) as u8)
            .collect();
        lut.extend([0; 3]);
        Quantizer { values, mids, lut }
    }

    /// The map's value of `code`.
    #[inline]
    pub fn value(&self, code: u8) -> f32 {
        self.values[usize::from(code)]
    }

    /// The code of the value nearest `x` (ties to the lower): the number of midpoints below `x`
    /// (for a NaN: its key's bucket, a code like any other; its block's absmax is a NaN).
    #[inline(always)]
    pub fn code(&self, x: f32) -> u8 {
        let c = self.lut[(order_key(x) >> 16) as usize];
        c + u8::from(self.mids[usize::from(c)] < x)
    }

    /// The reference definition of [`Quantizer::code`]: a binary search.
    pub fn code_reference(&self, x: f32) -> u8 {
        self.mids[..255].partition_point(|m| *m < x) as u8
    }
}

/// The signed map (Adam m), nearest value.
pub fn signed() -> &'static Quantizer {
    static Q: OnceLock<Quantizer> = OnceLock::new();
    Q.get_or_init(|| Quantizer::new(dynamic_map(true), false))
}

/// The unsigned map (Adam v), nearest value except that a positive v never becomes 0: it rounds
/// up to the map's smallest positive value (3.25e-7 of its block's absmax) at least. With the
/// plain nearest rounding of bitsandbytes' CUDA kernel and torchao's AdamW8bit, a v below
/// 1.6e-7 of its block's absmax (a gradient 4e-4 of the block's largest) is stored as 0 while m
/// keeps its value, and the next step without gradient moves the weight by lr·m̂/ε: measured
/// 180·lr with torchao (tools/int8_adam_blowup.py; exact AdamW: ≤ 1·lr). Excluding 0 from v's
/// reachable values is what torchao's 4-bit AdamW does for the same reason (its v map has no
/// 0; Li et al., arXiv 2309.01507, "the zero-point problem"); it only ever overestimates a tiny
/// v, which shrinks that element's step.
pub fn unsigned() -> &'static Quantizer {
    static Q: OnceLock<Quantizer> = OnceLock::new();
    Q.get_or_init(|| Quantizer::new(dynamic_map(false), true))
}

/// A 32-bit integer hash (lowbias32): the stochastic-rounding generator.
#[inline(always)]
pub fn hash32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^= x >> 16;
    x
}

/// The stochastic-rounding salts of one unit's update at one step, for m and for v: the same
/// seed, step and unit give the same rounding, so runs and resumed runs are bit-identical.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Salts {
    /// For m.
    pub m: u32,
    /// For v.
    pub v: u32,
}

impl Salts {
    /// The salts of unit `unit`'s update at step `step` of a run seeded `seed`.
    pub fn new(seed: u64, step: u64, unit: usize) -> Self {
        let s = hash32(seed as u32 ^ hash32((seed >> 32) as u32))
            ^ hash32(step as u32 ^ 0x9e37_79b9)
            ^ hash32((step >> 32) as u32 ^ 0x85eb_ca6b)
            ^ hash32(unit as u32 ^ 0xc2b2_ae35);
        Salts {
            m: hash32(s ^ 0x6d6d_6d6d),
            v: hash32(s ^ 0x7676_7676),
        }
    }
}

/// `x` to bf16 with stochastic rounding by the 16 random bits `r`: rounded away from zero with
/// probability (dropped bits)/2^16. NaN stays a quiet NaN; ±Inf stays.
/// Written without branches, so that loops over it vectorise.
#[inline(always)]
pub fn bf16_stochastic(x: f32, r: u32) -> u16 {
    let b = x.to_bits();
    let magnitude = b & 0x7fff_ffff;
    let noise = if magnitude >= 0x7f80_0000 { 0 } else { r >> 16 };
    let rounded = (b.wrapping_add(noise) >> 16) as u16;
    if magnitude > 0x7f80_0000 {
        rounded | 0x0040
    } else {
        rounded
    }
}

/// Bytes the AdamW update moves per parameter with moments stored as `state`: reads p, g, m, v
/// and writes p, m, v (28 B fp32, 20 B bf16, ≈ 16 B int8 with its block scales read and
/// written). At the memory-bandwidth limit, the update's time is proportional to it.
pub fn update_bytes_per_param(state: AdamState) -> f64 {
    let moment = match state {
        AdamState::Fp32 => 4.0,
        AdamState::Bf16 => 2.0,
        AdamState::Int8 => 1.0 + 4.0 / INT8_BLOCK as f64,
    };
    12.0 + 4.0 * moment
}

/// A unit's master params, as the update addresses them (element `i` of the unit).
#[derive(Debug, Clone, Copy)]
pub enum ParamPtr {
    /// fp32 values.
    Fp32(*mut f32),
    /// The high and low planes ([`crate::store::planes`]).
    Planes {
        /// High (bf16-rounded) halves.
        hi: *mut u16,
        /// Low halves.
        lo: *mut u16,
    },
}

impl ParamPtr {
    /// Where `master`'s elements are.
    pub fn of(master: &mut Master<'_>) -> Self {
        match master {
            Master::Fp32(p) => ParamPtr::Fp32(p.as_mut_ptr()),
            Master::Planes { hi, lo } => ParamPtr::Planes {
                hi: hi.as_mut_ptr(),
                lo: lo.as_mut_ptr(),
            },
        }
    }

    /// Elements `start..start + dst.len()` (one tile) as fp32 (planes only: fp32 params are
    /// updated in place).
    ///
    /// # Safety
    /// As [`step_range`].
    unsafe fn expand(self, isa: Isa, start: usize, dst: &mut [f32]) {
        let n = dst.len();
        if let ParamPtr::Planes { hi, lo } = self {
            // SAFETY: the tile's elements of each plane.
            let (hi, lo) = unsafe {
                (
                    std::slice::from_raw_parts(hi.add(start), n),
                    std::slice::from_raw_parts(lo.add(start), n),
                )
            };
            codec::planes_join(isa, hi, lo, dst);
        }
    }

    /// As [`MomentPtr::tile`], for the params.
    ///
    /// # Safety
    /// As [`MomentPtr::tile`].
    unsafe fn tile(self, expanded: &mut [f32], start: usize, lo: usize, k: usize) -> &mut [f32] {
        match self {
            // SAFETY: the elements are inside the caller's range and no one else's.
            ParamPtr::Fp32(p) => unsafe { std::slice::from_raw_parts_mut(p.add(lo), k) },
            ParamPtr::Planes { .. } => &mut expanded[lo - start..lo - start + k],
        }
    }

    /// Store a tile's fp32 values back into the planes.
    ///
    /// # Safety
    /// As [`ParamPtr::expand`].
    unsafe fn compress(self, isa: Isa, start: usize, src: &[f32]) {
        let n = src.len();
        if let ParamPtr::Planes { hi, lo } = self {
            // SAFETY: the tile's elements of each plane (disjoint planes).
            let (hi, lo) = unsafe {
                (
                    std::slice::from_raw_parts_mut(hi.add(start), n),
                    std::slice::from_raw_parts_mut(lo.add(start), n),
                )
            };
            codec::planes_split(isa, src, hi, lo);
        }
    }
}

/// One moment (m or v) of a unit, as the update addresses it (element `i` of the unit).
#[derive(Debug, Clone, Copy)]
pub enum MomentPtr {
    /// fp32 values.
    Fp32(*mut f32),
    /// bf16 values, and the stochastic-rounding salt of this step.
    Bf16 { bits: *mut u16, salt: u32 },
    /// int8 codes, the per-block fp32 absmax, and the map (signed for m, unsigned for v).
    Int8 {
        codes: *mut u8,
        scales: *mut f32,
        map: &'static Quantizer,
    },
}

/// One unit's m and v.
#[derive(Debug, Clone, Copy)]
pub struct MomentPtrs {
    /// Adam m.
    pub m: MomentPtr,
    /// Adam v.
    pub v: MomentPtr,
}

impl MomentPtrs {
    /// The moments of a unit of `numel` elements stored as `state` in the shards at `m` and
    /// `v`, with this step's salts.
    pub fn new(state: AdamState, m: *mut u8, v: *mut u8, numel: usize, salts: Salts) -> Self {
        let one = |shard: *mut u8, salt: u32, map: &'static Quantizer| match state {
            AdamState::Fp32 => MomentPtr::Fp32(shard.cast()),
            AdamState::Bf16 => MomentPtr::Bf16 {
                bits: shard.cast(),
                salt,
            },
            AdamState::Int8 => MomentPtr::Int8 {
                codes: shard,
                // The scales region follows the codes, 64-byte aligned inside the shard.
                scales: shard
                    .wrapping_add(AdamState::int8_scales_offset(numel))
                    .cast(),
                map,
            },
        };
        MomentPtrs {
            m: one(m, salts.m, signed()),
            v: one(v, salts.v, unsigned()),
        }
    }
}

impl MomentPtr {
    /// Elements `start..start + dst.len()` (one tile) as fp32.
    ///
    /// # Safety
    /// As [`step_range`]; the tile lies within one int8 block.
    unsafe fn expand(self, isa: Isa, start: usize, dst: &mut [f32]) {
        let n = dst.len();
        match self {
            // Updated in place (`MomentPtr::tile`).
            MomentPtr::Fp32(_) => {}
            MomentPtr::Bf16 { bits, .. } => {
                // SAFETY: the tile's elements.
                let src = unsafe { std::slice::from_raw_parts(bits.add(start), n) };
                codec::bf16_expand(isa, src, dst);
            }
            MomentPtr::Int8 { codes, scales, map } => {
                // SAFETY: the tile's codes and its block's scale.
                let (src, absmax) = unsafe {
                    (
                        std::slice::from_raw_parts(codes.add(start), n),
                        scales.add(start / INT8_BLOCK).read(),
                    )
                };
                codec::int8_expand(isa, map, src, absmax, dst);
            }
        }
    }

    /// The fp32 values of elements `lo..lo + k` of the tile starting at element `start`: in
    /// place for fp32 moments, else in the tile's scratch `expanded`.
    ///
    /// # Safety
    /// As [`MomentPtr::expand`]; no other live slice covers these elements.
    unsafe fn tile(self, expanded: &mut [f32], start: usize, lo: usize, k: usize) -> &mut [f32] {
        match self {
            // SAFETY: the elements are inside the caller's range and no one else's.
            MomentPtr::Fp32(p) => unsafe { std::slice::from_raw_parts_mut(p.add(lo), k) },
            _ => &mut expanded[lo - start..lo - start + k],
        }
    }

    /// Store a tile's fp32 values back in the compact format.
    ///
    /// # Safety
    /// As [`MomentPtr::expand`].
    unsafe fn compress(self, isa: Isa, start: usize, src: &[f32]) {
        let n = src.len();
        match self {
            MomentPtr::Fp32(_) => {}
            MomentPtr::Bf16 { bits, salt } => {
                // SAFETY: the tile's elements.
                let dst = unsafe { std::slice::from_raw_parts_mut(bits.add(start), n) };
                codec::bf16_compress(isa, src, dst, start as u32, salt);
            }
            MomentPtr::Int8 { codes, scales, map } => {
                // SAFETY: the tile's codes.
                let dst = unsafe { std::slice::from_raw_parts_mut(codes.add(start), n) };
                let absmax = codec::int8_compress(isa, map, src, dst);
                // SAFETY: the tile's block's scale.
                unsafe { scales.add(start / INT8_BLOCK).write(absmax) };
            }
        }
    }
}

/// One piece of a unit with its step scalars (a tensor: decay differs per tensor).
#[derive(Debug, Clone)]
pub struct Piece<'a> {
    /// Elements of the unit.
    pub range: Range<usize>,
    /// Its scalars.
    pub scalars: &'a StepScalars,
}

/// AdamW over elements `range` of a unit whose params and moments are at `params` and `mom` and
/// whose raw gradients are at `g` (the gradient of element `range.start`), split into `pieces`
/// (sorted, tiling at least `range`). Returns Σ g_raw².
///
/// All fp32: one pass of the fp32 kernel per piece. Otherwise tile by tile: the compact parts
/// (bf16 planes, compact moments) are expanded to fp32 in L1-sized scratch, updated by the same
/// kernel, and stored back. Expanding and storing are integer operations, the same for every ISA,
/// so every ISA's update stays bit-identical to the scalar one.
///
/// # Safety
/// The pointers address a unit of at least `range.end` elements in the layout's format (`g`,
/// `range.len()` gradients); for
/// int8 `range.start` is a multiple of [`INT8_BLOCK`] and `range.end` one or the unit's end; no
/// one else touches the range (or its int8 blocks) meanwhile.
pub unsafe fn step_range(
    isa: Isa,
    params: ParamPtr,
    g: *const f32,
    mom: MomentPtrs,
    range: Range<usize>,
    pieces: &[Piece<'_>],
) -> f64 {
    let mut sumsq = 0.0;
    if let (ParamPtr::Fp32(p), MomentPtr::Fp32(m), MomentPtr::Fp32(v)) = (params, mom.m, mom.v) {
        for piece in pieces {
            let (lo, hi) = (
                piece.range.start.max(range.start),
                piece.range.end.min(range.end),
            );
            if lo >= hi {
                continue;
            }
            let n = hi - lo;
            // SAFETY: [lo, hi) is inside the caller's range.
            let x = unsafe {
                AdamSlices {
                    p: std::slice::from_raw_parts_mut(p.add(lo), n),
                    g: std::slice::from_raw_parts(g.add(lo - range.start), n),
                    m: std::slice::from_raw_parts_mut(m.add(lo), n),
                    v: std::slice::from_raw_parts_mut(v.add(lo), n),
                }
            };
            sumsq += adamw::step_with(isa, x, piece.scalars);
        }
        return sumsq;
    }
    // An int8 tile is one block (its absmax needs all of it); a bf16 tile is smaller, so that
    // the tile's params, gradients and fp32 moments stay in L1.
    let tile = match mom.m {
        MomentPtr::Int8 { .. } => INT8_BLOCK,
        _ => BF16_TILE,
    };
    let mut p32 = vec![0f32; tile];
    let mut m32 = vec![0f32; tile];
    let mut v32 = vec![0f32; tile];
    let mut start = range.start;
    while start < range.end {
        // Tiles end on multiples of the tile size from the unit's start (int8: its blocks).
        let end = ((start / tile + 1) * tile).min(range.end);
        let n = end - start;
        // SAFETY: [start, end) is inside the caller's range.
        unsafe {
            params.expand(isa, start, &mut p32[..n]);
            mom.m.expand(isa, start, &mut m32[..n]);
            mom.v.expand(isa, start, &mut v32[..n]);
        }
        for piece in pieces {
            let (lo, hi) = (piece.range.start.max(start), piece.range.end.min(end));
            if lo >= hi {
                continue;
            }
            let k = hi - lo;
            // SAFETY: as above; each of p, g, m, v is its own array (or scratch).
            let x = unsafe {
                AdamSlices {
                    p: params.tile(&mut p32, start, lo, k),
                    g: std::slice::from_raw_parts(g.add(lo - range.start), k),
                    m: mom.m.tile(&mut m32, start, lo, k),
                    v: mom.v.tile(&mut v32, start, lo, k),
                }
            };
            sumsq += adamw::step_with(isa, x, piece.scalars);
        }
        // SAFETY: as above.
        unsafe {
            params.compress(isa, start, &p32[..n]);
            mom.m.compress(isa, start, &m32[..n]);
            mom.v.compress(isa, start, &v32[..n]);
        }
        start = end;
    }
    sumsq
}

/// Moments of `numel` elements in `state` (the bytes of one moment shard) as fp32.
pub fn to_f32(state: AdamState, bytes: &[u8], numel: usize, signed_map: bool) -> Vec<f32> {
    let mut out = vec![0f32; numel];
    match state {
        AdamState::Fp32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        AdamState::Bf16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = adamw::bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        AdamState::Int8 => {
            let q = if signed_map { signed() } else { unsigned() };
            let off = AdamState::int8_scales_offset(numel);
            for (b, chunk) in out.chunks_mut(INT8_BLOCK).enumerate() {
                let s = &bytes[off + 4 * b..off + 4 * b + 4];
                let absmax = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                let codes = &bytes[b * INT8_BLOCK..b * INT8_BLOCK + chunk.len()];
                codec::int8_expand(Isa::Scalar, q, codes, absmax, chunk);
            }
        }
    }
    out
}

/// fp32 moments stored as `state` into `bytes` (one moment shard): fp32 as is, bf16 rounded to
/// nearest (a conversion, not an update: no noise), int8 quantised per block.
pub fn from_f32(state: AdamState, x: &[f32], bytes: &mut [u8], signed_map: bool) {
    match state {
        AdamState::Fp32 => {
            for (c, v) in bytes.chunks_exact_mut(4).zip(x) {
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        AdamState::Bf16 => {
            for (c, v) in bytes.chunks_exact_mut(2).zip(x) {
                c.copy_from_slice(&adamw::f32_to_bf16(*v).to_le_bytes());
            }
        }
        AdamState::Int8 => {
            let q = if signed_map { signed() } else { unsigned() };
            let off = AdamState::int8_scales_offset(x.len());
            let (codes, rest) = bytes.split_at_mut(off);
            for (b, chunk) in x.chunks(INT8_BLOCK).enumerate() {
                let absmax = codec::int8_compress(
                    Isa::Scalar,
                    q,
                    chunk,
                    &mut codes[b * INT8_BLOCK..b * INT8_BLOCK + chunk.len()],
                );
                rest[4 * b..4 * b + 4].copy_from_slice(&absmax.to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_have_bitsandbytes_shape() {
        let s = dynamic_map(true);
        let u = dynamic_map(false);
        assert_eq!(s.iter().filter(|x| **x < 0.0).count(), 127);
        assert_eq!(s.iter().filter(|x| **x > 0.0).count(), 128); // 127 + 1.0
        assert!(s.contains(&0.0) && s.contains(&1.0));
        assert!(u.iter().all(|x| *x >= 0.0));
        assert_eq!(u[255], 1.0);
        // The smallest nonzero magnitudes: the first decade's first mean, (0.1 + 0.55) / 2 · 1e-6
        // unsigned (3 boundaries), (0.1 + 1) / 2 · 1e-6 signed (2 boundaries).
        assert_eq!(u[1], 0.325e-6);
        assert_eq!(s[128], 0.55e-6);
        for w in s.windows(2).chain(u.windows(2)) {
            assert!(w[0] <= w[1]);
        }
    }

    /// The LUT's one comparison is a complete search only if no 16-bit key bucket holds two
    /// midpoints.
    #[test]
    fn no_lut_bucket_holds_two_midpoints() {
        for q in [signed(), unsigned()] {
            for w in q.mids[..255].windows(2) {
                assert_ne!(order_key(w[0]) >> 16, order_key(w[1]) >> 16, "{w:?}");
            }
            assert_eq!(q.mids[255], f32::INFINITY);
            assert_eq!(q.lut.len(), (1 << 16) + 3);
        }
    }

    #[test]
    fn fast_quantizer_equals_binary_search_everywhere() {
        for q in [signed(), unsigned()] {
            let mut x = 0x1234_5678u32;
            let check = |v: f32| assert_eq!(q.code(v), q.code_reference(v), "{v}");
            for &v in q.values.iter().chain(q.mids[..255].iter()) {
                check(v);
                check(f32::from_bits(v.to_bits() + 1));
                check(f32::from_bits(v.to_bits().saturating_sub(1)));
            }
            for _ in 0..200_000 {
                x = hash32(x);
                let v = (f64::from(x) / f64::from(u32::MAX) * 2.0 - 1.0) as f32;
                check(v);
                check(v * 1e-3);
                check(v * 1e-6);
            }
            for v in [
                0.0,
                -0.0,
                1.0,
                -1.0,
                2.0,
                -2.0,
                f32::MIN_POSITIVE,
                f32::INFINITY,
            ] {
                check(v);
            }
        }
    }

    #[test]
    fn stochastic_rounding_is_unbiased_and_exact_where_representable() {
        let x = 1.0f32 + 3.0 * 2f32.powi(-10); // between two bf16 values
        let (lo, hi) = (adamw::bf16_to_f32(0x3f80), adamw::bf16_to_f32(0x3f81));
        let n = 100_000;
        let mean: f64 = (0..n)
            .map(|i| f64::from(adamw::bf16_to_f32(bf16_stochastic(x, hash32(i)))))
            .sum::<f64>()
            / f64::from(n);
        assert!(lo < x && x < hi);
        assert!((mean - f64::from(x)).abs() < 2e-5, "{mean} vs {x}");
        for r in [0, 1, u32::MAX] {
            assert_eq!(bf16_stochastic(1.5, r), 0x3fc0);
            assert_eq!(bf16_stochastic(-2.0, r), 0xc000);
        }
        assert!(adamw::bf16_to_f32(bf16_stochastic(f32::NAN, 7)).is_nan());
        assert_eq!(bf16_stochastic(f32::INFINITY, u32::MAX), 0x7f80);
    }

    #[test]
    fn conversions_round_trip_within_each_format() {
        let x: Vec<f32> = (0..5000)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 1e-3)
            .collect();
        for state in [AdamState::Fp32, AdamState::Bf16, AdamState::Int8] {
            let mut bytes = vec![0u8; state.moment_bytes_unaligned(x.len())];
            from_f32(state, &x, &mut bytes, true);
            let y = to_f32(state, &bytes, x.len(), true);
            let tol = match state {
                AdamState::Fp32 => 0.0,
                AdamState::Bf16 => 1.0 / 128.0,
                AdamState::Int8 => 0.07,
            };
            for (a, b) in x.iter().zip(&y) {
                assert!(
                    (a - b).abs() <= tol * 0.05 + 1e-9 || (a - b).abs() <= tol * a.abs(),
                    "{state:?}: {a} → {b}"
                );
            }
        }
    }
}
