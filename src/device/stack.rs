//! The CUDA software stack a CUDA run uses: the NVIDIA driver (`libcuda.so.1`), NVRTC with the
//! CUDA headers of its own release, and cuBLAS — CUDA 12 or CUDA 13, found where users have them.
//!
//! Each library is looked for in these places, in order; the first usable one wins:
//! 1. a file named explicitly: `MEGATRAIN_NVRTC_LIB`, `MEGATRAIN_CUBLAS_LIB` (used as given, or
//!    an error — never passed over);
//! 2. a Python environment named explicitly: `MEGATRAIN_CUDA_VENV` (a venv or conda root, its
//!    `site-packages`, or its `python`), holding NVIDIA's pip wheels;
//! 3. the CUDA toolkit: `$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda`, then `/usr/local/cuda-13*`
//!    and `/usr/local/cuda-12*`, newest first (`lib64`, `lib`, `targets/<arch>-linux/lib`);
//! 4. the dynamic linker's own search by soname (`LD_LIBRARY_PATH`, `ld.so.cache`);
//! 5. NVIDIA's pip wheels in the Python environments of this machine: `$VIRTUAL_ENV`,
//!    `$CONDA_PREFIX`, every `python3` on `PATH` (PyTorch's venv among them), `~/.local`, the
//!    system's `dist-packages`, and the environments `tools/setup-cuda-wheels.sh` makes
//!    (`~/.cache/megatrain/cuda{13,12}-wheels`).
//!
//! In a wheel, CUDA 13 keeps everything in `nvidia/cu13/{lib,include}`; CUDA 12 keeps each
//! library in its own folder (`nvidia/cuda_nvrtc/lib`, `nvidia/cublas/lib`, headers in
//! `nvidia/cuda_runtime/include`). A library for a newer CUDA than the driver runs is passed over
//! (CUDA 13 needs a driver for CUDA 13.0, R580 or newer), as is an NVRTC without the headers of
//! its own release beside it (`MEGATRAIN_CUDA_INCLUDE` names them explicitly).
//!
//! Nothing here needs the `cuda` feature: the search is plain files and `dlopen`, so `megatrain
//! probe` reports the stack of any machine. The CUDA device ([`super::cuda`]) opens the chosen
//! libraries by absolute path before cudarc's first call, so cudarc's lookup by soname binds
//! the same ones.

use crate::{Error, Result};
use std::ffi::{c_int, c_void, CStr, CString, OsString};
use std::path::{Path, PathBuf};

/// The CUDA major versions megatrain runs on, newest first.
pub const MAJORS: [u32; 2] = [13, 12];

/// A CUDA library megatrain loads beside the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Library {
    /// The run-time compiler of the kernels.
    Nvrtc,
    /// The GEMMs.
    Cublas,
}

impl Library {
    /// The name users know it by.
    pub fn name(self) -> &'static str {
        match self {
            Library::Nvrtc => "NVRTC",
            Library::Cublas => "cuBLAS",
        }
    }

    fn stem(self) -> &'static str {
        match self {
            Library::Nvrtc => "nvrtc",
            Library::Cublas => "cublas",
        }
    }

    /// The variable naming the library file explicitly.
    pub fn env(self) -> &'static str {
        match self {
            Library::Nvrtc => "MEGATRAIN_NVRTC_LIB",
            Library::Cublas => "MEGATRAIN_CUBLAS_LIB",
        }
    }

    /// `libnvrtc.so.13`.
    pub fn soname(self, major: u32) -> String {
        format!("lib{}.so.{major}", self.stem())
    }

    /// Where a wheel of CUDA `major` keeps it, under `site-packages`.
    fn wheel_dir(self, major: u32) -> &'static str {
        match (self, major) {
            (_, 13) => "nvidia/cu13/lib",
            (Library::Nvrtc, _) => "nvidia/cuda_nvrtc/lib",
            (Library::Cublas, _) => "nvidia/cublas/lib",
        }
    }

    /// The pip packages that hold it (CUDA 13, CUDA 12).
    fn wheels(self) -> (&'static str, &'static str) {
        match self {
            Library::Nvrtc => (
                "nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cuda-crt",
                "nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12",
            ),
            Library::Cublas => ("nvidia-cublas", "nvidia-cublas-cu12"),
        }
    }
}

/// Where a library was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// The variable that named the file.
    Given(&'static str),
    /// The Python environment `MEGATRAIN_CUDA_VENV` names (its `site-packages`).
    GivenVenv(PathBuf),
    /// A CUDA toolkit (its root).
    Toolkit(PathBuf),
    /// The dynamic linker's search by soname.
    Loader,
    /// NVIDIA's pip wheels in this `site-packages`.
    Wheels(PathBuf),
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Given(var) => write!(f, "{var}"),
            Origin::GivenVenv(site) => write!(f, "MEGATRAIN_CUDA_VENV: {}", site.display()),
            Origin::Toolkit(root) => write!(f, "CUDA toolkit {}", root.display()),
            Origin::Loader => write!(f, "the dynamic linker's path"),
            Origin::Wheels(site) => write!(f, "pip wheels in {}", site.display()),
        }
    }
}

