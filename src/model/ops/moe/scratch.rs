//! The CPU op's buffers, kept between calls per thread: a MoE layer's internals are tens of
//! megabytes per call, and allocating them afresh each time faults every page in again (a fifth
//! of a small layer's time, measured with `perf` on `benches/moe.rs`). At most [`KEEP`] buffers
//! are kept per thread — one call's worth; the workspace's `moe_scratch_bytes` already charges
//! them.

use std::cell::RefCell;

/// Buffers kept per thread.
const KEEP: usize = 8;

thread_local! {
    static FREE: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// A buffer of `len` elements, reused where one is free: its contents are whatever the last
/// user left (or 0), so every caller writes each element before reading it.
pub(super) fn take(len: usize) -> Vec<f32> {
    let mut v = FREE.with(|f| {
        let mut f = f.borrow_mut();
        let best = f
            .iter()
            .enumerate()
            .filter(|(_, v)| v.capacity() >= len)
            .min_by_key(|(_, v)| v.capacity())
            .map(|(i, _)| i);
        best.map(|i| f.swap_remove(i)).unwrap_or_default()
    });
    if v.len() >= len {
        v.truncate(len);
    } else {
        v.resize(len, 0.0);
    }
    v
}

/// Give `v` back for the next [`take`] on this thread.
pub(super) fn give(v: Vec<f32>) {
    if v.capacity() == 0 {
        return;
    }
    FREE.with(|f| {
        let mut f = f.borrow_mut();
        if f.len() < KEEP {
            f.push(v);
        } else if let Some(smallest) = f.iter_mut().min_by_key(|b| b.capacity()) {
            if smallest.capacity() < v.capacity() {
                *smallest = v;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_given_buffer_is_taken_again_at_any_smaller_length() {
        let mut v = take(1000);
        v.fill(7.0);
        let p = v.as_ptr();
        give(v);
        let w = take(600);
        assert_eq!((w.len(), w.as_ptr()), (600, p));
        give(w);
        let big = take(5000);
        assert_eq!(big.len(), 5000);
        assert!(big[1000..].iter().all(|&x| x == 0.0));
    }
}
