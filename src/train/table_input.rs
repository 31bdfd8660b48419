//! A `prepare` input as the Hugging Face hub and `datasets` store it: Parquet (a `.parquet` file,
//! or a directory of shards, as the hub lays them out) and Arrow IPC (a `.arrow` file, or a
//! `Dataset.save_to_disk` folder of them), read with the Apache Arrow crates one row group (one
//! IPC record batch) at a time — only the columns asked for, so a dataset never sits in memory
//! whole — and handed on as JSON records, the shape the JSON Lines route reads.

use crate::util::contain::contain;
use crate::util::progress::{Meter, Unit};
use crate::{Error, Result};
use arrow_array::cast::AsArray;
use arrow_array::{Array, RecordBatch};
use arrow_schema::{DataType, Schema};
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ParquetRecordBatchReaderBuilder};
use parquet::arrow::ProjectionMask;
use serde_json::Value as Json;
use std::path::{Path, PathBuf};

/// Rows decoded at a time.
const BATCH_ROWS: usize = 1024;

/// The files' format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableFormat {
    /// Apache Parquet.
    Parquet,
    /// Arrow IPC (file or stream format; `datasets` writes streams).
    ArrowIpc,
}

/// A tabular input: its files in order.
#[derive(Debug, Clone)]
pub struct TableInput {
    /// The format.
    pub format: TableFormat,
    /// The files, sorted by path.
    pub files: Vec<PathBuf>,
}

/// Where a batch of records came from, for messages: the file and its row group (a Parquet
/// row group, or the IPC record batch).
#[derive(Debug, Clone)]
pub struct BatchAt {
    /// The file.
    pub file: PathBuf,
    /// Its row group (or IPC record batch).
    pub group: usize,
    /// The batch's first row within the row group.
    pub first_row: usize,
}

impl BatchAt {
    /// "FILE, row group G, row R" for row `i` of the batch.
    pub fn row(&self, i: usize) -> String {
        format!(
            "{}, row group {}, row {}",
            self.file.display(),
            self.group,
            self.first_row + i
        )
    }
}

fn bad(what: String, why: impl Into<String>, fix: Option<&str>) -> Error {
    Error::bad_input("input", what, why, fix)
}

impl TableInput {
    /// The tabular input `path` names: a `.parquet` or `.arrow` file, or a directory holding
    /// such files (anywhere below it, Parquet first); `None` for anything else (text and JSON
    /// inputs). A `DatasetDict` folder is refused naming its splits.
    pub fn detect(path: &Path) -> Result<Option<Self>> {
        let ext = |p: &Path, e: &str| p.extension().is_some_and(|x| x == e);
        if path.is_file() {
            return Ok(if ext(path, "parquet") {
                Some(TableInput {
                    format: TableFormat::Parquet,
                    files: vec![path.to_owned()],
                })
            } else if ext(path, "arrow") {
                Some(TableInput {
                    format: TableFormat::ArrowIpc,
                    files: vec![path.to_owned()],
                })
            } else {
                None
            });
        }
        if !path.is_dir() {
            return Ok(split_prefix(path));
        }
        if path.join("dataset_dict.json").is_file() {
            let splits: Vec<String> = std::fs::read_dir(path)
                .map_err(|e| Error::io("list", path, e))?
                .flatten()
                .filter(|e| e.path().is_dir())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            return Err(bad(
                path.display().to_string(),
                format!(
                    "is a DatasetDict (splits: {}); prepare reads one split",
                    splits.join(", ")
                ),
                Some("pass the split's folder, e.g. DIR/train"),
            ));
        }
        let mut all = Vec::new();
        collect_files(path, &mut all, 0)?;
        all.sort();
        for (format, e) in [
            (TableFormat::Parquet, "parquet"),
            (TableFormat::ArrowIpc, "arrow"),
        ] {
            let files: Vec<PathBuf> = all.iter().filter(|p| ext(p, e)).cloned().collect();
            if files.is_empty() {
                continue;
            }
            let splits: std::collections::BTreeSet<String> =
                files.iter().filter_map(|f| split_of(path, f)).collect();
            if splits.len() > 1 {
                // The suggestion names the training split where there is one.
                let first = files
                    .iter()
                    .filter_map(|f| Some((f, split_of(path, f)?)))
                    .min_by_key(|(_, sp)| sp != "train")
                    .map(|(f, sp)| split_input(path, f, &sp))
                    .unwrap_or_default();
                return Err(bad(
                    path.display().to_string(),
                    format!(
                        "holds the shards of several splits ({}); prepare reads one",
                        splits.into_iter().collect::<Vec<_>>().join(", ")
                    ),
                    Some(&format!("pass one split, e.g. --input {first}")),
                ));
            }
            return Ok(Some(TableInput { format, files }));
        }
        Err(bad(
            path.display().to_string(),
            "is a directory without .parquet or .arrow files",
            Some(
                "pass a text, JSON Lines, Parquet or Arrow file, or a directory of Parquet shards",
            ),
        ))
    }

