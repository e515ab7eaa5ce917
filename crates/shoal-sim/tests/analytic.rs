//! Simulator results checked against analytic answers and shoal-core's invariants.

use shoal_sim::scenario::Scenario;
use shoal_sim::sim::{RunOptions, SimResult, run, run_with};

fn scenario(toml: &str) -> Scenario {
    Scenario::from_toml(toml).unwrap()
}

fn balanced(r: &SimResult) {
    assert_eq!(r.summary.ledger_unaccounted, 0, "{:?}", r.summary.ledger);
    assert_eq!(r.summary.ledger_produced, r.summary.fragments_produced);
}

#[test]
fn one_tcp_flow_reaches_the_bottleneck_rate() {
    // One board offering 160 Mbit/s (200 kB per 10 ms) into its 50 Mbit/s uplink.
    let r = run(&scenario(
        r#"
        [topology]
        sources = 1
        builders = 1
        [traffic]
        fragment_bytes = 200000
        load_s = 5.0
        relax_s = 0.0
        "#,
    ))
    .unwrap();
    balanced(&r);
    let arrived: Vec<_> = r.records.iter().filter(|x| x.arrived_ns > 0).collect();
    assert!(arrived.len() > 10);
    let first = arrived.iter().map(|x| x.sent_ns).min().unwrap();
    let last = arrived.iter().map(|x| x.arrived_ns).max().unwrap();
    let payload: u64 = arrived.iter().map(|x| u64::from(x.bytes)).sum();
    let goodput = payload as f64 * 8.0 / ((last - first) as f64 * 1e-9);
    // A full-size segment carries 1460 payload bytes in 1538 wire bytes.
    let capacity = 50e6 * 1460.0 / 1538.0;
    assert!((goodput / capacity - 1.0).abs() < 0.05, "goodput {goodput:.0} b/s vs capacity {capacity:.0} b/s");
}

#[test]
fn udp_fragment_loss_matches_the_bit_error_rate() {
    // 30,000-byte fragments as one datagram: 30,008 IP payload bytes in 21 IP fragments
    // (20 x 1480 + 408), each with 20 IP bytes and 38 bytes of Ethernet framing, crossing
    // the shore cable once. A datagram is lost if any of its packets is damaged.
    let ber: f64 = 2e-7;
    let r = run(&scenario(&format!(
        r#"
        [topology]
        sources = 10
        builders = 3
        shore_ber = {ber}
        [traffic]
        transport = "udp"
        load_s = 10.0
        relax_s = 1.0
        "#
    )))
    .unwrap();
    balanced(&r);
    let bits: f64 = (0..21).map(|i| if i < 20 { 1480.0 + 58.0 } else { 408.0 + 58.0 }).map(|b| b * 8.0).sum();
    let p = 1.0 - (1.0 - ber).powf(bits);
    let n = r.summary.udp_fragments_sent as f64;
    let lost = r.summary.udp_fragment_loss_fraction;
    let sd = (p * (1.0 - p) / n).sqrt();
    assert!(n >= 9_000.0);
    assert!((lost - p).abs() < 5.0 * sd, "lost {lost:.5}, analytic {p:.5} (sd {sd:.5})");
    assert_eq!(r.summary.ledger["lost_in_transport"], r.summary.udp_fragments_lost);
}

#[test]
fn same_seed_same_results_other_seed_differs() {
    let text = r#"
        seed = 7
        [topology]
        scale = "2-string"
        shore_ber = 1e-7
        [traffic]
        policy = "delayed:8"
        bursts = true
        load_s = 2.0
        relax_s = 1.0
    "#;
    let a = run(&scenario(text)).unwrap();
    let b = run(&scenario(text)).unwrap();
    let key = |r: &SimResult| r.records.iter().map(|x| (x.sent_ns, x.arrived_ns, x.bytes)).collect::<Vec<_>>();
    assert_eq!(key(&a), key(&b));
    assert_eq!(a.summary.events, b.summary.events);
    assert_eq!(a.summary.tcp_retransmitted, b.summary.tcp_retransmitted);
    let c = run(&scenario(&text.replace("seed = 7", "seed = 8"))).unwrap();
    assert_ne!(key(&a), key(&c));
}

