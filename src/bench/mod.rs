//! The CLI's `bench` commands: measured throughput next to the physical limit measured in the
//! same run.

pub mod adam;
pub mod engine;
pub mod link;
pub mod nvme;

/// Parse a count with an optional K/M/G suffix (powers of 1000): "64M" → 64 000 000.
pub fn parse_count(s: &str) -> Result<usize, String> {
    let t = s.trim();
    for (suffix, mult) in [("Ki", 1usize << 10), ("Mi", 1 << 20), ("Gi", 1 << 30)] {
        if let Some(num) = t.strip_suffix(suffix) {
            return num
                .parse::<usize>()
                .ok()
                .and_then(|n| n.checked_mul(mult))
                .ok_or_else(|| format!("`{s}` is not a count (e.g. 4Mi, 64M, 500000)"));
        }
    }
    let (num, mult) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1_000),
        Some('m' | 'M') => (&t[..t.len() - 1], 1_000_000),
        Some('g' | 'G') => (&t[..t.len() - 1], 1_000_000_000),
        _ => (t, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("`{s}` is not a count (e.g. 64M, 1G, 500000)"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn counts() {
        assert_eq!(super::parse_count("64M"), Ok(64_000_000));
        assert_eq!(super::parse_count("3"), Ok(3));
        assert_eq!(super::parse_count("128Ki"), Ok(128 << 10));
        assert_eq!(super::parse_count("4Mi"), Ok(4 << 20));
        assert!(super::parse_count("x").is_err());
    }
}