    /// One line for the user: what is read.
    pub fn describe(&self) -> String {
        format!(
            "{} {} file(s), read a row group at a time",
            self.files.len(),
            match self.format {
                TableFormat::Parquet => "Parquet",
                TableFormat::ArrowIpc => "Arrow IPC",
            }
        )
    }

    /// Every row's `columns` as a JSON object, a batch at a time, in file and row order; with
    /// `text`, each column must hold strings (else an error naming its type).
    pub fn for_each_batch(
        &self,
        columns: &[&str],
        text: bool,
        mut f: impl FnMut(&BatchAt, Vec<Json>) -> Result<()>,
    ) -> Result<()> {
        let meter = Meter::start("prepare", self.rows(), Unit::Records);
        let mut each = |at: &BatchAt, batch: &RecordBatch| -> Result<()> {
            if text {
                check_text(batch, columns, at)?;
            }
            f(at, records(batch, columns, at)?)?;
            meter.add(batch.num_rows() as u64);
            Ok(())
        };
        for file in &self.files {
            match self.format {
                TableFormat::Parquet => parquet_batches(file, columns, &mut each)?,
                TableFormat::ArrowIpc => ipc_batches(file, columns, &mut each)?,
            }
        }
        meter.finish();
        Ok(())
    }

    /// Rows in all the files, as Parquet footers say (0: not known, as for Arrow IPC streams
    /// or a footer that cannot be read — which the read itself then reports).
    fn rows(&self) -> u64 {
        if self.format != TableFormat::Parquet {
            return 0;
        }
        let rows = |f: &PathBuf| -> Option<u64> {
            let fh = std::fs::File::open(f).ok()?;
            let meta = contain(|| ArrowReaderMetadata::load(&fh, Default::default()))
                .ok()?
                .ok()?;
            u64::try_from(meta.metadata().file_metadata().num_rows()).ok()
        };
        self.files.iter().map(|f| rows(f).unwrap_or(0)).sum()
    }
}

/// The split a file of a dataset directory `root` belongs to: the hub's shard names
/// (`{split}-00000-of-00004.parquet`) or a split's folder (`train/…`); `None` when neither says.
fn split_of(root: &Path, file: &Path) -> Option<String> {
    const SPLITS: [&str; 6] = ["train", "test", "validation", "valid", "dev", "eval"];
    let stem = file.file_stem()?.to_str()?;
    if let Some((split, _)) = shard_name(stem) {
        if split != "data" {
            return Some(split.to_owned());
        }
    }
    file.strip_prefix(root)
        .ok()?
        .parent()?
        .components()
        .filter_map(|c| c.as_os_str().to_str())
        .find(|c| SPLITS.contains(c))
        .map(str::to_owned)
}

