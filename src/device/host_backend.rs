//! The device program's primitives on the CPU: each one is the CPU reference op
//! ([`crate::model::ops`]), on ranges of host buffers that are checked before use — inside their
//! buffer, outputs disjoint from every other range of the call, outputs only in buffers the
//! caller holds for writing. A range the program gets wrong is an error here, where on a GPU it
//! would be silent memory corruption.

use super::program::{Backend, Gemm, MoeAt};
use super::Precision;
use crate::model::config::MlpActivation;
pub(crate) use crate::model::ops::bf16_value;
use crate::model::ops::{self, round_into, AttnShape, AuxGrad, ExpertLoad, MoeShape, Rope};
use crate::{Error, Result};
use std::sync::{Arc, Mutex};

mod moe;

/// A host address: `off` elements into a buffer of `cap` elements at `base`.
#[derive(Debug, Clone, Copy)]
pub struct HostP {
    base: *mut f32,
    cap: usize,
    off: usize,
    writable: bool,
    /// Holds bf16 values ([`Backend::as_bf16`]): rounded when written.
    bf16: bool,
}

impl HostP {
    /// The start of a buffer the caller holds for reading only.
    ///
    /// # Safety
    /// `s` must stay valid, and unwritten by anyone else, while ranges derived from it are used.
    pub unsafe fn read(s: &[f32]) -> Self {
        HostP {
            base: s.as_ptr().cast_mut(),
            cap: s.len(),
            off: 0,
            writable: false,
            bf16: false,
        }
    }

    /// The start of a buffer the caller holds exclusively.
    ///
    /// # Safety
    /// `s` must stay valid, and untouched by anyone else, while ranges derived from it are used.
    pub unsafe fn write(s: &mut [f32]) -> Self {
        HostP {
            base: s.as_mut_ptr(),
            cap: s.len(),
            off: 0,
            writable: true,
            bf16: false,
        }
    }

    /// The same address, its bf16 keeping set apart, and whether it had it.
    fn plain(self) -> (Self, bool) {
        (
            HostP {
                bf16: false,
                ..self
            },
            self.bf16,
        )
    }

    /// Whether `other` is the same address (the same view of the same element).
    fn is(&self, other: &HostP) -> bool {
        (self.base, self.off, self.bf16) == (other.base, other.off, other.bf16)
    }

    fn range(&self, len: usize) -> std::ops::Range<usize> {
        let a = self.base as usize + 4 * self.off;
        a..a + 4 * len
    }
}

/// Token ids on the host.
#[derive(Debug, Clone, Copy)]
pub struct HostIds {
    ptr: *const u32,
    len: usize,
}

/// The slices of one call: outputs, then inputs.
type Views<'a, const W: usize, const R: usize> = ([&'a mut [f32]; W], [&'a [f32]; R]);

/// Checked slices for one call: `outs` are written, `ins` read.
pub(super) fn views<'a, const W: usize, const R: usize>(
    op: &str,
    outs: [(HostP, usize); W],
    ins: [(HostP, usize); R],
) -> Result<Views<'a, W, R>> {
    let bad = |why: String| Error::internal("CPU backend", format!("{op}: {why}"));
    // A stored tensor is written only by the ops that round it, read only by GEMMs and
    // attention: each takes it apart ([`HostP::plain`]) before asking for its views.
    if outs.iter().chain(&ins).any(|(p, _)| p.bf16) {
        return Err(bad(
            "a bf16-kept tensor where fp32 is read or written".into()
        ));
    }
    for (p, len) in outs.iter().chain(&ins) {
        if p.off + len > p.cap {
            return Err(bad(format!(
                "{len} elements at {} overflow a buffer of {}",
                p.off, p.cap
            )));
        }
    }
    for (i, (p, len)) in outs.iter().enumerate() {
        if !p.writable {
            return Err(bad(format!(
                "output {i} is in a buffer held for reading only"
            )));
        }

        let r = p.range(*len);
        for (j, (q, qlen)) in outs.iter().chain(&ins).enumerate() {
            let s = q.range(*qlen);
            if j != i && r.start < s.end && s.start < r.end {
                return Err(bad(format!("output {i} overlaps operand {j}")));
            }
        }
    }
    // SAFETY: every range lies inside its buffer (checked above), whose validity and
    // exclusivity the constructors of `HostP` promise; outputs overlap no other range of the call.
    let o = outs.map(|(p, len)| unsafe { std::slice::from_raw_parts_mut(p.base.add(p.off), len) });
    // SAFETY: as above; inputs are only read.
    let i = ins
        .map(|(p, len)| unsafe { std::slice::from_raw_parts(p.base.add(p.off).cast_const(), len) });
    Ok((o, i))
}

