//! The NVRTC stand-in (`libnvrtc.so.12`): every call goes to the real NVRTC (from the PyPI
//! wheel, `CUEMU_REAL_NVRTC`, loaded in its own link-map namespace so its soname never shadows
//! this library), so compile errors, warnings and the PTX/CUBIN stay NVIDIA's. A successful
//! compile also builds the same source for the host ([`crate::hostbuild`]) and remembers which
//! PTX and CUBIN images it produced, so `cuModuleLoadData` can find the host build.

use crate::api::{self, nv, Lib, Sticky};
use crate::{config, hostbuild, ptx, report};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Mutex, OnceLock};

type Prog = *mut c_void;

struct Real {
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    create: unsafe extern "C" fn(
        *mut Prog,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    destroy: unsafe extern "C" fn(*mut Prog) -> c_int,
    compile: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int,
    ptx_size: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
    ptx: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
    cubin_size: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
    cubin: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
    log_size: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
    log: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
    num_archs: unsafe extern "C" fn(*mut c_int) -> c_int,
    archs: unsafe extern "C" fn(*mut c_int) -> c_int,
    add_name: unsafe extern "C" fn(Prog, *const c_char) -> c_int,
    lowered: unsafe extern "C" fn(Prog, *const c_char, *mut *const c_char) -> c_int,
}

/// A symbol as the function pointer type `F` (pointer-sized).
///
/// # Safety
/// `p` is a function of exactly that C signature.
unsafe fn cast<F: Copy>(p: *mut c_void) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: same size; the caller's contract makes it a valid function pointer.
    unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) }
}

fn real() -> Result<&'static Real, i32> {
    static R: OnceLock<Result<Real, String>> = OnceLock::new();
    let r = R.get_or_init(|| {
        let path = config::get().real_nvrtc.clone().ok_or_else(|| {
            "CUEMU_REAL_NVRTC is not set: the emulated NVRTC forwards to the real one (tools/cuemu.sh sets it)".to_owned()
        })?;
        let c = CString::new(path.display().to_string()).map_err(|_| "path with NUL".to_owned())?;
        // NVRTC opens its builtins (`libnvrtc-builtins.so.13.0`) by soname when it first
        // compiles; CUDA 13's wheel gives it no RUNPATH to find them by, so they are loaded first,
        // into the namespace NVRTC then joins.
        let namespace = builtins_namespace(&path);
        // SAFETY: loading NVIDIA's NVRTC into a fresh (or the builtins') namespace; it stays
        // loaded.
        let mut h = unsafe { libc::dlmopen(namespace, c.as_ptr(), libc::RTLD_NOW) };
        if h.is_null() {
            // SAFETY: as above, in the default namespace.
            h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        }
        if h.is_null() {
            return Err(format!(
                "cannot load the real NVRTC {}: {}",
                path.display(),
                hostbuild::dlerror()
            ));
        }
        let sym = |name: &CStr| -> Result<*mut c_void, String> {
            // SAFETY: looking up a symbol in the library just loaded.
            let p = unsafe { libc::dlsym(h, name.as_ptr()) };
            if p.is_null() {
                Err(format!("the real NVRTC lacks {}", name.to_string_lossy()))
            } else {
                Ok(p)
            }
        };
        // SAFETY: NVRTC's documented C signatures.
        unsafe {
            Ok(Real {
                version: cast(sym(c"nvrtcVersion")?),
                error_string: cast(sym(c"nvrtcGetErrorString")?),
                create: cast(sym(c"nvrtcCreateProgram")?),
                destroy: cast(sym(c"nvrtcDestroyProgram")?),
                compile: cast(sym(c"nvrtcCompileProgram")?),
                ptx_size: cast(sym(c"nvrtcGetPTXSize")?),
                ptx: cast(sym(c"nvrtcGetPTX")?),
                cubin_size: cast(sym(c"nvrtcGetCUBINSize")?),
                cubin: cast(sym(c"nvrtcGetCUBIN")?),
                log_size: cast(sym(c"nvrtcGetProgramLogSize")?),
                log: cast(sym(c"nvrtcGetProgramLog")?),
                num_archs: cast(sym(c"nvrtcGetNumSupportedArchs")?),
                archs: cast(sym(c"nvrtcGetSupportedArchs")?),
                add_name: cast(sym(c"nvrtcAddNameExpression")?),
                lowered: cast(sym(c"nvrtcGetLoweredName")?),
            })
        }
    });
    r.as_ref().map_err(|e| {
        report::once("real-nvrtc", &format!("error: {e}"));
        nv::INTERNAL_ERROR
    })
}

