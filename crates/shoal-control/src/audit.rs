//! The audit log: every command, alert and refusal of run control's HTTP API, with who
//! (the token's name and role), from where and when.
//!
//! Each event is one JSON line in `STATE_DIR/audit.jsonl` (`shoal audit` prints them) and a
//! count by kind and outcome on run control's `/metrics`
//! (`shoal_runcontrol_audit_events_total`). Refusals are counted every time but written at
//! most [`REFUSALS_PER_SECOND`] a second, the next one written saying how many were held
//! back, so that a flood of bad requests cannot fill the disk.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// Most refusals written a second (the rest are counted, and said by the next one written).
pub const REFUSALS_PER_SECOND: u32 = 10;

/// One audited event.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AuditEvent {
    /// RFC 3339, UTC.
    pub time: String,
    /// `command`, `alert` or `request` (a refused request to any other endpoint).
    pub kind: String,
    /// What was asked: the command's name, the alert's text, the path.
    pub what: String,
    /// `accepted`, `refused` or `failed`.
    pub outcome: String,
    /// Why it was refused or failed (`no_token`, `bad_token`, `role`, `origin`, the
    /// command's answer).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// The token's name; empty where none was given or security is off.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub identity: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub role: String,
    /// The client's address.
    pub address: String,
    /// Refusals not written since the last one that was.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub held_back: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Events kept in memory for the run records (the log file has them all).
pub const RECENT: usize = 1000;

#[derive(Default)]
struct Inner {
    /// The latest events with their time, for [`Audit::between`].
    recent: std::collections::VecDeque<(std::time::SystemTime, AuditEvent)>,
    counts: BTreeMap<(String, String), u64>,
    /// The second and how many refusals were written in it.
    refusal_second: (u64, u32),
    held_back: u64,
    failed_writes: u64,
}

/// The audit log of one run control.
pub struct Audit {
    path: PathBuf,
    inner: Mutex<Inner>,
}

impl Audit {
    /// The log in `state_dir` (appended to; made when the first event comes).
    pub fn new(state_dir: &Path) -> Self {
        Self { path: state_dir.join("audit.jsonl"), inner: Mutex::default() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records an event (its `time` and `held_back` are filled in here).
    pub fn record(&self, event: AuditEvent) {
        self.record_at(event, std::time::SystemTime::now());
    }

    /// [`Audit::record`] at `now`.
    pub fn record_at(&self, mut event: AuditEvent, now: std::time::SystemTime) {
        event.time = humantime::format_rfc3339_millis(now).to_string();
        let second = now.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let mut inner = self.inner.lock().expect("audit lock");
        *inner.counts.entry((event.kind.clone(), event.outcome.clone())).or_default() += 1;
        if event.outcome == "refused" {
            if inner.refusal_second.0 != second {
                inner.refusal_second = (second, 0);
            }
            if inner.refusal_second.1 >= REFUSALS_PER_SECOND {
                inner.held_back += 1;
                return;
            }
            inner.refusal_second.1 += 1;
            event.held_back = std::mem::take(&mut inner.held_back);
        }
        if inner.recent.len() == RECENT {
            inner.recent.pop_front();
        }
        inner.recent.push_back((now, event.clone()));
        tracing::info!(kind = %event.kind, what = %event.what, outcome = %event.outcome, reason = %event.reason,
            identity = %event.identity, address = %event.address, "audit");
        let line = serde_json::to_string(&event).expect("an event serialises");
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
        let why = match (e.reason.is_empty(), e.held_back) {
            (true, 0) => String::new(),
            (false, 0) => format!(" [{}]", e.reason),
            (_, n) => format!(" [{}; {n} more refusals before it not written]", e.reason),
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
            held_back: 0,
        }
    }

    #[test]
    fn every_event_is_counted_and_a_flood_of_refusals_is_written_at_a_bounded_rate() {
        let dir = std::env::temp_dir().join(format!("shoal-audit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let audit = Audit::new(&dir);
        let _ = std::fs::remove_file(audit.path());
        let second = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_800_000_000);
        audit.record_at(event("command", "accepted"), second);
        for _ in 0..1000 {
            audit.record_at(event("request", "refused"), second);
        }
        // The next second writes again, and says how many were held back.
        audit.record_at(event("request", "refused"), second + std::time::Duration::from_secs(1));
        let (counts, failed) = audit.counts();
        assert_eq!(counts[&("command".to_string(), "accepted".to_string())], 1);
        assert_eq!(counts[&("request".to_string(), "refused".to_string())], 1001);
        assert_eq!(failed, 0);
        let (events, bad) = read(audit.path()).unwrap();
        assert_eq!(bad, 0);
        assert_eq!(events[0].what, "START");
        assert!(!events[0].time.is_empty());
        let refused: Vec<_> = events.iter().filter(|e| e.outcome == "refused").collect();
        assert_eq!(refused.len(), REFUSALS_PER_SECOND as usize + 1);
        assert_eq!(refused.last().unwrap().held_back, 1000 - u64::from(REFUSALS_PER_SECOND));
        // A run of that second holds what was written in it.
        let in_run = audit.between(second, second);
        assert_eq!(in_run.len(), 1 + REFUSALS_PER_SECOND as usize);
        assert_eq!(in_run[0].what, "START");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
