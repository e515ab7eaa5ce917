//! The burst saver: every builder keeps the raw slices it built over the last seconds, so
//! that an external alert arriving 10-30 s after the fact (a gamma-ray-burst notice) still
//! finds the data of its window unfiltered; and the late-data side stream, which keeps
//! fragments that arrived after their slice was processed instead of only dropping them.
//!
//! [`BurstSaver`] decides what is kept, evicted and saved; it holds the fragments' data
//! (`T`, shared buffers in the runtime) but writes nothing itself. Its driver (the builder
//! process) feeds every processed slice ([`BurstSaver::handle_slice`]), every late
//! fragment ([`BurstSaver::handle_late`]) and every alert ([`BurstSaver::handle_alert`]),
//! and drains [`BurstSaver::poll_output`]: alert openings, fragments to save (to local disk
//! first, then to the writer) and alert reports. It reports bytes written to disk back with
//! [`BurstSaver::handle_spooled`], which bounds what waits in memory.
//!
//! The history is bounded twice: by age in slice time (slices older than
//! [`SaverConfig::history`] before the newest one are evicted) and by bytes
//! ([`SaverConfig::max_bytes`], oldest first). The byte bound covers what the saver keeps
//! alive, not only the history: fragments handed out to save and not yet on disk count
//! too once their slice left the history, so a slow disk during an alert shortens the
//! history instead of growing memory. Every eviction is counted. An alert saves the
//! held slices that overlap its window, then every slice of the window built afterwards,
//! and closes when the builder has processed a slice starting at or after the window's end
//! (slices are processed in order, so nothing of the window can follow), at
//! [`SaverConfig::close_grace`] after the window's end at the latest, or at the end of the
//! run. Its [`AlertReport`] says what was saved and whether part of the window had already
//! been evicted.

use std::collections::VecDeque;

use crate::assembly::SliceOutcome;
use crate::slice::{SliceClock, SliceNumber};
use crate::{Duration, Instant, SourceId};

pub use crate::alert::Alert;

/// Number of an alert within one builder's run (1, 2, ...). 0 marks the late stream.
pub type AlertId = u32;

/// The burst saver's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SaverConfig {
    /// How much slice time is kept (default 30 s: alerts come 10-30 s after the fact).
    pub history: Duration,
    /// Most bytes (on the wire) held in the history; oldest slices go first.
    pub max_bytes: u64,
    /// Most bytes of late fragments and saved fragments waiting for the disk; late
    /// fragments beyond it are dropped (counted), saved ones never are.
    pub max_pending_bytes: u64,
    /// An open alert closes this long after its window's end at the latest, even if the
    /// builder processed no later slice (a builder that sees no more slices).
    pub close_grace: Duration,
    /// Keep late fragments (the late-data side stream).
    pub salvage_late: bool,
}

impl SaverConfig {
    /// 30 s of history in at most 384 MiB. An ANTARES builder sees about 9 MB/s: 30 s are
    /// 270 MB, and the rest leaves room for bioluminescence bursts (fragments 6x larger for
    /// up to 3 s) without cutting the history short.
    pub const DEFAULT: SaverConfig = SaverConfig {
        history: Duration::from_secs(30),
        max_bytes: 384 << 20,
        max_pending_bytes: 64 << 20,
        close_grace: Duration::from_secs(5),
        salvage_late: true,
    };
}

impl Default for SaverConfig {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Which stream a saved fragment belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Record {
    /// The window of alert `AlertId`.
    Alert(AlertId),
    /// The late-data side stream.
    Late,
}

impl Record {
    /// 0 for the late stream, the alert's number otherwise (the wire's record field).
    pub fn number(self) -> u32 {
        match self {
            Record::Alert(id) => id,
            Record::Late => 0,
        }
    }
}

/// What one builder saved for one alert (also its `ALERT_RE` reply).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct AlertReport {
    pub builder: u32,
    pub id: AlertId,
    pub name: String,
    pub origin: String,
    pub from_ns: u64,
    pub to_ns: u64,
    /// The slices the window spans (first and last, inclusive).
    pub first_slice: SliceNumber,
    pub last_slice: SliceNumber,
    /// The oldest slice this builder still held when the alert came (None: none held).
    pub oldest_held: Option<SliceNumber>,
    /// Part of the window had been evicted (or built before this builder kept history)
    /// before the alert came: what was saved starts later than the window.
    pub partly_evicted: bool,
    /// The window's slices up to this one had been evicted before the alert came.
    pub evicted_through: Option<SliceNumber>,
    pub slices_saved: u64,
    pub incomplete_slices_saved: u64,
    pub fragments_saved: u64,
    pub bytes_saved: u64,
    /// Why it closed: `window_passed`, `grace_expired` or `end_of_run`.
    pub closed_by: String,
}

