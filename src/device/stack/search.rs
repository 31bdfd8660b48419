//! Where a CUDA library may be, and which one to use: the places of this machine (explicit
//! files, a named Python environment, toolkits, the loader's path, pip wheels), every candidate
//! file in their order with the headers beside it, and the choice for a driver, with why each
//! candidate passed over was. Plain files: nothing is loaded here except to ask the dynamic
//! linker where a soname resolves.

use super::{Library, Version, MAJORS};
use std::ffi::OsString;
use std::path::{Path, PathBuf};

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

impl Candidate {
    /// `path` as a candidate for `lib` found at `origin`: its major version from its name, the
    /// header folders of its release beside it.
    pub fn new(lib: Library, places: &Places, path: PathBuf, origin: Origin) -> Candidate {
        let major = major_of(&path);
        let dir = path.parent().unwrap_or(Path::new("/")).to_path_buf();
        let include = include_dirs(places, &origin, &dir, major);
        Candidate {
            library: lib,
            path,
            major,
            origin,
            include,
        }
    }
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

/// The `site-packages` a binary installed by the megatrain wheel lives in: the wheel puts it at
/// `SITE/megatrain.scripts/megatrain` (pyproject.toml, tools/build_wheels.sh).
pub fn wheel_site(exe: &Path) -> Option<PathBuf> {
    let dir = exe.parent()?;
    (dir.file_name()? == "megatrain.scripts").then(|| dir.parent().map(Path::to_path_buf))?
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
        // The environment the megatrain wheel was installed into: NVIDIA's wheels beside it
        // (`pip install megatrain nvidia-cublas…`, or a venv with PyTorch) are found even when
        // that environment is not activated.
        if let Some(site) = std::env::current_exe().ok().as_deref().and_then(wheel_site) {
            push_unique(&mut sites, site);
        }
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
        if !found.iter().any(|c| c.path == path) {
            found.push(Candidate::new(lib, places, path, origin));
        }
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

/// Why a folder's headers cannot be NVRTC's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderProblem {
    /// No `cuda_bf16.h` there (or no such folder).
    #[error("no cuda_bf16.h in {}", .0.display())]
    Missing(PathBuf),
    /// The headers of another CUDA release.
    #[error("the headers in {} are CUDA {found}, NVRTC is CUDA {nvrtc}", .dir.display())]
    OtherRelease {
        /// The folder.
        dir: PathBuf,
        /// Their release.
        found: Version,
        /// NVRTC's major version.
        nvrtc: u32,
    },
}

/// Why [`choose`] passed a candidate over.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PassedOver {
    /// The file is not there (a given path).
    #[error("{} does not exist", .0.display())]
    Missing(PathBuf),
    /// A newer CUDA than the driver runs.
    #[error("{} is CUDA {major}, newer than the driver's CUDA {driver}", .path.display())]
    NewerThanDriver {
        /// The file.
        path: PathBuf,
        /// Its CUDA major version.
        major: u32,
        /// The driver's.
        driver: u32,
    },
    /// Neither CUDA 12 nor 13.
    #[error("{} is CUDA {major}; megatrain runs on CUDA 12 and 13", .path.display())]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// Its CUDA major version.
        major: u32,
    },
    /// An NVRTC without headers of its release beside it.
    #[error("{}: {}", .path.display(), join(.problems))]
    NoHeaders {
        /// The file.
        path: PathBuf,
        /// Why each header folder did not do.
        problems: Vec<HeaderProblem>,
    },
}

/// `items` as one `; `-separated line.
pub(super) fn join<T: std::fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(T::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// The usable headers among `c.include` for an NVRTC of CUDA `major`, or why none is.
fn headers_for(c: &Candidate, major: Option<u32>) -> Result<Headers, Vec<HeaderProblem>> {
    let mut why = Vec::new();
    for dir in &c.include {
        if !dir.join("cuda_bf16.h").is_file() {
            why.push(HeaderProblem::Missing(dir.clone()));
            continue;
        }
        let version = header_version(dir);
        match (version, major) {
            (Some(found), Some(nvrtc)) if found.major != nvrtc => {
                why.push(HeaderProblem::OtherRelease {
                    dir: dir.clone(),
                    found,
                    nvrtc,
                })
            }
            _ => {
                return Ok(Headers {
                    dir: dir.clone(),
                    version,
                })
            }
        }
    }
    Err(why)
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
) -> Result<Chosen, Vec<PassedOver>> {
    let mut why = Vec::new();
    let mut order: Vec<&Candidate> = found.iter().collect();
    if let Some(p) = prefer_major {
        // Stable: the places' order within each group.
        order.sort_by_key(|c| c.major != Some(p));
    }
    for c in order {
        let path = c.path.clone();
        if !c.path.is_file() {
            why.push(PassedOver::Missing(path));
            continue;
        }
        if let (Some(major), Some(driver)) = (c.major, driver_major) {
            if major > driver {
                why.push(PassedOver::NewerThanDriver {
                    path,
                    major,
                    driver,
                });
                continue;
            }
        }
        if let Some(major) = c.major.filter(|m| !MAJORS.contains(m)) {
            why.push(PassedOver::Unsupported { path, major });
            continue;
        }
        let headers = match c.library {
            Library::Cublas => None,
            Library::Nvrtc => match headers_for(c, c.major) {
                Ok(h) => Some(h),
                Err(problems) => {
                    why.push(PassedOver::NoHeaders { path, problems });
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::stack::test_files::{headers, touch};

    fn none(_: &str) -> Option<PathBuf> {
        None
    }

    #[test]
    fn the_wheels_environment_is_the_site_packages_above_its_binary() {
        let site = Path::new("/opt/venv/lib/python3.12/site-packages");
        assert_eq!(
            wheel_site(&site.join("megatrain.scripts/megatrain")).as_deref(),
            Some(site)
        );
        // A binary anywhere else (cargo's target/, /usr/local/bin) is not a wheel's.
        assert_eq!(
            wheel_site(Path::new("/work/target/release/megatrain")),
            None
        );
        assert_eq!(wheel_site(Path::new("megatrain")), None);
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
            why[0]
                .to_string()
                .contains("newer than the driver's CUDA 12"),
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
            why[0]
                .to_string()
                .contains("are CUDA 12.9, NVRTC is CUDA 13"),
            "{why:?}"
        );
        assert!(why[1].to_string().contains("no cuda_bf16.h"), "{why:?}");
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
        assert!(choose(&found, Some(13), None).unwrap_err()[0]
            .to_string()
            .contains("does not exist"));
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
    }
}
