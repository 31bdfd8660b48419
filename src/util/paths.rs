//! The paths one command reads and writes, checked against each other before anything is
//! written: no output may be an input or another output (the same file by device and inode, a
//! hard link or a symlink included, or the same path once resolved), and none may lie where
//! another output replaces or deletes things (inside an export directory, which is replaced
//! whole; inside the names a checkpoint directory owns).

use crate::{Error, Result};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

/// How a command uses a path.
#[derive(Debug, Clone, Copy)]
pub enum Use {
    /// A file read.
    ReadFile,
    /// A directory read (a model directory): no output may replace it or hold it; the files
    /// read in it are listed as [`Use::ReadFile`] each, so outputs beside them are fine.
    ReadDir,
    /// A file written.
    WriteFile,
    /// A directory written and replaced whole (an export).
    ReplacedDir,
    /// A directory the command creates and deletes entries in; `owns` says which names are its
    /// (a checkpoint directory's `step-*`).
    OwnedDir {
        /// True for an entry name the command may create, replace or delete.
        owns: fn(&str) -> bool,
    },
}

impl Use {
    fn writes(self) -> bool {
        !matches!(self, Use::ReadFile | Use::ReadDir)
    }
}

/// One path of a command: the flag that gave it, the path, how it is used.
#[derive(Debug, Clone)]
pub struct PathUse {
    /// The flag, as the user typed it (`--metrics`), or a description ("the loss curve").
    pub flag: String,
    /// The path as given.
    pub path: PathBuf,
    /// How it is used.
    pub used: Use,
}

impl PathUse {
    /// `flag` gives `path`, used as `used`.
    pub fn new(flag: impl Into<String>, path: &Path, used: Use) -> Self {
        PathUse {
            flag: flag.into(),
            path: path.to_owned(),
            used,
        }
    }
}

/// `dir` as [`Use::ReadDir`] of `flag`, and its entries whose names `read` says are read, as
/// [`Use::ReadFile`] ("--init-from (its config.json)").
pub fn read_dir_uses(flag: &str, dir: &Path, read: impl Fn(&str) -> bool) -> Vec<PathUse> {
    let mut uses = vec![PathUse::new(flag, dir, Use::ReadDir)];
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if read(&name) {
                uses.push(PathUse::new(
                    format!("{flag} (its {name})"),
                    &e.path(),
                    Use::ReadFile,
                ));
            }
        }
    }
    uses
}

/// `path` absolute and resolved: its longest existing ancestor canonicalised (symlinks
/// followed), the rest appended with `.` dropped and `..` applied.
pub fn resolve(path: &Path) -> PathBuf {
    let abs = if path.is_absolute() {
        path.to_owned()
    } else {
        std::env::current_dir().unwrap_or_default().join(path)
    };
    let mut existing = abs.as_path();
    let mut rest: Vec<Component<'_>> = Vec::new();
    let base = loop {
        if let Ok(c) = std::fs::canonicalize(existing) {
            break c;
        }
        match (existing.parent(), existing.components().next_back()) {
            (Some(parent), Some(last)) => {
                rest.push(last);
                existing = parent;
            }
            _ => break PathBuf::from("/"),
        }
    };
    let mut out = base;
    for c in rest.into_iter().rev() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

struct Resolved<'a> {
    use_: &'a PathUse,
    at: PathBuf,
    /// (device, inode) when it exists.
    id: Option<(u64, u64)>,
    /// A character device (`/dev/null`, a terminal): outputs may share it.
    shared: bool,
}

fn what(u: Use) -> &'static str {
    match u {
        Use::ReadFile | Use::WriteFile => "file",
        _ => "directory",
    }
}