/// A library file that may be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// Which library.
    pub library: Library,
    /// The file.
    pub path: PathBuf,
    /// Its CUDA major version, from its name (`None`: a name without one, `libnvrtc.so`).
    pub major: Option<u32>,
    /// Where it was found.
    pub origin: Origin,
    /// Where the CUDA headers of its release would be (NVRTC: the first holding `cuda_bf16.h`
    /// is used).
    pub include: Vec<PathBuf>,
}

/// The places a search looks in, from the environment (or given, in tests).
#[derive(Debug, Clone, Default)]
pub struct Places {
    /// `MEGATRAIN_NVRTC_LIB`, `MEGATRAIN_CUBLAS_LIB`.
    pub given: Vec<(Library, PathBuf)>,
    /// `MEGATRAIN_CUDA_INCLUDE`.
    pub given_include: Option<PathBuf>,
    /// `site-packages` folders of `MEGATRAIN_CUDA_VENV`.
    pub given_venv: Vec<PathBuf>,
    /// Toolkit roots, in order.
    pub toolkits: Vec<PathBuf>,
    /// Whether to ask the dynamic linker.
    pub loader: bool,
    /// `LD_LIBRARY_PATH`'s folders (searched by hand first, for a readable path).
    pub loader_dirs: Vec<PathBuf>,
    /// Other `site-packages` folders, in order.
    pub sites: Vec<PathBuf>,
}

fn var(name: &str) -> Option<OsString> {
    std::env::var_os(name).filter(|v| !v.is_empty())
}

/// `site-packages` (and `dist-packages`) folders under a Python prefix: `lib/python3.*/…`,
/// `lib64/python3.*/…`, or `prefix` itself when it is one.
pub fn sites_of(prefix: &Path) -> Vec<PathBuf> {
    if prefix.join("nvidia").is_dir() || prefix.ends_with("site-packages") {
        return vec![prefix.to_path_buf()];
    }
    // A python executable: its environment is two folders up (`ENV/bin/python3`).
    if prefix.is_file() {
        return prefix
            .parent()
            .and_then(Path::parent)
            .map(sites_of)
            .unwrap_or_default();
    }
    let mut out = Vec::new();
    // `pip install --target DIR/site` (tools/setup-cuda-wheels.sh without a venv module).
    if prefix.join("site/nvidia").is_dir() {
        out.push(prefix.join("site"));
    }
    for lib in ["lib", "lib64"] {
        let Ok(rd) = std::fs::read_dir(prefix.join(lib)) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = rd
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        // Newest Python first (python3.12 before python3.9).
        pythons.sort_by_key(|p| {
            std::cmp::Reverse(
                p.file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_prefix("python3."))
                    .and_then(|m| m.parse::<u32>().ok())
                    .unwrap_or(0),
            )
        });
        for p in pythons {
            for sub in ["site-packages", "dist-packages"] {
                if p.join(sub).is_dir() {
                    out.push(p.join(sub));
                }
            }
        }
    }
    // A venv's `lib64` is often a link to its `lib`: one folder, looked in once.
    let mut seen = Vec::new();
    out.retain(|p| {
        let real = std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
        if seen.contains(&real) {
            false
        } else {
            seen.push(real);
            true
        }
    });
    out
}

fn push_unique(v: &mut Vec<PathBuf>, p: PathBuf) {
    if !v.contains(&p) {
        v.push(p);
    }
}

/// `/usr/local/cuda-13.0`, `/usr/local/cuda-12.9`, … newest first.
fn versioned_toolkits(dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<(Vec<u32>, PathBuf)> = rd
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let ver = name.strip_prefix("cuda-")?;
            let nums: Vec<u32> = ver
                .split('.')
                .map(|x| x.parse().ok())
                .collect::<Option<_>>()?;
            Some((nums, e.path()))
        })
        .collect();
    v.sort_by(|a, b| b.0.cmp(&a.0));
    v.into_iter().map(|(_, p)| p).collect()
}

