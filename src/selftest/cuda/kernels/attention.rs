//! The attention kernels' cases: whole sequences and query chunks (dK/dV summed over them) in
//! f32 (SIMT), from the bf16 recipe's bf16 inputs (on the tensor cores, every head dim they are
//! built for; SIMT at another), the SIMT forward with bf16 storage, against the CPU attention.

use super::{round_bf16, Gpu, Out, TOL_ATTN_BWD, TOL_F32, TOL_FLASH};
use crate::device::cuda::launches::{AttnArgs, Dtype};
use crate::device::launch::{self, AttnShape, FLASH_HEAD_DIMS};
use crate::model::ops;
use crate::{Error, Result};
use cudarc::driver::CudaSlice;

/// Positions of [`ATTN`]'s two sequences: one flat, one of documents across tile boundaries
/// (a one-token document among them).
const ATTN_DOCS: [usize; 5] = [70, 20, 1, 45, 4];

/// GQA, T not a multiple of the tile.
const ATTN: AttnShape = AttnShape {
    b: 2,
    t: 70,
    nh: 8,
    nkv: 2,
    hd: 64,
    q0: 0,
    q1: 70,
    window: None,
    scale: None,
    softcap: None,
};

/// Rows `q0..q1` of every sequence of a `[B·T, width]` tensor, or (`back`) those rows written
/// back from `part` `[B·(q1−q0), width]`.
fn query_rows(whole: &mut [f32], part: &mut [f32], s: AttnShape, width: usize, back: bool) {
    let nq = s.nq();
    for b in 0..s.b {
        for i in 0..nq {
            let w = &mut whole[(b * s.t + s.q0 + i) * width..][..width];
            let p = &mut part[(b * nq + i) * width..][..width];
            if back {
                w.copy_from_slice(p);
            } else {
                p.copy_from_slice(w);
            }
        }
    }
}

/// Which attention kernels a case runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernels {
    /// `attention_*_{dtype}`: SIMT, `f32` or `f32i16` (bf16 inputs), tiles sized to this much
    /// shared memory per block.
    Simt(Dtype, usize),
    /// `flash{hd}_*_f32i16`: tensor cores, bf16 inputs.
    Flash,
}

impl Kernels {
    /// Whether Q, K, V and dO are stored in bf16 (the bf16 recipe's storage).
    fn bf16_inputs(self) -> bool {
        !matches!(self, Kernels::Simt(Dtype::F32, _))
    }
}

/// A device copy of an attention input in its kernels' storage.
enum Input {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

impl Input {
    /// `x` (bf16 values when `bf16`) uploaded as fp32 or as bf16.
    fn up(g: &Gpu<'_>, x: &[f32], bf16: bool) -> Result<Self> {
        Ok(if bf16 {
            Input::Bf16(g.up16(x)?)
        } else {
            Input::F32(g.up(x)?)
        })
    }

