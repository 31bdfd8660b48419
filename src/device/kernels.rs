//! The CUDA kernel sources (`kernels/*.cu`), embedded in the binary, and the symbols each must
//! export. Plain data, compiled in every build: NVRTC turns them into PTX at start-up on a GPU
//! machine (feature `cuda`), and the test suite compiles all of them for every architecture in
//! [`ARCHS`] even where no GPU exists.

/// The shared header every kernel file includes.
pub const COMMON: &str = include_str!("../../kernels/common.cuh");

/// One kernel file.
#[derive(Debug, Clone, Copy)]
pub struct KernelFile {
    /// File name under `kernels/`.
    pub file: &'static str,
    /// Its source.
    pub source: &'static str,
    /// The `extern "C"` kernels it must export (`{op}_{fwd|bwd}_{dtype}`).
    pub symbols: &'static [&'static str],
}

/// GPU architectures every kernel is compiled for in CI (A100, H100/H200/GH200).
pub const ARCHS: &[&str] = &["sm_80", "sm_90"];

/// Every kernel file.
pub const FILES: &[KernelFile] = &[
    KernelFile {
        file: "embedding.cu",
        source: include_str!("../../kernels/embedding.cu"),
        symbols: &[
            "embedding_fwd_f32",
            "embedding_bwd_f32",
            "embedding_fwd_bf16",
            "embedding_bwd_bf16",
        ],
    },
    KernelFile {
        file: "rmsnorm.cu",
        source: include_str!("../../kernels/rmsnorm.cu"),
        symbols: &[
            "rmsnorm_fwd_f32",
            "rmsnorm_bwd_f32",
            "rmsnorm_fwd_bf16",
            "rmsnorm_bwd_bf16",
        ],
    },
    KernelFile {
        file: "rope.cu",
        source: include_str!("../../kernels/rope.cu"),
        symbols: &[
            "rope_fwd_f32",
            "rope_bwd_f32",
            "rope_fwd_bf16",
            "rope_bwd_bf16",
        ],
    },
    KernelFile {
        file: "swiglu.cu",
        source: include_str!("../../kernels/swiglu.cu"),
        symbols: &[
            "swiglu_fwd_f32",
            "swiglu_bwd_f32",
            "swiglu_fwd_bf16",
            "swiglu_bwd_bf16",
        ],
    },
    KernelFile {
        file: "attention.cu",
        source: include_str!("../../kernels/attention.cu"),
        symbols: &[
            "attention_fwd_f32",
            "attention_bwd_f32",
            "attention_bwd_kv_f32",
            "attention_fwd_bf16",
            "attention_bwd_bf16",
            "attention_bwd_kv_bf16",
        ],
    },
    KernelFile {
        file: "cross_entropy.cu",
        source: include_str!("../../kernels/cross_entropy.cu"),
        symbols: &[
            "cross_entropy_fwd_f32",
            "cross_entropy_bwd_f32",
            "cross_entropy_fwd_bf16",
            "cross_entropy_bwd_bf16",
        ],
    },
    KernelFile {
        file: "cast.cu",
        source: include_str!("../../kernels/cast.cu"),
        symbols: &["cast_fwd_f32_bf16", "cast_fwd_bf16_f32"],
    },
    KernelFile {
        file: "reduce.cu",
        source: include_str!("../../kernels/reduce.cu"),
        symbols: &[
            "sumsq_fwd_f32",
            "bias_fwd_f32",
            "bias_bwd_f32",
            "add_fwd_f32",
            "bias_fwd_bf16",
            "bias_bwd_bf16",
            "add_fwd_bf16",
        ],
    },
];

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
            for s in f.symbols {
                assert!(all.insert(*s), "{s} exported twice");
                let (op_dir, dtype) = s.rsplit_once('_').unwrap();
                assert!(
                    op_dir.contains("_fwd") || op_dir.contains("_bwd"),
                    "{s}: names are {{op}}_{{fwd|bwd}}_{{dtype}}"
                );
                assert!(["f32", "bf16"].contains(&dtype), "{s}: dtype suffix");
                // Defined literally or through the file's per-dtype macro (`…_##name`).
                let stem = s.trim_end_matches(&format!("_{dtype}"));
                assert!(
                    f.source.contains(s) || f.source.contains(&format!("{stem}_##name")),
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
