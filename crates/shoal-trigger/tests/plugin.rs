//! C filter plug-ins (include/shoal_filter.h): the C `l1` of examples/c/filter/ gives the
//! built-in `l1`'s events on the same slices; a plug-in built for another ABI version, one
//! whose init fails, one whose process fails and one that returns malformed events are each
//! refused or counted with a clear reason. Compiles the C with the system's `cc` (which
//! `make test` needs for the C examples anyway).

use std::path::{Path, PathBuf};
use std::process::Command;

use shoal_core::event::{Event, EventHit};
use shoal_detector::geometry::Geometry;
use shoal_detector::physics::{PhysicsConfig, PhysicsGenerator};
use shoal_trigger::{FilterConfig, SliceData, build, generated_slice};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Compiles C source (a file, or text) into a shared library in this test's temp dir.
fn compile(name: &str, source: Result<&Path, &str>) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("plugins");
    std::fs::create_dir_all(&dir).unwrap();
    let src = match source {
        Ok(p) => p.to_path_buf(),
        Err(text) => {
            let p = dir.join(format!("{name}.c"));
            std::fs::write(&p, text).unwrap();
            p
        }
    };
    let out = dir.join(format!("lib{name}.so"));
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-I"])
        .arg(root().join("include"))
        .arg("-o")
        .arg(&out)
        .arg(&src)
        .status()
        .expect("a C compiler (cc) to build the plug-in");
    assert!(status.success(), "compiling {}", src.display());
    out
}

fn refusal(cfg: &FilterConfig) -> String {
    match build(cfg) {
        Ok(_) => panic!("{} was accepted", cfg.plugin),
        Err(e) => e.to_string(),
    }
}

fn plugin_config(path: &Path, config: &str) -> FilterConfig {
    FilterConfig { plugin: path.display().to_string(), config: config.into(), ..FilterConfig::default() }
}

/// Slices of the physics generator on one ANTARES sector, bursts included.
fn slices(n: u64) -> Vec<SliceData> {
    let cfg = PhysicsConfig { muon_rate_hz: 500.0, burst_fraction: 0.2, ..PhysicsConfig::default() };
    let g =
        PhysicsGenerator::new(cfg, Geometry::antares_for_sources(10), std::time::Duration::from_millis(10)).unwrap();
    (0..n).map(|slice| generated_slice(&g, slice)).collect()
}

/// Events with their hits in a canonical order (ties in the sort key may come out either way).
fn canonical(events: Vec<Event>) -> Vec<(u32, u32, Vec<EventHit>)> {
    events
        .into_iter()
        .map(|mut e| {
            e.hits.sort_unstable_by_key(|h| (h.time_ns, h.source, h.channel, h.amplitude, h.triggered));
            (e.trigger_mask, e.overlays, e.hits)
        })
        .collect()
}

#[test]
fn the_c_l1_gives_the_built_in_l1s_events() {
    let lib = compile("l1_filter", Ok(&root().join("examples/c/filter/l1_filter.c")));
    for (l1, text) in [
        ((20, 2, 2_200, 1_000, 0), "coincidence_ns=20 min_sources=2 cluster_ns=2200 snapshot_ns=1000"),
        ((10, 3, 1_000, 500, 30), "coincidence_ns=10 min_sources=3 cluster_ns=1000 snapshot_ns=500 high_amplitude=30"),
    ] {
        let mut builtin_cfg = FilterConfig { name: "l1".into(), ..FilterConfig::default() };
        let c = &mut builtin_cfg.l1;
        (c.coincidence_ns, c.min_sources, c.cluster_ns, c.snapshot_ns, c.high_amplitude) = l1;
        let mut builtin = build(&builtin_cfg).unwrap();
        let mut plugin = build(&plugin_config(&lib, text)).unwrap();
        let (mut events, mut hits) = (0, 0);
        for s in slices(40) {
            let want = canonical(builtin.process(&s));
            let got = canonical(plugin.process(&s));
            assert_eq!(got, want, "slice {} with {text}", s.slice);
            events += want.len();
            hits += want.iter().map(|e| e.2.len()).sum::<usize>();
        }
        assert!(events > 20 && hits > events, "the slices fire the trigger: {events} events, {hits} hits");
        assert_eq!((plugin.failed_slices(), plugin.malformed_events()), (0, 0));
        plugin.cleanup();
    }
}

const STUB: &str = r#"
#include <shoal_filter.h>
#include <stdio.h>
uint32_t shoal_filter_abi_version(void) { return VERSION; }
int32_t shoal_filter_init(const char *config, void **state, char *error, size_t error_len) {
    *state = 0;
    if (config[0] == 'x') { snprintf(error, error_len, "no thanks: %s", config); return 7; }
    return 0;
}
int32_t shoal_filter_process(void *state, const shoal_slice_view *s, const shoal_filter_host *host) {
    (void)state;
    shoal_event_hit good = {(uint32_t)s->fragments[0].source, 5, 1, 2, 1, 0};
    shoal_event_hit stranger = {4242, 5, 1, 2, 1, 0};
    shoal_event_hit late = {(uint32_t)s->fragments[0].source, (uint32_t)s->slice_ns, 1, 2, 1, 0};
    host->emit_event(host->ctx, 1, 0, &good, 1);
    if (host->emit_event(host->ctx, 1, 0, &stranger, 1) != -1) return 3;
    if (host->emit_event(host->ctx, 1, 0, &late, 1) != -1) return 3;
    if (host->emit_event(host->ctx, 1, 0, &good, 0) != -1) return 3;
    return s->slice % 2 ? 9 : 0;
}
void shoal_filter_cleanup(void *state) { (void)state; }
"#;

#[test]
fn wrong_abi_versions_failed_inits_failures_and_malformed_events_are_named() {
    let old = compile("v0", Err(&STUB.replace("VERSION", "0")));
    let e = refusal(&plugin_config(&old, ""));
    assert!(e.contains("ABI version 0") && e.contains("version 1"), "{e}");

    let missing = refusal(&plugin_config(Path::new("/nonexistent/libnothing.so"), ""));
    assert!(missing.contains("/nonexistent/libnothing.so"), "{missing}");

    let stub = compile("stub", Err(&STUB.replace("VERSION", "SHOAL_FILTER_ABI_VERSION")));
    let e = refusal(&plugin_config(&stub, "xyz"));
    assert!(e.contains("init failed (7): no thanks: xyz"), "{e}");

    let mut f = build(&plugin_config(&stub, "ok")).unwrap();
    let mut kept = 0;
    for s in slices(4) {
        let events = f.process(&s);
        kept += events.len();
        assert!(events.iter().all(|e| e.hits.len() == 1 && e.hits[0].triggered));
    }
    assert_eq!(kept, 4, "the good event of every slice, failed or not");
    assert_eq!((f.failed_slices(), f.malformed_events()), (2, 12), "odd slices fail; three malformed per slice");
}
