//! The builder's slice assembler (domain.md section 5).
//!
//! [`SliceAssembler`] keeps the table of *active* slices (at least one fragment received,
//! not yet processed). It emits each slice exactly once and in slice order, as a
//! [`SliceOutcome`], when
//! - the oldest active slice has a fragment (or a drop marker) from every source;
//! - more than `max_active` slices are active (the slice-count timeout: the builder has no
//!   detector clock, but with round-robin assignment it sees one new slice per cycle);
//! - the oldest slice's first fragment arrived more than `wall_timeout` ago;
//! - or the run ends ([`SliceAssembler::handle_drain`]).
//!
//! Fragments for an already processed slice are discarded and counted as late. Above the
//! memory budget (bytes held here plus bytes handed downstream and not yet released) new
//! fragments are discarded as an emergency measure, counted, and their source is recorded
//! in the slice's `dropped` list so the slice is not held waiting for them.

use std::collections::{BTreeMap, VecDeque};

use crate::ledger::BuilderTally;
use crate::slice::SliceNumber;
use crate::{Duration, Instant, SourceId};

/// Assembler settings. Defaults follow the reference design.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AssemblerConfig {
    /// Number of sources; fragments are expected from source ids `0..n_sources`.
    pub n_sources: u32,
    /// Slice-count timeout: most active slices before the oldest is processed incomplete.
    pub max_active: usize,
    /// Wall-clock guard: most time between a slice's first fragment and its processing.
    pub wall_timeout: Duration,
    /// Emergency limit on bytes held (active slices plus unreleased downstream bytes).
    pub memory_budget: u64,
}

impl AssemblerConfig {
    pub fn new(n_sources: u32) -> Self {
        Self { n_sources, max_active: 5, wall_timeout: Duration::from_secs(2), memory_budget: 512 << 20 }
    }
}

/// Why a slice was processed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EmitReason {
    /// Every source delivered (or was dropped for overload).
    Complete,
    /// Too many active slices.
    SliceCountTimeout,
    /// The wall-clock guard expired.
    WallClockTimeout,
    /// End of run.
    Drained,
    /// Pull: the builder gave up the fragments it still missed (re-asks exhausted).
    Abandoned,
}

/// What happened to a fragment offered to the assembler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    Accepted,
    Late,
    Duplicate,
    UnknownSource,
    DroppedOverload,
}

/// One fragment inside a slice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fragment<T> {
    pub source: SourceId,
    pub bytes: u64,
    /// The fragment is a burst-cutoff marker (no data).
    pub cut_off: bool,
    /// It arrived only thanks to a retransmission (counted `recovered`, not `delivered`).
    pub recovered: bool,
    pub data: T,
}

/// A processed slice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceOutcome<T> {
    pub slice: SliceNumber,
    pub reason: EmitReason,
    /// Received fragments, in source order.
    pub fragments: Vec<Fragment<T>>,
    /// Sources that sent nothing for this slice.
    pub missing: Vec<SourceId>,
    /// Sources whose fragment was discarded for overload.
    pub dropped: Vec<SourceId>,
    pub first_arrival: Instant,
    pub bytes: u64,
}

impl<T> SliceOutcome<T> {
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty() && self.dropped.is_empty()
    }

    /// What the filter sees: the fragments' data in source order, without burst-cutoff
    /// markers (they carry no data; they only keep the slice from waiting for them).
    pub fn into_filter_input(self) -> Vec<T> {
        self.fragments.into_iter().filter(|f| !f.cut_off).map(|f| f.data).collect()
    }
}

/// Which sources a slice has heard from: one bit per source. A slice of a builder with
/// 10,000 sources takes 10,000 fragments; a bit test per fragment (and a word scan for the
/// missing ones) is what keeps that from costing a map lookup each.
#[derive(Debug)]
struct SourceSet {
    words: Vec<u64>,
}

