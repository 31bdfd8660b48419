//! The cuBLAS stand-in (`libcublas.so.12`): handles (stream, math mode, pointer mode,
//! workspace) and the GEMMs — `Sgemm`, `GemmEx`, and their strided-batched forms — column-major
//! as cuBLAS, with fp32 or bf16 inputs and fp32 accumulation. Arguments are validated as the
//! cuBLAS documentation says (`lda < max(1, rows of op(A))` is `CUBLAS_STATUS_INVALID_VALUE`, …),
//! each matrix's extent is checked against its allocation (a GPU would fault later, somewhere),
//! and the GEMM runs on the handle's stream like any other command. In TF32 math mode the
//! inputs of fp32 GEMMs are rounded to TF32 first, as the tensor cores do.

use crate::api::{self, blas, cu, Lib, Sticky};
use crate::memory::mem;
use crate::report;
use crate::stream::{Cmd, Stream, Touch, Work};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_longlong, c_void};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

type Handle = *mut c_void;

#[derive(Debug, Clone, Copy)]
struct HandleState {
    stream: usize,
    math: c_int,
    device_pointers: bool,
}

fn handles() -> MutexGuard<'static, HashMap<usize, HandleState>> {
    static H: OnceLock<Mutex<HashMap<usize, HandleState>>> = OnceLock::new();
    H.get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

fn handle(h: Handle) -> Result<HandleState, i32> {
    handles()
        .get(&(h as usize))
        .copied()
        .ok_or(blas::NOT_INITIALIZED)
}

fn blas_call(name: &str, f: impl FnOnce() -> Result<(), i32>) -> c_int {
    api::call(name, Lib::Cublas, Sticky::Fail, f)
}

