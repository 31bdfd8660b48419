//! The CUDA path end to end, as a GPU would run it: `megatrain selftest --device cuda` (every
//! kernel and GEMM against the CPU reference, training steps against the CPU device, the link)
//! — on the CUDA emulator (tools/cuemu.sh), or on a real GPU with `MEGATRAIN_GPU=1`.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

#[test]
fn selftest_passes() {
    let out = common::megatrain_cuda()
        .args(["selftest", "--device", "cuda"])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    eprintln!("{stdout}");
    assert!(out.status.success(), "selftest failed:\n{stdout}\n{stderr}");
    assert!(
        !stderr.contains("cuemu: error"),
        "the emulator reported defects:\n{stderr}"
    );
    let checks = stdout.lines().filter(|l| l.ends_with("pass")).count();
    assert!(checks >= 30, "only {checks} checks passed:\n{stdout}");
    if std::env::var("MEGATRAIN_GPU").is_err() {
        assert!(
            stdout.contains("emulated"),
            "the link figures must say they are emulated:\n{stdout}"
        );
    }
}
