//! TensorBoard event files (`--tensorboard DIR`), in the format TensorBoard, PyTorch's
//! `SummaryWriter` and TensorFlow write: `tensorflow.Event` protocol buffers (encoded by prost
//! from the field numbers of TensorBoard's `event.proto`, `summary.proto` and `tensor.proto`),
//! each framed as a TFRecord — the length (u64 LE), its masked CRC-32C, the record, the record's
//! masked CRC-32C.
//!
//! Each run start writes a new file in DIR (`events.out.tfevents.<secs>.<host>.<pid>.megatrain`,
//! never an existing one): the file version, a `SessionLog.START` at the run's first step —
//! TensorBoard drops every event of an earlier file at that step or later, so a resumed run
//! replaces the steps the interrupted one logged after its checkpoint (`SummaryWriter`'s
//! `purge_step`) and a fresh run in the directory replaces an earlier run — then the resolved
//! configuration as text, then one event of scalars per step. A failed write is a warning, as
//! for the metrics log: the file is cut back to its last whole record and training goes on.

use crate::{Error, Result};
use prost::Message;
use std::io::Write;
use std::path::{Path, PathBuf};

/// `tensorflow.Event`.
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "What", tags = "3, 5, 7")]
    what: Option<What>,
}

/// `Event.what`.
#[derive(Clone, PartialEq, prost::Oneof)]
enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
    #[prost(message, tag = "7")]
    SessionLog(SessionLog),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<Value>,
}

/// `tensorflow.Summary.Value`.
#[derive(Clone, PartialEq, prost::Message)]
struct Value {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(message, optional, tag = "9")]
    metadata: Option<SummaryMetadata>,
    #[prost(oneof = "ValueKind", tags = "2, 8")]
    value: Option<ValueKind>,
}

/// `Summary.Value.value`.
#[derive(Clone, PartialEq, prost::Oneof)]
enum ValueKind {
    #[prost(float, tag = "2")]
    SimpleValue(f32),
    #[prost(message, tag = "8")]
    Tensor(TensorProto),
}

/// `tensorflow.SummaryMetadata`.
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    plugin_data: Option<PluginData>,
}

/// `SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, prost::Message)]
struct PluginData {
    #[prost(string, tag = "1")]
    plugin_name: String,
    #[prost(bytes = "vec", tag = "2")]
    content: Vec<u8>,
}

/// `tensorflow.TensorProto`, as far as a string tensor needs it.
#[derive(Clone, PartialEq, prost::Message)]
struct TensorProto {
    #[prost(int32, tag = "1")]
    dtype: i32,
    #[prost(message, optional, tag = "2")]
    tensor_shape: Option<TensorShapeProto>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    string_val: Vec<Vec<u8>>,
}

/// `tensorflow.TensorShapeProto`.
#[derive(Clone, PartialEq, prost::Message)]
struct TensorShapeProto {
    #[prost(message, repeated, tag = "2")]
    dim: Vec<Dim>,
}

/// `TensorShapeProto.Dim`.
#[derive(Clone, PartialEq, prost::Message)]
struct Dim {
    #[prost(int64, tag = "1")]
    size: i64,
}

/// `tensorflow.SessionLog`.
#[derive(Clone, PartialEq, prost::Message)]
struct SessionLog {
    #[prost(int32, tag = "1")]
    status: i32,
}

/// `DataType.DT_STRING`.
const DT_STRING: i32 = 7;
/// `SessionLog.SessionStatus.START`.
const SESSION_START: i32 = 1;
/// What every event file starts with.
const FILE_VERSION: &str = "brain.Event:2";
/// The prefix TensorBoard looks for; the names this module creates.
pub const FILE_PREFIX: &str = "events.out.tfevents.";

/// TFRecord's CRC mask: CRC-32C rotated right by 15 bits plus a constant (a CRC of data that
/// holds CRCs is weak unmasked).
fn masked_crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
        .rotate_right(15)
        .wrapping_add(0xa282_ead8)
}

/// `record` framed as a TFRecord, appended to `out`.
fn frame(record: &[u8], out: &mut Vec<u8>) {
    let len = (record.len() as u64).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(record);
    out.extend_from_slice(&masked_crc(record).to_le_bytes());
}

