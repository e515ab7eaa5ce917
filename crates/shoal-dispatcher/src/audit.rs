//! The audit log: every command, alert and refusal of run control's HTTP API, with who
//! (the token's name and role), from where and when.
//!
//! Each event is one JSON line in `STATE_DIR/audit.jsonl` (`shoal audit` prints them) and a
//! count by kind and outcome on run control's `/metrics`
//! (`shoal_runcontrol_audit_events_total`). A flood of refusals cannot fill the disk, and
//! loses none from the log either: at most [`REFUSALS_PER_SECOND`] a second are written one
//! by one, the rest of that second are gathered by (kind, what, reason, address) into one
//! line each with their `count` and `first` and `last` times ([`Audit::flush`], at the next
//! second and at the end), at most [`GROUPS_PER_SECOND`] groups a second before addresses
//! are gathered too (`address` `*`). The counts of the lines add up to the metrics'.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

/// Most refusals written one by one a second (the rest are gathered).
pub const REFUSALS_PER_SECOND: u32 = 10;

/// Most gathered lines for one second before refusals from further addresses share one
/// (address `*`) per kind, what and reason.
pub const GROUPS_PER_SECOND: usize = 64;

/// One audited event, or several alike gathered into one line (`count` > 1).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AuditEvent {
    /// RFC 3339, UTC (of a gathered line: when it was written).
    pub time: String,
    /// `command`, `alert` or `request` (a refused request to any other endpoint).
    pub kind: String,
    /// What was asked: the command's name, the alert's text, the path.
    pub what: String,
    /// `accepted`, `refused` or `failed`.
    pub outcome: String,
    /// Why it was refused or failed (`no_token`, `bad_token`, `revoked`, `role`, `origin`,
    /// the command's answer).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// The token's name; empty where none was given or security is off.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub identity: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub role: String,
    /// The client's address (`*` for a gathered line of many addresses).
    pub address: String,
    /// A gathered line: how many events it stands for (absent: one).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub count: u64,
    /// A gathered line: the first and the last of its events, RFC 3339.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub first: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub last: String,
}

