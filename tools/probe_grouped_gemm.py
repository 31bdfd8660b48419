#!/usr/bin/env python3
"""Which cuBLAS grouped GEMMs this GPU's cuBLAS runs, and what they buy a mixture-of-experts
layer over one cublasGemmEx per expert.

    python3 tools/probe_grouped_gemm.py [OUT.json]

Needs a GPU and PyTorch (for memory, random inputs and fp64 references; every GEMM timed is a
direct cuBLAS call through ctypes on a handle of our own, as megatrain makes them). The shapes
are one MoE layer as wide as Qwen3-30B-A3B's: 128 experts, hidden 2048, expert width 768,
8 x 4096 tokens routed top-8 (262,144 grouped rows spread unevenly over the experts). For each
of the layer's three GEMM kinds (forward x.W^T, backward data dG.W, backward weight dG^T.X
accumulated) and each way to make it:

    loop      one cublasGemmEx / cublasSgemm per expert (megatrain today)
    grouped   one cublasGemmGroupedBatchedEx over every expert
    dense     one GEMM of the same FLOPs (all rows against one expert's weight): the ceiling

it prints the status cuBLAS returned (a combination it does not support says
NOT_SUPPORTED), the error against an fp64 reference (norm-wise), and the median time of 10
runs with CUDA events. Figures printed are measured on the GPU it runs on and nothing else.
"""
import ctypes
import json
import statistics
import sys

import torch

