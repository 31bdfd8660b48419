//! Launch geometry of the CUDA kernels (`kernels/*.cu`): grid, block and shared memory from the
//! shapes, with the limits checked here — in every build, tested without a GPU — rather than
//! discovered as a launch failure on one.

use crate::{Error, Result};

/// Threads per block of the elementwise and row kernels.
pub const BLOCK: u32 = 256;
/// Query (or key) rows per attention block: one warp each (`ROWS` in attention.cu).
pub const ATTN_ROWS: u32 = 8;
/// Largest head dimension the attention kernels hold in registers (`MAX_PER_LANE` × 32).
pub const ATTN_MAX_HEAD_DIM: usize = 256;
/// Shared memory a block may use without opting in (all architectures since sm_70).
pub const DEFAULT_SMEM: usize = 48 << 10;
/// gridDim.y and gridDim.z limits.
const GRID_YZ_MAX: usize = 65_535;
/// gridDim.x limit.
const GRID_X_MAX: usize = (1 << 31) - 1;

/// A launch configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    /// Blocks (x, y, z).
    pub grid: (u32, u32, u32),
    /// Threads per block (x).
    pub block: u32,
    /// Dynamic shared memory, bytes.
    pub smem: u32,
}

/// Elementwise kernels (grid-stride loops): enough blocks to fill `sms` multiprocessors several
/// times over, never more than the work needs.
pub fn elementwise(n: usize, sms: u32) -> Launch {
    let need = n.div_ceil(BLOCK as usize).max(1);
    let cap = (sms.max(1) as usize) * 32;
    Launch {
        grid: (need.min(cap).min(GRID_X_MAX) as u32, 1, 1),
        block: BLOCK,
        smem: 0,
    }
}

/// One block per row (RMSNorm, cross-entropy): `rows` blocks of up to 1024 threads, a multiple of
/// 32 no larger than the row needs.
pub fn per_row(rows: usize, cols: usize) -> Result<Launch> {
    if rows > GRID_X_MAX {
        return Err(Error::bad_input(
            "kernel launch",
            format!("{rows} rows"),
            format!("exceeds the grid limit {GRID_X_MAX}"),
            None,
        ));
    }
    let threads = cols.div_ceil(32).clamp(1, 32) * 32;
    Ok(Launch {
        grid: (rows.max(1) as u32, 1, 1),
        block: threads as u32,
        smem: 0,
    })
}

/// Columns per block of the column reductions (`COL_TILE` in common.cuh).
const COL_TILE: usize = 16;
/// Row lanes per column of the column reductions (`ROW_LANES` in common.cuh).
const ROW_LANES: u32 = 64;

/// Column reductions (bias and RMSNorm weight gradients): a block of 16 columns × 64 row lanes.
pub fn per_column(cols: usize) -> Launch {
    Launch {
        grid: (cols.div_ceil(COL_TILE).max(1) as u32, 1, 1),
        block: COL_TILE as u32 * ROW_LANES,
        smem: 0,
    }
}

/// The rows and columns of one block's output tile in the experts' GEMMs (`EG_BM`, `EG_BN` in
/// kernels/expert_gemm.cu), and its threads.
const EXPERT_TILE: usize = 128;
const EXPERT_THREADS: u32 = 256;
/// Their dynamic shared memory: `EG_STAGES` (3) stages of an A and a B tile of `EG_TILE`
/// (128 × 40) halfwords each.
const EXPERT_SMEM: u32 = 3 * 2 * 128 * 40 * 2;

/// `expert_gemm_fwd_f32i16` over `rows` grouped rows of `groups` experts, `n` output columns:
/// blockIdx.x counts (row tile, column tile) pairs, column tiles fastest, over at most
/// ⌈rows/128⌉ + groups row tiles whatever the counts (the host need not know them).
pub fn expert_gemm_rows(rows: usize, groups: usize, n: usize) -> Result<Launch> {
    let tiles =
        (rows.div_ceil(EXPERT_TILE) + groups).saturating_mul(n.div_ceil(EXPERT_TILE).max(1));
    if tiles > GRID_X_MAX {
        return Err(Error::bad_input(
            "expert GEMM",
            format!("{rows} rows of {groups} experts, {n} columns"),
            format!("exceeds the grid limit ({GRID_X_MAX} tiles of {EXPERT_TILE} × {EXPERT_TILE})"),
            None,
        ));
    }
    Ok(Launch {
        grid: (tiles.max(1) as u32, 1, 1),
        block: EXPERT_THREADS,
        smem: EXPERT_SMEM,
    })
}

