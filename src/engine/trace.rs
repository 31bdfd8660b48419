//! The timeline of every step as Chrome trace-event JSON (opens in Perfetto or chrome://tracing):
//! one track per device stream and one per AdamW worker pool.

use crate::device::OpRecord;
use crate::Result;
use serde::Serialize;
use std::path::Path;
use std::time::Instant;

/// The `otherData.writer` of every trace written: a run replaces an existing trace file only
/// when it holds this (or is an older megatrain trace).
pub const OWN_MARK: &str = "megatrain";

/// A span on a track.
#[derive(Debug, Clone, Serialize)]
pub struct Span {
    /// Track (thread) name.
    pub track: String,
    /// What ran.
    pub name: String,
    /// Start, seconds since the epoch.
    pub start: f64,
    /// End, seconds since the epoch.
    pub end: f64,
}

/// Spans of a run.
#[derive(Debug, Clone)]
pub struct Timeline {
    /// The instant times are relative to.
    pub epoch: Instant,
    /// Everything recorded.
    pub spans: Vec<Span>,
}

impl Timeline {
    /// Empty timeline.
    pub fn new(epoch: Instant) -> Self {
        Timeline {
            epoch,
            spans: Vec::new(),
        }
    }

    /// Add a span.
    pub fn push(&mut self, s: Span) {
        self.spans.push(s);
    }

    /// Add the device's executed commands.
    pub fn extend_device(&mut self, records: Vec<OpRecord>) {
        self.spans.extend(records.into_iter().map(|r| Span {
            track: r.stream.name().to_owned(),
            name: r.name,
            start: r.start,
            end: r.end,
        }));
    }

    /// The trace-event JSON text.
    pub fn to_chrome_json(&self) -> String {
        let mut tracks: Vec<&str> = self.spans.iter().map(|s| s.track.as_str()).collect();
        tracks.sort_unstable();
        tracks.dedup();
        let tid = |t: &str| tracks.iter().position(|x| *x == t).unwrap_or(0);
        let mut events: Vec<serde_json::Value> = tracks
            .iter()
            .enumerate()
            .map(|(i, t)| serde_json::json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": i, "args": {"name": t}}))
            .collect();
        events.extend(self.spans.iter().map(|s| {
            serde_json::json!({
                "name": s.name, "ph": "X", "pid": 1, "tid": tid(&s.track),
                "ts": s.start * 1e6, "dur": ((s.end - s.start) * 1e6).max(0.0),
            })
        }));
        serde_json::json!({
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": { "writer": OWN_MARK },
        })
        .to_string()
    }

    /// Write the trace file atomically.
    pub fn write_chrome(&self, path: &Path) -> Result<()> {
        crate::util::write_atomic(path, self.to_chrome_json().as_bytes())
    }
}
