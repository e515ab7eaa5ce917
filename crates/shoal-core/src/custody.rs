//! Custody of stored files: which closed file goes to which destination next, when a copy
//! is safe, when a local copy may be deleted, and what the archive's ledger says. Sans-IO:
//! the archiver (`shoal-archive`) copies, asks destinations for their checksums, deletes
//! and journals; this decides, with time passed in.
//!
//! A file is `written` when it closes (its size and adler32 known), `copying` while a copy
//! to some destination is under way, `safe` once every destination that must hold it
//! reported a checksum equal to the one computed while writing, `deleted` once its local
//! copy is gone (never before it is safe at [`CustodyConfig::delete_after`] destinations),
//! or `quarantined(reason)` once a destination refused it [`CustodyConfig::max_attempts`]
//! times or its local copy no longer matches its checksum.
//!
//! Every input is also a [`Record`] of the archiver's journal: the state after a crash is
//! what replaying the journal gives ([`Custody::replay`]). A copy under way when the
//! archiver died is simply tried again; a deletion whose record was lost is found by the
//! archiver (the local file is gone) and recorded then.

use std::collections::{BTreeMap, VecDeque};

use crate::{Duration, Instant};

/// What custody is asked to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CustodyConfig {
    /// How many destinations every file goes to (the archiver's list, in order).
    pub destinations: usize,
    /// Delete the local copy once the file is safe at this many destinations and no copy
    /// to another is still to come (none: never, the default). It is also how many make a
    /// file safe (none: every destination).
    pub delete_after: Option<usize>,
    /// Copies refused (failed, or a checksum that did not match) before a file is
    /// quarantined at a destination.
    pub max_attempts: u32,
    /// The first wait after a refused copy, doubled each time up to `max_backoff`.
    pub backoff: Duration,
    pub max_backoff: Duration,
    /// Copies under way at once, over every destination.
    pub max_parallel: usize,
}

impl Default for CustodyConfig {
    fn default() -> Self {
        Self {
            destinations: 1,
            delete_after: None,
            max_attempts: 5,
            backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(60),
            max_parallel: 2,
        }
    }
}

/// A file's size and adler32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Seal {
    pub bytes: u64,
    pub adler32: u32,
}

/// One line of the archiver's journal, and one input of [`Custody`].
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(tag = "record", rename_all = "snake_case"))]
pub enum Record {
    /// A file closed whole (its metadata exists): `closed_at` in Unix seconds.
    Closed { file: String, run: u64, seal: Seal, closed_at: f64 },
    /// A copy to destination `dest` begins.
    Copying { file: String, dest: usize },
    /// The destination's own checksum equals the file's.
    Safe { file: String, dest: usize, at: f64 },
    /// A copy failed or its checksum did not match (the bad copy removed): tried again
    /// after a back-off, quarantined after `max_attempts`.
    Refused { file: String, dest: usize, reason: String, at: f64 },
    /// The local copy no longer matches its checksum: it is kept, never copied again.
    LocalAltered { file: String, found: Seal, at: f64 },
    /// The local copy is gone (deleted once safe; or found gone).
    Deleted { file: String, at: f64 },
    /// An operator released a quarantined file (its cause fixed): every destination where
    /// it was quarantined is tried again from the start, and its local copy is checked
    /// again at the next copy.
    Released { file: String, at: f64 },
}

/// Where a file stands at one destination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AtDestination {
    /// Not copied yet; the next attempt not before `after`.
    Pending {
        attempts: u32,
        after: Instant,
    },
    Copying {
        attempts: u32,
    },
    Safe,
    Quarantined(String),
}

/// A file's state as the issue names them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FileState {
    Written,
    Copying,
    Safe,
    Deleted,
    Quarantined(String),
}

impl FileState {
    pub fn name(&self) -> &'static str {
        match self {
            FileState::Written => "written",
            FileState::Copying => "copying",
            FileState::Safe => "safe",
            FileState::Deleted => "deleted",
            FileState::Quarantined(_) => "quarantined",
        }
    }
}