/// `expert_gemm_bwd_f32i16`: each expert's `[m, n]` weight gradient in 128 × 128 tiles
/// (blockIdx.x), one expert per blockIdx.z.
pub fn expert_gemm_sums(m: usize, n: usize, groups: usize) -> Result<Launch> {
    let tiles = m.div_ceil(EXPERT_TILE) * n.div_ceil(EXPERT_TILE);
    if tiles > GRID_X_MAX || groups > GRID_YZ_MAX {
        return Err(Error::bad_input(
            "expert GEMM",
            format!("{groups} experts' [{m}, {n}] gradients"),
            format!("exceeds the grid limits ({GRID_X_MAX} tiles, {GRID_YZ_MAX} experts)"),
            None,
        ));
    }
    Ok(Launch {
        grid: (tiles.max(1) as u32, 1, groups.max(1) as u32),
        block: EXPERT_THREADS,
        smem: EXPERT_SMEM,
    })
}

pub use crate::model::ops::AttnShape;

/// Geometry of the three attention kernels for one shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnLaunch {
    /// `attention_fwd_*` and `attention_bwd_*` (dq): a block per 8 query rows of one head.
    pub rows: Launch,
    /// `attention_bwd_kv_*`: a block per 8 key rows (before `q1`) of one kv head.
    pub kv: Launch,
    /// Rows of the other side held in shared memory per tile (the kernels' `tile` argument).
    pub tile: u32,
}

/// An attention shape the kernels cannot take, named.
fn bad_attention<T>(s: AttnShape, why: String) -> Result<T> {
    Err(Error::bad_input(
        "attention shape",
        format!("{s:?}"),
        why,
        None,
    ))
}

/// The limits every attention kernel shares: whole GQA groups, the grid, a query range.
fn check_attention(s: AttnShape) -> Result<()> {
    if s.nkv == 0 || !s.nh.is_multiple_of(s.nkv) {
        return bad_attention(
            s,
            "num_attention_heads must be a multiple of num_key_value_heads".into(),
        );
    }
    if s.b > GRID_YZ_MAX || s.nh > GRID_YZ_MAX || s.b == 0 || s.t == 0 {
        return bad_attention(s, format!("batch and heads must be 1..={GRID_YZ_MAX}"));
    }
    if s.q0 >= s.q1 || s.q1 > s.t {
        return bad_attention(
            s,
            "the queries must be a non-empty range of the sequence".into(),
        );
    }
    Ok(())
}

/// Attention geometry within `smem_limit` bytes of shared memory per block.
pub fn attention(s: AttnShape, smem_limit: usize) -> Result<AttnLaunch> {
    let bad = |why: String| bad_attention(s, why);
    if s.hd == 0 || s.hd > ATTN_MAX_HEAD_DIM || !s.hd.is_multiple_of(2) {
        return bad(format!(
            "head_dim must be even and ≤ {ATTN_MAX_HEAD_DIM} for the CUDA attention kernels"
        ));
    }
    check_attention(s)?;
    // fwd/dq: K and V tiles; kv: Q and dO tiles plus per row two floats (lse, delta) and the
    // query's first key (an int).
    let per_row_fwd = 2 * s.hd * 4;
    let per_row_kv = (2 * s.hd + 3) * 4;
    let tile = (smem_limit / per_row_kv).min(64).min(s.t.max(1));
    if tile == 0 {
        return bad(format!(
            "one tile row needs {per_row_kv} bytes of shared memory, {smem_limit} available"
        ));
    }
    // A block per 8 queries of the range, and per 8 keys the range can see (0..q1).
    let (query_blocks, key_blocks) = (
        s.nq().div_ceil(ATTN_ROWS as usize) as u32,
        s.q1.div_ceil(ATTN_ROWS as usize) as u32,
    );
    Ok(AttnLaunch {
        rows: Launch {
            grid: (query_blocks, s.nh as u32, s.b as u32),
            block: ATTN_ROWS * 32,
            smem: (tile * per_row_fwd) as u32,
        },
        kv: Launch {
            grid: (key_blocks, s.nkv as u32, s.b as u32),
            block: ATTN_ROWS * 32,
            smem: (tile * per_row_kv) as u32,
        },
        tile: tile as u32,
    })
}

