//! Compiled kernels kept on disk, so a process starts in seconds instead of compiling every
//! kernel file again: one file per (NVRTC release and library file, headers' release,
//! architecture, options, program text), named by the SHA-256 of those, under `MEGATRAIN_KERNEL_CACHE`, else
//! `$XDG_CACHE_HOME/megatrain/kernels`, else `~/.cache/megatrain/kernels`
//! (`MEGATRAIN_KERNEL_CACHE=off` turns it off).
//!
//! An entry is `MAGIC`, then the CUBIN, PTX and log lengths (u64 LE each), the three byte
//! strings, and a CRC-32C of everything before it. An entry that does not check out (cut short,
//! damaged, another format) is compiled again and replaced; a cache folder that cannot be
//! written only costs the compile. Entries are written atomically (a temporary file, renamed),
//! so concurrent processes never read half an entry.

use super::nvrtc::Compiled;
use crate::device::stack::Version;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 16] = b"megatrain-kc-v1\n";

/// The cache folder this process uses (`None`: turned off, or no home to put it in).
pub fn dir() -> Option<PathBuf> {
    match std::env::var_os("MEGATRAIN_KERNEL_CACHE") {
        Some(v) if v == "off" || v == "0" => return None,
        Some(v) if !v.is_empty() => return Some(PathBuf::from(v)),
        _ => {}
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".cache"))
        })?;
    Some(base.join("megatrain/kernels"))
}

/// What an entry's name is made of.
#[derive(Debug, Clone, Copy)]
pub struct Key<'a> {
    /// NVRTC's release.
    pub nvrtc: Version,
    /// NVRTC's library file as it is now (its size and time: `nvrtcVersion` has no patch level,
    /// so an updated 12.9 is told apart by its file).
    pub library: &'a str,
    /// The headers' release (`None`: not stated).
    pub headers: Option<Version>,
    /// `sm_90`.
    pub arch: &'a str,
    /// NVRTC's options.
    pub options: &'a [String],
    /// The program text (headers of the project inlined).
    pub program: &'a str,
}

impl Key<'_> {
    /// The entry's file name: the hex SHA-256 of every part, each length-prefixed.
    pub fn file_name(&self) -> String {
        let mut h = Sha256::new();
        let mut part = |b: &[u8]| {
            h.update((b.len() as u64).to_le_bytes());
            h.update(b);
        };
        part(format!("nvrtc {}", self.nvrtc).as_bytes());
        part(self.library.as_bytes());
        part(
            self.headers
                .map(|v| format!("headers {v}"))
                .unwrap_or_default()
                .as_bytes(),
        );
        part(self.arch.as_bytes());
        for o in self.options {
            part(o.as_bytes());
        }
        part(self.program.as_bytes());
        let digest = h.finalize();
        let mut s = String::with_capacity(64 + 6);
        for b in digest {
            s.push_str(&format!("{b:02x}"));
        }
        s.push_str(".kc");
        s
    }
}

/// The entry's bytes for `c`.
pub fn encode(c: &Compiled) -> Vec<u8> {
    let mut v = Vec::with_capacity(MAGIC.len() + 28 + c.cubin.len() + c.ptx.len() + c.log.len());
    v.extend_from_slice(MAGIC);
    for n in [c.cubin.len(), c.ptx.len(), c.log.len()] {
        v.extend_from_slice(&(n as u64).to_le_bytes());
    }
    v.extend_from_slice(&c.cubin);
    v.extend_from_slice(c.ptx.as_bytes());
    v.extend_from_slice(c.log.as_bytes());
    let crc = crc32c::crc32c(&v);
    v.extend_from_slice(&crc.to_le_bytes());
    v
}