fn now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn event(step: u64, what: What) -> Event {
    Event {
        wall_time: now_s(),
        step: i64::try_from(step).unwrap_or(i64::MAX),
        what: Some(what),
    }
}

/// `text` as the text plugin's summary under `tag` (what `SummaryWriter.add_text` writes).
fn text_value(tag: &str, text: &str) -> Value {
    Value {
        tag: format!("{tag}/text_summary"),
        metadata: Some(SummaryMetadata {
            plugin_data: Some(PluginData {
                plugin_name: "text".into(),
                content: Vec::new(),
            }),
        }),
        value: Some(ValueKind::Tensor(TensorProto {
            dtype: DT_STRING,
            tensor_shape: Some(TensorShapeProto {
                dim: vec![Dim { size: 1 }],
            }),
            string_val: vec![text.as_bytes().to_vec()],
        })),
    }
}

/// The event file of one run start.
#[derive(Debug)]
pub struct TensorBoardLog {
    path: PathBuf,
    file: std::fs::File,
    /// Bytes of whole records in the file: a failed write is cut back to it.
    whole: u64,
    /// Writes that failed.
    pub failed_writes: u64,
}

impl TensorBoardLog {
    /// A new event file in `dir` (created if missing) for a run whose first step is
    /// `first_step`, with `config` (the resolved configuration) as text.
    pub fn create(dir: &Path, first_step: u64, config: &str) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| {
            Error::io("create directory", dir, e).with_fix("choose another --tensorboard")
        })?;
        let host = hostname();
        let secs = now_s() as u64;
        let pid = std::process::id();
        // A name no other writer uses; `create_new` never opens an existing file.
        let mut n = 0u32;
        let (path, file) = loop {
            let name = match n {
                0 => format!("{FILE_PREFIX}{secs:010}.{host}.{pid}.megatrain"),
                n => format!("{FILE_PREFIX}{secs:010}.{host}.{pid}.{n}.megatrain"),
            };
            let path = dir.join(name);
            match std::fs::OpenOptions::new()
                .append(true)
                .create_new(true)
                .open(&path)
            {
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
                opened => break (path, opened),
            }
        };
        let file = file.map_err(|e| {
            Error::io("create event file", &path, e)
                .with_fix("make the --tensorboard directory writable, or choose another")
        })?;
        let mut log = TensorBoardLog {
            path,
            file,
            whole: 0,
            failed_writes: 0,
        };
        let mut head = Vec::new();
        for e in [
            event(0, What::FileVersion(FILE_VERSION.into())),
            event(
                first_step,
                What::SessionLog(SessionLog {
                    status: SESSION_START,
                }),
            ),
            event(
                first_step,
                What::Summary(Summary {
                    value: vec![text_value("config", &as_markdown_code(config))],
                }),
            ),
        ] {
            frame(&e.encode_to_vec(), &mut head);
        }
        log.file
            .write_all(&head)
            .map_err(|e| Error::io("write event file", &log.path, e))?;
        log.whole = head.len() as u64;
        Ok(log)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append one step's scalars, by tag (`section/name`: TensorBoard groups by section).
    /// `Some(warning)` on the first failure; later ones are counted.
    pub fn append(&mut self, step: u64, scalars: &[(&str, f64)]) -> Option<String> {
        let value = scalars
            .iter()
            .map(|&(tag, v)| Value {
                tag: tag.into(),
                metadata: None,
                value: Some(ValueKind::SimpleValue(v as f32)),
            })
            .collect();
        self.append_summary(step, Summary { value })
    }

    /// Append `text` at `step` under `tag` (the text plugin's tab), shown verbatim.
    pub fn append_text(&mut self, step: u64, tag: &str, text: &str) -> Option<String> {
        let value = vec![text_value(tag, &as_markdown_code(text))];
        self.append_summary(step, Summary { value })
    }

    fn append_summary(&mut self, step: u64, summary: Summary) -> Option<String> {
        let mut bytes = Vec::new();
        frame(
            &event(step, What::Summary(summary)).encode_to_vec(),
            &mut bytes,
        );
        match self.file.write_all(&bytes) {
            Ok(()) => {
                self.whole += bytes.len() as u64;
                None
            }
            Err(e) => {
                // A torn record would end the file for every reader: cut it off.
                let _ = self.file.set_len(self.whole);
                self.failed_writes += 1;
                (self.failed_writes == 1).then(|| {
                    format!(
                        "warning: writing TensorBoard events to {} failed ({e}); training goes on, later failures are counted",
                        self.path.display()
                    )
                })
            }
        }
    }
}

