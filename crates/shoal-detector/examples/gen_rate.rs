//! Generator throughput: one second of ANTARES-size data (300 sources x 100 slices).
fn main() {
    let g = shoal_detector::NoiseGenerator::new(Default::default(), std::time::Duration::from_millis(10)).unwrap();
    let t = std::time::Instant::now();
    let mut hits = 0u64;
    let mut bytes = 0u64;
    for slice in 0..100 {
        for s in 0..300 {
            let f = g.generate(s, slice);
            hits += u64::from(f.hit_count);
            bytes += f.payload.len() as u64;
        }
    }
    let dt = t.elapsed().as_secs_f64();
    println!(
        "{hits} hits, {:.0} MB in {dt:.2} s: {:.1} M hits/s, {:.0} MB/s",
        bytes as f64 / 1e6,
        hits as f64 / dt / 1e6,
        bytes as f64 / dt / 1e6
    );
}
