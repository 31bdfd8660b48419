//! The CUDA kernel sources (`kernels/*.cu`), embedded in the binary, and the symbols each must
//! export. Plain data, compiled in every build: NVRTC turns them into PTX at start-up on a GPU
//! machine (feature `cuda`), and the test suite compiles all of them for every architecture in
//! [`ARCHS`] even where no GPU exists.

/// The shared header every kernel file includes.
pub const COMMON: &str = include_str!("../../kernels/common.cuh");

/// A kernel parameter's type, as the C signature declares it (and the PTX lists it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param {
    /// A device pointer (`T*`; `.u64` in PTX).
    Ptr,
    /// `int` or `unsigned` (`.u32`).
    I32,
    /// `long long` (`.u64`).
    I64,
    /// `float` (`.f32`).
    F32,
}

impl Param {
    /// The PTX parameter type of this C type.
    pub fn ptx(self) -> &'static str {
        match self {
            Param::Ptr | Param::I64 => ".u64",
            Param::I32 => ".u32",
            Param::F32 => ".f32",
        }
    }
}

/// An exported kernel: its symbol and parameter list. The typed launch wrappers
/// (`device::cuda::launches`) check every launch against it, and the test suite checks it against
/// the compiled PTX, so a wrapper, its signature and the kernel cannot drift apart unseen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signature {
    /// `{op}_{fwd|bwd}_{dtype}`: `f32` or `bf16` storage, or `f32w16` (fp32 activations, bf16
    /// weights), `f32w16o16` and `f32o16` (a bf16 output from fp32 inputs), `f32i16` (bf16
    /// inputs, fp32 outputs: attention).
    pub name: &'static str,
    /// Its parameters, in order.
    pub params: &'static [Param],
}

/// One kernel file.
#[derive(Debug, Clone, Copy)]
pub struct KernelFile {
    /// File name under `kernels/`.
    pub file: &'static str,
    /// Its source.
    pub source: &'static str,
    /// The `extern "C"` kernels it must export.
    pub kernels: &'static [Signature],
}

/// GPU architectures every kernel is compiled for in CI (A100, H100/H200/GH200).
pub const ARCHS: &[&str] = &["sm_80", "sm_90"];

use Param::{Ptr, F32, I32, I64};

const fn sig(name: &'static str, params: &'static [Param]) -> Signature {
    Signature { name, params }
}

/// `attention_fwd_*`: out, lse, q, k, v, pos; t, window, q0, q1, nh, nkv, hd, tile; scale,
/// softcap.
const ATTN_FWD: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, I32, I32, I32, I32, I32, I32, F32, F32,
];
const ATTN_BWD: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, I32, I32, I32, I32, I32, I32, F32, F32,
];
/// `flash{HD}_fwd`: [`ATTN_FWD`] without the tile (the tensor-core kernels' tiles are fixed)
/// and the soft cap (soft-capped scores take the SIMT kernels).
const FLASH_FWD: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, I32, I32, I32, I32, F32,
];
/// `flash{HD}_bwd` and `flash{HD}_bwd_kv`: [`ATTN_BWD`] without the tile and the soft cap.
const FLASH_BWD: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, I32, I32, I32, I32, F32,
];
const PTR2_N64: &[Param] = &[Ptr, Ptr, I64];
const PTR2_ROWS_COLS: &[Param] = &[Ptr, Ptr, I32, I32];
/// `embedding_fwd`: out, wte, tokens, n, c, scale.
const EMBED_FWD: &[Param] = &[Ptr, Ptr, Ptr, I32, I32, F32];
/// `embedding_bwd`: dwte, dout, the grouped tokens, n, groups, c, scale.
const EMBED_BWD: &[Param] = &[Ptr, Ptr, Ptr, I32, I32, I32, F32];
/// `rmsnorm_fwd`: out, rstd, x, w, n, c, eps, w_offset.
const RMSNORM_FWD: &[Param] = &[Ptr, Ptr, Ptr, Ptr, I32, I32, F32, F32];
/// `rmsnorm_bwd`: dx, dout, x, w, rstd, n, c, accumulate, w_offset.
const RMSNORM_BWD: &[Param] = &[Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, I32, F32];
const RMSNORM_DW: &[Param] = &[Ptr, Ptr, Ptr, Ptr, I32, I32];
const ROPE: &[Param] = &[Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, I32];
/// `cross_entropy_fwd`: losses, logits, targets, rows, vocab, softcap.
const CE_FWD: &[Param] = &[Ptr, Ptr, Ptr, I32, I32, F32];
/// `cross_entropy_bwd`: logits, losses, targets, rows, vocab, scale, softcap.
const CE_BWD: &[Param] = &[Ptr, Ptr, Ptr, I32, I32, F32, F32];

