//! The document file: tokenized documents with their loss masks, as `megatrain prepare --format
//! prompt-completion|chat` writes them and `megatrain train --data` reads them (packed into rows
//! by [`super::data`]). Little-endian, versioned, checksummed:
//!
//! ```text
//! offset  size        field
//! 0       8           magic "MTDOCS\r\n"
//! 8       4           version (1)
//! 12      4           token width in bytes (2: u16 ids, 4: u32 ids)
//! 16      8           documents D
//! 24      8           tokens N
//! 32      4           padding token id (fills the ends of packed rows; never trained)
//! 36      4           crc32c of everything after the header
//! 40      8·(D+1)     document starts: 0 = s_0 ≤ s_1 ≤ … ≤ s_D = N (u64)
//! …       width·N     token ids
//! …       N           loss mask, one byte per token: 1 when the token is a trained target
//!                     (the model's prediction of it from the tokens before it counts in the
//!                     loss), else 0; a document's first token is never a target
//! ```
//!
//! Document d is tokens `s_d .. s_{d+1}`; every document has at least two tokens and one trained
//! target (prepare skips, and counts, the others).

use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// The file's first bytes.
pub const MAGIC: &[u8; 8] = b"MTDOCS\r\n";
/// The format version this build reads and writes.
pub const VERSION: u32 = 1;
const HEADER: usize = 40;

/// One tokenized document: its ids and which of them are trained targets.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Document {
    /// Token ids.
    pub tokens: Vec<u32>,
    /// `mask[i]`: token i is a trained target (`mask[0]` is always false).
    pub mask: Vec<bool>,
}

impl Document {
    /// Targets that train.
    pub fn trained(&self) -> usize {
        self.mask.iter().filter(|&&m| m).count()
    }
}

/// Whether a file starts with the document file's magic (the trainer's format sniff).
pub fn is_document_file(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 8];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok_and(|()| &head == MAGIC)
}

