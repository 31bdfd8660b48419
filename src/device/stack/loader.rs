//! The dynamic linker's side of the stack: opening libraries by absolute path (with NVRTC's
//! builtins), asking each its version, the driver, and what cudarc's own lookup by soname would
//! bind.

use super::search::major_of;
use super::{Library, Version};
use crate::{Error, Result};
use std::ffi::{c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};

/// What the dynamic linker resolves `soname` to (`None`: nothing). The library is opened and
/// closed again; only its path is kept.
pub fn loader_lookup(soname: &str, symbol: &str) -> Option<PathBuf> {
    let name = CString::new(soname).ok()?;
    // SAFETY: dlopen with a valid C string; closed below.
    let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    if h.is_null() {
        return None;
    }
    let path = symbol_file(h, symbol);
    // SAFETY: `h` came from dlopen above and is closed once.
    unsafe { libc::dlclose(h) };
    path
}

/// The file the object holding `symbol` (looked up in `handle`) was loaded from.
fn symbol_file(handle: *mut c_void, symbol: &str) -> Option<PathBuf> {
    let sym = CString::new(symbol).ok()?;
    // SAFETY: a live handle and a valid C string.
    let addr = unsafe { libc::dlsym(handle, sym.as_ptr()) };
    if addr.is_null() {
        return None;
    }
    file_of(addr as usize)
}

/// The file of the loaded object holding the address `addr` (`dladdr`; nothing is read there).
pub fn file_of(addr: usize) -> Option<PathBuf> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr only looks the address up among the loaded objects and fills `info`; a zero
    // return means not found.
    let ok = unsafe { libc::dladdr(addr as *const c_void, info.as_mut_ptr()) };
    if ok == 0 {
        return None;
    }
    // SAFETY: filled by dladdr.
    let info = unsafe { info.assume_init() };
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr's file name is a NUL-terminated string owned by the loader.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    use std::os::unix::ffi::OsStrExt;
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes())))
}

/// The NVIDIA driver.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Driver {
    /// The file the dynamic linker loaded for `libcuda.so.1`.
    pub path: PathBuf,
    /// The CUDA version it supports (`cuDriverGetVersion`).
    pub cuda: Version,
    /// The same, as the driver encodes it (13000).
    pub cuda_code: i32,
    /// The kernel module's version (`/proc/driver/nvidia/version`: `580.159.04`), where readable.
    pub module: Option<String>,
}

/// A library handle kept for the process (the CUDA libraries are never unloaded).
#[derive(Debug, Clone, Copy)]
pub(super) struct Handle(*mut c_void);

fn dlerror_text() -> String {
    // SAFETY: dlerror returns a thread-local C string or null.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown error".to_owned()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

/// Open `lib` by its absolute path with `RTLD_GLOBAL` (idempotent), so a later lookup by soname
/// (cudarc's) finds it. The handle is kept for the process. An error names `what` (the
/// library's name) and the dynamic linker's reason.
pub(super) fn open_global(lib: &Path, what: &'static str) -> Result<Handle> {
    let failed = |why: String| Error::system(what, format!("load {}", lib.display()), why);
    let path = CString::new(lib.as_os_str().as_encoded_bytes())
        .map_err(|_| failed("the path contains NUL".to_owned()))?;
    // SAFETY: dlopen with a valid C string; the handle is deliberately leaked (the library stays
    // loaded for the process, as cudarc expects).
    let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        return Err(failed(dlerror_text()));
    }
    Ok(Handle(h))
}

