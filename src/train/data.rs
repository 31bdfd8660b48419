//! Pre-tokenized training data, memory-mapped, as rows of micro-batches. Two kinds of file:
//!
//! - a flat little-endian u16/u32 token file, read as consecutive rows of `seq_len + 1` tokens
//!   (row r = tokens[r·(T+1) .. (r+1)·(T+1)]; inputs are its first T tokens, targets its last T,
//!   every one trained, positions 0..T);
//! - a document file ([`super::documents`]), whose documents are packed greedily, in order, into
//!   rows of T tokens ([`Packing::On`]; one per row with [`Packing::Off`]), never split: inside a
//!   row each document's positions restart at 0, so attention never crosses a document boundary
//!   (the device program's positions); a document's last token and the padding at a row's end
//!   have [`IGNORE`] targets, as do the tokens its loss mask leaves out.
//!
//! Rows are consumed in order, or in a seeded permutation per epoch with `shuffle`.

use super::config::{DataDtype, Overlong, Packing};
use super::documents::{is_document_file, DocFile};
use crate::engine::MicroBatch;
use crate::model::ops::{flat_positions, IGNORE};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// A memory-mapped token file.
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    map: memmap2::Mmap,
    dtype: DataDtype,
    len: usize,
}

impl TokenFile {
    /// Map `path` and check it against the vocabulary (every id < `vocab`).
    pub fn open(path: &Path, dtype: DataDtype, vocab: usize) -> Result<Self> {
        check_data_path(path)?;
        let f = std::fs::File::open(path)
            .map_err(|e| Error::io("open data", path, e).with_fix("check --data / --val-data"))?;
        // SAFETY: read-only private mapping; if another process truncates the file while we train
        // we may fault, which is the documented hazard of mmap'd input (as with numpy.memmap).
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io("mmap data", path, e))?;
        let width = match dtype {
            DataDtype::U16 => 2,
            DataDtype::U32 => 4,
        };
        let shown = path.display().to_string();
        if map.len() % width != 0 {
            return Err(Error::bad_input(
                "data file",
                shown,
                format!(
                    "{} bytes is not a multiple of {width} ({dtype:?} tokens)",
                    map.len()
                ),
                Some("check --data-dtype, or re-run `megatrain prepare`"),
            ));
        }
        let tf = TokenFile {
            path: path.to_owned(),
            len: map.len() / width,
            map,
            dtype,
        };
        if let Some((i, t)) = (0..tf.len)
            .map(|i| (i, tf.get(i)))
            .find(|&(_, t)| t as usize >= vocab)
        {
            return Err(Error::bad_input(
                "data file",
                tf.path.display().to_string(),
                format!("token {t} at position {i} is ≥ the model's vocab size {vocab}"),
                Some(&tf.advice_beyond_vocab(vocab)),
            ));
        }
        Ok(tf)
    }

    /// Tokens in the file.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What to do about an id beyond the vocabulary: decompression for a compressed file, the
    /// other element type when the file reads as valid ids that way, else the model's tokenizer.
    fn advice_beyond_vocab(&self, vocab: usize) -> String {
        if let Some((name, cmd)) = crate::util::compression(&self.map[..self.map.len().min(8)]) {
            return format!(
                "the file is {name}-compressed: decompress it first (`{cmd} {}`)",
                self.path.display()
            );
        }
        let fits = |width: usize| {
            self.map.len().is_multiple_of(width)
                && self.map.chunks_exact(width).all(|c| {
                    let id = if width == 2 {
                        u32::from(u16::from_le_bytes([c[0], c[1]]))
                    } else {
                        u32::from_le_bytes([c[0], c[1], c[2], c[3]])
                    };
                    (id as usize) < vocab
                })
        };
        match self.dtype {
            DataDtype::U16 if fits(4) => {
                "the file reads as valid ids as u32 tokens: pass --data-dtype u32".into()
            }
            DataDtype::U32 if fits(2) => {
                "the file reads as valid ids as u16 tokens: pass --data-dtype u16".into()
            }
            _ => "the data was tokenized for another vocabulary: prepare it with this model's tokenizer (`megatrain prepare --tokenizer MODEL_DIR`)".into(),
        }
    }

    fn get(&self, i: usize) -> u32 {
        match self.dtype {
            DataDtype::U16 => u32::from(u16::from_le_bytes([self.map[2 * i], self.map[2 * i + 1]])),
            DataDtype::U32 => u32::from_le_bytes([
                self.map[4 * i],
                self.map[4 * i + 1],
                self.map[4 * i + 2],
                self.map[4 * i + 3],
            ]),
        }
    }

    /// Rows of `seq + 1` tokens.
    pub fn rows(&self, seq: usize) -> usize {
        self.len / (seq + 1)
    }

    /// Row `r`: inputs and targets, T each, appended to `x` and `y`.
    fn row(&self, r: usize, seq: usize, x: &mut Vec<u32>, y: &mut Vec<u32>) {
        let base = r * (seq + 1);
        x.extend((base..base + seq).map(|i| self.get(i)));
        y.extend((base + 1..base + seq + 1).map(|i| self.get(i)));
    }
}