/// `("train", "00000-of-00004")` for a shard's stem `train-00000-of-00004`.
fn shard_name(stem: &str) -> Option<(&str, &str)> {
    let (head, total) = stem.rsplit_once("-of-")?;
    let (split, index) = head.rsplit_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (digits(index) && digits(total)).then_some((split, &stem[split.len() + 1..]))
}

/// How to name split `split` of `root` as an input (`file` is one of its shards): its folder,
/// or the shards' path prefix (`DIR/data/train`).
fn split_input(root: &Path, file: &Path, split: &str) -> String {
    let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    match shard_name(stem) {
        Some((s, _)) if s == split => file.with_file_name(split).display().to_string(),
        _ => root.join(split).display().to_string(),
    }
}

/// `PREFIX` naming the shards `PREFIX-00000-of-0000n.{parquet,arrow}` beside it (one split of a
/// hub dataset: `--input DIR/data/train`).
fn split_prefix(path: &Path) -> Option<TableInput> {
    let (dir, name) = (path.parent()?, path.file_name()?.to_str()?);
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_stem()
                .and_then(|s| s.to_str())
                .and_then(shard_name)
                .is_some_and(|(split, _)| split == name)
        })
        .collect();
    files.sort();
    let format = match files.first()?.extension()?.to_str()? {
        "parquet" => TableFormat::Parquet,
        "arrow" => TableFormat::ArrowIpc,
        _ => return None,
    };
    let ext = files.first()?.extension()?.to_owned();
    files.retain(|f| f.extension() == Some(&ext));
    Some(TableInput { format, files })
}