/// An attention shape the CPU kernels take: whole kv groups, queries inside the sequences.
fn check_queries(s: &AttnShape, op: &str) -> Result<()> {
    if s.nkv == 0 || !s.nh.is_multiple_of(s.nkv) || s.q0 > s.q1 || s.q1 > s.t {
        return Err(Error::internal(
            "device program",
            format!("{op}: unsupported shape {s:?}"),
        ));
    }
    Ok(())
}

/// The CPU backend: RoPE tables and the CPU reference ops, in fp32 or in the bf16 recipe.
#[derive(Debug)]
pub struct HostBackend<'r> {
    rope: &'r Rope,
    precision: Precision,
}

thread_local! {
    /// bf16-rounded copies of a GEMM's operands (the bf16 recipe).
    static ROUNDED: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const {
        std::cell::RefCell::new((Vec::new(), Vec::new()))
    };
}

impl<'r> HostBackend<'r> {
    /// An fp32 backend rotating with `rope`'s tables.
    pub fn new(rope: &'r Rope) -> Self {
        Self::with_precision(rope, Precision::Fp32)
    }

    /// A backend computing in `precision`.
    pub fn with_precision(rope: &'r Rope, precision: Precision) -> Self {
        HostBackend { rope, precision }
    }

    fn ids<'a>(&self, ids: HostIds, n: usize, op: &str) -> Result<&'a [u32]> {
        if n > ids.len {
            return Err(Error::internal(
                "device program",
                format!("{op}: {n} ids wanted, {} uploaded", ids.len),
            ));
        }
        // SAFETY: `upload_ids` took this pointer from a slice the caller keeps alive for the run.
        Ok(unsafe { std::slice::from_raw_parts(ids.ptr, n) })
    }

    /// Attention's inputs (Q, K, V, dO) as fp32 storage: under bf16 the program stores them
    /// in bf16 ([`Backend::as_bf16`], here the fp32 storage of bf16 values), else in fp32.
    /// Inputs in the other precision are a bug in the program (a GPU would misread them).
    fn attention_inputs<const N: usize>(&self, ins: [HostP; N], op: &str) -> Result<[HostP; N]> {
        let bf16 = self.precision == Precision::Bf16;
        if ins.iter().any(|p| p.bf16 != bf16) {
            return Err(Error::internal(
                "CPU backend",
                format!("{op}: attention inputs not all in the recipe's storage"),
            ));
        }
        Ok(ins.map(|p| p.plain().0))
    }
}

