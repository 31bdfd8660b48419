//! How gradients cross the link back to the host: the planner predicts the step with fp32 and
//! with bf16 gradients (`train --grad-link bf16`) and takes bf16 where it pays.

use super::{time, Hardware, PlanRequest};
use crate::device::GradLink;
use crate::model::config::ModelConfig;
use serde::Serialize;

/// The gradients' format on the link the plan uses, and the step it predicts with each.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GradLinkChoice {
    /// The format (the one asked for, else the one picked).
    pub link: GradLink,
    /// Whether the planner picked it (no `--grad-link` given).
    pub picked: bool,
    /// Predicted step with fp32 gradients, s.
    pub fp32_step_s: f64,
    /// Predicted step with bf16 gradients, s (bf16 plans only).
    pub bf16_step_s: Option<f64>,
}

/// The least share of the step that bf16 gradients must save for [`pick_grad_link`] to take
/// them: below it their rounding buys too little.
pub const GRAD_LINK_MIN_GAIN: f64 = 0.05;

/// `req` with its gradients' format decided, and the steps predicted with each: as asked, else
/// bf16 where the plan is for the bf16 recipe and bf16 gradients save at least
/// [`GRAD_LINK_MIN_GAIN`] of the step (the device→host link, or its drain after the last
/// backward, bounds it), else fp32 (exact).
pub fn pick_grad_link(
    model: &ModelConfig,
    hw: &Hardware,
    req: &PlanRequest,
) -> (PlanRequest, GradLinkChoice) {
    let with = |link: GradLink| PlanRequest {
        grad_link: Some(link),
        ..req.clone()
    };
    let fp32_step_s = time(model, hw, &with(GradLink::Fp32)).step_s;
    let bf16_step_s = req
        .bf16
        .then(|| time(model, hw, &with(GradLink::Bf16)).step_s);
    let link = req.grad_link.unwrap_or(match bf16_step_s {
        Some(b) if b < (1.0 - GRAD_LINK_MIN_GAIN) * fp32_step_s => GradLink::Bf16,
        _ => GradLink::Fp32,
    });
    (
        with(link),
        GradLinkChoice {
            link,
            picked: req.grad_link.is_none(),
            fp32_step_s,
            bf16_step_s,
        },
    )
}

/// How the gradients cross the link, and why, for [`super::render`].
pub(super) fn grad_link_line(g: &GradLinkChoice, ms: impl Fn(f64) -> String) -> String {
    let save = |b: f64| 100.0 * (1.0 - b / g.fp32_step_s);
    match (g.link, g.picked, g.bf16_step_s) {
        (GradLink::Bf16, true, Some(b)) => format!(
            "bf16 on the link, picked: the step takes {} with fp32 gradients, {} with bf16 ({:.0}% less); train with --grad-link bf16",
            ms(g.fp32_step_s),
            ms(b),
            save(b)
        ),
        (GradLink::Bf16, _, _) => format!(
            "bf16 on the link (--grad-link bf16); fp32 gradients: a step of {}",
            ms(g.fp32_step_s)
        ),
        (GradLink::Fp32, true, Some(b)) => format!(
            "fp32 on the link: bf16 gradients would save {:.1}% of the step, under the {:.0}% that pays for their rounding",
            save(b),
            100.0 * GRAD_LINK_MIN_GAIN
        ),
        (GradLink::Fp32, false, Some(b)) => format!(
            "fp32 on the link (--grad-link fp32); bf16 gradients: a step of {}",
            ms(b)
        ),
        (GradLink::Fp32, _, None) => "fp32 on the link".to_owned(),
    }
}
