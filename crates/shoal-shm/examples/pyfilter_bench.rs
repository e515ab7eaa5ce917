//! A Python filter worker's throughput beside the built-in filter, same slices, same run
//! (docs/benchmarks.md, "Python filters"): the numpy `l1` of examples/python/l1_filter.py in
//! one worker process, then in two, against the built-in `l1` in this process.
//!
//! `SHOAL_PYTHON=.venv/bin/python cargo run --release -p shoal-shm --example pyfilter_bench -- [SLICES] [REPEATS]`

use std::path::Path;
use std::time::{Duration, Instant};

use shoal_detector::geometry::Geometry;
use shoal_detector::physics::{PhysicsConfig, PhysicsGenerator};
use shoal_shm::workers::{Outcome, WorkerConfig, WorkerPool, WorkerProgram};
use shoal_trigger::{FilterConfig, SliceData, build, generated_slice};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let args: Vec<u64> = std::env::args().skip(1).map(|a| a.parse().expect("a number")).collect();
    let n = args.first().copied().unwrap_or(40);
    let repeats = args.get(1).copied().unwrap_or(3);
    // One ANTARES sector's builder input: 10 sources (floors), 10-ms slices, physics.
    let g =
        PhysicsGenerator::new(PhysicsConfig::default(), Geometry::antares_for_sources(10), Duration::from_millis(10))
            .unwrap();
    let slices: Vec<SliceData> = (0..n).map(|slice| generated_slice(&g, slice)).collect();
    let bytes: usize = slices.iter().flat_map(|s| &s.fragments).map(|f| f.payload.len()).sum();
    let config = "coincidence_ns=20 min_sources=2 cluster_ns=2200 snapshot_ns=1000";
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/python");
    let (mut builtin, mut one, mut two) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..repeats {
        let mut f = build(&FilterConfig { name: "l1".into(), ..FilterConfig::default() }).unwrap();
        let t = Instant::now();
        let events: usize = slices.iter().map(|s| f.process(s).len()).sum();
        builtin.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e6);
        for (workers, out) in [(1, &mut one), (2, &mut two)] {
            let mut pool = WorkerPool::start(WorkerConfig {
                program: WorkerProgram::Python {
                    exe: std::env::var("SHOAL_PYTHON").unwrap_or_else(|_| "python3".into()),
                    target: "l1_filter:l1".into(),
                    path: root.display().to_string(),
                },
                workers,
                config: config.into(),
                timeout: Duration::from_secs(600),
                start_timeout: Duration::from_secs(120),
                max_restarts: 0,
            })
            .unwrap();
            let t = Instant::now();
            let mut done = Vec::new();
            for s in &slices {
                let frags: Vec<(u32, u16, u32, &[u8])> =
                    s.fragments.iter().map(|f| (f.source, f.flags, f.hit_count, &f.payload[..])).collect();
                done.extend(pool.submit(s.slice, s.slice_start_ns, s.slice_ns, &frags, ()));
            }
            let (rest, _) = pool.finish();
            done.extend(rest);
            out.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e6);
            let got: usize = done.iter().map(|(_, o)| if let Outcome::Events(e) = o { e.len() } else { 0 }).sum();
            assert_eq!(got, events, "the workers select the built-in's events");
        }
    }
    println!("{n} slices of {:.0} kB, {repeats} repeats (medians)", bytes as f64 / n as f64 / 1e3);
    println!("built-in l1 (Rust, in process)   {:>8.1} MB/s", median(builtin));
    println!("numpy l1, 1 worker process       {:>8.1} MB/s", median(one));
    println!("numpy l1, 2 worker processes     {:>8.1} MB/s", median(two));
}