/// Files below `dir` (hidden entries and `datasets`' cache files skipped), at most 8 deep.
fn collect_files(dir: &Path, out: &mut Vec<PathBuf>, depth: usize) -> Result<()> {
    if depth > 8 {
        return Ok(());
    }
    for e in std::fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))? {
        let e = e.map_err(|e| Error::io("list", dir, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || name.starts_with("cache-") {
            continue;
        }
        let p = e.path();
        if p.is_dir() {
            collect_files(&p, out, depth + 1)?;
        } else {
            out.push(p);
        }
    }
    Ok(())
}

/// The indices of `columns` in `schema`, or an error naming the file and the columns it has.
fn column_indices(schema: &Schema, columns: &[&str], file: &Path) -> Result<Vec<usize>> {
    columns
        .iter()
        .map(|c| {
            schema.index_of(c).map_err(|_| {
                let have: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
                bad(
                    file.display().to_string(),
                    format!("has no column `{c}` (its columns: {})", have.join(", ")),
                    Some("name the column (--text-key for text; prompt/completion or messages for the other formats)"),
                )
            })
        })
        .collect()
}

fn parquet_batches(
    file: &Path,
    columns: &[&str],
    f: &mut impl FnMut(&BatchAt, &RecordBatch) -> Result<()>,
) -> Result<()> {
    let open = || std::fs::File::open(file).map_err(|e| Error::io("open", file, e));
    let not_parquet = |e: &dyn std::fmt::Display| {
        bad(
            file.display().to_string(),
            format!("is not a readable Parquet file: {e}"),
            Some("re-download or re-write it (a truncated file has no footer)"),
        )
    };
    let fh = open()?;
    let meta = contain(|| ArrowReaderMetadata::load(&fh, Default::default()))
        .map_err(|p| not_parquet(&p))?
        .map_err(|e| not_parquet(&e))?;
    let idx = column_indices(meta.schema(), columns, file)?;
    let groups = meta.metadata().num_row_groups();
    for group in 0..groups {
        let failed = |e: &dyn std::fmt::Display| group_error(file, group, columns, e);
        let mask = ProjectionMask::roots(meta.parquet_schema(), idx.iter().copied());
        let fh = open()?;
        let mut reader = contain(|| {
            ParquetRecordBatchReaderBuilder::new_with_metadata(fh, meta.clone())
                .with_row_groups(vec![group])
                .with_projection(mask)
                .with_batch_size(BATCH_ROWS)
                .build()
        })
        .map_err(|p| failed(&p))?
        .map_err(|e| failed(&e))?;
        let mut first_row = 0;
        while let Some(batch) = contain(|| reader.next()).map_err(|p| failed(&p))? {
            let batch = batch.map_err(|e| failed(&e))?;
            let at = BatchAt {
                file: file.to_owned(),
                group,
                first_row,
            };
            first_row += batch.num_rows();
            f(&at, &batch)?;
        }
    }
    Ok(())
}

fn group_error(file: &Path, group: usize, columns: &[&str], e: &dyn std::fmt::Display) -> Error {
    bad(
        format!("{}, row group {group}", file.display()),
        format!("cannot be decoded (columns {}): {e}", columns.join(", ")),
        Some("re-download or re-write the file; it is damaged or uses a codec this build lacks (snappy and lz4 are read; zstd, gzip and brotli are not)"),
    )
}

/// An Arrow IPC reader of either format, the columns wanted projected.
type IpcBatches =
    Box<dyn Iterator<Item = std::result::Result<RecordBatch, arrow_schema::ArrowError>>>;

fn ipc_batches(
    file: &Path,
    columns: &[&str],
    f: &mut impl FnMut(&BatchAt, &RecordBatch) -> Result<()>,
) -> Result<()> {
    let mut fh = std::fs::File::open(file).map_err(|e| Error::io("open", file, e))?;
    let mut magic = [0u8; 6];
    let file_format = std::io::Read::read_exact(&mut fh, &mut magic).is_ok() && &magic == b"ARROW1";
    let fh = std::fs::File::open(file).map_err(|e| Error::io("open", file, e))?;
    let not_arrow = |e: &dyn std::fmt::Display| {
        bad(
            file.display().to_string(),
            format!("is not a readable Arrow IPC file: {e}"),
            Some("pass the .arrow files `Dataset.save_to_disk` wrote, or Parquet"),
        )
    };
    // The schema first (a reader without projection reads only the header here), then a
    // reader that decodes the columns wanted alone (an image column is never decoded).
    let open_again = || {
        std::fs::File::open(file)
            .map(std::io::BufReader::new)
            .map_err(|e| Error::io("open", file, e))
    };
    let opened = contain(|| -> Result<IpcBatches> {
        let fh = std::io::BufReader::new(fh);
        Ok(if file_format {
            let r = arrow_ipc::reader::FileReader::try_new(fh, None).map_err(|e| not_arrow(&e))?;
            let idx = column_indices(&r.schema(), columns, file)?;
            Box::new(
                arrow_ipc::reader::FileReader::try_new(open_again()?, Some(idx))
                    .map_err(|e| not_arrow(&e))?,
            )
        } else {
            let r =
                arrow_ipc::reader::StreamReader::try_new(fh, None).map_err(|e| not_arrow(&e))?;
            let idx = column_indices(&r.schema(), columns, file)?;
            Box::new(
                arrow_ipc::reader::StreamReader::try_new(open_again()?, Some(idx))
                    .map_err(|e| not_arrow(&e))?,
            )
        })
    });
    let mut batches = opened.map_err(|p| not_arrow(&p))??;
    let mut group = 0;
    loop {
        let failed = |e: &dyn std::fmt::Display| group_error(file, group, columns, e);
        let Some(batch) = contain(|| batches.next()).map_err(|p| failed(&p))? else {
            return Ok(());
        };
        let batch = batch.map_err(|e| failed(&e))?;
        let at = BatchAt {
            file: file.to_owned(),
            group,
            first_row: 0,
        };
        f(&at, &batch)?;
        group += 1;
    }
}

/// Every column of `batch` (named `columns`) holds strings.
fn check_text(batch: &RecordBatch, columns: &[&str], at: &BatchAt) -> Result<()> {
    for (c, name) in columns.iter().enumerate() {
        let t = batch.column(c).data_type();
        if !matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View) {
            return Err(bad(
                format!(
                    "{}, row group {}, column `{name}`",
                    at.file.display(),
                    at.group
                ),
                format!("is of type {t}, not text"),
                Some("name a text column (--text-key)"),
            ));
        }
    }
    Ok(())
}

