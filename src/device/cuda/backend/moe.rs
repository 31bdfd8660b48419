//! The mixture-of-experts MLP on the GPU: the router's GEMM (cuBLAS), softmax and top-k
//! (`moe_route`), the tokens grouped by expert on the host from the chosen experts (one small
//! device→host copy per call: the grouping, and the load the metrics report), the rows
//! gathered, the experts' GEMMs on their rows (`expert_rows`, `expert_sums`), GPT-OSS's expert
//! biases and the activation over all rows at once, and the weighted sum per token in ascending
//! expert order — the CPU reference's order (`model::ops::moe`). The backward recomputes the
//! forward and runs the same steps in reverse.
//!
//! Under the bf16 recipe the input `h` (the norm's output) and the weights are bf16, the
//! gathered rows are gathered in bf16 (the first half of the `x` scratch's bytes), and the
//! experts' other GEMM operands — the activation, dY, d gate/up — are cast to bf16 once for all
//! rows (one launch each), so the experts' GEMMs read bf16 as held: one launch per projection
//! for every expert (`kernels/expert_gemm.cu`, fp32 sums and results, each expert's rows from
//! the offsets on the device); in fp32 one cuBLAS GEMM per expert. The router's d logits are
//! cast per GEMM: the CPU's [`crate::model::ops::MoeWeights::bf16_recipe`].
//!
//! Scratch lives in [`MoeScratch`], sized for the largest call so far.

use super::{CudaBackend, DevP, F32};
use crate::device::cuda::launches::{Dtype, ExpertRows, ExpertSums};
use crate::device::cuda::runtime::{drv, DevPtr};
use crate::device::launch;
use crate::device::program::{Backend, Gemm, MoeAt};
use crate::model::ops::{group_by_expert, AuxGrad, ExpertAct, ExpertLayout, ExpertLoad, MoeShape};
use crate::{Error, Result};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// What one MoE call computes besides its output, on the device (`R = rows·k` grouped rows).
#[derive(Debug)]
pub(super) struct MoeScratch {
    /// Tokens and the shape it was sized for.
    rows: usize,
    shape: (usize, usize, usize, usize),
    /// Router logits `[n, E]` (later d logits) and probabilities `[n, E]`.
    logits: CudaSlice<f32>,
    probs: CudaSlice<f32>,
    /// Chosen experts, their weights and d weights `[n, k]`.
    expert: CudaSlice<u32>,
    weight: CudaSlice<f32>,
    dweight: CudaSlice<f32>,
    /// The slots grouped by expert `[R]`, each slot's grouped row `[n·k]`, and each expert's
    /// first grouped row `[E + 1]`.
    slots: CudaSlice<u32>,
    row_of: CudaSlice<u32>,
    offsets: CudaSlice<u32>,
    /// Gathered inputs `[R, C]`, the experts' outputs `[R, C]`, their gradients `[R, C]` (dy,
    /// then dx).
    x: CudaSlice<f32>,
    y: CudaSlice<f32>,
    dy: CudaSlice<f32>,
    /// Gate (GPT-OSS: interleaved gate/up `[R, 2I]`), up, activation `[R, I]`; d activation,
    /// d gate (or d gate/up `[R, 2I]`), d up `[R, I]`.
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    act: CudaSlice<f32>,
    da: CudaSlice<f32>,
    dg: CudaSlice<f32>,
    du: CudaSlice<f32>,
    /// Each expert's probability sum `[E]` (f64) and the load-balancing gradient `[E]`.
    sums: CudaSlice<f64>,
    aux: CudaSlice<f32>,
    /// Which tokens are padding `[N]` (non-zero), when some are.
    pad: CudaSlice<u8>,
    /// Under bf16: the activation `[R, I]`, dY `[R, C]` and d gate/up `[R, 2I]` (gate then up
    /// for Linear-layout experts) as the GEMMs read them (one element when fp32).
    act16: CudaSlice<u16>,
    dy16: CudaSlice<u16>,
    dgu16: CudaSlice<u16>,
    /// The host's copies of the routing (kept until the next call's synchronisation, so no
    /// copy from them is ever in flight when they change).
    expert_host: Vec<u32>,
    offsets_host: Vec<u32>,
    sums_host: Vec<f64>,
    aux_host: Vec<f32>,
    pad_host: Vec<u8>,
    grouped: (Vec<usize>, Vec<u32>, Vec<u32>),
}

