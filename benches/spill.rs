//! criterion: the spill tier's extent store writing and reading 64 MiB (4 MiB extents, 32 in
//! flight, O_DIRECT, crc32c per extent) in a directory under `$MEGATRAIN_BENCH_DIR` (default: the
//! system temp dir). The sweep over block sizes and queue depths, next to fio, is
//! `megatrain bench nvme --fio`.
#![allow(clippy::unwrap_used)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use megatrain::host::{Region, RegionSpec};
use megatrain::spill::extents::{ExtentStore, SpillConfig};
use megatrain::spill::io::EngineKind;

const BYTES: usize = 64 << 20;
const EXTENT: usize = 4 << 20;

fn bench(c: &mut Criterion) {
    let base = std::env::var_os("MEGATRAIN_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::tempdir_in(base).unwrap();
    let buf = Region::allocate(RegionSpec::scratch("bench", BYTES)).unwrap();
    // SAFETY: a fresh region of BYTES bytes, used only here.
    let data = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), BYTES) };
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i * 31 + i / 4096) as u8;
    }
    let mut g = c.benchmark_group("spill");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(BYTES as u64));
    for engine in [EngineKind::Auto, EngineKind::Sync] {
        let mut s = ExtentStore::create(&SpillConfig {
            dirs: vec![dir.path().join(format!("{engine:?}"))],
            extent_bytes: EXTENT,
            extents: BYTES / EXTENT,
            engine,
            direct: true,
            queue_depth: 32,
            run_id: None,
        })
        .unwrap();
        // SAFETY: `buf` outlives `s` (dropped at the end of this iteration).
        let _ = unsafe { s.register(&[(buf.as_ptr(), BYTES)]) };
        let name = if s.uses_uring() {
            "uring"
        } else {
            "pread_threads"
        };
        g.bench_function(format!("write_64MiB_{name}"), |b| {
            b.iter(|| s.write(0, data, "bench").unwrap())
        });
        g.bench_function(format!("read_64MiB_{name}"), |b| {
            b.iter(|| s.read(0, data, "bench").unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
