//! One tile of compact moments to fp32 and back: the scalar reference, and the AVX2 and AVX-512
//! paths, bit-identical to it (integer operations and single IEEE multiplies and comparisons
//! only, in the same order; tested on random tiles for every ISA this CPU has).
//!
//! The bf16 codecs and the int8 absmax are the scalar code compiled for the ISA (the compiler
//! vectorises them); the int8 codes and their expansion gather from the quantiser's tables with
//! explicit intrinsics. On aarch64 every codec has a NEON path in intrinsics (NEON has no gather:
//! the int8 table lookups are per lane, the arithmetic around them in vectors).

use super::{bf16_stochastic, hash32, Quantizer};
use crate::optim::adamw::{self, Isa};
use crate::store::planes;

/// bf16 moments of a tile as fp32.
pub fn bf16_expand(isa: Isa, src: &[u16], dst: &mut [f32]) {
    match usable(isa) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx512f is present (checked by `usable`).
        Isa::Avx512 => unsafe { x86::bf16_expand_avx512(src, dst) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx2 is present (checked by `usable`).
        Isa::Avx2 => unsafe { x86::bf16_expand_avx2(src, dst) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: neon is present (checked by `usable`).
        Isa::Neon => unsafe { neon::bf16_expand(src, dst) },
        _ => scalar::bf16_expand(src, dst),
    }
}

/// A tile's fp32 moments as bf16 with stochastic rounding: element `i` of the tile (element
/// `index0 + i` of the unit) rounds by `hash32((index0 + i) ^ salt)`.
pub fn bf16_compress(isa: Isa, src: &[f32], dst: &mut [u16], index0: u32, salt: u32) {
    match usable(isa) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx512f is present (checked by `usable`).
        Isa::Avx512 => unsafe { x86::bf16_compress_avx512(src, dst, index0, salt) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx2 is present (checked by `usable`).
        Isa::Avx2 => unsafe { x86::bf16_compress_avx2(src, dst, index0, salt) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: neon is present (checked by `usable`).
        Isa::Neon => unsafe { neon::bf16_compress(src, dst, index0, salt) },
        _ => scalar::bf16_compress(src, dst, index0, salt),
    }
}

/// A tile of a planes master as fp32 ([`crate::store::planes::join`]).
pub fn planes_join(isa: Isa, hi: &[u16], lo: &[u16], dst: &mut [f32]) {
    match usable(isa) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx512f is present (checked by `usable`).
        Isa::Avx512 => unsafe { x86::planes_join_avx512(hi, lo, dst) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx2 is present (checked by `usable`).
        Isa::Avx2 => unsafe { x86::planes_join_avx2(hi, lo, dst) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: neon is present (checked by `usable`).
        Isa::Neon => unsafe { neon::planes_join(hi, lo, dst) },
        _ => scalar::planes_join(hi, lo, dst),
    }
}

/// A tile's fp32 values into a planes master ([`crate::store::planes::split`]).
pub fn planes_split(isa: Isa, src: &[f32], hi: &mut [u16], lo: &mut [u16]) {
    match usable(isa) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx512f is present (checked by `usable`).
        Isa::Avx512 => unsafe { x86::planes_split_avx512(src, hi, lo) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx2 is present (checked by `usable`).
        Isa::Avx2 => unsafe { x86::planes_split_avx2(src, hi, lo) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: neon is present (checked by `usable`).
        Isa::Neon => unsafe { neon::planes_split(src, hi, lo) },
        _ => scalar::planes_split(src, hi, lo),
    }
}

/// A tile's int8 codes as fp32: `q.value(code) · absmax`.
pub fn int8_expand(isa: Isa, q: &Quantizer, codes: &[u8], absmax: f32, dst: &mut [f32]) {
    match usable(isa) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx512f is present (checked by `usable`).
        Isa::Avx512 => unsafe { x86::int8_expand_avx512(q, codes, absmax, dst) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx2 is present (checked by `usable`).
        Isa::Avx2 => unsafe { x86::int8_expand_avx2(q, codes, absmax, dst) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: neon is present (checked by `usable`).
        Isa::Neon => unsafe { neon::int8_expand(q, codes, absmax, dst) },
        _ => scalar::int8_expand(q, codes, absmax, dst, 0),
    }
}

/// Quantise one block: returns its absmax (the largest magnitude's bits, so a NaN in the block
/// makes it a NaN: the moments carry it, as in bitsandbytes) and writes each element's code for
/// `x · (1 / absmax)`; a block of zeros is absmax 0 and the code of 0.
pub fn int8_compress(isa: Isa, q: &Quantizer, x: &[f32], codes: &mut [u8]) -> f32 {
    let isa = usable(isa);
    let absmax = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx512f is present (checked by `usable`).
        Isa::Avx512 => unsafe { x86::absmax_avx512(x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx2 is present (checked by `usable`).
        Isa::Avx2 => unsafe { x86::absmax_avx2(x) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: neon is present (checked by `usable`).
        Isa::Neon => unsafe { neon::absmax(x) },
        _ => scalar::absmax(x),
    };
    if absmax == 0.0 {
        codes.fill(q.code(0.0));
        return 0.0;
    }
    let inv = 1.0 / absmax;
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx512f is present (checked by `usable`).
        Isa::Avx512 => unsafe { x86::int8_codes_avx512(q, x, inv, codes) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx2 is present (checked by `usable`).
        Isa::Avx2 => unsafe { x86::int8_codes_avx2(q, x, inv, codes) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: neon is present (checked by `usable`).
        Isa::Neon => unsafe { neon::int8_codes(q, x, inv, codes) },
        _ => scalar::int8_codes(q, x, inv, codes, 0),
    }
    absmax
}

/// `isa` if this CPU has it, else the scalar code.
fn usable(isa: Isa) -> Isa {
    if adamw::supported(isa) {
        isa
    } else {
        Isa::Scalar
    }
}

/// The reference: one element at a time, from element `from` (the SIMD paths' tails).
mod scalar {
    use super::*;

    #[inline(always)]
    pub fn bf16_expand(src: &[u16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = adamw::bf16_to_f32(*s);
        }
    }

    #[inline(always)]
    pub fn planes_join(hi: &[u16], lo: &[u16], dst: &mut [f32]) {
        for ((d, h), l) in dst.iter_mut().zip(hi).zip(lo) {
            *d = planes::join(*h, *l);
        }
    }

    #[inline(always)]
    pub fn planes_split(src: &[f32], hi: &mut [u16], lo: &mut [u16]) {
        for ((x, h), l) in src.iter().zip(hi.iter_mut()).zip(lo.iter_mut()) {
            (*h, *l) = planes::split(*x);
        }
    }

    #[inline(always)]
    pub fn bf16_compress(src: &[f32], dst: &mut [u16], index0: u32, salt: u32) {
        for (i, (d, x)) in dst.iter_mut().zip(src).enumerate() {
            *d = bf16_stochastic(*x, hash32(index0.wrapping_add(i as u32) ^ salt));
        }
    }

    #[inline(always)]
    pub fn int8_expand(q: &Quantizer, codes: &[u8], absmax: f32, dst: &mut [f32], from: usize) {
        for (d, c) in dst[from..].iter_mut().zip(&codes[from..]) {
            *d = q.value(*c) * absmax;
        }
    }

    #[inline(always)]
    pub fn absmax(x: &[f32]) -> f32 {
        f32::from_bits(x.iter().fold(0u32, |a, v| a.max(v.to_bits() & 0x7fff_ffff)))
    }

    #[inline(always)]
    pub fn int8_codes(q: &Quantizer, x: &[f32], inv: f32, codes: &mut [u8], from: usize) {
        for (c, v) in codes[from..].iter_mut().zip(&x[from..]) {
            *c = q.code(*v * inv);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// The scalar code compiled for AVX2 and for AVX-512 (the compiler vectorises it).
    macro_rules! compiled_for {
        ($($name:ident: $feature:literal => $scalar:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)?;)*) => {$(
            #[target_feature(enable = $feature)]
            pub unsafe fn $name($($arg: $ty),*) $(-> $ret)? {
                scalar::$scalar($($arg),*)
            }
        )*};
    }

    compiled_for! {
        bf16_expand_avx2: "avx2" => bf16_expand(src: &[u16], dst: &mut [f32]);
        bf16_expand_avx512: "avx512f" => bf16_expand(src: &[u16], dst: &mut [f32]);
        bf16_compress_avx2: "avx2" => bf16_compress(src: &[f32], dst: &mut [u16], index0: u32, salt: u32);
        bf16_compress_avx512: "avx512f" => bf16_compress(src: &[f32], dst: &mut [u16], index0: u32, salt: u32);
        planes_join_avx2: "avx2" => planes_join(hi: &[u16], lo: &[u16], dst: &mut [f32]);
        planes_join_avx512: "avx512f" => planes_join(hi: &[u16], lo: &[u16], dst: &mut [f32]);
        planes_split_avx2: "avx2" => planes_split(src: &[f32], hi: &mut [u16], lo: &mut [u16]);
        planes_split_avx512: "avx512f" => planes_split(src: &[f32], hi: &mut [u16], lo: &mut [u16]);
        absmax_avx2: "avx2" => absmax(x: &[f32]) -> f32;
        absmax_avx512: "avx512f" => absmax(x: &[f32]) -> f32;
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn int8_expand_avx512(q: &Quantizer, codes: &[u8], absmax: f32, dst: &mut [f32]) {
        let n = dst.len().min(codes.len());
        let body = n - n % 16;
        let scale = _mm512_set1_ps(absmax);
        let mut i = 0;
        while i < body {
            // SAFETY: i + 16 ≤ n; codes are < 256, the length of `values`.
            unsafe {
                let c = _mm512_cvtepu8_epi32(_mm_loadu_si128(codes.as_ptr().add(i).cast()));
                let v = _mm512_i32gather_ps::<4>(c, q.values.as_ptr());
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_mul_ps(v, scale));
            }
            i += 16;
        }
        scalar::int8_expand(q, &codes[..n], absmax, &mut dst[..n], body);
    }

    #[target_feature(enable = "avx2")]
    pub unsafe fn int8_expand_avx2(q: &Quantizer, codes: &[u8], absmax: f32, dst: &mut [f32]) {
        let n = dst.len().min(codes.len());
        let body = n - n % 8;
        let scale = _mm256_set1_ps(absmax);
        let mut i = 0;
        while i < body {
            // SAFETY: i + 8 ≤ n; codes are < 256, the length of `values`.
            unsafe {
                let c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(codes.as_ptr().add(i).cast()));
                let v = _mm256_i32gather_ps::<4>(q.values.as_ptr(), c);
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_mul_ps(v, scale));
            }
            i += 8;
        }
        scalar::int8_expand(q, &codes[..n], absmax, &mut dst[..n], body);
    }

    /// [`Quantizer::code`] of `x · inv`, 16 lanes: the order key's top 16 bits index the LUT
    /// (a 32-bit gather at a byte offset, masked to its low byte: the LUT has 3 bytes of
    /// padding), then one comparison with the next midpoint.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn int8_codes_avx512(q: &Quantizer, x: &[f32], inv: f32, codes: &mut [u8]) {
        let n = x.len().min(codes.len());
        let body = n - n % 16;
        let (inv_v, sign, byte, one) = (
            _mm512_set1_ps(inv),
            _mm512_set1_epi32(i32::MIN),
            _mm512_set1_epi32(0xff),
            _mm512_set1_epi32(1),
        );
        let mut i = 0;
        while i < body {
            // SAFETY: i + 16 ≤ n; LUT offsets are < 2^16 and the LUT has 2^16 + 3 bytes; codes
            // are < 256, the length of `mids`.
            unsafe {
                let y = _mm512_mul_ps(_mm512_loadu_ps(x.as_ptr().add(i)), inv_v);
                let b = _mm512_castps_si512(y);
                let key = _mm512_xor_si512(b, _mm512_or_si512(_mm512_srai_epi32::<31>(b), sign));
                let slot = _mm512_srli_epi32::<16>(key);
                let c = _mm512_and_si512(
                    _mm512_i32gather_epi32::<1>(slot, q.lut.as_ptr().cast()),
                    byte,
                );
                let mid = _mm512_i32gather_ps::<4>(c, q.mids.as_ptr());
                let up = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(mid, y);
                let code = _mm512_mask_add_epi32(c, up, c, one);
                _mm_storeu_si128(codes.as_mut_ptr().add(i).cast(), _mm512_cvtepi32_epi8(code));
            }
            i += 16;
        }
        scalar::int8_codes(q, &x[..n], inv, &mut codes[..n], body);
    }

    /// As [`int8_codes_avx512`], 8 lanes.
    #[target_feature(enable = "avx2")]
    pub unsafe fn int8_codes_avx2(q: &Quantizer, x: &[f32], inv: f32, codes: &mut [u8]) {
        let n = x.len().min(codes.len());
        let body = n - n % 8;
        let (inv_v, sign, byte) = (
            _mm256_set1_ps(inv),
            _mm256_set1_epi32(i32::MIN),
            _mm256_set1_epi32(0xff),
        );
        let mut i = 0;
        while i < body {
            // SAFETY: as in `int8_codes_avx512`, with i + 8 ≤ n.
            unsafe {
                let y = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(i)), inv_v);
                let b = _mm256_castps_si256(y);
                let key = _mm256_xor_si256(b, _mm256_or_si256(_mm256_srai_epi32::<31>(b), sign));
                let slot = _mm256_srli_epi32::<16>(key);
                let c = _mm256_and_si256(
                    _mm256_i32gather_epi32::<1>(q.lut.as_ptr().cast(), slot),
                    byte,
                );
                let mid = _mm256_i32gather_ps::<4>(q.mids.as_ptr(), c);
                // All ones (−1) where the midpoint is below: subtracting adds 1.
                let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LT_OQ>(mid, y));
                let code = _mm256_sub_epi32(c, up);
                // 8 × u32 (each < 256) → 8 bytes: pack within each 128-bit lane, then join.
                let words = _mm256_packus_epi32(code, code);
                let bytes = _mm256_packus_epi16(words, words);
                let joined = _mm_unpacklo_epi32(
                    _mm256_castsi256_si128(bytes),
                    _mm256_extracti128_si256::<1>(bytes),
                );
                _mm_storel_epi64(codes.as_mut_ptr().add(i).cast(), joined);
            }
            i += 8;
        }
        scalar::int8_codes(q, &x[..n], inv, &mut codes[..n], body);
    }
}

/// NEON (aarch64): 8 lanes of u16 or two vectors of 4 f32/u32 per iteration, the tails by the
/// scalar reference. Integer operations, single IEEE multiplies and comparisons only, in the
/// reference's order, so every result is its bits.
#[cfg(target_arch = "aarch64")]
mod neon {
    use super::*;
    use std::arch::aarch64::*;

    #[target_feature(enable = "neon")]
    pub unsafe fn bf16_expand(src: &[u16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let body = n - n % 8;
        let mut i = 0;
        while i < body {
            // SAFETY: i + 8 ≤ n, the length of both slices' used part.
            unsafe {
                let h = vld1q_u16(src.as_ptr().add(i));
                let d = dst.as_mut_ptr().add(i);
                vst1q_u32(d.cast(), vshll_n_u16::<16>(vget_low_u16(h)));
                vst1q_u32(d.add(4).cast(), vshll_high_n_u16::<16>(h));
            }
            i += 8;
        }
        scalar::bf16_expand(&src[body..n], &mut dst[body..n]);
    }

    /// [`bf16_stochastic`] of 4 lanes whose element indices are `idx`.
    #[inline]
    #[target_feature(enable = "neon")]
    fn stochastic4(b: uint32x4_t, idx: uint32x4_t, salt: uint32x4_t) -> uint16x4_t {
        // hash32 (lowbias32) of idx ^ salt, as [`hash32`].
        let mut h = veorq_u32(idx, salt);
        h = veorq_u32(h, vshrq_n_u32::<16>(h));
        h = vmulq_u32(h, vdupq_n_u32(0x7feb_352d));
        h = veorq_u32(h, vshrq_n_u32::<15>(h));
        h = vmulq_u32(h, vdupq_n_u32(0x846c_a68b));
        h = veorq_u32(h, vshrq_n_u32::<16>(h));
        let magnitude = vandq_u32(b, vdupq_n_u32(0x7fff_ffff));
        let finite = vcltq_u32(magnitude, vdupq_n_u32(0x7f80_0000));
        let noise = vandq_u32(vshrq_n_u32::<16>(h), finite);
        let rounded = vshrq_n_u32::<16>(vaddq_u32(b, noise));
        let nan = vcgtq_u32(magnitude, vdupq_n_u32(0x7f80_0000));
        vmovn_u32(vorrq_u32(rounded, vandq_u32(nan, vdupq_n_u32(0x0040))))
    }

    #[target_feature(enable = "neon")]
    pub unsafe fn bf16_compress(src: &[f32], dst: &mut [u16], index0: u32, salt: u32) {
        let n = src.len().min(dst.len());
        let body = n - n % 8;
        let lanes: [u32; 4] = [0, 1, 2, 3];
        // SAFETY: a 4-element array.
        let lanes = unsafe { vld1q_u32(lanes.as_ptr()) };
        let salt_v = vdupq_n_u32(salt);
        let mut i = 0;
        while i < body {
            let idx = vaddq_u32(vdupq_n_u32(index0.wrapping_add(i as u32)), lanes);
            let idx_hi = vaddq_u32(idx, vdupq_n_u32(4));
            // SAFETY: i + 8 ≤ n, the length of both slices' used part.
            unsafe {
                let x = src.as_ptr().add(i).cast::<u32>();
                let lo = stochastic4(vld1q_u32(x), idx, salt_v);
                let hi = stochastic4(vld1q_u32(x.add(4)), idx_hi, salt_v);
                vst1q_u16(dst.as_mut_ptr().add(i), vcombine_u16(lo, hi));
            }
            i += 8;
        }
        scalar::bf16_compress(
            &src[body..n],
            &mut dst[body..n],
            index0.wrapping_add(body as u32),
            salt,
        );
    }

    #[target_feature(enable = "neon")]
    pub unsafe fn planes_join(hi: &[u16], lo: &[u16], dst: &mut [f32]) {
        let n = hi.len().min(lo.len()).min(dst.len());
        let body = n - n % 8;
        let mut i = 0;
        while i < body {
            // SAFETY: i + 8 ≤ n, the length of every slice's used part.
            unsafe {
                let h = vld1q_u16(hi.as_ptr().add(i));
                let l = vld1q_u16(lo.as_ptr().add(i));
                // All ones (−1) where lo > 0x8000: adding it takes the borrow from hi.
                let h = vaddq_u16(h, vcgtq_u16(l, vdupq_n_u16(0x8000)));
                // (lo, hi) pairs are little-endian u32s: hi << 16 | lo.
                let d = dst.as_mut_ptr().add(i).cast::<u16>();
                vst1q_u16(d, vzip1q_u16(l, h));
                vst1q_u16(d.add(8), vzip2q_u16(l, h));
            }
            i += 8;
        }
        scalar::planes_join(&hi[body..n], &lo[body..n], &mut dst[body..n]);
    }

    /// [`planes::split`] of 4 lanes: (hi, lo).
    #[inline]
    #[target_feature(enable = "neon")]
    fn split4(b: uint32x4_t) -> (uint16x4_t, uint16x4_t) {
        let magnitude = vandq_u32(b, vdupq_n_u32(0x7fff_ffff));
        let nan = vcgtq_u32(magnitude, vdupq_n_u32(0x7f80_0000));
        let quiet = vandq_u32(
            vorrq_u32(b, vdupq_n_u32(0x0040_0000)),
            vdupq_n_u32(0xffff_0000),
        );
        let b = vbslq_u32(nan, quiet, b);
        (
            vshrn_n_u32::<16>(vaddq_u32(b, vdupq_n_u32(0x7fff))),
            vmovn_u32(b),
        )
    }

    #[target_feature(enable = "neon")]
    pub unsafe fn planes_split(src: &[f32], hi: &mut [u16], lo: &mut [u16]) {
        let n = src.len().min(hi.len()).min(lo.len());
        let body = n - n % 8;
        let mut i = 0;
        while i < body {
            // SAFETY: i + 8 ≤ n, the length of every slice's used part.
            unsafe {
                let x = src.as_ptr().add(i).cast::<u32>();
                let (h0, l0) = split4(vld1q_u32(x));
                let (h1, l1) = split4(vld1q_u32(x.add(4)));
                vst1q_u16(hi.as_mut_ptr().add(i), vcombine_u16(h0, h1));
                vst1q_u16(lo.as_mut_ptr().add(i), vcombine_u16(l0, l1));
            }
            i += 8;
        }
        scalar::planes_split(&src[body..n], &mut hi[body..n], &mut lo[body..n]);
    }

    /// The largest magnitude's bits (max is order-free: the scalar fold's result).
    #[target_feature(enable = "neon")]
    pub unsafe fn absmax(x: &[f32]) -> f32 {
        let n = x.len();
        let body = n - n % 8;
        let mask = vdupq_n_u32(0x7fff_ffff);
        let (mut a0, mut a1) = (vdupq_n_u32(0), vdupq_n_u32(0));
        let mut i = 0;
        while i < body {
            // SAFETY: i + 8 ≤ n.
            unsafe {
                let p = x.as_ptr().add(i).cast::<u32>();
                a0 = vmaxq_u32(a0, vandq_u32(vld1q_u32(p), mask));
                a1 = vmaxq_u32(a1, vandq_u32(vld1q_u32(p.add(4)), mask));
            }
            i += 8;
        }
        let body_max = vmaxvq_u32(vmaxq_u32(a0, a1));
        f32::from_bits(body_max.max(scalar::absmax(&x[body..]).to_bits()))
    }

    /// `q.value(code) · absmax`: the values read per lane (no gather), multiplied 4 at a time.
    #[target_feature(enable = "neon")]
    pub unsafe fn int8_expand(q: &Quantizer, codes: &[u8], absmax: f32, dst: &mut [f32]) {
        let n = dst.len().min(codes.len());
        let body = n - n % 4;
        let scale = vdupq_n_f32(absmax);
        let mut i = 0;
        while i < body {
            let v = [
                q.value(codes[i]),
                q.value(codes[i + 1]),
                q.value(codes[i + 2]),
                q.value(codes[i + 3]),
            ];
            // SAFETY: a 4-element array; i + 4 ≤ n.
            unsafe {
                vst1q_f32(
                    dst.as_mut_ptr().add(i),
                    vmulq_f32(vld1q_f32(v.as_ptr()), scale),
                )
            };
            i += 4;
        }
        scalar::int8_expand(q, &codes[..n], absmax, &mut dst[..n], body);
    }

    /// [`Quantizer::code`] of `x · inv`, 4 lanes: the product, its order key and LUT slot in
    /// vectors, the LUT and midpoint reads per lane, the comparison in a vector.
    #[target_feature(enable = "neon")]
    pub unsafe fn int8_codes(q: &Quantizer, x: &[f32], inv: f32, codes: &mut [u8]) {
        let n = x.len().min(codes.len());
        let body = n - n % 4;
        let inv_v = vdupq_n_f32(inv);
        let sign = vdupq_n_u32(0x8000_0000);
        let (mut slots, mut c, mut mids) = ([0u32; 4], [0u32; 4], [0f32; 4]);
        let mut i = 0;
        while i < body {
            // SAFETY: i + 4 ≤ n; 4-element arrays.
            unsafe {
                let y = vmulq_f32(vld1q_f32(x.as_ptr().add(i)), inv_v);
                let b = vreinterpretq_u32_f32(y);
                let negative = vreinterpretq_u32_s32(vshrq_n_s32::<31>(vreinterpretq_s32_u32(b)));
                let key = veorq_u32(b, vorrq_u32(negative, sign));
                vst1q_u32(slots.as_mut_ptr(), vshrq_n_u32::<16>(key));
                for l in 0..4 {
                    c[l] = u32::from(q.lut[slots[l] as usize]);
                    mids[l] = q.mids[c[l] as usize];
                }
                // All ones (−1) where the midpoint is below: subtracting adds 1.
                let up = vcltq_f32(vld1q_f32(mids.as_ptr()), y);
                let code = vsubq_u32(vld1q_u32(c.as_ptr()), up);
                let bytes = vmovn_u16(vcombine_u16(vmovn_u32(code), vdup_n_u16(0)));
                let mut out = [0u8; 8];
                vst1_u8(out.as_mut_ptr(), bytes);
                codes[i..i + 4].copy_from_slice(&out[..4]);
            }
            i += 4;
        }
        scalar::int8_codes(q, &x[..n], inv, &mut codes[..n], body);
    }
}

#[cfg(test)]
mod tests {
    use super::super::{signed, unsigned};
    use super::*;

    fn random(n: usize, seed: u32, scale: f32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| {
                let h = hash32(i ^ seed);
                (f64::from(h) / f64::from(u32::MAX) * 2.0 - 1.0) as f32 * scale
            })
            .collect()
    }

    fn isas() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon]
            .into_iter()
            .filter(|i| adamw::supported(*i))
            .collect()
    }

    /// Every ISA equals the scalar reference bit for bit, on tiles of every length class
    /// (SIMD bodies and tails), on values across the maps' decades, with zeros, ±0, infinities
    /// and NaNs in some tiles.
    #[test]
    fn every_isa_equals_the_scalar_reference() {
        for (t, n) in [1usize, 7, 8, 15, 16, 17, 100, 2047, 2048]
            .into_iter()
            .enumerate()
        {
            for scale in [1.0f32, 1e-3, 1e-7, 3e4] {
                let mut x = random(n, t as u32 * 977 + scale.to_bits(), scale);
                if t % 3 == 1 {
                    x[n / 2] = 0.0;
                    x[n - 1] = -0.0;
                }
                if t == 5 {
                    x[3] = f32::INFINITY;
                }
                if t == 7 {
                    x[11] = f32::NAN;
                }
                let bits: Vec<u16> = x.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
                let mut want = (vec![0f32; n], vec![0u16; n], vec![0u8; n], vec![0f32; n]);
                scalar::bf16_expand(&bits, &mut want.0);
                scalar::bf16_compress(&x, &mut want.1, 12345, 0xdead_beef);
                let q = if t % 2 == 0 { signed() } else { unsigned() };
                let want_abs = int8_compress(Isa::Scalar, q, &x, &mut want.2);
                scalar::int8_expand(q, &want.2, want_abs, &mut want.3, 0);
                for isa in isas() {
                    let mut got = (vec![0f32; n], vec![0u16; n], vec![0u8; n], vec![0f32; n]);
                    bf16_expand(isa, &bits, &mut got.0);
                    bf16_compress(isa, &x, &mut got.1, 12345, 0xdead_beef);
                    let abs = int8_compress(isa, q, &x, &mut got.2);
                    int8_expand(isa, q, &got.2, abs, &mut got.3);
                    let f = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(f(&got.0), f(&want.0), "bf16 expand {isa:?} n={n}");
                    assert_eq!(got.1, want.1, "bf16 compress {isa:?} n={n}");
                    assert_eq!(abs.to_bits(), want_abs.to_bits(), "absmax {isa:?} n={n}");
                    assert_eq!(got.2, want.2, "int8 codes {isa:?} n={n} scale={scale}");
                    assert_eq!(f(&got.3), f(&want.3), "int8 expand {isa:?} n={n}");
                    // Planes: every ISA splits and joins as the element functions do.
                    let (mut hi, mut lo, mut back) = (vec![0u16; n], vec![0u16; n], vec![0f32; n]);
                    planes_split(isa, &x, &mut hi, &mut lo);
                    planes_join(isa, &hi, &lo, &mut back);
                    for (i, v) in x.iter().enumerate() {
                        assert_eq!((hi[i], lo[i]), planes::split(*v), "planes {isa:?} n={n}");
                        let b = planes::join(hi[i], lo[i]);
                        assert_eq!(back[i].to_bits(), b.to_bits(), "planes {isa:?} n={n}");
                    }
                }
            }
        }
    }

    /// The codes are the binary search's (the definition) on every ISA, also for values that
    /// land exactly on midpoints and one ulp either side.
    #[test]
    fn simd_codes_equal_the_binary_search() {
        for q in [signed(), unsigned()] {
            let mut x: Vec<f32> = q.mids[..255]
                .iter()
                .chain(q.values.iter())
                .flat_map(|m| {
                    [
                        *m,
                        f32::from_bits(m.to_bits() + 1),
                        f32::from_bits(m.to_bits().saturating_sub(1)),
                    ]
                })
                .collect();
            x.retain(|v| v.abs() <= 1.0);
            x.push(1.0);
            let want: Vec<u8> = x.iter().map(|v| q.code_reference(*v)).collect();
            for isa in isas() {
                let mut got = vec![0u8; x.len()];
                let abs = int8_compress(isa, q, &x, &mut got);
                assert_eq!(abs, 1.0);
                assert_eq!(got, want, "{isa:?}");
            }
        }
    }
}