impl Places {
    /// The places of this process's environment (module docs).
    pub fn from_env() -> Places {
        let mut p = Places {
            loader: true,
            ..Places::default()
        };
        for lib in [Library::Nvrtc, Library::Cublas] {
            if let Some(f) = var(lib.env()) {
                p.given.push((lib, PathBuf::from(f)));
            }
        }
        p.given_include = var("MEGATRAIN_CUDA_INCLUDE").map(PathBuf::from);
        if let Some(v) = var("MEGATRAIN_CUDA_VENV") {
            p.given_venv = sites_of(Path::new(&v));
            if p.given_venv.is_empty() {
                // Named but holding no site-packages: looked in (and reported) as it is.
                p.given_venv.push(PathBuf::from(v));
            }
        }
        for v in ["CUDA_HOME", "CUDA_PATH"] {
            if let Some(r) = var(v) {
                push_unique(&mut p.toolkits, PathBuf::from(r));
            }
        }
        push_unique(&mut p.toolkits, PathBuf::from("/usr/local/cuda"));
        for r in versioned_toolkits(Path::new("/usr/local")) {
            push_unique(&mut p.toolkits, r);
        }
        if let Some(ld) = var("LD_LIBRARY_PATH") {
            p.loader_dirs = std::env::split_paths(&ld)
                .filter(|d| !d.as_os_str().is_empty())
                .collect();
        }
        let mut sites = Vec::new();
        for v in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
            if let Some(r) = var(v) {
                for s in sites_of(Path::new(&r)) {
                    push_unique(&mut sites, s);
                }
            }
        }
        if let Some(path) = var("PATH") {
            for dir in std::env::split_paths(&path) {
                if dir.join("python3").is_file() || dir.join("python").is_file() {
                    if let Some(root) = dir.parent() {
                        for s in sites_of(root) {
                            push_unique(&mut sites, s);
                        }
                    }
                }
            }
        }
        let home = var("HOME").map(PathBuf::from);
        if let Some(h) = &home {
            for s in sites_of(&h.join(".local")) {
                push_unique(&mut sites, s);
            }
        }
        for sys in ["/usr/local", "/usr"] {
            for s in sites_of(Path::new(sys)) {
                push_unique(&mut sites, s);
            }
        }
        if let Some(h) = &home {
            for m in MAJORS {
                for s in sites_of(&h.join(format!(".cache/megatrain/cuda{m}-wheels"))) {
                    push_unique(&mut sites, s);
                }
            }
        }
        // Already looked in as the given environment.
        sites.retain(|s| !p.given_venv.contains(s));
        p.sites = sites;
        p
    }
}

/// The architecture folder of a toolkit's `targets/` (`x86_64-linux`, `sbsa-linux`).
fn target_dir() -> &'static str {
    if cfg!(target_arch = "aarch64") {
        "targets/sbsa-linux"
    } else {
        "targets/x86_64-linux"
    }
}

/// A library file's CUDA major version from its name or, through links, its target's name
/// (`libnvrtc.so.12`, `libnvrtc.so` → `libnvrtc.so.12.9.86`).
pub fn major_of(path: &Path) -> Option<u32> {
    let from_name = |p: &Path| -> Option<u32> {
        let name = p.file_name()?.to_str()?;
        let (_, ver) = name.split_once(".so.")?;
        ver.split('.').next()?.parse().ok()
    };
    from_name(path).or_else(|| from_name(&std::fs::canonicalize(path).ok()?))
}

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

/// Where the CUDA headers of a library's release would be, beside it.
fn include_dirs(places: &Places, origin: &Origin, dir: &Path, major: Option<u32>) -> Vec<PathBuf> {
    if let Some(i) = &places.given_include {
        return vec![i.clone()];
    }
    match origin {
        Origin::GivenVenv(site) | Origin::Wheels(site) => match major {
            Some(13) => vec![site.join("nvidia/cu13/include")],
            _ => vec![site.join("nvidia/cuda_runtime/include")],
        },
        Origin::Toolkit(root) => vec![
            root.join("include"),
            root.join(target_dir()).join("include"),
        ],
        Origin::Given(_) | Origin::Loader => {
            // Beside the library, the way a toolkit or a wheel lays it out.
            let mut inc: Vec<PathBuf> = [dir.parent(), dir.parent().and_then(Path::parent)]
                .into_iter()
                .flatten()
                .map(|up| up.join("include"))
                .collect();
            if let Some(site) = dir.ancestors().find(|a| a.join("nvidia").is_dir()) {
                inc.push(site.join("nvidia/cuda_runtime/include"));
            }
            inc.push(PathBuf::from("/usr/include"));
            inc
        }
    }
}

/// Every file that may be `lib`, in the order of the places, and a description of each place
/// looked in (for the error when none is usable). `loader` asks the dynamic linker for a soname.
pub fn candidates(
    lib: Library,
    places: &Places,
    loader: &dyn Fn(&str) -> Option<PathBuf>,
) -> (Vec<Candidate>, Vec<String>) {
    let mut found: Vec<Candidate> = Vec::new();
    let mut looked = Vec::new();
    let mut add = |path: PathBuf, origin: Origin| {
        if found.iter().any(|c| c.path == path) {
            return;
        }
        let major = major_of(&path);
        let dir = path.parent().unwrap_or(Path::new("/")).to_path_buf();
        let include = include_dirs(places, &origin, &dir, major);
        found.push(Candidate {
            library: lib,
            path,
            major,
            origin,
            include,
        });
    };
    if let Some((_, file)) = places.given.iter().find(|(l, _)| *l == lib) {
        // Used as given: a missing file is the caller's error to report, not a reason to look
        // elsewhere.
        looked.push(format!("{}={}", lib.env(), file.display()));
        add(file.clone(), Origin::Given(lib.env()));
        return (found, looked);
    }
    let in_wheels = |site: &Path| {
        MAJORS
            .iter()
            .map(|&m| site.join(lib.wheel_dir(m)).join(lib.soname(m)))
            .filter(|f| f.is_file())
            .collect::<Vec<_>>()
    };
    for site in &places.given_venv {
        looked.push(format!("MEGATRAIN_CUDA_VENV {}", site.display()));
        for f in in_wheels(site) {
            add(f, Origin::GivenVenv(site.clone()));
        }
    }
    for root in places.toolkits.iter().filter(|r| r.is_dir()) {
        looked.push(format!("toolkit {}", root.display()));
        for sub in [
            "lib64".to_owned(),
            "lib".to_owned(),
            format!("{}/lib", target_dir()),
        ] {
            for m in MAJORS {
                let f = root.join(&sub).join(lib.soname(m));
                if f.is_file() {
                    add(f, Origin::Toolkit(root.clone()));
                }
            }
        }
    }
    if places.loader {
        looked.push("the dynamic linker's path".into());
        for m in MAJORS {
            let soname = lib.soname(m);
            let by_hand = places
                .loader_dirs
                .iter()
                .map(|d| d.join(&soname))
                .find(|f| f.is_file());
            if let Some(f) = by_hand.or_else(|| loader(&soname)) {
                add(f, Origin::Loader);
            }
        }
    }
    for site in places.sites.iter().filter(|s| s.join("nvidia").is_dir()) {
        looked.push(format!("pip wheels in {}", site.display()));
        for f in in_wheels(site) {
            add(f, Origin::Wheels(site.clone()));
        }
    }
    (found, looked)
}

