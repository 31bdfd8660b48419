//! The mixture-of-experts kernels' launches (`kernels/moe.cu`) and the attention sinks'
//! (`kernels/sinks.cu`).

use super::Arg::{Ptr, F32, I32, I64};
use super::{i32_of, Dtype, Launcher};
use crate::device::cuda::runtime::DevPtr;
use crate::device::launch::Launch;
use crate::model::ops::Router;
use crate::Result;

/// The kernels' code of a router: 0 softmax then top-k, 1 top-k then softmax.
fn router_code(r: Router) -> i32 {
    match r {
        Router::SoftmaxTopK => 0,
        Router::TopKSoftmax => 1,
    }
}

/// A token count, an expert count and k as the kernels take them.
fn dims(n: usize, e: usize, k: usize) -> Result<(i32, i32, i32)> {
    Ok((
        i32_of(n, "moe tokens")?,
        i32_of(e, "moe experts")?,
        i32_of(k, "moe top-k")?,
    ))
}

impl Launcher<'_> {
    /// Softmax over `e` router logits per token, the top `k`, their (renormalised) weights.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_route(
        &self,
        l: Launch,
        (probs, expert, weight): (DevPtr, DevPtr, DevPtr),
        logits: DevPtr,
        (n, e, k): (usize, usize, usize),
        (norm, router): (bool, Router),
    ) -> Result<()> {
        let (n, e, k) = dims(n, e, k)?;
        self.launch(
            "moe_route_fwd_f32",
            l,
            &[
                Ptr(probs),
                Ptr(expert),
                Ptr(weight),
                Ptr(logits),
                I32(n),
                I32(e),
                I32(k),
                I32(norm as i32),
                I32(router_code(router)),
            ],
        )
    }

    /// GPT-OSS's clamped SwiGLU over interleaved gate/up (`n` outputs).
    pub fn moe_clamped_swiglu(
        &self,
        l: Launch,
        out: DevPtr,
        gu: DevPtr,
        n: usize,
        (alpha, limit): (f32, f32),
    ) -> Result<()> {
        self.launch(
            "moe_clamped_swiglu_fwd_f32",
            l,
            &[Ptr(out), Ptr(gu), I64(n as i64), F32(alpha), F32(limit)],
        )
    }

    /// Its backward.
    pub fn moe_clamped_swiglu_bwd(
        &self,
        l: Launch,
        (dgu, dout, gu): (DevPtr, DevPtr, DevPtr),
        n: usize,
        (alpha, limit): (f32, f32),
    ) -> Result<()> {
        self.launch(
            "moe_clamped_swiglu_bwd_f32",
            l,
            &[
                Ptr(dgu),
                Ptr(dout),
                Ptr(gu),
                I64(n as i64),
                F32(alpha),
                F32(limit),
            ],
        )
    }

    /// Attention sinks on the output and log-sum-exp of `nb` sequences of `rows` query rows
    /// (`dt`: `F32`, or `F32W16` for a bf16 device's sinks).
    pub fn attn_sinks(
        &self,
        dt: Dtype,
        l: Launch,
        (o, lse, sinks): (DevPtr, DevPtr, DevPtr),
        (nb, rows, nh, hd): (usize, usize, usize, usize),
    ) -> Result<()> {
        let (nb, rows) = (i32_of(nb, "sequences")?, i32_of(rows, "query rows")?);
        let (nh, hd) = (i32_of(nh, "heads")?, i32_of(hd, "head dim")?);
        self.launch(
            &dt.symbol("attn_sinks_fwd"),
            l,
            &[
                Ptr(o),
                Ptr(lse),
                Ptr(sinks),
                I32(nb),
                I32(rows),
                I32(nh),
                I32(hd),
            ],
        )
    }

    /// The sinks' gradient (`dsinks +=`; `dt`: `F32`, or `F32I16` for bf16 dO and sinks).
    pub fn attn_sinks_bwd(
        &self,
        dt: Dtype,
        l: Launch,
        dsinks: DevPtr,
        (d_o, o, lse, sinks): (DevPtr, DevPtr, DevPtr, DevPtr),
        (nb, rows, nh, hd): (usize, usize, usize, usize),
    ) -> Result<()> {
        let (nb, rows) = (i32_of(nb, "sequences")?, i32_of(rows, "query rows")?);
        let (nh, hd) = (i32_of(nh, "heads")?, i32_of(hd, "head dim")?);
        self.launch(
            &dt.symbol("attn_sinks_bwd"),
            l,
            &[
                Ptr(dsinks),
                Ptr(d_o),
                Ptr(o),
                Ptr(lse),
                Ptr(sinks),
                I32(nb),
                I32(rows),
                I32(nh),
                I32(hd),
            ],
        )
    }

    /// `x[r] = h[slots[r] / k]` over `rows` rows of `c` (`dt`: both `F32` or both `Bf16`).
    pub fn moe_gather(
        &self,
        dt: Dtype,
        l: Launch,
        x: DevPtr,
        h: DevPtr,
        slots: DevPtr,
        (rows, c, k): (usize, usize, usize),
    ) -> Result<()> {
        let (rows, c, k) = dims(rows, c, k)?;
        self.launch(
            &dt.symbol("moe_gather_fwd"),
            l,
            &[Ptr(x), Ptr(h), Ptr(slots), I32(rows), I32(c), I32(k)],
        )
    }

    /// `y[r] += b[expert of row r]` over `rows` grouped rows of `w` (`dt`: `F32`, or `F32W16`
    /// for a bf16 device's biases).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_bias(
        &self,
        dt: Dtype,
        l: Launch,
        (y, b): (DevPtr, DevPtr),
        (slots, expert): (DevPtr, DevPtr),
        (rows, w): (usize, usize),
    ) -> Result<()> {
        let (rows, w) = (i32_of(rows, "moe rows")?, i32_of(w, "moe bias width")?);
        self.launch(
            &dt.symbol("moe_bias_fwd"),
            l,
            &[Ptr(y), Ptr(b), Ptr(slots), Ptr(expert), I32(rows), I32(w)],
        )
    }

    /// `db[e] += Σ dy[r]` over expert `e`'s grouped rows (`offsets` `[E + 1]`), in row order.
    pub fn moe_bias_bwd(
        &self,
        l: Launch,
        (db, dy, offsets): (DevPtr, DevPtr, DevPtr),
        (e, w): (usize, usize),
    ) -> Result<()> {
        let (e, w) = (i32_of(e, "moe experts")?, i32_of(w, "moe bias width")?);
        self.launch(
            "moe_bias_bwd_f32",
            l,
            &[Ptr(db), Ptr(dy), Ptr(offsets), I32(e), I32(w)],
        )
    }

    /// `out[t] = Σ (weight ·) y[row]` over t's slots in ascending expert order (`weight` 0:
    /// unweighted).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine(
        &self,
        l: Launch,
        out: DevPtr,
        y: DevPtr,
        (row_of, expert, weight): (DevPtr, DevPtr, DevPtr),
        (n, c, k): (usize, usize, usize),
    ) -> Result<()> {
        let (n, c, k) = dims(n, c, k)?;
        self.launch(
            "moe_combine_fwd_f32",
            l,
            &[
                Ptr(out),
                Ptr(y),
                Ptr(row_of),
                Ptr(expert),
                Ptr(weight),
                I32(n),
                I32(c),
                I32(k),
            ],
        )
    }

    /// The weighted sum's backward: `dy` of the rows, `dweight` of the slots.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine_bwd(
        &self,
        l: Launch,
        (dy, dweight): (DevPtr, DevPtr),
        (dout, y): (DevPtr, DevPtr),
        (slots, row_of, weight): (DevPtr, DevPtr, DevPtr),
        (rows, c, k): (usize, usize, usize),
    ) -> Result<()> {
        let (rows, c, k) = dims(rows, c, k)?;
        self.launch(
            "moe_combine_bwd_f32",
            l,
            &[
                Ptr(dy),
                Ptr(dweight),
                Ptr(dout),
                Ptr(y),
                Ptr(slots),
                Ptr(row_of),
                Ptr(weight),
                I32(rows),
                I32(c),
                I32(k),
            ],
        )
    }

    /// Each expert's router probability summed over `n` tokens but those `pad` (bytes, non-zero
    /// for padding; 0: none is) marks, in f64.
    pub fn moe_prob_sums(
        &self,
        l: Launch,
        sums: DevPtr,
        (probs, pad): (DevPtr, DevPtr),
        n: usize,
        e: usize,
    ) -> Result<()> {
        let (n, e, _) = dims(n, e, 1)?;
        self.launch(
            "moe_prob_sums_fwd_f32",
            l,
            &[Ptr(sums), Ptr(probs), Ptr(pad), I32(n), I32(e)],
        )
    }

    /// The router's backward: d logits from the slots' d weight, plus the load-balancing
    /// loss's `aux` `[E]` through the softmax (0: none) on the tokens `pad` (bytes, non-zero for
    /// padding; 0: none is) does not mark.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_route_bwd(
        &self,
        l: Launch,
        dlogits: DevPtr,
        (probs, expert, weight, dweight): (DevPtr, DevPtr, DevPtr, DevPtr),
        (aux, pad): (DevPtr, DevPtr),
        (n, e, k): (usize, usize, usize),
        (norm, router): (bool, Router),
    ) -> Result<()> {
        let (n, e, k) = dims(n, e, k)?;
        self.launch(
            "moe_route_bwd_f32",
            l,
            &[
                Ptr(dlogits),
                Ptr(probs),
                Ptr(expert),
                Ptr(weight),
                Ptr(dweight),
                Ptr(aux),
                Ptr(pad),
                I32(n),
                I32(e),
                I32(k),
                I32(norm as i32),
                I32(router_code(router)),
            ],
        )
    }
}

