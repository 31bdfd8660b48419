//! What `megatrain bench kernels` measured (the runner is `bench::kernels`, feature `cuda`): its
//! report, readable in any build, and what it says about the planner's kernel efficiencies —
//! `megatrain plan --calibration` takes a GPU's measured GEMM and attention rates over the
//! sourced assumptions (the calibration a GPU run gives the planner).

use crate::plan::KernelEfficiency;

/// One measured case.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KernelRow {
    /// Kernel family ("gemm bf16", "attention fwd (tensor cores)", …).
    pub kernel: String,
    /// Its shape, in words.
    pub shape: String,
    /// Floating-point operations of one run (2 per multiply-add; causal attention counts the
    /// unmasked half).
    pub flops: f64,
    /// Median milliseconds.
    pub ms: f64,
    /// flops / time.
    pub tflops: f64,
    /// The datasheet peak it is set beside (dense fp32 or bf16 tensor core), if the GPU is known.
    pub peak_tflops: Option<f64>,
}

/// The report.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KernelReport {
    /// The device's name.
    pub device: String,
    /// Whether the device is the CUDA emulator: times are host times.
    pub emulated: bool,
    /// Every case.
    pub rows: Vec<KernelRow>,
}

/// The report as a table.
pub fn render(r: &KernelReport) -> String {
    let mut s = format!(
        "bench kernels — {}{}\n",
        r.device,
        if r.emulated {
            " — EMULATED: host times under tools/cuemu.sh, not GPU figures"
        } else {
            ""
        }
    );
    s += &format!(
        "{:<34} {:<44} {:>10} {:>9} {:>8}\n",
        "kernel", "shape", "ms", "TFLOP/s", "of peak"
    );
    for row in &r.rows {
        let of_peak = row
            .peak_tflops
            .map(|p| format!("{:.1}%", 100.0 * row.tflops / p))
            .unwrap_or_else(|| "-".into());
        s += &format!(
            "{:<34} {:<44} {:>10.3} {:>9.3} {:>8}\n",
            row.kernel, row.shape, row.ms, row.tflops, of_peak
        );
    }
    s += "peaks: datasheet dense fp32 (CUDA cores) for fp32 rows, bf16 tensor-core for the rest\n";
    s
}

/// The kernel efficiencies a report measured, in bf16 (cuBLAS `GemmEx` with fp32 sums, the
/// tensor-core attention) or fp32 (SGEMM, the SIMT attention), as shares of the datasheet peak
/// the rows carry; `memory_tbps` (not measured here) is kept from the assumptions. The best GEMM
/// row, and the attention rows of the longest sequence measured: the forward's share, and the
/// backward's from the forward+backward row less the forward (the backward is 2.5 forwards of
/// FLOPs, the planner's count). `None` when the report lacks the rows or the peaks.
pub fn measured_efficiency(
    r: &KernelReport,
    bf16: bool,
    memory_tbps: f64,
) -> Option<KernelEfficiency> {
    let gemm_kind = if bf16 { "gemm bf16" } else { "gemm fp32" };
    let gemm = r
        .rows
        .iter()
        .filter(|x| x.kernel.starts_with(gemm_kind))
        .filter_map(|x| Some(x.tflops / x.peak_tflops?))
        .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))?;
    let (fwd_kind, fb_kind) = if bf16 {
        (
            "attention fwd (tensor cores)",
            Some("attention fwd+bwd (tensor cores)"),
        )
    } else {
        ("attention fwd (fp32 SIMT)", None)
    };
    // The forward row of the longest sequence (its FLOPs grow with T²).
    let fwd = r
        .rows
        .iter()
        .filter(|x| x.kernel == fwd_kind)
        .max_by(|a, b| a.flops.total_cmp(&b.flops))?;
    let peak = fwd.peak_tflops?;
    let attention_fwd = fwd.tflops / peak;
    let attention_bwd = match fb_kind {
        Some(k) => {
            let fb = r
                .rows
                .iter()
                .find(|x| x.kernel == k && x.shape == fwd.shape)?;
            let bwd_ms = fb.ms - fwd.ms;
            if bwd_ms <= 0.0 {
                return None;
            }
            2.5 * fwd.flops / (bwd_ms * 1e-3) / 1e12 / peak
        }
        // The SIMT backward is not measured alone: assumed to reach the forward's share.
        None => attention_fwd,
    };
    Some(KernelEfficiency {
        gemm,
        // Not among the kernels it times: the plan assumes them (`plan::efficiency`).
        expert_gemm: None,
        attention_fwd,
        attention_bwd,
        memory_tbps,
        source: format!(
            "measured by `megatrain bench kernels` on {}: GEMM {:.1}%, attention forward {:.1}%, backward {:.1}% of the datasheet peak ({}; longest sequence: {}); elementwise memory rate assumed",
            r.device,
            100.0 * gemm,
            100.0 * attention_fwd,
            100.0 * attention_bwd,
            if bf16 { "bf16" } else { "fp32" },
            fwd.shape
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(kernel: &str, shape: &str, flops: f64, ms: f64, peak: f64) -> KernelRow {
        KernelRow {
            kernel: kernel.into(),
            shape: shape.into(),
            flops,
            ms,
            tflops: flops / (ms * 1e-3) / 1e12,
            peak_tflops: Some(peak),
        }
    }

    #[test]
    fn a_measured_report_gives_the_shares_of_the_peak() {
        let t8 = "T 8192, 32 heads (8 kv), hd 128";
        let f = 2.2e12; // forward FLOPs of the T 8192 case
        let r = KernelReport {
            device: "NVIDIA H100 80GB HBM3".into(),
            emulated: false,
            rows: vec![
                row("gemm bf16 (fp32 accumulate)", "qkv", 1e12, 2.0, 989.0),
                row("gemm bf16 (fp32 accumulate)", "down", 1e12, 1.6, 989.0),
                row("gemm fp32", "down", 1e12, 25.0, 67.0),
                row("attention fwd (fp32 SIMT)", t8, f, 200.0, 67.0),
                row(
                    "attention fwd (tensor cores)",
                    "T 2048, 32 heads (8 kv), hd 128",
                    f / 16.0,
                    1.0,
                    989.0,
                ),
                row("attention fwd (tensor cores)", t8, f, 10.0, 989.0),
                row("attention fwd+bwd (tensor cores)", t8, 3.5 * f, 40.0, 989.0),
            ],
        };
        let e = measured_efficiency(&r, true, 3.0).unwrap();
        // The best GEMM: 1e12 / 1.6 ms = 625 TF of 989.
        assert!((e.gemm - 625.0 / 989.0).abs() < 1e-9, "{e:?}");
        // The longest sequence's forward: 220 TF; backward 2.5 · 2.2e12 over 30 ms = 183.3 TF.
        assert!((e.attention_fwd - 220.0 / 989.0).abs() < 1e-9, "{e:?}");
        assert!((e.attention_bwd - 2.5 * 2.2e12 / 0.030 / 1e12 / 989.0).abs() < 1e-9);
        assert_eq!(e.memory_tbps, 3.0);
        assert!(e.source.contains("H100"), "{}", e.source);
        let e = measured_efficiency(&r, false, 3.0).unwrap();
        assert!((e.gemm - 40.0 / 67.0).abs() < 1e-9, "{e:?}");
        assert_eq!(e.attention_fwd, e.attention_bwd);
        // No attention rows: nothing claimed.
        let gemms_only = KernelReport {
            rows: r.rows[..3].to_vec(),
            ..r
        };
        assert_eq!(measured_efficiency(&gemms_only, true, 3.0), None);
    }
}