/// A CUDA version, as `major.minor` (and a patch level where the library gives one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct Version {
    /// Major.
    pub major: u32,
    /// Minor.
    pub minor: u32,
    /// Patch level (cuBLAS), else 0.
    pub patch: u32,
}

impl Version {
    /// From the driver's encoding (13000 → 13.0).
    pub fn from_cuda(v: i32) -> Version {
        let v = v.max(0) as u32;
        Version {
            major: v / 1000,
            minor: v % 1000 / 10,
            patch: 0,
        }
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)?;
        if self.patch > 0 {
            write!(f, ".{}", self.patch)?;
        }
        Ok(())
    }
}

/// The CUDA release of a header folder: `CUDART_VERSION` in `cuda_runtime_api.h`, else
/// `CUDA_VERSION` in `cuda.h` (`None`: neither says).
pub fn header_version(include: &Path) -> Option<Version> {
    for (file, define) in [
        ("cuda_runtime_api.h", "CUDART_VERSION"),
        ("cuda.h", "CUDA_VERSION"),
    ] {
        let Ok(text) = std::fs::read_to_string(include.join(file)) else {
            continue;
        };
        let v = text.lines().find_map(|l| {
            let rest = l.trim().strip_prefix("#define")?.trim_start();
            let rest = rest.strip_prefix(define)?;
            if !rest.starts_with(char::is_whitespace) {
                return None;
            }
            rest.trim().parse::<i32>().ok()
        });
        if let Some(v) = v {
            return Some(Version::from_cuda(v));
        }
    }
    None
}

/// The headers NVRTC compiles the kernels with.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Headers {
    /// The folder holding `cuda_bf16.h`.
    pub dir: PathBuf,
    /// Their release (`None`: the folder does not say).
    pub version: Option<Version>,
}

/// The usable headers among `c.include` for an NVRTC of CUDA `major`, or why none is.
fn headers_for(c: &Candidate, major: Option<u32>) -> std::result::Result<Headers, String> {
    let mut why = Vec::new();
    for dir in &c.include {
        if !dir.join("cuda_bf16.h").is_file() {
            why.push(format!("no cuda_bf16.h in {}", dir.display()));
            continue;
        }
        let version = header_version(dir);
        match (version, major) {
            (Some(v), Some(m)) if v.major != m => why.push(format!(
                "the headers in {} are CUDA {v}, NVRTC is CUDA {m}",
                dir.display()
            )),
            _ => {
                return Ok(Headers {
                    dir: dir.clone(),
                    version,
                })
            }
        }
    }
    Err(why.join("; "))
}

/// What [`choose`] picked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chosen {
    /// The library file.
    pub candidate: Candidate,
    /// NVRTC's headers.
    pub headers: Option<Headers>,
}

/// The first usable candidate: its CUDA major at most the driver's (when known), preferring
/// `prefer_major` when one has it (cuBLAS of NVRTC's release), and for NVRTC with headers of its
/// release. `Err`: why each was passed over.
pub fn choose(
    found: &[Candidate],
    driver_major: Option<u32>,
    prefer_major: Option<u32>,
) -> std::result::Result<Chosen, Vec<String>> {
    let mut why = Vec::new();
    let mut order: Vec<&Candidate> = found.iter().collect();
    if let Some(p) = prefer_major {
        // Stable: the places' order within each group.
        order.sort_by_key(|c| c.major != Some(p));
    }
    for c in order {
        if !c.path.is_file() {
            why.push(format!("{} does not exist", c.path.display()));
            continue;
        }
        if let (Some(m), Some(d)) = (c.major, driver_major) {
            if m > d {
                why.push(format!(
                    "{} is CUDA {m}, newer than the driver's CUDA {d}",
                    c.path.display()
                ));
                continue;
            }
        }
        if let Some(m) = c.major {
            if !MAJORS.contains(&m) {
                why.push(format!(
                    "{} is CUDA {m}; megatrain runs on CUDA 12 and 13",
                    c.path.display()
                ));
                continue;
            }
        }
        let headers = match c.library {
            Library::Cublas => None,
            Library::Nvrtc => match headers_for(c, c.major) {
                Ok(h) => Some(h),
                Err(e) => {
                    why.push(format!("{}: {e}", c.path.display()));
                    continue;
                }
            },
        };
        return Ok(Chosen {
            candidate: c.clone(),
            headers,
        });
    }
    Err(why)
}