/// One grouped GEMM over every expert's rows (`kernels/expert_gemm.cu`,
/// `expert_gemm_fwd_f32i16`): `c[rows of g] (+)= a[rows of g] · B_gᵀ` with `a` `[R, k]`, `c`
/// `[R, n]` and `B_g = b + g·b_stride` `[n, k]` (`b_kmajor`) or `[k, n]`; bf16 `a` and `b`.
#[derive(Debug, Clone, Copy)]
pub struct ExpertRows {
    pub c: DevPtr,
    pub a: DevPtr,
    pub b: DevPtr,
    pub b_stride: usize,
    pub b_kmajor: bool,
    pub n: usize,
    pub k: usize,
    pub accumulate: bool,
}

/// One grouped weight gradient (`expert_gemm_bwd_f32i16`): `C_g (+)= a[rows of g]ᵀ · b[rows of
/// g]` with `a` `[R, m]`, `b` `[R, n]` (bf16) and `C_g = c + g·c_stride` `[m, n]` (fp32).
#[derive(Debug, Clone, Copy)]
pub struct ExpertSums {
    pub c: DevPtr,
    pub c_stride: usize,
    pub a: DevPtr,
    pub b: DevPtr,
    pub m: usize,
    pub n: usize,
    pub accumulate: bool,
}

