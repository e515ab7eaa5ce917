//! `shoal validate --testbed-record`: the simulator against a testbed run recorded earlier
//! (tests/data/validate-6x2-record.json, a 6 x 2 run with a 300 us shore delay), without
//! root. The simulator gets the network the testbed had, and a record of another scenario
//! or a file that is not one is refused with a clear error.

use std::path::PathBuf;
use std::process::Command;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

fn validate(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
        .arg("validate")
        .arg(data("validate-6x2.toml"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn a_recorded_testbed_run_is_compared_with_the_network_it_had() {
    let record = data("validate-6x2-record.json");
    let out = validate(&["--json", "--testbed-record", record.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let bed: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&record).unwrap()).unwrap();
    assert_eq!(v["testbed"]["network_delay_steady_avg_us"], bed["network_delay_steady_avg_us"], "the record's run");
    // The shore delay the testbed had: 300 us asked for, plus its lines' median lateness.
    let lines = bed["delay_lines"].as_array().unwrap();
    assert_eq!(lines.len(), 2);
    let late = lines.iter().map(|l| l["late_p50_us"].as_f64().unwrap()).sum::<f64>() / 2.0;
    assert!(late > 0.0);
    assert_eq!(v["simulated_shore_delay_us"].as_f64().unwrap(), 300.0 + late);
    // The hosts' model: as late as the record's sources woke, Linux's loss recovery.
    assert_eq!(v["tcp_model"], "linux");
    assert_eq!(v["wake_phase_us"], 0.0);
    assert_eq!(v["wake_jitter_us"], bed["source_wake_lag_avg_us"]);
    let rows = v["rows"].as_array().unwrap();
    assert!(rows.iter().any(|r| r["metric"] == "net delay avg (ms)"), "{v}");
    assert!(rows.iter().all(|r| r["simulator"].is_number() && r["testbed"].is_number()), "{v}");
    // Every fragment of 6 sources over 2 s of 10 ms slices crossed the simulated network.
    assert_eq!(v["simulator"]["slices_complete"].as_u64(), Some(200), "{}", v["simulator"]);

    assert_eq!(v["simulator"]["process_wakeups"].as_u64(), Some(0), "no run queue unless asked");

    let out = validate(&["--json", "--testbed-record", record.to_str().unwrap(), "--tcp-model", "newreno"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["tcp_model"], "newreno");

    // The hosts' CPU with the processes' run queue: the processes wake, and wait.
    let cpu = ["--cpu-cores", "2", "--cpu-packet-us", "6.75", "--cpu-wake-us", "30"];
    let out = validate(&[&["--json", "--testbed-record", record.to_str().unwrap()][..], &cpu].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let sim = &v["simulator"];
    assert!(sim["process_wakeups"].as_u64().unwrap() > 1200, "6 sources x 200 slices, and the builders: {sim}");
    assert!(sim["process_wait_s"].as_f64().unwrap() > 0.0, "{sim}");
    // A wake-up cost without the cores to share is a malformed model, refused.
    let out = validate(&["--testbed-record", record.to_str().unwrap(), "--cpu-wake-us", "30"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cpu_wake_us needs"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_record_of_another_scenario_or_no_record_at_all_is_refused() {
    let dir = std::env::temp_dir().join(format!("shoal-validate-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let record = std::fs::read_to_string(data("validate-6x2-record.json")).unwrap();
    let other = dir.join("other.json");
    std::fs::write(&other, record.replace("\"validate-6x2\"", "\"another\"")).unwrap();
    let out = validate(&["--testbed-record", other.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("records scenario \"another\""), "{err}");

    let garbage = dir.join("garbage.json");
    std::fs::write(&garbage, b"\x00\x01 not json").unwrap();
    let out = validate(&["--testbed-record", garbage.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not JSON"), "{}", String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A heavy incast on the testbed (15 x 5, 20-packet switch buffers: thousands of segments
/// dropped at the builders' ports), recorded: Linux repairs a burst of losses in one round
/// trip (SACK, RACK), the model before one hole per round trip. The simulator's TCP for
/// the testbed's hosts (`linux`) comes within the tolerances docs/validation.md reports for
/// this record; the model before (`rack`) does not.
/// `shoal validate --json` of `scenario` (under scenarios/testbed) against the committed
/// record `record` (from the repository's root), with `extra` arguments.
fn validate_record(scenario: &str, record: &str, extra: &[&str]) -> serde_json::Value {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .arg("validate")
        .arg(root.join("scenarios/testbed").join(scenario))
        .args(["--json", "--testbed-record"])
        .arg(root.join(record))
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// 15x5-direct-buf20 against the record in `dir`, TCP `model`.
fn heavy_incast(dir: &str, model: &str) -> serde_json::Value {
    validate_record("15x5-direct-buf20.toml", &format!("{dir}/15x5-direct-buf20-reno.json"), &["--tcp-model", model])
}

fn field(v: &serde_json::Value, side: &str, key: &str) -> f64 {
    v[side][key].as_f64().unwrap_or_else(|| panic!("{side}.{key} in {v}"))
}

#[test]
fn a_heavy_incast_is_recovered_from_as_linux_does() {
    // The run of 2026-11-26 (a busy machine: 53 timeouts). Its builders reported their
    // p99s only, so each side's is its worst builder's.
    let linux = heavy_incast("docs/bench/validation", "linux");
    let before = heavy_incast("docs/bench/validation", "rack");
    let bed_timeouts = field(&linux, "testbed", "tcp_timeouts");
    assert!(
        bed_timeouts > 5.0 && field(&linux, "testbed", "queue_drops") > 1000.0,
        "a heavy incast: {}",
        linux["testbed"]
    );
    let (timeouts, timeouts_before) =
        (field(&linux, "simulator", "tcp_timeouts"), field(&before, "simulator", "tcp_timeouts"));
    // Measured: the model before 5x the testbed's timeouts; Linux's recovery about 2.4x.
    assert!(timeouts <= 3.0 * bed_timeouts, "{timeouts} timeouts against the testbed's {bed_timeouts}");
    assert!(timeouts_before > 3.0 * bed_timeouts, "{timeouts_before} against {bed_timeouts}");
    // Fewer timeouts, no more 400-ms backoffs in phase with the slices: the worst
    // builder's slowest fragments within 2x the testbed's (1.8x), the model before's 4.6x.
    let worst = |v: &serde_json::Value| field(v, "simulator", "network_delay_steady_p99_worst_builder_us");
    let bed_p99 = field(&linux, "testbed", "network_delay_steady_p99_us");
    assert!(worst(&linux) <= 2.0 * bed_p99, "p99 {} against {bed_p99}", worst(&linux));
    assert!(worst(&before) > 2.0 * bed_p99, "p99 before {} against {bed_p99}", worst(&before));
    assert_eq!(linux["verdicts_agree"], true);
}

#[test]
fn a_heavy_incast_on_a_quiet_testbed_agrees_in_timeouts_and_tail() {
    // The run of 2026-11-27 (a quieter machine: 168 timeouts, 11,000 drops). Its builders
    // reported their histograms, so the p99s compared are over every fragment.
    let linux = heavy_incast("docs/bench/validation-2026-11-27", "linux");
    let before = heavy_incast("docs/bench/validation-2026-11-27", "rack");
    let bed_timeouts = field(&linux, "testbed", "tcp_timeouts");
    let timeouts = field(&linux, "simulator", "tcp_timeouts");
    assert!(bed_timeouts > 100.0, "{}", linux["testbed"]);
    assert!(timeouts <= 2.0 * bed_timeouts && bed_timeouts <= 2.0 * timeouts, "{timeouts} against {bed_timeouts}");
    let bed_p99 = field(&linux, "testbed", "network_delay_steady_p99_pooled_us");
    let p99 = |v: &serde_json::Value| field(v, "simulator", "network_delay_steady_p99_us");
    assert!((p99(&linux) - bed_p99).abs() <= 0.25 * bed_p99, "p99 {} against {bed_p99}", p99(&linux));
    assert!(p99(&before) > 1.25 * bed_p99, "p99 before {} against {bed_p99}", p99(&before));
    let row = linux["rows"].as_array().unwrap().iter().find(|r| r["metric"] == "net delay p99 (ms)").unwrap().clone();
    assert_eq!(row["testbed"].as_f64().unwrap(), bed_p99 / 1e3, "the row compares the pooled p99s: {row}");
    assert_eq!(row["simulator"].as_f64().unwrap(), p99(&linux) / 1e3);
}

#[test]
fn the_sources_wake_up_lags_can_be_drawn_as_the_testbed_measured_them() {
    // Records since 2026-11-27 carry the distribution of the sources' wake-up lags.
    let run = |extra: &[&str]| {
        validate_record("15x5-direct.toml", "docs/bench/validation-2026-11-27/15x5-direct-reno.json", extra)
    };
    let exponential = run(&[]);
    let measured = run(&["--wake-lag", "measured"]);
    assert_eq!(exponential["wake_lag"], "exponential", "the default");
    assert_eq!(measured["wake_lag"], "measured");
    assert!(measured["testbed"]["source_wake_lag_us"].as_array().is_some_and(|h| !h.is_empty()));
    // Both have the measured mean; the draws differ, and with them the incast's drops.
    assert_eq!(measured["wake_jitter_us"], exponential["wake_jitter_us"]);
    let drops = |v: &serde_json::Value| v["simulator"]["queue_drops"].as_u64().unwrap();
    assert_ne!(drops(&measured), drops(&exponential));
    let lag = |v: &serde_json::Value| v["simulator"]["shaping_delay_avg_us"].as_f64().unwrap();
    let bed_lag = measured["testbed"]["source_wake_lag_avg_us"].as_f64().unwrap();
    assert!((lag(&measured) - bed_lag).abs() < 0.1 * bed_lag, "{} against {bed_lag}", lag(&measured));
}

#[test]
fn the_cpu_cost_per_packet_can_come_from_the_run_itself() {
    let record = "docs/bench/validation-2026-11-27/15x5-delayed8-reno.json";
    let run = |extra: &[&str]| validate_record("15x5-delayed8.toml", record, extra);
    let plain = run(&[]);
    assert_eq!(plain["cpu_cores"], 0, "off by default");
    let per_run = run(&["--cpu-per-run", "--cpu-cores", "2"]);
    // The testbed machine's busy core-seconds over the packets the model without CPU
    // takes in (the plain run is that model).
    let bed = &per_run["testbed"];
    let busy = (100.0 - bed["cpu_idle_pct"].as_f64().unwrap()) / 100.0 * 2.0 * bed["seconds"].as_f64().unwrap();
    let packets = plain["simulator"]["packet_arrivals"].as_f64().unwrap();
    let expected = busy / packets * 1e6;
    let cost = per_run["cpu_packet_us"].as_f64().unwrap();
    assert!((cost - expected).abs() < 1e-9 * expected, "{cost} us a packet against {expected}");
    assert!(cost > 0.5 && cost < 50.0, "{cost}");
    assert_eq!(per_run["cpu_cores"], 2);
    assert!(per_run["simulator"]["cpu_busy_fraction"].as_f64().unwrap() > 0.0);
    // A fixed cost and one from the run are two answers to one question: refused.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .arg("validate")
        .arg(root.join("scenarios/testbed/15x5-delayed8.toml"))
        .args(["--testbed-record"])
        .arg(root.join(record))
        .args(["--cpu-per-run", "--cpu-packet-us", "5"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot be used with"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
