//! The archive's checksum, computed on every byte the writer stores as it is written
//! (`shoal_store::custody::ChecksumWriter`): adler32 by simd-adler32 (shoal's) beside
//! adler2 (miniz_oxide's, scalar) and a copy of the same bytes, one core. Divide the size
//! by the median for bytes per second.
//!
//! `cargo bench -p shoal-store --bench adler32` (docs/benchmarks.md "The archive's checksum").

use divan::{Bencher, black_box};

fn main() {
    divan::main();
}

/// A Parquet writer's flushes (8 kB buffered writes) and a whole row group's worth.
const SIZES: [usize; 2] = [8_192, 1 << 20];

fn data(size: usize) -> Vec<u8> {
    (0..size).map(|i| (i * 7 + 3) as u8).collect()
}

#[divan::bench(args = SIZES)]
fn simd_adler32(bencher: Bencher, size: usize) {
    let d = data(size);
    bencher.counter(divan::counter::BytesCount::new(size)).bench(|| {
        let mut h = simd_adler32::Adler32::new();
        h.write(black_box(&d));
        h.finish()
    });
}

#[divan::bench(args = SIZES)]
fn adler2_scalar(bencher: Bencher, size: usize) {
    let d = data(size);
    bencher.counter(divan::counter::BytesCount::new(size)).bench(|| {
        let mut h = adler2::Adler32::new();
        h.write_slice(black_box(&d));
        h.checksum()
    });
}

#[divan::bench(args = SIZES)]
fn copy(bencher: Bencher, size: usize) {
    let d = data(size);
    bencher.counter(divan::counter::BytesCount::new(size)).bench(|| black_box(&d).to_vec());
}