/// One file in custody.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub run: u64,
    pub seal: Seal,
    pub closed_at: f64,
    pub at: Vec<AtDestination>,
    /// Its local copy is gone.
    pub deleted: bool,
    /// Its local copy no longer matches (what was found).
    pub altered: Option<Seal>,
    /// The last refusal's reason, per destination.
    pub last_refusal: Vec<Option<String>>,
}

impl Entry {
    /// Destinations where it is safe.
    pub fn safe_count(&self) -> usize {
        self.at.iter().filter(|a| **a == AtDestination::Safe).count()
    }

    /// Its state, where `required` destinations make it safe.
    pub fn state(&self, required: usize) -> FileState {
        if let Some(found) = self.altered {
            return FileState::Quarantined(format!(
                "local copy altered after close: adler32 {:08x} over {} bytes, written as {:08x} over {}",
                found.adler32, found.bytes, self.seal.adler32, self.seal.bytes
            ));
        }
        if self.deleted {
            return FileState::Deleted;
        }
        if self.at.iter().any(|a| matches!(a, AtDestination::Copying { .. })) {
            return FileState::Copying;
        }
        if self.at.iter().any(|a| matches!(a, AtDestination::Pending { .. })) {
            return FileState::Written;
        }
        if self.safe_count() >= required {
            return FileState::Safe;
        }
        let reason = self.at.iter().find_map(|a| match a {
            AtDestination::Quarantined(r) => Some(r.clone()),
            _ => None,
        });
        FileState::Quarantined(reason.unwrap_or_default())
    }
}

/// What the archiver should do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Copy `file` to destination `dest` (journal [`Record::Copying`] first), then report
    /// [`Custody::handle_copied`] with the destination's own checksum, or
    /// [`Custody::handle_refused`].
    Copy { file: String, dest: usize },
    /// Delete the local copy (it is safe where it must be), then report
    /// [`Custody::handle_deleted`].
    Delete { file: String },
}

/// The archive's ledger: every byte written is safe, pending, quarantined or lost.
#[derive(Clone, Debug, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ArchiveLedger {
    pub files: u64,
    pub bytes_written: u64,
    /// Safe at every destination (deleted locally or not).
    pub files_safe: u64,
    pub bytes_safe: u64,
    /// Not yet safe everywhere, not quarantined: waiting or being copied.
    pub files_pending: u64,
    pub bytes_pending: u64,
    /// When the oldest pending file closed (Unix seconds).
    pub oldest_pending_closed_at: Option<f64>,
    pub files_quarantined: u64,
    pub bytes_quarantined: u64,
    /// Of the safe files, those whose local copy is gone.
    pub files_deleted: u64,
    /// Files lost: gone locally before they were safe anywhere, by reason.
    pub bytes_lost: u64,
    pub lost: Vec<(String, String)>,
    /// Each quarantined file and why.
    pub quarantined: Vec<(String, String)>,
}

impl ArchiveLedger {
    /// Adds `other`'s files to this ledger (several writers' ledgers of one run).
    pub fn absorb(&mut self, other: ArchiveLedger) {
        self.files += other.files;
        self.bytes_written += other.bytes_written;
        self.files_safe += other.files_safe;
        self.bytes_safe += other.bytes_safe;
        self.files_pending += other.files_pending;
        self.bytes_pending += other.bytes_pending;
        self.files_quarantined += other.files_quarantined;
        self.bytes_quarantined += other.bytes_quarantined;
        self.files_deleted += other.files_deleted;
        self.bytes_lost += other.bytes_lost;
        self.lost.extend(other.lost);
        self.quarantined.extend(other.quarantined);
        self.oldest_pending_closed_at = match (self.oldest_pending_closed_at, other.oldest_pending_closed_at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }

    /// Written = safe + pending + quarantined + lost.
    pub fn balanced(&self) -> bool {
        self.bytes_written == self.bytes_safe + self.bytes_pending + self.bytes_quarantined + self.bytes_lost
    }
}

/// The custody of every file an archiver has seen. See the module documentation.
#[derive(Debug)]
pub struct Custody {
    cfg: CustodyConfig,
    files: BTreeMap<String, Entry>,
    /// Files in the order they closed, for copying in that order.
    order: VecDeque<String>,
    /// Files gone locally before they were safe: why.
    lost: BTreeMap<String, String>,
}

impl Custody {
    pub fn new(cfg: CustodyConfig) -> Self {
        Self { cfg, files: BTreeMap::new(), order: VecDeque::new(), lost: BTreeMap::new() }
    }