/// Every kernel file.
pub const FILES: &[KernelFile] = &[
    KernelFile {
        file: "embedding.cu",
        source: include_str!("../../kernels/embedding.cu"),
        kernels: &[
            sig("embedding_fwd_f32", EMBED_FWD),
            sig("embedding_bwd_f32", EMBED_BWD),
            sig("embedding_fwd_bf16", EMBED_FWD),
            sig("embedding_fwd_f32w16", EMBED_FWD),
            sig("embedding_bwd_bf16", EMBED_BWD),
        ],
    },
    KernelFile {
        file: "rmsnorm.cu",
        source: include_str!("../../kernels/rmsnorm.cu"),
        kernels: &[
            sig("rmsnorm_fwd_f32", RMSNORM_FWD),
            sig("rmsnorm_bwd_f32", RMSNORM_BWD),
            sig("rmsnorm_bwd_dw_f32", RMSNORM_DW),
            sig("rmsnorm_fwd_bf16", RMSNORM_FWD),
            sig("rmsnorm_bwd_bf16", RMSNORM_BWD),
            sig("rmsnorm_bwd_dw_bf16", RMSNORM_DW),
            sig("rmsnorm_fwd_f32w16", RMSNORM_FWD),
            sig("rmsnorm_bwd_f32w16", RMSNORM_BWD),
            sig("rmsnorm_fwd_f32w16o16", RMSNORM_FWD),
        ],
    },
    KernelFile {
        file: "rope.cu",
        source: include_str!("../../kernels/rope.cu"),
        kernels: &[
            sig("rope_fwd_f32", ROPE),
            sig("rope_bwd_f32", ROPE),
            sig("rope_fwd_bf16", ROPE),
            sig("rope_bwd_bf16", ROPE),
            sig("rope_fwd_f32o16", ROPE),
            sig("rope_bwd_f32o16", ROPE),
        ],
    },
    KernelFile {
        file: "swiglu.cu",
        source: include_str!("../../kernels/swiglu.cu"),
        kernels: &[
            sig("swiglu_fwd_f32", &[Ptr, Ptr, Ptr, I64]),
            sig("swiglu_bwd_f32", &[Ptr, Ptr, Ptr, Ptr, Ptr, I64]),
            sig("swiglu_fwd_bf16", &[Ptr, Ptr, Ptr, I64]),
            sig("swiglu_bwd_bf16", &[Ptr, Ptr, Ptr, Ptr, Ptr, I64]),
            sig("swiglu_fwd_f32o16", &[Ptr, Ptr, Ptr, I64]),
            sig("swiglu_bwd_f32o16", &[Ptr, Ptr, Ptr, Ptr, Ptr, I64]),
            sig("geglu_fwd_f32", &[Ptr, Ptr, Ptr, I64]),
            sig("geglu_bwd_f32", &[Ptr, Ptr, Ptr, Ptr, Ptr, I64]),
            sig("geglu_fwd_bf16", &[Ptr, Ptr, Ptr, I64]),
            sig("geglu_bwd_bf16", &[Ptr, Ptr, Ptr, Ptr, Ptr, I64]),
            sig("geglu_fwd_f32o16", &[Ptr, Ptr, Ptr, I64]),
            sig("geglu_bwd_f32o16", &[Ptr, Ptr, Ptr, Ptr, Ptr, I64]),
        ],
    },
    KernelFile {
        file: "moe.cu",
        source: include_str!("../../kernels/moe.cu"),
        kernels: &[
            // probs, expert, weight, logits; n, e, k, norm, router
            // (router: 0 softmax then top-k, 1 top-k then softmax)
            sig(
                "moe_route_fwd_f32",
                &[Ptr, Ptr, Ptr, Ptr, I32, I32, I32, I32, I32],
            ),
            // x, h, slots; rows, c, k.
            sig("moe_gather_fwd_f32", &[Ptr, Ptr, Ptr, I32, I32, I32]),
            sig("moe_gather_fwd_bf16", &[Ptr, Ptr, Ptr, I32, I32, I32]),
            // y, b, slots, expert; rows, w.
            sig("moe_bias_fwd_f32", &[Ptr, Ptr, Ptr, Ptr, I32, I32]),
            sig("moe_bias_fwd_f32w16", &[Ptr, Ptr, Ptr, Ptr, I32, I32]),
            // db, dy, offsets; e, w.
            sig("moe_bias_bwd_f32", &[Ptr, Ptr, Ptr, I32, I32]),
            // out, y, row_of, expert, weight (or null); n, c, k.
            sig(
                "moe_combine_fwd_f32",
                &[Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, I32],
            ),
            // dy, dweight, dout, y, slots, row_of, weight; rows, c, k.
            sig(
                "moe_combine_bwd_f32",
                &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, I32],
            ),
            // dlogits, probs, expert, weight, dweight, aux (or null), pad (u8, or null); n, e,
            // k, norm, router.
            sig(
                "moe_route_bwd_f32",
                &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, I32, I32, I32],
            ),
            // sums (f64), probs, pad (u8, or null); n, e.
            sig("moe_prob_sums_fwd_f32", &[Ptr, Ptr, Ptr, I32, I32]),
            // out, gu; n, alpha, limit.
            sig("moe_clamped_swiglu_fwd_f32", &[Ptr, Ptr, I64, F32, F32]),
            // dgu, dout, gu; n, alpha, limit.
            sig(
                "moe_clamped_swiglu_bwd_f32",
                &[Ptr, Ptr, Ptr, I64, F32, F32],
            ),
        ],
    },
    KernelFile {
        file: "expert_gemm.cu",
        source: include_str!("../../kernels/expert_gemm.cu"),
        kernels: &[
            // c, a, b, offsets; groups, n, k, b_stride, b_kmajor, accumulate, vec.
            sig(
                "expert_gemm_fwd_f32i16",
                &[Ptr, Ptr, Ptr, Ptr, I32, I32, I32, I64, I32, I32, I32],
            ),
            // c, a, b, offsets; m, n, c_stride, accumulate, vec.
            sig(
                "expert_gemm_bwd_f32i16",
                &[Ptr, Ptr, Ptr, Ptr, I32, I32, I64, I32, I32],
            ),
        ],
    },
    KernelFile {
        file: "sinks.cu",
        source: include_str!("../../kernels/sinks.cu"),
        kernels: &[
            // o, lse, sinks; nb, rows, nh, hd.
            sig("attn_sinks_fwd_f32", &[Ptr, Ptr, Ptr, I32, I32, I32, I32]),
            sig(
                "attn_sinks_fwd_f32w16",
                &[Ptr, Ptr, Ptr, I32, I32, I32, I32],
            ),
            // dsinks, d_o, o, lse, sinks; nb, rows, nh, hd.
            sig(
                "attn_sinks_bwd_f32",
                &[Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, I32, I32],
            ),
            sig(
                "attn_sinks_bwd_f32i16",
                &[Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, I32, I32],
            ),
        ],
    },
    KernelFile {
        file: "attention.cu",
        source: include_str!("../../kernels/attention.cu"),
        kernels: &[
            sig("attention_fwd_f32", ATTN_FWD),
            sig("attention_bwd_f32", ATTN_BWD),
            sig("attention_bwd_kv_f32", ATTN_BWD),
            sig("attention_fwd_bf16", ATTN_FWD),
            sig("attention_bwd_bf16", ATTN_BWD),
            sig("attention_bwd_kv_bf16", ATTN_BWD),
            sig("attention_fwd_f32i16", ATTN_FWD),
            sig("attention_bwd_f32i16", ATTN_BWD),
            sig("attention_bwd_kv_f32i16", ATTN_BWD),
        ],
    },
    KernelFile {
        file: "flash.cu",
        source: include_str!("../../kernels/flash.cu"),
        kernels: &[
            sig("flash32_fwd_f32i16", FLASH_FWD),
            sig("flash32_bwd_f32i16", FLASH_BWD),
            sig("flash32_bwd_kv_f32i16", FLASH_BWD),
            sig("flash64_fwd_f32i16", FLASH_FWD),
            sig("flash64_bwd_f32i16", FLASH_BWD),
            sig("flash64_bwd_kv_f32i16", FLASH_BWD),
            sig("flash128_fwd_f32i16", FLASH_FWD),
            sig("flash128_bwd_f32i16", FLASH_BWD),
            sig("flash128_bwd_kv_f32i16", FLASH_BWD),
        ],
    },
    KernelFile {
        file: "cross_entropy.cu",
        source: include_str!("../../kernels/cross_entropy.cu"),
        kernels: &[
            sig("cross_entropy_fwd_f32", CE_FWD),
            sig("cross_entropy_bwd_f32", CE_BWD),
            sig("cross_entropy_fwd_bf16", CE_FWD),
            sig("cross_entropy_bwd_bf16", CE_BWD),
        ],
    },
    KernelFile {
        file: "cast.cu",
        source: include_str!("../../kernels/cast.cu"),
        kernels: &[
            sig("cast_fwd_f32_bf16", PTR2_N64),
            sig("cast_bwd_bf16_f32", PTR2_N64),
        ],
    },
    KernelFile {
        file: "reduce.cu",
        source: include_str!("../../kernels/reduce.cu"),
        kernels: &[
            sig("sumsq_fwd_f32", PTR2_N64),
            sig("bias_fwd_f32", PTR2_ROWS_COLS),
            sig("bias_bwd_f32", PTR2_ROWS_COLS),
            sig("add_fwd_f32", PTR2_N64),
            sig("bias_fwd_bf16", PTR2_ROWS_COLS),
            sig("bias_bwd_bf16", PTR2_ROWS_COLS),
            sig("add_fwd_bf16", PTR2_N64),
            sig("bias_fwd_f32w16", PTR2_ROWS_COLS),
        ],
    },
];