/// Head dimensions of the tensor-core attention (`flash.cu`'s instantiations).
pub const FLASH_HEAD_DIMS: [usize; 3] = [32, 64, 128];
/// Rows (queries, or keys for dk/dv) a tensor-core attention block owns: 4 warps of 16
/// (`FLASH_ROWS`).
const FLASH_ROWS: usize = 64;
/// Key tile of the forward (`FWD_KEYS`), of dq (`DQ_KEYS`), query tile of dk/dv (`KV_QUERIES`).
const FLASH_FWD_KEYS: usize = 64;
const FLASH_DQ_KEYS: usize = 32;
const FLASH_KV_QUERIES: usize = 16;
/// Halfwords of padding per shared bf16 row (`PAD`).
const FLASH_PAD: usize = 8;

/// Geometry of the three tensor-core attention kernels (`flash{hd}_*`) for one shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlashLaunch {
    /// The head dimension: which instantiation runs.
    pub hd: usize,
    /// `flash{hd}_fwd_*`: a block per 64 query rows of one head.
    pub fwd: Launch,
    /// `flash{hd}_bwd_*` (dq): a block per 64 query rows of one head.
    pub dq: Launch,
    /// `flash{hd}_bwd_kv_*`: a block per 64 key rows (before `q1`) of one kv head.
    pub kv: Launch,
}

/// The tensor-core attention's geometry for `s`, or `None` when its head dimension has no
/// instantiation or its scores are soft-capped (the SIMT kernels of [`attention`] take it: a
/// cap compiled into the tensor-core kernels cost them a fifth of their speed on an H200 even
/// when off, 27.7 against 34–35 TFLOP/s). Every tile fits the 48 KiB every architecture
/// grants without opting in.
pub fn flash(s: AttnShape) -> Result<Option<FlashLaunch>> {
    if !FLASH_HEAD_DIMS.contains(&s.hd) || s.softcap.is_some() {
        return Ok(None);
    }
    check_attention(s)?;
    // Bytes of one shared bf16 row.
    let row = (s.hd + FLASH_PAD) * 2;
    let block = |blocks: usize, heads: usize, rows: usize| Launch {
        grid: (blocks as u32, heads as u32, s.b as u32),
        block: (FLASH_ROWS / 16 * 32) as u32,
        smem: (rows * row) as u32,
    };
    let query_blocks = s.nq().div_ceil(FLASH_ROWS);
    let mut kv = block(
        s.q1.div_ceil(FLASH_ROWS),
        s.nkv,
        2 * FLASH_ROWS + 2 * FLASH_KV_QUERIES,
    );
    // lse, delta and first key per query of the tile.
    kv.smem += (3 * FLASH_KV_QUERIES * 4) as u32;
    Ok(Some(FlashLaunch {
        hd: s.hd,
        fwd: block(query_blocks, s.nh, 2 * FLASH_FWD_KEYS),
        dq: block(query_blocks, s.nh, 2 * FLASH_DQ_KEYS),
        kv,
    }))
}

/// Rows of LM-head logits per cross-entropy chunk so that `rows × vocab` fp32 logits stay within
/// `budget_bytes` of device memory (at least one row, at most `n`).
pub fn logit_chunk_rows(n: usize, vocab: usize, budget_bytes: usize) -> usize {
    (budget_bytes / (vocab.max(1) * 4)).clamp(1, n.max(1))
}

/// A column-major BLAS GEMM call: `C = op(first)·op(second) (+ C)` with cuBLAS' argument order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ColMajorGemm {
    /// `op` of the first matrix is a transpose.
    pub trans_first: bool,
    /// `op` of the second matrix is a transpose.
    pub trans_second: bool,
    /// Rows of the column-major C.
    pub m: usize,
    /// Columns of the column-major C.
    pub n: usize,
    /// Inner dimension.
    pub k: usize,
    /// Leading dimension of the first matrix.
    pub ld_first: usize,
    /// Leading dimension of the second matrix.
    pub ld_second: usize,
    /// Leading dimension of C.
    pub ldc: usize,
}