/// `path` must be a regular file: a directory is not a token file, and a pipe or device cannot
/// be mapped and read many times (and opening a FIFO would wait for a writer).
fn check_data_path(path: &Path) -> Result<()> {
    if path.is_dir() {
        return Err(Error::bad_input(
            "data file",
            path.display().to_string(),
            "is a directory; --data and --val-data take a token file",
            Some("pass the .bin file `megatrain prepare` wrote (e.g. DIR/train.bin)"),
        ));
    }
    // Checked before opening: opening a FIFO waits for a writer.
    let meta = std::fs::metadata(path)
        .map_err(|e| Error::io("open data", path, e).with_fix("check --data / --val-data"))?;
    if !meta.is_file() {
        return Err(Error::bad_input(
            "data file",
            path.display().to_string(),
            "is not a regular file (a pipe or device?): training reads its data many times, mapped into memory",
            Some("write the tokens to a file first (`megatrain prepare --out FILE`) and pass that"),
        ));
    }
    Ok(())
}

/// A data file of either kind, recognised by its first bytes.
#[derive(Debug)]
pub enum DataFile {
    /// Flat tokens.
    Tokens(TokenFile),
    /// Documents with loss masks.
    Documents(DocFile),
}

impl DataFile {
    /// Open `path`: a document file if it starts with the document magic, else a flat token
    /// file of `dtype`; checked against the vocabulary.
    pub fn open(path: &Path, dtype: DataDtype, vocab: usize) -> Result<Self> {
        check_data_path(path)?;
        if is_document_file(path) {
            return DocFile::open(path, vocab).map(DataFile::Documents);
        }
        TokenFile::open(path, dtype, vocab).map(DataFile::Tokens)
    }
}

/// How documents were laid into rows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PackReport {
    /// Documents in the file.
    pub documents: usize,
    /// Rows made.
    pub rows: usize,
    /// Documents cut to the row length.
    pub truncated: usize,
    /// Documents left out (too long with [`Overlong::Drop`], or no trained token within the
    /// row length).
    pub dropped: usize,
    /// Of those, left out for being longer than a row ([`Overlong::Drop`]).
    pub too_long: usize,
    /// Tokens of the shortest document.
    pub shortest: usize,
    /// Document tokens in the rows (the rest is padding).
    pub tokens: usize,
    /// Trained targets in the rows.
    pub trained: usize,
}

impl std::fmt::Display for PackReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} documents in {} rows ({} tokens, {} trained; {} truncated, {} dropped)",
            self.documents - self.dropped,
            self.rows,
            self.tokens,
            self.trained,
            self.truncated,
            self.dropped
        )
    }
}

/// Documents packed into rows: row r holds the pieces `pieces[rows[r]..rows[r + 1]]`, each a
/// document's first tokens `(start, len)`, laid end to end.
#[derive(Debug)]
struct Packed {
    docs: DocFile,
    rows: Vec<usize>,
    pieces: Vec<(usize, usize)>,
    report: PackReport,
}