impl Backend for HostBackend<'_> {
    type P = HostP;
    type Ids = HostIds;

    fn off(p: HostP, elems: usize) -> HostP {
        HostP {
            off: p.off + elems,
            ..p
        }
    }

    fn as_bf16(p: HostP) -> HostP {
        HostP { bf16: true, ..p }
    }

    fn ids_off(ids: HostIds, n: usize) -> HostIds {
        HostIds {
            ptr: ids.ptr.wrapping_add(n),
            len: ids.len.saturating_sub(n),
        }
    }

    fn upload_ids(&mut self, ids: &[u32]) -> Result<HostIds> {
        Ok(HostIds {
            ptr: ids.as_ptr(),
            len: ids.len(),
        })
    }

    fn upload_positions(&mut self, positions: &std::sync::Arc<[u32]>) -> Result<HostIds> {
        self.upload_ids(positions)
    }

    fn gemm(&mut self, g: Gemm<HostP>) -> Result<()> {
        // bf16-kept operands are read as the values they hold (rounding them again below is
        // exact).
        let (a, b) = (g.a.plain().0, g.b.plain().0);
        let g = Gemm { a, b, ..g };
        let (a_len, b_len) = (g.m * g.k, g.k * g.n);
        let ([c], [a, b]) = views("gemm", [(g.c, g.m * g.n)], [(g.a, a_len), (g.b, b_len)])?;
        let a_st = if g.ta { (1, g.m) } else { (g.k, 1) };
        let b_st = if g.tb { (1, g.k) } else { (g.n, 1) };
        if self.precision == Precision::Fp32 {
            ops::gemm(c, a, a_st, b, b_st, g.m, g.k, g.n, g.accumulate);
            return Ok(());
        }
        // A bf16 GEMM: bf16 operands (their products are exact in fp32), fp32 sums and result.
        ROUNDED.with_borrow_mut(|(ra, rb)| {
            round_into(ra, a);
            round_into(rb, b);
            ops::gemm(c, ra, a_st, rb, b_st, g.m, g.k, g.n, g.accumulate);
        });
        Ok(())
    }

    fn bias_fwd(&mut self, y: HostP, b: HostP, rows: usize, cols: usize) -> Result<()> {
        let ([y], [b]) = views("bias_fwd", [(y, rows * cols)], [(b, cols)])?;
        ops::bias_fwd(y, b);
        Ok(())
    }

    fn bias_bwd(&mut self, db: HostP, dy: HostP, rows: usize, cols: usize) -> Result<()> {
        let ([db], [dy]) = views("bias_bwd", [(db, cols)], [(dy, rows * cols)])?;
        ops::bias_bwd(db, dy, rows);
        Ok(())
    }

    fn add(&mut self, y: HostP, x: HostP, len: usize) -> Result<()> {
        let ([y], [x]) = views("add", [(y, len)], [(x, len)])?;
        for (a, b) in y.iter_mut().zip(x) {
            *a += *b;
        }
        Ok(())
    }

    fn zero(&mut self, dst: HostP, len: usize) -> Result<()> {
        let ([d], []) = views("zero", [(dst, len)], [])?;
        d.fill(0.0);
        Ok(())
    }

    fn fixed_grad_blocks(&self) -> bool {
        true
    }

    fn precision(&self) -> Precision {
        self.precision
    }

    fn stored(&self) -> Precision {
        Precision::Fp32
    }

    fn store_bf16(&mut self, dst: HostP, src: HostP, len: usize) -> Result<()> {
        let (dst, keep16) = dst.plain();
        if !keep16 {
            return Err(Error::internal(
                "CPU backend",
                "store_bf16: an fp32 destination",
            ));
        }
        let ([d], [s]) = views("store_bf16", [(dst, len)], [(src, len)])?;
        d.iter_mut().zip(s).for_each(|(d, s)| *d = bf16_value(*s));
        Ok(())
    }

    fn load_bf16(&mut self, dst: HostP, src: HostP, len: usize) -> Result<()> {
        let (src, keep16) = src.plain();
        if !keep16 || dst.plain().1 {
            return Err(Error::internal(
                "CPU backend",
                "load_bf16: the source must be a bf16 region and the destination fp32",
            ));
        }
        // The region holds the bf16 values as fp32 already: widening is a copy.
        let ([d], [s]) = views("load_bf16", [(dst, len)], [(src, len)])?;
        d.copy_from_slice(s);
        Ok(())
    }

    fn rmsnorm_fwd(
        &mut self,
        y: HostP,
        rstd: HostP,
        x: HostP,
        (w, w_offset): (HostP, f32),
        rows: usize,
        c: usize,
        eps: f32,
    ) -> Result<()> {
        let (y, keep16) = y.plain();
        let ([y, r], [x, w]) = views(
            "rmsnorm_fwd",
            [(y, rows * c), (rstd, rows)],
            [(x, rows * c), (w, c)],
        )?;
        ops::rmsnorm_fwd(y, r, x, (w, w_offset), c, eps);
        if keep16 {
            y.iter_mut().for_each(|v| *v = bf16_value(*v));
        }
        Ok(())
    }

    fn rmsnorm_bwd(
        &mut self,
        dx: HostP,
        dw: HostP,
        dy: HostP,
        x: HostP,
        (w, w_offset): (HostP, f32),
        rstd: HostP,
        rows: usize,
        c: usize,
        accumulate: bool,
    ) -> Result<()> {
        let ([dx, dw], [dy, x, w, r]) = views(
            "rmsnorm_bwd",
            [(dx, rows * c), (dw, c)],
            [(dy, rows * c), (x, rows * c), (w, c), (rstd, rows)],
        )?;
        ops::rmsnorm_bwd(dx, accumulate, dw, dy, x, (w, w_offset), r, c);
        Ok(())
    }

    fn rope(
        &mut self,
        y: HostP,
        x: HostP,
        pos: HostIds,
        (rows, heads): (usize, usize),
        inverse: bool,
        table: usize,
    ) -> Result<()> {
        let len = rows * heads * self.rope.head_dim;
        // In place only as fp32: a stored output over its own input is an overlap (on a GPU,
        // bf16 pairs written over fp32 values other threads still read).
        let in_place = y.is(&x);
        let (y, keep16) = y.plain();
        let y = if in_place {
            let ([y], []) = views("rope", [(x, len)], [])?;
            y
        } else {
            let ([y], [x]) = views("rope", [(y, len)], [(x, len)])?;
            y.copy_from_slice(x);
            y
        };
        let pos = self.ids(pos, rows, "rope")?;
        if let Some(p) = pos.iter().find(|&&p| p as usize >= self.rope.max_pos) {
            return Err(Error::internal(
                "device program",
                format!(
                    "rope: position {p} beyond the table's {}",
                    self.rope.max_pos
                ),
            ));
        }
        if table >= self.rope.tables {
            return Err(Error::internal(
                "device program",
                format!("rope: table {table} of {}", self.rope.tables),
            ));
        }
        self.rope.apply_table(y, pos, heads, inverse, table);
        if keep16 {
            y.iter_mut().for_each(|v| *v = bf16_value(*v));
        }
        Ok(())
    }

    fn attention_fwd(
        &mut self,
        o: HostP,
        lse: HostP,
        q: HostP,
        k: HostP,
        v: HostP,
        pos: HostIds,
        s: AttnShape,
    ) -> Result<()> {
        let (n, nq, qd, kvd) = (s.b * s.t, s.b * s.nq(), s.nh * s.hd, s.nkv * s.hd);
        check_queries(&s, "attention_fwd")?;
        let [q, k, v] = self.attention_inputs([q, k, v], "attention_fwd")?;
        let ([o, l], [q, k, v]) = views(
            "attention_fwd",
            [(o, nq * qd), (lse, s.nh * nq)],
            [(q, nq * qd), (k, n * kvd), (v, n * kvd)],
        )?;
        let pos = self.ids(pos, n, "attention_fwd")?;
        ops::attention_fwd(o, l, q, k, v, pos, s);
        Ok(())
    }

    fn attention_bwd(
        &mut self,
        dq: HostP,
        dk: HostP,
        dv: HostP,
        delta: HostP,
        d_o: HostP,
        q: HostP,
        k: HostP,
        v: HostP,
        o: HostP,
        lse: HostP,
        pos: HostIds,
        s: AttnShape,
    ) -> Result<()> {
        let (n, nq, qd, kvd) = (s.b * s.t, s.b * s.nq(), s.nh * s.hd, s.nkv * s.hd);
        check_queries(&s, "attention_bwd")?;
        let [d_o, q, k, v] = self.attention_inputs([d_o, q, k, v], "attention_bwd")?;
        let pos = self.ids(pos, n, "attention_bwd")?;
        let ([dq, dk, dv, delta], [d_o, q, k, v, o, l]) = views(
            "attention_bwd",
            [
                (dq, nq * qd),
                (dk, n * kvd),
                (dv, n * kvd),
                (delta, s.nh * nq),
            ],
            [
                (d_o, nq * qd),
                (q, nq * qd),
                (k, n * kvd),
                (v, n * kvd),
                (o, nq * qd),
                (lse, s.nh * nq),
            ],
        )?;
        ops::attention_bwd(dq, dk, dv, delta, d_o, q, k, v, o, l, pos, s);
        Ok(())
    }

    fn gated_fwd(
        &mut self,
        act: MlpActivation,
        h: HostP,
        g: HostP,
        u: HostP,
        len: usize,
    ) -> Result<()> {
        let (h, keep16) = h.plain();
        let ([h], [g, u]) = views("gated_fwd", [(h, len)], [(g, len), (u, len)])?;
        ops::gated_fwd(act, h, g, u);
        if keep16 {
            h.iter_mut().for_each(|v| *v = bf16_value(*v));
        }
        Ok(())
    }

    fn attn_sinks_fwd(&mut self, o: HostP, lse: HostP, sinks: HostP, s: AttnShape) -> Result<()> {
        let rows = s.b * (s.q1 - s.q0);
        let ([o, lse], [sinks]) = views(
            "attn_sinks_fwd",
            [(o, rows * s.nh * s.hd), (lse, rows * s.nh)],
            [(sinks, s.nh)],
        )?;
        ops::sinks_fwd(o, lse, sinks, s);
        Ok(())
    }

    fn attn_sinks_bwd(
        &mut self,
        dsinks: HostP,
        d_o: HostP,
        o: HostP,
        lse: HostP,
        sinks: HostP,
        s: AttnShape,
    ) -> Result<()> {
        let rows = s.b * (s.q1 - s.q0);
        // dO as stored (bf16-kept under the bf16 recipe), read as the values it holds.
        let d_o = d_o.plain().0;
        let ([dsinks], [d_o, o, lse, sinks]) = views(
            "attn_sinks_bwd",
            [(dsinks, s.nh)],
            [
                (d_o, rows * s.nh * s.hd),
                (o, rows * s.nh * s.hd),
                (lse, rows * s.nh),
                (sinks, s.nh),
            ],
        )?;
        ops::sinks_bwd(dsinks, d_o, o, lse, sinks, s);
        Ok(())
    }

    fn moe_fwd(
        &mut self,
        out: HostP,
        h: HostP,
        w: MoeAt<HostP>,
        rows: usize,
        s: MoeShape,
        pad: Option<&[u8]>,
    ) -> Result<ExpertLoad> {
        moe::forward(out, h, w, rows, (s, pad), self.precision == Precision::Bf16)
    }

    #[allow(clippy::too_many_arguments)]
    fn moe_bwd(
        &mut self,
        dh: HostP,
        g: MoeAt<HostP>,
        d_out: HostP,
        h: HostP,
        w: MoeAt<HostP>,
        rows: usize,
        s: MoeShape,
        aux: Option<AuxGrad<'_>>,
    ) -> Result<()> {
        let bf16 = self.precision == Precision::Bf16;
        moe::backward(dh, g, d_out, h, w, rows, (s, bf16), aux)
    }

    fn gated_bwd(
        &mut self,
        act: MlpActivation,
        dg: HostP,
        du: HostP,
        dh: HostP,
        g: HostP,
        u: HostP,
        len: usize,
    ) -> Result<()> {
        let ((dg, g16), (du, u16)) = (dg.plain(), du.plain());
        let ([dg, du], [dh, g, u]) = views(
            "gated_bwd",
            [(dg, len), (du, len)],
            [(dh, len), (g, len), (u, len)],
        )?;
        ops::gated_bwd(act, dg, du, dh, g, u);
        for (out, keep16) in [(dg, g16), (du, u16)] {
            if keep16 {
                out.iter_mut().for_each(|v| *v = bf16_value(*v));
            }
        }
        Ok(())
    }

    fn embed_fwd(
        &mut self,
        x: HostP,
        e: HostP,
        ids: HostIds,
        (rows, c, vocab): (usize, usize, usize),
        scale: f32,
    ) -> Result<()> {
        let ids = self.ids(ids, rows, "embed_fwd")?;
        let ([x], [e]) = views("embed_fwd", [(x, rows * c)], [(e, vocab * c)])?;
        for (row, &tok) in x.chunks_mut(c).zip(ids) {
            let t = tok as usize;
            let src = e.get(t * c..(t + 1) * c).ok_or_else(|| {
                Error::internal("device program", format!("embed_fwd: token {t} ≥ {vocab}"))
            })?;
            for (o, v) in row.iter_mut().zip(src) {
                *o = *v * scale;
            }
        }
        Ok(())
    }

    fn embed_bwd(
        &mut self,
        de: HostP,
        tokens: &[u32],
        dx: HostP,
        (rows, c, vocab): (usize, usize, usize),
        scale: f32,
        pad: Option<u32>,
    ) -> Result<()> {
        let ids = tokens.get(..rows).ok_or_else(|| {
            Error::internal(
                "CPU backend",
                format!("embed_bwd: {} token ids for {rows} rows", tokens.len()),
            )
        })?;
        let ([de], [dx]) = views("embed_bwd", [(de, vocab * c)], [(dx, rows * c)])?;
        for (row, &tok) in dx.chunks(c).zip(ids) {
            if Some(tok) == pad {
                continue;
            }
            let t = tok as usize;
            let dst = de.get_mut(t * c..(t + 1) * c).ok_or_else(|| {
                Error::internal("device program", format!("embed_bwd: token {t} ≥ {vocab}"))
            })?;
            for (d, v) in dst.iter_mut().zip(row) {
                *d += *v * scale;
            }
        }
        Ok(())
    }

    fn cross_entropy(
        &mut self,
        logits: HostP,
        losses: HostP,
        targets: HostIds,
        rows: usize,
        vocab: usize,
        (scale, softcap): (f32, Option<f32>),
    ) -> Result<()> {
        let tg = self.ids(targets, rows, "cross_entropy")?;
        if let Some(bad) = tg
            .iter()
            .find(|&&t| t != ops::IGNORE && t as usize >= vocab)
        {
            return Err(Error::internal(
                "device program",
                format!("cross_entropy: target {bad} ≥ {vocab}"),
            ));
        }
        let ([z, l], []) = views(
            "cross_entropy",
            [(logits, rows * vocab), (losses, rows)],
            [],
        )?;
        ops::cross_entropy(z, l, tg, vocab, scale, softcap);
        Ok(())
    }

    fn add_loss(&mut self, losses: HostP, rows: usize, into: Arc<Mutex<f64>>) -> Result<()> {
        let ([], [l]) = views("add_loss", [], [(losses, rows)])?;
        let s: f64 = l.iter().map(|x| f64::from(*x)).sum();
        *crate::util::lock(&into) += s;
        Ok(())
    }

    fn read_back(&mut self, src: HostP, len: usize, into: Arc<Mutex<Vec<f32>>>) -> Result<()> {
        let ([], [x]) = views("read_back", [], [(src, len)])?;
        let mut dst = crate::util::lock(&into);
        dst.clear();
        dst.extend_from_slice(x);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::adamw::{bf16_to_f32, f32_to_bf16};

    /// Under bf16, a GEMM is the fp32 GEMM of its operands rounded to bf16 (nearest even), bit
    /// for bit, in every transpose and with accumulation; `store_bf16` is that rounding.
    #[test]
    fn bf16_gemm_is_the_gemm_of_rounded_operands() {
        let rope = Rope::new(8, 1e4, 4);
        let (m, k, n) = (7, 33, 5);
        for (ta, tb, accumulate) in [
            (false, true, false),
            (true, false, true),
            (false, false, true),
        ] {
            let a = crate::util::uniform(m * k, 1, 3.0);
            let b = crate::util::uniform(k * n, 2, 3.0);
            let c0 = crate::util::uniform(m * n, 3, 1.0);
            let run = |be: &mut HostBackend<'_>, a: &[f32], b: &[f32]| {
                let mut c = c0.clone();
                // SAFETY: the three buffers outlive the call; c is written by it alone.
                let (pa, pb, pc) =
                    unsafe { (HostP::read(a), HostP::read(b), HostP::write(&mut c)) };
                be.gemm(Gemm {
                    c: pc,
                    a: pa,
                    ta,
                    b: pb,
                    tb,
                    m,
                    k,
                    n,
                    accumulate,
                })
                .unwrap();
                c
            };
            let got = run(
                &mut HostBackend::with_precision(&rope, Precision::Bf16),
                &a,
                &b,
            );
            let (ra, rb): (Vec<f32>, Vec<f32>) = (
                a.iter().map(|x| bf16_value(*x)).collect(),
                b.iter().map(|x| bf16_value(*x)).collect(),
            );
            let want = run(&mut HostBackend::new(&rope), &ra, &rb);
            assert_eq!(got, want, "ta {ta} tb {tb}");
            assert_ne!(got, run(&mut HostBackend::new(&rope), &a, &b));
        }
        let src = [
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            -2.5e-3,
            f32::INFINITY,
        ];
        let mut x = vec![0.0f32; 4];
        // SAFETY: x and src outlive the calls.
        let (p, ps) = unsafe { (HostP::write(&mut x), HostP::read(&src)) };
        let mut be = HostBackend::with_precision(&rope, Precision::Bf16);
        assert!(
            be.store_bf16(p, ps, 4).is_err(),
            "only into a region the recipe stores in bf16"
        );
        be.store_bf16(HostBackend::as_bf16(p), ps, 4).unwrap();
        // RoPE into a stored region: RoPE in place, then that rounding; `x` untouched.
        let (heads, rows) = (2, 3);
        let len = heads * rows * rope.head_dim;
        let src: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let pos = [0u32, 1, 0];
        let ids = be.upload_ids(&pos).unwrap();
        for inverse in [false, true] {
            let (mut x, mut y) = (src.clone(), vec![0.0f32; len]);
            // SAFETY: x and y outlive the calls.
            let (xp, yp) = unsafe { (HostP::write(&mut x), HostP::write(&mut y)) };
            be.rope(HostBackend::as_bf16(yp), xp, ids, (rows, heads), inverse, 0)
                .unwrap();
            assert_eq!(x, src, "the input is left as it was");
            let over_itself = be.rope(HostBackend::as_bf16(xp), xp, ids, (rows, heads), inverse, 0);
            assert!(over_itself.is_err(), "bf16 written over its own fp32 input");
            be.rope(xp, xp, ids, (rows, heads), inverse, 0).unwrap();
            assert_ne!(x, src);
            let want: Vec<f32> = x.iter().map(|v| bf16_value(*v)).collect();
            assert_eq!(y, want, "inverse {inverse}");
        }
        assert_eq!(x[0], 1.0, "a tie rounds to even");
        assert_eq!(x[1], 1.0 + 4.0 * 2f32.powi(-8));
        assert_eq!(x[2], bf16_to_f32(f32_to_bf16(-2.5e-3)));
        assert_eq!(x[3], f32::INFINITY);
        // The branch-free rounding is the optimizer's conversion, over a sweep of patterns.
        for i in 0..=u16::MAX as u32 {
            for low in [0u32, 0x7fff, 0x8000, 0x8001, 0xffff, i] {
                let v = f32::from_bits((i << 16) | (low & 0xffff));
                let (a, b) = (bf16_value(v), bf16_to_f32(f32_to_bf16(v)));
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "{v:e}"
                );
            }
        }
    }
}
