//! The fp32 master as two 16-bit planes: `hi`, the value rounded to bf16 (the copy that crosses
//! the link when the device computes in bf16), and `lo`, the fp32 pattern's low 16 bits, which
//! complete it. The planes take the fp32 master's 4 bytes per parameter and hold it exactly, so
//! the bf16 copy the device streams costs no host bytes and no extra write.
//!
//! `hi` is the nearest bf16, ties resolved toward the truncated value: the pattern's high half
//! is rounded up exactly when `lo > 0x8000`. So `join` subtracts that carry back:
//! `fp32_bits = ((hi − up) << 16) | lo` with `up = lo > 0x8000` (16-bit wrapping arithmetic).
//!
//! What every pattern does (`every_fp32_pattern_round_trips`, over all 2^32):
//! - finite values and ±0 round-trip exactly; `hi` is the nearest bf16, which for magnitudes at
//!   or past bf16's largest value plus half its ulp is ±Inf (as torch's `.bfloat16()` gives);
//! - ±Inf round-trips exactly and streams as ±Inf;
//! - a NaN is stored quieted with its low 16 payload bits dropped (what any arithmetic on it
//!   would give): it comes back a NaN of the same sign and high payload, and streams as a NaN,
//!   never as a number.

/// `x` as its (hi, lo) planes.
#[inline(always)]
pub fn split(x: f32) -> (u16, u16) {
    let b = x.to_bits();
    // A NaN: quiet it and drop the low half, so that rounding never carries it into ±0 or ±Inf.
    let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    let b = if nan {
        (b | 0x0040_0000) & 0xffff_0000
    } else {
        b
    };
    ((b.wrapping_add(0x7fff) >> 16) as u16, b as u16)
}

/// The fp32 value the planes (hi, lo) hold.
#[inline(always)]
pub fn join(hi: u16, lo: u16) -> f32 {
    let up = u16::from(lo > 0x8000);
    f32::from_bits((u32::from(hi.wrapping_sub(up)) << 16) | u32::from(lo))
}

/// The bf16 `hi` as fp32 (exact).
#[inline(always)]
pub fn hi_to_f32(hi: u16) -> f32 {
    f32::from_bits(u32::from(hi) << 16)
}

/// `src` into the planes `hi` and `lo` (all the same length). Branch-free per element, so the
/// loop vectorises.
pub fn split_into(src: &[f32], hi: &mut [u16], lo: &mut [u16]) {
    assert!(
        hi.len() == src.len() && lo.len() == src.len(),
        "plane lengths must match"
    );
    for ((x, h), l) in src.iter().zip(hi.iter_mut()).zip(lo.iter_mut()) {
        (*h, *l) = split(*x);
    }
}

/// The planes `hi` and `lo` into `dst` (all the same length).
pub fn join_into(hi: &[u16], lo: &[u16], dst: &mut [f32]) {
    assert!(
        hi.len() == dst.len() && lo.len() == dst.len(),
        "plane lengths must match"
    );
    for ((h, l), d) in hi.iter().zip(lo).zip(dst.iter_mut()) {
        *d = join(*h, *l);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nearest bf16 to a finite `x` by exhaustive comparison in f64 (ties: the one nearer
    /// zero, i.e. the truncated one), as bits; ±Inf past the largest value plus half an ulp.
    fn nearest_bf16(x: f32) -> u16 {
        let t = (x.to_bits() >> 16) as u16;
        // Rounding up past the largest value reaches ±Inf, which counts as ±2^128 here.
        let value = |h: u16| match hi_to_f32(h) {
            v if v.is_infinite() => 2f64.powi(128).copysign(f64::from(v)),
            v => f64::from(v),
        };
        let (a, b) = (value(t), value(t.wrapping_add(1)));
        let x = f64::from(x);
        if (b - x).abs() < (x - a).abs() {
            t.wrapping_add(1)
        } else {
            t
        }
    }

    /// Patterns `from..to` (a slice of the 2^32): the round trip, and the meaning of `hi`.
    fn check_range(from: u64, to: u64) {
        for b in from..to {
            let b = b as u32;
            let x = f32::from_bits(b);
            let (hi, lo) = split(x);
            let y = join(hi, lo);
            if x.is_nan() {
                assert!(y.is_nan() && hi_to_f32(hi).is_nan(), "{b:#010x}");
                assert_eq!(y.to_bits() >> 16, (b | 0x0040_0000) >> 16, "{b:#010x}");
                assert_eq!(y.to_bits() & 0xffff, 0, "{b:#010x}");
            } else {
                assert_eq!(y.to_bits(), b, "{b:#010x} → ({hi:#06x}, {lo:#06x})");
            }
            // Sampled (the f64 check is the slow part): hi is the nearest bf16.
            if b.is_multiple_of(61) && x.is_finite() {
                assert_eq!(hi, nearest_bf16(x), "{b:#010x}");
            }
        }
    }

    #[test]
    fn every_fp32_pattern_round_trips() {
        const PARTS: u64 = 2;
        let span = (1u64 << 32) / PARTS;
        std::thread::scope(|s| {
            for p in 0..PARTS {
                s.spawn(move || check_range(p * span, (p + 1) * span));
            }
        });
    }

    #[test]
    fn named_values() {
        assert_eq!(split(1.0), (0x3f80, 0));
        assert_eq!(split(f32::INFINITY), (0x7f80, 0));
        assert_eq!(split(f32::NEG_INFINITY), (0xff80, 0));
        assert_eq!(split(-0.0), (0x8000, 0));
        // Ties go toward the truncated value; just past a tie rounds up.
        assert_eq!(split(f32::from_bits(0x3f80_8000)), (0x3f80, 0x8000));
        assert_eq!(split(f32::from_bits(0x3f80_8001)), (0x3f81, 0x8001));
        // The largest finite fp32 streams as +Inf, and still comes back exactly.
        assert_eq!(split(f32::MAX).0, 0x7f80);
        assert_eq!(join(0x7f80, 0xffff), f32::MAX);
        // The NaN whose rounding would carry into -0.0 streams as a NaN.
        let (hi, _) = split(f32::from_bits(0x7fff_ffff));
        assert!(hi_to_f32(hi).is_nan());
    }

    #[test]
    fn slices_equal_elements() {
        let x = crate::util::uniform(1000, 7, 3.0);
        let (mut hi, mut lo) = (vec![0u16; 1000], vec![0u16; 1000]);
        split_into(&x, &mut hi, &mut lo);
        let mut y = vec![0f32; 1000];
        join_into(&hi, &lo, &mut y);
        assert_eq!(x, y);
        for (i, v) in x.iter().enumerate() {
            assert_eq!((hi[i], lo[i]), split(*v));
        }
    }
}