    pub fn config(&self) -> &CustodyConfig {
        &self.cfg
    }

    pub fn files(&self) -> impl Iterator<Item = (&String, &Entry)> {
        self.order.iter().filter_map(|f| self.files.get_key_value(f))
    }

    pub fn entry(&self, file: &str) -> Option<&Entry> {
        self.files.get(file)
    }

    /// Destinations that make a file safe: `delete_after`, or every one.
    pub fn required(&self) -> usize {
        self.cfg.delete_after.unwrap_or(self.cfg.destinations).clamp(1, self.cfg.destinations.max(1))
    }

    pub fn state(&self, file: &str) -> Option<FileState> {
        self.files.get(file).map(|e| e.state(self.required()))
    }

    /// Takes one journal record as it was when written (`now`: the replaying archiver's
    /// clock; a copy that was under way is pending again, at once).
    pub fn replay(&mut self, record: &Record, now: Instant) {
        match record {
            Record::Closed { file, run, seal, closed_at } => self.handle_closed(file, *run, *seal, *closed_at, now),
            Record::Copying { .. } => {}
            Record::Safe { file, dest, .. } => self.set(file, *dest, AtDestination::Safe),
            Record::Refused { file, dest, reason, .. } => self.handle_refused(file, *dest, reason, now),
            Record::LocalAltered { file, found, .. } => self.handle_local_altered(file, *found),
            Record::Deleted { file, .. } => self.handle_deleted(file),
            Record::Released { file, .. } => {
                self.handle_released(file, now);
            }
        }
    }

    /// A quarantined file released: its quarantined destinations pending again, its local
    /// copy to be checked again. Whether it was quarantined.
    pub fn handle_released(&mut self, file: &str, now: Instant) -> bool {
        let Some(e) = self.files.get_mut(file) else { return false };
        let mut released = e.altered.take().is_some();
        for (a, why) in e.at.iter_mut().zip(&mut e.last_refusal) {
            if matches!(a, AtDestination::Quarantined(_)) {
                *a = AtDestination::Pending { attempts: 0, after: now };
                *why = None;
                released = true;
            }
        }
        released
    }

    /// A file closed whole. Known already (seen again after a restart): nothing changes.
    /// Known with another seal or close time: a new file under a used name (a run number
    /// used again outside run control), taken as new from the start.
    pub fn handle_closed(&mut self, file: &str, run: u64, seal: Seal, closed_at: f64, now: Instant) {
        if let Some(e) = self.files.get(file) {
            if e.seal == seal && e.closed_at == closed_at {
                return;
            }
            self.files.remove(file);
            self.order.retain(|f| f != file);
            self.lost.remove(file);
        }
        let n = self.cfg.destinations;
        self.files.insert(
            file.to_string(),
            Entry {
                run,
                seal,
                closed_at,
                at: vec![AtDestination::Pending { attempts: 0, after: now }; n],
                deleted: false,
                altered: None,
                last_refusal: vec![None; n],
            },
        );
        self.order.push_back(file.to_string());
    }

    fn set(&mut self, file: &str, dest: usize, to: AtDestination) {
        if let Some(a) = self.files.get_mut(file).and_then(|e| e.at.get_mut(dest)) {
            *a = to;
        }
    }

    /// A copy finished and the destination reports `remote` for it; `read` is what the
    /// copy read of the local file. Returns the record to journal.
    /// `at`: the wall clock (Unix seconds) for the record.
    pub fn handle_copied(
        &mut self,
        file: &str,
        dest: usize,
        read: Seal,
        remote: Option<Seal>,
        now: Instant,
        at: f64,
    ) -> Record {
        let Some(e) = self.files.get(file) else {
            return Record::Refused { file: file.into(), dest, reason: "not in custody".into(), at };
        };
        if read != e.seal {
            self.handle_local_altered(file, read);
            return Record::LocalAltered { file: file.into(), found: read, at };
        }
        let reason = match remote {
            Some(r) if r == e.seal => {
                self.set(file, dest, AtDestination::Safe);
                return Record::Safe { file: file.into(), dest, at };
            }
            Some(r) => format!(
                "checksum mismatch at the destination: adler32 {:08x} over {} bytes, expected {:08x} over {}",
                r.adler32, r.bytes, e.seal.adler32, e.seal.bytes
            ),
            None => "the destination reports no checksum".into(),
        };
        self.handle_refused(file, dest, &reason, now);
        Record::Refused { file: file.into(), dest, reason, at }
    }