fn alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<CudaSlice<T>> {
    drv(
        stream.alloc_zeros::<T>(len.max(1)),
        "allocate the mixture-of-experts scratch",
    )
}

impl MoeScratch {
    fn new(stream: &Arc<CudaStream>, rows: usize, s: MoeShape, bf16: bool) -> Result<Self> {
        let (n, e, k, c, i) = (rows, s.experts, s.top_k, s.c, s.inter);
        let r = n * k;
        let b16 = |len: usize| if bf16 { len } else { 1 };
        Ok(MoeScratch {
            rows,
            shape: (e, k, c, i),
            logits: alloc(stream, n * e)?,
            probs: alloc(stream, n * e)?,
            expert: alloc(stream, r)?,
            weight: alloc(stream, r)?,
            dweight: alloc(stream, r)?,
            slots: alloc(stream, r)?,
            row_of: alloc(stream, r)?,
            offsets: alloc(stream, e + 1)?,
            x: alloc(stream, r * c)?,
            y: alloc(stream, r * c)?,
            dy: alloc(stream, r * c)?,
            gate: alloc(stream, r * 2 * i)?,
            up: alloc(stream, r * i)?,
            act: alloc(stream, r * i)?,
            da: alloc(stream, r * i)?,
            dg: alloc(stream, r * 2 * i)?,
            du: alloc(stream, r * i)?,
            sums: alloc(stream, e)?,
            aux: alloc(stream, e)?,
            pad: alloc(stream, n)?,
            act16: alloc(stream, b16(r * i))?,
            dy16: alloc(stream, b16(r * c))?,
            dgu16: alloc(stream, b16(r * 2 * i))?,
            expert_host: Vec::new(),
            offsets_host: Vec::new(),
            sums_host: Vec::new(),
            aux_host: Vec::new(),
            pad_host: Vec::new(),
            grouped: (Vec::new(), Vec::new(), Vec::new()),
        })
    }
}

/// Device addresses of the scratch (f32 unless named).
struct At {
    logits: DevPtr,
    probs: DevPtr,
    expert: DevPtr,
    weight: DevPtr,
    dweight: DevPtr,
    slots: DevPtr,
    row_of: DevPtr,
    offsets: DevPtr,
    x: DevPtr,
    y: DevPtr,
    dy: DevPtr,
    gate: DevPtr,
    up: DevPtr,
    act: DevPtr,
    da: DevPtr,
    dg: DevPtr,
    du: DevPtr,
    sums: DevPtr,
    aux: DevPtr,
    pad: DevPtr,
    act16: DevPtr,
    dy16: DevPtr,
    dgu16: DevPtr,
}

impl CudaBackend {
    /// The scratch for `rows` tokens of shape `s`, allocated (or grown) on first need.
    fn moe_scratch(&mut self, rows: usize, s: MoeShape) -> Result<At> {
        let fits = self
            .moe
            .as_ref()
            .is_some_and(|m| m.rows >= rows && m.shape == (s.experts, s.top_k, s.c, s.inter));
        if !fits {
            let bf16 = self.bf16.is_some();
            self.moe = Some(MoeScratch::new(&self.stream, rows, s, bf16)?);
        }
        let m = self
            .moe
            .as_ref()
            .ok_or_else(|| Error::internal("CUDA backend", "moe scratch"))?;
        let st = &self.stream;
        let p32 = |x: &CudaSlice<f32>| x.device_ptr(st).0;
        let pu = |x: &CudaSlice<u32>| x.device_ptr(st).0;
        let p16 = |x: &CudaSlice<u16>| x.device_ptr(st).0;
        Ok(At {
            logits: p32(&m.logits),
            probs: p32(&m.probs),
            expert: pu(&m.expert),
            weight: p32(&m.weight),
            dweight: p32(&m.dweight),
            slots: pu(&m.slots),
            row_of: pu(&m.row_of),
            offsets: pu(&m.offsets),
            x: p32(&m.x),
            y: p32(&m.y),
            dy: p32(&m.dy),
            gate: p32(&m.gate),
            up: p32(&m.up),
            act: p32(&m.act),
            da: p32(&m.da),
            dg: p32(&m.dg),
            du: p32(&m.du),
            sums: m.sums.device_ptr(st).0,
            aux: p32(&m.aux),
            pad: m.pad.device_ptr(st).0,
            act16: p16(&m.act16),
            dy16: p16(&m.dy16),
            dgu16: p16(&m.dgu16),
        })
    }

