//! The burst saver end to end in one process: an alert 20 s after the fact recovers every
//! raw fragment of its window byte for byte, and late fragments reach the raw file.

mod common;

use std::collections::BTreeMap;

use common::*;
use shoal_core::saver::Alert;
use shoal_net::demo::run_embedded;

/// (stream, slice, source) -> payload, from a raw file.
fn read_raw(path: &std::path::Path) -> BTreeMap<(String, u64, u32), Vec<u8>> {
    let mut rows = BTreeMap::new();
    for r in shoal_store::read_raw(path).unwrap() {
        let key = (r.stream, r.slice, r.source);
        assert!(!rows.contains_key(&key), "{key:?} stored twice");
        rows.insert(key, r.payload);
    }
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alert_20_s_after_the_fact_recovers_its_window_byte_for_byte() {
    let out = temp_dir("burst-saver-alert");
    let (sources, builders) = (4u32, 2u32);
    let mut cfg = small_config(sources, builders, 24.0, &out);
    cfg.run.slice_ms = 100;
    let slice_clock = cfg.slice_clock().unwrap();
    let clock = clock();
    let start = slice_clock.slice_at(clock.now() + shoal_core::Duration::from_millis(300)) + 1;
    cfg.run.start_slice = Some(start);
    // The window: one second, two seconds into the run.
    let (first, last) = (start + 20, start + 29);
    let from = slice_clock.start_of(first);
    let to = slice_clock.end_of(last);
    let live = live();
    let run = tokio::spawn(run_embedded(cfg.clone(), live.clone(), never()));
    // The notice comes 20 s after the window's end.
    let send_at = to + shoal_core::Duration::from_secs(20);
    tokio::time::sleep_until(clock.deadline(send_at)).await;
    let alert = Alert::new("GRB261123A", from, to, "test").unwrap();
    live.alerts.alerts.send(alert).expect("the builders listen");
    let s = run.await.unwrap().unwrap();
    assert!(s.ledger.balanced, "{:?}", s.ledger);

    // Each builder reports the alert, nothing evicted.
    assert_eq!(s.writer.alerts.len(), builders as usize, "{:?}", s.writer.alerts);
    for a in &s.writer.alerts {
        assert_eq!((a.name.as_str(), a.first_slice, a.last_slice), ("GRB261123A", first, last));
        assert!(!a.partly_evicted, "{a:?}");
    }
    let saved: u64 = s.writer.alerts.iter().map(|a| a.fragments_saved).sum();
    assert_eq!(saved, 10 * u64::from(sources));

    // Every fragment of the window, byte for byte what the generator produces.
    let raw = s.writer.raw.as_ref().expect("a raw file");
    let rows = read_raw(&raw.path);
    let generator = cfg.workload().unwrap();
    let mut checked = 0;
    for slice in first..=last {
        for source in 0..sources {
            let stored = rows
                .get(&("alert".to_string(), slice, source))
                .unwrap_or_else(|| panic!("slice {slice} source {source} missing"));
            let expected = generator.generate(source, slice).payload;
            assert_eq!(&stored[..], &expected[..], "slice {slice} source {source}");
            checked += 1;
        }
    }
    assert_eq!(checked, 40);
    assert_eq!(rows.keys().filter(|k| k.0 == "alert").count(), 40, "nothing outside the window");
    for b in &s.builder_reports {
        let spool = b.spool.as_ref().unwrap();
        assert!(spool.removed && spool.write_failed == 0 && spool.refused_full == 0, "{spool:?}");
    }
    std::fs::remove_dir_all(&out).unwrap();
}

/// Barrel shifting with a one-slice limit: the builders time slices out before the delayed
/// sources' fragments come, and those late fragments are kept and written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_fragments_are_salvaged_into_the_raw_file() {
    let out = temp_dir("burst-saver-late");
    let mut cfg = small_config(4, 1, 1.0, &out);
    cfg.run.policy = "delayed:1".into();
    cfg.builder.max_active = 1;
    let generator = cfg.workload().unwrap();
    let s = run_embedded(cfg, live(), never()).await.unwrap();
    assert!(s.ledger.balanced, "{:?}", s.ledger);
    let salvaged = s.ledger.buckets["salvaged"];
    assert!(salvaged > 0, "{:?}", s.ledger);
    let rows = read_raw(&s.writer.raw.as_ref().expect("a raw file").path);
    let late: Vec<_> = rows.iter().filter(|(k, _)| k.0 == "late").collect();
    assert_eq!(late.len() as u64, salvaged);
    for ((_, slice, source), payload) in late {
        assert_eq!(&payload[..], &generator.generate(*source, *slice).payload[..]);
    }
    std::fs::remove_dir_all(&out).unwrap();
}