    /// A copy failed (or did not verify): tried again after a back-off, or quarantined at
    /// that destination after `max_attempts`.
    pub fn handle_refused(&mut self, file: &str, dest: usize, reason: &str, now: Instant) {
        let cfg = &self.cfg;
        let Some(e) = self.files.get_mut(file) else { return };
        let Some(a) = e.at.get_mut(dest) else { return };
        let attempts = match a {
            AtDestination::Pending { attempts, .. } | AtDestination::Copying { attempts } => *attempts + 1,
            AtDestination::Safe | AtDestination::Quarantined(_) => return,
        };
        e.last_refusal[dest] = Some(reason.to_string());
        *a = if attempts >= cfg.max_attempts {
            AtDestination::Quarantined(format!("{attempts} attempts; the last: {reason}"))
        } else {
            let wait = cfg.backoff.saturating_mul(1 << (attempts - 1).min(20)).min(cfg.max_backoff);
            AtDestination::Pending { attempts, after: now + wait }
        };
    }

    /// The local copy no longer matches what was written: kept, copied nowhere again.
    pub fn handle_local_altered(&mut self, file: &str, found: Seal) {
        if let Some(e) = self.files.get_mut(file) {
            e.altered = Some(found);
        }
    }

    /// The local copy is gone: deleted once safe, or lost when it was not.
    pub fn handle_deleted(&mut self, file: &str) {
        let required = self.required();
        let Some(e) = self.files.get_mut(file) else { return };
        if !e.deleted && e.safe_count() < required {
            self.lost.insert(file.to_string(), "the local copy disappeared before it was safe".into());
        }
        e.deleted = true;
    }

    /// Whether `file` is known with this seal and close time (not a new file of that name).
    pub fn knows(&self, file: &str, seal: Seal, closed_at: f64) -> bool {
        self.files.get(file).is_some_and(|e| e.seal == seal && e.closed_at == closed_at)
    }

    /// Whether the local copy of `file` may be deleted now.
    pub fn deletable(&self, file: &str) -> bool {
        self.cfg.delete_after.is_some() && self.state(file) == Some(FileState::Safe)
    }

    /// The next thing to do at `now`, if any; a copy is marked under way.
    pub fn poll_action(&mut self, now: Instant) -> Option<Action> {
        if let Some(file) = self.order.iter().find(|f| self.deletable(f)) {
            return Some(Action::Delete { file: file.clone() });
        }
        let under_way =
            self.files.values().flat_map(|e| &e.at).filter(|a| matches!(a, AtDestination::Copying { .. })).count();
        if under_way >= self.cfg.max_parallel {
            return None;
        }
        for file in &self.order {
            let e = self.files.get_mut(file).expect("ordered files are in custody");
            if e.deleted || e.altered.is_some() {
                continue;
            }
            for (dest, a) in e.at.iter_mut().enumerate() {
                if let AtDestination::Pending { attempts, after } = *a
                    && after <= now
                {
                    *a = AtDestination::Copying { attempts };
                    return Some(Action::Copy { file: file.clone(), dest });
                }
            }
        }
        None
    }

    /// When a copy waiting out its back-off may go (none: nothing waits).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.files
            .values()
            .filter(|e| !e.deleted && e.altered.is_none())
            .flat_map(|e| &e.at)
            .filter_map(|a| match a {
                AtDestination::Pending { after, .. } => Some(*after),
                _ => None,
            })
            .min()
    }

    /// Nothing left to do: every file safe everywhere, deleted where it should be, or
    /// quarantined.
    pub fn is_settled(&self) -> bool {
        self.files.iter().all(|(f, e)| {
            let state = e.state(self.required());
            matches!(state, FileState::Quarantined(_) | FileState::Deleted)
                || (state == FileState::Safe && !self.deletable(f))
        })
    }

