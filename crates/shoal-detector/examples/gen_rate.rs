//! Generator throughput on one core: one second of ANTARES-size data (300 sources x 100
//! slices of 10 ms), for the singles-only and the physics generator (each version of its
//! algorithm), beside copying as many bytes into fresh fragments.
use shoal_detector::geometry::Geometry;
use shoal_detector::physics::{PhysicsConfig, PhysicsGenerator};
use shoal_detector::{GeneratedFragment, NoiseGenerator};

// The allocator of the `shoal` binary, which runs the generators.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn measure(name: &str, generate: impl Fn(u32, u64) -> GeneratedFragment) {
    let t = std::time::Instant::now();
    let (mut hits, mut bytes) = (0u64, 0u64);
    for slice in 0..100 {
        for s in 0..300 {
            let f = generate(s, 170_000_000_000 + slice);
            hits += u64::from(f.hit_count);
            bytes += f.payload.len() as u64;
        }
    }
    let dt = t.elapsed().as_secs_f64();
    println!(
        "{name}: {hits} hits, {:.0} MB in {dt:.2} s: {:.1} M hits/s, {:.0} MB/s",
        bytes as f64 / 1e6,
        hits as f64 / dt / 1e6,
        bytes as f64 / dt / 1e6
    );
}

/// The physical limit beside them: writing the same number of bytes as fresh fragments
/// copied from one 30-kB buffer, a slice's 300 held at a time (allocation and memory
/// bandwidth, no computing).
fn measure_copy(total: u64) {
    let src = vec![7u8; 30_000];
    let t = std::time::Instant::now();
    let mut bytes = 0u64;
    while bytes < total {
        let slice: Vec<bytes::Bytes> = (0..300).map(|_| bytes::Bytes::copy_from_slice(&src)).collect();
        bytes += std::hint::black_box(slice).iter().map(|f| f.len() as u64).sum::<u64>();
    }
    let dt = t.elapsed().as_secs_f64();
    println!("copy: {:.0} MB in {dt:.2} s: {:.0} MB/s", bytes as f64 / 1e6, bytes as f64 / dt / 1e6);
}

fn main() {
    let slice = std::time::Duration::from_millis(10);
    let noise = NoiseGenerator::new(Default::default(), slice).unwrap();
    measure("noise", |s, sl| noise.generate(s, sl));
    // Every version of the physics generator's algorithm (docs/physics.md), the default last.
    for version in shoal_detector::physics::PHYSICS_VERSIONS {
        let cfg = PhysicsConfig { version, ..Default::default() };
        let physics = PhysicsGenerator::new(cfg, Geometry::antares(10, 30), slice).unwrap();
        measure(&format!("physics version {version}"), |s, sl| physics.generate(s as usize, sl));
    }
    measure_copy(881_000_000);
}