/// The rows of `batch` (its columns named `columns`, in order) as JSON objects; a null where a
/// value is needed, or a column of a type that is not text, is an error naming the row.
fn records(batch: &RecordBatch, columns: &[&str], at: &BatchAt) -> Result<Vec<Json>> {
    let mut rows = vec![serde_json::Map::new(); batch.num_rows()];
    for (c, name) in columns.iter().enumerate() {
        let col = batch.column(c);
        for (i, row) in rows.iter_mut().enumerate() {
            let v = value(col.as_ref(), i).map_err(|why| {
                bad(
                    format!("{}, column `{name}`", at.row(i)),
                    why.to_string(),
                    Some("fix the dataset, or filter such rows out before preparing it"),
                )
            })?;
            row.insert((*name).to_owned(), v);
        }
    }
    Ok(rows.into_iter().map(Json::Object).collect())
}

/// Why one cell cannot become a JSON value.
#[derive(Debug, thiserror::Error)]
enum CellError {
    #[error("is null")]
    Null,
    #[error("is of type {0}, not text, a number or a list")]
    Type(DataType),
}

/// Row `i` of `a` as JSON: strings, numbers, booleans, lists and structs of them (a chat's
/// `messages`); a null is an error.
fn value(a: &dyn Array, i: usize) -> std::result::Result<Json, CellError> {
    use arrow_array::types::{
        Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type,
        UInt32Type, UInt64Type, UInt8Type,
    };
    if a.is_null(i) {
        return Err(CellError::Null);
    }
    let json = match a.data_type() {
        DataType::Utf8 => Json::from(a.as_string::<i32>().value(i)),
        DataType::LargeUtf8 => Json::from(a.as_string::<i64>().value(i)),
        DataType::Utf8View => Json::from(a.as_string_view().value(i)),
        DataType::Boolean => Json::from(a.as_boolean().value(i)),
        DataType::Int8 => Json::from(a.as_primitive::<Int8Type>().value(i)),
        DataType::Int16 => Json::from(a.as_primitive::<Int16Type>().value(i)),
        DataType::Int32 => Json::from(a.as_primitive::<Int32Type>().value(i)),
        DataType::Int64 => Json::from(a.as_primitive::<Int64Type>().value(i)),
        DataType::UInt8 => Json::from(a.as_primitive::<UInt8Type>().value(i)),
        DataType::UInt16 => Json::from(a.as_primitive::<UInt16Type>().value(i)),
        DataType::UInt32 => Json::from(a.as_primitive::<UInt32Type>().value(i)),
        DataType::UInt64 => Json::from(a.as_primitive::<UInt64Type>().value(i)),
        DataType::Float32 => Json::from(f64::from(a.as_primitive::<Float32Type>().value(i))),
        DataType::Float64 => Json::from(a.as_primitive::<Float64Type>().value(i)),
        DataType::List(_) => list(a.as_list::<i32>().value(i).as_ref())?,
        DataType::LargeList(_) => list(a.as_list::<i64>().value(i).as_ref())?,
        DataType::Struct(fields) => {
            let s = a.as_struct();
            let mut m = serde_json::Map::new();
            for (f, col) in fields.iter().zip(s.columns()) {
                // A missing field of a struct (a message without `name`) is left out.
                if col.is_null(i) {
                    continue;
                }
                m.insert(f.name().clone(), value(col.as_ref(), i)?);
            }
            Json::Object(m)
        }
        other => return Err(CellError::Type(other.clone())),
    };
    Ok(json)
}

fn list(items: &dyn Array) -> std::result::Result<Json, CellError> {
    (0..items.len())
        .map(|j| value(items, j))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map(Json::Array)
}