    /// The router, the grouping and every expert's rows up to their outputs `y` (the forward,
    /// and the backward's recompute; `sums`: the forward's probability sums too, over the
    /// tokens but those the padding flags at that address mark (0: none is)); returns each
    /// expert's first grouped row (`E + 1`).
    fn moe_internals(
        &mut self,
        at: &At,
        h: DevP,
        w: MoeAt<DevP>,
        n: usize,
        s: MoeShape,
        sums: Option<DevPtr>,
    ) -> Result<Vec<usize>> {
        let bf16 = self.bf16.is_some();
        let weights = [w.router, w.gate_up, w.down];
        if h.bf16 != bf16 || weights.iter().any(|p| p.bf16 != bf16) {
            return Err(Error::internal(
                "CUDA backend",
                "the mixture-of-experts MLP: its input and weights are bf16 exactly under the bf16 recipe",
            ));
        }
        let (e, k, c, i) = (s.experts, s.top_k, s.c, s.inter);
        let f = DevP::f32;
        let gemm =
            |c_: DevPtr, a: DevP, b: DevP, tb: bool, (m, kk, nn): (usize, usize, usize)| Gemm {
                c: f(c_),
                a,
                ta: false,
                b,
                tb,
                m,
                k: kk,
                n: nn,
                accumulate: false,
            };
        self.gemm(gemm(at.logits, h, w.router, true, (n, c, e)))?;
        if let Some([br, _, _]) = w.biases {
            self.bias_fwd(f(at.logits), br, n, e)?;
        }
        let l = launch::elementwise(n, self.sms());
        self.k().moe_route(
            l,
            (at.probs, at.expert, at.weight),
            at.logits,
            (n, e, k),
            (s.norm_topk, s.router),
        )?;
        if let Some(pad) = sums {
            let l = launch::elementwise(e, self.sms());
            self.k().moe_prob_sums(l, at.sums, (at.probs, pad), n, e)?;
        }
        // The chosen experts come to the host for the grouping (and the fp32 GEMMs' row counts;
        // with, in the forward, the probability sums the load-balancing loss reads).
        let m = self
            .moe
            .as_mut()
            .ok_or_else(|| Error::internal("CUDA backend", "moe scratch"))?;
        m.expert_host.resize(n * k, 0);
        m.sums_host.resize(e, 0.0);
        drv(
            self.stream
                .memcpy_dtoh(&m.expert.slice(..n * k), &mut m.expert_host[..]),
            "copy the chosen experts to the host",
        )?;
        if sums.is_some() {
            drv(
                self.stream
                    .memcpy_dtoh(&m.sums.slice(..e), &mut m.sums_host[..]),
                "copy the router's probability sums to the host",
            )?;
        }
        drv(
            self.stream.synchronize(),
            "wait for the chosen experts (mixture of experts)",
        )?;
        m.grouped = group_by_expert(&m.expert_host, e)?;
        let (offsets, slots, row_of) = &m.grouped;
        drv(
            self.stream
                .memcpy_htod(&slots[..], &mut m.slots.slice_mut(..n * k)),
            "upload the grouped slots",
        )?;
        drv(
            self.stream
                .memcpy_htod(&row_of[..], &mut m.row_of.slice_mut(..n * k)),
            "upload the grouped rows",
        )?;
        m.offsets_host.clear();
        for &o in offsets {
            let o = u32::try_from(o).map_err(|_| {
                Error::internal("CUDA backend", "more grouped rows than a u32 counts")
            })?;
            m.offsets_host.push(o);
        }
        drv(
            self.stream
                .memcpy_htod(&m.offsets_host[..], &mut m.offsets.slice_mut(..e + 1)),
            "upload the experts' first rows",
        )?;
        let offsets = offsets.clone();
        let r = n * k;
        let l = launch::elementwise(r * c, self.sms());
        let gather = if bf16 { Dtype::Bf16 } else { F32 };
        self.k()
            .moe_gather(gather, l, at.x, h.addr, at.slots, (r, c, k))?;
        let interleaved = s.layout == ExpertLayout::InterleavedColumns;
        let x = operand((at.x, at.x), bf16);
        if interleaved {
            // gu [m, 2I] = x · W [C, 2I] (+ b, below).
            self.expert_rows(
                &offsets,
                at.gate,
                x,
                (w.gate_up, 2 * i * c, false),
                (2 * i, c),
                false,
            )?;
        } else {
            // gate, up [m, I] = x · Wgᵀ, x · Wuᵀ (W [2I, C]: gate's rows, then up's).
            let wu = Self::off(w.gate_up, i * c);
            self.expert_rows(
                &offsets,
                at.gate,
                x,
                (w.gate_up, 2 * i * c, true),
                (i, c),
                false,
            )?;
            self.expert_rows(&offsets, at.up, x, (wu, 2 * i * c, true), (i, c), false)?;
        }
        // GPT-OSS's gate/up biases, every expert's rows in one launch.
        if let Some([_, bgu, _]) = w.biases {
            self.expert_bias(at, (at.gate, bgu), r, 2 * i)?;
        }
        match s.act {
            ExpertAct::Gated(act) => self.gated_fwd(act, f(at.act), f(at.gate), f(at.up), r * i)?,
            ExpertAct::ClampedSwiglu { alpha, limit } => {
                let l = launch::elementwise(r * i, self.sms());
                self.k()
                    .moe_clamped_swiglu(l, at.act, at.gate, r * i, (alpha, limit))?
            }
        }
        if bf16 {
            self.cast_rows(at.act16, at.act, r * i)?;
        }
        // y = act · Wdᵀ (Wd [C, I]), or GPT-OSS's act · Wd (Wd [I, C]) + b.
        let act = operand((at.act, at.act16), bf16);
        self.expert_rows(
            &offsets,
            at.y,
            act,
            (w.down, c * i, !interleaved),
            (c, i),
            false,
        )?;
        if let Some([_, _, bd]) = w.biases {
            self.expert_bias(at, (at.y, bd), r, c)?;
        }
        Ok(offsets)
    }