/// Whether every row of the operands starts 16-byte aligned (the kernels' `vec`): the bf16
/// operands' addresses and every width and stride a multiple of 8 elements.
fn rows_aligned(addrs: &[DevPtr], widths: &[usize]) -> bool {
    addrs.iter().all(|a| a % 16 == 0) && widths.iter().all(|w| w % 8 == 0)
}

fn i64_of(v: usize, what: &str) -> Result<i64> {
    i64::try_from(v).map_err(|_| {
        crate::Error::bad_input(
            "CUDA kernel argument",
            what.to_owned(),
            format!("{v} exceeds a 64-bit index"),
            None,
        )
    })
}

impl Launcher<'_> {
    /// [`ExpertRows`] over `rows` grouped rows of `groups` experts whose first rows are at
    /// `offsets` (`[groups + 1]` u32, on the device).
    pub fn expert_gemm_rows(
        &self,
        g: ExpertRows,
        offsets: DevPtr,
        rows: usize,
        groups: usize,
    ) -> Result<()> {
        let l = crate::device::launch::expert_gemm_rows(rows, groups, g.n)?;
        let b_width = if g.b_kmajor { g.k } else { g.n };
        let vec = rows_aligned(&[g.a, g.b], &[g.k, b_width, g.b_stride]);
        self.launch(
            "expert_gemm_fwd_f32i16",
            l,
            &[
                Ptr(g.c),
                Ptr(g.a),
                Ptr(g.b),
                Ptr(offsets),
                I32(i32_of(groups, "moe experts")?),
                I32(i32_of(g.n, "expert GEMM columns")?),
                I32(i32_of(g.k, "expert GEMM depth")?),
                I64(i64_of(g.b_stride, "expert weight stride")?),
                I32(g.b_kmajor as i32),
                I32(g.accumulate as i32),
                I32(vec as i32),
            ],
        )
    }

    /// [`ExpertSums`] for `groups` experts whose first rows are at `offsets` (on the device).
    pub fn expert_gemm_sums(&self, g: ExpertSums, offsets: DevPtr, groups: usize) -> Result<()> {
        let l = crate::device::launch::expert_gemm_sums(g.m, g.n, groups)?;
        let vec = rows_aligned(&[g.a, g.b], &[g.m, g.n]);
        self.launch(
            "expert_gemm_bwd_f32i16",
            l,
            &[
                Ptr(g.c),
                Ptr(g.a),
                Ptr(g.b),
                Ptr(offsets),
                I32(i32_of(g.m, "expert gradient rows")?),
                I32(i32_of(g.n, "expert gradient columns")?),
                I64(i64_of(g.c_stride, "expert gradient stride")?),
                I32(g.accumulate as i32),
                I32(vec as i32),
            ],
        )
    }
}