impl SourceSet {
    fn new(n_sources: u32) -> Self {
        Self { words: vec![0; (n_sources as usize).div_ceil(64)] }
    }
    fn contains(&self, source: SourceId) -> bool {
        self.words.get(source as usize / 64).is_some_and(|w| w & (1 << (source % 64)) != 0)
    }
    /// Adds a source below `n_sources` (the assembler refuses the others before).
    fn insert(&mut self, source: SourceId) {
        self.words[source as usize / 64] |= 1 << (source % 64);
    }
    /// The sources below `n_sources` not in the set, in order.
    fn missing(&self, n_sources: u32) -> Vec<SourceId> {
        let mut out = Vec::new();
        for (i, &w) in self.words.iter().enumerate() {
            let mut absent = !w;
            while absent != 0 {
                let source = i as u32 * 64 + absent.trailing_zeros();
                if source >= n_sources {
                    break;
                }
                out.push(source);
                absent &= absent - 1;
            }
        }
        out
    }
}

#[derive(Debug)]
struct ActiveSlice<T> {
    /// In arrival order; put in source order when the slice is processed.
    fragments: Vec<Fragment<T>>,
    /// Sources with a fragment here or dropped for overload.
    heard: SourceSet,
    dropped: Vec<SourceId>,
    first_arrival: Instant,
    bytes: u64,
    /// Nothing more is expected (pull: re-asks exhausted): process it when it is oldest.
    given_up: bool,
}

impl<T> ActiveSlice<T> {
    fn new(first_arrival: Instant, n_sources: u32) -> Self {
        Self {
            fragments: Vec::new(),
            heard: SourceSet::new(n_sources),
            dropped: Vec::new(),
            first_arrival,
            bytes: 0,
            given_up: false,
        }
    }
    fn has(&self, source: SourceId) -> bool {
        self.heard.contains(source)
    }
    fn count(&self) -> usize {
        self.fragments.len() + self.dropped.len()
    }
}

/// The active-slice table. See the module documentation.
#[derive(Debug)]
pub struct SliceAssembler<T> {
    cfg: AssemblerConfig,
    active: BTreeMap<SliceNumber, ActiveSlice<T>>,
    /// Slices at or below this have been processed.
    last_emitted: Option<SliceNumber>,
    held_bytes: u64,
    downstream_bytes: u64,
    out: VecDeque<SliceOutcome<T>>,
    /// Frames received per known source (indexed by source id): counted on every
    /// fragment, so kept dense; the tally's map is built when it is asked for. Unknown
    /// sources are counted in `tally.received` itself.
    received: Vec<u64>,
    tally: BuilderTally,
}

impl<T> SliceAssembler<T> {
    pub fn new(cfg: AssemblerConfig) -> Self {
        Self {
            cfg,
            active: BTreeMap::new(),
            last_emitted: None,
            held_bytes: 0,
            downstream_bytes: 0,
            out: VecDeque::new(),
            received: vec![0; cfg.n_sources as usize],
            tally: BuilderTally::default(),
        }
    }

    pub fn config(&self) -> &AssemblerConfig {
        &self.cfg
    }

    /// Offers a received fragment.
    pub fn handle_fragment(
        &mut self,
        now: Instant,
        source: SourceId,
        slice: SliceNumber,
        bytes: u64,
        cut_off: bool,
        data: T,
    ) -> Admission {
        self.handle_fragment_recovered(now, source, slice, bytes, cut_off, false, data)
    }

    /// [`SliceAssembler::handle_fragment`] for a fragment that may have needed a
    /// retransmission (`recovered`: counted apart when its slice is processed).
    #[allow(clippy::too_many_arguments)]
    pub fn handle_fragment_recovered(
        &mut self,
        now: Instant,
        source: SourceId,
        slice: SliceNumber,
        bytes: u64,
        cut_off: bool,
        recovered: bool,
        data: T,
    ) -> Admission {
        self.handle_fragment_returning(now, source, slice, bytes, cut_off, recovered, data).0
    }