#[test]
fn barrel_shifter_invariants_hold_in_the_simulator() {
    // 60 sources, 20 builders, k = 8: after the ramp-up (60 / 8 -> delays 0..7 slices),
    // every builder receives from at most 8 sources per slot and source i's fragments are
    // handed to the transport (i div 8) slices after their slice ended.
    let r = run(&scenario(
        r#"
        [topology]
        scale = "2-string"
        [traffic]
        policy = "delayed:8"
        load_s = 1.0
        relax_s = 1.0
        "#,
    ))
    .unwrap();
    balanced(&r);
    let slice_ns = 10_000_000u64;
    let mut per_slot: std::collections::HashMap<(u64, u32), u32> = Default::default();
    // Including the last slices: after the load, slots keep passing and the schedule holds.
    for x in r.records.iter().filter(|x| x.sent_ns > 0) {
        let delay_slices = (x.sent_ns - x.ready_ns) / slice_ns;
        assert_eq!(delay_slices, u64::from(x.source / 8), "source {} slice {}", x.source, x.slice);
        *per_slot.entry((x.sent_ns / slice_ns, x.builder)).or_default() += 1;
    }
    assert!(per_slot.values().all(|&n| n <= 8), "max {:?}", per_slot.values().max());
    assert_eq!(r.summary.slices_complete, r.summary.slices);
}

#[test]
fn bursts_cover_the_configured_fraction_and_cutoff_is_counted() {
    let r = run(&scenario(
        r#"
        seed = 3
        [topology]
        scale = "2-string"
        [traffic]
        bursts = true
        cutoff = true
        load_s = 60.0
        relax_s = 1.0
        "#,
    ))
    .unwrap();
    balanced(&r);
    // 60 boards x 6000 slices; bursts 5% of the time on average (burst lengths up to 3 s
    // make this noisy: allow 2 to 8 %).
    let f = r.summary.burst_mean_fraction;
    assert!((0.02..0.08).contains(&f), "burst fraction {f}");
    assert!(r.summary.ledger["cut_off"] > 0);
    // Cut-off markers that reached a processed slice count as cut_off; the others arrived
    // late (their slice timed out while the board was behind) or were still unsent.
    let cut = r.records.iter().filter(|x| x.cut_off).count() as u64;
    let l = &r.summary.ledger;
    assert!(l["cut_off"] <= cut && cut - l["cut_off"] <= l["late"] + l["unsent"]);
}

/// Every shipped scenario parses, validates and runs (shortened to 0.3 s of load here;
/// `shoal sim sweep scenarios/` runs them in full).
#[test]
fn every_shipped_scenario_runs() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scenarios");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let mut sc = Scenario::from_toml(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(sc.traffic.load_s, 60.0, "{}: shipped scenarios run 60 s of load", path.display());
        sc.traffic.load_s = 0.3;
        sc.traffic.relax_s = 0.2;
        let r = run(&sc).unwrap();
        assert_eq!(r.summary.ledger_unaccounted, 0, "{}", path.display());
        n += 1;
    }
    assert_eq!(n, 38);
}

/// Inside the simulator, a token-bucket source never hands more than rate x t + burst
/// bytes to one builder in any window, and everything it produced is eventually sent.
#[test]
fn token_bucket_bound_holds_in_the_simulator() {
    let (rate, burst) = (2_000_000u128, 20_000u128); // 2 MB/s per destination, 20 kB deep
    let sc = scenario(
        r#"
        [topology]
        sources = 5
        builders = 2
        [traffic]
        policy = "tbf:2MB:20k"
        fragment_bytes = 30000
        load_s = 1.0
        relax_s = 2.0
        "#,
    );
    let r = run_with(&sc, RunOptions { log_transmits: true }).unwrap();
    balanced(&r);
    assert_eq!(r.summary.ledger["unsent"], 0);
    let mut per: std::collections::HashMap<(u32, u32), Vec<(u64, u64)>> = Default::default();
    for t in &r.transmits {
        per.entry((t.source, t.dest)).or_default().push((t.at.as_nanos(), t.bytes));
    }
    assert_eq!(per.len(), 10);
    for (pair, events) in per {
        for i in 0..events.len() {
            let mut bytes = 0u128;
            for e in &events[i..] {
                bytes += u128::from(e.1);
                let window = u128::from(e.0 - events[i].0);
                assert!(bytes * 1_000_000_000 <= window * rate + burst * 1_000_000_000, "{pair:?}");
            }
        }
    }
}

