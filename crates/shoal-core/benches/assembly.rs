//! The slice assembler's cost per fragment as the sources per slice grow (issue 32, goal
//! 3: a builder of 10,000 connections takes 10,000 fragments into every slice).
//!
//! Each iteration builds 10 slices of `n` sources' fragments, five active at a time as
//! the builder's default window, in source order or with each slice's sources shuffled
//! (a seeded permutation: the order a builder's readers deliver them in is not the
//! sources'), and takes every outcome out. Divide by `10 * n` for a fragment.
//!
//! `cargo bench -p shoal-core --bench assembly` (docs/benchmarks.md "Connection scaling").

use divan::{Bencher, black_box};
use shoal_core::assembly::{AssemblerConfig, SliceAssembler};
use shoal_core::{Instant, SourceId};

fn main() {
    divan::main();
}

const SLICES: u64 = 10;
const SOURCES: [u32; 3] = [10, 1_000, 10_000];

/// The sources of a slice in a seeded pseudo-random order (xorshift; no clock, no RNG crate).
fn shuffled(n: u32, seed: u64) -> Vec<SourceId> {
    let mut order: Vec<SourceId> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    order
}

fn run(orders: &[Vec<SourceId>], n: u32) -> usize {
    let mut a = SliceAssembler::new(AssemblerConfig::new(n));
    let now = Instant::from_nanos(1);
    let mut out = 0;
    for (slice, order) in orders.iter().enumerate() {
        for &source in order {
            a.handle_fragment(now, source, slice as u64, 4096, false, source);
        }
        while let Some(o) = a.poll_outcome() {
            out += o.fragments.len();
        }
    }
    a.handle_drain(now);
    while let Some(o) = a.poll_outcome() {
        out += o.fragments.len();
    }
    out
}

#[divan::bench(args = SOURCES)]
fn in_source_order(bencher: Bencher, n: u32) {
    let orders: Vec<Vec<SourceId>> = (0..SLICES).map(|_| (0..n).collect()).collect();
    bencher.bench(|| black_box(run(black_box(&orders), n)));
}

#[divan::bench(args = SOURCES)]
fn shuffled_sources(bencher: Bencher, n: u32) {
    let orders: Vec<Vec<SourceId>> = (0..SLICES).map(|s| shuffled(n, 0x9e37_79b9 + s)).collect();
    bencher.bench(|| black_box(run(black_box(&orders), n)));
}