    /// [`SliceAssembler::handle_fragment_recovered`] that gives back the data of a fragment
    /// that came too late (for the late-data side stream); every other refused fragment's
    /// data is dropped.
    #[allow(clippy::too_many_arguments)]
    pub fn handle_fragment_returning(
        &mut self,
        now: Instant,
        source: SourceId,
        slice: SliceNumber,
        bytes: u64,
        cut_off: bool,
        recovered: bool,
        data: T,
    ) -> (Admission, Option<T>) {
        self.count_received(source);
        let (admission, late) = match self.admit(now, source, slice, bytes, cut_off, recovered, data) {
            Ok(()) => (Admission::Accepted, None),
            Err((a, data)) => (a, data.filter(|_| a == Admission::Late)),
        };
        match admission {
            Admission::Accepted => {}
            Admission::Late => self.tally.late += 1,
            Admission::Duplicate => self.tally.duplicate += 1,
            Admission::UnknownSource => self.tally.unknown_source += 1,
            Admission::DroppedOverload => self.tally.dropped_overload += 1,
        }
        self.emit_ready(now);
        (admission, late)
    }

    /// A fragment its source flagged late: data that reached the source after it had sent
    /// its fragment of the slice (the source SDK). It never joins a slice (the source's
    /// place in it is taken); it is counted late and its data given back for the late-data
    /// side stream.
    pub fn handle_late_fragment(&mut self, source: SourceId, data: T) -> (Admission, Option<T>) {
        self.count_received(source);
        if source >= self.cfg.n_sources {
            self.tally.unknown_source += 1;
            return (Admission::UnknownSource, None);
        }
        self.tally.late += 1;
        (Admission::Late, Some(data))
    }

    /// Takes a fragment in, or says why not (with its data back where it still has it).
    #[allow(clippy::too_many_arguments)]
    fn admit(
        &mut self,
        now: Instant,
        source: SourceId,
        slice: SliceNumber,
        bytes: u64,
        cut_off: bool,
        recovered: bool,
        data: T,
    ) -> Result<(), (Admission, Option<T>)> {
        if source >= self.cfg.n_sources {
            return Err((Admission::UnknownSource, None));
        }
        if self.last_emitted.is_some_and(|l| slice <= l) {
            return Err((Admission::Late, Some(data)));
        }
        let over_budget = self.held_bytes + self.downstream_bytes + bytes > self.cfg.memory_budget;
        let n_sources = self.cfg.n_sources;
        let entry = self.active.entry(slice).or_insert_with(|| ActiveSlice::new(now, n_sources));
        if entry.has(source) {
            return Err((Admission::Duplicate, None));
        }
        entry.heard.insert(source);
        if over_budget {
            entry.dropped.push(source);
            return Err((Admission::DroppedOverload, None));
        }
        entry.bytes += bytes;
        entry.fragments.push(Fragment { source, bytes, cut_off, recovered, data });
        self.held_bytes += bytes;
        Ok(())
    }