/// Bit errors on the shore cable: best-effort UDP loses the fragments they hit; with
/// selective retransmission (the runtime's datagram layer) every one is recovered and
/// counted `recovered`, and the ledger balances in both.
#[test]
fn nack_recovers_what_bit_errors_cost_best_effort_udp() {
    let text = r#"
name = "sector-ber"
seed = 3
[topology]
scale = "sector"
shore_ber = 1e-6
[traffic]
policy = "delayed:2"
transport = "udp"
load_s = 1.0
relax_s = 0.5
"#;
    let best_effort = Scenario::from_toml(text).unwrap();
    let mut nack = best_effort.clone();
    nack.traffic.udp_nack = true;
    let be = run(&best_effort).unwrap().summary;
    let nk = run(&nack).unwrap().summary;
    let lost = |s: &shoal_sim::sim::SimSummary| s.ledger["lost_in_transport"] + s.ledger["damaged"];
    assert_eq!((be.ledger_unaccounted, nk.ledger_unaccounted), (0, 0));
    assert!(lost(&be) > 0, "bit errors at 1e-6 cost best-effort UDP fragments: {:?}", be.ledger);
    assert_eq!(lost(&nk), 0, "{:?}", nk.ledger);
    assert!(nk.ledger["recovered"] > 0, "{:?}", nk.ledger);
    let n = nk.udp_nack.expect("datagram transport counts");
    assert!(nk.damaged_packets > 0 && n.sender.retransmitted > 0 && n.receiver.frames_recovered > 0, "{n:?}");
}

/// The testbed's 15 x 5 direct scenario, one second of load.
fn incast(wake: &str) -> Scenario {
    scenario(&format!(
        r#"
        [topology]
        sources = 15
        builders = 5
        queue_packets = 100
        board_delay_us = 0.0
        shore_delay_us = 0.0
        builder_delay_us = 0.0
        [traffic]
        policy = "direct"
        fragment_bytes = 30000
        load_s = 2.0
        relax_s = 1.0
        {wake}
        "#
    ))
}

#[test]
fn hosts_that_wake_apart_do_not_overflow_what_lockstep_boards_do() {
    let lockstep = run(&incast("")).unwrap();
    let spread = run(&incast("wake_phase_us = 1000.0\nwake_jitter_us = 1800.0")).unwrap();
    balanced(&lockstep);
    balanced(&spread);
    // Lockstep: every fragment of a slice meets the builder's 100-packet port at once
    // (15 x 21 frames) and the port drops; spread over about 2 ms, 15 sources at
    // 50 Mbit/s into 500 Mbit/s fit.
    assert!(lockstep.summary.queue_drops > 100, "lockstep drops {}", lockstep.summary.queue_drops);
    assert!(
        spread.summary.queue_drops * 10 < lockstep.summary.queue_drops,
        "spread {} vs lockstep {}",
        spread.summary.queue_drops,
        lockstep.summary.queue_drops
    );
    // With direct sending the send lag is the wake-up latency alone: phase/2 + jitter on
    // average (0.5 + 1.8 ms), within 10% over 3,000 fragments.
    assert_eq!(lockstep.summary.shaping_delay_avg_us, 0.0);
    let lag = spread.summary.shaping_delay_avg_us;
    assert!((lag / 2300.0 - 1.0).abs() < 0.1, "send lag {lag} us");
    // The same seed gives the same run.
    let again = run(&incast("wake_phase_us = 1000.0\nwake_jitter_us = 1800.0")).unwrap();
    assert_eq!(again.summary.queue_drops, spread.summary.queue_drops);
    assert_eq!(again.summary.shaping_delay_avg_us, spread.summary.shaping_delay_avg_us);
}

