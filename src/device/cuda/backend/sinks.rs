//! Attention sinks on the GPU (`kernels/sinks.cu`; the CPU's `model::ops::sinks`).

use super::{CudaBackend, DevP};
use crate::device::launch;
use crate::model::ops::AttnShape;
use crate::{Error, Result};

impl CudaBackend {
    /// The sinks' forward on the attention's output and log-sum-exp (fp32).
    pub(super) fn sinks_forward(
        &mut self,
        o: DevP,
        lse: DevP,
        sinks: DevP,
        s: AttnShape,
    ) -> Result<()> {
        fp32(&[o, lse, sinks])?;
        let rows = s.q1 - s.q0;
        let l = launch::elementwise(s.b * s.nh * rows, self.sms());
        self.k()
            .attn_sinks(l, (o.addr, lse.addr, sinks.addr), (s.b, rows, s.nh, s.hd))
    }

    /// The sinks' gradient (`dsinks +=`).
    pub(super) fn sinks_backward(
        &mut self,
        dsinks: DevP,
        (d_o, o, lse, sinks): (DevP, DevP, DevP, DevP),
        s: AttnShape,
    ) -> Result<()> {
        fp32(&[dsinks, d_o, o, lse, sinks])?;
        let l = launch::elementwise(s.nh, self.sms());
        self.k().attn_sinks_bwd(
            l,
            dsinks.addr,
            (d_o.addr, o.addr, lse.addr, sinks.addr),
            (s.b, s.q1 - s.q0, s.nh, s.hd),
        )
    }
}

/// Attention sinks run in fp32 (their models' mixture of experts does).
fn fp32(ps: &[DevP]) -> Result<()> {
    match ps.iter().any(|p| p.bf16) {
        true => Err(Error::internal(
            "CUDA backend",
            "attention sinks on bf16 data",
        )),
        false => Ok(()),
    }
}
