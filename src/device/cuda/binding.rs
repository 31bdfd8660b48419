//! cudarc bound to the CUDA stack's files. cudarc (built for CUDA 13) opens each library by
//! soname on its first call; the stack ([`crate::device::stack`]) has already opened the file it
//! chose by absolute path with `RTLD_GLOBAL`, so the lookup finds that object — unless the loader
//! gives a name cudarc asks for first to another file. [`bind`] opens the chosen file and checks
//! that a symbol resolves to the same address through cudarc, so a mismatch is an error naming
//! both files, never two libraries of different releases at work.

use crate::device::stack;
use crate::{Error, Result};
use std::ffi::c_void;
use std::path::Path;

/// One of cudarc's libraries: its name, a symbol to compare, the variable naming it, cudarc's
/// probe and its loaded library.
#[derive(Debug, Clone, Copy)]
pub struct Binding {
    /// As users know it.
    pub what: &'static str,
    /// A function every release exports.
    pub symbol: &'static str,
    /// The variable that names the file explicitly.
    pub env: &'static str,
    present: unsafe fn() -> bool,
    library: unsafe fn() -> &'static libloading::Library,
}

/// The driver (`libcuda.so.1`; a toolkit's `stubs/libcuda.so` first on the loader's path would
/// otherwise be what cudarc binds).
pub const DRIVER: Binding = Binding {
    what: "CUDA driver",
    symbol: "cuDriverGetVersion",
    env: "LD_LIBRARY_PATH",
    present: cudarc::driver::sys::is_culib_present,
    library: cudarc::driver::sys::culib,
};

/// NVRTC.
pub const NVRTC: Binding = Binding {
    what: "NVRTC",
    symbol: "nvrtcVersion",
    env: "MEGATRAIN_NVRTC_LIB",
    present: cudarc::nvrtc::sys::is_culib_present,
    library: cudarc::nvrtc::sys::culib,
};

/// cuBLAS.
pub const CUBLAS: Binding = Binding {
    what: "cuBLAS",
    symbol: "cublasGetProperty",
    env: "MEGATRAIN_CUBLAS_LIB",
    present: cudarc::cublas::sys::is_culib_present,
    library: cudarc::cublas::sys::culib,
};

/// Open `path` by its absolute path (idempotent) and check cudarc binds that very library.
pub fn bind(b: &Binding, path: &Path) -> Result<()> {
    let ours = stack::open_library(path, b.symbol)?;
    // SAFETY: only tries to dlopen the library by its usual names.
    if !unsafe { (b.present)() } {
        return Err(Error::system(
            b.what,
            path.display().to_string(),
            "opened, but cudarc's lookup by soname does not find it",
        )
        .with_fix(format!(
            "put {} first on LD_LIBRARY_PATH",
            path.parent().unwrap_or(Path::new("/")).display()
        )));
    }
    // SAFETY: the library is present (checked above), so cudarc's loader does not panic; the
    // symbol is only compared, never called.
    let theirs = unsafe {
        (b.library)()
            .get::<unsafe extern "C" fn()>(b.symbol.as_bytes())
            .ok()
            .map(|f| *f as *const c_void)
    };
    match theirs {
        Some(t) if std::ptr::eq(t, ours.cast_const()) => Ok(()),
        theirs => {
            let other = theirs
                .and_then(|p| stack::file_of(p as usize))
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| format!("a library without {}", b.symbol));
            Err(Error::system(
                b.what,
                path.display().to_string(),
                format!(
                    "the dynamic linker gave cudarc {other} instead (a name cudarc asks for first resolves to it)"
                ),
            )
            .with_fix(format!(
                "take {other}'s folder off LD_LIBRARY_PATH (or out of ld.so.cache), or point {} at it",
                b.env
            )))
        }
    }
}
