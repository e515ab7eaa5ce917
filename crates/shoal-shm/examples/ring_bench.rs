//! The shared-memory consumer path against memcpy, same run, same bytes
//! (docs/benchmarks.md, "Slice consumers"):
//!
//! - `memcpy`: 1 MB slices copied into a 64 MB buffer, cycling (what publishing costs at
//!   least: the one copy into the ring), into private memory and into a shared memfd;
//! - `ring`: the same slices published into a 64 MB ring, a consumer on another thread
//!   reading every byte in place (a sum) and releasing (policy `hold`, window 4): the whole
//!   path, end to end, slices delivered per second times their size.
//!
//! `cargo run --release -p shoal-shm --example ring_bench -- [SLICE_KB] [SLICES] [REPEATS]`

// Mapping a memfd for the shared-memory peer is unsafe by nature.
#![allow(unsafe_code)]

use std::time::{Duration, Instant};

use shoal_shm::{ConsumerOptions, Next, Policy, PublisherConfig, SliceConsumer, SlicePublisher};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Copies `slices` times every fragment into `dst`, cycling; returns the seconds taken.
fn copy_cycling(dst: &mut [u8], frags: &[(u32, u16, u32, &[u8])], slices: u64) -> f64 {
    let t = Instant::now();
    let mut at = 0;
    for _ in 0..slices {
        for f in frags {
            if at + f.3.len() > dst.len() {
                at = 0;
            }
            dst[at..at + f.3.len()].copy_from_slice(f.3);
            at += f.3.len();
        }
    }
    std::hint::black_box(&dst);
    t.elapsed().as_secs_f64()
}

fn main() {
    let args: Vec<u64> = std::env::args().skip(1).map(|a| a.parse().expect("a number")).collect();
    let slice_kb = args.first().copied().unwrap_or(1024) as usize;
    let slices = args.get(1).copied().unwrap_or(2000);
    let repeats = args.get(2).copied().unwrap_or(5);
    let ring = 64u64 << 20;
    let slice_bytes = slice_kb << 10;
    // 10 fragments per slice, as from 10 boards.
    let payload: Vec<u8> = (0..slice_bytes / 10).map(|i| (i * 7) as u8).collect();
    let frags: Vec<(u32, u16, u32, &[u8])> = (0..10).map(|s| (s, 0u16, 0u32, payload.as_slice())).collect();
    let total = (slices as f64) * (slice_bytes as f64);
    let (mut memcpy, mut memcpy_shared, mut path) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..repeats {
        let mut dst = vec![0u8; ring as usize];
        memcpy.push(total / copy_cycling(&mut dst, &frags, slices) / 1e6);

        // The same copies into a shared mapping of a memfd (populated first, as the ring is).
        let fd = rustix::fs::memfd_create("bench", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let file = std::fs::File::from(fd);
        file.set_len(ring).unwrap();
        // SAFETY: our own memfd, mapped once, never truncated.
        let mut shared = unsafe { memmap2::MmapOptions::new().populate().map_mut(&file).unwrap() };
        memcpy_shared.push(total / copy_cycling(&mut shared, &frags, slices) / 1e6);

        let name = format!("shoal-bench/{}/{r}", std::process::id());
        let mut p = SlicePublisher::start(&PublisherConfig {
            socket: name.clone(),
            ring_bytes: ring,
            max_consumers: 1,
            max_hold: Duration::from_secs(60),
            any_user: false,
            run: 1,
            builder: 0,
        })
        .unwrap();
        let reader = std::thread::spawn(move || {
            let opts = ConsumerOptions { policy: Policy::Hold { max: Duration::from_secs(60) }, window: 4 };
            let mut c = SliceConsumer::connect_within(&name, opts, Duration::from_secs(10)).unwrap();
            let (mut n, mut sum) = (0u64, 0u64);
            while let Next::Slice(s) = c.next(None).unwrap() {
                for f in s.fragments() {
                    // Read every byte in place, 8 at a time.
                    sum = f
                        .payload
                        .chunks_exact(8)
                        .fold(sum, |a, w| a.wrapping_add(u64::from_le_bytes(w.try_into().unwrap())));
                }
                assert!(s.release());
                n += 1;
            }
            (n, sum)
        });
        while p.consumers() == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let t = Instant::now();
        for i in 0..slices {
            p.publish(i, 0, 1, &frags);
        }
        let report = p.finish();
        let (n, sum) = reader.join().unwrap();
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(sum);
        assert_eq!((n, report.published), (slices, slices));
        path.push(total / secs / 1e6);
    }
    let (m, ms, p) = (median(memcpy), median(memcpy_shared), median(path));
    println!("slice {slice_kb} KiB x {slices}, {repeats} repeats (medians)");
    println!("memcpy into a 64 MB private buffer   {m:>8.0} MB/s");
    println!("memcpy into a 64 MB shared memfd     {ms:>8.0} MB/s  ({:.2} of private)", ms / m);
    println!("ring: publish + read + release       {p:>8.0} MB/s  ({:.2} of private, {:.2} of shared)", p / m, p / ms);
}
