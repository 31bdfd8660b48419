//! What the emulator tells the user: errors it found (stderr, and appended to `$CUEMU_REPORT`),
//! and, with `CUEMU_LOG=1`, notes and every unimplemented call.

use crate::config;
use std::collections::HashSet;
use std::io::Write as _;
use std::sync::Mutex;

fn write(line: &str) {
    eprintln!("{line}");
    if let Some(path) = &config::get().report {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "{line}");
        }
    }
}

/// A defect the emulator found in the program: `kind` is a short class ("stream hazard",
/// "out-of-bounds write", …), `detail` names the kernel, launch, stream and memory.
pub fn error(kind: &str, detail: &str) {
    write(&format!("cuemu: error: {kind}: {detail}"));
}

/// A fact worth knowing that is not a defect (a pageable copy made synchronous, a fallback).
pub fn warning(detail: &str) {
    write(&format!("cuemu: warning: {detail}"));
}

/// Logged only with `CUEMU_LOG=1`.
pub fn note(detail: &str) {
    if config::get().log {
        write(&format!("cuemu: note: {detail}"));
    }
}

/// Logged once per `key` (always): what the program asked for that the emulator lacks.
pub fn once(key: &str, detail: &str) {
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let mut g = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if g.get_or_insert_with(HashSet::new).insert(key.to_owned()) {
        write(&format!("cuemu: {detail}"));
    }
}