#[no_mangle]
pub unsafe extern "C" fn cublasCreate_v2(h: *mut Handle) -> c_int {
    blas_call("cublasCreate_v2", || {
        if h.is_null() {
            return Err(blas::INVALID_VALUE);
        }
        static NEXT: Mutex<usize> = Mutex::new(0xb1a5_0000);
        let id = {
            let mut g = NEXT.lock().unwrap_or_else(|e| e.into_inner());
            *g += 16;
            *g
        };
        handles().insert(
            id,
            HandleState {
                stream: 0,
                math: 0,
                device_pointers: false,
            },
        );
        // SAFETY: writable pointer (checked).
        unsafe { h.write(id as Handle) };
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cublasDestroy_v2(h: Handle) -> c_int {
    // Releasing a handle works on a failed context too.
    api::call("cublasDestroy_v2", Lib::Cublas, Sticky::Ignore, || {
        handles()
            .remove(&(h as usize))
            .map(|_| ())
            .ok_or(blas::NOT_INITIALIZED)
    })
}

fn update(h: Handle, f: impl FnOnce(&mut HandleState)) -> Result<(), i32> {
    let mut g = handles();
    let s = g.get_mut(&(h as usize)).ok_or(blas::NOT_INITIALIZED)?;
    f(s);
    Ok(())
}

#[no_mangle]
pub extern "C" fn cublasSetStream_v2(h: Handle, stream: *mut c_void) -> c_int {
    blas_call("cublasSetStream_v2", || {
        Stream::get(stream as usize).map_err(|_| blas::INVALID_VALUE)?;
        update(h, |s| s.stream = stream as usize)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetStream_v2(h: Handle, stream: *mut *mut c_void) -> c_int {
    blas_call("cublasGetStream_v2", || {
        let s = handle(h)?;
        if stream.is_null() {
            return Err(blas::INVALID_VALUE);
        }
        // SAFETY: writable pointer (checked).
        unsafe { stream.write(s.stream as *mut c_void) };
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cublasSetMathMode(h: Handle, mode: c_int) -> c_int {
    blas_call("cublasSetMathMode", || {
        if !matches!(mode & !16, 0..=3) {
            return Err(blas::INVALID_VALUE);
        }
        update(h, |s| s.math = mode)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetMathMode(h: Handle, mode: *mut c_int) -> c_int {
    blas_call("cublasGetMathMode", || {
        let s = handle(h)?;
        if mode.is_null() {
            return Err(blas::INVALID_VALUE);
        }
        // SAFETY: writable (checked).
        unsafe { mode.write(s.math) };
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cublasSetPointerMode_v2(h: Handle, mode: c_int) -> c_int {
    blas_call("cublasSetPointerMode_v2", || {
        if !(0..=1).contains(&mode) {
            return Err(blas::INVALID_VALUE);
        }
        update(h, |s| s.device_pointers = mode == 1)
    })
}

#[no_mangle]
pub extern "C" fn cublasSetWorkspace_v2(h: Handle, ws: *mut c_void, bytes: usize) -> c_int {
    blas_call("cublasSetWorkspace_v2", || {
        handle(h)?;
        // cuBLAS reads and writes the workspace on the handle's stream: it must be device
        // memory of at least `bytes`, aligned to 256 bytes (cuBLAS' documented requirement).
        if bytes > 0 {
            if ws.is_null() || !(ws as usize).is_multiple_of(256) {
                report::error(
                    "invalid cuBLAS argument",
                    &format!("cublasSetWorkspace_v2: workspace {ws:?} is not 256-byte aligned"),
                );
                return Err(blas::INVALID_VALUE);
            }
            if let Err(why) = mem().range(ws as u64, bytes) {
                report::error(
                    "invalid cuBLAS argument",
                    &format!(
                        "cublasSetWorkspace_v2: a workspace of {bytes} bytes at {ws:?}: {why}"
                    ),
                );
                return Err(blas::INVALID_VALUE);
            }
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetVersion_v2(h: Handle, v: *mut c_int) -> c_int {
    blas_call("cublasGetVersion_v2", || {
        handle(h)?;
        if v.is_null() {
            return Err(blas::INVALID_VALUE);
        }
        let (major, minor, patch) = version();
        // SAFETY: writable (checked).
        unsafe { v.write(major * 10_000 + minor * 100 + patch) };
        Ok(())
    })
}

/// The cuBLAS release presented: 12.9.1 (CUDA 12.9's) or 13.1.0 (CUDA 13.0's).
fn version() -> (c_int, c_int, c_int) {
    if crate::config::get().cuda == 13 {
        (13, 1, 0)
    } else {
        (12, 9, 1)
    }
}

/// `cublasGetProperty(MAJOR_VERSION | MINOR_VERSION | PATCH_LEVEL, &v)`: no handle needed.
#[no_mangle]
pub unsafe extern "C" fn cublasGetProperty(kind: c_int, v: *mut c_int) -> c_int {
    blas_call("cublasGetProperty", || {
        if v.is_null() {
            return Err(blas::INVALID_VALUE);
        }
        let (major, minor, patch) = version();
        let x = match kind {
            0 => major,
            1 => minor,
            2 => patch,
            _ => return Err(blas::INVALID_VALUE),
        };
        // SAFETY: writable (checked).
        unsafe { v.write(x) };
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cublasGetStatusString(status: c_int) -> *const c_char {
    match status {
        0 => c"the operation completed successfully".as_ptr(),
        1 => c"the library was not initialized".as_ptr(),
        3 => c"the resource allocation failed".as_ptr(),
        7 => c"an invalid numeric value was used as an argument".as_ptr(),
        8 => c"an absent device architectural feature is required".as_ptr(),
        13 => c"the GPU program failed to execute".as_ptr(),
        15 => c"the functionality requested is not supported".as_ptr(),
        _ => c"an internal operation failed".as_ptr(),
    }
}

#[no_mangle]
pub extern "C" fn cublasGetStatusName(status: c_int) -> *const c_char {
    match status {
        0 => c"CUBLAS_STATUS_SUCCESS".as_ptr(),
        1 => c"CUBLAS_STATUS_NOT_INITIALIZED".as_ptr(),
        3 => c"CUBLAS_STATUS_ALLOC_FAILED".as_ptr(),
        7 => c"CUBLAS_STATUS_INVALID_VALUE".as_ptr(),
        8 => c"CUBLAS_STATUS_ARCH_MISMATCH".as_ptr(),
        13 => c"CUBLAS_STATUS_EXECUTION_FAILED".as_ptr(),
        15 => c"CUBLAS_STATUS_NOT_SUPPORTED".as_ptr(),
        _ => c"CUBLAS_STATUS_INTERNAL_ERROR".as_ptr(),
    }
}

// ---- GEMM ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ty {
    F32,
    Bf16,
}

impl Ty {
    fn of(cuda_data_type: c_int) -> Option<Ty> {
        match cuda_data_type {
            0 => Some(Ty::F32),
            14 => Some(Ty::Bf16),
            _ => None,
        }
    }

    fn bytes(self) -> usize {
        match self {
            Ty::F32 => 4,
            Ty::Bf16 => 2,
        }
    }

    /// # Safety
    /// `p` points to an element of this type.
    unsafe fn load(self, p: *const u8) -> f32 {
        // SAFETY: the caller's contract.
        unsafe {
            match self {
                Ty::F32 => p.cast::<f32>().read_unaligned(),
                Ty::Bf16 => f32::from_bits(u32::from(p.cast::<u16>().read_unaligned()) << 16),
            }
        }
    }

    /// # Safety
    /// `p` points to writable storage of this type.
    unsafe fn store(self, p: *mut u8, v: f32) {
        // SAFETY: the caller's contract.
        unsafe {
            match self {
                Ty::F32 => p.cast::<f32>().write_unaligned(v),
                Ty::Bf16 => p.cast::<u16>().write_unaligned(bf16_rne(v)),
            }
        }
    }
}

fn bf16_rne(v: f32) -> u16 {
    let b = v.to_bits();
    if v.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// Round an fp32 value to TF32 (10 mantissa bits) to nearest, ties away from zero — PTX's
/// `cvt.rna.tf32.f32`, what CUTLASS-style kernels apply before the tensor cores.
fn tf32(v: f32) -> f32 {
    if !v.is_finite() {
        return v;
    }
    f32::from_bits((v.to_bits() + 0x1000) & !0x1fff)
}

/// Σ a·b with a fused multiply-add per term, in order — what one GPU thread of an SGEMM does.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has FMA (checked).
            return unsafe { dot_fma(a, b) };
        }
    }
    a.iter().zip(b).fold(0f32, |acc, (x, y)| x.mul_add(*y, acc))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn dot_fma(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |acc, (x, y)| x.mul_add(*y, acc))
}

/// One (possibly batched) GEMM, ready to run on its stream.
struct Gemm {
    name: &'static str,
    transa: bool,
    transb: bool,
    m: usize,
    n: usize,
    k: usize,
    alpha: Scalar,
    beta: Scalar,
    a: u64,
    b: u64,
    c: u64,
    lda: usize,
    ldb: usize,
    ldc: usize,
    stride: (i64, i64, i64),
    batch: usize,
    types: (Ty, Ty, Ty),
    tf32: bool,
}

/// alpha/beta: a host value read at the call, or a device pointer read when the GEMM runs.
#[derive(Clone, Copy)]
enum Scalar {
    Value(f32),
    Device(u64),
}

impl Scalar {
    fn get(self) -> f32 {
        match self {
            Scalar::Value(v) => v,
            // SAFETY: a device float the program passed in device pointer mode; checked at call.
            Scalar::Device(p) => unsafe { (p as *const f32).read_unaligned() },
        }
    }
}

impl Work for Gemm {
    fn run(self: Box<Self>, _stream: &Stream) {
        let (ta, tb, tc) = self.types;
        let (alpha, beta) = (self.alpha.get(), self.beta.get());
        let (m, n, k) = (self.m, self.n, self.k);
        let round = |v: f32| if self.tf32 { tf32(v) } else { v };
        let mut arow = vec![0f32; m * k]; // op(A), row-major m × k
        let mut bcol = vec![0f32; k * n]; // op(B), column-major k × n
        for batch in 0..self.batch {
            let a = (self.a as i64 + batch as i64 * self.stride.0 * ta.bytes() as i64) as usize;
            let b = (self.b as i64 + batch as i64 * self.stride.1 * tb.bytes() as i64) as usize;
            let c = (self.c as i64 + batch as i64 * self.stride.2 * tc.bytes() as i64) as usize;
            for i in 0..m {
                for p in 0..k {
                    let idx = if self.transa {
                        p + i * self.lda
                    } else {
                        i + p * self.lda
                    };
                    // SAFETY: the extent was checked against A's allocation at the call.
                    arow[i * k + p] =
                        round(unsafe { ta.load((a + idx * ta.bytes()) as *const u8) });
                }
            }
            for j in 0..n {
                for p in 0..k {
                    let idx = if self.transb {
                        j + p * self.ldb
                    } else {
                        p + j * self.ldb
                    };
                    // SAFETY: as above, for B.
                    bcol[j * k + p] =
                        round(unsafe { tb.load((b + idx * tb.bytes()) as *const u8) });
                }
            }
            for j in 0..n {
                for i in 0..m {
                    let acc = dot(&arow[i * k..(i + 1) * k], &bcol[j * k..(j + 1) * k]);
                    let at = (c + (i + j * self.ldc) * tc.bytes()) as *mut u8;
                    let prior = if beta == 0.0 {
                        0.0
                    } else {
                        // SAFETY: as above, for C.
                        beta * unsafe { tc.load(at) }
                    };
                    // SAFETY: as above, for C.
                    unsafe { tc.store(at, alpha * acc + prior) };
                }
            }
        }
        let _ = self.name;
    }
}

/// The byte extent of an `rows × cols` column-major matrix with leading dimension `ld`, over
/// `batch` matrices `stride` elements apart.
fn extent(
    rows: usize,
    cols: usize,
    ld: usize,
    stride: i64,
    batch: usize,
    bytes: usize,
) -> (i64, i64) {
    if rows == 0 || cols == 0 || batch == 0 {
        return (0, 0);
    }
    let last = (rows - 1 + (cols - 1) * ld) as i64;
    let (lo, hi) = if stride >= 0 {
        (0, stride * (batch as i64 - 1) + last)
    } else {
        (stride * (batch as i64 - 1), last)
    };
    (lo * bytes as i64, (hi + 1) * bytes as i64)
}

#[allow(clippy::too_many_arguments)]
unsafe fn gemm(
    name: &'static str,
    h: Handle,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    lda: c_int,
    b: *const c_void,
    ldb: c_int,
    beta: *const c_void,
    c: *mut c_void,
    ldc: c_int,
    stride: (c_longlong, c_longlong, c_longlong),
    batch: c_int,
    types: (Ty, Ty, Ty),
) -> Result<(), i32> {
    let state = handle(h)?;
    let invalid = |why: String| {
        report::error(
            "invalid cuBLAS argument",
            &format!(
                "{name}: {why}: CUBLAS_STATUS_INVALID_VALUE, as the cuBLAS documentation specifies"
            ),
        );
        blas::INVALID_VALUE
    };
    if !(0..=2).contains(&transa) || !(0..=2).contains(&transb) {
        return Err(invalid(format!(
            "transa {transa} / transb {transb} is not N, T or C"
        )));
    }
    if m < 0 || n < 0 || k < 0 || batch < 0 {
        return Err(invalid(format!(
            "m = {m}, n = {n}, k = {k}, batchCount = {batch}: negative"
        )));
    }
    let (ta, tb) = (transa != 0, transb != 0);
    let (m, n, k) = (m as usize, n as usize, k as usize);
    let a_rows = if ta { k } else { m };
    let b_rows = if tb { n } else { k };
    if (lda as i64) < a_rows.max(1) as i64 {
        return Err(invalid(format!(
            "lda = {lda} < max(1, {a_rows}) (the rows of A with transa = {})",
            if ta { "T" } else { "N" }
        )));
    }
    if (ldb as i64) < b_rows.max(1) as i64 {
        return Err(invalid(format!(
            "ldb = {ldb} < max(1, {b_rows}) (the rows of B with transb = {})",
            if tb { "T" } else { "N" }
        )));
    }
    if (ldc as i64) < m.max(1) as i64 {
        return Err(invalid(format!("ldc = {ldc} < max(1, m = {m})")));
    }
    if alpha.is_null() || beta.is_null() {
        return Err(invalid("alpha or beta is null".into()));
    }
    if m == 0 || n == 0 || batch == 0 {
        return Ok(());
    }
    let stream = Stream::get(state.stream).map_err(|_| blas::INVALID_VALUE)?;
    let scalar = |p: *const c_void| {
        if state.device_pointers {
            Scalar::Device(p as u64)
        } else {
            // SAFETY: host pointer mode: a float the caller passed.
            Scalar::Value(unsafe { p.cast::<f32>().read_unaligned() })
        }
    };
    let (alpha_s, beta_s) = (scalar(alpha), scalar(beta));
    let what: Arc<str> = Arc::from(format!(
        "{name} (m {m}, n {n}, k {k}, trans {}{}{})",
        if ta { "T" } else { "N" },
        if tb { "T" } else { "N" },
        if batch > 1 {
            format!(", batch {batch}")
        } else {
            String::new()
        }
    ));
    let (a_cols, b_cols) = (if ta { m } else { k }, if tb { k } else { n });
    let mut touches = Vec::new();
    {
        let mm = mem();
        let mut check =
            |which: &str, p: u64, rows, cols, ld: c_int, stride: i64, ty: Ty, write: bool| {
                if rows == 0 || cols == 0 {
                    return Ok(());
                }
                let (lo, hi) = extent(rows, cols, ld as usize, stride, batch as usize, ty.bytes());
                let start = (p as i64 + lo) as u64;
                match mm.range(start, (hi - lo) as usize) {
                    Ok(alloc) => {
                        if let Some(t) = touches
                            .iter_mut()
                            .find(|t: &&mut Touch| t.base == alloc.base)
                        {
                            t.write |= write;
                        } else {
                            touches.push(Touch {
                                base: alloc.base,
                                write,
                            });
                        }
                        Ok(())
                    }
                    Err(why) => Err(format!("{which} ({rows} × {cols}, ld {ld}): {why}")),
                }
            };
        let r = check("A", a as u64, a_rows, a_cols, lda, stride.0, types.0, false)
            .and_then(|()| check("B", b as u64, b_rows, b_cols, ldb, stride.1, types.1, false))
            .and_then(|()| check("C", c as u64, m, n, ldc, stride.2, types.2, true));
        if let Err(why) = r {
            drop(mm);
            report::error(
                "out-of-bounds GEMM",
                &format!("{what} on {}: {why}", stream.name),
            );
            api::set_sticky(cu::ILLEGAL_ADDRESS);
            return Err(blas::EXECUTION_FAILED);
        }
    }
    let g = Gemm {
        name,
        transa: ta,
        transb: tb,
        m,
        n,
        k,
        alpha: alpha_s,
        beta: beta_s,
        a: a as u64,
        b: b as u64,
        c: c as u64,
        lda: lda as usize,
        ldb: ldb as usize,
        ldc: ldc as usize,
        stride,
        batch: batch as usize,
        types,
        tf32: state.math & !16 == 3 && types.0 == Ty::F32,
    };
    stream
        .enqueue(Cmd::Work(Box::new(g)), what, &touches, &[])
        .map(|_| ())
        .map_err(|_| blas::EXECUTION_FAILED)
}

#[no_mangle]
pub unsafe extern "C" fn cublasSgemm_v2(
    h: Handle,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f32,
    a: *const f32,
    lda: c_int,
    b: *const f32,
    ldb: c_int,
    beta: *const f32,
    c: *mut f32,
    ldc: c_int,
) -> c_int {
    blas_call("cublasSgemm_v2", || {
        // SAFETY: the caller's arguments, validated inside.
        unsafe {
            gemm(
                "cublasSgemm_v2",
                h,
                transa,
                transb,
                m,
                n,
                k,
                alpha.cast(),
                a.cast(),
                lda,
                b.cast(),
                ldb,
                beta.cast(),
                c.cast(),
                ldc,
                (0, 0, 0),
                1,
                (Ty::F32, Ty::F32, Ty::F32),
            )
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cublasSgemmStridedBatched(
    h: Handle,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f32,
    a: *const f32,
    lda: c_int,
    sa: c_longlong,
    b: *const f32,
    ldb: c_int,
    sb: c_longlong,
    beta: *const f32,
    c: *mut f32,
    ldc: c_int,
    sc: c_longlong,
    batch: c_int,
) -> c_int {
    blas_call("cublasSgemmStridedBatched", || {
        // SAFETY: the caller's arguments, validated inside.
        unsafe {
            gemm(
                "cublasSgemmStridedBatched",
                h,
                transa,
                transb,
                m,
                n,
                k,
                alpha.cast(),
                a.cast(),
                lda,
                b.cast(),
                ldb,
                beta.cast(),
                c.cast(),
                ldc,
                (sa, sb, sc),
                batch,
                (Ty::F32, Ty::F32, Ty::F32),
            )
        }
    })
}

/// The types of a `GemmEx`: fp32 or bf16 inputs, fp32 or bf16 output, fp32 compute.
fn ex_types(
    at: c_int,
    bt: c_int,
    ct: c_int,
    compute: c_int,
    name: &str,
) -> Result<(Ty, Ty, Ty), i32> {
    let (Some(a), Some(b), Some(c)) = (Ty::of(at), Ty::of(bt), Ty::of(ct)) else {
        report::once(
            &format!("gemmex-{at}-{bt}-{ct}"),
            &format!("unsupported: {name} with data types {at}/{bt}/{ct} (only CUDA_R_32F and CUDA_R_16BF are emulated)"),
        );
        return Err(blas::NOT_SUPPORTED);
    };
    // 32F, 32F_PEDANTIC, 32F_FAST_16BF, 32F_FAST_TF32.
    if !matches!(compute, 68 | 69 | 75 | 77) || a != b {
        report::once(
            &format!("gemmex-compute-{compute}"),
            &format!("unsupported: {name} with compute type {compute} or mixed input types"),
        );
        return Err(blas::NOT_SUPPORTED);
    }
    Ok((a, b, c))
}

#[no_mangle]
pub unsafe extern "C" fn cublasGemmEx(
    h: Handle,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    at: c_int,
    lda: c_int,
    b: *const c_void,
    bt: c_int,
    ldb: c_int,
    beta: *const c_void,
    c: *mut c_void,
    ct: c_int,
    ldc: c_int,
    compute: c_int,
    _algo: c_int,
) -> c_int {
    blas_call("cublasGemmEx", || {
        let types = ex_types(at, bt, ct, compute, "cublasGemmEx")?;
        // SAFETY: the caller's arguments, validated inside.
        unsafe {
            gemm(
                "cublasGemmEx",
                h,
                transa,
                transb,
                m,
                n,
                k,
                alpha,
                a,
                lda,
                b,
                ldb,
                beta,
                c,
                ldc,
                (0, 0, 0),
                1,
                types,
            )
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cublasGemmStridedBatchedEx(
    h: Handle,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    at: c_int,
    lda: c_int,
    sa: c_longlong,
    b: *const c_void,
    bt: c_int,
    ldb: c_int,
    sb: c_longlong,
    beta: *const c_void,
    c: *mut c_void,
    ct: c_int,
    ldc: c_int,
    sc: c_longlong,
    batch: c_int,
    compute: c_int,
    _algo: c_int,
) -> c_int {
    blas_call("cublasGemmStridedBatchedEx", || {
        let types = ex_types(at, bt, ct, compute, "cublasGemmStridedBatchedEx")?;
        // SAFETY: the caller's arguments, validated inside.
        unsafe {
            gemm(
                "cublasGemmStridedBatchedEx",
                h,
                transa,
                transb,
                m,
                n,
                k,
                alpha,
                a,
                lda,
                b,
                ldb,
                beta,
                c,
                ldc,
                (sa, sb, sc),
                batch,
                types,
            )
        }
    })
}