    /// Lets wall-clock timeouts fire. Call at [`SliceAssembler::poll_timeout`] or later.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.emit_ready(now);
    }

    /// Downstream (the filter) has released `bytes` handed out earlier.
    pub fn handle_released(&mut self, bytes: u64) {
        self.downstream_bytes = self.downstream_bytes.saturating_sub(bytes);
    }

    /// Pull: nothing more will come for `slice` (the builder gave up the fragments it still
    /// missed). It is processed as soon as it is the oldest; a slice that received nothing
    /// is processed too, with every source missing, so every assigned slice has an outcome.
    pub fn handle_give_up(&mut self, now: Instant, slice: SliceNumber) {
        if self.last_emitted.is_some_and(|l| slice <= l) {
            return;
        }
        let n_sources = self.cfg.n_sources;
        let entry = self.active.entry(slice).or_insert_with(|| ActiveSlice::new(now, n_sources));
        entry.given_up = true;
        self.emit_ready(now);
    }

    /// End of run: processes every active slice in order.
    pub fn handle_drain(&mut self, _now: Instant) {
        while let Some((&slice, _)) = self.active.first_key_value() {
            self.emit(slice, EmitReason::Drained);
        }
    }

    /// The next processed slice. Its bytes count against the memory budget until
    /// [`SliceAssembler::handle_released`].
    pub fn poll_outcome(&mut self) -> Option<SliceOutcome<T>> {
        self.out.pop_front()
    }

    /// When the wall-clock guard of the oldest active slice expires.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.active.values().next().map(|s| s.first_arrival + self.cfg.wall_timeout)
    }

    /// Whether a fragment of `slice` would open a slice past the window: newer than every
    /// active slice while `max_active` are active, so that taking it in would process the
    /// oldest one incomplete (the slice-count timeout). A builder whose sources run free
    /// (no slice clock) holds such a fragment back and stops reading its connection, so
    /// that TCP's flow control paces the source instead.
    pub fn opens_past_window(&self, slice: SliceNumber) -> bool {
        self.window_edge().is_some_and(|newest| slice > newest)
    }

    /// The newest active slice while the window is full (`max_active` active), else
    /// `None`: a fragment of a later slice [`SliceAssembler::opens_past_window`].
    pub fn window_edge(&self) -> Option<SliceNumber> {
        if self.active.len() < self.cfg.max_active {
            return None;
        }
        self.active.last_key_value().map(|(&newest, _)| newest)
    }

    /// Active slices.
    pub fn active(&self) -> usize {
        self.active.len()
    }

    /// Bytes held in active slices plus bytes handed downstream and not yet released.
    pub fn memory_in_use(&self) -> u64 {
        self.held_bytes + self.downstream_bytes
    }

    fn count_received(&mut self, source: SourceId) {
        match self.received.get_mut(source as usize) {
            Some(n) => *n += 1,
            None => *self.tally.received.entry(source).or_default() += 1,
        }
    }

    /// This builder's accounting so far; fragments still held count as pending.
    pub fn tally(&self) -> BuilderTally {
        let mut t = self.tally.clone();
        let known = self.received.iter().enumerate().filter(|(_, n)| **n > 0);
        t.received.extend(known.map(|(source, &n)| (source as SourceId, n)));
        t.pending = self.active.values().map(|s| s.fragments.len() as u64).sum();
        t
    }

    fn emit_ready(&mut self, now: Instant) {
        loop {
            let Some((&slice, oldest)) = self.active.first_key_value() else { return };
            let reason = if oldest.count() >= self.cfg.n_sources as usize {
                EmitReason::Complete
            } else if oldest.given_up {
                EmitReason::Abandoned
            } else if self.active.len() > self.cfg.max_active {
                EmitReason::SliceCountTimeout
            } else if now >= oldest.first_arrival + self.cfg.wall_timeout {
                EmitReason::WallClockTimeout
            } else {
                return;
            };
            self.emit(slice, reason);
        }
    }

    fn emit(&mut self, slice: SliceNumber, reason: EmitReason) {
        let mut s = self.active.remove(&slice).expect("emit an active slice");
        let missing = s.heard.missing(self.cfg.n_sources);
        // Sources mostly arrive in order already (then the check is all it costs).
        if !s.fragments.is_sorted_by_key(|f| f.source) {
            s.fragments.sort_unstable_by_key(|f| f.source);
        }
        for f in &s.fragments {
            if f.cut_off {
                self.tally.cut_off += 1;
            } else if f.recovered {
                self.tally.recovered += 1;
            } else {
                self.tally.delivered += 1;
            }
        }
        self.held_bytes -= s.bytes;
        self.downstream_bytes += s.bytes;
        self.last_emitted = Some(slice);
        self.out.push_back(SliceOutcome {
            slice,
            reason,
            fragments: s.fragments,
            missing,
            dropped: s.dropped,
            first_arrival: s.first_arrival,
            bytes: s.bytes,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{Ledger, SourceTally};
    use proptest::prelude::*;

    fn t(ms: u64) -> Instant {
        Instant::from_nanos(ms * 1_000_000)
    }

    fn drain<T>(a: &mut SliceAssembler<T>) -> Vec<SliceOutcome<T>> {
        std::iter::from_fn(|| a.poll_outcome()).collect()
    }

    #[test]
    fn completes_in_order_and_discards_late() {
        let mut a = SliceAssembler::new(AssemblerConfig::new(2));
        assert_eq!(a.handle_fragment(t(0), 0, 10, 100, false, ()), Admission::Accepted);
        assert_eq!(a.handle_fragment(t(0), 0, 11, 100, false, ()), Admission::Accepted);
        assert_eq!(a.handle_fragment(t(0), 1, 11, 100, false, ()), Admission::Accepted);
        assert!(drain(&mut a).is_empty(), "11 is complete but 10 is older and open");
        assert_eq!(a.handle_fragment(t(1), 1, 10, 100, false, ()), Admission::Accepted);
        let out = drain(&mut a);
        assert_eq!(out.iter().map(|o| o.slice).collect::<Vec<_>>(), [10, 11]);
        assert!(out.iter().all(|o| o.is_complete() && o.reason == EmitReason::Complete));
        assert_eq!(a.handle_fragment(t(2), 0, 9, 1, false, ()), Admission::Late);
        assert_eq!(a.handle_fragment(t(2), 0, 11, 1, false, ()), Admission::Late);
        assert_eq!(a.handle_fragment(t(2), 5, 12, 1, false, ()), Admission::UnknownSource);
        assert_eq!(a.handle_fragment(t(2), 0, 12, 1, false, ()), Admission::Accepted);
        assert_eq!(a.handle_fragment(t(2), 0, 12, 1, false, ()), Admission::Duplicate);
        let tally = a.tally();
        assert_eq!(
            (tally.delivered, tally.late, tally.unknown_source, tally.duplicate, tally.pending),
            (4, 2, 1, 1, 1)
        );
        assert_eq!(tally.unaccounted(), 0);
    }

    #[test]
    fn slice_count_timeout_names_missing_sources() {
        let mut cfg = AssemblerConfig::new(3);
        cfg.max_active = 2;
        let mut a = SliceAssembler::new(cfg);
        a.handle_fragment(t(0), 0, 1, 1, false, ());
        a.handle_fragment(t(0), 0, 2, 1, false, ());
        assert!(drain(&mut a).is_empty());
        a.handle_fragment(t(0), 2, 3, 1, false, ());
        let out = drain(&mut a);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].slice, out[0].reason), (1, EmitReason::SliceCountTimeout));
        assert_eq!(out[0].missing, [1, 2]);
    }

    #[test]
    fn a_fragment_past_the_window_is_the_one_that_would_force_out() {
        let mut cfg = AssemblerConfig::new(2);
        cfg.max_active = 2;
        let mut a = SliceAssembler::new(cfg);
        assert!(!a.opens_past_window(7), "an empty table has room");
        a.handle_fragment(t(0), 0, 1, 1, false, ());
        assert!(!a.opens_past_window(9), "one active of two: room");
        a.handle_fragment(t(0), 0, 2, 1, false, ());
        assert!(a.opens_past_window(3), "two active of two: a third would push slice 1 out");
        assert!(!a.opens_past_window(2) && !a.opens_past_window(1), "active slices take more fragments");
        a.handle_fragment(t(0), 0, 3, 1, false, ());
        assert_eq!(drain(&mut a)[0].reason, EmitReason::SliceCountTimeout, "what holding back avoids");
        a.handle_fragment(t(0), 1, 2, 1, false, ());
        assert_eq!(drain(&mut a)[0].reason, EmitReason::Complete);
        assert!(!a.opens_past_window(4), "slice 2 done: room again");
    }

    #[test]
    fn wall_clock_timeout() {
        let mut cfg = AssemblerConfig::new(2);
        cfg.wall_timeout = Duration::from_millis(50);
        let mut a = SliceAssembler::new(cfg);
        a.handle_fragment(t(0), 0, 1, 1, false, ());
        assert_eq!(a.poll_timeout(), Some(t(50)));
        a.handle_timeout(t(49));
        assert!(drain(&mut a).is_empty());
        a.handle_timeout(t(50));
        let out = drain(&mut a);
        assert_eq!((out[0].reason, out[0].missing.clone()), (EmitReason::WallClockTimeout, vec![1]));
        assert_eq!(a.poll_timeout(), None);
    }

    #[test]
    fn memory_budget_drops_and_marks() {
        let mut cfg = AssemblerConfig::new(2);
        cfg.memory_budget = 150;
        let mut a = SliceAssembler::new(cfg);
        assert_eq!(a.handle_fragment(t(0), 0, 1, 100, false, ()), Admission::Accepted);
        assert_eq!(a.handle_fragment(t(0), 1, 1, 100, false, ()), Admission::DroppedOverload);
        let out = drain(&mut a);
        assert_eq!(out[0].dropped, [1]);
        assert!(!out[0].is_complete());
        assert_eq!(a.memory_in_use(), 100, "handed downstream, not yet released");
        assert_eq!(a.handle_fragment(t(0), 0, 2, 100, false, ()), Admission::DroppedOverload);
        a.handle_released(100);
        assert_eq!(a.handle_fragment(t(0), 1, 2, 100, false, ()), Admission::Accepted);
        assert_eq!(a.tally().dropped_overload, 2);
    }

    #[test]
    fn cut_off_markers_are_their_own_bucket() {
        let mut a = SliceAssembler::new(AssemblerConfig::new(2));
        a.handle_fragment(t(0), 0, 1, 56, true, ());
        a.handle_fragment(t(0), 1, 1, 500, false, ());
        let out = drain(&mut a);
        assert!(out[0].is_complete());
        let tally = a.tally();
        assert_eq!((tally.delivered, tally.cut_off), (1, 1));
    }

    #[test]
    fn many_sources_out_of_order_come_out_in_source_order_with_the_missing_named() {
        // 130 sources: three words of the set, the last one partly used.
        let mut cfg = AssemblerConfig::new(130);
        cfg.max_active = 1;
        let mut a = SliceAssembler::new(cfg);
        let skipped = [0u32, 63, 64, 127, 128];
        for src in (0..130u32).rev().filter(|s| !skipped.contains(s)) {
            assert_eq!(a.handle_fragment(t(0), src, 1, 10, false, src), Admission::Accepted);
        }
        assert_eq!(a.handle_fragment(t(0), 129, 1, 10, false, 0), Admission::Duplicate);
        assert_eq!(a.handle_fragment(t(0), 7, 2, 10, false, 7), Admission::Accepted);
        let out = drain(&mut a);
        assert_eq!(out[0].reason, EmitReason::SliceCountTimeout);
        let order: Vec<u32> = out[0].fragments.iter().map(|f| f.data).collect();
        let expected: Vec<u32> = (0..130u32).filter(|s| !skipped.contains(s)).collect();
        assert_eq!(order, expected);
        assert_eq!(out[0].missing, skipped);
        let tally = a.tally();
        assert_eq!(tally.received.len(), 125, "every source but the 5 skipped sent something");
        assert_eq!((tally.received[&129], tally.received[&7], tally.duplicate), (2, 2, 1));
        assert_eq!(a.handle_fragment(t(0), 200, 3, 10, false, 200), Admission::UnknownSource);
        assert_eq!(a.tally().received[&200], 1, "unknown sources are counted received too");
    }

    proptest! {
        /// Free-running sources, each sending its slices in order on a connection of its own
        /// and racing each other: holding back every fragment past the window (and the
        /// rest of its connection behind it), and taking held fragments in again in slice
        /// order as soon as they no longer are, never stalls (no clock runs here: a stall
        /// would leave fragments held) and builds every slice complete.
        #[test]
        fn holding_back_past_the_window_builds_every_slice(n_sources in 1u32..6, n_slices in 1u64..30,
                                                           max_active in 1usize..6,
                                                           order in proptest::collection::vec(any::<u8>(), 0..600)) {
            let cfg = AssemblerConfig { n_sources, max_active, wall_timeout: Duration::from_secs(1), memory_budget: u64::MAX };
            let mut a = SliceAssembler::new(cfg);
            let mut next = vec![0u64; n_sources as usize];
            let mut held: Vec<VecDeque<SliceNumber>> = vec![VecDeque::new(); n_sources as usize];
            let mut outcomes = Vec::new();
            let mut picks = order.into_iter().map(usize::from).chain(0..);
            while next.iter().any(|&n| n < n_slices) || held.iter().any(|h| !h.is_empty()) {
                // A reader reads only while its connection holds nothing back.
                let readable: Vec<usize> = (0..n_sources as usize).filter(|&s| held[s].is_empty() && next[s] < n_slices).collect();
                if let Some(&src) = readable.get(picks.next().unwrap() % readable.len().max(1)) {
                    let slice = next[src];
                    next[src] += 1;
                    if a.opens_past_window(slice) {
                        held[src].push_back(slice);
                    } else {
                        prop_assert_eq!(a.handle_fragment(t(0), src as SourceId, slice, 1, false, ()), Admission::Accepted);
                    }
                } else {
                    prop_assert!(held.iter().any(|h| !h.is_empty()), "nothing to read and nothing held");
                }
                // Held fragments go in, oldest slice first, as soon as they fit.
                while let Some(src) = (0..n_sources as usize).filter(|&s| !held[s].is_empty()).min_by_key(|&s| held[s][0]) {
                    let slice = held[src][0];
                    if a.opens_past_window(slice) {
                        let stalled = readable.is_empty() && (0..n_sources as usize).all(|s| !held[s].is_empty() || next[s] == n_slices);
                        prop_assert!(!stalled, "stalled: every reader held, slice {} past the window", slice);
                        break;
                    }
                    held[src].pop_front();
                    prop_assert_eq!(a.handle_fragment(t(0), src as SourceId, slice, 1, false, ()), Admission::Accepted);
                }
                prop_assert!(a.active() <= max_active);
                outcomes.extend(std::iter::from_fn(|| a.poll_outcome()));
            }
            prop_assert_eq!(outcomes.len() as u64, n_slices);
            prop_assert!(outcomes.iter().all(|o| o.reason == EmitReason::Complete), "{:?}", outcomes.iter().map(|o| o.reason).collect::<Vec<_>>());
        }

        /// Under random arrival order, delays and losses: every slice is emitted at most
        /// once, in increasing order; every accepted fragment is in exactly one outcome; and
        /// the run ledger balances.
        #[test]
        fn random_arrivals(n_sources in 1u32..8, n_slices in 1u64..40, max_active in 1usize..8,
                           budget in 500u64..20_000,
                           events in proptest::collection::vec((any::<u16>(), 0u64..300, any::<bool>(), 0u8..10), 0..400)) {
            let cfg = AssemblerConfig { n_sources, max_active, wall_timeout: Duration::from_millis(100), memory_budget: budget };
            let mut a = SliceAssembler::new(cfg);
            // Produce every (source, slice); each event picks one, a send delay, and loss.
            let all: Vec<(SourceId, SliceNumber)> = (0..n_slices).flat_map(|s| (0..n_sources).map(move |src| (src, s))).collect();
            let mut sources: BTreeMap<SourceId, SourceTally> = (0..n_sources).map(|s| (s, SourceTally::default())).collect();
            for &(src, _) in &all { sources.get_mut(&src).unwrap().produced += 1; }
            let mut arrivals = Vec::new();
            let mut used = vec![false; all.len()];
            for (pick, delay_ms, lost, release) in events {
                let i = pick as usize % all.len();
                if used[i] { continue; }
                used[i] = true;
                let (src, slice) = all[i];
                *sources.get_mut(&src).unwrap().sent.entry(0).or_default() += 1;
                if !lost || release > 7 {
                    arrivals.push((slice * 10 + delay_ms, src, slice, release));
                }
            }
            for (i, &(src, _)) in all.iter().enumerate() {
                if !used[i] { sources.get_mut(&src).unwrap().unsent += 1; }
            }
            arrivals.sort();
            let mut emitted = Vec::new();
            let mut seen_fragments = 0u64;
            for (at, src, slice, release) in arrivals {
                let now = t(at);
                a.handle_timeout(now);
                a.handle_fragment(now, src, slice, 100, false, ());
                while let Some(o) = a.poll_outcome() {
                    seen_fragments += o.fragments.len() as u64;
                    if release < 5 { a.handle_released(o.bytes); }
                    emitted.push(o.slice);
                }
            }
            a.handle_drain(t(1_000_000));
            while let Some(o) = a.poll_outcome() { seen_fragments += o.fragments.len() as u64; emitted.push(o.slice); }
            prop_assert!(emitted.windows(2).all(|w| w[0] < w[1]), "order {:?}", emitted);
            let tally = a.tally();
            prop_assert_eq!(tally.pending, 0);
            prop_assert_eq!(tally.delivered, seen_fragments);
            prop_assert_eq!(tally.unaccounted(), 0);
            let ledger = Ledger::combine(&sources, &BTreeMap::from([(0, tally)]));
            prop_assert_eq!(ledger.unaccounted(), 0);
            prop_assert!(ledger.is_balanced());
        }
    }
}