/// The cuBLAS call for the row-major, packed `C[m, n] = op(A)·op(B)` of
/// [`super::program::Gemm`] (`A` m×k, stored k×m when `ta`; `B` k×n, stored n×k when `tb`):
/// row-major C is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ, so B goes first, and a row-major matrix
/// stored r×c is, to BLAS, its transpose with leading dimension c.
pub fn row_major_gemm(m: usize, k: usize, n: usize, ta: bool, tb: bool) -> ColMajorGemm {
    ColMajorGemm {
        trans_first: tb,
        trans_second: ta,
        m: n,
        n: m,
        k,
        ld_first: if tb { k } else { n }.max(1),
        ld_second: if ta { m } else { k }.max(1),
        ldc: n.max(1),
    }
}

/// The token ids of a micro-batch grouped for the embedding gradient (`embedding_bwd`), packed
/// as the kernel reads them: `order` (the rows, stably sorted by token: each token's rows
/// ascending), `starts` (group g's rows are `order[starts[g]..starts[g + 1]]`, U + 1 entries) and
/// `tokens` (group g's token, U entries) — `n + 2·U + 1` ids, U the distinct tokens. One thread
/// then owns each (token, column) and adds its rows in order: no atomics, the CPU's bits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenGroups {
    /// `order ‖ starts ‖ tokens`.
    pub packed: Vec<u32>,
    /// Distinct tokens (U).
    pub groups: usize,
}

/// Group `tokens` (each below `vocab`) for [`TokenGroups`]; the rows of token `skip` (the
/// embedding's padding index, which gets no gradient) are left out of every group.
pub fn group_tokens(tokens: &[u32], vocab: usize, skip: Option<u32>) -> Result<TokenGroups> {
    if let Some(t) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::internal(
            "embedding gradient",
            format!("token {t} of a vocabulary of {vocab}"),
        ));
    }
    let n = u32::try_from(tokens.len()).map_err(|_| {
        Error::internal(
            "embedding gradient",
            format!("{} tokens in one micro-batch", tokens.len()),
        )
    })?;
    let mut order: Vec<u32> = (0..n).collect();
    // The skipped rows last, after every group.
    order.sort_by_key(|&r| (Some(tokens[r as usize]) == skip, tokens[r as usize]));
    let mut starts = Vec::new();
    let mut ids = Vec::new();
    let mut end = n;
    for (i, &r) in order.iter().enumerate() {
        let t = tokens[r as usize];
        if Some(t) == skip {
            end = i as u32;
            break;
        }
        if ids.last() != Some(&t) {
            starts.push(i as u32);
            ids.push(t);
        }
    }
    starts.push(end);
    let groups = ids.len();
    let mut packed = order;
    packed.extend(starts);
    packed.extend(ids);
    Ok(TokenGroups { packed, groups })
}

#[cfg(test)]
mod tests {

    /// Column-major `C = op(A)·op(B) + beta·C` exactly as BLAS defines it (the reference the
    /// cuBLAS mapping is checked against without a GPU).
    #[allow(clippy::too_many_arguments)]
    fn blas_sgemm(g: &ColMajorGemm, a: &[f32], b: &[f32], c: &mut [f32], beta: f32) {
        let at = |i: usize, l: usize| {
            if g.trans_first {
                a[l + i * g.ld_first]
            } else {
                a[i + l * g.ld_first]
            }
        };
        let bt = |l: usize, j: usize| {
            if g.trans_second {
                b[j + l * g.ld_second]
            } else {
                b[l + j * g.ld_second]
            }
        };
        for j in 0..g.n {
            for i in 0..g.m {
                let mut s = 0.0f64;
                for l in 0..g.k {
                    s += f64::from(at(i, l)) * f64::from(bt(l, j));
                }
                let o = &mut c[i + j * g.ldc];
                *o = s as f32 + beta * *o;
            }
        }
    }