/// The signature of kernel `name`, if it exists.
pub fn signature(name: &str) -> Option<&'static Signature> {
    FILES
        .iter()
        .flat_map(|f| f.kernels.iter())
        .find(|s| s.name == name)
}

impl KernelFile {
    /// The source with `common.cuh` inlined (NVRTC is given one self-contained program).
    pub fn program(&self) -> String {
        self.source.replace(
            "#include \"common.cuh\"",
            &format!(
                "// ---- common.cuh ----\n{COMMON}\n// ---- {} ----",
                self.file
            ),
        )
    }
}

/// NVRTC options for `arch` with the CUDA headers (`cuda_bf16.h`) under `include`. Accurate
/// math (no fast-math, no flush-to-zero): the kernels are checked against the CPU reference.
pub fn nvrtc_options(arch: &str, include: &std::path::Path) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        format!("--include-path={}", include.display()),
        "--ftz=false".into(),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--fmad=true".into(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_symbol_is_named_by_convention_and_defined_in_its_file() {
        let mut all = std::collections::BTreeSet::new();
        for f in FILES {
            assert!(
                f.program().contains("common.cuh ----"),
                "{} inlines the header",
                f.file
            );
            for s in f.kernels.iter().map(|k| k.name) {
                assert!(all.insert(s), "{s} exported twice");
                let (op_dir, dtype) = s.rsplit_once('_').unwrap();
                assert!(
                    op_dir.contains("_fwd") || op_dir.contains("_bwd"),
                    "{s}: names are {{op}}_{{fwd|bwd}}_{{dtype}}"
                );
                assert!(
                    ["f32", "bf16", "f32w16", "f32w16o16", "f32o16", "f32i16"].contains(&dtype),
                    "{s}: dtype suffix"
                );
                // Defined literally, through the file's per-dtype macro (`…_##name`), or through
                // a per-head-dim one (`flash##HD##_fwd_##name`, instantiated as `FLASH(64, f32i16`).
                let stem = s.trim_end_matches(&format!("_{dtype}"));
                let digits: String = stem.chars().filter(char::is_ascii_digit).collect();
                let per_dim = !digits.is_empty()
                    && f.source
                        .contains(&format!("{}_##name", stem.replacen(&digits, "##HD##", 1)))
                    && f.source.contains(&format!("({digits}, {dtype},"));
                assert!(
                    f.source.contains(s) || f.source.contains(&format!("{stem}_##name")) || per_dim,
                    "{s} is not defined in {}",
                    f.file
                );
            }
        }
        // Every kernel file on disk is registered.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        for e in std::fs::read_dir(dir).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            if name.ends_with(".cu") {
                assert!(
                    FILES.iter().any(|f| f.file == name),
                    "{name} is not in FILES"
                );
            }
        }
    }
}
