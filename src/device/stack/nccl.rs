//! NCCL (`libnccl.so.2`), the collectives between the GPUs of a data-parallel job: found in the
//! places the other CUDA libraries are ([`super`]), in the same order — `MEGATRAIN_NCCL_LIB`,
//! `MEGATRAIN_CUDA_VENV`, the toolkits, the dynamic linker's path (NVIDIA's `libnccl2`
//! package puts it there), then NVIDIA's pip wheels (`nvidia-nccl-cu13` and `nvidia-nccl-cu12`
//! both keep it in `nvidia/nccl/lib`, the one PyTorch's venv holds among them). Its soname
//! does not carry the CUDA release: NCCL is 2.x for both.
//!
//! The first file that opens and says its version (`ncclGetVersion`) is used. cudarc's own
//! lookup asks for `libnccl.so` and `libnccl.so.<CUDA major>`, names a wheel does not have,
//! so the CUDA device calls NCCL through the file found here ([`crate::device::cuda`]).

use super::search::{Origin, Places};
use super::{loader_lookup, open_library};
use crate::{Error, Result};
use std::path::PathBuf;

/// The soname NCCL 2 has.
pub const SONAME: &str = "libnccl.so.2";
/// The variable naming the file explicitly.
pub const ENV: &str = "MEGATRAIN_NCCL_LIB";
/// Where NVIDIA's wheels keep it, under `site-packages`.
const WHEEL_DIR: &str = "nvidia/nccl/lib";

/// A usable NCCL.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Found {
    /// The file.
    pub path: PathBuf,
    /// Where it was found (as text).
    pub origin: String,
}

/// Every file that may be NCCL, in the order of the places, and the places looked in.
pub fn candidates(
    places: &Places,
    loader: &dyn Fn(&str) -> Option<PathBuf>,
) -> (Vec<(PathBuf, Origin)>, Vec<String>) {
    let mut found: Vec<(PathBuf, Origin)> = Vec::new();
    let mut looked = Vec::new();
    let mut add = |path: PathBuf, origin: Origin| {
        if !found.iter().any(|(p, _)| *p == path) {
            found.push((path, origin));
        }
    };
    if let Some(file) = std::env::var_os(ENV).filter(|v| !v.is_empty()) {
        // Used as given, or an error: never passed over.
        looked.push(format!("{ENV}={}", PathBuf::from(&file).display()));
        add(PathBuf::from(file), Origin::Given(ENV));
        return (found, looked);
    }
    for site in &places.given_venv {
        looked.push(format!("MEGATRAIN_CUDA_VENV {}", site.display()));
        let f = site.join(WHEEL_DIR).join(SONAME);
        if f.is_file() {
            add(f, Origin::GivenVenv(site.clone()));
        }
    }
    for root in places.toolkits.iter().filter(|r| r.is_dir()) {
        looked.push(format!("toolkit {}", root.display()));
        for sub in ["lib64", "lib"] {
            let f = root.join(sub).join(SONAME);
            if f.is_file() {
                add(f, Origin::Toolkit(root.clone()));
            }
        }
    }
    if places.loader {
        looked.push("the dynamic linker's path".into());
        let by_hand = places
            .loader_dirs
            .iter()
            .map(|d| d.join(SONAME))
            .find(|f| f.is_file());
        if let Some(f) = by_hand.or_else(|| loader(SONAME)) {
            add(f, Origin::Loader);
        }
    }
    for site in places.sites.iter().filter(|s| s.join("nvidia").is_dir()) {
        looked.push(format!("pip wheels in {}", site.display()));
        let f = site.join(WHEEL_DIR).join(SONAME);
        if f.is_file() {
            add(f, Origin::Wheels(site.clone()));
        }
    }
    (found, looked)
}

/// Find NCCL in this process's places (module docs) and open it: the first candidate that
/// loads, or an error naming every place looked in and why each file failed.
pub fn find() -> Result<Found> {
    let places = Places::from_env();
    let (found, looked) = candidates(&places, &|s| loader_lookup(s, "ncclGetVersion"));
    let given = found
        .first()
        .is_some_and(|(_, o)| matches!(o, Origin::Given(_)));
    let mut failed = Vec::new();
    for (path, origin) in &found {
        match open_library(path, "ncclGetVersion") {
            Ok(_) => {
                return Ok(Found {
                    path: path.clone(),
                    origin: origin.to_string(),
                })
            }
            Err(e) if given => return Err(e.with_fix(fix())),
            Err(e) => failed.push(format!("{}: {e}", path.display())),
        }
    }
    let what = if failed.is_empty() {
        format!("not found (looked in: {})", looked.join(", "))
    } else {
        format!(
            "none usable ({}; looked in: {})",
            failed.join("; "),
            looked.join(", ")
        )
    };
    Err(Error::bad_input("NCCL", SONAME, what, None).with_fix(fix()))
}

fn fix() -> String {
    format!(
        "set MEGATRAIN_CUDA_VENV to a Python environment holding NVIDIA's NCCL wheel (PyTorch's venv has it; no network needed), or {ENV} to a libnccl.so.2; with network, `pip install nvidia-nccl-cu13` (CUDA 13) or `nvidia-nccl-cu12` (CUDA 12)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_is_looked_for_in_the_stacks_places_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let venv = dir.path().join("venv/lib/python3.12/site-packages");
        let site = dir.path().join("site/lib/python3.11/site-packages");
        let toolkit = dir.path().join("cuda");
        for d in [&venv, &site] {
            std::fs::create_dir_all(d.join(WHEEL_DIR)).unwrap();
            std::fs::write(d.join(WHEEL_DIR).join(SONAME), b"").unwrap();
        }
        std::fs::create_dir_all(toolkit.join("lib64")).unwrap();
        std::fs::write(toolkit.join("lib64").join(SONAME), b"").unwrap();
        let places = Places {
            given_venv: vec![venv.clone()],
            toolkits: vec![toolkit.clone(), dir.path().join("missing")],
            loader: true,
            sites: vec![site.clone()],
            ..Places::default()
        };
        let loaded = dir.path().join("ld").join(SONAME);
        let (found, looked) = candidates(&places, &|s| (s == SONAME).then(|| loaded.clone()));
        let paths: Vec<&PathBuf> = found.iter().map(|(p, _)| p).collect();
        assert_eq!(
            paths,
            [
                &venv.join(WHEEL_DIR).join(SONAME),
                &toolkit.join("lib64").join(SONAME),
                &loaded,
                &site.join(WHEEL_DIR).join(SONAME)
            ]
        );
        assert_eq!(looked.len(), 4, "{looked:?}");
        // Nothing anywhere: nothing found, every place named.
        let (none, looked) = candidates(
            &Places {
                loader: true,
                ..Places::default()
            },
            &|_| None,
        );
        assert!(none.is_empty());
        assert_eq!(looked, ["the dynamic linker's path"]);
    }
}