/// `text` shown verbatim by TensorBoard's text plugin (which renders markdown): an indented
/// code block.
fn as_markdown_code(text: &str) -> String {
    text.lines()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The host's name for the file name (TensorBoard's convention), with anything but
/// `[A-Za-z0-9_-]` replaced.
fn hostname() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let name: String = raw
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

/// True for the names [`TensorBoardLog::create`] creates (a `--tensorboard` directory's other
/// entries are never touched).
pub fn owns(name: &str) -> bool {
    name.starts_with(FILE_PREFIX) && name.ends_with(".megatrain")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The records of a TFRecord file, each checked against its CRCs.
    fn records(mut bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let (len, rest) = bytes.split_at(8);
            let n = u64::from_le_bytes(len.try_into().unwrap()) as usize;
            assert_eq!(rest[..4], masked_crc(len).to_le_bytes());
            let (rec, rest) = rest[4..].split_at(n);
            assert_eq!(rest[..4], masked_crc(rec).to_le_bytes());
            out.push(rec.to_vec());
            bytes = &rest[4..];
        }
        out
    }

    #[test]
    fn masked_crc_is_tfrecords() {
        // An empty record and "abc" as TensorBoard's own `RecordWriter` frames them.
        let mut out = Vec::new();
        frame(b"", &mut out);
        frame(b"abc", &mut out);
        #[rustfmt::skip]
        let expected = [
            0, 0, 0, 0, 0, 0, 0, 0, 41, 3, 152, 7, 216, 234, 130, 162,
            3, 0, 0, 0, 0, 0, 0, 0, 176, 153, 73, 14, 97, 98, 99, 110, 87, 241, 33,
        ];
        assert_eq!(out, expected);
    }

    #[test]
    fn events_round_trip_and_a_failed_write_leaves_whole_records() {
        let d = tempfile::tempdir().unwrap();
        let mut log = TensorBoardLog::create(d.path(), 3, "lr  0.001").unwrap();
        assert!(owns(log.path().file_name().unwrap().to_str().unwrap()));
        assert!(log
            .append(3, &[("train/loss", 2.5), ("train/lr", 1e-3)])
            .is_none());
        let recs = records(&std::fs::read(log.path()).unwrap());
        let events: Vec<Event> = recs
            .iter()
            .map(|r| Event::decode(r.as_slice()).unwrap())
            .collect();
        assert_eq!(events.len(), 4);
        assert_eq!(events[0].what, Some(What::FileVersion(FILE_VERSION.into())));
        assert_eq!(
            (events[1].step, &events[1].what),
            (
                3,
                &Some(What::SessionLog(SessionLog {
                    status: SESSION_START
                }))
            )
        );
        let Some(What::Summary(s)) = &events[3].what else {
            panic!("{:?}", events[3]);
        };
        assert_eq!(s.value[0].tag, "train/loss");
        assert_eq!(s.value[0].value, Some(ValueKind::SimpleValue(2.5)));
        // A second run start in the directory gets its own file.
        let other = TensorBoardLog::create(d.path(), 1, "").unwrap();
        assert_ne!(other.path(), log.path());
        // A write that fails (a read-only descriptor) is cut back to the whole records.
        let len = std::fs::metadata(log.path()).unwrap().len();
        log.file = std::fs::File::open(log.path()).unwrap();
        assert!(log.append(4, &[("train/loss", 1.0)]).is_some());
        assert!(log.append(5, &[("train/loss", 1.0)]).is_none());
        assert_eq!(log.failed_writes, 2);
        assert_eq!(std::fs::metadata(log.path()).unwrap().len(), len);
    }
}
