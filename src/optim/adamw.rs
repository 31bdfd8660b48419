//! The AdamW update, exactly `torch.optim.AdamW` (single-tensor path, fp32), on one contiguous
//! range of a unit: a scalar reference and SIMD paths (AVX-512F, AVX2, NEON) picked at run time.
//!
//! Per element, in torch's order (DESIGN.md §4):
//! ```text
//! g  = g_raw · grad_scale                     (clip_grad_norm_ scales grads in place)
//! p  = p · (1 − lr·wd)
//! m  = m + (1−β1)·(g − m)                     (torch.lerp, weight < 0.5 branch)
//! v  = v·β2 + (1−β2)·g·g                      (mul_, then addcmul_)
//! p  = p + (−lr/bc1)·m / (√v / √bc2 + eps)    (addcdiv_)
//! ```
//! Scalars are computed in f64 and rounded to f32 once, as torch does with Python floats. The SIMD
//! paths use the same operations in the same order and no FMA, so every path is bit-identical to
//! the scalar reference (tests assert equality). The sum of squared raw gradients is fused in (f64
//! accumulation).

/// AdamW hyperparameters (torch defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, wd 0.01).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamWConfig {
    /// Learning rate (the schedule's value for this step).
    pub lr: f64,
    /// β1.
    pub beta1: f64,
    /// β2.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// The f32 scalars of one step for one tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepScalars {
    /// 1 − lr·wd (1 when the tensor is not decayed).
    pub decay: f32,
    /// 1 − β1 (lerp weight).
    pub w1: f32,
    /// β2.
    pub beta2: f32,
    /// 1 − β2.
    pub w2: f32,
    /// −lr / (1 − β1^t).
    pub neg_step_size: f32,
    /// √(1 − β2^t).
    pub bc2_sqrt: f32,
    /// ε.
    pub eps: f32,
    /// Gradient scale (the clipping coefficient, 1 without clipping).
    pub grad_scale: f32,
}

impl StepScalars {
    /// Scalars for step `t` (1-based, as torch counts after its increment).
    pub fn new(cfg: &AdamWConfig, t: u64, decay: bool, grad_scale: f32) -> Self {
        let t = t.max(1) as i32;
        let bc1 = 1.0 - cfg.beta1.powi(t);
        let bc2 = 1.0 - cfg.beta2.powi(t);
        StepScalars {
            decay: if decay {
                (1.0 - cfg.lr * cfg.weight_decay) as f32
            } else {
                1.0
            },
            w1: (1.0 - cfg.beta1) as f32,
            beta2: cfg.beta2 as f32,
            w2: (1.0 - cfg.beta2) as f32,
            neg_step_size: (-(cfg.lr / bc1)) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: cfg.eps as f32,
            grad_scale,
        }
    }
}

/// Round an f32 to bf16 bits, nearest-even; NaN stays a quiet NaN.
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    let bias = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(bias) >> 16) as u16
}

/// bf16 bits to f32.
#[inline]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// One element of the update; returns g_raw² for the norm. Shared by every path's tail.
#[inline(always)]
fn element(p: &mut f32, g_raw: f32, m: &mut f32, v: &mut f32, s: &StepScalars) {
    let g = g_raw * s.grad_scale;
    let pd = *p * s.decay;
    let mn = if s.w1 < 0.5 {
        *m + s.w1 * (g - *m)
    } else {
        g - (g - *m) * (1.0 - s.w1)
    };
    let vn = *v * s.beta2 + s.w2 * g * g;
    let denom = vn.sqrt() / s.bc2_sqrt + s.eps;
    *p = pd + s.neg_step_size * mn / denom;
    *m = mn;
    *v = vn;
}

/// The slices one update works on. All have the same length.
#[derive(Debug)]
pub struct AdamSlices<'a> {
    /// fp32 params.
    pub p: &'a mut [f32],
    /// Raw gradients (before clipping).
    pub g: &'a [f32],
    /// Adam m.
    pub m: &'a mut [f32],
    /// Adam v.
    pub v: &'a mut [f32],
}

impl AdamSlices<'_> {
    fn check(&self) {
        let n = self.p.len();
        assert!(
            self.g.len() == n && self.m.len() == n && self.v.len() == n,
            "AdamW slices must have equal lengths"
        );
    }
}

/// Scalar reference. Returns Σ g_raw² (f64).
pub fn step_scalar(x: AdamSlices<'_>, s: &StepScalars) -> f64 {
    x.check();
    scalar_from(x, s, 0)
}

