//! The cluster controller against in-memory processes that each run the real per-process
//! state machine ([`RunControl`]), with virtual time: command order, start and end slices,
//! reply deadlines, inactive marking, refusals, discovery of processes already running.

use std::collections::BTreeMap;

use proptest::prelude::*;
use shoal_core::cluster::{
    ClusterCommand, ClusterControl, ClusterControlConfig, ClusterEvent, ClusterProcess, CommandRejected,
    InactiveReason, Outgoing,
};
use shoal_core::runstate::{Command, Reply, Role, RunControl, RunState};
use shoal_core::slice::SliceClock;
use shoal_core::{Duration, Instant};

/// How an in-memory process behaves.
#[derive(Clone, Debug, PartialEq)]
enum Behaviour {
    /// Answers every command after `delay`.
    Answers { delay: Duration },
    /// Never answers anything (hung, or not started).
    Silent,
    /// Answers, but ignores this command (hangs in it).
    HangsIn(&'static str),
    /// Refuses this command with an error.
    Refuses(&'static str),
    /// Misses this command once (it was reconnecting to the dispatcher), then announces
    /// its state again as a reconnected process does, and answers from then on.
    MissesOnce(&'static str),
    /// This command is lost on its way once, without a trace (published before the
    /// process's subscription reached a restarted dispatcher), then answers from then on.
    LosesOnce(&'static str),
}

struct Process {
    role: Role,
    rc: RunControl,
    behaviour: Behaviour,
    /// Every command it received, with the time.
    received: Vec<(Instant, Command)>,
}

struct Harness {
    ctl: ClusterControl,
    procs: BTreeMap<String, Process>,
    now: Instant,
    /// Replies on their way, with the time they arrive.
    in_flight: Vec<(Instant, Reply)>,
    events: Vec<(Instant, ClusterEvent)>,
    /// Every delivery in order (process, command name), for order at equal times.
    deliveries: Vec<(String, &'static str)>,
    next_run: u64,
    runs_taken: u64,
}

const T0: Instant = Instant::from_nanos(1_700_000_000_000_000_000);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

impl Harness {
    fn new(procs: &[(&str, Role, Behaviour)], tune: impl FnOnce(&mut ClusterControlConfig)) -> Self {
        let list = procs.iter().map(|(n, r, _)| ClusterProcess { name: n.to_string(), role: *r }).collect();
        let mut cfg = ClusterControlConfig::new(list, "[run]\nsources = 1\n".into(), SliceClock::new(ms(100)));
        cfg.reply_timeout = ms(1000);
        cfg.announce_timeout = ms(3000);
        cfg.source_drain = ms(2000);
        cfg.builder_drain = ms(1500);
        cfg.writer_drain = ms(1000);
        tune(&mut cfg);
        let procs = procs
            .iter()
            .map(|(n, r, b)| {
                (n.to_string(), Process { role: *r, rc: RunControl::new(T0), behaviour: b.clone(), received: vec![] })
            })
            .collect();
        let mut h = Self {
            ctl: ClusterControl::new(cfg, T0),
            procs,
            now: T0,
            in_flight: vec![],
            events: vec![],
            deliveries: vec![],
            next_run: 1,
            runs_taken: 0,
        };
        h.settle();
        h
    }

    fn deliver(&mut self, out: Outgoing) {
        let now = self.now;
        let targets: Vec<String> =
            if out.target == "*" { self.procs.keys().cloned().collect() } else { vec![out.target.clone()] };
        for name in targets {
            let Some(p) = self.procs.get_mut(&name) else { continue };
            p.received.push((now, out.command.clone()));
            self.deliveries.push((name.clone(), out.command.name()));
            let delay = match &p.behaviour {
                Behaviour::MissesOnce(c) if *c == out.command.name() => {
                    p.behaviour = Behaviour::Answers { delay: ms(3) };
                    self.in_flight.push((now + ms(5), Reply { name, state: p.rc.state(), error: None }));
                    continue;
                }
                Behaviour::LosesOnce(c) if *c == out.command.name() => {
                    p.received.pop();
                    self.deliveries.pop();
                    p.behaviour = Behaviour::Answers { delay: ms(3) };
                    continue;
                }
                Behaviour::Silent => continue,
                Behaviour::HangsIn(c) if *c == out.command.name() => continue,
                Behaviour::Answers { delay } => *delay,
                _ => ms(1),
            };
            let error = match (&p.behaviour, &out.command) {
                (Behaviour::Refuses(c), cmd) if *c == cmd.name() => Some("not today".to_string()),
                // Sent again after its answer was lost: answered again, not carried out.
                (_, cmd) if p.rc.is_repeat(cmd) => None,
                (_, cmd) => p.rc.handle_command(now, cmd.clone()).err().map(|e| e.to_string()),
            };
            self.in_flight.push((now + delay, Reply { name, state: p.rc.state(), error }));
        }
    }

    fn drain(&mut self) {
        while let Some(out) = self.ctl.poll_transmit() {
            self.deliver(out);
        }
        while let Some(e) = self.ctl.poll_event() {
            self.events.push((self.now, e));
        }
    }

    /// Runs virtual time until nothing is pending (bounded).
    fn settle(&mut self) {
        for _ in 0..100_000 {
            self.drain();
            let next_reply = self.in_flight.iter().map(|(t, _)| *t).min();
            let next = match (next_reply, self.ctl.poll_timeout()) {
                (Some(a), Some(b)) => a.min(b),
                (a, b) => match a.or(b) {
                    Some(t) => t,
                    None => return,
                },
            };
            self.now = self.now.max(next);
            let (due, later): (Vec<_>, Vec<_>) = self.in_flight.drain(..).partition(|(t, _)| *t <= self.now);
            self.in_flight = later;
            for (_, r) in due {
                self.ctl.handle_reply(self.now, &r);
            }
            if self.ctl.poll_timeout().is_some_and(|t| t <= self.now) {
                self.ctl.handle_timeout(self.now);
            }
        }
        panic!("the controller never settled");
    }

    fn command(&mut self, c: ClusterCommand) -> Result<(), CommandRejected> {
        let run = self.next_run;
        let mut taken = false;
        let r = self.ctl.handle_command(self.now, c, || {
            taken = true;
            Ok(run)
        });
        if taken {
            self.next_run += 1;
            self.runs_taken += 1;
        }
        self.settle();
        r
    }

    fn after(&mut self, d: Duration) {
        self.now += d;
        self.settle();
    }

    fn done(&self, c: ClusterCommand) -> Vec<&shoal_core::cluster::CommandOutcome> {
        self.events
            .iter()
            .filter_map(|(_, e)| match e {
                ClusterEvent::CommandDone(o) if o.command == c => Some(o),
                _ => None,
            })
            .collect()
    }

    /// When the last `c` ended.
    fn done_at(&self, c: ClusterCommand) -> Instant {
        self.events
            .iter()
            .rev()
            .find_map(|(t, e)| matches!(e, ClusterEvent::CommandDone(o) if o.command == c).then_some(*t))
            .expect("the command ended")
    }

    fn first_received(&self, name: &str, command: &str) -> Option<Instant> {
        self.procs[name].received.iter().find(|(_, c)| c.name() == command).map(|(t, _)| *t)
    }

    /// Position of the first delivery of `command` to `name` among all deliveries.
    fn delivery_index(&self, name: &str, command: &str) -> Option<usize> {
        self.deliveries.iter().position(|(n, c)| n == name && *c == command)
    }

    fn state(&self, name: &str) -> RunState {
        self.procs[name].rc.state()
    }
}

fn sector(behaviours: &[(&str, Behaviour)]) -> Vec<(&'static str, Role, Behaviour)> {
    let names: [(&'static str, Role); 6] = [
        ("w", Role::Writer),
        ("b0", Role::Builder),
        ("b1", Role::Builder),
        ("s0", Role::Source),
        ("s1", Role::Source),
        ("s2", Role::Source),
    ];
    names
        .into_iter()
        .map(|(n, r)| {
            let b = behaviours
                .iter()
                .find(|(m, _)| *m == n)
                .map_or(Behaviour::Answers { delay: ms(3) }, |(_, b)| b.clone());
            (n, r, b)
        })
        .collect()
}

#[test]
fn processes_running_before_run_control_are_discovered() {
    let h = Harness::new(&sector(&[]), |_| {});
    assert!(!h.ctl.is_discovering());
    assert!(h.ctl.processes().iter().all(|p| p.active && p.state == Some(RunState::Idle)));
    assert!(h.events.iter().any(|(_, e)| *e == ClusterEvent::DiscoveryDone { missing: vec![] }));
    // One question answered by all: discovery ended with the answers, not a timeout.
    assert_eq!(h.now, T0 + ms(3));
}

#[test]
fn a_process_that_never_answers_is_asked_again_then_marked_inactive_at_the_deadline() {
    let h = Harness::new(&sector(&[("b1", Behaviour::Silent)]), |_| {});
    let asked = h.procs["b1"].received.iter().filter(|(_, c)| *c == Command::Status).count();
    assert_eq!(asked, 6, "STATUS every 0.5 s within the 3 s announce time: at 0, 0.5, .., 2.5 s");
    let b1 = h.ctl.processes().iter().find(|p| p.name == "b1").unwrap();
    assert!(!b1.active);
    assert_eq!(b1.inactive_reason, Some(InactiveReason::NeverAnnounced { within: ms(3000) }));
    let (at, _) = h.events.iter().find(|(_, e)| matches!(e, ClusterEvent::DiscoveryDone { .. })).unwrap();
    assert_eq!(*at, T0 + ms(3000));
}

#[test]
fn a_late_announcer_is_found_by_a_later_status_question() {
    // It answers only after 1.2 s (starting up): the questions at 0, 0.5, 1.0 s are
    // answered at 1.2, 1.7, 2.2 s.
    let h = Harness::new(&sector(&[("s2", Behaviour::Answers { delay: ms(1200) })]), |_| {});
    assert!(h.ctl.processes().iter().all(|p| p.active));
    assert!(h.events.iter().any(|(_, e)| *e == ClusterEvent::DiscoveryDone { missing: vec![] }));
}

#[test]
fn a_run_goes_downstream_first_on_start_and_upstream_first_on_stop() {
    let mut h = Harness::new(&sector(&[]), |_| {});
    for c in [ClusterCommand::Init, ClusterCommand::Configure, ClusterCommand::Start] {
        h.command(c).unwrap();
        assert!(h.done(c)[0].is_ok(), "{c}");
    }
    assert!(h.procs.values().all(|p| p.rc.state() == RunState::Running));
    let start = |n: &str| h.first_received(n, "START").unwrap();
    assert!(start("w") < start("b0") && start("b0") == start("b1"));
    assert!(start("b1") < start("s0") && start("s0") == start("s2"));
    // One first slice for every process, ahead of the time START was given.
    let run = h.ctl.run().unwrap();
    assert_eq!(run.run, 1);
    for p in h.procs.values() {
        let slice = p.received.iter().find_map(|(_, c)| match c {
            Command::Start { start_slice, .. } => *start_slice,
            _ => None,
        });
        assert_eq!(slice, Some(run.start_slice));
    }
    h.after(Duration::from_secs(4));
    h.command(ClusterCommand::Stop).unwrap();
    let stop = |n: &str| h.first_received(n, "STOP").unwrap();
    assert!(stop("s0") < stop("b0") && stop("b1") < stop("w"));
    let end_slices: Vec<Option<u64>> = ["s0", "b0", "w"]
        .iter()
        .map(|n| {
            h.procs[*n].received.iter().find_map(|(_, c)| match c {
                Command::Stop { end_slice } => Some(*end_slice),
                _ => None,
            })
        })
        .map(|o| o.flatten())
        .collect();
    let clock = SliceClock::new(ms(100));
    let expected_end = clock.slice_at(stop("s0") + ms(500)) + 1;
    assert_eq!(end_slices, vec![Some(expected_end), None, None], "only sources get the end slice");
    let stopped: Vec<_> = h.events.iter().filter(|(_, e)| matches!(e, ClusterEvent::RunStopped { .. })).collect();
    assert_eq!(stopped.len(), 1);
    assert_eq!(
        stopped[0].1,
        ClusterEvent::RunStopped { run: 1, start_slice: run.start_slice, end_slice: expected_end }
    );
    assert!(stopped[0].0 >= stop("w"), "the run ends when the writer has answered");
    assert!(h.ctl.run().is_none());
    assert!(h.procs.values().all(|p| p.rc.state() == RunState::Ready));
}

#[test]
fn a_pull_run_starts_the_manager_before_the_builders_and_stops_it_after_the_sources() {
    let mut procs = sector(&[]);
    procs.push(("m", Role::Dfm, Behaviour::Answers { delay: ms(3) }));
    let mut h = Harness::new(&procs, |_| {});
    for c in [ClusterCommand::Init, ClusterCommand::Configure, ClusterCommand::Start] {
        h.command(c).unwrap();
        assert!(h.done(c)[0].is_ok(), "{c}");
    }
    let start = |n: &str| h.first_received(n, "START").unwrap();
    assert!(start("w") < start("m") && start("m") < start("b0") && start("b0") < start("s0"));
    h.after(Duration::from_secs(4));
    h.command(ClusterCommand::Stop).unwrap();
    let stop = |n: &str| h.first_received(n, "STOP").unwrap();
    assert!(stop("s0") < stop("m") && stop("m") < stop("b0") && stop("b0") < stop("w"));
    let end_slice = |n: &str| {
        h.procs[n].received.iter().find_map(|(_, c)| match c {
            Command::Stop { end_slice } => Some(*end_slice),
            _ => None,
        })
    };
    // The manager assigns up to the sources' end slice, then waits for the builders.
    assert!(end_slice("m").flatten().is_some());
    assert_eq!(end_slice("m"), end_slice("s0"));
    h.command(ClusterCommand::Off).unwrap();
    let off = |n: &str| h.first_received(n, "OFF").unwrap();
    assert!(off("s0") < off("b0") && off("b0") < off("m") && off("m") < off("w"));
}

#[test]
fn start_is_refused_with_processes_missing_and_no_run_number_is_taken() {
    let mut h = Harness::new(&sector(&[("s1", Behaviour::Silent)]), |_| {});
    h.command(ClusterCommand::Init).unwrap();
    h.command(ClusterCommand::Configure).unwrap();
    let err = h.command(ClusterCommand::Start).unwrap_err();
    match &err {
        CommandRejected::ProcessesMissing { missing, total } => {
            assert_eq!(*total, 6);
            assert_eq!(missing.len(), 1);
            assert!(missing[0].starts_with("s1: did not announce"), "{missing:?}");
        }
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("start_with_missing"));
    assert_eq!(h.runs_taken, 0);
    assert!(h.procs.values().all(|p| p.received.iter().all(|(_, c)| c.name() != "START")));
}

#[test]
fn start_with_missing_runs_without_the_silent_process_and_never_sends_it_start() {
    let mut h = Harness::new(&sector(&[("s1", Behaviour::Silent)]), |c| c.start_with_missing = true);
    h.start_run();
    assert_eq!(h.state("s0"), RunState::Running);
    assert!(h.first_received("s1", "START").is_none());
    assert!(h.first_received("s1", "INIT").is_none(), "inactive processes are not commanded");
}

#[test]
fn a_process_that_hangs_is_inactive_exactly_at_its_deadline_and_the_others_go_on() {
    let mut h = Harness::new(&sector(&[("b0", Behaviour::HangsIn("CONFIGURE"))]), |_| {});
    h.command(ClusterCommand::Init).unwrap();
    let sent = h.now;
    h.command(ClusterCommand::Configure).unwrap();
    let outcome = h.done(ClusterCommand::Configure)[0].clone();
    assert!(outcome.is_ok(), "silence is not a refusal");
    assert_eq!(outcome.no_answer, vec!["b0".to_string()]);
    let (at, _) =
        h.events.iter().find(|(_, e)| matches!(e, ClusterEvent::Inactive { name, .. } if name == "b0")).unwrap();
    assert_eq!(*at, sent + ms(1000), "marked at the reply deadline, not before");
    assert_eq!(
        h.ctl.processes()[1].inactive_reason,
        Some(InactiveReason::NoAnswer { command: "CONFIGURE", within: ms(1000) })
    );
    assert!(matches!(h.command(ClusterCommand::Start), Err(CommandRejected::ProcessesMissing { .. })));
}

#[test]
fn refusals_add_up_and_name_every_refuser() {
    let mut h = Harness::new(
        &sector(&[("b1", Behaviour::Refuses("CONFIGURE")), ("s2", Behaviour::Refuses("CONFIGURE"))]),
        |_| {},
    );
    h.command(ClusterCommand::Init).unwrap();
    h.command(ClusterCommand::Configure).unwrap();
    let o = h.done(ClusterCommand::Configure)[0];
    assert!(!o.is_ok());
    let names: Vec<&str> = o.refusals.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["b1", "s2"]);
    assert!(o.refusals.iter().all(|r| r.error == "not today"));
    // A refusal is an answer: the refusers stay active.
    assert!(h.ctl.processes().iter().all(|p| p.active));
}

#[test]
fn off_during_a_run_stops_it_first_and_reaches_inactive_processes_too() {
    let mut h = Harness::new(&sector(&[("s2", Behaviour::HangsIn("START"))]), |_| {});
    h.start_run();
    assert!(!h.ctl.processes().iter().find(|p| p.name == "s2").unwrap().active);
    h.after(Duration::from_secs(2));
    h.command(ClusterCommand::Off).unwrap();
    let (stopped_at, _) =
        h.events.iter().find(|(_, e)| matches!(e, ClusterEvent::RunStopped { .. })).expect("the run was stopped");
    let off_s0 = h.first_received("s0", "OFF").unwrap();
    assert!(*stopped_at <= off_s0);
    assert!(h.first_received("s2", "STOP").is_none(), "STOP goes to active processes");
    assert!(h.first_received("s2", "OFF").is_some(), "OFF goes to every process");
    assert!(h.first_received("s0", "OFF").unwrap() < h.first_received("b0", "OFF").unwrap());
    assert!(h.first_received("b0", "OFF").unwrap() < h.first_received("w", "OFF").unwrap());
    assert!(h.ctl.processes().iter().all(|p| p.switched_off));
    assert_eq!(h.state("w"), RunState::Off);
}

#[test]
fn a_process_that_leaves_is_not_waited_for() {
    let mut h = Harness::new(&sector(&[("b1", Behaviour::HangsIn("INIT"))]), |_| {});
    let sent = h.now;
    h.ctl.handle_command(h.now, ClusterCommand::Init, || Ok(1)).unwrap();
    h.drain();
    h.now += ms(10);
    h.settle_replies_only();
    assert_eq!(h.ctl.busy(), Some(ClusterCommand::Init), "still waiting for b1");
    h.ctl.handle_left(h.now, "b1");
    h.drain();
    assert_eq!(h.ctl.busy(), None);
    assert!(h.now < sent + ms(1000));
    let b1 = &h.ctl.processes()[2];
    assert_eq!(b1.inactive_reason, Some(InactiveReason::LeftDispatcher));
    // Answering again brings it back.
    h.ctl.handle_reply(h.now, &Reply { name: "b1".into(), state: RunState::Idle, error: None });
    h.drain();
    assert!(h.ctl.processes()[2].active);
    assert!(h.events.iter().any(|(_, e)| matches!(e, ClusterEvent::Back { name, .. } if name == "b1")));
}

#[test]
fn a_process_restarted_during_a_run_rejoins_it_and_its_absence_is_recorded() {
    let mut h = Harness::new(&sector(&[]), |_| {});
    h.start_run();
    let run = h.ctl.run().unwrap();
    h.after(ms(2000));
    // s1 dies: its part of the run is recorded.
    let died = h.now;
    h.ctl.handle_exited(died, "s1", "signal: 9 (SIGKILL)");
    h.settle();
    let d = h.ctl.departures().to_vec();
    assert_eq!(d.len(), 1);
    let clock = SliceClock::new(ms(100));
    assert_eq!((d[0].name.as_str(), d[0].role, d[0].run), ("s1", Role::Source, run.run));
    assert_eq!((d[0].from_slice, d[0].to_slice), (run.start_slice, clock.slice_at(died)));
    assert!(matches!(d[0].reason, InactiveReason::Exited(_)));
    // Restarted 300 ms later: it announces itself IDLE and is brought back into the run.
    h.after(ms(300));
    let p = h.procs.get_mut("s1").unwrap();
    p.rc = RunControl::new(h.now);
    p.received.clear();
    h.in_flight.push((h.now, Reply { name: "s1".into(), state: RunState::Idle, error: None }));
    h.settle();
    assert_eq!(h.state("s1"), RunState::Running);
    let got: Vec<&str> = h.procs["s1"].received.iter().map(|(_, c)| c.name()).collect();
    assert_eq!(got, ["INIT", "CONFIGURE", "START"]);
    let rejoined = h
        .events
        .iter()
        .find_map(|(_, e)| match e {
            ClusterEvent::Rejoined { name, run, start_slice } if name == "s1" => Some((*run, *start_slice)),
            _ => None,
        })
        .expect("a Rejoined event");
    assert_eq!(rejoined.0, run.run);
    assert!(rejoined.1 > d[0].to_slice, "it starts ahead of now, after the slices it missed");
    let view = h.ctl.processes().iter().find(|p| p.name == "s1").unwrap();
    assert!(view.active && view.joined_at == Some(rejoined.1));
    // The run stops normally, with s1 in it; nothing is left marked as joined.
    h.command(ClusterCommand::Stop).unwrap();
    assert!(h.done(ClusterCommand::Stop)[0].is_ok());
    assert!(h.procs["s1"].received.iter().any(|(_, c)| c.name() == "STOP"));
    assert!(h.ctl.processes().iter().all(|p| p.joined_at.is_none()));
    // A process restarted between runs is not started: it waits for the next INIT.
    h.ctl.handle_exited(h.now, "s2", "signal: 9 (SIGKILL)");
    h.procs.get_mut("s2").unwrap().rc = RunControl::new(h.now);
    h.in_flight.push((h.now, Reply { name: "s2".into(), state: RunState::Idle, error: None }));
    h.settle();
    assert_eq!(h.state("s2"), RunState::Idle);
    assert_eq!(h.ctl.departures().len(), 1, "not in a run: nothing to record");
}

#[test]
fn a_command_a_process_missed_while_reconnecting_is_sent_again_when_it_announces_itself() {
    let mut h = Harness::new(&sector(&[("b1", Behaviour::MissesOnce("STOP"))]), |_| {});
    h.run_then_stop();
    let stops = h.procs["b1"].received.iter().filter(|(_, c)| c.name() == "STOP").count();
    assert_eq!(stops, 2, "STOP went again after b1 announced itself RUNNING");
    assert_eq!(h.state("b1"), RunState::Ready);
    assert!(h.ctl.processes().iter().all(|p| p.active));
    assert!(
        h.events.iter().any(|(_, e)| matches!(e, ClusterEvent::AskedAgain { name, command: "STOP" } if name == "b1"))
    );
    // Not by waiting out the deadline: the announcement is what brought the STOP again.
    let builders_asked = h.first_received("b0", "STOP").unwrap();
    assert!(h.done_at(ClusterCommand::Stop) < builders_asked + ms(1000));
}

#[test]
fn answers_lost_while_run_control_was_away_are_asked_for_again_and_answered_again() {
    let mut h = Harness::new(&sector(&[]), |_| {});
    h.start_run();
    h.after(ms(2000));
    h.ctl.handle_command(h.now, ClusterCommand::Stop, || unreachable!()).unwrap();
    h.drain();
    assert_eq!(h.state("s0"), RunState::Ready, "the sources carried out STOP");
    // ... but their answers were lost: run control's listener was reconnecting.
    h.in_flight.clear();
    h.ctl.handle_answers_missed();
    h.settle();
    let stop = h.done(ClusterCommand::Stop);
    assert!(stop[0].is_ok(), "a repeat is answered, not refused: {:?}", stop[0]);
    for s in ["s0", "s1", "s2"] {
        let stops: Vec<_> = h.procs[s].received.iter().filter(|(_, c)| c.name() == "STOP").collect();
        assert_eq!(stops.len(), 2, "{s}");
        assert_eq!(stops[0].1, stops[1].1, "the same STOP, end slice and all");
    }
    assert!(h.ctl.processes().iter().all(|p| p.active && p.state == Some(RunState::Ready)));
    // Only those waited for are asked: the builders had not been sent STOP yet.
    assert_eq!(h.procs["b0"].received.iter().filter(|(_, c)| c.name() == "STOP").count(), 1);
}

#[test]
fn a_rejoin_stops_at_a_refusal_and_says_so() {
    let mut h = Harness::new(&sector(&[]), |_| {});
    h.start_run();
    h.ctl.handle_exited(h.now, "b1", "signal: 9 (SIGKILL)");
    let p = h.procs.get_mut("b1").unwrap();
    p.rc = RunControl::new(h.now);
    p.received.clear();
    p.behaviour = Behaviour::Refuses("CONFIGURE");
    h.in_flight.push((h.now, Reply { name: "b1".into(), state: RunState::Idle, error: None }));
    h.settle();
    assert_eq!(h.state("b1"), RunState::Standby);
    assert!(h.events.iter().any(|(_, e)| matches!(e, ClusterEvent::RejoinFailed { name, .. } if name == "b1")));
    let configures = h.procs["b1"].received.iter().filter(|(_, c)| c.name() == "CONFIGURE").count();
    assert_eq!(configures, 1, "asked once, not in a loop: {:?}", h.procs["b1"].received);
}

#[test]
fn commands_are_rejected_while_busy_discovering_or_out_of_turn() {
    let list = vec![ClusterProcess { name: "w".into(), role: Role::Writer }];
    let mut c = ClusterControl::new(ClusterControlConfig::new(list, String::new(), SliceClock::new(ms(100))), T0);
    assert_eq!(c.handle_command(T0, ClusterCommand::Init, || Ok(1)), Err(CommandRejected::Discovering));
    c.handle_reply(T0, &Reply { name: "w".into(), state: RunState::Idle, error: None });
    assert_eq!(c.handle_command(T0, ClusterCommand::Stop, || Ok(1)), Err(CommandRejected::NoRun));
    c.handle_command(T0, ClusterCommand::Init, || Ok(1)).unwrap();
    assert_eq!(c.handle_command(T0, ClusterCommand::Reset, || Ok(1)), Err(CommandRejected::Busy("INIT")));
    assert!(!c.handle_reply(T0, &Reply { name: "stranger".into(), state: RunState::Idle, error: None }));
    assert_eq!("start".parse::<ClusterCommand>(), Ok(ClusterCommand::Start));
    assert!("LAUNCH".parse::<ClusterCommand>().unwrap_err().contains("INIT"));
}

impl Harness {
    /// INIT, CONFIGURE and START, each carried to its end (whatever its outcome).
    fn start_run(&mut self) {
        for c in [ClusterCommand::Init, ClusterCommand::Configure, ClusterCommand::Start] {
            self.command(c).unwrap();
        }
    }

    /// A run of 2 s: [`Harness::start_run`], then a STOP that must succeed.
    fn run_then_stop(&mut self) {
        self.start_run();
        self.after(ms(2000));
        self.command(ClusterCommand::Stop).unwrap();
        let stop = self.done(ClusterCommand::Stop);
        assert!(stop[0].is_ok(), "{:?}", stop[0]);
    }

    /// Delivers the replies due now, without moving time.
    fn settle_replies_only(&mut self) {
        let (due, later): (Vec<_>, Vec<_>) = self.in_flight.drain(..).partition(|(t, _)| *t <= self.now);
        self.in_flight = later;
        for (_, r) in due {
            self.ctl.handle_reply(self.now, &r);
        }
        self.drain();
    }
}

fn behaviour() -> impl Strategy<Value = Behaviour> {
    prop_oneof![
        6 => (0u64..2500).prop_map(|d| Behaviour::Answers { delay: ms(d) }),
        1 => Just(Behaviour::Silent),
        1 => prop::sample::select(vec!["INIT", "CONFIGURE", "START", "STOP"]).prop_map(Behaviour::HangsIn),
        1 => prop::sample::select(vec!["CONFIGURE", "START"]).prop_map(Behaviour::Refuses),
        1 => prop::sample::select(vec!["INIT", "CONFIGURE", "START", "STOP"]).prop_map(Behaviour::MissesOnce),
    ]
}

proptest! {
    /// Whatever the processes do, every command ends within the sum of its step deadlines,
    /// START reaches a source only after every active builder and the writer answered, a
    /// run never starts with processes missing, and OFF reaches every process.
    #[test]
    fn every_command_ends_in_bounded_time_in_data_flow_order(
        behaviours in prop::collection::vec(behaviour(), 6),
        with_missing in any::<bool>(),
    ) {
        let names = ["w", "b0", "b1", "s0", "s1", "s2"];
        let list: Vec<(&str, Behaviour)> = names.iter().copied().zip(behaviours).collect();
        let mut h = Harness::new(&sector(&list), |c| c.start_with_missing = with_missing);
        let (discovered, _) = h.events.iter().find(|(_, e)| matches!(e, ClusterEvent::DiscoveryDone { .. })).unwrap();
        prop_assert!(*discovered <= T0 + ms(3000));
        for c in [ClusterCommand::Init, ClusterCommand::Configure, ClusterCommand::Start] {
            let before = h.now;
            match h.command(c) {
                Ok(()) => {
                    prop_assert_eq!(h.done(c).len(), 1);
                    // One step for INIT/CONFIGURE, three for START, each at most 1 s.
                    let steps = if c == ClusterCommand::Start { 3 } else { 1 };
                    prop_assert!(h.done_at(c) <= before + ms(1000) * steps);
                }
                Err(CommandRejected::ProcessesMissing { .. }) => {
                    prop_assert!(c == ClusterCommand::Start && !with_missing);
                    prop_assert_eq!(h.runs_taken, 0);
                }
                Err(e) => prop_assert!(false, "{e}"),
            }
        }
        if let Some(first_source) = ["s0", "s1", "s2"].iter().filter_map(|s| h.delivery_index(s, "START")).min() {
            for (name, p) in &h.procs {
                if p.role != Role::Source && let Some(i) = h.delivery_index(name, "START") {
                    prop_assert!(i < first_source);
                }
            }
        }
        h.after(Duration::from_secs(1));
        let before = h.now;
        h.command(ClusterCommand::Off).unwrap();
        // STOP (1 + 2, 1 + 1.5, 1 + 1 s, plus 0.5 s lead each) then OFF (3 x 1 s).
        prop_assert!(h.done_at(ClusterCommand::Off) <= before + ms(3500 + 3000 + 2500 + 3000));
        prop_assert_eq!(h.ctl.busy(), None);
        prop_assert!(h.ctl.run().is_none());
        for name in names {
            prop_assert!(h.first_received(name, "OFF").is_some(), "{} never got OFF", name);
        }
    }
}

#[test]
fn a_command_lost_without_a_trace_is_sent_again_to_whoever_has_not_answered() {
    let mut h = Harness::new(&sector(&[("s1", Behaviour::LosesOnce("STOP"))]), |_| {});
    h.run_then_stop();
    assert_eq!(h.state("s1"), RunState::Ready, "the STOP sent again was carried out");
    assert!(h.ctl.processes().iter().all(|p| p.active), "nobody marked silent");
    let reminded: Vec<_> = h
        .events
        .iter()
        .filter_map(|(t, e)| match e {
            ClusterEvent::Reminded { command: "STOP", names } => Some((*t, names.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(reminded.len(), 1, "{reminded:?}");
    assert_eq!(reminded[0].1, vec!["s1".to_string()], "only the process not heard from");
    // Within the first reminder's wait, long before the answer deadline.
    let sources_asked = h.first_received("s0", "STOP").unwrap();
    assert_eq!(reminded[0].0, sources_asked + shoal_core::cluster::ASK_AGAIN_FIRST);
}

#[test]
fn a_process_slow_to_answer_is_reminded_at_doubling_intervals_and_not_asked_to_act_twice() {
    let mut h = Harness::new(&sector(&[("b0", Behaviour::Answers { delay: ms(3200) })]), |c| {
        // Every answer of b0 takes 3.2 s: within the deadlines, slow enough for reminders.
        c.reply_timeout = ms(4000);
        c.builder_drain = ms(5000);
    });
    h.run_then_stop();
    let asked: Vec<Instant> =
        h.procs["b0"].received.iter().filter(|(_, c)| c.name() == "STOP").map(|(t, _)| *t).collect();
    let first = asked[0];
    // 0.5 s, then 1 s, then 2 s later: at +0.5, +1.5, +3.5 s; its answer came at +3.2 s.
    assert_eq!(asked, vec![first, first + ms(500), first + ms(1500)], "reminders double");
    assert_eq!(h.state("b0"), RunState::Ready, "the repeats were answered, not carried out again");
}