impl AlertReport {
    /// One line for logs and `shoal alert`.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "builder {}: alert {} saved {} slices ({} incomplete), {} fragments, {} bytes of slices {}-{}",
            self.builder,
            self.name,
            self.slices_saved,
            self.incomplete_slices_saved,
            self.fragments_saved,
            self.bytes_saved,
            self.first_slice,
            self.last_slice
        );
        if self.partly_evicted {
            s.push_str(&format!(
                "; the window's slices up to {} were already evicted (oldest held: {})",
                self.evicted_through.unwrap_or_default(),
                self.oldest_held.map_or("none".to_string(), |s| s.to_string())
            ));
        }
        s
    }
}

/// What the driver must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SaverOutput<T> {
    /// A new alert: what follows for `id` belongs to it.
    Opened { id: AlertId, alert: Alert },
    /// A fragment to save (to disk, then to the writer). `bytes` count against the pending
    /// bound until [`BurstSaver::handle_spooled`].
    Fragment { record: Record, slice: SliceNumber, source: SourceId, bytes: u64, data: T },
    /// An alert is complete: ship what was saved for it.
    Closed(AlertReport),
}

/// Counters of the saver (cumulative over the run).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SaverStats {
    /// Held now.
    pub held_slices: u64,
    pub held_bytes: u64,
    /// Most bytes held at once.
    pub held_bytes_max: u64,
    pub slices_kept: u64,
    pub evicted_for_age: u64,
    pub evicted_for_bytes: u64,
    pub evicted_bytes: u64,
    pub alerts: u64,
    pub alerts_partly_evicted: u64,
    /// Late fragments kept in the side stream, and dropped because the pending bound was
    /// full (those stay counted `late` in the ledger).
    pub late_salvaged: u64,
    pub late_salvage_refused: u64,
    /// Fragments and bytes handed out to save (alerts and late stream).
    pub fragments_out: u64,
    pub bytes_out: u64,
    /// Handed out and not yet reported written.
    pub pending_bytes: u64,
    /// Of those: late fragments, and saved fragments whose slice was evicted from the
    /// history meanwhile (memory the history no longer accounts for).
    pub pending_late_bytes: u64,
    pub pending_evicted_bytes: u64,
}

#[derive(Clone, Debug)]
struct HeldFragment<T> {
    source: SourceId,
    bytes: u64,
    data: T,
}

#[derive(Clone, Debug)]
struct HeldSlice<T> {
    slice: SliceNumber,
    complete: bool,
    bytes: u64,
    fragments: Vec<HeldFragment<T>>,
}

#[derive(Clone, Debug)]
struct OpenAlert {
    report: AlertReport,
    /// The window's end as a slice bound: slices below it belong to the window.
    end_slice: SliceNumber,
    deadline: Instant,
}

/// See the [module documentation](self).
#[derive(Debug)]
pub struct BurstSaver<T> {
    cfg: SaverConfig,
    builder: u32,
    clock: SliceClock,
    held: VecDeque<HeldSlice<T>>,
    /// The newest slice this builder evicted: slices up to it are gone.
    last_evicted: Option<SliceNumber>,
    next_id: AlertId,
    open: Vec<OpenAlert>,
    out: VecDeque<SaverOutput<T>>,
    stats: SaverStats,
    /// Fragments handed out, in order (the driver reports them written in that order).
    pending: VecDeque<Pending>,
    /// Saved bytes not yet written, by slice (to know what an eviction leaves alive).
    pending_by_slice: std::collections::BTreeMap<SliceNumber, u64>,
}

#[derive(Clone, Copy, Debug)]
struct Pending {
    slice: SliceNumber,
    bytes: u64,
    late: bool,
}

impl<T: Clone> BurstSaver<T> {
    pub fn new(cfg: SaverConfig, builder: u32, clock: SliceClock) -> Self {
        Self {
            cfg,
            builder,
            clock,
            held: VecDeque::new(),
            last_evicted: None,
            next_id: 1,
            open: Vec::new(),
            out: VecDeque::new(),
            stats: SaverStats::default(),
            pending: VecDeque::new(),
            pending_by_slice: std::collections::BTreeMap::new(),
        }
    }