E, C, I, TOKENS, TOP_K = 128, 2048, 768, 8 * 4096, 8
R_F32, R_16F, R_16BF = 0, 2, 14  # cudaDataType_t
COMPUTE_32F, COMPUTE_32F_FAST_TF32 = 68, 77  # cublasComputeType_t
OP_N, OP_T = 0, 1
STATUS = {0: "SUCCESS", 1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE",
          8: "ARCH_MISMATCH", 11: "MAPPING_ERROR", 13: "EXECUTION_FAILED",
          14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED", 16: "LICENSE_ERROR"}
DTYPE = {R_F32: torch.float32, R_16BF: torch.bfloat16}


def cublas():
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")  # loads cuBLAS
    torch.cuda.synchronize()
    with open("/proc/self/maps") as maps:
        paths = {l.split()[-1] for l in maps if "libcublas.so" in l and "libcublasLt" not in l}
    if not paths:
        sys.exit("error: PyTorch loaded no libcublas.so (see /proc/self/maps)")
    lib = ctypes.CDLL(sorted(paths)[0])
    handle = ctypes.c_void_p()
    check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    check(lib.cublasSetStream_v2(handle, stream), "cublasSetStream")
    version = ctypes.c_int()
    check(lib.cublasGetVersion_v2(handle, ctypes.byref(version)), "cublasGetVersion")
    return lib, handle, sorted(paths)[0], version.value


def check(status, what):
    if status != 0:
        sys.exit(f"error: {what}: {STATUS.get(status, status)}")


def ints(values):
    return (ctypes.c_int * len(values))(*values)


def per_expert(counts, call):
    """One column-major GEMM per expert with rows: `call(e, lo, m)` gives its arguments."""
    calls, lo = [], 0
    for e, m in enumerate(counts):
        if m:
            calls.append(call(e, lo, m))
        lo += m
    return calls


def forward(counts, dtype):
    """Y_e[m_e, I] = X_e[m_e, C] . W_e[I, C]^T: column-major Y^T[I, m_e] = W_e^T' . X_e^T."""
    rows = int(sum(counts))
    x = torch.randn(rows, C, device="cuda").to(dtype)
    w = (torch.randn(E, I, C, device="cuda") / C ** 0.5).to(dtype)
    y = torch.full((rows, I), float("nan"), device="cuda")
    calls = per_expert(counts, lambda e, lo, m: dict(
        ta=OP_T, tb=OP_N, m=I, n=m, k=C, a=w[e], lda=C, b=x[lo:lo + m], ldb=C, c=y[lo:lo + m], ldc=I, beta=0.0))
    return calls, (x, w[0], (rows, C, I))


def backward_data(counts, dtype):
    """dX_e[m_e, C] = dG_e[m_e, I] . W_e[I, C]: column-major dX^T[C, m_e] = W_e^T . dG_e^T."""
    rows = int(sum(counts))
    dg = torch.randn(rows, I, device="cuda").to(dtype)
    w = (torch.randn(E, I, C, device="cuda") / I ** 0.5).to(dtype)
    dx = torch.full((rows, C), float("nan"), device="cuda")
    calls = per_expert(counts, lambda e, lo, m: dict(
        ta=OP_N, tb=OP_N, m=C, n=m, k=I, a=w[e], lda=C, b=dg[lo:lo + m], ldb=I, c=dx[lo:lo + m], ldc=C, beta=0.0))
    return calls, (dg, w[0], (rows, I, C))


def backward_weight(counts, dtype):
    """gW_e[I, C] += dG_e[m_e, I]^T . X_e[m_e, C]: column-major gW^T[C, I] += X_e^T . dG_e."""
    rows = int(sum(counts))
    x = torch.randn(rows, C, device="cuda").to(dtype)
    dg = (torch.randn(rows, I, device="cuda") / 64).to(dtype)
    gw = torch.randn(E, I, C, device="cuda")
    calls = per_expert(counts, lambda e, lo, m: dict(
        ta=OP_N, tb=OP_T, m=C, n=I, k=m, a=x[lo:lo + m], lda=C, b=dg[lo:lo + m], ldb=I, c=gw[e], ldc=C, beta=1.0))
    return calls, (x, dg, (I, rows, C))


def col_major_ref(call):
    """op(A') . op(B') + beta . C' in fp64, as the row-major tensor C'^T."""
    def op(t, trans, rows, cols, ld):
        # t holds a column-major [ld, *] matrix: the row-major view is its transpose.
        flat = t.double().reshape(-1)
        cm_cols = cols if not trans else rows
        cm_rows = rows if not trans else cols
        mat_t = flat[: ld * (cm_cols - 1) + cm_rows].as_strided((cm_cols, cm_rows), (ld, 1))
        cm = mat_t.T  # column-major matrix [cm_rows, cm_cols]
        return cm.T if trans else cm
    m, n, k = call["m"], call["n"], call["k"]
    a = op(call["a"], call["ta"] == OP_T, m, k, call["lda"])
    b = op(call["b"], call["tb"] == OP_T, k, n, call["ldb"])
    return (a @ b).T  # [n, m] row-major == C' column-major [m, n]


def run_loop(lib, h, calls, ab_type, c_type, compute):
    alpha = ctypes.c_float(1.0)
    for cl in calls:
        beta = ctypes.c_float(cl["beta"])
        st = lib.cublasGemmEx(h, cl["ta"], cl["tb"], cl["m"], cl["n"], cl["k"], ctypes.byref(alpha),
                              ctypes.c_void_p(cl["a"].data_ptr()), ab_type, cl["lda"],
                              ctypes.c_void_p(cl["b"].data_ptr()), ab_type, cl["ldb"], ctypes.byref(beta),
                              ctypes.c_void_p(cl["c"].data_ptr()), c_type, cl["ldc"], compute, -1)
        if st:
            return st
    return 0


def grouped_args(calls):
    g = len(calls)
    ptr = lambda key: torch.tensor([cl[key].data_ptr() for cl in calls], dtype=torch.int64, device="cuda")
    return dict(
        ta=ints([cl["ta"] for cl in calls]), tb=ints([cl["tb"] for cl in calls]),
        m=ints([cl["m"] for cl in calls]), n=ints([cl["n"] for cl in calls]), k=ints([cl["k"] for cl in calls]),
        lda=ints([cl["lda"] for cl in calls]), ldb=ints([cl["ldb"] for cl in calls]), ldc=ints([cl["ldc"] for cl in calls]),
        alpha=(ctypes.c_float * g)(*[1.0] * g), beta=(ctypes.c_float * g)(*[cl["beta"] for cl in calls]),
        A=ptr("a"), B=ptr("b"), C=ptr("c"), size=ints([1] * g), g=g)


def run_grouped(lib, h, ga, ab_type, c_type, compute):
    return lib.cublasGemmGroupedBatchedEx(
        h, ga["ta"], ga["tb"], ga["m"], ga["n"], ga["k"], ga["alpha"],
        ctypes.c_void_p(ga["A"].data_ptr()), ab_type, ga["lda"],
        ctypes.c_void_p(ga["B"].data_ptr()), ab_type, ga["ldb"], ga["beta"],
        ctypes.c_void_p(ga["C"].data_ptr()), c_type, ga["ldc"], ga["g"], ga["size"], compute)


def timed(fn, reps=10, warm=3):
    for _ in range(warm):
        st = fn()
        if st:
            return st, None
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        st = fn()
        e.record()
        e.synchronize()
        if st:
            return st, None
        times.append(s.elapsed_time(e))
    return 0, statistics.median(times)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else None
    torch.manual_seed(0)
    lib, h, path, version = cublas()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}; cuBLAS {version} ({path}); grouped entry point: "
          f"{'present' if hasattr(lib, 'cublasGemmGroupedBatchedEx') else 'ABSENT'}")
    probs = torch.softmax(torch.randn(E) * 0.7, 0)
    counts = torch.multinomial(probs, TOKENS * TOP_K, replacement=True).bincount(minlength=E).tolist()
    print(f"{E} experts, {TOKENS} tokens top-{TOP_K}: rows per expert min {min(counts)}, "
          f"median {int(statistics.median(counts))}, max {max(counts)}")
    variants = [  # name, A/B type, C type, compute
        ("bf16->f32", R_16BF, R_F32, COMPUTE_32F),
        ("bf16->bf16", R_16BF, R_16BF, COMPUTE_32F),
        ("f32", R_F32, R_F32, COMPUTE_32F),
    ]
    rows, results = [], []
    for kind, gen in (("fwd x.W^T", forward), ("bwd dG.W", backward_data), ("bwd dW+=dG^T.X", backward_weight)):
        for vname, ab, ct, comp in variants:
            calls, (da, db, (dm, dk, dn)) = gen(counts, DTYPE[ab])
            if ct == R_16BF:
                for cl in calls:
                    cl["c"] = cl["c"].to(torch.bfloat16)
            flops = 2.0 * sum(cl["m"] * cl["n"] * cl["k"] for cl in calls)
            init = [cl["c"].clone() for cl in calls]
            refs = []
            for cl in calls:
                r = col_major_ref(cl)
                # beta = 0: C is not read (it holds NaN, to show an unwritten output).
                refs.append(r + cl["beta"] * cl["c"].double().reshape(r.shape) if cl["beta"] else r)
            rec = dict(kind=kind, dtype=vname)
            for way in ("loop", "grouped"):
                for cl, c0 in zip(calls, init):
                    cl["c"].copy_(c0)
                if way == "loop":
                    st = run_loop(lib, h, calls, ab, ct, comp)
                else:
                    ga = grouped_args(calls)
                    st = run_grouped(lib, h, ga, ab, ct, comp)
                torch.cuda.synchronize()
                err = None
                if st == 0:
                    num = sum(float(((cl["c"].double().reshape(r.shape) - r) ** 2).sum()) for cl, r in zip(calls, refs))
                    den = sum(float((r ** 2).sum()) for r in refs)
                    err = (num / den) ** 0.5
                    if way == "loop":
                        st, ms = timed(lambda: run_loop(lib, h, calls, ab, ct, comp))
                    else:
                        st, ms = timed(lambda: run_grouped(lib, h, ga, ab, ct, comp))
                else:
                    ms = None
                rec[way] = dict(status=STATUS.get(st, st), err=err, ms=ms,
                                tflops=(flops / ms / 1e9) if ms else None)
                for cl, c0 in zip(calls, init):
                    cl["c"].copy_(c0)
            # The ceiling: one GEMM of the same FLOPs (every row against one weight).
            a = torch.randn(dm, dk, device="cuda").to(DTYPE[ab])
            b = torch.randn(dk, dn, device="cuda").to(DTYPE[ab])
            st, ms = timed(lambda: (a @ b, 0)[1])
            rec["dense"] = dict(ms=ms, tflops=2.0 * dm * dk * dn / ms / 1e9)
            results.append(rec)
            f = lambda r: (f"{r['ms']:.3f} ms {r['tflops']:.0f} TF/s err {r['err']:.1e}"
                           if r.get("ms") else r["status"])
            rows.append(f"| {kind} | {vname} | {f(rec['loop'])} | {f(rec['grouped'])} | "
                        f"{rec['dense']['ms']:.3f} ms {rec['dense']['tflops']:.0f} TF/s |")
            del calls, init, refs
            torch.cuda.empty_cache()
    print("| GEMM | dtype | loop (one per expert) | grouped (one call) | dense, same FLOPs (torch) |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    if out:
        with open(out, "w") as fh:
            json.dump(dict(gpu=gpu, cublas=version, counts=counts, results=results), fh, indent=1)


if __name__ == "__main__":
    main()