#[test]
fn woken_processes_queue_for_the_cores() {
    // One core, each process wake-up costing 1 ms, and no cost per packet: at each slice's
    // end the five sources wake together and run one after the other, so the k-th sends k
    // ms late (2 ms on average). Their 6-kB fragments (five frames at 50 Mbit/s, 1 ms) are
    // read by the builders' processes between the sources' turns, and everything of a
    // slice is done well within its 10 ms, so every slice starts with the core idle.
    let run_queue = |wake_us: f64| {
        let sc = scenario(&format!(
            r#"
            [topology]
            sources = 5
            builders = 5
            board_delay_us = 0.0
            shore_delay_us = 0.0
            builder_delay_us = 0.0
            cpu_cores = 1
            cpu_wake_us = {wake_us}
            [traffic]
            policy = "direct"
            fragment_bytes = 6000
            load_s = 1.0
            relax_s = 0.5
            "#
        ));
        run(&sc).unwrap()
    };
    let queued = run_queue(1000.0);
    balanced(&queued);
    let s = &queued.summary;
    assert_eq!(s.slices_incomplete, 0);
    assert!((s.shaping_delay_avg_us - 2000.0).abs() < 1.0, "send lag {} us", s.shaping_delay_avg_us);
    assert!((s.shaping_delay_max_us - 4000.0).abs() < 1.0, "send lag max {} us", s.shaping_delay_max_us);
    // Every source wakes once a slice, and the slice's builder at least once more; a
    // builder woken while the core is busy reads every frame that came in meanwhile at once.
    let fragments = s.fragments_produced;
    assert!(s.process_wakeups >= fragments + s.slices, "wake-ups {}", s.process_wakeups);
    assert!(s.process_wakeups < 2 * fragments, "wake-ups {}: builders read frames together", s.process_wakeups);
    // The sources waited 0 + 1 + 2 + 3 + 4 ms a slice, and the builders a little too.
    let slices = s.slices as f64;
    assert!(s.process_wait_s >= slices * 10e-3, "waited {} s", s.process_wait_s);
    assert!(s.cpu_busy_fraction.is_some_and(|f| f > 0.5), "busy {:?}", s.cpu_busy_fraction);

    // Without the run queue the same sources send on time.
    let free = run_queue(0.0);
    assert_eq!(free.summary.shaping_delay_avg_us, 0.0);
    assert_eq!(free.summary.process_wakeups, 0);
}

#[test]
fn the_worst_builder_s_p99_is_what_the_testbed_reports() {
    // The testbed's builders each keep a histogram and a run's p99 is the largest of
    // theirs; `shoal validate` compares the simulator's by the same rule.
    let p99 = |mut v: Vec<u64>| {
        v.sort_unstable();
        v[((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len()) - 1] as f64 / 1e3
    };
    let r = run(&incast("wake_jitter_us = 500.0")).unwrap();
    balanced(&r);
    // 10-ms slices: the steady state starts a second in.
    let steady = |b: Option<u32>| -> Vec<u64> {
        r.records
            .iter()
            .filter(|x| x.arrived_ns > 0 && x.slice >= 100 && b.is_none_or(|b| x.builder == b))
            .map(|x| x.arrived_ns - x.sent_ns)
            .collect()
    };
    let per_builder: Vec<f64> = (0..5).map(|b| p99(steady(Some(b)))).collect();
    let worst = per_builder.iter().copied().fold(0.0, f64::max);
    assert_eq!(r.summary.network_delay_steady_p99_worst_builder_us, worst);
    assert_eq!(r.summary.network_delay_steady_p99_us, p99(steady(None)));
    assert!(worst >= r.summary.network_delay_steady_p99_us, "{per_builder:?}");

    let mut one = incast("wake_jitter_us = 500.0");
    one.topology.builders = Some(1);
    let r = run(&one).unwrap();
    assert_eq!(r.summary.network_delay_steady_p99_worst_builder_us, r.summary.network_delay_steady_p99_us);
}