    pub fn config(&self) -> &SaverConfig {
        &self.cfg
    }

    /// A processed slice (complete or not), in processing order. Its fragments' data are
    /// kept (`T` is cloned: shared buffers in the runtime, no copy) besides going to the
    /// filter. The history counts their payload bytes; what a shared buffer keeps alive
    /// beyond them is the runtime's to bound (its frame decoder hands out frames owning
    /// buffers of about their size).
    pub fn handle_slice(&mut self, now: Instant, outcome: &SliceOutcome<T>) {
        let fragments: Vec<HeldFragment<T>> = outcome
            .fragments
            .iter()
            .filter(|f| !f.cut_off)
            .map(|f| HeldFragment { source: f.source, bytes: f.bytes, data: f.data.clone() })
            .collect();
        let slice = HeldSlice {
            slice: outcome.slice,
            complete: outcome.is_complete(),
            bytes: fragments.iter().map(|f| f.bytes).sum(),
            fragments,
        };
        // Open alerts take what belongs to their window now.
        for i in 0..self.open.len() {
            let a = &self.open[i];
            if slice.slice >= a.report.first_slice && slice.slice < a.end_slice {
                let id = a.report.id;
                self.save(i, id, &slice);
            }
        }
        self.stats.slices_kept += 1;
        self.stats.held_bytes += slice.bytes;
        let newest_start = self.clock.start_of(slice.slice);
        self.held.push_back(slice);
        self.evict(newest_start);
        self.stats.held_bytes_max = self.stats.held_bytes_max.max(self.stats.held_bytes);
        // Nothing of a window can follow a slice at or past its end.
        let processed = outcome.slice;
        self.close_where(|a| processed >= a.end_slice, "window_passed");
        self.handle_timeout(now);
    }

    /// A fragment that arrived after its slice was processed. Returns whether the late
    /// stream kept it (otherwise it stays a plain `late` loss).
    pub fn handle_late(&mut self, source: SourceId, slice: SliceNumber, bytes: u64, data: T) -> bool {
        if !self.cfg.salvage_late || self.stats.pending_late_bytes + bytes > self.cfg.max_pending_bytes {
            self.stats.late_salvage_refused += 1;
            return false;
        }
        self.stats.late_salvaged += 1;
        self.emit(Record::Late, slice, source, bytes, data);
        true
    }

    /// An external alert: saves the held slices of its window and opens it for the slices
    /// still to come. Returns its number.
    pub fn handle_alert(&mut self, now: Instant, alert: Alert) -> AlertId {
        let id = self.next_id;
        self.next_id += 1;
        self.stats.alerts += 1;
        let first_slice = self.clock.slice_at(alert.from);
        // `to` is exclusive: a window ending exactly on a slice boundary stops before it.
        let end_slice = self.clock.slice_at(Instant::from_nanos(alert.to.as_nanos().saturating_sub(1))) + 1;
        let evicted_through = self.last_evicted.filter(|&e| e >= first_slice).map(|e| e.min(end_slice - 1));
        let oldest_held = self.held.front().map(|s| s.slice);
        let report = AlertReport {
            builder: self.builder,
            id,
            name: alert.name.clone(),
            origin: alert.origin.clone(),
            from_ns: alert.from.as_nanos(),
            to_ns: alert.to.as_nanos(),
            first_slice,
            last_slice: end_slice - 1,
            oldest_held,
            partly_evicted: evicted_through.is_some(),
            evicted_through,
            ..Default::default()
        };
        if report.partly_evicted {
            self.stats.alerts_partly_evicted += 1;
        }
        let deadline = alert.to + self.cfg.close_grace;
        self.out.push_back(SaverOutput::Opened { id, alert });
        self.open.push(OpenAlert { report, end_slice, deadline });
        let i = self.open.len() - 1;
        let held: Vec<HeldSlice<T>> =
            self.held.iter().filter(|s| s.slice >= first_slice && s.slice < end_slice).cloned().collect();
        for s in &held {
            self.save(i, id, s);
        }
        // A window this builder is already past closes at once.
        let past = self.held.back().is_some_and(|s| s.slice >= end_slice);
        if past {
            self.close_where(|a| a.report.id == id, "window_passed");
        }
        self.handle_timeout(now);
        id
    }