    /// Each expert's first grouped row (`E + 1` u32) on the device, as the last call grouped them.
    fn expert_offsets(&self) -> Result<DevPtr> {
        let moe = self
            .moe
            .as_ref()
            .ok_or_else(|| Error::internal("CUDA backend", "moe scratch"))?;
        Ok(moe.offsets.device_ptr(&self.stream).0)
    }

    /// Every expert's `c[rows of g] (+)= a[rows of g] · B_gᵀ` (`B_g = b + g·stride`, `[n, k]`
    /// when `kmajor` — a weight as nn.Linear holds it — else `[k, n]`); `a` `[R, k]` and `c`
    /// `[R, n]` fp32 hold the grouped rows, `offsets` each expert's first (`E + 1`). Under the
    /// bf16 recipe one launch of the grouped kernel (`expert_gemm_fwd_f32i16`); fp32 takes one
    /// cuBLAS GEMM per expert, each long enough on the GPU to hide its launch (an fp32 expert
    /// GEMM of the step's shapes runs ~10× longer than its bf16 twin: 20 ms against 2 on an H100).
    fn expert_rows(
        &mut self,
        offsets: &[usize],
        c: DevPtr,
        a: DevP,
        (b, stride, kmajor): (DevP, usize, bool),
        (n, k): (usize, usize),
        accumulate: bool,
    ) -> Result<()> {
        let groups = offsets.len().saturating_sub(1);
        let rows = offsets.last().copied().unwrap_or(0);
        if a.bf16 != b.bf16 {
            return Err(Error::internal(
                "CUDA backend",
                "an expert GEMM's rows and weights in different types",
            ));
        }
        if a.bf16 {
            let at = self.expert_offsets()?;
            let g = ExpertRows {
                c,
                a: a.addr,
                b: b.addr,
                b_stride: stride,
                b_kmajor: kmajor,
                n,
                k,
                accumulate,
            };
            return self.k().expert_gemm_rows(g, at, rows, groups);
        }
        for ex in 0..groups {
            let (lo, m) = (offsets[ex], offsets[ex + 1] - offsets[ex]);
            if m == 0 {
                continue;
            }
            self.gemm(Gemm {
                c: DevP::f32(c + 4 * (lo * n) as u64),
                a: Self::off(a, lo * k),
                ta: false,
                b: Self::off(b, ex * stride),
                tb: kmajor,
                m,
                k,
                n,
                accumulate,
            })?;
        }
        Ok(())
    }

