//! Pre-tokenized training data: a flat little-endian u16/u32 token file, memory-mapped, read as
//! consecutive rows of `seq_len + 1` tokens (row r = tokens[r·(T+1) .. (r+1)·(T+1)]; inputs are its
//! first T tokens, targets its last T). Rows are consumed in order, or in a seeded permutation per
//! epoch with `shuffle`.

use super::config::DataDtype;
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
        if path.is_dir() {
            return Err(Error::bad_input(
                "data file",
                path.display().to_string(),
                "is a directory; --data and --val-data take a token file",
                Some("pass the .bin file `megatrain prepare` wrote (e.g. DIR/train.bin)"),
            ));
        }
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
                Some("tokenize with the model's tokenizer (or check --data-dtype)"),
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

    /// Row `r`: (inputs, targets), T each.
    pub fn row(&self, r: usize, seq: usize) -> (Vec<u32>, Vec<u32>) {
        let base = r * (seq + 1);
        let toks: Vec<u32> = (base..base + seq + 1).map(|i| self.get(i)).collect();
        (toks[..seq].to_vec(), toks[1..].to_vec())
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

/// splitmix64: a tiny, well-known deterministic generator for the shuffle.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The row order of `epoch`: identity, or a Fisher–Yates permutation seeded by (seed, epoch).
pub fn epoch_order(rows: usize, shuffle: bool, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..rows).collect();
    if shuffle {
        let mut s = seed ^ epoch.wrapping_mul(0xA24B_AED4_963E_E407);
        for i in (1..rows).rev() {
            let j = (splitmix(&mut s) % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
    }
    order
}

/// Sequential reader of micro-batches.
#[derive(Debug)]
pub struct Loader {
    file: TokenFile,
    seq: usize,
    batch: usize,
    shuffle: bool,
    seed: u64,
    order: Vec<usize>,
    /// Position of the next row.
    pub cursor: Cursor,
}

impl Loader {
    /// A loader over `file`; fails if one micro-batch does not fit in it.
    pub fn new(
        file: TokenFile,
        seq: usize,
        batch: usize,
        shuffle: bool,
        seed: u64,
        cursor: Cursor,
    ) -> Result<Self> {
        let rows = file.rows(seq);
        if rows < batch {
            return Err(Error::bad_input(
                "data file",
                file.path.display().to_string(),
                format!(
                    "{} tokens make {rows} rows of {} tokens, fewer than one batch of {batch}",
                    file.len(),
                    seq + 1
                ),
                Some("use more data, or a smaller --seq-len / --batch-size"),
            ));
        }
        let order = epoch_order(rows, shuffle, seed, cursor.epoch);
        Ok(Loader {
            file,
            seq,
            batch,
            shuffle,
            seed,
            order,
            cursor,
        })
    }

    /// The next `batch` rows as flat (inputs, targets).
    pub fn next_batch(&mut self) -> (Vec<u32>, Vec<u32>) {
        let (mut x, mut y) = (
            Vec::with_capacity(self.batch * self.seq),
            Vec::with_capacity(self.batch * self.seq),
        );
        for _ in 0..self.batch {
            if self.cursor.position as usize >= self.order.len() {
                self.cursor = Cursor {
                    epoch: self.cursor.epoch + 1,
                    position: 0,
                };
                self.order =
                    epoch_order(self.order.len(), self.shuffle, self.seed, self.cursor.epoch);
            }
            let (a, b) = self
                .file
                .row(self.order[self.cursor.position as usize], self.seq);
            x.extend(a);
            y.extend(b);
            self.cursor.position += 1;
        }
        (x, y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let f = TokenFile::open(&p, DataDtype::U16, 100).unwrap();
        let mut l = Loader::new(f, 4, 2, false, 0, Cursor::default()).unwrap();
        let (x, y) = l.next_batch();
        assert_eq!(x, vec![0, 1, 2, 3, 5, 6, 7, 8]);
        assert_eq!(y, vec![1, 2, 3, 4, 6, 7, 8, 9]);
        let _ = l.next_batch(); // rows 2, 3
        assert_eq!(
            l.cursor,
            Cursor {
                epoch: 0,
                position: 4
            }
        );
        let (x, _) = l.next_batch(); // wraps to epoch 1
        assert_eq!(&x[..4], &[0, 1, 2, 3]);
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
        let f = TokenFile::open(&p2, DataDtype::U16, 256).unwrap();
        let e = Loader::new(f, 4, 1, false, 0, Cursor::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("fewer than one batch"), "{e}");
    }
}