    /// The runs of the files in custody.
    pub fn runs(&self) -> std::collections::BTreeSet<u64> {
        self.files.values().map(|e| e.run).collect()
    }

    /// The ledger over every file, or over one run's.
    pub fn ledger(&self, run: Option<u64>) -> ArchiveLedger {
        let mut l = ArchiveLedger::default();
        for (file, e) in self.files() {
            if run.is_some_and(|r| r != e.run) {
                continue;
            }
            l.files += 1;
            l.bytes_written += e.seal.bytes;
            match e.state(self.required()) {
                FileState::Safe | FileState::Deleted if e.safe_count() >= self.required() => {
                    l.files_safe += 1;
                    l.bytes_safe += e.seal.bytes;
                    l.files_deleted += u64::from(e.deleted);
                }
                FileState::Quarantined(reason) => {
                    l.files_quarantined += 1;
                    l.bytes_quarantined += e.seal.bytes;
                    l.quarantined.push((file.clone(), reason));
                }
                _ if self.lost.contains_key(file) => {
                    l.bytes_lost += e.seal.bytes;
                    l.lost.push((file.clone(), self.lost[file].clone()));
                }
                _ => {
                    l.files_pending += 1;
                    l.bytes_pending += e.seal.bytes;
                    l.oldest_pending_closed_at =
                        Some(l.oldest_pending_closed_at.map_or(e.closed_at, |t: f64| t.min(e.closed_at)));
                }
            }
        }
        l
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SEAL: Seal = Seal { bytes: 1000, adler32: 0xabcd_0123 };

    fn t(s: u64) -> Instant {
        Instant::from_nanos(s * 1_000_000_000)
    }

    fn custody(destinations: usize, delete_after: Option<usize>) -> Custody {
        Custody::new(CustodyConfig { destinations, delete_after, max_parallel: 8, ..Default::default() })
    }

    #[test]
    fn files_go_in_close_order_and_are_deleted_only_once_safe_where_they_must_be() {
        let mut c = custody(2, Some(2));
        c.handle_closed("a", 1, SEAL, 10.0, t(0));
        c.handle_closed("b", 1, SEAL, 11.0, t(0));
        let copies: Vec<_> = std::iter::from_fn(|| c.poll_action(t(0))).collect();
        assert_eq!(
            copies,
            [("a", 0), ("a", 1), ("b", 0), ("b", 1)].map(|(f, dest)| Action::Copy { file: f.into(), dest }).to_vec()
        );
        assert_eq!(c.state("a").unwrap(), FileState::Copying);
        c.handle_copied("a", 0, SEAL, Some(SEAL), t(1), 0.0);
        assert!(!c.deletable("a"), "safe at one of two");
        assert_eq!(c.poll_action(t(1)), None);
        assert_eq!(
            c.handle_copied("a", 1, SEAL, Some(SEAL), t(1), 0.0),
            Record::Safe { file: "a".into(), dest: 1, at: 0.0 }
        );
        assert_eq!(c.state("a").unwrap(), FileState::Safe);
        assert_eq!(c.poll_action(t(1)), Some(Action::Delete { file: "a".into() }));
        c.handle_deleted("a");
        let l = c.ledger(None);
        assert_eq!((l.bytes_written, l.bytes_safe, l.bytes_pending, l.files_deleted), (2000, 1000, 1000, 1));
        assert_eq!(l.oldest_pending_closed_at, Some(11.0));
        assert!(l.balanced());
    }

    #[test]
    fn a_mismatch_is_retried_with_back_off_then_quarantined() {
        let mut c = custody(1, Some(1));
        c.handle_closed("a", 1, SEAL, 0.0, t(0));
        let bad = Seal { adler32: 1, ..SEAL };
        let mut now = t(0);
        for attempt in 1..=5 {
            assert_eq!(c.poll_action(now), Some(Action::Copy { file: "a".into(), dest: 0 }), "attempt {attempt}");
            let r = c.handle_copied("a", 0, SEAL, Some(bad), now, 0.0);
            assert!(matches!(r, Record::Refused { ref reason, .. } if reason.contains("mismatch")), "{r:?}");
            if attempt < 5 {
                assert_eq!(c.poll_action(now), None, "waits out its back-off");
                let after = c.poll_timeout().unwrap();
                assert_eq!(after.saturating_duration_since(now), Duration::from_secs(1 << (attempt - 1)));
                now = after;
            }
        }
        assert!(matches!(c.state("a").unwrap(), FileState::Quarantined(r) if r.contains("5 attempts")));
        assert_eq!(c.poll_action(now + Duration::from_secs(3600)), None);
        assert!(!c.deletable("a"));
        let l = c.ledger(Some(1));
        assert_eq!((l.files_quarantined, l.bytes_quarantined), (1, 1000));
        assert!(l.balanced() && c.is_settled());
    }

    #[test]
    fn a_local_copy_altered_after_close_is_kept_and_never_copied_again() {
        let mut c = custody(1, Some(1));
        c.handle_closed("a", 1, SEAL, 0.0, t(0));
        c.poll_action(t(0));
        let found = Seal { adler32: 7, ..SEAL };
        assert!(matches!(c.handle_copied("a", 0, found, Some(found), t(0), 0.0), Record::LocalAltered { .. }));
        assert!(matches!(c.state("a").unwrap(), FileState::Quarantined(r) if r.contains("altered")));
        assert_eq!(c.poll_action(t(100)), None);
        assert!(!c.deletable("a"));
    }

    #[test]
    fn without_delete_after_nothing_is_ever_deleted_and_a_file_gone_early_is_lost() {
        let mut c = custody(1, None);
        c.handle_closed("a", 1, SEAL, 0.0, t(0));
        c.handle_closed("b", 2, SEAL, 0.0, t(0));
        c.poll_action(t(0));
        c.handle_copied("a", 0, SEAL, Some(SEAL), t(0), 0.0);
        assert!(!c.deletable("a"));
        assert_eq!(c.poll_action(t(0)), Some(Action::Copy { file: "b".into(), dest: 0 }));
        c.handle_refused("b", 0, "connection refused", t(0));
        c.handle_deleted("b");
        let l = c.ledger(None);
        assert_eq!((l.bytes_safe, l.bytes_lost), (1000, 1000));
        assert_eq!(l.lost[0].0, "b");
        assert!(l.balanced());
        assert_eq!(c.ledger(Some(1)).bytes_written, 1000);
    }

    #[test]
    fn a_copy_under_way_at_a_crash_is_tried_again_after_replay() {
        let records = [
            Record::Closed { file: "a".into(), run: 1, seal: SEAL, closed_at: 0.0 },
            Record::Closed { file: "b".into(), run: 1, seal: SEAL, closed_at: 1.0 },
            Record::Copying { file: "a".into(), dest: 0 },
            Record::Safe { file: "a".into(), dest: 0, at: 2.0 },
            Record::Copying { file: "b".into(), dest: 0 },
        ];
        let mut c = custody(1, Some(1));
        for r in &records {
            c.replay(r, t(50));
        }
        assert_eq!(c.poll_action(t(50)), Some(Action::Delete { file: "a".into() }));
        c.handle_deleted("a");
        assert_eq!(c.poll_action(t(50)), Some(Action::Copy { file: "b".into(), dest: 0 }));
    }

    #[test]
    fn a_new_file_under_a_used_name_starts_over() {
        let mut c = custody(1, None);
        c.handle_closed("a", 1, SEAL, 1.0, t(0));
        c.poll_action(t(0));
        c.handle_copied("a", 0, SEAL, Some(SEAL), t(0), 0.0);
        c.handle_closed("a", 1, SEAL, 1.0, t(1));
        assert_eq!(c.state("a"), Some(FileState::Safe), "the same file seen again");
        let other = Seal { bytes: 5, adler32: 5 };
        c.handle_closed("a", 1, other, 2.0, t(1));
        assert_eq!(c.state("a"), Some(FileState::Written));
        assert_eq!(c.poll_action(t(1)), Some(Action::Copy { file: "a".into(), dest: 0 }));
        assert_eq!(c.ledger(None).bytes_written, 5);
    }

    #[test]
    fn a_released_file_is_tried_again_from_the_start() {
        let mut c = Custody::new(CustodyConfig { max_attempts: 1, ..CustodyConfig::default() });
        c.handle_closed("a", 1, SEAL, 0.0, t(0));
        c.poll_action(t(0));
        c.handle_refused("a", 0, "permission denied", t(0));
        assert!(matches!(c.state("a"), Some(FileState::Quarantined(_))));
        assert!(!c.handle_released("b", t(1)));
        assert!(c.handle_released("a", t(1)));
        assert_eq!(c.poll_action(t(1)), Some(Action::Copy { file: "a".into(), dest: 0 }));
        c.handle_copied("a", 0, SEAL, Some(SEAL), t(1), 0.0);
        assert_eq!(c.state("a"), Some(FileState::Safe));
        assert!(!c.handle_released("a", t(2)), "nothing to release");
    }

    #[derive(Clone, Debug)]
    enum Step {
        Close,
        Poll,
        Good(usize),
        Bad(usize),
        Fail(usize),
        Wait(u64),
        Crash,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            Just(Step::Close),
            Just(Step::Poll),
            Just(Step::Poll),
            (0..8usize).prop_map(Step::Good),
            (0..8usize).prop_map(Step::Bad),
            (0..8usize).prop_map(Step::Fail),
            (1..100u64).prop_map(Step::Wait),
            Just(Step::Crash),
        ]
    }

