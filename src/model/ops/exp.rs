//! The exponential, vectorised: of softmax rows (attention's online softmax and the
//! cross-entropy call it on every score, where libm's scalar `expf` would cost as much as the
//! GEMMs around it) and inside the SwiGLU's sigmoid.

/// Largest element.
pub fn row_max(x: &[f32]) -> f32 {
    x.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `x = exp(x − shift)` in place (every x − shift ≤ 0 up to rounding); returns Σ x, summed in
/// 16 fixed lanes.
pub fn exp_shifted(x: &mut [f32], shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked).
            return unsafe { exp_shifted_avx512(x, shift) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked).
            return unsafe { exp_shifted_avx2(x, shift) };
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            // SAFETY: the CPU has NEON (checked).
            return unsafe { neon::exp_shifted(x, shift) };
        }
    }
    exp_shifted_body(x, shift)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn exp_shifted_avx512(x: &mut [f32], shift: f32) -> f32 {
    exp_shifted_body(x, shift)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_shifted_avx2(x: &mut [f32], shift: f32) -> f32 {
    exp_shifted_body(x, shift)
}

#[inline(always)]
fn exp_shifted_body(x: &mut [f32], shift: f32) -> f32 {
    for v in x.iter_mut() {
        *v = exp_neg(*v - shift);
    }
    let mut lanes = [0.0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += *v;
        }
    }
    let tail: f32 = chunks.remainder().iter().sum();
    lanes.iter().sum::<f32>() + tail
}

/// NEON in intrinsics: [`exp_neg`] four lanes at a time, with the body's 16 summing lanes as four
/// vectors (no fused multiply-add, as in the scalar code: the same bits).
#[cfg(target_arch = "aarch64")]
mod neon {
    use super::{exp_neg, LN2_HI, LN2_LO};
    use std::arch::aarch64::*;

    #[target_feature(enable = "neon")]
    pub unsafe fn exp_shifted(x: &mut [f32], shift: f32) -> f32 {
        let n = x.len();
        let body = n - n % 16;
        let s = vdupq_n_f32(shift);
        let mut acc = [vdupq_n_f32(0.0); 4];
        let mut i = 0;
        while i < body {
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: i + 4k + 4 ≤ body ≤ n.
                unsafe {
                    let p = x.as_mut_ptr().add(i + 4 * k);
                    let e = exp_neg4(vsubq_f32(vld1q_f32(p), s));
                    vst1q_f32(p, e);
                    *a = vaddq_f32(*a, e);
                }
            }
            i += 16;
        }
        let tail = &mut x[body..];
        for v in tail.iter_mut() {
            *v = exp_neg(*v - shift);
        }
        let mut lanes = [0.0f32; 16];
        for (k, a) in acc.iter().enumerate() {
            // SAFETY: 4 lanes into lanes[4k..4k + 4].
            unsafe { vst1q_f32(lanes.as_mut_ptr().add(4 * k), *a) };
        }
        let tail: f32 = tail.iter().sum();
        lanes.iter().sum::<f32>() + tail
    }

    /// [`exp_neg`] of 4 lanes, operation for operation.
    #[inline]
    #[target_feature(enable = "neon")]
    fn exp_neg4(x: float32x4_t) -> float32x4_t {
        let c = vdupq_n_f32;
        let x = vminq_f32(vmaxq_f32(x, c(-87.0)), c(0.5));
        let n = vrndmq_f32(vaddq_f32(vmulq_f32(x, c(std::f32::consts::LOG2_E)), c(0.5)));
        let r = vsubq_f32(
            vsubq_f32(x, vmulq_f32(n, c(LN2_HI))),
            vmulq_f32(n, c(LN2_LO)),
        );
        let mut p = vaddq_f32(c(1.0 / 120.0), vmulq_f32(r, c(1.0 / 720.0)));
        for k in [1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = vaddq_f32(c(k), vmulq_f32(r, p));
        }
        let biased = vsubq_u32(
            vreinterpretq_u32_f32(vaddq_f32(n, c(127.0 + 8_388_608.0))),
            vdupq_n_u32(0x4B00_0000),
        );
        vmulq_f32(p, vreinterpretq_f32_u32(vshlq_n_u32::<23>(biased)))
    }
}