/// A new link-map namespace holding NVRTC's builtins from `nvrtc`'s folder (the namespace id),
/// or `LM_ID_NEWLM` when there are none to load.
fn builtins_namespace(nvrtc: &std::path::Path) -> libc::Lmid_t {
    let Some(dir) = nvrtc.parent() else {
        return libc::LM_ID_NEWLM;
    };
    let Some(builtins) = std::fs::read_dir(dir).ok().and_then(|rd| {
        rd.filter_map(|e| e.ok()).map(|e| e.path()).find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvrtc-builtins.so."))
        })
    }) else {
        return libc::LM_ID_NEWLM;
    };
    let Ok(c) = CString::new(builtins.display().to_string()) else {
        return libc::LM_ID_NEWLM;
    };
    // SAFETY: loading NVIDIA's library into a fresh namespace; it stays loaded.
    let h = unsafe { libc::dlmopen(libc::LM_ID_NEWLM, c.as_ptr(), libc::RTLD_NOW) };
    if h.is_null() {
        return libc::LM_ID_NEWLM;
    }
    let mut id: libc::Lmid_t = 0;
    // SAFETY: `h` is a live handle; RTLD_DI_LMID writes one Lmid_t.
    if unsafe { libc::dlinfo(h, libc::RTLD_DI_LMID, (&mut id as *mut libc::Lmid_t).cast()) } != 0 {
        return libc::LM_ID_NEWLM;
    }
    id
}

/// What the stand-in keeps per program: its source, for the host build.
struct Source {
    text: String,
    name: String,
    headers: Vec<(String, String)>,
    /// Appended to NVRTC's log (the host build's failure).
    extra_log: String,
}

fn sources() -> std::sync::MutexGuard<'static, HashMap<usize, Source>> {
    static S: OnceLock<Mutex<HashMap<usize, Source>>> = OnceLock::new();
    S.get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

fn nvrtc(name: &str, f: impl FnOnce() -> Result<(), i32>) -> c_int {
    api::call(name, Lib::Nvrtc, Sticky::Ignore, f)
}

fn check(code: c_int) -> Result<(), i32> {
    if code == nv::SUCCESS {
        Ok(())
    } else {
        Err(code)
    }
}

unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: a NUL-terminated string from the caller.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcVersion(major: *mut c_int, minor: *mut c_int) -> c_int {
    // SAFETY: forwarded to the real function with the caller's pointers.
    nvrtc("nvrtcVersion", || {
        // SAFETY: forwarded to the real NVRTC with the caller's arguments.
        check(unsafe { (real()?.version)(major, minor) })
    })
}

