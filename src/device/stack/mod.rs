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
//! 5. NVIDIA's pip wheels in the Python environments of this machine: the one the megatrain
//!    wheel is installed in (activated or not), `$VIRTUAL_ENV`, `$CONDA_PREFIX`, every `python3`
//!    on `PATH` (PyTorch's venv among them), `~/.local`, the system's `dist-packages`, and the
//!    environments `tools/setup-cuda-wheels.sh` makes (`~/.cache/megatrain/cuda{13,12}-wheels`).
//!
//! In a wheel, CUDA 13 keeps everything in `nvidia/cu13/{lib,include}`; CUDA 12 keeps each
//! library in its own folder (`nvidia/cuda_nvrtc/lib`, `nvidia/cublas/lib`, headers in
//! `nvidia/cuda_runtime/include`). A library for a newer CUDA than the driver runs is passed over
//! (CUDA 13 needs a driver for CUDA 13.0, R580 or newer), as is an NVRTC without the headers of
//! its own release beside it (`MEGATRAIN_CUDA_INCLUDE` names them explicitly).
//!
//! Nothing here needs the `cuda` feature: the search is plain files and `dlopen`, tested in every
//! build. The CUDA device ([`super::cuda`]) opens the chosen libraries by absolute path before
//! cudarc's first call, so cudarc's lookup by soname binds the same ones.
//!
//! [`search`] finds and chooses files; [`loader`] opens them, asks their versions and the
//! driver's, and simulates cudarc's lookup; this module puts them together ([`load`], [`Stack`]).

mod loader;
pub mod nccl;
mod search;
#[cfg(test)]
mod test_files;

use loader::{cudarc_names, library_version, open_companions, open_global};
pub use loader::{cudarc_would_bind, driver, file_of, loader_lookup, open_library, Driver};
use search::join;
pub use search::{
    candidates, choose, header_version, major_of, sites_of, Candidate, Chosen, HeaderProblem,
    Headers, Origin, PassedOver, Places,
};

use crate::{Error, Result};
use std::path::PathBuf;

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
                join(&why),
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
        let theirs = Candidate::new(lib, places, other.clone(), Origin::Loader);
        match choose(&[theirs], driver.map(|d| d.major), None) {
            Ok(c) if !given => chosen = c,
            usable => {
                let why = match usable {
                    Ok(_) => format!(
                        "while {} is what was named ({})",
                        chosen.candidate.path.display(),
                        chosen.candidate.origin
                    ),
                    Err(why) => format!("which is unusable here: {}", join(&why)),
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
    let h = open_global(&c.path, lib.name()).map_err(|e| e.with_fix(fix_for(lib, driver)))?;
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
    ///
    /// Found once per process (the environment it reads does not change; a self-test opens the
    /// GPU several times): later calls return the same stack.
    pub fn open() -> Result<Stack> {
        static OPENED: std::sync::Mutex<Option<Stack>> = std::sync::Mutex::new(None);
        let mut opened = crate::util::lock(&OPENED);
        if let Some(s) = opened.as_ref() {
            return Ok(s.clone());
        }
        let s = Self::find()?;
        *opened = Some(s.clone());
        Ok(s)
    }

    fn find() -> Result<Stack> {
        let driver = supported_driver()?;
        let places = Places::from_env();
        let (nvrtc, headers) = load_nvrtc(&places, Some(driver.cuda))?;
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
    load_nvrtc(&Places::from_env(), None)
}

/// [`load`] of NVRTC, with its headers.
fn load_nvrtc(places: &Places, driver: Option<Version>) -> Result<(Loaded, Headers)> {
    let (nvrtc, headers) = load(Library::Nvrtc, places, driver, None)?;
    let headers =
        headers.ok_or_else(|| Error::internal("CUDA stack", "NVRTC chosen without headers"))?;
    Ok((nvrtc, headers))
}

#[cfg(test)]
mod tests {
    use super::*;

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