pub(super) fn symbol(h: Handle, name: &str) -> Option<*mut c_void> {
    let c = CString::new(name).ok()?;
    // SAFETY: a live handle and a valid C string.
    let p = unsafe { libc::dlsym(h.0, c.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// Open `lib` by absolute path (idempotent) and return the address of `symbol` in it: what a
/// caller compares with what cudarc bound.
pub fn open_library(lib: &Path, sym: &str) -> Result<*mut c_void> {
    let h = open_global(lib, "dlopen")?;
    symbol(h, sym).ok_or_else(|| {
        Error::system(
            "dlopen",
            lib.display().to_string(),
            format!("loaded, but it has no `{sym}`"),
        )
    })
}

/// Open what NVRTC itself opens by soname from its own folder — `libnvrtc-builtins.so.13.0`:
/// CUDA 13's wheel gives NVRTC no `RUNPATH`, so without this its first compile fails ("failed to
/// open libnvrtc-builtins.so.13.0") unless the folder is on `LD_LIBRARY_PATH`.
pub(super) fn open_companions(nvrtc: &Path) -> Result<()> {
    let Some(dir) = nvrtc.parent() else {
        return Ok(());
    };
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    let mut builtins: Vec<PathBuf> = rd
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvrtc-builtins.so."))
        })
        .collect();
    builtins.sort();
    for b in builtins {
        open_global(&b, "NVRTC")?;
    }
    Ok(())
}

/// `CUDA_ERROR_STUB_LIBRARY`: the toolkit's link-time stub was loaded instead of the driver.
const STUB_LIBRARY: c_int = 34;

/// The driver, loaded (`libcuda.so.1` by soname, as every CUDA program does) and asked its
/// version.
pub fn driver() -> Result<Driver> {
    let name = c"libcuda.so.1";
    // SAFETY: dlopen with a valid C string; kept loaded for the process.
    let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        return Err(Error::system(
            "CUDA driver",
            "load libcuda.so.1",
            format!(
                "no NVIDIA driver on this machine: the dynamic linker finds no libcuda.so.1 (LD_LIBRARY_PATH, ld.so.cache; {})",
                dlerror_text()
            ),
        )
        .with_fix(
            "run on a machine with an NVIDIA GPU and its driver (`nvidia-smi` must work); in a container, start it with the NVIDIA runtime (`--gpus all`)",
        ));
    }
    let h = Handle(h);
    let path =
        symbol_file(h.0, "cuDriverGetVersion").unwrap_or_else(|| PathBuf::from("libcuda.so.1"));
    let get = symbol(h, "cuDriverGetVersion").ok_or_else(|| {
        Error::system(
            "CUDA driver",
            path.display().to_string(),
            "it has no cuDriverGetVersion: not an NVIDIA driver",
        )
    })?;
    // SAFETY: the driver API's `CUresult cuDriverGetVersion(int*)`.
    let get: unsafe extern "C" fn(*mut c_int) -> c_int = unsafe { std::mem::transmute(get) };
    let mut v: c_int = 0;
    // SAFETY: writes one int.
    let r = unsafe { get(&mut v) };
    if r == STUB_LIBRARY {
        return Err(Error::system(
            "CUDA driver",
            path.display().to_string(),
            "this is the CUDA toolkit's link-time stub, not the driver",
        )
        .with_fix(format!(
            "take {} (a `stubs` folder) off LD_LIBRARY_PATH",
            path.parent().unwrap_or(Path::new("/")).display()
        )));
    }
    if r != 0 {
        return Err(Error::system(
            "CUDA driver",
            format!("cuDriverGetVersion ({})", path.display()),
            format!("error {r}"),
        )
        .with_fix("check the driver with `nvidia-smi`"));
    }
    Ok(Driver {
        path,
        cuda: Version::from_cuda(v),
        cuda_code: v,
        module: crate::topology::linux::nvidia_driver_version(),
    })
}

/// The names cudarc (built for CUDA 13) asks the dynamic linker for, in its order; its
/// Windows-style `lib…64_*` names do not exist on Linux and are left out.
pub(super) fn cudarc_names(lib: Library) -> Vec<String> {
    vec![
        format!("lib{}.so", lib.stem()),
        lib.soname(13),
        lib.soname(12),
    ]
}

/// The file cudarc's own lookup would bind for `lib` once `chosen` is open (`None`: `chosen`
/// itself). A loaded library answers a later lookup of its own soname (`libnvrtc.so.12`) or of a
/// name the loader resolves to the same file; any name cudarc asks for earlier that the loader
/// resolves to another file wins over it. `lookup` asks the loader for a name.
pub fn cudarc_would_bind(
    lib: Library,
    chosen: &Path,
    lookup: &dyn Fn(&str) -> Option<PathBuf>,
) -> Option<PathBuf> {
    let soname = major_of(chosen).map(|m| lib.soname(m));
    for name in cudarc_names(lib) {
        if soname.as_deref() == Some(name.as_str()) {
            return None;
        }
        if let Some(p) = lookup(&name) {
            return (!same_file(&p, chosen)).then_some(p);
        }
    }
    None
}

