//! Every CUDA kernel compiles through NVRTC for every architecture in `ARCHS`, with no warning,
//! and exports the symbols the device looks up — on a machine with no GPU (CI installs NVRTC and
//! the CUDA headers from their PyPI wheels; see tools/setup-cuda-wheels.sh).
//!
//! Without NVRTC the test skips and says why, unless `MEGATRAIN_REQUIRE_NVRTC=1` (CI sets it),
//! in which case a missing toolchain fails it. `MEGATRAIN_PTX_OUT=DIR` keeps the PTX
//! (tools/ptxas_report.sh reads it).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr)]

use megatrain::device::kernels::{ARCHS, FILES};
use megatrain::device::nvrtc;

#[test]
fn every_kernel_compiles_for_every_arch_without_warnings() {
    let tc = match nvrtc::locate() {
        Ok(tc) => tc,
        Err(e) if std::env::var("MEGATRAIN_REQUIRE_NVRTC").as_deref() == Ok("1") => {
            panic!("MEGATRAIN_REQUIRE_NVRTC=1 but {e}")
        }
        Err(e) => {
            eprintln!("SKIP: no NVRTC to compile the kernels with: {e}");
            return;
        }
    };
    nvrtc::load(&tc).unwrap();
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
    let Ok(tc) = nvrtc::locate() else {
        eprintln!("SKIP: no NVRTC");
        return;
    };
    nvrtc::load(&tc).unwrap();
    let bad = megatrain::device::kernels::KernelFile {
        file: "broken.cu",
        source: "#include \"common.cuh\"\nextern \"C\" __global__ void broken_fwd_f32(float* x) { x[0] = undefined_thing; }\n",
        symbols: &["broken_fwd_f32"],
    };
    let e = nvrtc::compile(&tc, &bad, "sm_90").unwrap_err().to_string();
    assert!(
        e.contains("undefined_thing") && e.contains("broken.cu"),
        "{e}"
    );
}