#[no_mangle]
pub extern "C" fn nvrtcGetErrorString(code: c_int) -> *const c_char {
    match real() {
        // SAFETY: forwarded.
        Ok(r) => unsafe { (r.error_string)(code) },
        Err(_) => c"NVRTC_ERROR_INTERNAL_ERROR (the real NVRTC could not be loaded)".as_ptr(),
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcCreateProgram(
    prog: *mut Prog,
    src: *const c_char,
    name: *const c_char,
    num_headers: c_int,
    headers: *const *const c_char,
    include_names: *const *const c_char,
) -> c_int {
    nvrtc("nvrtcCreateProgram", || {
        let r = real()?;
        // SAFETY: forwarded with the caller's arguments.
        check(unsafe { (r.create)(prog, src, name, num_headers, headers, include_names) })?;
        let mut hs = Vec::new();
        for i in 0..num_headers.max(0) as usize {
            // SAFETY: `num_headers` entries in each array, per NVRTC's contract.
            let (h, n) = unsafe { (*headers.add(i), *include_names.add(i)) };
            // SAFETY: NUL-terminated strings.
            hs.push(unsafe { (cstr(n), cstr(h)) });
        }
        // SAFETY: the caller's source and name (NUL-terminated); `prog` was just written.
        let (text, name, handle) = unsafe { (cstr(src), cstr(name), *prog as usize) };
        sources().insert(
            handle,
            Source {
                text,
                name: if name.is_empty() {
                    "default_program".into()
                } else {
                    name
                },
                headers: hs,
                extra_log: String::new(),
            },
        );
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcDestroyProgram(prog: *mut Prog) -> c_int {
    nvrtc("nvrtcDestroyProgram", || {
        if prog.is_null() {
            return Err(nv::INVALID_INPUT);
        }
        // SAFETY: the caller's handle.
        sources().remove(&(unsafe { *prog } as usize));
        // SAFETY: forwarded.
        check(unsafe { (real()?.destroy)(prog) })
    })
}

/// A real getter's bytes: `size` then `get`.
unsafe fn fetch(
    prog: Prog,
    size: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
    get: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
) -> Option<Vec<u8>> {
    let mut n = 0usize;
    // SAFETY: NVRTC's getters on a compiled program.
    unsafe {
        if size(prog, &mut n) != nv::SUCCESS || n == 0 {
            return None;
        }
        let mut buf = vec![0u8; n];
        if get(prog, buf.as_mut_ptr().cast()) != nv::SUCCESS {
            return None;
        }
        Some(buf)
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcCompileProgram(
    prog: Prog,
    num_options: c_int,
    options: *const *const c_char,
) -> c_int {
    nvrtc("nvrtcCompileProgram", || {
        let r = real()?;
        // SAFETY: forwarded.
        check(unsafe { (r.compile)(prog, num_options, options) })?;
        let opts: Vec<String> = (0..num_options.max(0) as usize)
            // SAFETY: `num_options` NUL-terminated strings.
            .map(|i| unsafe { cstr(*options.add(i)) })
            .collect();
        // SAFETY: the program compiled; the getters are valid on it.
        let ptx_bytes = unsafe { fetch(prog, r.ptx_size, r.ptx) }.ok_or(nv::INTERNAL_ERROR)?;
        // SAFETY: as above (absent when the target is virtual).
        let cubin = unsafe { fetch(prog, r.cubin_size, r.cubin) };
        let ptx_text = String::from_utf8_lossy(&ptx_bytes);
        let ptx_text = ptx_text.trim_end_matches('\0');
        let (text, name, headers) = {
            let s = sources();
            let src = s.get(&(prog as usize)).ok_or(nv::INVALID_PROGRAM)?;
            (src.text.clone(), src.name.clone(), src.headers.clone())
        };
        let built = ptx::parse(ptx_text)
            .and_then(|info| hostbuild::build(&name, &text, &headers, &opts, info));
        match built {
            Ok(program) => {
                hostbuild::register_image(ptx_text.as_bytes(), program.clone());
                let mut images: Vec<&[u8]> = vec![ptx_text.as_bytes()];
                if let Some(c) = &cubin {
                    hostbuild::register_image(c, program);
                    images.push(c);
                }
                hostbuild::keep_recipe(
                    &images,
                    &hostbuild::Recipe {
                        name: name.clone(),
                        source: text.clone(),
                        headers: headers.clone(),
                        options: opts.clone(),
                        ptx: ptx_text.to_owned(),
                    },
                );
                Ok(())
            }
            Err(e) => {
                report::error("host build failed", &format!("{name}: {e}"));
                if let Some(s) = sources().get_mut(&(prog as usize)) {
                    s.extra_log = format!("\ncuemu: the host build of {name} failed: {e}\n");
                }
                Err(nv::COMPILATION)
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetPTXSize(prog: Prog, n: *mut usize) -> c_int {
    // SAFETY: forwarded.
    nvrtc("nvrtcGetPTXSize", || {
        // SAFETY: forwarded to the real NVRTC with the caller's arguments.
        check(unsafe { (real()?.ptx_size)(prog, n) })
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetPTX(prog: Prog, out: *mut c_char) -> c_int {
    // SAFETY: forwarded.
    nvrtc("nvrtcGetPTX", || check(unsafe { (real()?.ptx)(prog, out) }))
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetCUBINSize(prog: Prog, n: *mut usize) -> c_int {
    // SAFETY: forwarded.
    nvrtc("nvrtcGetCUBINSize", || {
        // SAFETY: forwarded to the real NVRTC with the caller's arguments.
        check(unsafe { (real()?.cubin_size)(prog, n) })
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetCUBIN(prog: Prog, out: *mut c_char) -> c_int {
    // SAFETY: forwarded.
    nvrtc("nvrtcGetCUBIN", || {
        // SAFETY: forwarded to the real NVRTC with the caller's arguments.
        check(unsafe { (real()?.cubin)(prog, out) })
    })
}

fn extra_log(prog: Prog) -> String {
    sources()
        .get(&(prog as usize))
        .map(|s| s.extra_log.clone())
        .unwrap_or_default()
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetProgramLogSize(prog: Prog, n: *mut usize) -> c_int {
    nvrtc("nvrtcGetProgramLogSize", || {
        // SAFETY: forwarded.
        check(unsafe { (real()?.log_size)(prog, n) })?;
        let extra = extra_log(prog).len();
        if !n.is_null() && extra > 0 {
            // SAFETY: written by the real call just now.
            unsafe { *n += extra };
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetProgramLog(prog: Prog, out: *mut c_char) -> c_int {
    nvrtc("nvrtcGetProgramLog", || {
        let r = real()?;
        let extra = extra_log(prog);
        if extra.is_empty() || out.is_null() {
            // SAFETY: forwarded.
            return check(unsafe { (r.log)(prog, out) });
        }
        let mut n = 0usize;
        // SAFETY: forwarded; the caller's buffer holds the size we reported (real + extra).
        unsafe {
            check((r.log_size)(prog, &mut n))?;
            check((r.log)(prog, out))?;
            let at = n.saturating_sub(1);
            std::ptr::copy_nonoverlapping(extra.as_ptr().cast(), out.add(at), extra.len());
            *out.add(at + extra.len()) = 0;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetNumSupportedArchs(n: *mut c_int) -> c_int {
    // SAFETY: forwarded.
    nvrtc("nvrtcGetNumSupportedArchs", || {
        // SAFETY: forwarded to the real NVRTC with the caller's arguments.
        check(unsafe { (real()?.num_archs)(n) })
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetSupportedArchs(a: *mut c_int) -> c_int {
    // SAFETY: forwarded.
    nvrtc("nvrtcGetSupportedArchs", || {
        // SAFETY: forwarded to the real NVRTC with the caller's arguments.
        check(unsafe { (real()?.archs)(a) })
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcAddNameExpression(prog: Prog, e: *const c_char) -> c_int {
    // SAFETY: forwarded.
    nvrtc("nvrtcAddNameExpression", || {
        // SAFETY: forwarded to the real NVRTC with the caller's arguments.
        check(unsafe { (real()?.add_name)(prog, e) })
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetLoweredName(
    prog: Prog,
    e: *const c_char,
    out: *mut *const c_char,
) -> c_int {
    // SAFETY: forwarded.
    nvrtc("nvrtcGetLoweredName", || {
        // SAFETY: forwarded to the real NVRTC with the caller's arguments.
        check(unsafe { (real()?.lowered)(prog, e, out) })
    })
}