/// Whether two paths are one file, as the dynamic linker tells files apart (device and inode:
/// links, symbolic or hard, are the same file).
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => {
            let real = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
            real(a) == real(b)
        }
    }
}

/// The version an opened library reports: NVRTC by `nvrtcVersion`, cuBLAS by
/// `cublasGetProperty`.
pub(super) fn library_version(lib: Library, h: Handle) -> Option<Version> {
    match lib {
        Library::Nvrtc => {
            let f = symbol(h, "nvrtcVersion")?;
            // SAFETY: `nvrtcResult nvrtcVersion(int*, int*)`.
            let f: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int =
                unsafe { std::mem::transmute(f) };
            let (mut a, mut b) = (0, 0);
            // SAFETY: writes two ints.
            (unsafe { f(&mut a, &mut b) } == 0).then_some(Version {
                major: a.max(0) as u32,
                minor: b.max(0) as u32,
                patch: 0,
            })
        }
        Library::Cublas => {
            let f = symbol(h, "cublasGetProperty")?;
            // SAFETY: `cublasStatus_t cublasGetProperty(libraryPropertyType, int*)`.
            let f: unsafe extern "C" fn(c_int, *mut c_int) -> c_int =
                unsafe { std::mem::transmute(f) };
            let mut v = [0; 3];
            for (kind, out) in v.iter_mut().enumerate() {
                // SAFETY: writes one int; kinds 0, 1, 2 are MAJOR_VERSION, MINOR_VERSION,
                // PATCH_LEVEL.
                if unsafe { f(kind as c_int, out) } != 0 {
                    return None;
                }
            }
            Some(Version {
                major: v[0].max(0) as u32,
                minor: v[1].max(0) as u32,
                patch: v[2].max(0) as u32,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::stack::test_files::touch;

    #[test]
    fn cudarc_binds_what_the_loader_gives_it_first() {
        let t = tempfile::tempdir().unwrap();
        let cu12 = t.path().join("tk/lib64/libnvrtc.so.12.9.86");
        touch(&cu12);
        let link12 = t.path().join("tk/lib64/libnvrtc.so.12");
        std::os::unix::fs::symlink(&cu12, &link12).unwrap();
        let dev = t.path().join("tk/lib64/libnvrtc.so");
        std::os::unix::fs::symlink(&cu12, &dev).unwrap();
        let cu13 = t.path().join("cu13/libnvrtc.so.13");
        touch(&cu13);
        let map = |pairs: Vec<(&'static str, PathBuf)>| {
            move |s: &str| pairs.iter().find(|(n, _)| *n == s).map(|(_, p)| p.clone())
        };
        // Nothing else on the path: a CUDA 12 NVRTC answers its own soname.
        assert_eq!(
            cudarc_would_bind(Library::Nvrtc, &link12, &map(vec![])),
            None
        );
        // The toolkit's unversioned link to the same file: the same library.
        let same = map(vec![("libnvrtc.so", dev.clone())]);
        assert_eq!(cudarc_would_bind(Library::Nvrtc, &link12, &same), None);
        // A hard link of it elsewhere (uv installs wheels by hard link): the same file.
        let hard = t.path().join("hard/libnvrtc.so");
        std::fs::create_dir_all(hard.parent().unwrap()).unwrap();
        std::fs::hard_link(&cu12, &hard).unwrap();
        let linked = map(vec![("libnvrtc.so", hard)]);
        assert_eq!(cudarc_would_bind(Library::Nvrtc, &link12, &linked), None);
        // A CUDA 13 NVRTC in ld.so.cache is asked for before `.so.12`: it wins.
        let newer = map(vec![("libnvrtc.so.13", cu13.clone())]);
        assert_eq!(
            cudarc_would_bind(Library::Nvrtc, &link12, &newer),
            Some(cu13.clone())
        );
        // Chosen CUDA 13: its soname comes before `.so.12`, but an unversioned name first wins.
        assert_eq!(
            cudarc_would_bind(Library::Nvrtc, &cu13, &same),
            Some(dev.clone())
        );
        assert_eq!(
            cudarc_would_bind(
                Library::Nvrtc,
                &cu13,
                &map(vec![("libnvrtc.so.12", link12)])
            ),
            None
        );
    }
}