    /// Closes alerts whose grace time has passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.close_where(|a| now >= a.deadline, "grace_expired");
    }

    /// When [`BurstSaver::handle_timeout`] must be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.open.iter().map(|a| a.deadline).min()
    }

    /// End of run: every open alert closes with what it has.
    pub fn handle_end(&mut self) {
        self.close_where(|_| true, "end_of_run");
    }

    /// The next fragment handed out (in output order) is on disk, or was refused: it no
    /// longer takes memory. `bytes` is what [`SaverOutput::Fragment`] said.
    pub fn handle_spooled(&mut self, bytes: u64) {
        self.stats.pending_bytes = self.stats.pending_bytes.saturating_sub(bytes);
        let Some(p) = self.pending.pop_front() else { return };
        if p.late {
            self.stats.pending_late_bytes = self.stats.pending_late_bytes.saturating_sub(p.bytes);
            return;
        }
        if let std::collections::btree_map::Entry::Occupied(mut e) = self.pending_by_slice.entry(p.slice) {
            *e.get_mut() = e.get().saturating_sub(p.bytes);
            if *e.get() == 0 {
                e.remove();
            }
        }
        if self.last_evicted.is_some_and(|l| p.slice <= l) {
            self.stats.pending_evicted_bytes = self.stats.pending_evicted_bytes.saturating_sub(p.bytes);
        }
    }

    pub fn poll_output(&mut self) -> Option<SaverOutput<T>> {
        self.out.pop_front()
    }

    pub fn open_alerts(&self) -> usize {
        self.open.len()
    }

    /// Bytes the saver keeps alive: the history plus what waits for the disk.
    pub fn memory_in_use(&self) -> u64 {
        self.stats.held_bytes + self.stats.pending_late_bytes + self.stats.pending_evicted_bytes
    }

    pub fn stats(&self) -> SaverStats {
        let mut s = self.stats.clone();
        s.held_slices = self.held.len() as u64;
        s
    }

    fn save(&mut self, open_index: usize, id: AlertId, slice: &HeldSlice<T>) {
        let r = &mut self.open[open_index].report;
        r.slices_saved += 1;
        r.incomplete_slices_saved += u64::from(!slice.complete);
        r.fragments_saved += slice.fragments.len() as u64;
        r.bytes_saved += slice.bytes;
        for f in &slice.fragments {
            self.emit(Record::Alert(id), slice.slice, f.source, f.bytes, f.data.clone());
        }
    }

    fn emit(&mut self, record: Record, slice: SliceNumber, source: SourceId, bytes: u64, data: T) {
        self.stats.fragments_out += 1;
        self.stats.bytes_out += bytes;
        self.stats.pending_bytes += bytes;
        let late = record == Record::Late;
        self.pending.push_back(Pending { slice, bytes, late });
        if late {
            self.stats.pending_late_bytes += bytes;
        } else {
            *self.pending_by_slice.entry(slice).or_default() += bytes;
        }
        self.out.push_back(SaverOutput::Fragment { record, slice, source, bytes, data });
    }

    fn evict(&mut self, newest_start: Instant) {
        let horizon = newest_start.as_nanos().saturating_sub(self.cfg.history.as_nanos() as u64);
        while let Some(oldest) = self.held.front() {
            let too_old = self.clock.end_of(oldest.slice).as_nanos() <= horizon;
            let too_big = self.memory_in_use() > self.cfg.max_bytes;
            if !too_old && !too_big {
                return;
            }
            let s = self.held.pop_front().expect("front exists");
            if too_old {
                self.stats.evicted_for_age += 1;
            } else {
                self.stats.evicted_for_bytes += 1;
            }
            self.stats.evicted_bytes += s.bytes;
            self.stats.held_bytes -= s.bytes;
            self.last_evicted = Some(s.slice);
            // Saved fragments of this slice not yet on disk stay alive outside the history.
            self.stats.pending_evicted_bytes += self.pending_by_slice.get(&s.slice).copied().unwrap_or(0);
        }
    }

    fn close_where(&mut self, mut done: impl FnMut(&OpenAlert) -> bool, why: &str) {
        let mut i = 0;
        while i < self.open.len() {
            if done(&self.open[i]) {
                let mut a = self.open.remove(i);
                a.report.closed_by = why.to_string();
                self.out.push_back(SaverOutput::Closed(a.report));
            } else {
                i += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assembly::{EmitReason, Fragment};

    const SLICE_MS: u64 = 100;

    fn clock() -> SliceClock {
        SliceClock::new(Duration::from_millis(SLICE_MS))
    }

    fn at_ms(ms: u64) -> Instant {
        Instant::from_nanos(ms * 1_000_000)
    }

    /// Slice `n` from `sources` sources, each fragment `bytes` long carrying (slice, source).
    fn outcome(n: SliceNumber, sources: u32, bytes: u64) -> SliceOutcome<(u64, u32)> {
        SliceOutcome {
            slice: n,
            reason: EmitReason::Complete,
            fragments: (0..sources)
                .map(|s| Fragment { source: s, bytes, cut_off: false, recovered: false, data: (n, s) })
                .collect(),
            missing: vec![],
            dropped: vec![],
            first_arrival: Instant::ZERO,
            bytes: bytes * u64::from(sources),
        }
    }

    fn saver(cfg: SaverConfig) -> BurstSaver<(u64, u32)> {
        BurstSaver::new(cfg, 7, clock())
    }

    fn drain(s: &mut BurstSaver<(u64, u32)>) -> (Vec<(Record, u64, u32)>, Vec<AlertReport>) {
        let (mut frags, mut reports) = (vec![], vec![]);
        while let Some(o) = s.poll_output() {
            match o {
                SaverOutput::Fragment { record, slice, source, data, .. } => {
                    assert_eq!(data, (slice, source));
                    frags.push((record, slice, source));
                }
                SaverOutput::Closed(r) => reports.push(r),
                SaverOutput::Opened { .. } => {}
            }
        }
        (frags, reports)
    }

    #[test]
    fn an_alert_after_the_fact_saves_the_held_window_and_what_follows() {
        let mut s = saver(SaverConfig { history: Duration::from_secs(30), ..SaverConfig::DEFAULT });
        for n in 0..200 {
            s.handle_slice(at_ms(n * SLICE_MS + 150), &outcome(n, 3, 10));
        }
        // Slices 100..=250 (10.0 s to 25.1 s); slices up to 199 are held.
        let alert = Alert::new("GRB", at_ms(10_000), at_ms(25_050), "test").unwrap();
        let id = s.handle_alert(at_ms(20_000), alert);
        let (frags, reports) = drain(&mut s);
        assert!(reports.is_empty(), "the window is still open");
        assert_eq!(frags.len(), 100 * 3);
        assert!(frags.iter().all(|f| f.0 == Record::Alert(id) && (100..200).contains(&f.1)));
        for n in 200..260 {
            s.handle_slice(at_ms(n * SLICE_MS + 150), &outcome(n, 3, 10));
        }
        let (frags, reports) = drain(&mut s);
        assert_eq!(frags.len(), 51 * 3, "slices 200..=250 as they were built");
        let r = &reports[0];
        assert_eq!((r.first_slice, r.last_slice, r.slices_saved, r.fragments_saved), (100, 250, 151, 453));
        assert_eq!((r.partly_evicted, r.closed_by.as_str()), (false, "window_passed"));
        assert_eq!(s.open_alerts(), 0);
    }

    #[test]
    fn history_is_bounded_by_age_and_bytes_and_says_what_was_evicted() {
        let mut s = saver(SaverConfig { history: Duration::from_secs(2), max_bytes: 1_000, ..SaverConfig::DEFAULT });
        for n in 0..100 {
            s.handle_slice(at_ms(n * SLICE_MS + 150), &outcome(n, 2, 10));
            assert!(s.stats().held_bytes <= 1_000);
        }
        // 2 s of 100 ms slices, 20 bytes each: age is the bound (20 or 21 slices held).
        let st = s.stats();
        assert!((20..=21).contains(&st.held_slices), "{st:?}");
        assert_eq!(st.evicted_for_age + st.held_slices, 100);
        for n in 100..200 {
            s.handle_slice(at_ms(n * SLICE_MS + 150), &outcome(n, 10, 10));
        }
        let st = s.stats();
        assert_eq!((st.held_slices, st.held_bytes), (10, 1_000), "bytes are the bound at 100 bytes a slice");
        assert!(st.evicted_for_bytes > 0);
        let id = s.handle_alert(at_ms(20_000), Alert::new("old", at_ms(18_000), at_ms(19_500), "t").unwrap());
        let (frags, reports) = drain(&mut s);
        let r = &reports[0];
        assert_eq!(r.id, id);
        assert!(r.partly_evicted);
        assert_eq!((r.evicted_through, r.oldest_held), (Some(189), Some(190)));
        assert_eq!(r.slices_saved, 5, "190..=194 were still held");
        assert_eq!(frags.len(), 50);
        assert_eq!(r.closed_by, "window_passed");
        assert!(r.describe().contains("already evicted"));
    }

    #[test]
    fn late_fragments_are_kept_within_the_pending_bound() {
        let mut s = saver(SaverConfig { max_pending_bytes: 25, ..SaverConfig::DEFAULT });
        assert!(s.handle_late(1, 5, 10, (5, 1)));
        assert!(s.handle_late(2, 5, 10, (5, 2)));
        assert!(!s.handle_late(3, 5, 10, (5, 3)), "over the pending bound");
        s.handle_spooled(10);
        s.handle_spooled(10);
        assert!(s.handle_late(3, 5, 10, (5, 3)));
        let (frags, _) = drain(&mut s);
        assert_eq!(frags, vec![(Record::Late, 5, 1), (Record::Late, 5, 2), (Record::Late, 5, 3)]);
        let st = s.stats();
        assert_eq!((st.late_salvaged, st.late_salvage_refused, st.pending_bytes), (3, 1, 10));
        let mut off = saver(SaverConfig { salvage_late: false, ..SaverConfig::DEFAULT });
        assert!(!off.handle_late(1, 5, 10, (5, 1)));
    }

    #[test]
    fn saved_data_waiting_for_the_disk_count_against_the_bound() {
        let mut s = saver(SaverConfig { max_bytes: 1_000, ..SaverConfig::DEFAULT });
        for n in 0..10 {
            s.handle_slice(at_ms(n * SLICE_MS + 150), &outcome(n, 10, 10));
        }
        // An alert saves the 10 held slices (1,000 bytes); the disk has written none yet.
        s.handle_alert(at_ms(2_000), Alert::new("a", at_ms(0), at_ms(1_000), "t").unwrap());
        let (frags, _) = drain(&mut s);
        assert_eq!(frags.len(), 100);
        assert_eq!(s.memory_in_use(), 1_000, "shared with the history: counted once");
        // New slices evict the saved ones, which stay alive until written: the history
        // shrinks so that what the saver keeps alive stays within the bound.
        for n in 10..15 {
            s.handle_slice(at_ms(n * SLICE_MS + 150), &outcome(n, 10, 10));
            assert!(s.memory_in_use() <= 1_000, "{:?}", s.stats());
        }
        let st = s.stats();
        assert_eq!((st.pending_evicted_bytes, st.held_bytes), (1_000, 0));
        for _ in 0..100 {
            s.handle_spooled(10);
        }
        assert_eq!((s.stats().pending_bytes, s.stats().pending_evicted_bytes), (0, 0));
        for n in 15..25 {
            s.handle_slice(at_ms(n * SLICE_MS + 150), &outcome(n, 10, 10));
        }
        assert_eq!(s.stats().held_bytes, 1_000, "the history is back to its bound");
    }

    #[test]
    fn open_alerts_close_on_grace_or_at_the_end_and_overlap() {
        let mut s = saver(SaverConfig::DEFAULT);
        s.handle_slice(at_ms(150), &outcome(0, 1, 10));
        let a = s.handle_alert(at_ms(200), Alert::new("a", at_ms(0), at_ms(1_000), "t").unwrap());
        let b = s.handle_alert(at_ms(200), Alert::new("b", at_ms(50), at_ms(60_000), "t").unwrap());
        assert_eq!(s.poll_timeout(), Some(at_ms(6_000)));
        s.handle_timeout(at_ms(6_000));
        let (frags, reports) = drain(&mut s);
        assert_eq!(frags, vec![(Record::Alert(a), 0, 0), (Record::Alert(b), 0, 0)]);
        assert_eq!((reports[0].id, reports[0].closed_by.as_str()), (a, "grace_expired"));
        s.handle_end();
        let (_, reports) = drain(&mut s);
        assert_eq!((reports[0].id, reports[0].closed_by.as_str()), (b, "end_of_run"));
        assert_eq!(s.poll_timeout(), None);
    }
}