/// Refuse, by name, any output of `uses` that would overwrite, or be overwritten or deleted by,
/// another of them.
pub fn check_disjoint(uses: &[PathUse]) -> Result<()> {
    let resolved: Vec<Resolved<'_>> = uses
        .iter()
        .map(|u| {
            let at = resolve(&u.path);
            let meta = std::fs::metadata(&u.path).ok();
            let id = meta.as_ref().map(|m| (m.dev(), m.ino()));
            let shared = meta.is_some_and(|m| m.file_type().is_char_device());
            Resolved {
                use_: u,
                at,
                id,
                shared,
            }
        })
        .collect();
    for (i, a) in resolved.iter().enumerate() {
        for b in &resolved[i + 1..] {
            if !a.use_.used.writes() && !b.use_.used.writes() {
                continue;
            }
            let (out, other) = if a.use_.used.writes() { (a, b) } else { (b, a) };
            let same = a.at == b.at || (a.id.is_some() && a.id == b.id);
            // Two outputs to /dev/null, or to the terminal, write nothing the other reads.
            let both_write = a.use_.used.writes() && b.use_.used.writes();
            if same && !(both_write && a.shared) {
                return Err(Error::bad_input(
                    "output path",
                    out.use_.path.display().to_string(),
                    format!(
                        "{} {} and {} {} are the same {}; writing one would destroy the other",
                        a.use_.flag,
                        a.use_.path.display(),
                        b.use_.flag,
                        b.use_.path.display(),
                        what(other.use_.used)
                    ),
                    Some(&format!("give {} a path of its own", out.use_.flag)),
                ));
            }
            for (outer, inner) in [(a, b), (b, a)] {
                let Ok(rel) = inner.at.strip_prefix(&outer.at) else {
                    continue;
                };
                let first = rel
                    .components()
                    .next()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .unwrap_or_default();
                let why = match outer.use_.used {
                    Use::ReplacedDir => "which is replaced whole when it is written",
                    Use::OwnedDir { owns } if owns(&first) => {
                        "in an entry that directory's run creates and deletes"
                    }
                    _ => continue,
                };
                let moved = if inner.use_.used.writes() {
                    inner
                } else {
                    outer
                };
                return Err(Error::bad_input(
                    "output path",
                    inner.use_.path.display().to_string(),
                    format!(
                        "{} {} lies inside {} {}, {why}",
                        inner.use_.flag,
                        inner.use_.path.display(),
                        outer.use_.flag,
                        outer.use_.path.display()
                    ),
                    Some(&format!(
                        "give {} a path outside the other",
                        moved.use_.flag
                    )),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step_dirs(name: &str) -> bool {
        name.starts_with("step-")
    }

    #[test]
    fn resolve_applies_dots_beyond_what_exists() {
        let d = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(d.path()).unwrap();
        assert_eq!(resolve(&d.path().join("a/./b/../c")), base.join("a/c"));
        std::os::unix::fs::symlink(d.path(), d.path().join("link")).unwrap();
        assert_eq!(resolve(&d.path().join("link/x")), base.join("x"));
    }

    #[test]
    fn the_same_file_by_any_name_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let data = d.path().join("d.bin");
        std::fs::write(&data, b"tokens").unwrap();
        let hard = d.path().join("hard.bin");
        std::fs::hard_link(&data, &hard).unwrap();
        for out in [
            data.clone(),
            hard.clone(),
            d.path().join("sub/../d.bin"),
            d.path().join("./d.bin"),
        ] {
            let e = check_disjoint(&[
                PathUse::new("--data", &data, Use::ReadFile),
                PathUse::new("--metrics", &out, Use::WriteFile),
            ])
            .unwrap_err()
            .to_string();
            assert!(e.contains("--data") && e.contains("--metrics"), "{e}");
        }
        // Two outputs on one new file.
        let e = check_disjoint(&[
            PathUse::new("--metrics", &d.path().join("m.svg"), Use::WriteFile),
            PathUse::new("the loss curve", &d.path().join("m.svg"), Use::WriteFile),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("the loss curve"), "{e}");
        // Two outputs may share /dev/null.
        check_disjoint(&[
            PathUse::new("--metrics", Path::new("/dev/null"), Use::WriteFile),
            PathUse::new("--trace", Path::new("/dev/null"), Use::WriteFile),
        ])
        .unwrap();
        // Two inputs may be one file.
        check_disjoint(&[
            PathUse::new("--data", &data, Use::ReadFile),
            PathUse::new("--val-data", &hard, Use::ReadFile),
        ])
        .unwrap();
    }

    #[test]
    fn nesting_is_refused_where_something_is_replaced_or_deleted() {
        let d = tempfile::tempdir().unwrap();
        let p = |s: &str| d.path().join(s);
        let ckpt = Use::OwnedDir { owns: step_dirs };
        let refused = [
            // Inside an export (replaced whole).
            vec![
                PathUse::new("--export-hf", &p("hf"), Use::ReplacedDir),
                PathUse::new("--metrics", &p("hf/m.jsonl"), Use::WriteFile),
            ],
            // An input inside an export.
            vec![
                PathUse::new("--init-from", &p("model"), Use::ReadDir),
                PathUse::new("--export-hf", &p("model/.."), Use::ReplacedDir),
            ],
            // Inside a checkpoint the run prunes.
            vec![
                PathUse::new("--checkpoint-dir", &p("c"), ckpt),
                PathUse::new("--trace", &p("c/step-00000010/t.json"), Use::WriteFile),
            ],
        ];
        // An output naming a file of a model read as input.
        std::fs::create_dir(p("model")).unwrap();
        std::fs::write(p("model/config.json"), "{}").unwrap();
        let mut uses = read_dir_uses("--init-from", &p("model"), |n| n == "config.json");
        uses.push(PathUse::new(
            "--metrics",
            &p("model/./config.json"),
            Use::WriteFile,
        ));
        let e = check_disjoint(&uses).unwrap_err().to_string();
        assert!(
            e.contains("same file") && e.contains("its config.json"),
            "{e}"
        );
        for uses in refused {
            let e = check_disjoint(&uses).unwrap_err().to_string();
            assert!(e.contains("lies inside"), "{e}");
        }
        // Beside what the checkpoint directory owns, or the model's files: fine; an input inside
        // an input: fine.
        check_disjoint(&[
            PathUse::new("--checkpoint-dir", &p("c"), ckpt),
            PathUse::new("--metrics", &p("c/metrics.jsonl"), Use::WriteFile),
            PathUse::new("--trace", &p("model/trace.json"), Use::WriteFile),
            PathUse::new("--init-from", &p("model"), Use::ReadDir),
            PathUse::new("--model", &p("model/config.json"), Use::ReadFile),
            PathUse::new("--export-hf", &p("hf"), Use::ReplacedDir),
        ])
        .unwrap();
    }
}