/// Serialise `docs` (ids of `width` bytes, 2 or 4) into the file's bytes; an id that does not
/// fit the width is an error.
pub fn encode(docs: &[Document], width: usize, pad_id: u32) -> Result<Vec<u8>> {
    let n: usize = docs.iter().map(|d| d.tokens.len()).sum();
    let mut body = Vec::with_capacity(8 * (docs.len() + 1) + (width + 1) * n);
    let mut start = 0u64;
    body.extend_from_slice(&start.to_le_bytes());
    for d in docs {
        start += d.tokens.len() as u64;
        body.extend_from_slice(&start.to_le_bytes());
    }
    let too_wide = |t: u32| {
        Error::bad_input(
            "token id",
            t.to_string(),
            "does not fit a 2-byte document file",
            Some("use --dtype u32"),
        )
    };
    if width == 2 && u16::try_from(pad_id).is_err() {
        return Err(too_wide(pad_id));
    }
    for &t in docs.iter().flat_map(|d| &d.tokens) {
        match width {
            2 => body.extend_from_slice(&u16::try_from(t).map_err(|_| too_wide(t))?.to_le_bytes()),
            _ => body.extend_from_slice(&t.to_le_bytes()),
        }
    }
    body.extend(docs.iter().flat_map(|d| &d.mask).map(|&m| u8::from(m)));
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(width as u32).to_le_bytes());
    out.extend_from_slice(&(docs.len() as u64).to_le_bytes());
    out.extend_from_slice(&(n as u64).to_le_bytes());
    out.extend_from_slice(&pad_id.to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// A memory-mapped, verified document file.
#[derive(Debug)]
pub struct DocFile {
    path: PathBuf,
    map: memmap2::Mmap,
    width: usize,
    docs: usize,
    tokens: usize,
    pad_id: u32,
}

impl DocFile {
    /// Map `path` and verify it whole: header, sizes, checksum, document starts, ids below
    /// `vocab`, mask bytes (0 or 1, never on a document's first token).
    pub fn open(path: &Path, vocab: usize) -> Result<Self> {
        let f = std::fs::File::open(path)
            .map_err(|e| Error::io("open data", path, e).with_fix("check --data / --val-data"))?;
        // SAFETY: read-only private mapping; a concurrent truncation by another process is the
        // documented hazard of mmap'd input (as for the token file).
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io("mmap data", path, e))?;
        let header = Header::parse(&map, path)?;
        let df = DocFile {
            path: path.to_owned(),
            map,
            width: header.width,
            docs: header.docs,
            tokens: header.tokens,
            pad_id: header.pad_id,
        };
        df.verify(vocab)?;
        Ok(df)
    }

    fn verify(&self, vocab: usize) -> Result<()> {
        let body = &self.map[HEADER..];
        let stored = u32::from_le_bytes([self.map[36], self.map[37], self.map[38], self.map[39]]);
        if crc32c::crc32c(body) != stored {
            return Err(bad(
                &self.path,
                "checksum mismatch (the file is damaged or was cut short and padded)".into(),
            ));
        }
        if self.docs == 0 {
            return Err(bad(&self.path, "holds no documents".into()));
        }
        let mut prev = 0usize;
        for d in 0..=self.docs {
            let s = self.start(d);
            let ok = match d {
                0 => s == 0,
                _ if d == self.docs => s == self.tokens && s >= prev + 2,
                _ => s >= prev + 2 && s <= self.tokens,
            };
            if !ok {
                return Err(bad(
                    &self.path,
                    format!("document {d} starts at token {s}, after {prev}: starts must rise by ≥ 2 from 0 to the token count"),
                ));
            }
            prev = s;
        }
        if (self.pad_id as usize) >= vocab {
            return Err(bad(
                &self.path,
                format!(
                    "padding id {} is ≥ the model's vocab size {vocab}",
                    self.pad_id
                ),
            ));
        }
        if let Some(i) = (0..self.tokens).find(|&i| self.token(i) as usize >= vocab) {
            return Err(bad(
                &self.path,
                format!(
                    "token {} at position {i} is ≥ the model's vocab size {vocab}",
                    self.token(i)
                ),
            )
            .with_fix("prepare the data with the model's tokenizer"));
        }
        if let Some(i) = (0..self.tokens).find(|&i| self.mask_byte(i) > 1) {
            return Err(bad(&self.path, format!("mask byte {i} is neither 0 nor 1")));
        }
        for d in 0..self.docs {
            let (s, e) = (self.start(d), self.start(d + 1));
            if self.mask_byte(s) != 0 {
                return Err(bad(
                    &self.path,
                    format!("document {d}'s first token is marked trained (nothing predicts it)"),
                ));
            }
            if (s..e).all(|i| self.mask_byte(i) == 0) {
                return Err(bad(
                    &self.path,
                    format!("document {d} has no trained token"),
                ));
            }
        }
        Ok(())
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Documents.
    pub fn documents(&self) -> usize {
        self.docs
    }

    /// Tokens of every document.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The padding token id.
    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// Token range of document `d`.
    pub fn range(&self, d: usize) -> std::ops::Range<usize> {
        self.start(d)..self.start(d + 1)
    }

    fn start(&self, d: usize) -> usize {
        let at = HEADER + 8 * d;
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.map[at..at + 8]);
        u64::from_le_bytes(b) as usize
    }

    /// Token `i` (of the whole file).
    pub fn token(&self, i: usize) -> u32 {
        let at = HEADER + 8 * (self.docs + 1) + self.width * i;
        match self.width {
            2 => u32::from(u16::from_le_bytes([self.map[at], self.map[at + 1]])),
            _ => u32::from_le_bytes([
                self.map[at],
                self.map[at + 1],
                self.map[at + 2],
                self.map[at + 3],
            ]),
        }
    }

    fn mask_byte(&self, i: usize) -> u8 {
        self.map[HEADER + 8 * (self.docs + 1) + self.width * self.tokens + i]
    }

    /// Whether token `i` is a trained target.
    pub fn trained(&self, i: usize) -> bool {
        self.mask_byte(i) == 1
    }
}

/// The header's fields, checked against the file's length before anything is read past it.
struct Header {
    width: usize,
    docs: usize,
    tokens: usize,
    pad_id: u32,
}

