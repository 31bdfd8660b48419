//! Rounding to bf16, as the bf16 recipe stores a tensor or rounds a GEMM's operand
//! (docs/precision.md).

use rayon::prelude::*;

/// `x` rounded to bf16 (nearest even) and back: exactly what a bf16 store keeps (a NaN stays a
/// quiet NaN). Branch-free, so that loops over it vectorise; equal to the optimizer's
/// `bf16_to_f32(f32_to_bf16(x))` (tested in `device::host_backend`).
#[inline(always)]
pub fn bf16_value(x: f32) -> f32 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
    let quiet_nan = (b | 0x0040_0000) & 0xffff_0000;
    f32::from_bits(if (b & 0x7fff_ffff) > 0x7f80_0000 {
        quiet_nan
    } else {
        rounded
    })
}

/// Pieces rounded by one task.
const PIECE: usize = 1 << 14;

/// Every value of `x` rounded to bf16 in place ([`bf16_value`]), in parallel pieces.
pub fn round_bf16(x: &mut [f32]) {
    x.par_chunks_mut(PIECE)
        .for_each(|p| p.iter_mut().for_each(|v| *v = bf16_value(*v)));
}

/// `src` rounded to bf16 into `dst` (resized to it), in parallel pieces.
pub fn round_into(dst: &mut Vec<f32>, src: &[f32]) {
    if dst.len() < src.len() {
        dst.resize(src.len(), 0.0);
    }
    dst.truncate(src.len());
    dst.par_chunks_mut(PIECE)
        .zip(src.par_chunks(PIECE))
        .for_each(|(d, s)| {
            for (d, s) in d.iter_mut().zip(s) {
                *d = bf16_value(*s);
            }
        });
}