    /// Every expert's weight gradient `C_g += a[rows of g]ᵀ · b[rows of g]` (`C_g = c + g·stride`,
    /// `[m, n]` fp32; `a` `[R, m]`, `b` `[R, n]`). Under the bf16 recipe one launch
    /// (`expert_gemm_bwd_f32i16`), else one cuBLAS GEMM per expert (see [`Self::expert_rows`]).
    fn expert_sums(
        &mut self,
        offsets: &[usize],
        (c, stride): (DevP, usize),
        a: DevP,
        b: DevP,
        (m, n): (usize, usize),
    ) -> Result<()> {
        if c.bf16 || a.bf16 != b.bf16 {
            return Err(Error::internal(
                "CUDA backend",
                "an expert weight gradient: fp32, from operands of one type",
            ));
        }
        let groups = offsets.len().saturating_sub(1);
        if a.bf16 {
            let at = self.expert_offsets()?;
            let g = ExpertSums {
                c: c.addr,
                c_stride: stride,
                a: a.addr,
                b: b.addr,
                m,
                n,
                accumulate: true,
            };
            return self.k().expert_gemm_sums(g, at, groups);
        }
        for ex in 0..groups {
            let (lo, rows) = (offsets[ex], offsets[ex + 1] - offsets[ex]);
            if rows == 0 {
                continue;
            }
            self.gemm(Gemm {
                c: Self::off(c, ex * stride),
                a: Self::off(a, lo * m),
                ta: true,
                b: Self::off(b, lo * n),
                tb: false,
                m,
                k: rows,
                n,
                accumulate: true,
            })?;
        }
        Ok(())
    }

    /// `y[r] += b[expert of r]` over the `rows` grouped rows of width `w` at `y` (one launch).
    fn expert_bias(
        &mut self,
        at: &At,
        (y, b): (DevPtr, DevP),
        rows: usize,
        w: usize,
    ) -> Result<()> {
        let dt = if b.bf16 { Dtype::F32W16 } else { F32 };
        let l = launch::elementwise(rows * w, self.sms());
        self.k()
            .moe_bias(dt, l, (y, b.addr), (at.slots, at.expert), (rows, w))
    }

    /// `db[e] += Σ dy[r]` over each expert's grouped rows of width `w` at `dy` (one launch).
    fn expert_bias_bwd(&mut self, at: &At, db: DevP, dy: DevPtr, w: usize, e: usize) -> Result<()> {
        if db.bf16 {
            return Err(Error::internal("CUDA backend", "a bf16 bias gradient"));
        }
        let l = launch::elementwise(e * w, self.sms());
        self.k().moe_bias_bwd(l, (db.addr, dy, at.offsets), (e, w))
    }

    /// `len` fp32 values at `src` rounded to bf16 into `dst` (one launch).
    fn cast_rows(&mut self, dst: DevPtr, src: DevPtr, len: usize) -> Result<()> {
        let l = launch::elementwise(len, self.sms());
        self.k().cast_f32_bf16(l, dst, src, len as i64)
    }

    /// The padding flags of the call's `n` tokens on the device (0: none is padding).
    fn upload_pad(&mut self, at: &At, pad: Option<&[u8]>, n: usize) -> Result<DevPtr> {
        let Some(pad) = pad else {
            return Ok(0);
        };
        if pad.len() != n {
            return Err(Error::internal(
                "CUDA backend",
                format!("{} padding flags for {n} tokens", pad.len()),
            ));
        }
        let m = self
            .moe
            .as_mut()
            .ok_or_else(|| Error::internal("CUDA backend", "moe scratch"))?;
        m.pad_host.clear();
        m.pad_host.extend_from_slice(pad);
        drv(
            self.stream
                .memcpy_htod(&m.pad_host[..], &mut m.pad.slice_mut(..n)),
            "upload the padding flags",
        )?;
        Ok(at.pad)
    }