impl Header {
    /// The header of `bytes` (the file at `path`, named in errors).
    fn parse(bytes: &[u8], path: &Path) -> Result<Self> {
        if bytes.len() < HEADER || &bytes[..8] != MAGIC {
            return Err(bad(
                path,
                "not a megatrain document file (no MTDOCS header)".into(),
            ));
        }
        let u32_at =
            |o: usize| u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]);
        let u64_at = |o: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[o..o + 8]);
            u64::from_le_bytes(b)
        };
        let version = u32_at(8);
        if version != VERSION {
            return Err(bad(
                path,
                format!("format version {version}; this build reads version {VERSION}"),
            ));
        }
        let width = u32_at(12) as usize;
        if width != 2 && width != 4 {
            return Err(bad(
                path,
                format!("token width {width} bytes (2 or 4 expected)"),
            ));
        }
        let (docs, tokens) = (u64_at(16), u64_at(24));
        let want = docs
            .checked_add(1)
            .and_then(|d| d.checked_mul(8))
            .and_then(|o| tokens.checked_mul(width as u64 + 1)?.checked_add(o))
            .and_then(|b| b.checked_add(HEADER as u64));
        if want != Some(bytes.len() as u64) {
            return Err(bad(
                path,
                format!(
                    "{} bytes, but its header describes {docs} documents of {tokens} tokens ({})",
                    bytes.len(),
                    want.map_or("more than 2^64 bytes".into(), |w| format!("{w} bytes"))
                ),
            ));
        }
        Ok(Header {
            width,
            docs: docs as usize,
            tokens: tokens as usize,
            pad_id: u32_at(32),
        })
    }
}

fn bad(path: &Path, why: String) -> Error {
    Error::bad_input(
        "document file",
        path.display().to_string(),
        why,
        Some("re-run `megatrain prepare`"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn docs() -> Vec<Document> {
        vec![
            Document {
                tokens: vec![5, 6, 7],
                mask: vec![false, false, true],
            },
            Document {
                tokens: vec![9, 1],
                mask: vec![false, true],
            },
        ]
    }

    #[test]
    fn round_trip_and_damage_is_named() {
        let d = tempfile::tempdir().unwrap();
        for width in [2, 4] {
            let p = d.path().join(format!("d{width}.bin"));
            std::fs::write(&p, encode(&docs(), width, 3).unwrap()).unwrap();
            assert!(is_document_file(&p));
            let f = DocFile::open(&p, 10).unwrap();
            assert_eq!((f.documents(), f.tokens(), f.pad_id()), (2, 5, 3));
            assert_eq!(f.range(1), 3..5);
            let ids: Vec<u32> = (0..5).map(|i| f.token(i)).collect();
            assert_eq!(ids, vec![5, 6, 7, 9, 1]);
            let mask: Vec<bool> = (0..5).map(|i| f.trained(i)).collect();
            assert_eq!(mask, vec![false, false, true, false, true]);
            let e = DocFile::open(&p, 9).unwrap_err().to_string();
            assert!(e.contains("vocab size 9"), "{e}");
        }
        let p = d.path().join("bad.bin");
        let mut bytes = encode(&docs(), 2, 0).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        let e = DocFile::open(&p, 10).unwrap_err().to_string();
        assert!(e.contains("checksum") && e.contains("bad.bin"), "{e}");
        std::fs::write(&p, &bytes[..bytes.len() - 3]).unwrap();
        let e = DocFile::open(&p, 10).unwrap_err().to_string();
        assert!(e.contains("header describes"), "{e}");
        let mut v2 = encode(&docs(), 2, 0).unwrap();
        v2[8] = 2;
        std::fs::write(&p, &v2).unwrap();
        let e = DocFile::open(&p, 10).unwrap_err().to_string();
        assert!(e.contains("version 2"), "{e}");
    }

    #[test]
    fn documents_without_a_target_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("d.bin");
        let mut ds = docs();
        ds[1].mask = vec![false, false];
        std::fs::write(&p, encode(&ds, 2, 0).unwrap()).unwrap();
        let e = DocFile::open(&p, 10).unwrap_err().to_string();
        assert!(e.contains("document 1 has no trained token"), "{e}");
        ds[1].mask = vec![true, true];
        std::fs::write(&p, encode(&ds, 2, 0).unwrap()).unwrap();
        let e = DocFile::open(&p, 10).unwrap_err().to_string();
        assert!(e.contains("first token"), "{e}");
    }
}
