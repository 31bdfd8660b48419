//! Compiling `kernels/*.cu` with NVRTC (feature `cuda`), and keeping what was compiled: in the
//! process (each architecture's files are compiled once however many devices open) and on disk
//! ([`super::kernel_cache`]).
//!
//! Which NVRTC and which headers is the CUDA stack's choice ([`crate::device::stack`]): CUDA 12 or
//! 13, from the toolkit, the loader's path or NVIDIA's pip wheels. The library is opened by
//! absolute path with `RTLD_GLOBAL` before cudarc's first NVRTC call, so cudarc's own lookup by
//! soname binds it — [`super::binding`] checks that it did (cudarc panics when it cannot load a
//! library, which is why nothing here calls cudarc before that).

use super::kernel_cache;
use crate::device::kernels::{nvrtc_options, KernelFile, FILES};
use crate::device::stack::{self, Headers, Loaded, Version};
use crate::{Error, Result};
use std::collections::HashMap;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// The NVRTC and headers kernels are compiled with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Toolchain {
    /// The NVRTC library.
    pub library: PathBuf,
    /// Its release.
    pub version: Version,
    /// Directory holding `cuda_bf16.h`.
    pub include: PathBuf,
    /// The headers' release, where they state it.
    pub headers_version: Option<Version>,
    /// The library file as it is (size and modification time), for the kernel cache's key.
    pub stamp: String,
}

impl Toolchain {
    /// The toolchain of a chosen stack.
    pub fn new(nvrtc: &Loaded, headers: &Headers) -> Toolchain {
        Toolchain {
            library: nvrtc.path.clone(),
            version: nvrtc.version,
            include: headers.dir.clone(),
            headers_version: headers.version,
            stamp: stamp(&nvrtc.path),
        }
    }

    /// NVRTC for compiling only (no driver or GPU needed: the test suite, the PTX report):
    /// found as [`stack::compiler`] finds it, opened and bound.
    pub fn for_compiling() -> Result<Toolchain> {
        let (nvrtc, headers) = stack::compiler()?;
        let tc = Toolchain::new(&nvrtc, &headers);
        super::binding::bind(&super::binding::NVRTC, &tc.library)?;
        Ok(tc)
    }
}

/// A library file's identity as it is now: its real path's size and modification time.
fn stamp(path: &Path) -> String {
    let real = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    match std::fs::metadata(&real) {
        Ok(m) => {
            let t = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            format!("{} {} {t}", real.display(), m.len())
        }
        Err(_) => real.display().to_string(),
    }
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
    /// Read from the disk cache rather than compiled by this process's NVRTC.
    pub from_disk: bool,
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
        from_disk: false,
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
            check_entries(f, &c)?;
            Ok(c)
        })
        .collect()
}

/// That `c` exports every kernel of `f`.
fn check_entries(f: &KernelFile, c: &Compiled) -> Result<()> {
    if let Some(missing) = f
        .kernels
        .iter()
        .map(|k| k.name)
        .find(|s| !c.ptx.contains(&format!(".entry {s}(")))
    {
        return Err(Error::system(
            "NVRTC",
            format!("compile {} for {}", f.file, c.arch),
            format!("the PTX has no entry point {missing}"),
        ));
    }
    Ok(())
}

/// How a set of kernels came to be.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Provenance {
    /// Files compiled by NVRTC now.
    pub compiled: usize,
    /// Files read from the disk cache.
    pub from_disk: usize,
    /// Files already compiled by this process.
    pub from_process: usize,
    /// Cached files the driver refused, compiled again.
    pub refreshed: usize,
    /// The disk cache folder (`None`: off).
    pub cache: Option<PathBuf>,
    /// Why an entry could not be written, if one could not (the compile still stands).
    pub write_error: Option<String>,
}

/// What this process has compiled, by (NVRTC library, architecture).
type Memo = Mutex<HashMap<(PathBuf, String), Arc<Vec<Compiled>>>>;

fn memo() -> &'static Memo {
    static MEMO: OnceLock<Memo> = OnceLock::new();
    MEMO.get_or_init(Memo::default)
}

fn cache_name(tc: &Toolchain, f: &KernelFile, arch: &str) -> String {
    let program = f.program();
    let options = nvrtc_options(arch, &tc.include);
    kernel_cache::Key {
        nvrtc: tc.version,
        library: &tc.stamp,
        headers: tc.headers_version,
        arch,
        options: &options,
        program: &program,
    }
    .file_name()
}

/// Compile file `index` of [`FILES`] for `arch` again, bypassing the caches, and put the result in
/// both: for a cached image the driver refused (a driver that changed under the cache).
pub fn refresh(tc: &Toolchain, arch: &str, index: usize) -> Result<Compiled> {
    let f = FILES
        .get(index)
        .ok_or_else(|| Error::internal("NVRTC", format!("no kernel file {index}")))?;
    let c = compile(tc, f, arch)?;
    check_entries(f, &c)?;
    if let Some(d) = kernel_cache::dir() {
        // Best effort, as for any compile: the kernels stand without the cache.
        let _ = kernel_cache::write(&d, &cache_name(tc, f, arch), &c);
    }
    let mut memo = crate::util::lock(memo());
    if let Some(v) = memo.get_mut(&(tc.library.clone(), arch.to_owned())) {
        let mut all = v.as_ref().clone();
        if let Some(slot) = all.get_mut(index) {
            *slot = c.clone();
        }
        *v = Arc::new(all);
    }
    Ok(c)
}

/// Every kernel file for `arch`, compiled once per process and kept on disk across processes
/// ([`kernel_cache`]): a cached entry is used only when it checks out and exports every kernel.
pub fn compile_all_cached(tc: &Toolchain, arch: &str) -> Result<(Arc<Vec<Compiled>>, Provenance)> {
    // Held while compiling, so two devices opening at once compile once.
    let mut memo = crate::util::lock(memo());
    let key = (tc.library.clone(), arch.to_owned());
    let cache = kernel_cache::dir();
    if let Some(done) = memo.get(&key) {
        let p = Provenance {
            from_process: done.len(),
            cache,
            ..Provenance::default()
        };
        return Ok((done.clone(), p));
    }
    let mut p = Provenance {
        cache: cache.clone(),
        ..Provenance::default()
    };
    let mut out = Vec::with_capacity(FILES.len());
    for f in FILES {
        let name = cache_name(tc, f, arch);
        let hit = cache
            .as_deref()
            .and_then(|d| kernel_cache::read(d, &name))
            .map(|(cubin, ptx, log)| Compiled {
                file: f.file,
                arch: arch.to_owned(),
                ptx,
                cubin,
                log,
                from_disk: true,
            })
            .filter(|c| check_entries(f, c).is_ok() && !c.cubin.is_empty());
        let c = match hit {
            Some(c) => {
                p.from_disk += 1;
                c
            }
            None => {
                let c = compile(tc, f, arch)?;
                check_entries(f, &c)?;
                p.compiled += 1;
                if let Some(d) = &cache {
                    if let Err(e) = kernel_cache::write(d, &name, &c) {
                        p.write_error.get_or_insert(e.to_string());
                    }
                }
                c
            }
        };
        out.push(c);
    }
    let out = Arc::new(out);
    memo.insert(key, out.clone());
    Ok((out, p))
}

/// `path` as the directory PTX files are written to (tools/ptxas_report.sh).
pub fn write_ptx(dir: &Path, c: &Compiled) -> Result<()> {
    let p = dir.join(format!("{}.{}.ptx", c.file.trim_end_matches(".cu"), c.arch));
    crate::util::write_atomic(&p, c.ptx.as_bytes())
}
