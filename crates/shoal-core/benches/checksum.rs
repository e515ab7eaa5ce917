//! The frame check's CRC32C: shoal-core's (crc-fast) beside the `crc32c` crate it replaced,
//! on a builder's fragment sizes (issue 32, goal 2). Divide the size by the median for
//! bytes per second.
//!
//! `cargo bench -p shoal-core --bench checksum` (docs/benchmarks.md).

use divan::{Bencher, black_box};

fn main() {
    divan::main();
}

const SIZES: [usize; 4] = [56, 4_096, 30_000, 1_000_000];

fn data(size: usize) -> Vec<u8> {
    (0..size).map(|i| (i * 7 + 3) as u8).collect()
}

#[divan::bench(args = SIZES)]
fn shoal_core_checksum(bencher: Bencher, size: usize) {
    let d = data(size);
    bencher.counter(divan::counter::BytesCount::new(size)).bench(|| shoal_core::checksum::crc32c(black_box(&d)));
}

#[divan::bench(args = SIZES)]
fn crc32c_crate(bencher: Bencher, size: usize) {
    let d = data(size);
    bencher.counter(divan::counter::BytesCount::new(size)).bench(|| crc32c::crc32c(black_box(&d)));
}
