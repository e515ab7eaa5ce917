//! Python filters in worker processes: the numpy `l1` of examples/python/l1_filter.py
//! selects the built-in `l1`'s very events on the same slices; a filter that raises, one
//! whose process dies, one that hangs and one that returns malformed events each cost only
//! their slice (counted), and the pool goes on with a new worker. Needs a Python with numpy:
//! `SHOAL_PYTHON` (make test sets the test venv's), else `python3`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use shoal_core::event::{Event, EventHit};
use shoal_detector::geometry::Geometry;
use shoal_detector::physics::{PhysicsConfig, PhysicsGenerator};
use shoal_shm::workers::{Outcome, WorkerConfig, WorkerPool, WorkerProgram};
use shoal_trigger::{FilterConfig, L1Config, SliceData, build, generated_slice};

fn python() -> String {
    std::env::var("SHOAL_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn config(target: &str, path: &Path, timeout: Duration) -> WorkerConfig {
    WorkerConfig {
        program: WorkerProgram::Python { exe: python(), target: target.into(), path: path.display().to_string() },
        workers: 2,
        config: String::new(),
        timeout,
        start_timeout: Duration::from_secs(120),
        max_restarts: 10,
    }
}

fn slices(n: u64) -> Vec<SliceData> {
    let cfg = PhysicsConfig { muon_rate_hz: 500.0, burst_fraction: 0.2, ..PhysicsConfig::default() };
    let g =
        PhysicsGenerator::new(cfg, Geometry::antares_for_sources(10), std::time::Duration::from_millis(10)).unwrap();
    (0..n).map(|slice| generated_slice(&g, slice)).collect()
}

fn canonical(events: Vec<Event>) -> Vec<(u32, Vec<EventHit>)> {
    events
        .into_iter()
        .map(|mut e| {
            e.hits.sort_unstable_by_key(|h| (h.time_ns, h.source, h.channel, h.amplitude, h.triggered));
            (e.trigger_mask, e.hits)
        })
        .collect()
}

/// Every slice through the pool; outcomes by slice number.
fn run_pool(cfg: WorkerConfig, slices: &[SliceData]) -> (Vec<(u64, Outcome)>, shoal_shm::workers::WorkerReport) {
    let mut pool = WorkerPool::start(cfg).expect("the workers start");
    let mut done = Vec::new();
    for s in slices {
        let frags: Vec<(u32, u16, u32, &[u8])> =
            s.fragments.iter().map(|f| (f.source, f.flags, f.hit_count, &f.payload[..])).collect();
        done.extend(pool.submit(s.slice, s.slice_start_ns, s.slice_ns, &frags, s.slice));
    }
    let (rest, report) = pool.finish();
    done.extend(rest);
    done.sort_by_key(|(slice, _)| *slice);
    (done, report)
}

#[test]
fn the_numpy_l1_selects_the_built_in_l1_s_events() {
    let l1 = L1Config { coincidence_ns: 20, high_amplitude: 0, min_sources: 2, cluster_ns: 2200, snapshot_ns: 1000 };
    let mut builtin = build(&FilterConfig { name: "l1".into(), l1, ..FilterConfig::default() }).unwrap();
    let slices = slices(12);
    let mut cfg = config("l1_filter:l1", &root().join("examples/python"), Duration::from_secs(600));
    cfg.config = "coincidence_ns=20 min_sources=2 cluster_ns=2200 snapshot_ns=1000".into();
    let (done, report) = run_pool(cfg, &slices);
    assert_eq!(done.len(), slices.len());
    let mut events = 0;
    for ((slice, outcome), s) in done.into_iter().zip(&slices) {
        assert_eq!(slice, s.slice);
        let Outcome::Events(got) = outcome else { panic!("slice {slice}: {outcome:?}") };
        let want = builtin.process(s);
        events += want.len();
        assert_eq!(canonical(got), canonical(want), "slice {slice}");
    }
    assert!(events > 0, "the slices have muons: some events expected");
    assert_eq!((report.failed, report.crashed, report.timed_out, report.malformed_events), (0, 0, 0, 0));
}

const FAULTY: &str = r#"
import os, signal, time
import numpy as np
from shoal.slices import event_hit_dtype

def init(config):
    assert config == "", config

def faulty(s):
    if s.slice == 1:
        raise RuntimeError("this filter does not like slice 1")
    if s.slice == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    if s.slice == 3:
        time.sleep(3600)
    if s.slice == 4:
        good = np.zeros(1, dtype=event_hit_dtype())
        good["source"] = s.fragments[0].source
        alien = good.copy()
        alien["source"] = 999
        return [good, alien, np.zeros(0, dtype=event_hit_dtype())]
    # Otherwise one event: the first hit of the first fragment.
    h = s.hits(s.fragments[0])[:1]
    e = np.zeros(1, dtype=event_hit_dtype())
    e["source"], e["time_ns"], e["channel"], e["amplitude"] = s.fragments[0].source, h["time_ns"], h["channel"], h["amplitude"]
    return [(7, e)]
"#;

#[test]
fn a_filter_that_raises_crashes_hangs_or_returns_garbage_costs_only_its_slice() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pyfilter-faulty");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("faulty_filter.py"), FAULTY).unwrap();
    let slices = slices(8);
    // The hanging slice is killed at the deadline; the others take milliseconds.
    let (done, report) = run_pool(config("faulty_filter:faulty", &dir, Duration::from_secs(5)), &slices);
    let outcome = |slice: u64| &done.iter().find(|(s, _)| *s == slice).unwrap().1;
    assert_eq!(outcome(1), &Outcome::Failed);
    assert_eq!(outcome(2), &Outcome::Crashed);
    assert_eq!(outcome(3), &Outcome::TimedOut);
    let Outcome::Events(e4) = outcome(4) else { panic!("{:?}", outcome(4)) };
    assert_eq!(e4.len(), 1, "the good event kept, the alien source and the empty event refused");
    for slice in [0, 5, 6, 7] {
        let Outcome::Events(e) = outcome(slice) else { panic!("slice {slice}: {:?}", outcome(slice)) };
        assert_eq!((e.len(), e[0].trigger_mask, e[0].hits.len()), (1, 7, 1), "slice {slice}");
    }
    assert_eq!((report.failed, report.crashed, report.timed_out, report.malformed_events), (1, 1, 1, 2));
    assert_eq!(report.restarts, 2, "a new worker for the dead one and for the killed one");
    assert_eq!(report.slices, 8);
}

#[test]
fn a_filter_that_cannot_import_refuses_to_start_with_the_reason() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pyfilter-missing");
    std::fs::create_dir_all(&dir).unwrap();
    let err = match WorkerPool::<u64>::start(config("no_such_module:f", &dir, Duration::from_secs(5))) {
        Ok(_) => panic!("a missing module was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("no_such_module:f") && err.contains("before it was ready"), "{err}");
}