impl Packed {
    /// Pack `docs` into rows of `seq` tokens.
    fn new(docs: DocFile, seq: usize, packing: Packing, overlong: Overlong) -> Self {
        let mut report = PackReport {
            documents: docs.documents(),
            shortest: (0..docs.documents())
                .map(|d| docs.range(d).len())
                .min()
                .unwrap_or(0),
            ..PackReport::default()
        };
        let (mut rows, mut pieces, mut fill) = (vec![0], Vec::new(), 0usize);
        for d in 0..docs.documents() {
            let r = docs.range(d);
            let len = if r.len() <= seq {
                r.len()
            } else if overlong == Overlong::Drop {
                report.dropped += 1;
                report.too_long += 1;
                continue;
            } else {
                seq
            };
            // Targets are tokens 1..len of the piece.
            let trained = (r.start + 1..r.start + len)
                .filter(|&i| docs.trained(i))
                .count();
            if trained == 0 {
                report.dropped += 1;
                continue;
            }
            report.truncated += usize::from(len < r.len());
            report.tokens += len;
            report.trained += trained;
            if fill + len > seq || (packing == Packing::Off && fill > 0) {
                rows.push(pieces.len());
                fill = 0;
            }
            pieces.push((r.start, len));
            fill += len;
        }
        if fill > 0 {
            rows.push(pieces.len());
        }
        report.rows = rows.len() - 1;
        Packed {
            docs,
            rows,
            pieces,
            report,
        }
    }

    /// Row `r`'s inputs, targets and positions, T each, appended; returns how many of its
    /// tokens (its tail) are padding.
    fn row(
        &self,
        r: usize,
        seq: usize,
        x: &mut Vec<u32>,
        y: &mut Vec<u32>,
        p: &mut Vec<u32>,
    ) -> usize {
        let mut used = 0;
        for &(start, len) in &self.pieces[self.rows[r]..self.rows[r + 1]] {
            x.extend((start..start + len).map(|i| self.docs.token(i)));
            y.extend(
                (start + 1..start + len).map(|i| match self.docs.trained(i) {
                    true => self.docs.token(i),
                    false => IGNORE,
                }),
            );
            y.push(IGNORE); // the document's last token predicts nothing
            p.extend(0..len as u32);
            used += len;
        }
        let pad = seq - used;
        x.extend(std::iter::repeat_n(self.docs.pad_id(), pad));
        y.extend(std::iter::repeat_n(IGNORE, pad));
        p.extend(0..pad as u32);
        pad
    }
}

/// Rows of one data file.
#[derive(Debug)]
enum Rows {
    Flat(TokenFile),
    Packed(Packed),
}

impl Rows {
    fn count(&self, seq: usize) -> usize {
        match self {
            Rows::Flat(f) => f.rows(seq),
            Rows::Packed(p) => p.rows.len() - 1,
        }
    }

    fn path(&self) -> &Path {
        match self {
            Rows::Flat(f) => &f.path,
            Rows::Packed(p) => p.docs.path(),
        }
    }
}

/// Where the reader is: epoch and position in that epoch's row order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Cursor {
    /// Epoch (0-based).
    pub epoch: u64,
    /// Rows consumed in this epoch.
    pub position: u64,
}

