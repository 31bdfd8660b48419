//! Checking a checkpoint against its manifest: in full ([`verify`]), or its listing alone
//! ([`check_complete`]: what choosing one to resume reads; `load` checksums the tensor files as
//! it reads them) — and a damaged one refused by name, naming the newest good older one.

use super::{files, list, FORMAT, PARAMS_FILE};
use crate::store::layout::AdamState;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::io::Read;
use std::path::Path;

/// The manifest's name in a checkpoint directory.
pub(super) const MANIFEST: &str = "MANIFEST.json";
/// Oldest format read (1: no run identity; treated as belonging to whoever resumes it).
const OLDEST_FORMAT: u32 = 1;

/// Why a checkpoint must not be loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Damage {
    /// No manifest: the write did not finish.
    Unfinished,
    /// The manifest is not what this version writes.
    BadManifest(String),
    /// The manifest does not list a file every checkpoint has.
    Incomplete(String),
    /// A listed file is gone.
    Missing(String),
    /// A file cannot be read (permissions, I/O error): the checkpoint may be fine.
    Unreadable(String, String),
    /// A file is shorter or longer than the manifest says.
    WrongSize {
        /// The file.
        file: String,
        /// Its bytes.
        have: u64,
        /// The manifest's bytes.
        want: u64,
    },
    /// A file's bytes do not match its checksum.
    Corrupt(String),
    /// The checkpoint was deleted while it was being read (pruned by the run that owns it).
    Gone,
}

impl Damage {
    /// True when the checkpoint's bytes are bad (as opposed to being unreadable by us).
    pub fn is_damage(&self) -> bool {
        !matches!(self, Damage::Unreadable(..) | Damage::Gone)
    }

    /// What to do about it.
    pub fn fix(&self) -> &'static str {
        match self {
            Damage::Unfinished => "it was being written when the run stopped; it is not usable",
            Damage::BadManifest(_) => "it was written by another megatrain version, or edited",
            Damage::Incomplete(_) | Damage::Missing(_) => {
                "restore the missing file (was it moved or deleted?)"
            }
            Damage::Unreadable(..) => {
                "check the file's owner and permissions (`ls -l`) and the disk; the checkpoint itself may be intact"
            }
            Damage::WrongSize { .. } => {
                "it was cut short (a full disk or an interrupted copy): restore it from a good copy"
            }
            Damage::Corrupt(_) => "its bytes changed on disk: restore it from a good copy",
            Damage::Gone => {
                "the run that owns its directory pruned it (a run keeps its newest --keep-checkpoints): use a newer checkpoint (pass the checkpoint directory itself for the newest), or wait until that run ends"
            }
        }
    }
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Damage::Unfinished => write!(f, "no {MANIFEST} (the write did not finish)"),
            Damage::BadManifest(why) => write!(f, "{MANIFEST} is unusable: {why}"),
            Damage::Incomplete(file) => write!(f, "{MANIFEST} does not list {file}"),
            Damage::Missing(file) => write!(f, "{file} is missing"),
            Damage::Unreadable(file, why) => write!(f, "{file} cannot be read: {why}"),
            Damage::WrongSize { file, have, want } => {
                write!(f, "{file} has {have} bytes, the manifest says {want}")
            }
            Damage::Corrupt(file) => write!(f, "{file} fails its crc32c check"),
            Damage::Gone => write!(f, "it was deleted while it was being read"),
        }
    }
}

/// What a checkpoint holds: its format and every file's (name, size, crc32c).
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Manifest {
    pub(super) format: u32,
    pub(super) files: Vec<(String, u64, u32)>,
}

/// Check a checkpoint's files against its manifest: every file a checkpoint has must be listed,
/// present, readable, of the listed size and checksum. A checkpoint deleted meanwhile (pruned by
/// its run) is [`Damage::Gone`], not damaged.
pub fn verify(dir: &Path) -> std::result::Result<(), Damage> {
    verify_files(dir, Depth::Contents).map_err(|d| if dir.is_dir() { d } else { Damage::Gone })
}

/// [`verify`] without reading the tensor files: the manifest, every file listed and present at
/// its size, the other files' checksums (`state.json`). What choosing a checkpoint to resume costs; [`load`]
/// checks the tensor files' checksums as it reads them, so a resume reads a checkpoint once.
pub fn check_complete(dir: &Path) -> std::result::Result<(), Damage> {
    verify_files(dir, Depth::Listing).map_err(|d| if dir.is_dir() { d } else { Damage::Gone })
}

/// [`check_complete`], and the params file's bytes against its checksum: what an export of
/// the checkpoint reads (not its moments), as the crate's error.
pub fn verify_params(dir: &Path) -> Result<()> {
    verify_files(dir, Depth::ContentsOf(PARAMS_FILE)).map_err(|d| refuse(dir, &d, None))
}

/// How much of a checkpoint a check reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Depth {
    /// Every file's bytes against its checksum.
    Contents,
    /// The tensor files' sizes; the other files' checksums.
    Listing,
    /// [`Depth::Listing`], and this file's bytes against its checksum.
    ContentsOf(&'static str),
}

impl Depth {
    /// Whether file `name` is read and checksummed.
    fn reads(self, name: &str) -> bool {
        match self {
            Depth::Contents => true,
            Depth::Listing => !is_tensor_file(name),
            Depth::ContentsOf(file) => !is_tensor_file(name) || name == file,
        }
    }
}