/// `f` compiled for the widest vector unit the CPU has (AVX-512, else AVX2 + FMA), so the
/// branch-free math it inlines ([`sigmoid`]) vectorises.
#[inline(always)]
pub fn vectorised(f: impl FnOnce()) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked).
            return unsafe { run_avx512(f) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked).
            return unsafe { run_avx2(f) };
        }
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn run_avx512(f: impl FnOnce()) {
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2(f: impl FnOnce()) {
    f()
}

/// σ(x) = 1 / (1 + e^−x) from e^−|x| (the exponential's argument is never positive), branch-free;
/// relative error below 4e-7 (tested against f64).
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    let t = exp_neg(-x.abs());
    let r = 1.0 / (1.0 + t);
    if x >= 0.0 {
        r
    } else {
        t * r
    }
}

/// ln 2 in two parts: `n · LN2_HI` is exact for the n of [`exp_neg`]'s range.
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;

/// e^x for x ≤ 0 (a small positive x from rounding is fine), branch-free so it vectorises:
/// x = n·ln 2 + r with |r| ≤ ln 2 / 2, e^r by its degree-6 Taylor polynomial (relative error
/// < 2e-7), 2^n from the exponent bits; at or below −87 it returns ≈ 1.6e-38 (callers only
/// pass visible scores, so that never stands for a masked 0).
#[inline(always)]
fn exp_neg(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    let x = x.clamp(-87.0, 0.5);
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^n without a float → int conversion (which does not vectorise): the biased exponent
    // n + 127 ∈ [1, 128] lands in the mantissa bits of (n + 127) + 2^23.
    let biased = (n + (127.0 + 8_388_608.0)).to_bits() - 0x4B00_0000;
    p * f32::from_bits(biased << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sigmoid against f64's over [−100, 100], and in the vectorised build the same bits.
    #[test]
    fn sigmoid_is_accurate() {
        let xs: Vec<f32> = (0..200_001).map(|i| -100.0 + i as f32 / 1000.0).collect();
        let mut fast = vec![0.0f32; xs.len()];
        vectorised(|| {
            for (o, x) in fast.iter_mut().zip(&xs) {
                *o = sigmoid(*x);
            }
        });
        for (x, f) in xs.iter().zip(&fast) {
            assert_eq!(f.to_bits(), sigmoid(*x).to_bits(), "σ({x}): paths differ");
            let want = 1.0 / (1.0 + (-f64::from(*x)).exp());
            let err = (f64::from(*f) - want).abs();
            // Relative where σ is representable, absolute below exp's clamp at −87.
            assert!(
                err <= 4e-7 * want || err < 1e-37,
                "σ({x}) = {f}, want {want}"
            );
        }
    }

    /// Against f64's exp over [−87, 0.5] (the dispatched SIMD path and the plain body alike),
    /// and the lane sum against a plain sum.
    #[test]
    fn exp_is_accurate_and_the_paths_agree() {
        let xs: Vec<f32> = (0..100_000)
            .map(|i| -87.0 + 87.5 * i as f32 / 99_999.0)
            .collect();
        let (mut fast, mut plain) = (xs.clone(), xs.clone());
        let sum = exp_shifted(&mut fast, 0.0);
        let plain_sum = exp_shifted_body(&mut plain, 0.0);
        let mut worst = 0.0f64;
        for ((x, f), p) in xs.iter().zip(&fast).zip(&plain) {
            let want = f64::from(*x).exp();
            worst = worst.max((f64::from(*f) - want).abs() / want);
            assert_eq!(
                f.to_bits(),
                p.to_bits(),
                "exp({x}): SIMD and plain paths differ"
            );
        }
        assert!(worst < 3e-7, "max relative error {worst:e}");
        let direct: f64 = fast.iter().map(|v| f64::from(*v)).sum();
        assert!(((f64::from(sum) - direct) / direct).abs() < 1e-5);
        assert_eq!(sum.to_bits(), plain_sum.to_bits());
        // Shifted: exp(x − s).
        let mut v = vec![3.0f32, 2.0, 1.0];
        exp_shifted(&mut v, 3.0);
        assert!((v[0] - 1.0).abs() < 1e-7 && (v[2] - (-2.0f32).exp()).abs() < 1e-7);
    }
}