    fn p(&self, g: &Gpu<'_>) -> crate::device::cuda::DevPtr {
        match self {
            Input::F32(x) => g.p(x),
            Input::Bf16(x) => g.p(x),
        }
    }
}

/// The SIMT kernels in fp32; then at head dim 128 with the tiles the opted-in shared memory
/// allows (above 48 KiB: 64 rows of 1 KiB for dk/dv, where 48 KiB holds 47).
pub(super) fn attention_f32(g: &Gpu<'_>) -> Result<Vec<Out>> {
    let simt = Kernels::Simt(Dtype::F32, launch::DEFAULT_SMEM);
    let mut out = attention_chunks(g, ATTN, &ATTN_DOCS, simt)?;
    // A sliding window of 17 keys: shorter than a document and the tile, crossing both.
    for o in attention_chunks(g, ATTN.windowed(Some(17)), &ATTN_DOCS, simt)? {
        out.push(o.label("window 17: "));
    }
    // Scores soft-capped at 0.5 (Gemma 2's 50 on these scores would barely bend them).
    for o in attention_chunks(g, ATTN.softcapped(Some(0.5)), &ATTN_DOCS, simt)? {
        out.push(o.label("soft cap 0.5: "));
    }
    let optin = g.rt.smem_optin;
    if optin > launch::DEFAULT_SMEM {
        let s = AttnShape { hd: 128, ..ATTN };
        let big = launch::attention(s, optin)?;
        if big.kv.smem as usize <= launch::DEFAULT_SMEM {
            return Err(Error::internal(
                "self-test",
                format!("the opt-in case's tiles fit 48 KiB ({big:?})"),
            ));
        }
        for o in attention_chunks(g, s, &ATTN_DOCS, Kernels::Simt(Dtype::F32, optin))? {
            out.push(o.label(&format!("hd 128, {} KiB tiles: ", big.kv.smem >> 10)));
        }
    }
    Ok(out)
}

/// The tensor-core kernels for every head dim they are built for, on bf16 inputs, against the
/// fp32 CPU attention of the same (rounded) inputs: they compute it to fp32 rounding. Then the
/// SIMT kernels on bf16 inputs (`f32i16`), at a head dim the tensor-core kernels are not built
/// for (where the bf16 recipe falls back to them).
pub(super) fn attention_bf16_inputs(g: &Gpu<'_>) -> Result<Vec<Out>> {
    let mut out = Vec::new();
    for hd in FLASH_HEAD_DIMS {
        for o in attention_chunks(g, AttnShape { hd, ..ATTN }, &ATTN_DOCS, Kernels::Flash)? {
            out.push(o.label(&format!("hd {hd} ")));
        }
    }
    // Longer documents: a block whose first query's document starts past the first key tile,
    // and warps whose document starts after a tile they are handed.
    for o in attention_chunks(g, FLASH_LONG, &FLASH_LONG_DOCS, Kernels::Flash)? {
        out.push(o.label("hd 64, T 200 "));
    }
    // A sliding window of 40 keys: a block's queries starting in several key tiles, warps
    // whose window ends before a tile they are handed.
    let windowed = FLASH_LONG.windowed(Some(40));
    for o in attention_chunks(g, windowed, &FLASH_LONG_DOCS, Kernels::Flash)? {
        out.push(o.label("hd 64, T 200, window 40 "));
    }

    let hd = 96;
    if FLASH_HEAD_DIMS.contains(&hd) {
        return Err(Error::internal(
            "self-test",
            format!("head dim {hd} has tensor-core kernels: pick another for the SIMT case"),
        ));
    }
    let simt = Kernels::Simt(Dtype::F32I16, launch::DEFAULT_SMEM);
    for o in attention_chunks(g, AttnShape { hd, ..ATTN }, &ATTN_DOCS, simt)? {
        out.push(o.label(&format!("SIMT hd {hd} ")));
    }
    // Soft-capped scores take the SIMT kernels under the bf16 recipe too.
    let capped = AttnShape { hd: 64, ..ATTN }.softcapped(Some(0.5));
    if launch::flash(capped)?.is_some() {
        return Err(Error::internal(
            "self-test",
            "soft-capped attention on the tensor cores, which carry no cap",
        ));
    }
    for o in attention_chunks(g, capped, &ATTN_DOCS, simt)? {
        out.push(o.label("SIMT hd 64, soft cap 0.5 "));
    }
    Ok(out)
}

/// [`attention_bf16_inputs`]'s longer case: 4 blocks of 64 queries, GQA 4/2.
const FLASH_LONG: AttnShape = AttnShape {
    b: 2,
    t: 200,
    nh: 4,
    nkv: 2,
    hd: 64,
    q0: 0,
    q1: 200,
    window: None,
    scale: None,
    softcap: None,
};
/// Its documents: one flat sequence; then 30, 100 and 70 tokens (queries 192.. start at key 130).
const FLASH_LONG_DOCS: [usize; 4] = [200, 30, 100, 70];

/// The three attention kernels over the whole sequences, then over two query chunks (a token
/// chunked layer program's calls: dK and dV summed over the chunks), against the CPU reference.
fn attention_chunks(
    g: &Gpu<'_>,
    s: AttnShape,
    docs: &[usize],
    kernels: Kernels,
) -> Result<Vec<Out>> {
    let (qs, qn, kn, rows) = (
        s.nh * s.hd,
        s.b * s.t * s.nh * s.hd,
        s.b * s.t * s.nkv * s.hd,
        s.b * s.nh * s.t,
    );
    // bf16 inputs: the reference sees their values.
    let bf16 = kernels.bf16_inputs();
    let input = |x: Vec<f32>| if bf16 { round_bf16(&x) } else { x };
    let (fwd_tolerance, bwd_tolerance) = match kernels {
        Kernels::Simt(..) => (TOL_F32, TOL_ATTN_BWD),
        Kernels::Flash => (TOL_FLASH, TOL_FLASH),
    };
    let (mut q, k, v, mut d_o) = (
        input(g.rnd(qn, 8, 1.0)),
        input(g.rnd(kn, 9, 1.0)),
        input(g.rnd(kn, 10, 1.0)),
        input(g.rnd(qn, 11, 1.0)),
    );
    let pos = ops::document_positions(docs);
    let (mut o_ref, mut lse_ref) = (vec![0.0; qn], vec![0.0; rows]);
    ops::attention_fwd(&mut o_ref, &mut lse_ref, &q, &k, &v, &pos, s);
    let (mut dq_ref, mut dk_ref, mut dv_ref) = (vec![0.0; qn], vec![0.0; kn], vec![0.0; kn]);
    ops::attention_bwd(
        &mut dq_ref,
        &mut dk_ref,
        &mut dv_ref,
        &mut vec![0.0; rows],
        &d_o,
        &q,
        &k,
        &v,
        &o_ref,
        &lse_ref,
        &pos,
        s,
    );
    let (kd, vd) = (Input::up(g, &k, bf16)?, Input::up(g, &v, bf16)?);
    let posd = g.up(&pos)?;
    let mut out = Vec::new();
    // Two query chunks split inside a block of rows (40 of 70 tokens, 114 of 200).
    let split = s.t * 4 / 7;
    for (label, ranges) in [
        ("", &[(0usize, s.t)][..]),
        ("chunked ", &[(0, split), (split, s.t)][..]),
    ] {
        let (mut o, mut lse, mut dq) = (vec![0.0; qn], vec![0.0; rows], vec![0.0; qn]);
        let (dkd, dvd) = (g.zeros::<f32>(kn)?, g.zeros::<f32>(kn)?);
        for &(q0, q1) in ranges {
            let sc = s.queries(q0, q1);
            let (cn, crows) = (s.b * sc.nq() * qs, s.b * s.nh * sc.nq());
            let (mut qc, mut doc) = (vec![0.0; cn], vec![0.0; cn]);
            query_rows(&mut q, &mut qc, sc, qs, false);
            query_rows(&mut d_o, &mut doc, sc, qs, false);
            let a = AttnArgs::new(sc, g.p(&posd))?;
            let (qd, dod) = (Input::up(g, &qc, bf16)?, Input::up(g, &doc, bf16)?);
            let (od, lsed, deltad, dqd) = (
                g.zeros::<f32>(cn)?,
                g.zeros::<f32>(crows)?,
                g.zeros::<f32>(crows)?,
                g.zeros::<f32>(cn)?,
            );
            let kk = g.k();
            let [o_, lse_, delta_, dq_, dk_, dv_] =
                [&od, &lsed, &deltad, &dqd, &dkd, &dvd].map(|b| g.p(b));
            let [q_, k_, v_, do_] = [&qd, &kd, &vd, &dod].map(|b| b.p(g));
            match kernels {
                Kernels::Simt(dt, smem) => {
                    let geo = launch::attention(sc, smem)?;
                    kk.attention_fwd(dt, &geo, o_, lse_, q_, k_, v_, a)?;
                    kk.attention_bwd(dt, &geo, dq_, delta_, do_, o_, q_, k_, v_, lse_, a)?;
                    kk.attention_bwd_kv(dt, &geo, dk_, dv_, do_, q_, k_, v_, lse_, delta_, a)?;
                }
                Kernels::Flash => {
                    let geo = launch::flash(sc)?.ok_or_else(|| {
                        Error::internal("self-test", format!("no flash kernel for {sc:?}"))
                    })?;
                    kk.flash_fwd(&geo, o_, lse_, q_, k_, v_, a)?;
                    kk.flash_bwd(&geo, dq_, delta_, do_, o_, q_, k_, v_, lse_, a)?;
                    kk.flash_bwd_kv(&geo, dk_, dv_, do_, q_, k_, v_, lse_, delta_, a)?;
                }
            }
            query_rows(&mut o, &mut g.down(&od)?, sc, qs, true);
            query_rows(&mut dq, &mut g.down(&dqd)?, sc, qs, true);
            // lse [B, NH, q1−q0] into [B, NH, T]: NH "rows" of one element per query.
            let lc = g.down(&lsed)?;
            for bh in 0..s.b * s.nh {
                lse[bh * s.t + q0..bh * s.t + q1]
                    .copy_from_slice(&lc[bh * sc.nq()..(bh + 1) * sc.nq()]);
            }
        }
        out.extend([
            Out::new(&format!("{label}forward out"), o, o_ref.clone()).tolerance(fwd_tolerance),
            Out::new(&format!("{label}forward lse"), lse, lse_ref.clone()).tolerance(fwd_tolerance),
            Out::new(&format!("{label}backward dq"), dq, dq_ref.clone()).tolerance(bwd_tolerance),
            Out::new(
                &format!("{label}backward dk"),
                g.down(&dkd)?,
                dk_ref.clone(),
            )
            .tolerance(bwd_tolerance),
            Out::new(
                &format!("{label}backward dv"),
                g.down(&dvd)?,
                dv_ref.clone(),
            )
            .tolerance(bwd_tolerance),
        ]);
    }
    Ok(out)
}

pub(super) fn attention_bf16(g: &Gpu<'_>) -> Result<Vec<Out>> {
    let s = AttnShape::causal(1, 45, 4, 4, 128);
    let (qn, kn, rows) = (
        s.b * s.t * s.nh * s.hd,
        s.b * s.t * s.nkv * s.hd,
        s.b * s.nh * s.t,
    );
    let (q, k, v) = (g.rnd(qn, 21, 1.0), g.rnd(kn, 22, 1.0), g.rnd(kn, 23, 1.0));
    let pos = ops::document_positions(&[30, 15]);
    let (mut o_ref, mut lse_ref) = (vec![0.0; qn], vec![0.0; rows]);
    ops::attention_fwd(
        &mut o_ref,
        &mut lse_ref,
        &round_bf16(&q),
        &round_bf16(&k),
        &round_bf16(&v),
        &pos,
        s,
    );
    let geo = launch::attention(s, launch::DEFAULT_SMEM)?;
    let (qd, kd, vd) = (g.up16(&q)?, g.up16(&k)?, g.up16(&v)?);
    let posd = g.up(&pos)?;
    let (od, lsed) = (g.zeros::<u16>(qn)?, g.zeros::<f32>(rows)?);
    g.k().attention_fwd(
        Dtype::Bf16,
        &geo,
        g.p(&od),
        g.p(&lsed),
        g.p(&qd),
        g.p(&kd),
        g.p(&vd),
        AttnArgs::new(s, g.p(&posd))?,
    )?;
    Ok(vec![Out::new("forward out", g.down16(&od)?, o_ref)])
}
