//! The one error type of the crate.
//!
//! Every variant names the thing that failed, the reason, and — where there is one — the fix, so the
//! CLI can print a single line that a user can act on. Library code returns these; only the CLI (`cli::main`)
//! turns them into an exit status.

use std::path::PathBuf;

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in megatrain.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A user-supplied input (file, string, flag value) is unusable.
    #[error("{what} `{subject}`: {reason}{}", fix_suffix(.fix))]
    BadInput {
        /// What kind of input (e.g. "topology file", "synthetic topology").
        what: &'static str,
        /// The input itself (a path or the offending string).
        subject: String,
        /// Why it is unusable.
        reason: String,
        /// How to fix it, if known.
        fix: Option<String>,
    },

    /// An I/O operation on a named file failed.
    #[error("{op} `{}`: {source}{}", .path.display(), fix_suffix(.fix))]
    Io {
        /// What we were doing ("read", "write", "create", ...).
        op: &'static str,
        /// The file involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
        /// How to fix it, if known.
        fix: Option<String>,
    },

    /// A system library (hwloc, io_uring, libc, a CUDA library that is missing or too old) failed;
    /// a failed CUDA call is an [`Error::Cuda`].
    #[error("{library}: {op} failed: {reason}{}", fix_suffix(.fix))]
    System {
        /// The library ("hwloc", "io_uring", "CUDA driver", ...).
        library: &'static str,
        /// The operation that failed.
        op: String,
        /// The library's own error text.
        reason: String,
        /// How to fix it, if known.
        fix: Option<String>,
    },

    /// A CUDA library call failed; the library's own error is the source.
    #[cfg(feature = "cuda")]
    #[error("CUDA {}: {op} failed: {source}{}", source.library(), fix_suffix(.fix))]
    Cuda {
        /// What we were doing.
        op: String,
        /// The library's error.
        #[source]
        source: CudaError,
        /// How to fix it, if known.
        fix: Option<String>,
    },

    /// An invariant of megatrain itself broke: a bug, not a user error.
    #[error("internal error in {what}: {detail} (a bug in megatrain: please report it)")]
    Internal {
        /// Which part.
        what: &'static str,
        /// What broke.
        detail: String,
    },

    /// Something failed after training progressed; the trained state was saved first.
    #[error("{source}; the trained state of step {step} is safe in `{}` (continue with `--resume --checkpoint-dir {}`, or export it with `megatrain export --checkpoint {}`)", .saved.display(), .root.display(), .saved.display())]
    StateSaved {
        /// What failed.
        source: Box<Error>,
        /// The step saved.
        step: u64,
        /// The checkpoint holding it.
        saved: PathBuf,
        /// Its checkpoint root (what `--checkpoint-dir` takes).
        root: PathBuf,
    },
}

/// The error code of a CUDA library (driver or cuBLAS), kept as the source of [`Error::Cuda`].
#[cfg(feature = "cuda")]
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The driver API.
    #[error("{0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// cuBLAS.
    #[error("{0}")]
    Cublas(#[from] cudarc::cublas::result::CublasError),
}

#[cfg(feature = "cuda")]
impl CudaError {
    /// "driver" or "cuBLAS".
    pub fn library(&self) -> &'static str {
        match self {
            CudaError::Driver(_) => "driver",
            CudaError::Cublas(_) => "cuBLAS",
        }
    }
}

fn fix_suffix(fix: &Option<String>) -> String {
    match fix {
        Some(f) => format!(" (fix: {f})"),
        None => String::new(),
    }
}

impl Error {
    /// A `BadInput` error with a fix.
    pub fn bad_input(
        what: &'static str,
        subject: impl Into<String>,
        reason: impl Into<String>,
        fix: Option<&str>,
    ) -> Self {
        Error::BadInput {
            what,
            subject: subject.into(),
            reason: reason.into(),
            fix: fix.map(str::to_owned),
        }
    }

    /// An `Io` error on `path`.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
            fix: None,
        }
    }

    /// A `System` error from `library`.
    pub fn system(library: &'static str, op: impl Into<String>, reason: impl ToString) -> Self {
        Error::System {
            library,
            op: op.into(),
            reason: reason.to_string(),
            fix: None,
        }
    }

    /// A CUDA library error while doing `op`.
    #[cfg(feature = "cuda")]
    pub fn cuda(op: impl Into<String>, source: impl Into<CudaError>) -> Self {
        Error::Cuda {
            op: op.into(),
            source: source.into(),
            fix: None,
        }
    }

    /// A broken invariant of `what` (a bug).
    pub fn internal(what: &'static str, detail: impl Into<String>) -> Self {
        Error::Internal {
            what,
            detail: detail.into(),
        }
    }

    /// Attach (or replace) the fix hint.
    #[must_use]
    pub fn with_fix(mut self, hint: impl Into<String>) -> Self {
        let hint = hint.into();
        match &mut self {
            Error::BadInput { fix, .. } | Error::Io { fix, .. } | Error::System { fix, .. } => {
                *fix = Some(hint);
            }
            #[cfg(feature = "cuda")]
            Error::Cuda { fix, .. } => *fix = Some(hint),
            Error::Internal { .. } => {}
            Error::StateSaved { source, .. } => {
                let inner = std::mem::replace(source.as_mut(), Error::system("", "", ""));
                **source = inner.with_fix(hint);
            }
        }
        self
    }

    /// Process exit status the CLI uses for this error: 2 for bad user input (like a usage error),
    /// 1 for failures of the machine or a library.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::BadInput { .. } => 2,
            Error::Io { source, .. } => match source.kind() {
                std::io::ErrorKind::NotFound
                | std::io::ErrorKind::PermissionDenied
                | std::io::ErrorKind::InvalidData
                | std::io::ErrorKind::IsADirectory
                | std::io::ErrorKind::NotADirectory
                | std::io::ErrorKind::AlreadyExists => 2,
                _ => 1,
            },
            Error::System { .. } | Error::Internal { .. } => 1,
            #[cfg(feature = "cuda")]
            Error::Cuda { .. } => 1,
            Error::StateSaved { source, .. } => source.exit_code(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_names_subject_reason_and_fix() {
        let e = Error::bad_input(
            "topology file",
            "x.xml",
            "not XML",
            Some("export with lstopo"),
        );
        assert_eq!(
            e.to_string(),
            "topology file `x.xml`: not XML (fix: export with lstopo)"
        );
        assert_eq!(e.exit_code(), 2);
        let e = Error::system("hwloc", "load", "boom").with_fix("reinstall");
        assert_eq!(e.to_string(), "hwloc: load failed: boom (fix: reinstall)");
        assert_eq!(e.exit_code(), 1);
    }
}