/// The CUBIN, PTX and log of an entry's bytes; `None` when they do not check out.
pub fn decode(b: &[u8]) -> Option<(Vec<u8>, String, String)> {
    let body_len = b.len().checked_sub(4)?;
    let (body, crc) = b.split_at(body_len);
    if crc32c::crc32c(body).to_le_bytes() != crc {
        return None;
    }
    let rest = body.strip_prefix(MAGIC.as_slice())?;
    let mut lens = [0usize; 3];
    for (i, l) in lens.iter_mut().enumerate() {
        let bytes: [u8; 8] = rest.get(8 * i..8 * i + 8)?.try_into().ok()?;
        *l = usize::try_from(u64::from_le_bytes(bytes)).ok()?;
    }
    let data = rest.get(24..)?;
    let total = lens[0].checked_add(lens[1])?.checked_add(lens[2])?;
    if data.len() != total {
        return None;
    }
    let (cubin, data) = data.split_at(lens[0]);
    let (ptx, log) = data.split_at(lens[1]);
    Some((
        cubin.to_vec(),
        String::from_utf8(ptx.to_vec()).ok()?,
        String::from_utf8(log.to_vec()).ok()?,
    ))
}

/// The entry named `name` under `dir`, if it is there and checks out.
pub fn read(dir: &Path, name: &str) -> Option<(Vec<u8>, String, String)> {
    decode(&std::fs::read(dir.join(name)).ok()?)
}

/// Keep `c` as the entry `name` under `dir` (creating the folder).
pub fn write(dir: &Path, name: &str, c: &Compiled) -> crate::Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| crate::Error::io("create", dir, e))?;
    crate::util::write_atomic(&dir.join(name), &encode(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compiled() -> Compiled {
        Compiled {
            file: "x.cu",
            arch: "sm_90".into(),
            ptx: ".version 8.8\n.target sm_90\n.entry k_fwd_f32(".into(),
            cubin: vec![0x7f, b'E', b'L', b'F', 1, 2, 3],
            log: String::new(),
            from_disk: false,
        }
    }

    #[test]
    fn an_entry_round_trips_and_any_damage_is_refused() {
        let c = compiled();
        let b = encode(&c);
        let (cubin, ptx, log) = decode(&b).unwrap();
        assert_eq!(
            (cubin, ptx, log),
            (c.cubin.clone(), c.ptx.clone(), c.log.clone())
        );
        for i in 0..b.len() {
            let mut d = b.clone();
            d[i] ^= 0x10;
            assert!(decode(&d).is_none(), "a flipped byte {i} was accepted");
        }
        for n in 0..b.len() {
            assert!(decode(&b[..n]).is_none(), "a cut at {n} was accepted");
        }
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("k");
        write(&dir, "e.kc", &c).unwrap();
        assert!(read(&dir, "e.kc").is_some());
        assert!(read(&dir, "absent.kc").is_none());
    }

    #[test]
    fn every_part_of_the_key_names_another_entry() {
        let v = |minor| Version {
            major: 13,
            minor,
            patch: 0,
        };
        let opts = vec!["--fmad=true".to_owned()];
        let other_opts = vec!["--fmad=false".to_owned()];
        let base = Key {
            nvrtc: v(0),
            library: "123-456",
            headers: Some(v(0)),
            arch: "sm_90",
            options: &opts,
            program: "a",
        };
        let names = [
            base.file_name(),
            Key {
                nvrtc: v(1),
                ..base
            }
            .file_name(),
            Key {
                library: "123-457",
                ..base
            }
            .file_name(),
            Key {
                headers: None,
                ..base
            }
            .file_name(),
            Key {
                arch: "sm_80",
                ..base
            }
            .file_name(),
            Key {
                options: &other_opts,
                ..base
            }
            .file_name(),
            Key {
                program: "b",
                ..base
            }
            .file_name(),
        ];
        let distinct: std::collections::BTreeSet<_> = names.iter().collect();
        assert_eq!(distinct.len(), names.len(), "{names:?}");
        assert_eq!(base.file_name(), base.file_name());
        assert_eq!(base.file_name().len(), 64 + 3);
    }
}