fn scalar_from(x: AdamSlices<'_>, s: &StepScalars, start: usize) -> f64 {
    let mut sumsq = 0.0f64;
    let AdamSlices { p, g, m, v } = x;
    for i in start..p.len() {
        sumsq += f64::from(g[i]) * f64::from(g[i]);
        element(&mut p[i], g[i], &mut m[i], &mut v[i], s);
    }
    sumsq
}

/// Σ x² in f64 (scalar reference).
pub fn sumsq_scalar(x: &[f32]) -> f64 {
    x.iter().map(|&v| f64::from(v) * f64::from(v)).sum()
}

/// Which implementation runs.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
pub enum Isa {
    /// Plain Rust.
    Scalar,
    /// x86-64 AVX2 (8 lanes).
    Avx2,
    /// x86-64 AVX-512F (16 lanes).
    Avx512,
    /// aarch64 NEON (4 lanes).
    Neon,
}

/// The best implementation this CPU supports.
pub fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Isa::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return Isa::Avx2;
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            return Isa::Neon;
        }
    }
    Isa::Scalar
}

/// Whether `isa` can run on this CPU.
pub fn supported(isa: Isa) -> bool {
    match isa {
        Isa::Scalar => true,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
        _ => false,
    }
}

/// Run the update with `isa` (falls back to scalar if this CPU lacks it). Returns Σ g_raw².
pub fn step_with(isa: Isa, x: AdamSlices<'_>, s: &StepScalars) -> f64 {
    x.check();
    if !supported(isa) {
        return scalar_from(x, s, 0);
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx512f is present (checked by `supported`).
        Isa::Avx512 => unsafe { x86::step_avx512(x, s) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx2 is present (checked by `supported`).
        Isa::Avx2 => unsafe { x86::step_avx2(x, s) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: neon is present (checked by `supported`).
        Isa::Neon => unsafe { arm::step_neon(x, s) },
        _ => scalar_from(x, s, 0),
    }
}

/// The update with the best implementation for this CPU. Returns Σ g_raw².
pub fn step(x: AdamSlices<'_>, s: &StepScalars) -> f64 {
    step_with(detect(), x, s)
}

/// Σ x² in f64 with the best implementation for this CPU.
pub fn sumsq(x: &[f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: avx2 is present.
            return unsafe { x86::sumsq_avx2(x) };
        }
    }
    sumsq_scalar(x)
}

/// Elements per part of [`sumsq_parallel`]: each part's Σ is one [`sumsq`], and the parts are
/// added in order, so the result does not depend on how many threads ran them.
pub const SUMSQ_PART: usize = 1 << 20;

/// Σ x² in f64 over the host's cores (rayon): [`sumsq`] of each [`SUMSQ_PART`]-element part,
/// added in order — the same bits for any number of threads. Exact mode's gradient norm reads
/// every gradient once per step; one core reads ~10 GB/s where the host's DRAM gives 10× that.
pub fn sumsq_parallel(x: &[f32]) -> f64 {
    use rayon::prelude::*;
    if x.len() <= SUMSQ_PART {
        return sumsq(x);
    }
    let parts: Vec<f64> = x.par_chunks(SUMSQ_PART).map(sumsq).collect();
    parts.iter().sum()
}

/// STREAM triad `a = b + s·c`, the bandwidth reference for the AdamW benchmark. SIMD paths use
/// non-temporal stores where `a` is vector-aligned (as STREAM's best builds do), so the measured
/// bytes are the bytes that cross the memory bus: no write-allocate read of `a`.
pub fn triad(isa: Isa, a: &mut [f32], b: &[f32], c: &[f32], s: f32) {
    assert!(
        a.len() == b.len() && a.len() == c.len(),
        "triad slices must have equal lengths"
    );
    if supported(isa) {
        #[cfg(target_arch = "x86_64")]
        match isa {
            // SAFETY: avx512f is present (checked by `supported`).
            Isa::Avx512 => return unsafe { x86::triad_avx512(a, b, c, s) },
            // SAFETY: avx2 is present (checked by `supported`).
            Isa::Avx2 => return unsafe { x86::triad_avx2(a, b, c, s) },
            _ => {}
        }
    }
    for ((a, b), c) in a.iter_mut().zip(b).zip(c) {
        *a = *b + s * *c;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{scalar_from, AdamSlices, StepScalars};
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX-512F; slices must have equal lengths.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn step_avx512(x: AdamSlices<'_>, s: &StepScalars) -> f64 {
        let n = x.p.len();
        let body = n - n % 16;
        let (pp, gp, mp, vp) = (
            x.p.as_mut_ptr(),
            x.g.as_ptr(),
            x.m.as_mut_ptr(),
            x.v.as_mut_ptr(),
        );
        let scale = _mm512_set1_ps(s.grad_scale);
        let decay = _mm512_set1_ps(s.decay);
        let w1 = _mm512_set1_ps(s.w1);
        let one_m_w1 = _mm512_set1_ps(1.0 - s.w1);
        let small = s.w1 < 0.5;
        let beta2 = _mm512_set1_ps(s.beta2);
        let w2 = _mm512_set1_ps(s.w2);
        let nss = _mm512_set1_ps(s.neg_step_size);
        let bc2 = _mm512_set1_ps(s.bc2_sqrt);
        let eps = _mm512_set1_ps(s.eps);
        let mut acc = _mm512_setzero_pd();
        let mut i = 0;
        while i < body {
            // SAFETY: i + 16 ≤ n for every slice; unaligned loads/stores.
            unsafe {
                let graw = _mm512_loadu_ps(gp.add(i));
                let lo = _mm512_cvtps_pd(_mm512_castps512_ps256(graw));
                let hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(
                    _mm512_castps_pd(graw),
                    1,
                )));
                acc = _mm512_add_pd(acc, _mm512_mul_pd(lo, lo));
                acc = _mm512_add_pd(acc, _mm512_mul_pd(hi, hi));
                let g = _mm512_mul_ps(graw, scale);
                let p = _mm512_mul_ps(_mm512_loadu_ps(pp.add(i)), decay);
                let m0 = _mm512_loadu_ps(mp.add(i));
                let d = _mm512_sub_ps(g, m0);
                let m = if small {
                    _mm512_add_ps(m0, _mm512_mul_ps(w1, d))
                } else {
                    _mm512_sub_ps(g, _mm512_mul_ps(d, one_m_w1))
                };
                let v0 = _mm512_loadu_ps(vp.add(i));
                let v = _mm512_add_ps(
                    _mm512_mul_ps(v0, beta2),
                    _mm512_mul_ps(_mm512_mul_ps(w2, g), g),
                );
                let denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2), eps);
                let pn = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(nss, m), denom));
                _mm512_storeu_ps(pp.add(i), pn);
                _mm512_storeu_ps(mp.add(i), m);
                _mm512_storeu_ps(vp.add(i), v);
            }
            i += 16;
        }
        let mut lanes = [0.0f64; 8];
        // SAFETY: 8 f64 lanes into an 8-element array.
        unsafe { _mm512_storeu_pd(lanes.as_mut_ptr(), acc) };
        lanes.iter().sum::<f64>() + scalar_from(x, s, body)
    }

    /// # Safety
    /// The CPU must support AVX2; slices must have equal lengths.
    #[target_feature(enable = "avx2")]
    pub unsafe fn step_avx2(x: AdamSlices<'_>, s: &StepScalars) -> f64 {
        let n = x.p.len();
        let body = n - n % 8;
        let (pp, gp, mp, vp) = (
            x.p.as_mut_ptr(),
            x.g.as_ptr(),
            x.m.as_mut_ptr(),
            x.v.as_mut_ptr(),
        );
        let scale = _mm256_set1_ps(s.grad_scale);
        let decay = _mm256_set1_ps(s.decay);
        let w1 = _mm256_set1_ps(s.w1);
        let one_m_w1 = _mm256_set1_ps(1.0 - s.w1);
        let small = s.w1 < 0.5;
        let beta2 = _mm256_set1_ps(s.beta2);
        let w2 = _mm256_set1_ps(s.w2);
        let nss = _mm256_set1_ps(s.neg_step_size);
        let bc2 = _mm256_set1_ps(s.bc2_sqrt);
        let eps = _mm256_set1_ps(s.eps);
        let mut acc = _mm256_setzero_pd();
        let mut i = 0;
        while i < body {
            // SAFETY: i + 8 ≤ n for every slice; unaligned loads/stores.
            unsafe {
                let graw = _mm256_loadu_ps(gp.add(i));
                let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(graw));
                let hi = _mm256_cvtps_pd(_mm256_extractf128_ps(graw, 1));
                acc = _mm256_add_pd(acc, _mm256_mul_pd(lo, lo));
                acc = _mm256_add_pd(acc, _mm256_mul_pd(hi, hi));
                let g = _mm256_mul_ps(graw, scale);
                let p = _mm256_mul_ps(_mm256_loadu_ps(pp.add(i)), decay);
                let m0 = _mm256_loadu_ps(mp.add(i));
                let d = _mm256_sub_ps(g, m0);
                let m = if small {
                    _mm256_add_ps(m0, _mm256_mul_ps(w1, d))
                } else {
                    _mm256_sub_ps(g, _mm256_mul_ps(d, one_m_w1))
                };
                let v0 = _mm256_loadu_ps(vp.add(i));
                let v = _mm256_add_ps(
                    _mm256_mul_ps(v0, beta2),
                    _mm256_mul_ps(_mm256_mul_ps(w2, g), g),
                );
                let denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps);
                let pn = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(nss, m), denom));
                _mm256_storeu_ps(pp.add(i), pn);
                _mm256_storeu_ps(mp.add(i), m);
                _mm256_storeu_ps(vp.add(i), v);
            }
            i += 8;
        }
        let mut lanes = [0.0f64; 4];
        // SAFETY: 4 f64 lanes into a 4-element array.
        unsafe { _mm256_storeu_pd(lanes.as_mut_ptr(), acc) };
        lanes.iter().sum::<f64>() + scalar_from(x, s, body)
    }

    /// # Safety
    /// The CPU must support AVX-512F; slices must have equal lengths.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn triad_avx512(a: &mut [f32], b: &[f32], c: &[f32], s: f32) {
        let n = a.len();
        let mut i = 0;
        // Scalar head up to a 64-byte boundary of `a`, for the streaming stores.
        while i < n && !(a.as_ptr() as usize + 4 * i).is_multiple_of(64) {
            a[i] = b[i] + s * c[i];
            i += 1;
        }
        let sv = _mm512_set1_ps(s);
        while i + 16 <= n {
            // SAFETY: i + 16 ≤ n; a + i is 64-byte aligned (head loop above).
            unsafe {
                let r = _mm512_add_ps(
                    _mm512_loadu_ps(b.as_ptr().add(i)),
                    _mm512_mul_ps(sv, _mm512_loadu_ps(c.as_ptr().add(i))),
                );
                _mm512_stream_ps(a.as_mut_ptr().add(i), r);
            }
            i += 16;
        }
        _mm_sfence();
        for j in i..n {
            a[j] = b[j] + s * c[j];
        }
    }

    /// # Safety
    /// The CPU must support AVX2; slices must have equal lengths.
    #[target_feature(enable = "avx2")]
    pub unsafe fn triad_avx2(a: &mut [f32], b: &[f32], c: &[f32], s: f32) {
        let n = a.len();
        let mut i = 0;
        while i < n && !(a.as_ptr() as usize + 4 * i).is_multiple_of(32) {
            a[i] = b[i] + s * c[i];
            i += 1;
        }
        let sv = _mm256_set1_ps(s);
        while i + 8 <= n {
            // SAFETY: i + 8 ≤ n; a + i is 32-byte aligned (head loop above).
            unsafe {
                let r = _mm256_add_ps(
                    _mm256_loadu_ps(b.as_ptr().add(i)),
                    _mm256_mul_ps(sv, _mm256_loadu_ps(c.as_ptr().add(i))),
                );
                _mm256_stream_ps(a.as_mut_ptr().add(i), r);
            }
            i += 8;
        }
        _mm_sfence();
        for j in i..n {
            a[j] = b[j] + s * c[j];
        }
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn sumsq_avx2(x: &[f32]) -> f64 {
        let n = x.len();
        let body = n - n % 8;
        let mut a0 = _mm256_setzero_pd();
        let mut a1 = _mm256_setzero_pd();
        let mut i = 0;
        while i < body {
            // SAFETY: i + 8 ≤ n.
            let g = unsafe { _mm256_loadu_ps(x.as_ptr().add(i)) };
            let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(g));
            let hi = _mm256_cvtps_pd(_mm256_extractf128_ps(g, 1));
            a0 = _mm256_add_pd(a0, _mm256_mul_pd(lo, lo));
            a1 = _mm256_add_pd(a1, _mm256_mul_pd(hi, hi));
            i += 8;
        }
        let mut lanes = [0.0f64; 4];
        // SAFETY: 4 f64 lanes into a 4-element array.
        unsafe { _mm256_storeu_pd(lanes.as_mut_ptr(), _mm256_add_pd(a0, a1)) };
        lanes.iter().sum::<f64>() + super::sumsq_scalar(&x[body..])
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use super::{scalar_from, AdamSlices, StepScalars};
    use std::arch::aarch64::*;

    /// # Safety
    /// The CPU must support NEON; slices must have equal lengths.
    #[target_feature(enable = "neon")]
    pub unsafe fn step_neon(x: AdamSlices<'_>, s: &StepScalars) -> f64 {
        let n = x.p.len();
        let body = n - n % 4;
        let (pp, gp, mp, vp) = (
            x.p.as_mut_ptr(),
            x.g.as_ptr(),
            x.m.as_mut_ptr(),
            x.v.as_mut_ptr(),
        );
        let scale = vdupq_n_f32(s.grad_scale);
        let decay = vdupq_n_f32(s.decay);
        let w1 = vdupq_n_f32(s.w1);
        let one_m_w1 = vdupq_n_f32(1.0 - s.w1);
        let small = s.w1 < 0.5;
        let beta2 = vdupq_n_f32(s.beta2);
        let w2 = vdupq_n_f32(s.w2);
        let nss = vdupq_n_f32(s.neg_step_size);
        let bc2 = vdupq_n_f32(s.bc2_sqrt);
        let eps = vdupq_n_f32(s.eps);
        let mut acc = vdupq_n_f64(0.0);
        let mut i = 0;
        while i < body {
            // SAFETY: i + 4 ≤ n for every slice.
            unsafe {
                let graw = vld1q_f32(gp.add(i));
                let lo = vcvt_f64_f32(vget_low_f32(graw));
                let hi = vcvt_high_f64_f32(graw);
                acc = vaddq_f64(acc, vmulq_f64(lo, lo));
                acc = vaddq_f64(acc, vmulq_f64(hi, hi));
                let g = vmulq_f32(graw, scale);
                let p = vmulq_f32(vld1q_f32(pp.add(i)), decay);
                let m0 = vld1q_f32(mp.add(i));
                let d = vsubq_f32(g, m0);
                let m = if small {
                    vaddq_f32(m0, vmulq_f32(w1, d))
                } else {
                    vsubq_f32(g, vmulq_f32(d, one_m_w1))
                };
                let v0 = vld1q_f32(vp.add(i));
                let v = vaddq_f32(vmulq_f32(v0, beta2), vmulq_f32(vmulq_f32(w2, g), g));
                let denom = vaddq_f32(vdivq_f32(vsqrtq_f32(v), bc2), eps);
                let pn = vaddq_f32(p, vdivq_f32(vmulq_f32(nss, m), denom));
                vst1q_f32(pp.add(i), pn);
                vst1q_f32(mp.add(i), m);
                vst1q_f32(vp.add(i), v);
            }
            i += 4;
        }
        vgetq_lane_f64::<0>(acc) + vgetq_lane_f64::<1>(acc) + scalar_from(x, s, body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn randn(n: usize, seed: u64) -> Vec<f32> {
        crate::util::uniform(n, seed, 2.0)
    }

    fn run(isa: Isa, n: usize, s: &StepScalars, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>, f64) {
        let mut p = randn(n, seed);
        let g = randn(n, seed + 1);
        let mut m: Vec<f32> = randn(n, seed + 2).iter().map(|x| x * 0.1).collect();
        let mut v: Vec<f32> = randn(n, seed + 3).iter().map(|x| x * x * 0.01).collect();
        let ss = step_with(
            isa,
            AdamSlices {
                p: &mut p,
                g: &g,
                m: &mut m,
                v: &mut v,
            },
            s,
        );
        (p, m, v, ss)
    }

    #[test]
    fn simd_paths_are_bit_identical_to_scalar_on_odd_lengths() {
        let cfg = AdamWConfig {
            lr: 3e-3,
            weight_decay: 0.1,
            ..Default::default()
        };
        let isas: Vec<Isa> = [Isa::Avx512, Isa::Avx2, Isa::Neon]
            .into_iter()
            .filter(|i| supported(*i))
            .collect();
        for (t, scale, beta1) in [(1u64, 1.0f32, 0.9), (7, 0.37, 0.9), (3, 1.0, 0.3)] {
            let s = StepScalars::new(&AdamWConfig { beta1, ..cfg }, t, t != 7, scale);
            for n in [0usize, 1, 7, 15, 16, 17, 31, 33, 100, 1000, 4099] {
                let want = run(Isa::Scalar, n, &s, n as u64 + 11);
                for &isa in &isas {
                    let got = run(isa, n, &s, n as u64 + 11);
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got.0), bits(&want.0), "{isa:?} p n={n}");
                    assert_eq!(bits(&got.1), bits(&want.1), "{isa:?} m n={n}");
                    assert_eq!(bits(&got.2), bits(&want.2), "{isa:?} v n={n}");
                    let rel = (got.3 - want.3).abs() / want.3.max(1e-30);
                    assert!(rel < 1e-12, "{isa:?} sumsq n={n}: {} vs {}", got.3, want.3);
                }
            }
        }
    }

    #[test]
    fn bf16_rounding_is_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (down).
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80); // rounds up to infinity, like torch
    }

    #[test]
    fn nan_propagates_in_every_path() {
        let s = StepScalars::new(&AdamWConfig::default(), 1, true, 1.0);
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon] {
            let n = 37;
            let mut p = vec![1.0f32; n];
            let mut g = vec![0.5f32; n];
            g[20] = f32::NAN;
            let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
            step_with(
                isa,
                AdamSlices {
                    p: &mut p,
                    g: &g,
                    m: &mut m,
                    v: &mut v,
                },
                &s,
            );
            assert!(p[20].is_nan() && m[20].is_nan(), "{isa:?}");
            assert!(!p[19].is_nan());
        }
    }

    #[test]
    fn triad_paths_match_scalar() {
        for n in [0usize, 1, 15, 17, 1000, 1027] {
            let (b, c) = (randn(n + 3, 1), randn(n + 3, 2));
            let mut want = vec![0.0f32; n];
            triad(Isa::Scalar, &mut want, &b[..n], &c[..n], 1.5);
            for isa in [Isa::Avx2, Isa::Avx512] {
                // Misaligned destination start exercises the head loop.
                let mut got = vec![0.0f32; n + 1];
                triad(isa, &mut got[1..], &b[..n], &c[..n], 1.5);
                assert_eq!(&got[1..], &want[..], "{isa:?} n={n}");
            }
        }
    }

    #[test]
    fn sumsq_matches_reference() {
        for n in [0, 1, 9, 1001] {
            let x = randn(n, 5);
            let a = sumsq(&x);
            let b = sumsq_scalar(&x);
            assert!((a - b).abs() <= 1e-12 * b.max(1.0), "{a} {b}");
        }
    }

    #[test]
    fn sumsq_parallel_matches_reference_with_the_same_bits_on_any_pool() {
        // Several parts and a ragged tail.
        let x = randn(3 * SUMSQ_PART + 777, 6);
        let want = sumsq_scalar(&x);
        let got = sumsq_parallel(&x);
        assert!((got - want).abs() <= 1e-12 * want, "{got} {want}");
        // The parts summed in order, whatever ran them.
        let serial: f64 = x.chunks(SUMSQ_PART).map(sumsq).sum();
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            assert_eq!(
                pool.install(|| sumsq_parallel(&x)).to_bits(),
                serial.to_bits()
            );
        }
        assert_eq!(sumsq_parallel(&x[..100]), sumsq(&x[..100]));
    }

    #[test]
    fn first_step_moves_each_param_by_about_lr() {
        // At t=1 with no decay, |Δp| = lr·|g|/(|g| + eps) ≈ lr for every element.
        let cfg = AdamWConfig {
            lr: 0.01,
            weight_decay: 0.0,
            ..Default::default()
        };
        let s = StepScalars::new(&cfg, 1, true, 1.0);
        let (p, _, _, _, _) = {
            let mut p = vec![0.5f32; 10];
            let g = randn(10, 3);
            let (mut m, mut v) = (vec![0.0; 10], vec![0.0; 10]);
            step_scalar(
                AdamSlices {
                    p: &mut p,
                    g: &g,
                    m: &mut m,
                    v: &mut v,
                },
                &s,
            );
            (p, m, v, (), ())
        };
        for x in p {
            assert!(((x - 0.5).abs() - 0.01).abs() < 1e-6, "{x}");
        }
    }
}
