//! L0 -> L1 and the full muon trigger on one core, in hits per second.
//!
//! Slices: ANTARES 10-string (300 floors x 3 OMs, 70 kHz, 10 ms: about 630 k hits) and an
//! ARCA-sized KM3NeT slice (25 lines x 18 DOMs x 31 PMTs, 7 kHz, 10 ms: about 980 k hits),
//! from the physics generator without bursts; the KM3NeT trigger with the 10-degree
//! direction scan. `scripts/bench-l1.sh` runs this beside the
//! numpy baseline and prints both.

use divan::counter::ItemsCount;
use divan::{Bencher, black_box};
use shoal_detector::geometry::Geometry;
use shoal_detector::physics::{PhysicsConfig, PhysicsGenerator};
use shoal_trigger::muon::{L1Kind, MuonConfig, MuonFilter, l1_hit_indices};
use shoal_trigger::{FragmentData, SliceData};

fn main() {
    divan::main();
}

struct Case {
    slice: SliceData,
    hits: usize,
    cfg: MuonConfig,
    geometry: Geometry,
}

fn case(arca: bool) -> Case {
    let (geometry, physics, mut cfg) = if arca {
        // KM3NeT-sized: the plain 3D test passes almost anything over hundreds of metres,
        // so the direction scan (10 degrees, as ORCA) confirms every cluster.
        let mut m = MuonConfig { window_ns: 5_000, direction_scan: true, ..Default::default() };
        m.l1.kind = L1Kind::Km3net;
        m.l1.window_ns = 25;
        (Geometry::arca_like(25, 18), PhysicsConfig::km3net(), m)
    } else {
        (Geometry::antares(10, 30), PhysicsConfig::default(), MuonConfig::default())
    };
    let physics = PhysicsConfig { burst_fraction: 0.0, waveform_hz: 0.0, ..physics };
    cfg.geometry = "given".into();
    let g = PhysicsGenerator::new(physics, geometry.clone(), core::time::Duration::from_millis(10)).unwrap();
    let slice = 170_000_000_000;
    let fragments: Vec<FragmentData> = (0..geometry.modules.len())
        .map(|m| {
            let f = g.generate(m, slice);
            FragmentData { source: m as u32, flags: 0, hit_count: f.hit_count, payload: f.payload }
        })
        .collect();
    let hits = fragments.iter().map(|f| f.hit_count as usize).sum();
    Case { slice: SliceData { slice, slice_start_ns: 0, slice_ns: 10_000_000, fragments }, hits, cfg, geometry }
}

fn l1(bencher: Bencher, arca: bool) {
    let c = case(arca);
    // Decoding the payloads is part of the cost, as in the builder.
    bencher.counter(ItemsCount::new(c.hits)).bench_local(|| {
        let mut l1 = Vec::new();
        let mut hits = Vec::new();
        let mut n = 0usize;
        for f in &c.slice.fragments {
            hits.clear();
            hits.extend(f.hits().unwrap().hits());
            l1_hit_indices(&hits, &c.cfg.l1, &mut l1);
            n += l1.len();
        }
        black_box(n)
    });
}

fn full(bencher: Bencher, arca: bool) {
    let c = case(arca);
    let mut filter = MuonFilter::new(c.cfg.clone(), c.geometry.clone());
    bencher.counter(ItemsCount::new(c.hits)).bench_local(|| black_box(filter.process_slice(&c.slice)));
}

#[divan::bench(sample_count = 20)]
fn l1_antares_10_string(b: Bencher) {
    l1(b, false);
}

#[divan::bench(sample_count = 20)]
fn trigger_antares_10_string(b: Bencher) {
    full(b, false);
}

#[divan::bench(sample_count = 20)]
fn l1_arca_sized(b: Bencher) {
    l1(b, true);
}

#[divan::bench(sample_count = 20)]
fn trigger_arca_sized(b: Bencher) {
    full(b, true);
}

/// The built-in `l1` filter against the same filter as a C plug-in
/// (examples/c/filter/l1_filter.c, compiled here with the system's `cc -O2`), on the same
/// ANTARES 10-string slice: the plug-in boundary's cost per slice (docs/plugins.md).
fn l1_filter(bencher: Bencher, plugin: bool) {
    let c = case(false);
    let mut cfg = shoal_trigger::FilterConfig { name: "l1".into(), ..Default::default() };
    if plugin {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        cfg.plugin = compile_plugin("l1_filter_bench", &root.join("examples/c/filter/l1_filter.c"));
        cfg.config = "coincidence_ns=20 min_sources=2 cluster_ns=2200 snapshot_ns=1000".into();
    }
    let mut filter = shoal_trigger::build(&cfg).unwrap();
    bencher.counter(ItemsCount::new(c.hits)).bench_local(|| black_box(filter.process(&c.slice)));
}

/// Compiles C with the system's `cc -O2` into a plug-in; its path.
fn compile_plugin(name: &str, source: &std::path::Path) -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("lib{name}.so"));
    let ok = std::process::Command::new("cc")
        .args(["-O2", "-shared", "-fPIC", "-I"])
        .arg(root.join("include"))
        .arg("-o")
        .arg(&out)
        .arg(source)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "cc builds {}", source.display());
    out.display().to_string()
}

/// The boundary alone: a plug-in that returns at once against the built-in `none` (which
/// checks every payload), on the same slice. What the plug-in path costs per slice beyond
/// the filter's own work: the fragment views and the call.
fn boundary(bencher: Bencher, plugin: bool) {
    let c = case(false);
    let mut cfg = shoal_trigger::FilterConfig { name: "none".into(), ..Default::default() };
    if plugin {
        let src = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("empty_filter.c");
        std::fs::write(
            &src,
            "#include <shoal_filter.h>\n\
             uint32_t shoal_filter_abi_version(void) { return SHOAL_FILTER_ABI_VERSION; }\n\
             int32_t shoal_filter_init(const char *c, void **s, char *e, size_t n) { (void)c; (void)e; (void)n; *s = 0; return 0; }\n\
             int32_t shoal_filter_process(void *s, const shoal_slice_view *v, const shoal_filter_host *h) { (void)s; (void)h; return v->fragment_count == 0; }\n\
             void shoal_filter_cleanup(void *s) { (void)s; }\n",
        )
        .unwrap();
        cfg.plugin = compile_plugin("empty_filter", &src);
    }
    let mut filter = shoal_trigger::build(&cfg).unwrap();
    bencher.counter(ItemsCount::new(c.slice.fragments.len())).bench_local(|| black_box(filter.process(&c.slice)));
}

#[divan::bench(sample_count = 20)]
fn boundary_builtin_none_antares_10_string(b: Bencher) {
    boundary(b, false);
}

#[divan::bench(sample_count = 20)]
fn boundary_empty_c_plugin_antares_10_string(b: Bencher) {
    boundary(b, true);
}

#[divan::bench(sample_count = 20)]
fn l1_filter_builtin_antares_10_string(b: Bencher) {
    l1_filter(b, false);
}

#[divan::bench(sample_count = 20)]
fn l1_filter_c_plugin_antares_10_string(b: Bencher) {
    l1_filter(b, true);
}
