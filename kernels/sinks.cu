// Attention sinks (GPT-OSS), around the attention without them (src/model/ops/sinks.rs): the
// forward rescales the output and log-sum-exp, lse' = log(e^lse + e^sink), O' = O·e^(lse − lse');
// the sinks' gradient is −Σ_rows e^(sink − lse')·rowsum(dO ⊙ O'). Layouts as the attention's:
// o, dO [B·R, NH·HD] (R query rows per sequence), lse [B, NH, R], sinks [NH].
#include "common.cuh"

// One thread per (sequence, head, row); `W`: the sinks as the device holds them (fp32, or a bf16
// device's bf16 weights: `f32w16`).
#define SINKS_FWD(name, T, W)                                                                    \
    extern "C" __global__ void attn_sinks_fwd_##name(float* __restrict__ o,                     \
                                                     float* __restrict__ lse,                   \
                                                     const W* __restrict__ sinks, int nb,       \
                                                     int rows, int nh, int hd) {                \
        FOR_EACH(i, (long long)nb * nh * rows) {                                                \
            const long long r = i % rows, bh = i / rows, h = bh % nh, b = bh / nh;              \
            const float l = lse[i], sink = ld(sinks[h]);                                        \
            const float m = fmaxf(l, sink);                                                     \
            const float l2 = __fadd_rn(m, logf(__fadd_rn(expf(l - m), expf(sink - m))));       \
            const float factor = expf(l - l2);                                                  \
            lse[i] = l2;                                                                        \
            float* row = o + ((b * rows + r) * nh + h) * (long long)hd;                         \
            for (int d = 0; d < hd; d++) row[d] = __fmul_rn(row[d], factor);                    \
        }                                                                                       \
    }

SINKS_FWD(f32, float, float)
SINKS_FWD(f32w16, float, bf16)

// One thread per head, its rows in order (the CPU's order). `D`: dO as stored (bf16 under the
// bf16 recipe), `W`: the sinks as held; `f32i16` takes both in bf16.
#define SINKS_BWD(name, D, W)                                                                    \
    extern "C" __global__ void attn_sinks_bwd_##name(float* __restrict__ dsinks,                \
                                                     const D* __restrict__ d_o,                 \
                                                     const float* __restrict__ o,               \
                                                     const float* __restrict__ lse,             \
                                                     const W* __restrict__ sinks, int nb,       \
                                                     int rows, int nh, int hd) {                \
        FOR_EACH(h, nh) {                                                                       \
            float acc = 0.0f;                                                                   \
            for (int b = 0; b < nb; b++)                                                        \
                for (int r = 0; r < rows; r++) {                                                \
                    const long long at = ((b * (long long)rows + r) * nh + h) * hd;             \
                    float delta = 0.0f;                                                         \
                    for (int d = 0; d < hd; d++)                                                \
                        delta = __fadd_rn(delta, __fmul_rn(ld(d_o[at + d]), o[at + d]));        \
                    const float p = expf(ld(sinks[h]) - lse[(b * (long long)nh + h) * rows + r]); \
                    acc = __fadd_rn(acc, __fmul_rn(p, delta));                                  \
                }                                                                               \
            dsinks[h] = __fsub_rn(dsinks[h], acc);                                              \
        }                                                                                       \
    }

SINKS_BWD(f32, float, float)
SINKS_BWD(f32i16, bf16, bf16)