/// A library in use: where, from where, which version.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Loaded {
    /// The file opened.
    pub path: PathBuf,
    /// Where it was found (as text).
    pub origin: String,
    /// The version the library reports.
    pub version: Version,
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
struct Handle(*mut c_void);

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
/// (cudarc's) finds it. The handle is kept for the process.
fn open_global(lib: &Path) -> std::result::Result<Handle, String> {
    let path = CString::new(lib.as_os_str().as_encoded_bytes())
        .map_err(|_| "the path contains NUL".to_owned())?;
    // SAFETY: dlopen with a valid C string; the handle is deliberately leaked (the library stays
    // loaded for the process, as cudarc expects).
    let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        return Err(dlerror_text());
    }
    Ok(Handle(h))
}

fn symbol(h: Handle, name: &str) -> Option<*mut c_void> {
    let c = CString::new(name).ok()?;
    // SAFETY: a live handle and a valid C string.
    let p = unsafe { libc::dlsym(h.0, c.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// Open `lib` by absolute path (idempotent) and return the address of `symbol` in it: what a
/// caller compares with what cudarc bound.
pub fn open_library(lib: &Path, sym: &str) -> Result<*mut c_void> {
    let h =
        open_global(lib).map_err(|why| Error::system("dlopen", lib.display().to_string(), why))?;
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
fn open_companions(nvrtc: &Path) -> Result<()> {
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
        open_global(&b)
            .map_err(|why| Error::system("NVRTC", format!("load {}", b.display()), why))?;
    }
    Ok(())
}

/// The driver's kernel module version, from `/proc/driver/nvidia/version`
/// (`NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  …`).
pub fn kernel_module_version() -> Option<String> {
    let text = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
    parse_module_version(&text)
}

fn parse_module_version(text: &str) -> Option<String> {
    let line = text.lines().find(|l| l.starts_with("NVRM version"))?;
    line.split_whitespace()
        .find(|w| {
            w.chars().next().is_some_and(|c| c.is_ascii_digit())
                && w.contains('.')
                && w.chars().all(|c| c.is_ascii_digit() || c == '.')
        })
        .map(str::to_owned)
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
        module: kernel_module_version(),
    })
}

/// The names cudarc (built for CUDA 13) asks the dynamic linker for, in its order; its
/// Windows-style `lib…64_*` names do not exist on Linux and are left out.
fn cudarc_names(lib: Library) -> Vec<String> {
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
fn library_version(lib: Library, h: Handle) -> Option<Version> {
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

/// The fix for a library that is missing or unusable: what works offline first.
fn fix_for(lib: Library, driver: Option<Version>) -> String {
    let (cu13, cu12) = lib.wheels();
    let pip = match driver.map(|d| d.major) {
        Some(12) => format!("`pip install {cu12}`"),
        _ => format!("`pip install {cu13}` (CUDA 13) or `{cu12}` (CUDA 12)"),
    };
    format!(
        "set MEGATRAIN_CUDA_VENV to a Python environment holding NVIDIA's CUDA wheels (PyTorch's venv has them; no network needed), or {} to a {} of a CUDA toolkit; with network, {pip} or tools/setup-cuda-wheels.sh",
        lib.env(),
        match lib {
            Library::Nvrtc => "libnvrtc.so.13/.so.12",
            Library::Cublas => "libcublas.so.13/.so.12",
        }
    )
}

/// Find, choose and open `lib` for a driver of `driver` (`None`: no driver, compiling only),
/// preferring `prefer_major`. Returns the library and, for NVRTC, its headers.
pub fn load(
    lib: Library,
    places: &Places,
    driver: Option<Version>,
    prefer_major: Option<u32>,
) -> Result<(Loaded, Option<Headers>)> {
    let symbol_name = match lib {
        Library::Nvrtc => "nvrtcVersion",
        Library::Cublas => "cublasGetProperty",
    };
    let (found, looked) = candidates(lib, places, &|s| loader_lookup(s, symbol_name));
    let mut chosen = choose(&found, driver.map(|d| d.major), prefer_major).map_err(|why| {
        let what = if found.is_empty() {
            format!("not found (looked in: {})", looked.join(", "))
        } else {
            format!(
                "none usable ({}; looked in: {})",
                why.join("; "),
                looked.join(", ")
            )
        };
        Error::bad_input(
            lib.name(),
            format!("{} or {}", lib.soname(13), lib.soname(12)),
            what,
            None,
        )
        .with_fix(fix_for(lib, driver))
    })?;
    // cudarc binds by soname, in its own order: where that finds another file first, that file
    // is what runs — so it is the one chosen, if usable; else the conflict is named.
    let lookup = |s: &str| loader_lookup(s, symbol_name);
    if let Some(other) = cudarc_would_bind(lib, &chosen.candidate.path, &lookup) {
        // Named explicitly (a file, or a venv): not overridden, a conflict is an error.
        let given = places.given.iter().any(|(l, _)| *l == lib)
            || matches!(chosen.candidate.origin, Origin::GivenVenv(_));
        let major = major_of(&other);
        let dir = other.parent().unwrap_or(Path::new("/")).to_path_buf();
        let theirs = Candidate {
            library: lib,
            include: include_dirs(places, &Origin::Loader, &dir, major),
            path: other.clone(),
            major,
            origin: Origin::Loader,
        };
        match choose(&[theirs], driver.map(|d| d.major), None) {
            Ok(c) if !given => chosen = c,
            usable => {
                let why = match usable {
                    Ok(_) => format!(
                        "while {} is what was named ({})",
                        chosen.candidate.path.display(),
                        chosen.candidate.origin
                    ),
                    Err(why) => format!("which is unusable here: {}", why.join("; ")),
                };
                return Err(Error::system(
                    lib.name(),
                    format!("use {}", chosen.candidate.path.display()),
                    format!(
                        "the dynamic linker gave cudarc {} instead (cudarc asks for {} in that order), {why}",
                        other.display(),
                        cudarc_names(lib).join(", ")
                    ),
                )
                .with_fix(format!(
                    "take {}'s folder off LD_LIBRARY_PATH (or out of ld.so.cache, /etc/ld.so.conf.d), or point {} at it",
                    other.display(),
                    lib.env()
                )));
            }
        }
    }
    let c = &chosen.candidate;
    if lib == Library::Nvrtc {
        open_companions(&c.path)?;
    }
    let h = open_global(&c.path).map_err(|why| {
        Error::system(lib.name(), format!("load {}", c.path.display()), why)
            .with_fix(fix_for(lib, driver))
    })?;
    let version = library_version(lib, h).ok_or_else(|| {
        Error::system(
            lib.name(),
            format!("use {}", c.path.display()),
            format!("loaded, but it does not say its version ({symbol_name})"),
        )
    })?;
    if let Some(d) = driver {
        if version.major > d.major {
            return Err(Error::system(
                lib.name(),
                format!("use {}", c.path.display()),
                format!("it is CUDA {version}, newer than the driver's CUDA {}", d),
            )
            .with_fix(format!(
                "update the NVIDIA driver, or point {} at a CUDA {} library",
                lib.env(),
                d.major
            )));
        }
    }
    if let Some(m) = c.major {
        if version.major != m {
            return Err(Error::system(
                lib.name(),
                format!("use {}", c.path.display()),
                format!("named for CUDA {m} but reports CUDA {version}"),
            ));
        }
    }
    if let Some(h) = &chosen.headers {
        if let Some(hv) = h.version {
            if hv.major != version.major {
                return Err(Error::bad_input(
                    "CUDA headers",
                    h.dir.display().to_string(),
                    format!(
                        "they are CUDA {hv}, NVRTC {} is CUDA {version}",
                        c.path.display()
                    ),
                    Some(
                        "set MEGATRAIN_CUDA_INCLUDE to the `include` folder of NVRTC's own release",
                    ),
                ));
            }
        }
    }
    Ok((
        Loaded {
            path: c.path.clone(),
            origin: c.origin.to_string(),
            version,
        },
        chosen.headers,
    ))
}

/// The driver ([`driver`]), refused by version when it is older than [`MIN_DRIVER`].
pub fn supported_driver() -> Result<Driver> {
    let driver = driver()?;
    if driver.cuda_code < MIN_DRIVER {
        return Err(Error::system(
            "CUDA driver",
            format!("the version check of {}", driver.path.display()),
            format!(
                "it supports CUDA {}{}; megatrain needs CUDA {} or newer",
                driver.cuda,
                driver
                    .module
                    .as_ref()
                    .map(|m| format!(" (driver {m})"))
                    .unwrap_or_default(),
                Version::from_cuda(MIN_DRIVER)
            ),
        )
        .with_fix("update the NVIDIA driver to R570 or newer (R580 for CUDA 13)"));
    }
    Ok(driver)
}

/// Everything a CUDA run uses.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Stack {
    /// The driver.
    pub driver: Driver,
    /// NVRTC.
    pub nvrtc: Loaded,
    /// The headers NVRTC compiles with.
    pub headers: Headers,
    /// cuBLAS.
    pub cublas: Loaded,
}

/// The oldest driver megatrain runs on: CUDA 12.8 (R570), for the driver API calls it makes
/// (`cuEventElapsedTime_v2`).
pub const MIN_DRIVER: i32 = 12080;

impl Stack {
    /// Load the driver, check its version, then find and open NVRTC (with its headers) and
    /// cuBLAS for it.
    pub fn open() -> Result<Stack> {
        let driver = supported_driver()?;
        let places = Places::from_env();
        let (nvrtc, headers) = load(Library::Nvrtc, &places, Some(driver.cuda), None)?;
        let headers =
            headers.ok_or_else(|| Error::internal("CUDA stack", "NVRTC chosen without headers"))?;
        let (cublas, _) = load(
            Library::Cublas,
            &places,
            Some(driver.cuda),
            Some(nvrtc.version.major),
        )?;
        Ok(Stack {
            driver,
            nvrtc,
            headers,
            cublas,
        })
    }

    /// One line per component: version, file, where it was found.
    pub fn lines(&self) -> Vec<String> {
        let d = &self.driver;
        vec![
            format!(
                "CUDA driver   {:<22} {}",
                match &d.module {
                    Some(m) => format!("{m} (CUDA {})", d.cuda),
                    None => format!("CUDA {}", d.cuda),
                },
                d.path.display()
            ),
            format!(
                "NVRTC         {:<22} {} ({})",
                self.nvrtc.version.to_string(),
                self.nvrtc.path.display(),
                self.nvrtc.origin
            ),
            format!(
                "CUDA headers  {:<22} {}",
                self.headers
                    .version
                    .map(|v| v.to_string())
                    .unwrap_or_else(|| "release not stated".into()),
                self.headers.dir.display()
            ),
            format!(
                "cuBLAS        {:<22} {} ({})",
                self.cublas.version.to_string(),
                self.cublas.path.display(),
                self.cublas.origin
            ),
        ]
    }
}

/// NVRTC and its headers for compiling only (no driver, no GPU: the test suite, `ptxas`
/// reports): the first usable one of the places.
pub fn compiler() -> Result<(Loaded, Headers)> {
    let (nvrtc, headers) = load(Library::Nvrtc, &Places::from_env(), None, None)?;
    let headers =
        headers.ok_or_else(|| Error::internal("CUDA stack", "NVRTC chosen without headers"))?;
    Ok((nvrtc, headers))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(p: &Path) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, b"").unwrap();
    }

    fn headers(dir: &Path, version: i32) {
        touch(&dir.join("cuda_bf16.h"));
        std::fs::write(
            dir.join("cuda_runtime_api.h"),
            format!("/* x */\n#define CUDART_VERSION  {version}\n#define CUDART_VERSION_X 1\n"),
        )
        .unwrap();
    }

    fn none(_: &str) -> Option<PathBuf> {
        None
    }

    #[test]
    fn wheels_of_both_layouts_are_found_newest_first_with_their_headers() {
        let t = tempfile::tempdir().unwrap();
        let site = t.path().join("venv/lib/python3.12/site-packages");
        touch(&site.join("nvidia/cu13/lib/libnvrtc.so.13"));
        headers(&site.join("nvidia/cu13/include"), 13000);
        touch(&site.join("nvidia/cuda_nvrtc/lib/libnvrtc.so.12"));
        headers(&site.join("nvidia/cuda_runtime/include"), 12090);
        let places = Places {
            sites: sites_of(&t.path().join("venv")),
            ..Places::default()
        };
        assert_eq!(places.sites, vec![site.clone()]);
        let (found, looked) = candidates(Library::Nvrtc, &places, &none);
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(found[0].major, Some(13));
        assert_eq!(found[1].major, Some(12));
        assert!(looked[0].contains("site-packages"), "{looked:?}");
        // A CUDA 13 driver takes CUDA 13; a CUDA 12 driver passes it over, saying why.
        let c = choose(&found, Some(13), None).unwrap();
        assert_eq!(
            c.candidate.path,
            site.join("nvidia/cu13/lib/libnvrtc.so.13")
        );
        assert_eq!(
            c.headers.unwrap(),
            Headers {
                dir: site.join("nvidia/cu13/include"),
                version: Some(Version {
                    major: 13,
                    minor: 0,
                    patch: 0
                }),
            }
        );
        let c = choose(&found, Some(12), None).unwrap();
        assert_eq!(c.candidate.major, Some(12));
        assert_eq!(
            c.headers.unwrap().dir,
            site.join("nvidia/cuda_runtime/include")
        );
        let why = choose(&found[..1], Some(12), None).unwrap_err();
        assert!(
            why[0].contains("newer than the driver's CUDA 12"),
            "{why:?}"
        );
    }

    #[test]
    fn an_nvrtc_without_headers_of_its_release_is_passed_over() {
        let t = tempfile::tempdir().unwrap();
        let site = t.path().join("site-packages");
        touch(&site.join("nvidia/cu13/lib/libnvrtc.so.13"));
        // CUDA 12 headers where CUDA 13's belong.
        headers(&site.join("nvidia/cu13/include"), 12090);
        touch(&site.join("nvidia/cuda_nvrtc/lib/libnvrtc.so.12"));
        let places = Places {
            sites: vec![site.clone()],
            ..Places::default()
        };
        let (found, _) = candidates(Library::Nvrtc, &places, &none);
        let why = choose(&found, Some(13), None).unwrap_err();
        assert_eq!(why.len(), 2, "{why:?}");
        assert!(
            why[0].contains("are CUDA 12.9, NVRTC is CUDA 13"),
            "{why:?}"
        );
        assert!(why[1].contains("no cuda_bf16.h"), "{why:?}");
        // The given headers win, and are checked the same way.
        let places = Places {
            given_include: Some(site.join("nvidia/cu13/include")),
            ..places
        };
        let (found, _) = candidates(Library::Nvrtc, &places, &none);
        let c = choose(&found, Some(13), None).unwrap();
        assert_eq!(c.candidate.major, Some(12));
    }

    #[test]
    fn places_come_in_order_and_a_given_file_is_never_passed_over() {
        let t = tempfile::tempdir().unwrap();
        let tk = t.path().join("cuda-12.9");
        touch(&tk.join("lib64/libcublas.so.12"));
        let given_venv = t.path().join("given/lib/python3.11/site-packages");
        touch(&given_venv.join("nvidia/cu13/lib/libcublas.so.13"));
        let ld = t.path().join("ld");
        touch(&ld.join("libcublas.so.13"));
        let site = t.path().join("other");
        touch(&site.join("nvidia/cublas/lib/libcublas.so.12"));
        let places = Places {
            given_venv: sites_of(&t.path().join("given")),
            toolkits: vec![tk.clone(), t.path().join("absent")],
            loader: true,
            loader_dirs: vec![ld.clone()],
            sites: vec![site.clone()],
            ..Places::default()
        };
        let (found, looked) = candidates(Library::Cublas, &places, &none);
        let paths: Vec<&Path> = found.iter().map(|c| c.path.as_path()).collect();
        assert_eq!(
            paths,
            vec![
                given_venv.join("nvidia/cu13/lib/libcublas.so.13").as_path(),
                tk.join("lib64/libcublas.so.12").as_path(),
                ld.join("libcublas.so.13").as_path(),
                site.join("nvidia/cublas/lib/libcublas.so.12").as_path(),
            ]
        );
        assert_eq!(looked.len(), 4, "{looked:?}");
        assert_eq!(found[1].origin, Origin::Toolkit(tk.clone()));
        // cuBLAS of NVRTC's release first, when there is one the driver runs.
        let c = choose(&found, Some(13), Some(12)).unwrap();
        assert_eq!(c.candidate.path, tk.join("lib64/libcublas.so.12"));
        let c = choose(&found, Some(13), Some(13)).unwrap();
        assert_eq!(c.candidate.major, Some(13));
        // A given file is the only candidate, even when missing.
        let places = Places {
            given: vec![(Library::Cublas, t.path().join("nope/libcublas.so.12"))],
            ..places
        };
        let (found, looked) = candidates(Library::Cublas, &places, &none);
        assert_eq!(found.len(), 1);
        assert_eq!(
            looked,
            vec![format!(
                "MEGATRAIN_CUBLAS_LIB={}",
                t.path().join("nope/libcublas.so.12").display()
            )]
        );
        assert!(choose(&found, Some(13), None).unwrap_err()[0].contains("does not exist"));
    }

    #[test]
    fn the_loader_is_asked_by_soname_when_no_folder_holds_the_library() {
        let t = tempfile::tempdir().unwrap();
        let lib = t.path().join("usr/lib/libnvrtc.so.12");
        touch(&lib);
        headers(&t.path().join("usr/include"), 12040);
        let places = Places {
            loader: true,
            ..Places::default()
        };
        let asked = std::cell::RefCell::new(Vec::new());
        let loader = |s: &str| {
            asked.borrow_mut().push(s.to_owned());
            (s == "libnvrtc.so.12").then(|| lib.clone())
        };
        let (found, _) = candidates(Library::Nvrtc, &places, &loader);
        assert_eq!(*asked.borrow(), vec!["libnvrtc.so.13", "libnvrtc.so.12"]);
        let c = choose(&found, None, None).unwrap();
        assert_eq!(c.candidate.origin, Origin::Loader);
        assert_eq!(c.headers.unwrap().dir, t.path().join("usr/include"));
    }

    #[test]
    fn versions_are_read_from_names_links_and_headers() {
        let t = tempfile::tempdir().unwrap();
        let real = t.path().join("libnvrtc.so.12.9.86");
        touch(&real);
        let link = t.path().join("libnvrtc.so");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert_eq!(major_of(&link), Some(12));
        assert_eq!(major_of(Path::new("/x/libcublas.so.13")), Some(13));
        assert_eq!(major_of(Path::new("/x/libcublas.so")), None);
        headers(t.path(), 13010);
        assert_eq!(
            header_version(t.path()),
            Some(Version {
                major: 13,
                minor: 1,
                patch: 0
            })
        );
        assert_eq!(Version::from_cuda(12080).to_string(), "12.8");
        assert_eq!(
            parse_module_version(
                "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Tue Oct 14 2025\nGCC version: gcc 12\n"
            ),
            Some("580.159.04".into())
        );
        assert_eq!(parse_module_version("garbage"), None);
    }

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

    #[test]
    fn a_missing_library_names_where_it_looked_and_an_offline_fix() {
        let t = tempfile::tempdir().unwrap();
        let places = Places {
            toolkits: vec![t.path().to_path_buf()],
            ..Places::default()
        };
        let e = load(
            Library::Nvrtc,
            &places,
            Some(Version::from_cuda(13000)),
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("NVRTC `libnvrtc.so.13 or libnvrtc.so.12`: not found"),
            "{e}"
        );
        assert!(
            e.contains(&format!("toolkit {}", t.path().display())),
            "{e}"
        );
        assert!(e.contains("MEGATRAIN_CUDA_VENV"), "{e}");
        assert!(e.contains("no network needed"), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
    }
}
