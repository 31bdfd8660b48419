//! Compiling `kernels/*.cu` with NVRTC (feature `cuda`).
//!
//! NVRTC (and cuBLAS, [`load_cublas`]) is loaded at run time. Where it lives: `MEGATRAIN_NVRTC_LIB` (a path to `libnvrtc.so*`),
//! else `$CUDA_PATH/lib64`, `/usr/local/cuda/lib64`; the CUDA headers (`cuda_bf16.h`) from
//! `MEGATRAIN_CUDA_INCLUDE`, else `$CUDA_PATH/include`, `/usr/local/cuda/include`. The PyPI wheels
//! `nvidia-cuda-nvrtc-cu12` and `nvidia-cuda-runtime-cu12` provide both on a machine with no
//! toolkit (`tools/setup-cuda-wheels.sh` installs them and prints the two variables).
//!
//! The library is opened by absolute path with `RTLD_GLOBAL` before cudarc's first NVRTC call, so
//! cudarc's own lookup by soname finds it — cudarc panics when it cannot load a library, which is
//! why nothing here calls cudarc before [`load`] succeeded.

use crate::device::kernels::{nvrtc_options, KernelFile, FILES};
use crate::{Error, Result};
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

/// Where NVRTC and the CUDA headers were found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Toolchain {
    /// The NVRTC library.
    pub library: PathBuf,
    /// Directory holding `cuda_bf16.h`.
    pub include: PathBuf,
}

fn candidates(var: &str, rel: &[&str]) -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(p) = std::env::var_os(var) {
        v.push(PathBuf::from(p));
    }
    for root in std::env::var_os("CUDA_PATH")
        .map(PathBuf::from)
        .into_iter()
        .chain([PathBuf::from("/usr/local/cuda")])
    {
        for r in rel {
            v.push(root.join(r));
        }
    }
    v
}

/// Find NVRTC and the headers (no loading yet).
pub fn locate() -> Result<Toolchain> {
    let library = candidates(
        "MEGATRAIN_NVRTC_LIB",
        &["lib64/libnvrtc.so", "lib64/libnvrtc.so.12", "lib/libnvrtc.so.12"],
    )
    .into_iter()
    .find(|p| p.is_file())
    .ok_or_else(|| {
        Error::bad_input(
            "NVRTC",
            "libnvrtc.so",
            "not found (MEGATRAIN_NVRTC_LIB, $CUDA_PATH/lib64, /usr/local/cuda/lib64)",
            Some("install the CUDA toolkit, or run tools/setup-cuda-wheels.sh and export what it prints"),
        )
    })?;
    let include = candidates("MEGATRAIN_CUDA_INCLUDE", &["include"])
        .into_iter()
        .find(|p| p.join("cuda_bf16.h").is_file())
        .ok_or_else(|| {
            Error::bad_input(
                "CUDA headers",
                "cuda_bf16.h",
                "not found (MEGATRAIN_CUDA_INCLUDE, $CUDA_PATH/include, /usr/local/cuda/include)",
                Some("install the CUDA toolkit, or run tools/setup-cuda-wheels.sh and export what it prints"),
            )
        })?;
    Ok(Toolchain { library, include })
}

/// Open NVRTC by its absolute path (idempotent).
pub fn load(tc: &Toolchain) -> Result<()> {
    dlopen_global(&tc.library)?;
    // SAFETY: the library is loaded, so cudarc's loader finds it and does not panic.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::system(
            "NVRTC",
            tc.library.display().to_string(),
            "loaded, but cudarc cannot find it by soname (a libnvrtc.so.12 is expected)",
        ));
    }
    Ok(())
}

/// Open `lib` by its absolute path with `RTLD_GLOBAL` (idempotent), so cudarc's lookup by
/// soname finds it. The handle is kept for the process.
pub fn dlopen_global(lib: &Path) -> Result<()> {
    let path = CString::new(lib.as_os_str().as_encoded_bytes()).map_err(|_| {
        Error::bad_input(
            "library",
            lib.display().to_string(),
            "path contains NUL",
            None,
        )
    })?;
    // SAFETY: dlopen with a valid C string; the handle is deliberately leaked (the library stays
    // loaded for the process, as cudarc expects).
    let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        // SAFETY: dlerror returns a thread-local C string or null.
        let why = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "unknown error".to_owned()
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(Error::system("dlopen", lib.display().to_string(), why));
    }
    Ok(())
}

/// Make cuBLAS loadable, or say how: `MEGATRAIN_CUBLAS_LIB` (opened by path), else whatever the
/// loader finds (`LD_LIBRARY_PATH`, `$CUDA_PATH/lib64`, `/usr/local/cuda/lib64`). cudarc panics
/// on its first cuBLAS call when the library is missing, so this runs before any.
pub fn load_cublas() -> Result<()> {
    let given = candidates(
        "MEGATRAIN_CUBLAS_LIB",
        &["lib64/libcublas.so.12", "lib64/libcublas.so"],
    )
    .into_iter()
    .find(|p| p.is_file());
    if let Some(p) = &given {
        dlopen_global(p)?;
    }
    // SAFETY: only tries to dlopen the library by its usual names.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(Error::bad_input(
            "cuBLAS",
            "libcublas.so.12",
            "not found (MEGATRAIN_CUBLAS_LIB, LD_LIBRARY_PATH, $CUDA_PATH/lib64, /usr/local/cuda/lib64)",
            Some("install the CUDA toolkit's cuBLAS, or run `tools/setup-cuda-wheels.sh --cublas` and export what it prints"),
        ));
    }
    Ok(())
}