    /// See [`Backend::moe_fwd`].
    pub(super) fn moe_forward(
        &mut self,
        out: DevP,
        h: DevP,
        w: MoeAt<DevP>,
        n: usize,
        s: MoeShape,
        pad: Option<&[u8]>,
    ) -> Result<ExpertLoad> {
        let at = self.moe_scratch(n, s)?;
        let pad_at = self.upload_pad(&at, pad, n)?;
        let offsets = self.moe_internals(&at, h, w, n, s, Some(pad_at))?;
        let l = launch::elementwise(n * s.c, self.sms());
        self.k().moe_combine(
            l,
            out.addr,
            at.y,
            (at.row_of, at.expert, at.weight),
            (n, s.c, s.top_k),
        )?;
        let m = self
            .moe
            .as_ref()
            .ok_or_else(|| Error::internal("CUDA backend", "moe scratch"))?;
        let counted = match pad {
            None => ExpertLoad {
                tokens: offsets.windows(2).map(|w| (w[1] - w[0]) as u64).collect(),
                prob_sums: Vec::new(),
                rows: n as u64,
            },
            Some(pad) => ExpertLoad::counts(&m.expert_host, n, s.experts, Some(pad)),
        };
        Ok(ExpertLoad {
            prob_sums: m.sums_host.clone(),
            ..counted
        })
    }

