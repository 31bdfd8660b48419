//! Attention sinks on the GPU (`kernels/sinks.cu`; the CPU's `model::ops::sinks`): fp32 output
//! and log-sum-exp; the sinks as the device holds them (bf16 on a bf16 device), dO as stored
//! (bf16 under the bf16 recipe).

use super::{CudaBackend, DevP};
use crate::device::cuda::launches::Dtype;
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
        fp32(&[o, lse])?;
        let dt = match sinks.bf16 {
            true => Dtype::F32W16,
            false => Dtype::F32,
        };
        let rows = s.q1 - s.q0;
        let l = launch::elementwise(s.b * s.nh * rows, self.sms());
        self.k().attn_sinks(
            dt,
            l,
            (o.addr, lse.addr, sinks.addr),
            (s.b, rows, s.nh, s.hd),
        )
    }

    /// The sinks' gradient (`dsinks +=`).
    pub(super) fn sinks_backward(
        &mut self,
        dsinks: DevP,
        (d_o, o, lse, sinks): (DevP, DevP, DevP, DevP),
        s: AttnShape,
    ) -> Result<()> {
        fp32(&[dsinks, o, lse])?;
        let dt = match (d_o.bf16, sinks.bf16) {
            (false, false) => Dtype::F32,
            (true, true) => Dtype::F32I16,
            _ => {
                return Err(Error::internal(
                    "CUDA backend",
                    "the sinks' gradient: dO and the sinks are bf16 together (the bf16 recipe) or not at all",
                ))
            }
        };
        let l = launch::elementwise(s.nh, self.sms());
        self.k().attn_sinks_bwd(
            dt,
            l,
            dsinks.addr,
            (d_o.addr, o.addr, lse.addr, sinks.addr),
            (s.b, s.q1 - s.q0, s.nh, s.hd),
        )
    }
}

/// The sinks' output, log-sum-exp and gradient are fp32.
fn fp32(ps: &[DevP]) -> Result<()> {
    match ps.iter().any(|p| p.bf16) {
        true => Err(Error::internal(
            "CUDA backend",
            "attention sinks: a bf16 output or log-sum-exp",
        )),
        false => Ok(()),
    }
}