/// The row order of `epoch`: identity, or a Fisher–Yates permutation seeded by (seed, epoch).
pub fn epoch_order(rows: usize, shuffle: bool, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..rows).collect();
    if shuffle {
        let mut s = seed ^ epoch.wrapping_mul(0xA24B_AED4_963E_E407);
        for i in (1..rows).rev() {
            let j = (crate::util::splitmix64(&mut s) % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
    }
    order
}

/// Sequential reader of micro-batches.
#[derive(Debug)]
pub struct Loader {
    rows: Rows,
    seq: usize,
    batch: usize,
    shuffle: bool,
    seed: u64,
    order: Vec<usize>,
    /// Position of the next row.
    pub cursor: Cursor,
}

/// How a [`Loader`] lays out its rows.
#[derive(Debug, Clone, Copy)]
pub struct RowSpec {
    /// Tokens per row.
    pub seq: usize,
    /// Rows per micro-batch.
    pub batch: usize,
    /// Document files: several documents per row or one.
    pub packing: Packing,
    /// Document files: what to do with a document longer than a row.
    pub overlong: Overlong,
}

impl Loader {
    /// A loader over `file`; fails if one micro-batch does not fit in it.
    pub fn new(
        file: DataFile,
        spec: RowSpec,
        shuffle: bool,
        seed: u64,
        cursor: Cursor,
    ) -> Result<Self> {
        let RowSpec { seq, batch, .. } = spec;
        let rows = match file {
            DataFile::Tokens(f) => Rows::Flat(f),
            DataFile::Documents(d) => {
                Rows::Packed(Packed::new(d, seq, spec.packing, spec.overlong))
            }
        };
        let count = rows.count(seq);
        if count < batch {
            let what = match &rows {
                Rows::Flat(f) => format!(
                    "{} tokens make {count} rows of {} tokens, fewer than one batch of {batch}",
                    f.len(),
                    seq + 1
                ),
                Rows::Packed(p) => format!(
                    "{} of {seq} tokens: fewer than one batch of {batch}",
                    p.report
                ),
            };
            let fix = match &rows {
                Rows::Packed(p) if p.report.too_long > 0 && p.report.shortest > seq => format!(
                    "every document is longer than a row of {seq} tokens and --overlong drop leaves them out, so nothing would train: raise --seq-len to at least {} (the shortest document), or pass --overlong truncate",
                    p.report.shortest
                ),
                Rows::Packed(p) if p.report.too_long > 0 => format!(
                    "{} document(s) longer than {seq} tokens are left out (--overlong drop): raise --seq-len, pass --overlong truncate, use more data, or a smaller --batch-size",
                    p.report.too_long
                ),
                Rows::Packed(_) => "use more data, or a smaller --batch-size".to_owned(),
                Rows::Flat(_) => "use more data, or a smaller --seq-len / --batch-size".to_owned(),
            };
            return Err(Error::bad_input(
                "data file",
                rows.path().display().to_string(),
                what,
                Some(&fix),
            ));
        }
        let order = epoch_order(count, shuffle, seed, cursor.epoch);
        Ok(Loader {
            rows,
            seq,
            batch,
            shuffle,
            seed,
            order,
            cursor,
        })
    }

    /// How a document file was packed (`None` for flat tokens).
    pub fn packed(&self) -> Option<PackReport> {
        match &self.rows {
            Rows::Flat(_) => None,
            Rows::Packed(p) => Some(p.report),
        }
    }

    /// The next `batch` rows.
    pub fn next_batch(&mut self) -> MicroBatch {
        let n = self.batch * self.seq;
        let (mut x, mut y) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let mut positions = Vec::with_capacity(n);
        // Padding flags per token, made only when a row has padding.
        let mut pad: Option<Vec<u8>> = None;
        for row in 0..self.batch {
            if self.cursor.position as usize >= self.order.len() {
                self.cursor = Cursor {
                    epoch: self.cursor.epoch + 1,
                    position: 0,
                };
                self.order =
                    epoch_order(self.order.len(), self.shuffle, self.seed, self.cursor.epoch);
            }
            let r = self.order[self.cursor.position as usize];
            match &self.rows {
                Rows::Flat(f) => {
                    f.row(r, self.seq, &mut x, &mut y);
                    positions.extend(flat_positions(1, self.seq));
                }
                Rows::Packed(p) => {
                    let tail = p.row(r, self.seq, &mut x, &mut y, &mut positions);
                    if tail > 0 {
                        let flags = pad.get_or_insert_with(|| vec![0; n]);
                        let end = (row + 1) * self.seq;
                        flags[end - tail..end].fill(1);
                    }
                }
            }
            self.cursor.position += 1;
        }
        MicroBatch {
            tokens: x.into(),
            targets: y.into(),
            positions: positions.into(),
            pad: pad.map(Into::into),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::documents::Document;
    use super::*;

    fn spec(seq: usize, batch: usize) -> RowSpec {
        RowSpec {
            seq,
            batch,
            packing: Packing::On,
            overlong: Overlong::Truncate,
        }
    }

    fn file(tokens: &[u16]) -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.bin");
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(&p, bytes).unwrap();
        (d, p)
    }

    #[test]
    fn rows_are_consecutive_and_targets_shifted() {
        let toks: Vec<u16> = (0..20).collect();
        let (_d, p) = file(&toks);
        let f = DataFile::open(&p, DataDtype::U16, 100).unwrap();
        let mut l = Loader::new(f, spec(4, 2), false, 0, Cursor::default()).unwrap();
        let mb = l.next_batch();
        assert_eq!(&mb.tokens[..], &[0, 1, 2, 3, 5, 6, 7, 8]);
        assert_eq!(&mb.targets[..], &[1, 2, 3, 4, 6, 7, 8, 9]);
        assert_eq!(&mb.positions[..], &[0, 1, 2, 3, 0, 1, 2, 3]);
        let _ = l.next_batch(); // rows 2, 3
        assert_eq!(
            l.cursor,
            Cursor {
                epoch: 0,
                position: 4
            }
        );
        let mb = l.next_batch(); // wraps to epoch 1
        assert_eq!(&mb.tokens[..4], &[0, 1, 2, 3]);
        assert_eq!(l.cursor.epoch, 1);
    }

    #[test]
    fn shuffle_is_a_seeded_permutation() {
        let a = epoch_order(100, true, 7, 0);
        let mut s = a.clone();
        s.sort();
        assert_eq!(s, (0..100).collect::<Vec<_>>());
        assert_eq!(a, epoch_order(100, true, 7, 0));
        assert_ne!(a, epoch_order(100, true, 7, 1));
    }

    #[test]
    fn bad_files_are_named() {
        let (_d, p) = file(&[1, 2, 300]);
        let e = TokenFile::open(&p, DataDtype::U16, 256)
            .unwrap_err()
            .to_string();
        assert!(e.contains("300") && e.contains("vocab"), "{e}");
        std::fs::write(&p, [1u8, 2, 3]).unwrap();
        let e = TokenFile::open(&p, DataDtype::U16, 256)
            .unwrap_err()
            .to_string();
        assert!(e.contains("multiple of 2"), "{e}");
        let (_d2, p2) = file(&[1, 2, 3]);
        let f = DataFile::open(&p2, DataDtype::U16, 256).unwrap();
        let e = Loader::new(f, spec(4, 1), false, 0, Cursor::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("fewer than one batch"), "{e}");
    }

    fn doc(tokens: &[u32], trained_from: usize) -> Document {
        Document {
            tokens: tokens.to_vec(),
            mask: (0..tokens.len())
                .map(|i| i >= trained_from.max(1))
                .collect(),
        }
    }

    fn loader(docs: &[Document], spec: RowSpec) -> (tempfile::TempDir, Result<Loader>) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("docs.bin");
        std::fs::write(&p, super::super::documents::encode(docs, 2, 0).unwrap()).unwrap();
        let f = DataFile::open(&p, DataDtype::U32, 100).unwrap();
        let l = Loader::new(f, spec, false, 0, Cursor::default());
        (d, l)
    }

    #[test]
    fn rows_shorter_than_every_document_advise_a_longer_seq_len_not_a_shorter_one() {
        let docs = [doc(&[1, 2, 3, 4, 5, 6], 0), doc(&[1, 2, 3, 4, 5], 0)];
        let drop = RowSpec {
            overlong: Overlong::Drop,
            ..spec(4, 1)
        };
        let (_d, l) = loader(&docs, drop);
        let e = l.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            e.contains("every document is longer than a row of 4 tokens")
                && e.contains("raise --seq-len to at least 5")
                && !e.contains("smaller --seq-len"),
            "{e}"
        );
        // Too few rows for a batch (truncated documents train): more data or a smaller batch.
        let (_d, l) = loader(&docs, spec(4, 3));
        let e = l.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            e.contains("smaller --batch-size") && !e.contains("--seq-len"),
            "{e}"
        );
    }

    #[test]
    fn documents_pack_greedily_with_positions_restarting_and_masks() {
        // Lengths 3, 4, 2, 6, 3 into rows of 8: [3 4] [2 6] [3]; the third document's prompt
        // (token 0) is untrained, the last document is trained from its second target on.
        let docs = [
            doc(&[10, 11, 12], 0),
            doc(&[20, 21, 22, 23], 0),
            doc(&[30, 31], 0),
            doc(&[40, 41, 42, 43, 44, 45], 3),
            doc(&[50, 51, 52], 2),
        ];
        let (_d, l) = loader(&docs, spec(8, 1));
        let mut l = l.unwrap();
        let r = l.packed().unwrap();
        assert_eq!((r.documents, r.rows, r.truncated, r.dropped), (5, 3, 0, 0));
        assert_eq!((r.tokens, r.trained), (18, 2 + 3 + 1 + 3 + 1));
        let x = IGNORE;
        let mb = l.next_batch();
        assert_eq!(&mb.tokens[..], &[10, 11, 12, 20, 21, 22, 23, 0]);
        assert_eq!(&mb.targets[..], &[11, 12, x, 21, 22, 23, x, x]);
        assert_eq!(&mb.positions[..], &[0, 1, 2, 0, 1, 2, 3, 0]);
        // The row's tail is padding (untrained targets are not: the flags say which is which).
        assert_eq!(mb.pad.as_deref(), Some(&[0, 0, 0, 0, 0, 0, 0, 1][..]));
        let mb = l.next_batch();
        assert_eq!(&mb.tokens[..], &[30, 31, 40, 41, 42, 43, 44, 45]);
        assert_eq!(&mb.targets[..], &[31, x, x, x, 43, 44, 45, x]);
        assert_eq!(&mb.positions[..], &[0, 1, 0, 1, 2, 3, 4, 5]);
        assert_eq!(mb.pad, None, "a full row has no padding");
        let mb = l.next_batch();
        assert_eq!(&mb.targets[..], &[x, 52, x, x, x, x, x, x]);
        assert_eq!(&mb.positions[..], &[0, 1, 2, 0, 1, 2, 3, 4]);
        assert_eq!(mb.pad.as_deref(), Some(&[0, 0, 0, 1, 1, 1, 1, 1][..]));
    }

    #[test]
    fn packing_off_truncation_and_drops_are_counted() {
        let docs = [
            doc(&[1, 2, 3], 0),
            doc(&[4, 5, 6, 7, 8, 9], 0),
            doc(&[1, 2, 3, 4, 5, 6], 5), // trained only past the row: dropped when cut
            doc(&[7, 8], 0),
        ];
        let (_d, l) = loader(
            &docs,
            RowSpec {
                packing: Packing::Off,
                ..spec(4, 1)
            },
        );
        let mut l = l.unwrap();
        let r = l.packed().unwrap();
        assert_eq!((r.rows, r.truncated, r.dropped), (3, 1, 1));
        assert_eq!(&l.next_batch().tokens[..], &[1, 2, 3, 0]);
        let mb = l.next_batch();
        assert_eq!(&mb.tokens[..], &[4, 5, 6, 7]);
        assert_eq!(&mb.targets[..], &[5, 6, 7, IGNORE]);
        let (_d, l) = loader(
            &docs,
            RowSpec {
                overlong: Overlong::Drop,
                ..spec(4, 1)
            },
        );
        let r = l.unwrap().packed().unwrap();
        assert_eq!((r.rows, r.truncated, r.dropped), (2, 0, 2));
        let (_d, l) = loader(&docs, spec(4, 5));
        let e = l.unwrap_err().to_string();
        assert!(
            e.contains("fewer than one batch of 5") && e.contains("1 truncated"),
            "{e}"
        );
    }
}