    /// The cuBLAS mapping of every transpose combination computes what the CPU GEMM computes.
    #[test]
    fn row_major_gemm_maps_onto_column_major_blas() {
        let (m, k, n) = (5usize, 7usize, 3usize);
        for (ta, tb, acc) in [
            (false, false, false),
            (false, true, true),
            (true, false, true),
            (true, true, false),
        ] {
            let a = crate::util::uniform(m * k, 1, 1.0);
            let b = crate::util::uniform(k * n, 2, 1.0);
            let c0 = crate::util::uniform(m * n, 3, 1.0);
            let mut want = c0.clone();
            let a_st = if ta { (1, m) } else { (k, 1) };
            let b_st = if tb { (1, k) } else { (n, 1) };
            crate::model::ops::gemm(&mut want, &a, a_st, &b, b_st, m, k, n, acc);
            let g = row_major_gemm(m, k, n, ta, tb);
            let mut got = c0.clone();
            // cuBLAS sees B first, then A.
            blas_sgemm(&g, &b, &a, &mut got, if acc { 1.0 } else { 0.0 });
            for (x, y) in got.iter().zip(&want) {
                assert!((x - y).abs() < 1e-5, "ta={ta} tb={tb}: {x} vs {y}");
            }
        }
    }
    use super::*;

    #[test]
    fn elementwise_covers_the_work_and_respects_limits() {
        assert_eq!(elementwise(1, 132).grid.0, 1);
        assert_eq!(elementwise(256 * 10, 132).grid.0, 10);
        let big = elementwise(1 << 40, 132);
        assert_eq!(
            big.grid.0,
            132 * 32,
            "grid-stride: capped at 32 blocks per SM"
        );
        assert_eq!(big.block, BLOCK);
    }

    #[test]
    fn row_kernels_size_blocks_to_the_row() {
        assert_eq!(per_row(4096, 4096).unwrap().block, 1024);
        assert_eq!(per_row(10, 64).unwrap().block, 64);
        assert_eq!(per_row(10, 1).unwrap().block, 32);
        assert_eq!(per_row(10, 100).unwrap().block, 128);
        assert!(per_row(usize::MAX, 8).is_err());
        assert_eq!(per_column(4097).grid.0, 257);
        assert_eq!(per_column(4097).block, 1024);
    }

    #[test]
    fn attention_tiles_fit_shared_memory_for_every_llama_head_dim() {
        for hd in [64, 80, 96, 128, 256] {
            let s = AttnShape::causal(2, 4096, 32, 8, hd);
            let l = attention(s, DEFAULT_SMEM).unwrap();
            assert!(l.rows.smem as usize <= DEFAULT_SMEM && l.kv.smem as usize <= DEFAULT_SMEM);
            assert!(l.tile >= 16, "hd {hd}: tile {}", l.tile);
            assert_eq!(l.rows.grid, (512, 32, 2));
            assert_eq!(l.kv.grid, (512, 8, 2));
            assert_eq!(l.rows.block, 256);
        }
        // Short sequences do not load tiles longer than the sequence.
        let short = attention(AttnShape::causal(1, 5, 4, 4, 64), DEFAULT_SMEM).unwrap();
        assert_eq!((short.tile, short.rows.grid.0), (5, 1));
    }

    #[test]
    fn opted_in_shared_memory_takes_whole_tiles() {
        // An H100's 227 KiB: head dim 256 gets 64-row tiles (131 KiB for dk/dv), which 48 KiB
        // cuts to 23 rows.
        let s = AttnShape::causal(1, 4096, 8, 2, 256);
        let big = attention(s, 227 << 10).unwrap();
        assert_eq!(big.tile, 64);
        assert_eq!(big.kv.smem as usize, 64 * (2 * 256 + 3) * 4);
        assert_eq!(attention(s, DEFAULT_SMEM).unwrap().tile, 23);
    }

    #[test]
    fn flash_tiles_fit_without_the_opt_in_and_cover_the_rows() {
        for hd in FLASH_HEAD_DIMS {
            let s = AttnShape::causal(2, 4096, 32, 8, hd).queries(1000, 3000);
            let l = flash(s).unwrap().unwrap();
            assert_eq!(l.hd, hd);
            for k in [l.fwd, l.dq, l.kv] {
                assert!(k.smem as usize <= DEFAULT_SMEM, "hd {hd}: {k:?}");
                assert_eq!(k.block, 128);
            }
            // 2000 queries in blocks of 64; keys 0..3000 in blocks of 64.
            assert_eq!(l.fwd.grid, (32, 32, 2));
            assert_eq!(l.dq.grid, (32, 32, 2));
            assert_eq!(l.kv.grid, (47, 8, 2));
        }
        // hd 128: K and V tiles of 64 rows of 136 halfwords.
        let l = flash(AttnShape::causal(1, 8, 1, 1, 128)).unwrap().unwrap();
        assert_eq!(l.fwd.smem, 2 * 64 * 136 * 2);
        assert_eq!(l.kv.smem, (2 * 64 + 2 * 16) * 136 * 2 + 3 * 16 * 4);
        assert_eq!(flash(AttnShape::causal(1, 8, 1, 1, 80)).unwrap(), None);
        assert!(flash(AttnShape::causal(1, 8, 3, 2, 64)).is_err());
    }

