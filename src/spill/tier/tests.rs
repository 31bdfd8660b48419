use super::*;
use crate::spill::io::EngineKind;

const M: usize = 0;
const V: usize = 1;

/// Units shaped like a small model's (embedding, `layers` blocks of different size, head),
/// each with its Adam m and v.
fn layout(layers: usize) -> Vec<TierUnit> {
    let numel = |u: usize| -> usize {
        match u {
            0 => 19_200,
            u if u == layers + 1 => 64,
            _ => 41_088,
        }
    };
    (0..layers + 2)
        .map(|u| {
            let bytes = (numel(u) * 4).div_ceil(4096) * 4096;
            TierUnit {
                unit: u,
                label: match u {
                    0 => "embedding".into(),
                    u if u == layers + 1 => "head".into(),
                    u => format!("layer {}", u - 1),
                },
                shards: vec![("adam_m", bytes), ("adam_v", bytes)],
            }
        })
        .collect()
}

fn tier(
    l: &[TierUnit],
    dir: &std::path::Path,
    slots: usize,
    engine: EngineKind,
    direct: bool,
) -> SpillTier {
    SpillTier::create(
        l,
        l.len(),
        &TierConfig {
            io: SpillConfig {
                dirs: vec![dir.join("a"), dir.join("b")],
                extent_bytes: 16 << 10,
                extents: 0,
                engine,
                direct,
                queue_depth: 8,
                run_id: Some("00000000000000bb".into()),
            },
            slots,
            node: None,
            cpus: Vec::new(),
            pages: PageKind::Transparent,
        },
    )
    .unwrap()
}

fn pattern(unit: usize, kind: usize, step: usize, i: usize) -> f32 {
    (unit * 1_000_003 + kind * 7_919 + step * 104_729 + i) as f32 * 1e-3
}

/// Random-ish shards through the tier with 2 slots for 6 units (every lease after the
/// first two evicts), on io_uring+O_DIRECT and on the pread/pwrite threads without O_DIRECT.
#[test]
fn shards_round_trip_through_the_tier_on_both_engines() {
    let l = layout(4);
    for (engine, direct) in [(EngineKind::Auto, true), (EngineKind::Sync, false)] {
        let d = tempfile::tempdir().unwrap();
        let t = tier(&l, d.path(), 2, engine, direct);
        assert_eq!(
            t.uses_uring(),
            engine == EngineKind::Auto && t.warnings.is_empty()
        );
        for u in 0..l.len() {
            let mut lease = t.lease(u).unwrap();
            // A never-written unit stages as zeros, like a fresh RAM shard.
            assert!(lease.shard(M).unwrap().iter().all(|x| *x == 0.0));
            for (k, kind) in [M, V].into_iter().enumerate() {
                for (i, x) in lease.shard(kind).unwrap().iter_mut().enumerate() {
                    *x = pattern(u, k, 0, i);
                }
            }
        }
        t.flush().unwrap();
        for u in (0..l.len()).rev() {
            let mut lease = t.lease(u).unwrap();
            for (k, kind) in [M, V].into_iter().enumerate() {
                let s = lease.shard(kind).unwrap();
                assert_eq!(4 * s.len(), l[u].shards[kind].1);
                assert!(s.iter().enumerate().all(|(i, x)| *x == pattern(u, k, 0, i)));
            }
            lease.release_clean();
        }
        let st = t.stats();
        let all: u64 = (0..l.len()).map(|u| 2 * l[u].shards[0].1 as u64).sum();
        assert_eq!(st.bytes_written, all);
        assert!(
            st.bytes_read >= all - 2 * t.shared.slot_bytes as u64,
            "{st:?}"
        );
    }
}

/// Five training-shaped steps over 10 units: prefetch u+1, lease u, update, release (write
/// back) — the values after every step are exact, and prefetch turns reads into hits.
#[test]
fn prefetch_update_write_back_sequence() {
    let l = layout(8);
    let d = tempfile::tempdir().unwrap();
    let t = tier(&l, d.path(), 3, EngineKind::Auto, true);
    let n = l.len();
    for step in 0..5 {
        t.prefetch(0);
        for u in 0..n {
            if u + 1 < n {
                t.prefetch(u + 1);
            }
            let mut lease = t.lease(u).unwrap();
            let m = lease.shard(M).unwrap();
            for (i, x) in m.iter_mut().enumerate() {
                assert_eq!(
                    *x,
                    if step == 0 {
                        0.0
                    } else {
                        pattern(u, 0, step - 1, i)
                    }
                );
                *x = pattern(u, 0, step, i);
            }
        }
    }
    t.flush().unwrap();
    let st = t.stats();
    assert!(
        st.hits >= st.misses,
        "prefetch should serve most leases: {st:?}"
    );
    assert!(st.bytes_read > 0 && st.bytes_written > 0);
}

#[test]
fn a_flipped_byte_on_disk_is_reported_with_file_offset_and_layer() {
    let l = layout(2);
    let d = tempfile::tempdir().unwrap();
    let t = tier(&l, d.path(), 1, EngineKind::Auto, true);
    for u in 0..l.len() {
        let mut lease = t.lease(u).unwrap();
        lease.shard(V).unwrap().fill(u as f32 + 0.5);
    }
    t.flush().unwrap();
    // Flip one byte in every 16 KiB extent copy of both files.
    for f in ["a", "b"] {
        let p = d.path().join(f).join(format!(
            "megatrain-spill-00000000000000bb-{}.bin",
            if f == "a" { 0 } else { 1 }
        ));
        let mut b = std::fs::read(&p).unwrap();
        for k in (100..b.len()).step_by(16 << 10) {
            b[k] ^= 0x40;
        }
        std::fs::write(&p, b).unwrap();
    }
    // Unit 1 (layer 0) was evicted by unit 2: leasing it reads the damaged copy.
    let e = t.lease(1).unwrap_err().to_string();
    assert!(
        e.contains("crc32c")
            && e.contains("layer 0")
            && e.contains("offset")
            && e.contains("megatrain-spill-"),
        "{e}"
    );
}

#[test]
fn a_failed_write_back_is_reported_and_the_unit_refused() {
    let l = layout(2);
    let d = tempfile::tempdir().unwrap();
    let t = tier(&l, d.path(), 2, EngineKind::Auto, true);
    t.lease(1).unwrap().shard(M).unwrap().fill(1.0);
    t.flush().unwrap();
    t.inject_write_error(libc::ENOSPC);
    t.lease(1).unwrap().shard(M).unwrap().fill(2.0);
    let e = t.flush().unwrap_err().to_string();
    assert!(e.contains("No space left") && e.contains("layer 0"), "{e}");
    assert!(t.check().is_err());
    assert!(
        t.lease(1).is_err(),
        "a unit whose write-back failed is not handed out"
    );
    // Other units keep working.
    t.lease(2).unwrap().shard(M).unwrap().fill(3.0);
}