    proptest! {
        /// Whatever copies succeed, fail or mismatch, and wherever the archiver crashes
        /// (its state rebuilt from the journal), no file is deleted before it is safe at
        /// `delete_after` destinations, the ledger balances, and a crash loses nothing.
        #[test]
        fn nothing_is_deleted_before_it_is_safe_and_the_ledger_balances(
            steps in prop::collection::vec(step(), 1..200),
            destinations in 1..3usize,
            delete_after in prop::option::of(1..3usize),
        ) {
            let cfg = CustodyConfig { destinations, delete_after, max_parallel: 3, ..Default::default() };
            let mut c = Custody::new(cfg.clone());
            let mut journal: Vec<Record> = Vec::new();
            let mut now = t(0);
            let mut closed = 0;
            let mut under_way: Vec<(String, usize)> = Vec::new();
            for s in steps {
                match s {
                    Step::Close => {
                        let file = format!("f{closed}");
                        closed += 1;
                        c.handle_closed(&file, 1, SEAL, 0.0, now);
                        journal.push(Record::Closed { file, run: 1, seal: SEAL, closed_at: 0.0 });
                    }
                    Step::Poll => match c.poll_action(now) {
                        Some(Action::Copy { file, dest }) => {
                            journal.push(Record::Copying { file: file.clone(), dest });
                            under_way.push((file, dest));
                        }
                        Some(Action::Delete { file }) => {
                            let e = c.entry(&file).unwrap();
                            prop_assert!(e.safe_count() >= delete_after.unwrap().min(destinations));
                            prop_assert!(e.at.iter().all(|a| matches!(a, AtDestination::Safe | AtDestination::Quarantined(_))));
                            c.handle_deleted(&file);
                            journal.push(Record::Deleted { file, at: 0.0 });
                        }
                        None => {}
                    },
                    Step::Good(i) | Step::Bad(i) | Step::Fail(i) if i < under_way.len() => {
                        let (file, dest) = under_way.remove(i);
                        let r = match s {
                            Step::Good(_) => c.handle_copied(&file, dest, SEAL, Some(SEAL), now, 0.0),
                            Step::Bad(_) => c.handle_copied(&file, dest, SEAL, Some(Seal { bytes: 1, adler32: 1 }), now, 0.0),
                            _ => {
                                c.handle_refused(&file, dest, "down", now);
                                Record::Refused { file, dest, reason: "down".into(), at: 0.0 }
                            }
                        };
                        journal.push(r);
                    }
                    Step::Good(_) | Step::Bad(_) | Step::Fail(_) => {}
                    Step::Wait(s) => now += Duration::from_secs(s),
                    Step::Crash => {
                        c = Custody::new(cfg.clone());
                        for r in &journal {
                            c.replay(r, now);
                        }
                        under_way.clear();
                    }
                }
                let l = c.ledger(None);
                prop_assert!(l.balanced(), "{l:?}");
                prop_assert_eq!(l.files, closed);
                prop_assert_eq!(l.bytes_lost, 0);
            }
        }
    }
}
