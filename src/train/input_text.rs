//! A `prepare` input as text, and as records: compressed files refused by name, a byte-order
//! mark skipped, invalid UTF-8 named by line; JSON Lines (or one JSON array of records) told
//! from plain text by content, the file's name only breaking ties.

use crate::{Error, Result};
use serde_json::Value as Json;
use std::path::Path;

/// The input's text: a compressed file is refused by name, a UTF-8 byte-order mark dropped
/// (noted), invalid UTF-8 named by line and byte. Works on pipes and `/dev/stdin`.
pub(super) fn read_input(path: &Path) -> Result<(String, Vec<String>)> {
    let bytes = std::fs::read(path).map_err(|e| Error::io("read input", path, e))?;
    if let Some((name, cmd)) = crate::util::compression(&bytes) {
        return Err(Error::bad_input(
            "input",
            path.display().to_string(),
            format!("is {name}-compressed; megatrain reads text"),
            Some(&format!("decompress it first (`{cmd} {}`)", path.display())),
        ));
    }
    let mut notes = Vec::new();
    let body = match bytes.strip_prefix(b"\xEF\xBB\xBF") {
        Some(rest) => {
            notes.push(format!(
                "{}: its UTF-8 byte-order mark is skipped",
                path.display()
            ));
            rest
        }
        None => &bytes[..],
    };
    match std::str::from_utf8(body) {
        Ok(t) => Ok((t.to_owned(), notes)),
        Err(e) => {
            let good = &body[..e.valid_up_to()];
            let line = 1 + good.iter().filter(|&&b| b == b'\n').count();
            let column = good.len() - good.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
            Err(Error::bad_input(
                "input",
                format!("{}:{line}", path.display()),
                format!(
                    "is not valid UTF-8 (byte {} of the file, column {})",
                    e.valid_up_to(),
                    column + 1
                ),
                Some("convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`), or fix that line"),
            ))
        }
    }
}

/// How an input's text is read: decided by its content, its name only breaking ties.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reading {
    /// One JSON object per line (`.jsonl`, or `.json` as `Dataset.to_json()` writes it).
    JsonLines,
    /// One JSON array of objects (`.json`).
    JsonArray,
    /// The whole file is one document.
    PlainText,
}

impl Reading {
    /// `.jsonl`, `.json` or `.ndjson` in any case: JSON must be there (a line that is not is
    /// an error naming it). Any other name: JSON Lines when every non-blank line is a JSON
    /// object, a JSON array when the whole file is one of objects, else plain text.
    pub(super) fn of(path: &Path, text: &str) -> Result<Reading> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        let named_json = matches!(ext.as_deref(), Some("jsonl" | "json" | "ndjson"));
        let trimmed = text.trim_start();
        if trimmed.starts_with('[') {
            if let Ok(Json::Array(items)) = serde_json::from_str::<Json>(text) {
                if items.iter().all(Json::is_object) {
                    return Ok(Reading::JsonArray);
                }
            }
        }
        let mut lines = text.lines().filter(|l| !l.trim().is_empty()).peekable();
        let is_object = |l: &str| {
            l.trim_start().starts_with('{')
                && serde_json::from_str::<Json>(l).is_ok_and(|v| v.is_object())
        };
        if named_json {
            return Ok(Reading::JsonLines); // each line checked as it is read
        }
        if lines.peek().is_some() && lines.all(is_object) {
            return Ok(Reading::JsonLines);
        }
        Ok(Reading::PlainText)
    }

    /// "read as …", for the user.
    pub(super) fn describe(self, path: &Path) -> String {
        let how = match self {
            Reading::JsonLines => "JSON Lines (one record per line)",
            Reading::JsonArray => "one JSON array of records",
            Reading::PlainText => "plain text (the whole file is one document)",
        };
        format!("{}: read as {how}", path.display())
    }

    /// The records, each with where it is for errors.
    pub(super) fn records<'a>(
        self,
        text: &'a str,
        path: &'a Path,
    ) -> Box<dyn Iterator<Item = Result<(String, Json)>> + 'a> {
        match self {
            Reading::JsonArray => match serde_json::from_str::<Json>(text) {
                Ok(Json::Array(items)) => Box::new(
                    items
                        .into_iter()
                        .enumerate()
                        .map(move |(i, v)| Ok((format!("{} record {}", path.display(), i + 1), v))),
                ),
                _ => Box::new(json_lines(text, path)),
            },
            _ => Box::new(json_lines(text, path)),
        }
    }
}

/// The non-blank lines of a JSON Lines file, parsed, each with its `file:line` for errors.
fn json_lines<'a>(
    text: &'a str,
    path: &'a Path,
) -> impl Iterator<Item = Result<(String, Json)>> + 'a {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(move |(i, l)| {
            let at = format!("{}:{}", path.display(), i + 1);
            match serde_json::from_str(l) {
                Ok(v) => Ok((at, v)),
                Err(e) => Err(Error::bad_input(
                    "input",
                    at,
                    format!("not JSON: {e}"),
                    None,
                )),
            }
        })
}
