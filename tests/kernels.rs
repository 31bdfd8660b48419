//! Every CUDA kernel compiles through NVRTC for every architecture in `ARCHS`, with no warning,
//! and exports the symbols the device looks up — on a machine with no GPU (CI installs NVRTC and
//! the CUDA headers from their PyPI wheels; see tools/setup-cuda-wheels.sh).
//!
//! Without NVRTC the test skips and says why, unless `MEGATRAIN_REQUIRE_NVRTC=1` (CI sets it),
//! in which case a missing toolchain fails it. `MEGATRAIN_PTX_OUT=DIR` keeps the PTX
//! (tools/ptxas_report.sh reads it).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr)]

use megatrain::device::cuda::nvrtc;
use megatrain::device::kernels::{ARCHS, FILES};

/// NVRTC, loaded; `None` (after saying why) where there is none and CI does not require it.
fn toolchain() -> Option<nvrtc::Toolchain> {
    let tc = match nvrtc::Toolchain::for_compiling() {
        Ok(tc) => tc,
        Err(e) if std::env::var("MEGATRAIN_REQUIRE_NVRTC").as_deref() == Ok("1") => {
            panic!("MEGATRAIN_REQUIRE_NVRTC=1 but {e}")
        }
        Err(e) => {
            eprintln!("SKIP: no NVRTC to compile the kernels with: {e}");
            return None;
        }
    };
    eprintln!(
        "NVRTC {} at {}, headers {}",
        tc.version,
        tc.library.display(),
        tc.include.display()
    );
    Some(tc)
}

#[test]
fn every_kernel_compiles_for_every_arch_without_warnings() {
    let Some(tc) = toolchain() else {
        return;
    };
    let out = std::env::var_os("MEGATRAIN_PTX_OUT").map(std::path::PathBuf::from);
    let mut n = 0;
    for arch in ARCHS {
        let t0 = std::time::Instant::now();
        for c in nvrtc::compile_all(&tc, arch).unwrap() {
            assert!(
                c.log.is_empty(),
                "{} for {arch}: NVRTC said:\n{}",
                c.file,
                c.log
            );
            assert!(
                c.ptx.contains(&format!(".target {arch}")),
                "{}: {arch}",
                c.file
            );
            if let Some(dir) = &out {
                std::fs::create_dir_all(dir).unwrap();
                nvrtc::write_ptx(dir, &c).unwrap();
            }
            n += 1;
        }
        eprintln!("{arch}: {} files in {:?}", FILES.len(), t0.elapsed());
    }
    assert_eq!(n, FILES.len() * ARCHS.len());
}

/// A broken kernel is an error that carries NVRTC's message (so a typo fails CI readably).
#[test]
fn a_compile_error_carries_the_nvrtc_log() {
    let Some(tc) = toolchain() else {
        return;
    };
    let bad = megatrain::device::kernels::KernelFile {
        file: "broken.cu",
        source: "#include \"common.cuh\"\nextern \"C\" __global__ void broken_fwd_f32(float* x) { x[0] = undefined_thing; }\n",
        kernels: &[megatrain::device::kernels::Signature {
            name: "broken_fwd_f32",
            params: &[megatrain::device::kernels::Param::Ptr],
        }],
    };
    let e = nvrtc::compile(&tc, &bad, "sm_90").unwrap_err().to_string();
    assert!(
        e.contains("undefined_thing") && e.contains("broken.cu"),
        "{e}"
    );
}

/// The parameter lists of an NVRTC-compiled PTX: entry name → parameter types (`.u64`, …).
fn ptx_params(ptx: &str) -> std::collections::HashMap<String, Vec<String>> {
    let mut out = std::collections::HashMap::new();
    let mut rest = ptx;
    while let Some(i) = rest.find(".entry ") {
        rest = &rest[i + 7..];
        let name_end = rest.find('(').unwrap();
        let name = rest[..name_end].trim().to_owned();
        let close = rest.find(')').unwrap();
        let params = rest[name_end + 1..close]
            .split(',')
            .filter_map(|p| p.split_whitespace().nth(1).map(str::to_owned))
            .collect();
        out.insert(name, params);
        rest = &rest[close..];
    }
    out
}

/// Every kernel's declared signature (what its typed launch wrapper is checked against at every
/// launch) is exactly the parameter list of the compiled kernel, and every exported kernel has a
/// typed wrapper (a GPU would read garbage otherwise; this is the part of a launch that can be
/// checked without one).
#[test]
fn every_signature_matches_the_compiled_kernel_and_every_kernel_has_a_wrapper() {
    let Some(tc) = toolchain() else {
        return;
    };
    let mut params = std::collections::HashMap::new();
    for c in nvrtc::compile_all(&tc, "sm_80").unwrap() {
        params.extend(ptx_params(&c.ptx));
    }
    let mut checked = 0;
    for f in FILES {
        for k in f.kernels {
            let ptx = params
                .get(k.name)
                .unwrap_or_else(|| panic!("{}: no entry {}", f.file, k.name));
            let declared: Vec<&str> = k.params.iter().map(|p| p.ptx()).collect();
            assert_eq!(
                &declared, ptx,
                "{}: {} is declared {:?}, compiled {ptx:?}",
                f.file, k.name, k.params
            );
            let stem = k
                .name
                .strip_suffix("_f32")
                .or_else(|| k.name.strip_suffix("_bf16"))
                .or_else(|| k.name.strip_suffix("_f32w16"))
                .or_else(|| k.name.strip_suffix("_f32w16o16"))
                .or_else(|| k.name.strip_suffix("_f32o16"))
                .or_else(|| k.name.strip_suffix("_f32i16"))
                .unwrap_or(k.name);
            assert!(
                megatrain::device::cuda::launches::WRAPPED.contains(&stem)
                    || megatrain::device::cuda::launches::WRAPPED.contains(&k.name),
                "{} has no typed launch wrapper",
                k.name
            );
            checked += 1;
        }
    }
    assert_eq!(checked, params.len(), "every entry point is declared");
    eprintln!("{checked} kernels match their declared signatures");
}

/// Without a GPU, `train --device cuda` (in a CUDA build) stops before any state is allocated,
/// exits non-zero and says why.
#[test]
fn train_on_cuda_without_a_gpu_says_why() {
    if std::path::Path::new("/dev/nvidia0").exists() {
        eprintln!("SKIP: this machine has a GPU; `megatrain selftest --device cuda` checks it");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_megatrain"))
        .current_dir(d.path())
        .args(["train", "--demo", "--device", "cuda", "--steps", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("error: CUDA driver") && err.contains("no NVIDIA driver"),
        "{err}"
    );
}