/// One compiled kernel file.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// File under `kernels/`.
    pub file: &'static str,
    /// Target architecture.
    pub arch: String,
    /// The PTX (what `tools/ptxas_report.sh` reads).
    pub ptx: String,
    /// The CUBIN for `arch`: what the device loads. Loading it needs no PTX JIT, so a driver
    /// older than this NVRTC (which emits a PTX ISA the driver cannot JIT) still runs it.
    pub cubin: Vec<u8>,
    /// NVRTC's log (warnings), empty when clean.
    pub log: String,
}

fn c_chars_to_string(v: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = v
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compile one file for `arch`. A compile error is an error carrying NVRTC's log; warnings are
/// returned in [`Compiled::log`].
pub fn compile(tc: &Toolchain, f: &KernelFile, arch: &str) -> Result<Compiled> {
    use cudarc::nvrtc::result;
    let src = CString::new(f.program())
        .map_err(|_| Error::bad_input("kernel source", f.file, "contains NUL", None))?;
    let name = CString::new(f.file).unwrap_or_default();
    let prog = result::create_program(&src, Some(&name)).map_err(|e| {
        Error::system(
            "NVRTC",
            format!("create program {}", f.file),
            format!("{e:?}"),
        )
    })?;
    let opts = nvrtc_options(arch, &tc.include);
    // SAFETY: `prog` was just created and is destroyed once below; `src`/`name` outlive it.
    let compiled = unsafe { result::compile_program(prog, &opts) };
    // SAFETY: as above.
    let log = unsafe { result::get_program_log(prog) }
        .map(|l| c_chars_to_string(&l))
        .unwrap_or_default();
    let ptx = match compiled {
        Ok(()) => {
            // SAFETY: as above; the program compiled.
            let ptx = unsafe { result::get_ptx(prog) }
                .map(|p| c_chars_to_string(&p))
                .map_err(|e| {
                    Error::system("NVRTC", format!("get PTX of {}", f.file), format!("{e:?}"))
                });
            // SAFETY: as above.
            let cubin = unsafe { cubin(prog) }.map_err(|e| {
                Error::system(
                    "NVRTC",
                    format!("get the CUBIN of {} for {arch}", f.file),
                    e,
                )
            });
            ptx.and_then(|p| cubin.map(|c| (p, c)))
        }
        Err(e) => Err(Error::system(
            "NVRTC",
            format!("compile {} for {arch}", f.file),
            format!("{e:?}\n{log}"),
        )),
    };
    // SAFETY: destroyed exactly once.
    let _ = unsafe { result::destroy_program(prog) };
    let (ptx, cubin) = ptx?;
    Ok(Compiled {
        file: f.file,
        arch: arch.to_owned(),
        ptx,
        cubin,
        log: log.trim().to_owned(),
    })
}

/// The CUBIN of a compiled program (its target is a real `sm_XY`).
///
/// # Safety
/// `prog` compiled successfully and is not destroyed yet.
unsafe fn cubin(prog: cudarc::nvrtc::sys::nvrtcProgram) -> std::result::Result<Vec<u8>, String> {
    use cudarc::nvrtc::sys;
    let mut n = 0usize;
    // SAFETY: the caller's contract; `n` is a valid out-pointer.
    let r = unsafe { sys::nvrtcGetCUBINSize(prog, &mut n) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS || n == 0 {
        return Err(format!("nvrtcGetCUBINSize: {r:?}"));
    }
    let mut buf = vec![0u8; n];
    // SAFETY: `buf` holds the `n` bytes NVRTC reported.
    let r = unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcGetCUBIN: {r:?}"));
    }
    Ok(buf)
}

/// Compile every kernel file for `arch` and check each exports its kernels.
pub fn compile_all(tc: &Toolchain, arch: &str) -> Result<Vec<Compiled>> {
    FILES
        .iter()
        .map(|f| {
            let c = compile(tc, f, arch)?;
            if let Some(missing) = f
                .kernels
                .iter()
                .map(|k| k.name)
                .find(|s| !c.ptx.contains(&format!(".entry {s}(")))
            {
                return Err(Error::system(
                    "NVRTC",
                    format!("compile {} for {arch}", f.file),
                    format!("the PTX has no entry point {missing}"),
                ));
            }
            Ok(c)
        })
        .collect()
}

/// `path` as the directory PTX files are written to (tools/ptxas_report.sh).
pub fn write_ptx(dir: &Path, c: &Compiled) -> Result<()> {
    let p = dir.join(format!("{}.{}.ptx", c.file.trim_end_matches(".cu"), c.arch));
    crate::util::write_atomic(&p, c.ptx.as_bytes())
}