/// The tensor files (the params and the moments): what [`load`] checksums as it reads them.
fn is_tensor_file(name: &str) -> bool {
    name == PARAMS_FILE || name.starts_with("adam_")
}

/// The manifest of the checkpoint in `dir`.
pub(super) fn manifest(dir: &Path) -> std::result::Result<Manifest, Damage> {
    let text = match std::fs::read(dir.join(MANIFEST)) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Damage::Unfinished),
        Err(e) => return Err(Damage::Unreadable(MANIFEST.into(), e.to_string())),
    };
    serde_json::from_slice(&text).map_err(|e| Damage::BadManifest(e.to_string()))
}

fn verify_files(dir: &Path, depth: Depth) -> std::result::Result<(), Damage> {
    let m = manifest(dir)?;
    if !(OLDEST_FORMAT..=FORMAT).contains(&m.format) {
        return Err(Damage::BadManifest(format!(
            "format {} (this megatrain reads {OLDEST_FORMAT} to {FORMAT})",
            m.format
        )));
    }
    let listed = |name: &str| m.files.iter().any(|(n, _, _)| n == name);
    for required in [PARAMS_FILE, "state.json"] {
        if !listed(required) {
            return Err(Damage::Incomplete(required.into()));
        }
    }
    // The moments in one of the formats (state.json says which; `load` opens that one).
    let formats: &[AdamState] = clap::ValueEnum::value_variants();
    if !formats
        .iter()
        .any(|f| files(*f).iter().all(|(n, _)| listed(n)))
    {
        // Name the partner of a half-listed pair; with neither listed, every format's pair.
        let half = formats.iter().find_map(|f| {
            let [_, (m, _), (v, _)] = files(*f);
            match (listed(&m), listed(&v)) {
                (true, false) => Some(v),
                (false, true) => Some(m),
                _ => None,
            }
        });
        return Err(Damage::Incomplete(half.unwrap_or_else(|| {
            "adam_m.f32 and adam_v.f32 (or .bf16, .int8)".into()
        })));
    }
    for (name, size, crc) in &m.files {
        if name.contains('/') || name.contains("..") {
            return Err(Damage::BadManifest(format!(
                "it names a file outside: {name}"
            )));
        }
        let p = dir.join(name);
        let mut f = match std::fs::File::open(&p) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Damage::Missing(name.clone()))
            }
            Err(e) => return Err(Damage::Unreadable(name.clone(), e.to_string())),
        };
        if !depth.reads(name) {
            let meta = f
                .metadata()
                .map_err(|e| Damage::Unreadable(name.clone(), e.to_string()))?;
            if !meta.is_file() {
                return Err(Damage::Unreadable(
                    name.clone(),
                    "not a regular file".into(),
                ));
            }
            let have = meta.len();
            if have != *size {
                return Err(Damage::WrongSize {
                    file: name.clone(),
                    have,
                    want: *size,
                });
            }
            continue;
        }
        let mut buf = vec![0u8; 1 << 20];
        let (mut c, mut n) = (0u32, 0u64);
        loop {
            let k = f
                .read(&mut buf)
                .map_err(|e| Damage::Unreadable(name.clone(), e.to_string()))?;
            if k == 0 {
                break;
            }
            c = crc32c::crc32c_append(c, &buf[..k]);
            n += k as u64;
        }
        if n != *size {
            return Err(Damage::WrongSize {
                file: name.clone(),
                have: n,
                want: *size,
            });
        }
        if c != *crc {
            return Err(Damage::Corrupt(name.clone()));
        }
    }
    Ok(())
}

/// `verify` as the crate's error: bad input (exit 2) naming the checkpoint, what is wrong with
/// it and the fix; `also` is appended to the fix (e.g. the newest good checkpoint).
pub(super) fn refuse(dir: &Path, damage: &Damage, also: Option<String>) -> Error {
    let fix = match also {
        Some(a) => format!("{}; {a}", damage.fix()),
        None => damage.fix().to_owned(),
    };
    let what = if damage.is_damage() {
        "is damaged"
    } else {
        "cannot be read"
    };
    Error::bad_input(
        "checkpoint",
        dir.display().to_string(),
        format!("{what}: {damage}"),
        Some(&fix),
    )
}

/// `damage` of checkpoint `dir` as the crate's error, naming the newest older checkpoint beside
/// it that verifies in full (read only on this error path).
pub(super) fn refuse_naming_older(dir: &Path, damage: &Damage) -> Error {
    let mut older = dir
        .parent()
        .and_then(|root| list(root).ok())
        .unwrap_or_default();
    older.sort();
    let good = older
        .iter()
        .rev()
        .filter(|(_, d)| d.as_path() != dir && d.file_name() < dir.file_name())
        .find(|(_, d)| verify(d).is_ok())
        .map(|(_, d)| d.clone());
    let also = match (&good, damage.is_damage()) {
        (Some(g), true) => format!(
            "or resume from the newest good checkpoint, {}, by moving the damaged one aside",
            g.display()
        ),
        (Some(g), false) => format!("the newest good older checkpoint is {}", g.display()),
        (None, _) => "no older good checkpoint remains".to_owned(),
    };
    refuse(dir, damage, Some(also))
}
