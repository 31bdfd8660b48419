//! Sizes and counts as people write them: `500000`, `64M` or `2G` (powers of 1000), `4Mi` or
//! `64MiB` (powers of 1024). Fractions such as `1.5T` are refused (integers only, so nothing
//! is rounded).

use crate::{Error, Result};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Parse `s` as a count with an optional suffix: K/M/G/T (powers of 1000, an optional `B`) or
/// Ki/Mi/Gi/Ti (powers of 1024, an optional `B`).
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let bad = || {
        Error::bad_input(
            "size",
            s,
            "is not a count (e.g. 500000, 64M, 4Mi, 64MiB, 2G)",
            None,
        )
    };
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits);
    let mult: u64 = match suffix.trim().trim_end_matches(['B', 'b']) {
        "" => 1,
        "k" | "K" => 1_000,
        "m" | "M" => 1_000_000,
        "g" | "G" => 1_000_000_000,
        "t" | "T" => 1_000_000_000_000,
        "Ki" | "KI" => 1 << 10,
        "Mi" | "MI" => 1 << 20,
        "Gi" | "GI" => 1 << 30,
        "Ti" | "TI" => 1 << 40,
        _ => return Err(bad()),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(bad)
}

/// [`parse_size`] as a `usize` (counts of elements, bytes of a buffer).
pub fn parse_count(s: &str) -> Result<usize> {
    usize::try_from(parse_size(s)?)
        .map_err(|_| Error::bad_input("size", s, "does not fit this machine's address space", None))
}

/// A byte size given as a number or a string with a unit (flags and TOML alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl std::str::FromStr for ByteSize {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        parse_size(s).map(ByteSize)
    }
}

impl From<ByteSize> for u64 {
    fn from(b: ByteSize) -> u64 {
        b.0
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Spelling {
            Number(u64),
            Text(String),
        }
        match Spelling::deserialize(d)? {
            Spelling::Number(n) => Ok(ByteSize(n)),
            Spelling::Text(t) => parse_size(&t)
                .map(ByteSize)
                .map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_in_every_spelling() {
        for (s, v) in [
            ("3", 3),
            ("64M", 64_000_000),
            ("64MB", 64_000_000),
            ("128Ki", 128 << 10),
            ("4Mi", 4 << 20),
            ("64MiB", 64 << 20),
            ("2G", 2_000_000_000),
            ("1Ti", 1 << 40),
        ] {
            assert_eq!(parse_size(s).unwrap(), v, "{s}");
        }
        for bad in [
            "x",
            "",
            "1.5G",
            "64Q",
            "99999999999999999999",
            "18446744073709551615Ki",
        ] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        let t: ByteSize =
            toml::from_str::<std::collections::HashMap<String, ByteSize>>("a = \"64MiB\"").unwrap()
                ["a"];
        assert_eq!(t, ByteSize(64 << 20));
    }
}