    /// See [`Backend::moe_bwd`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_backward(
        &mut self,
        dh: DevP,
        g: MoeAt<DevP>,
        d_out: DevP,
        h: DevP,
        w: MoeAt<DevP>,
        n: usize,
        s: MoeShape,
        aux: Option<AuxGrad<'_>>,
    ) -> Result<()> {
        let at = self.moe_scratch(n, s)?;
        let offsets = self.moe_internals(&at, h, w, n, s, None)?;
        let pad_at = self.upload_pad(&at, aux.and_then(|a| a.pad), n)?;
        let aux_at = match aux.map(|a| a.per_expert) {
            None => 0,
            Some(a) if a.len() == s.experts => {
                let m = self
                    .moe
                    .as_mut()
                    .ok_or_else(|| Error::internal("CUDA backend", "moe scratch"))?;
                m.aux_host.clear();
                m.aux_host.extend_from_slice(a);
                drv(
                    self.stream
                        .memcpy_htod(&m.aux_host[..], &mut m.aux.slice_mut(..a.len())),
                    "upload the load-balancing gradient",
                )?;
                at.aux
            }
            Some(_) => {
                return Err(Error::internal(
                    "CUDA backend",
                    "the load-balancing gradient is not one value per expert",
                ))
            }
        };
        let (e, k, c, i) = (s.experts, s.top_k, s.c, s.inter);
        let (r, bf16) = (n * k, self.bf16.is_some());
        let f = DevP::f32;
        let l = launch::elementwise(r * c, self.sms());
        self.k().moe_combine_bwd(
            l,
            (at.dy, at.dweight),
            (d_out.addr, at.y),
            (at.slots, at.row_of, at.weight),
            (r, c, k),
        )?;
        if bf16 {
            self.cast_rows(at.dy16, at.dy, r * c)?;
        }
        let gemm = |c_: DevP, (a, ta): (DevP, bool), (b, tb): (DevP, bool), m, kk, nn, acc| Gemm {
            c: c_,
            a,
            ta,
            b,
            tb,
            m,
            k: kk,
            n: nn,
            accumulate: acc,
        };
        let interleaved = s.layout == ExpertLayout::InterleavedColumns;
        // d activation = dY·Wd; dWd += dYᵀ·A (GPT-OSS: dY·Wdᵀ; dWd += Aᵀ·dY; db below). The
        // GEMMs read dY and the activation as the recipe rounds them; the bias gradient sums
        // dY in fp32.
        let dy = operand((at.dy, at.dy16), bf16);
        let act = operand((at.act, at.act16), bf16);
        self.expert_rows(
            &offsets,
            at.da,
            dy,
            (w.down, c * i, interleaved),
            (i, c),
            false,
        )?;
        match interleaved {
            true => self.expert_sums(&offsets, (g.down, c * i), act, dy, (i, c))?,
            false => self.expert_sums(&offsets, (g.down, c * i), dy, act, (c, i))?,
        }
        // The down biases' gradient (GPT-OSS) from dY in fp32, before dX takes its rows.
        if let Some([_, _, gbd]) = g.biases {
            self.expert_bias_bwd(&at, gbd, at.dy, c, e)?;
        }
        match s.act {
            ExpertAct::Gated(act) => self.gated_bwd(
                act,
                f(at.dg),
                f(at.du),
                f(at.da),
                f(at.gate),
                f(at.up),
                r * i,
            )?,
            ExpertAct::ClampedSwiglu { alpha, limit } => {
                let l = launch::elementwise(r * i, self.sms());
                self.k().moe_clamped_swiglu_bwd(
                    l,
                    (at.dg, at.da, at.gate),
                    r * i,
                    (alpha, limit),
                )?
            }
        }
        // The gate/up biases' gradient (GPT-OSS) from d gate/up in fp32.
        if let Some([_, gbgu, _]) = g.biases {
            self.expert_bias_bwd(&at, gbgu, at.dg, 2 * i, e)?;
        }
        // d gate/up as the GEMMs read them: [R, 2I] interleaved, else d gate then d up.
        let du16 = at.dgu16 + 2 * (r * i) as u64;
        if bf16 {
            match interleaved {
                true => self.cast_rows(at.dgu16, at.dg, r * 2 * i)?,
                false => {
                    self.cast_rows(at.dgu16, at.dg, r * i)?;
                    self.cast_rows(du16, at.du, r * i)?;
                }
            }
        }
        // dWg += dGᵀ·X, dWu += dUᵀ·X, dX = dG·Wg + dU·Wu (into dy's rows); GPT-OSS: dW += Xᵀ·dGU,
        // db += Σ dGU (above), dX = dGU·Wᵀ.
        let x = operand((at.x, at.x), bf16);
        let stride = 2 * i * c;
        if interleaved {
            let dgu = operand((at.dg, at.dgu16), bf16);
            self.expert_sums(&offsets, (g.gate_up, stride), x, dgu, (c, 2 * i))?;
            self.expert_rows(
                &offsets,
                at.dy,
                dgu,
                (w.gate_up, stride, true),
                (c, 2 * i),
                false,
            )?;
        } else {
            let (wu, gu) = (Self::off(w.gate_up, i * c), Self::off(g.gate_up, i * c));
            let dg = operand((at.dg, at.dgu16), bf16);
            let du = operand((at.du, du16), bf16);
            self.expert_sums(&offsets, (g.gate_up, stride), dg, x, (i, c))?;
            self.expert_sums(&offsets, (gu, stride), du, x, (i, c))?;
            self.expert_rows(
                &offsets,
                at.dy,
                dg,
                (w.gate_up, stride, false),
                (c, i),
                false,
            )?;
            self.expert_rows(&offsets, at.dy, du, (wu, stride, false), (c, i), true)?;
        }
        // The router: d logits (into the logits' scratch), dWr += dZᵀ·h; dh = Σ the rows' dx
        // (ascending expert) + dZ·Wr.
        let l = launch::elementwise(n, self.sms());
        self.k().moe_route_bwd(
            l,
            at.logits,
            (at.probs, at.expert, at.weight, at.dweight),
            (aux_at, pad_at),
            (n, e, k),
            (s.norm_topk, s.router),
        )?;
        let dz = f(at.logits);
        if let Some([gbr, _, _]) = g.biases {
            self.bias_bwd(gbr, dz, n, e)?;
        }
        self.gemm(gemm(g.router, (dz, true), (h, false), e, n, c, true))?;
        let l = launch::elementwise(n * c, self.sms());
        self.k()
            .moe_combine(l, dh.addr, at.dy, (at.row_of, at.expert, 0), (n, c, k))?;
        self.gemm(gemm(dh, (dz, false), (w.router, false), n, e, c, true))
    }
}

/// An expert GEMM operand: its fp32 rows, or under the bf16 recipe their bf16 copy (the
/// gathered rows: the same buffer, gathered in bf16).
fn operand((f32_rows, bf16_rows): (DevPtr, DevPtr), bf16: bool) -> DevP {
    match bf16 {
        true => DevP::bf16(bf16_rows),
        false => DevP::f32(f32_rows),
    }
}