    #[test]
    fn unsupported_attention_shapes_are_named() {
        let s = AttnShape::causal(1, 8, 6, 4, 64);
        assert!(attention(s, DEFAULT_SMEM)
            .unwrap_err()
            .to_string()
            .contains("multiple"));
        let s = AttnShape {
            nh: 4,
            hd: 512,
            ..s
        };
        assert!(attention(s, DEFAULT_SMEM)
            .unwrap_err()
            .to_string()
            .contains("256"));
        let s = AttnShape {
            hd: 64,
            b: 70_000,
            ..s
        };
        assert!(attention(s, DEFAULT_SMEM).is_err());
        assert!(attention(AttnShape { b: 1, ..s }, 100).is_err());
    }

    #[test]
    fn logit_chunks_stay_in_budget() {
        assert_eq!(logit_chunk_rows(8192, 128_256, 256 << 20), 523);
        assert_eq!(logit_chunk_rows(10, 32_000, 1 << 30), 10);
        assert_eq!(logit_chunk_rows(10, 1 << 30, 16), 1);
    }

    /// Every row once, grouped by token with its rows ascending; the starts delimit the groups.
    #[test]
    fn token_groups_cover_every_row_in_order() {
        let tokens = [5u32, 2, 5, 0, 2, 5, 9];
        let g = group_tokens(&tokens, 10, None).unwrap();
        let n = tokens.len();
        assert_eq!(g.groups, 4);
        let (order, rest) = g.packed.split_at(n);
        let (starts, ids) = rest.split_at(g.groups + 1);
        assert_eq!(order, &[3, 1, 4, 0, 2, 5, 6]);
        assert_eq!(starts, &[0, 1, 3, 6, 7]);
        assert_eq!(ids, &[0, 2, 5, 9]);
        for (k, w) in starts.windows(2).enumerate() {
            for &r in &order[w[0] as usize..w[1] as usize] {
                assert_eq!(tokens[r as usize], ids[k]);
            }
        }
        assert!(group_tokens(&tokens, 9, None).is_err(), "token 9 of 9");
        assert_eq!(group_tokens(&[], 4, None).unwrap().packed, vec![0]);
        // A skipped token's rows: last in the order, in no group.
        let g = group_tokens(&[3, 1, 3, 2, 1], 4, Some(3)).unwrap();
        assert_eq!(g.groups, 2);
        assert_eq!(g.packed, vec![1, 4, 3, 0, 2, 0, 2, 3, 1, 2]);
    }

    /// The grouped expert GEMMs' grids: every row tile any split of the rows can need (⌈R/128⌉
    /// full tiles plus one partial per expert) times the column tiles, in one dimension; a
    /// launch past the grid is refused by name, not truncated.
    #[test]
    fn expert_gemm_grids_cover_any_split_of_the_rows() {
        let l = expert_gemm_rows(262_144, 128, 768).unwrap();
        assert_eq!(l.grid, ((2048 + 128) * 6, 1, 1));
        assert_eq!((l.block, l.smem), (256, 3 * 2 * 128 * 40 * 2));
        // 300 rows over 6 experts, one of them all 300: 3 + 6 row tiles, 2 column tiles.
        assert_eq!(expert_gemm_rows(300, 6, 136).unwrap().grid, (18, 1, 1));
        assert!(expert_gemm_rows(1 << 40, 8, 4096).is_err());
        let s = expert_gemm_sums(2048, 768, 128).unwrap();
        assert_eq!(s.grid, (16 * 6, 1, 128));
        assert!(expert_gemm_sums(64, 64, 70_000).is_err());
    }
}
