//! MXFP4 expert weights as OpenAI released GPT-OSS (`*_blocks` and `*_scales`, read by
//! transformers' `convert_moe_packed_tensors`): per output row of an expert, the input dimension
//! in blocks of 32 E2M1 values (two 4-bit codes per byte, the low nibble first) sharing one E8M0
//! scale `2^(s − 127)`. Dequantised exactly to fp32, in the parameter's transposed layout
//! `[E, in, out]`.

use crate::{Error, Result};

/// The E2M1 values of the 16 codes (sign in the high bit).
const FP4_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Bytes of one block (32 values).
pub const BLOCK_BYTES: usize = 16;

/// The shape `[E, out, groups, 16]` of a `_blocks` tensor, checked against its `_scales`
/// `[E, out, groups]` and the parameter `[E, groups·32, out]` it dequantises to; `name` names it
/// in errors.
pub fn check_shapes(name: &str, blocks: &[usize], scales: &[usize], param: &[usize]) -> Result<()> {
    let ok = blocks.len() == 4
        && blocks[3] == BLOCK_BYTES
        && scales == &blocks[..3]
        && param == [blocks[0], blocks[2] * 2 * BLOCK_BYTES, blocks[1]];
    match ok {
        true => Ok(()),
        false => Err(Error::bad_input(
            "MXFP4 checkpoint tensor",
            name,
            format!(
                "blocks {blocks:?} and scales {scales:?} do not make the parameter {param:?} \
                 (blocks [E, out, in/32, 16], scales [E, out, in/32], parameter [E, in, out])"
            ),
            Some("check that config.json belongs to these weights"),
        )),
    }
}

/// Expert `e`'s dequantised weights `[in, out]` from `blocks` and `scales` of shape `[E, out,
/// groups, 16]` / `[E, out, groups]`; a scale whose power overflows fp32 is an error.
pub fn dequantize_expert(
    name: &str,
    blocks: &[u8],
    scales: &[u8],
    (out_rows, groups): (usize, usize),
    e: usize,
) -> Result<Vec<f32>> {
    let cols = groups * 2 * BLOCK_BYTES;
    let mut w = vec![0f32; cols * out_rows];
    let per_expert = out_rows * groups;
    for row in 0..out_rows {
        for g in 0..groups {
            let at = e * per_expert + row * groups + g;
            let s = scales[at];
            if s == 255 {
                return Err(Error::bad_input(
                    "MXFP4 checkpoint tensor",
                    name,
                    format!("expert {e}, row {row}, block {g} has scale 255 (2^128: not a number)"),
                    Some("these weights are broken: use another checkpoint"),
                ));
            }
            let factor = (2f64).powi(i32::from(s) - 127) as f32;
            let bytes = &blocks[at * BLOCK_BYTES..(at + 1) * BLOCK_BYTES];
            for (b, &byte) in bytes.iter().enumerate() {
                let col = g * 2 * BLOCK_BYTES + 2 * b;
                w[col * out_rows + row] = FP4_VALUES[usize::from(byte & 0x0f)] * factor;
                w[(col + 1) * out_rows + row] = FP4_VALUES[usize::from(byte >> 4)] * factor;
            }
        }
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_nibbles_and_scales_land_where_transformers_puts_them() {
        // One expert, 2 output rows, 1 block: row 0 all codes 0x21 scaled by 2^1, row 1 code 0x9F
        // (low 0xF = −6, high 0x9 = −0.5) scaled by 2^−1.
        let mut blocks = vec![0x21u8; 16];
        blocks.extend([0x9fu8; 16]);
        let scales = [128u8, 126];
        let w = dequantize_expert("t", &blocks, &scales, (2, 1), 0).unwrap();
        // w [in = 32, out = 2]: column j of row r at w[j·2 + r].
        assert_eq!(w[0], 0.5 * 2.0); // low nibble 1 → 0.5
        assert_eq!(w[2], 1.0 * 2.0); // high nibble 2 → 1.0
        assert_eq!(w[1], -6.0 * 0.5);
        assert_eq!(w[3], -0.5 * 0.5);
        assert!(dequantize_expert("t", &blocks, &[255, 0], (2, 1), 0).is_err());
        assert!(check_shapes("t", &[1, 2, 1, 16], &[1, 2, 1], &[1, 32, 2]).is_ok());
        assert!(check_shapes("t", &[1, 2, 1, 16], &[1, 2, 1], &[1, 2, 32]).is_err());
    }
}