impl AuditEvent {
    /// How many events this line stands for.
    pub fn events(&self) -> u64 {
        self.count.max(1)
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Refusals of one second beyond those written one by one, gathered by (kind, what,
/// reason, address).
type GroupKey = (String, String, String, String);

struct Group {
    event: AuditEvent,
    count: u64,
    first: SystemTime,
    last: SystemTime,
}

/// Events kept in memory for the run records (the log file has them all).
pub const RECENT: usize = 1000;

#[derive(Default)]
struct Inner {
    /// The latest events with their time, for [`Audit::between`].
    recent: std::collections::VecDeque<(SystemTime, AuditEvent)>,
    counts: BTreeMap<(String, String), u64>,
    /// The second and how many refusals were written in it one by one.
    refusal_second: (u64, u32),
    /// That second's refusals beyond them.
    gathered: BTreeMap<GroupKey, Group>,
    failed_writes: u64,
}

/// The audit log of one run control.
pub struct Audit {
    path: PathBuf,
    inner: Mutex<Inner>,
}

fn unix_second(t: SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

impl Audit {
    /// The log in `state_dir` (appended to; made when the first event comes).
    pub fn new(state_dir: &Path) -> Self {
        Self { path: state_dir.join("audit.jsonl"), inner: Mutex::default() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records an event (its `time` is filled in here).
    pub fn record(&self, event: AuditEvent) {
        self.record_at(event, SystemTime::now());
    }

    /// [`Audit::record`] at `now`.
    pub fn record_at(&self, mut event: AuditEvent, now: SystemTime) {
        event.time = rfc3339(now);
        let second = unix_second(now);
        let mut inner = self.inner.lock().expect("audit lock");
        *inner.counts.entry((event.kind.clone(), event.outcome.clone())).or_default() += 1;
        if event.outcome == "refused" {
            if inner.refusal_second.0 != second {
                self.write_gathered(&mut inner, now);
                inner.refusal_second = (second, 0);
            }
            if inner.refusal_second.1 >= REFUSALS_PER_SECOND {
                gather(&mut inner.gathered, event, now);
                return;
            }
            inner.refusal_second.1 += 1;
        }
        self.write(&mut inner, event, now);
    }

    /// Writes the refusals gathered in a second that is over (at `now`): run control calls
    /// it every second and at its end, so that a burst's last lines do not wait for the next
    /// refusal.
    pub fn flush_at(&self, now: SystemTime) {
        let mut inner = self.inner.lock().expect("audit lock");
        if inner.refusal_second.0 != unix_second(now) {
            self.write_gathered(&mut inner, now);
        }
    }

    /// Writes whatever is gathered, now (the end of run control).
    pub fn flush(&self) {
        let mut inner = self.inner.lock().expect("audit lock");
        self.write_gathered(&mut inner, SystemTime::now());
    }

    fn write_gathered(&self, inner: &mut Inner, now: SystemTime) {
        for (_, g) in std::mem::take(&mut inner.gathered) {
            let mut event = g.event;
            event.time = rfc3339(now);
            event.count = g.count;
            event.first = rfc3339(g.first);
            event.last = rfc3339(g.last);
            self.write(inner, event, g.last);
        }
    }

    /// Keeps `event` (of `at`) for the run records, logs it and appends its line.
    fn write(&self, inner: &mut Inner, event: AuditEvent, at: SystemTime) {
        if inner.recent.len() == RECENT {
            inner.recent.pop_front();
        }
        tracing::info!(kind = %event.kind, what = %event.what, outcome = %event.outcome, reason = %event.reason,
            identity = %event.identity, address = %event.address, count = event.events(), "audit");
        let line = serde_json::to_string(&event).expect("an event serialises");
        inner.recent.push_back((at, event));
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = written {
            inner.failed_writes += 1;
            tracing::warn!(path = %self.path.display(), error = %e, "cannot write the audit log");
        }
    }

    /// The events written between `from` and `to` (of the latest [`RECENT`]): a run's.
    pub fn between(&self, from: std::time::SystemTime, to: std::time::SystemTime) -> Vec<AuditEvent> {
        let inner = self.inner.lock().expect("audit lock");
        inner.recent.iter().filter(|(t, _)| *t >= from && *t <= to).map(|(_, e)| e.clone()).collect()
    }

    /// Events by (kind, outcome), and how many could not be written.
    pub fn counts(&self) -> (BTreeMap<(String, String), u64>, u64) {
        let inner = self.inner.lock().expect("audit lock");
        (inner.counts.clone(), inner.failed_writes)
    }
}

/// What is gathered is written when the log goes, whichever way run control ends.
impl Drop for Audit {
    fn drop(&mut self) {
        if let Ok(mut inner) = self.inner.lock() {
            self.write_gathered(&mut inner, SystemTime::now());
        }
    }
}

/// Adds a refusal beyond the second's written ones to its group (a new address beyond
/// [`GROUPS_PER_SECOND`] groups joins its kind's, what's and reason's `*` group).
fn gather(gathered: &mut BTreeMap<GroupKey, Group>, mut event: AuditEvent, now: SystemTime) {
    let mut key = (event.kind.clone(), event.what.clone(), event.reason.clone(), event.address.clone());
    if !gathered.contains_key(&key) && gathered.len() >= GROUPS_PER_SECOND {
        key.3 = "*".into();
        event.address = "*".into();
    }
    let group = gathered.entry(key).or_insert_with(|| Group { event, count: 0, first: now, last: now });
    group.count += 1;
    group.last = now;
}

/// The events of an audit log, oldest first; lines that are not events are skipped and
/// counted.
pub fn read(path: &Path) -> anyhow::Result<(Vec<AuditEvent>, usize)> {
    use anyhow::Context;
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut events = Vec::new();
    let mut bad = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        match serde_json::from_str(line) {
            Ok(e) => events.push(e),
            Err(_) => bad += 1,
        }
    }
    Ok((events, bad))
}

/// `shoal audit`: the log as a table (or its lines, `json`).
pub fn print(state_dir: &Path, json: bool) -> anyhow::Result<()> {
    let path = state_dir.join("audit.jsonl");
    if !path.exists() {
        println!("no audit log at {} (nothing was asked of run control's HTTP API)", path.display());
        return Ok(());
    }
    let (events, bad) = read(&path)?;
    for e in &events {
        if json {
            println!("{}", serde_json::to_string(e)?);
            continue;
        }
        let who = if e.identity.is_empty() { "-".to_string() } else { format!("{} ({})", e.identity, e.role) };
        let why = match (e.reason.is_empty(), e.count) {
            (true, 0) => String::new(),
            (false, 0) => format!(" [{}]", e.reason),
            (_, n) => format!(" [{}; {n} alike from {} to {}]", e.reason, e.first, e.last),
        };
        println!("{}  {:<8} {:<9} {:<24} {:<22} {}{}", e.time, e.kind, e.outcome, who, e.address, e.what, why);
    }
    if bad > 0 {
        eprintln!("{bad} lines of {} are not audit events", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: &str, outcome: &str) -> AuditEvent {
        AuditEvent {
            time: String::new(),
            kind: kind.into(),
            what: "START".into(),
            outcome: outcome.into(),
            reason: if outcome == "refused" { "bad_token".into() } else { String::new() },
            identity: "bob".into(),
            role: "operator".into(),
            address: "127.0.0.1:40000".into(),
            ..Default::default()
        }
    }

    #[test]
    fn every_refusal_of_a_flood_is_in_the_log_gathered_and_the_lines_add_up_to_the_counts() {
        let dir = std::env::temp_dir().join(format!("shoal-audit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let audit = Audit::new(&dir);
        let _ = std::fs::remove_file(audit.path());
        let second = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_800_000_000);
        let ms = |n: u64| second + std::time::Duration::from_millis(n);
        audit.record_at(event("command", "accepted"), second);
        // 1,000 refusals in one second from two addresses, then 200 from 200 addresses.
        for i in 0..1000u64 {
            let mut e = event("request", "refused");
            e.address = format!("127.0.0.{}:40000", 1 + i % 2);
            audit.record_at(e, ms(i));
        }
        for i in 0..200u64 {
            let mut e = event("request", "refused");
            e.address = format!("10.0.{}.{}:1", i / 250, i % 250);
            audit.record_at(e, ms(999));
        }
        // Nothing more comes: the second's flush writes what was gathered.
        audit.flush_at(second + std::time::Duration::from_secs(1));
        let (counts, failed) = audit.counts();
        assert_eq!(counts[&("command".to_string(), "accepted".to_string())], 1);
        assert_eq!(counts[&("request".to_string(), "refused".to_string())], 1200);
        assert_eq!(failed, 0);
        let (events, bad) = read(audit.path()).unwrap();
        assert_eq!(bad, 0);
        assert_eq!(events[0].what, "START");
        assert!(!events[0].time.is_empty());
        let refused: Vec<_> = events.iter().filter(|e| e.outcome == "refused").collect();
        assert_eq!(refused.iter().map(|e| e.events()).sum::<u64>(), 1200, "every refusal is in a line");
        let one_by_one = refused.iter().filter(|e| e.count == 0).count();
        assert_eq!(one_by_one, REFUSALS_PER_SECOND as usize);
        // The two addresses of the burst, then the many gathered once their groups ran out.
        let gathered: Vec<_> = refused.iter().filter(|e| e.count > 0).collect();
        assert_eq!(gathered.len(), GROUPS_PER_SECOND + 1, "{gathered:?}");
        let first = gathered.iter().find(|e| e.address == "127.0.0.1:40000").unwrap();
        assert_eq!((first.count, first.first.as_str()), (495, "2027-01-15T08:00:00.010Z"));
        assert_eq!(first.last, "2027-01-15T08:00:00.998Z");
        let many = gathered.iter().find(|e| e.address == "*").unwrap();
        assert_eq!(many.count, 200 - (GROUPS_PER_SECOND as u64 - 2));
        // A run of that second holds what was written in it.
        let in_run = audit.between(second, ms(999));
        assert_eq!(in_run.iter().map(|e| e.events()).sum::<u64>(), 1201);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
