//! Fragment accounting: every fragment a source produces ends in exactly one bucket.
//!
//! Sources and builders keep their own tallies ([`SourceTally`], [`BuilderTally`]), each
//! counted where the event happens. [`Ledger::combine`] sums them for a run and derives the
//! only bucket nobody can observe directly, [`Bucket::LostInTransport`], per
//! (source, builder) pair as `sent - received`. [`Ledger::unaccounted`] is then
//! `produced - sum(buckets)`: zero when the books balance, non-zero when a count is wrong
//! (for example a frame counted as sent twice, or received but never classified).

use std::collections::{BTreeMap, BTreeSet};

use crate::{BuilderId, SourceId};

/// Where a fragment ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum Bucket {
    /// Part of a slice the builder processed (complete or incomplete).
    Delivered,
    /// Delivered like [`Bucket::Delivered`], but only thanks to a retransmission the
    /// builder asked for (datagram transport: some of its datagrams were lost first).
    Recovered,
    /// Replaced by an empty marker by the burst rate cutoff (the marker was delivered).
    CutOff,
    /// Arrived after its slice had been processed; discarded.
    Late,
    /// Arrived after its slice had been processed; kept in the builder's late-data side
    /// stream and written with the run's raw data (not in a processed slice).
    Salvaged,
    /// A second copy for a (source, slice) the builder already held; discarded.
    Duplicate,
    /// Discarded by the builder's emergency memory limit.
    DroppedOverload,
    /// From a source id the builder does not expect; discarded.
    UnknownSource,
    /// Still held by the builder when its tally was taken (zero after a clean stop).
    PendingAtBuilder,
    /// Discarded by the source: its send queue for that builder was full.
    DroppedAtSource,
    /// The connection failed while the fragment was being written.
    SendFailed,
    /// Still queued at the source when its tally was taken (zero after a clean stop).
    Unsent,
    /// Pull policies: held by the source until its hold time passed, never asked for by a
    /// builder (the slice was never assigned, or its builder left before asking).
    NeverRequested,
    /// Datagram transport: partly received, never completed (the missing datagrams were
    /// not recovered within the budget); counted by the builder.
    Damaged,
    /// Sent, never received: `sent - received - damaged` per (source, builder).
    LostInTransport,
    /// Sent to a builder that left no tally (it died or never reported): whatever it
    /// held or would have built is gone with it.
    LostWithBuilder,
    /// Produced by a source process that died during the run and was never received:
    /// what it held when it died (see [`Ledger::attribute_departed_sources`]).
    LostWithSource,
}

impl Bucket {
    pub const ALL: [Bucket; 17] = [
        Bucket::Delivered,
        Bucket::Recovered,
        Bucket::CutOff,
        Bucket::Late,
        Bucket::Salvaged,
        Bucket::Duplicate,
        Bucket::DroppedOverload,
        Bucket::UnknownSource,
        Bucket::PendingAtBuilder,
        Bucket::DroppedAtSource,
        Bucket::SendFailed,
        Bucket::Unsent,
        Bucket::NeverRequested,
        Bucket::Damaged,
        Bucket::LostInTransport,
        Bucket::LostWithBuilder,
        Bucket::LostWithSource,
    ];

    /// Stable snake_case name (metric label, JSON key).
    pub fn name(self) -> &'static str {
        match self {
            Bucket::Delivered => "delivered",
            Bucket::Recovered => "recovered",
            Bucket::CutOff => "cut_off",
            Bucket::Late => "late",
            Bucket::Salvaged => "salvaged",
            Bucket::Duplicate => "duplicate",
            Bucket::DroppedOverload => "dropped_overload",
            Bucket::UnknownSource => "unknown_source",
            Bucket::PendingAtBuilder => "pending_at_builder",
            Bucket::DroppedAtSource => "dropped_at_source",
            Bucket::SendFailed => "send_failed",
            Bucket::Unsent => "unsent",
            Bucket::NeverRequested => "never_requested",
            Bucket::Damaged => "damaged",
            Bucket::LostInTransport => "lost_in_transport",
            Bucket::LostWithBuilder => "lost_with_builder",
            Bucket::LostWithSource => "lost_with_source",
        }
    }
}

/// A source's own counts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SourceTally {
    pub produced: u64,
    /// Fragments completely handed to the transport, per destination builder.
    pub sent: BTreeMap<BuilderId, u64>,
    pub dropped_at_source: u64,
    pub send_failed: u64,
    pub unsent: u64,
    /// Pull policies: evicted from the source's buffer without ever being requested.
    #[cfg_attr(feature = "serde", serde(default))]
    pub never_requested: u64,
    /// Produced by an incarnation of this source that died during the run, never
    /// received (set by [`Ledger::attribute_departed_sources`]).
    #[cfg_attr(feature = "serde", serde(default))]
    pub lost_with_source: u64,
}

impl SourceTally {
    pub fn merge(&mut self, other: &SourceTally) {
        self.produced += other.produced;
        for (b, n) in &other.sent {
            *self.sent.entry(*b).or_default() += n;
        }
        self.dropped_at_source += other.dropped_at_source;
        self.send_failed += other.send_failed;
        self.unsent += other.unsent;
        self.never_requested += other.never_requested;
        self.lost_with_source += other.lost_with_source;
    }
    /// produced minus everything this source can account for itself: should be zero.
    pub fn unaccounted(&self) -> i128 {
        i128::from(self.produced)
            - i128::from(
                self.sent.values().sum::<u64>()
                    + self.dropped_at_source
                    + self.send_failed
                    + self.unsent
                    + self.never_requested
                    + self.lost_with_source,
            )
    }
}

/// A builder's own counts: every received frame lands in exactly one bucket.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct BuilderTally {
    /// Frames received intact, per source.
    pub received: BTreeMap<SourceId, u64>,
    pub delivered: u64,
    /// Delivered after a retransmission (datagram transport); not in `delivered`.
    #[cfg_attr(feature = "serde", serde(default))]
    pub recovered: u64,
    /// Datagram transport: frames partly received and given up, per source. Not in
    /// `received` (they never arrived whole).
    #[cfg_attr(feature = "serde", serde(default))]
    pub damaged: BTreeMap<SourceId, u64>,
    pub cut_off: u64,
    /// Late fragments discarded.
    pub late: u64,
    /// Late fragments kept in the late-data side stream (not in `late`).
    #[cfg_attr(feature = "serde", serde(default))]
    pub salvaged: u64,
    pub duplicate: u64,
    pub dropped_overload: u64,
    pub unknown_source: u64,
    pub pending: u64,
}

impl BuilderTally {
    pub fn merge(&mut self, other: &BuilderTally) {
        for (s, n) in &other.received {
            *self.received.entry(*s).or_default() += n;
        }
        self.delivered += other.delivered;
        self.recovered += other.recovered;
        for (s, n) in &other.damaged {
            *self.damaged.entry(*s).or_default() += n;
        }
        self.cut_off += other.cut_off;
        self.late += other.late;
        self.salvaged += other.salvaged;
        self.duplicate += other.duplicate;
        self.dropped_overload += other.dropped_overload;
        self.unknown_source += other.unknown_source;
        self.pending += other.pending;
    }
    fn classified(&self) -> u64 {
        self.delivered
            + self.recovered
            + self.cut_off
            + self.late
            + self.salvaged
            + self.duplicate
            + self.dropped_overload
            + self.unknown_source
            + self.pending
    }
    /// received minus classified: should be zero.
    pub fn unaccounted(&self) -> i128 {
        i128::from(self.received.values().sum::<u64>()) - i128::from(self.classified())
    }
}

/// The run's books: how many fragments were produced and where each one ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ledger {
    pub produced: u64,
    buckets: BTreeMap<Bucket, u64>,
    /// Frames received beyond what was sent on a (source, builder) pair: a counting bug.
    pub excess_received: u64,
    /// Internal inconsistencies of the tallies themselves (see the tallies' `unaccounted`).
    pub tally_errors: i128,
}

impl Ledger {
    /// Combines the tallies of all sources and builders of a run.
    ///
    /// `sources` maps each source id to its tally; `builders` maps each builder id to its
    /// tally. Transport loss is derived per (source, builder) pair. Fragments sent to a
    /// builder missing from `builders` (a process that died) are [`Bucket::LostWithBuilder`].
    pub fn combine(sources: &BTreeMap<SourceId, SourceTally>, builders: &BTreeMap<BuilderId, BuilderTally>) -> Ledger {
        Self::combine_with_dead_builders(sources, builders, &BTreeSet::new())
    }

    /// [`Ledger::combine`] for a run in which `dead_builders` died (and may have been
    /// restarted): what their sources sent them beyond what the restarted incarnation
    /// received is [`Bucket::LostWithBuilder`], not lost in transport.
    pub fn combine_with_dead_builders(
        sources: &BTreeMap<SourceId, SourceTally>,
        builders: &BTreeMap<BuilderId, BuilderTally>,
        dead_builders: &BTreeSet<BuilderId>,
    ) -> Ledger {
        let mut l = Ledger::default();
        for (src, t) in sources {
            l.produced += t.produced;
            l.add(Bucket::DroppedAtSource, t.dropped_at_source);
            l.add(Bucket::SendFailed, t.send_failed);
            l.add(Bucket::Unsent, t.unsent);
            l.add(Bucket::NeverRequested, t.never_requested);
            l.add(Bucket::LostWithSource, t.lost_with_source);
            l.tally_errors += t.unaccounted();
            for (b, &sent) in &t.sent {
                let Some(bt) = builders.get(b) else {
                    l.add(Bucket::LostWithBuilder, sent);
                    continue;
                };
                let received = bt.received.get(src).copied().unwrap_or(0);
                let damaged = bt.damaged.get(src).copied().unwrap_or(0);
                l.add(Bucket::Damaged, damaged);
                // A builder that died during the run took what it had received (its
                // tally is the restarted one's) and what was on its way.
                let gone = if dead_builders.contains(b) { Bucket::LostWithBuilder } else { Bucket::LostInTransport };
                l.add(gone, sent.saturating_sub(received + damaged));
                l.excess_received += (received + damaged).saturating_sub(sent);
            }
        }
        for (b, t) in builders {
            l.add(Bucket::Delivered, t.delivered);
            l.add(Bucket::Recovered, t.recovered);
            l.add(Bucket::CutOff, t.cut_off);
            l.add(Bucket::Late, t.late);
            l.add(Bucket::Salvaged, t.salvaged);
            l.add(Bucket::Duplicate, t.duplicate);
            l.add(Bucket::DroppedOverload, t.dropped_overload);
            l.add(Bucket::UnknownSource, t.unknown_source);
            l.add(Bucket::PendingAtBuilder, t.pending);
            l.tally_errors += t.unaccounted();
            // Frames from sources we have no tally for (never sent, as far as we know).
            for (src, &received) in &t.received {
                let known = sources.get(src).is_some_and(|st| st.sent.contains_key(b));
                if !known {
                    l.excess_received += received;
                }
            }
        }
        l
    }

    /// Sources whose process died during the run (its report died with it): `slices`
    /// is how many slices each took part in before it died (from run control's record of
    /// the departure). What the builders received from it beyond what a restarted
    /// incarnation reports sending counts as sent by the dead one; the rest of its
    /// production (at least what was received) is [`Bucket::LostWithSource`]. Call
    /// before [`Ledger::combine`].
    pub fn attribute_departed_sources(
        sources: &mut BTreeMap<SourceId, SourceTally>,
        builders: &BTreeMap<BuilderId, BuilderTally>,
        slices: &BTreeMap<SourceId, u64>,
    ) {
        for (&src, &n) in slices {
            let t = sources.entry(src).or_default();
            let mut received_old = 0;
            for (&b, bt) in builders {
                let received = bt.received.get(&src).copied().unwrap_or(0) + bt.damaged.get(&src).copied().unwrap_or(0);
                let old = received.saturating_sub(t.sent.get(&b).copied().unwrap_or(0));
                if old > 0 {
                    *t.sent.entry(b).or_default() += old;
                    received_old += old;
                }
            }
            let produced = n.max(received_old);
            t.produced += produced;
            t.lost_with_source += produced - received_old;
        }
    }

    pub fn add(&mut self, bucket: Bucket, n: u64) {
        *self.buckets.entry(bucket).or_default() += n;
    }

    pub fn get(&self, bucket: Bucket) -> u64 {
        self.buckets.get(&bucket).copied().unwrap_or(0)
    }

    /// Every bucket with its count, in [`Bucket::ALL`] order (zeros included).
    pub fn buckets(&self) -> impl Iterator<Item = (Bucket, u64)> + '_ {
        Bucket::ALL.into_iter().map(|b| (b, self.get(b)))
    }

    pub fn accounted(&self) -> u64 {
        self.buckets.values().sum()
    }

    /// `produced - accounted`: zero when every fragment is in exactly one bucket.
    pub fn unaccounted(&self) -> i128 {
        i128::from(self.produced) - i128::from(self.accounted())
    }

    /// The books balance: nothing unaccounted, no frame received that was not sent, and
    /// every tally consistent with itself.
    pub fn is_balanced(&self) -> bool {
        self.unaccounted() == 0 && self.excess_received == 0 && self.tally_errors == 0
    }

    /// Fragments that did not reach a processed slice (everything but delivered,
    /// recovered and cut-off; salvaged late fragments are on disk, but not in a slice).
    pub fn lost(&self) -> u64 {
        self.accounted() - self.get(Bucket::Delivered) - self.get(Bucket::Recovered) - self.get(Bucket::CutOff)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_source_and_a_dead_builder_are_attributed_and_the_books_balance() {
        // Source 0 died after 10 slices (7 of its fragments arrived, 4 at builder 0 and 3
        // at builder 1) and was restarted: the new incarnation produced 5 and sent them.
        let mut new = SourceTally { produced: 5, ..Default::default() };
        new.sent.insert(0, 3);
        new.sent.insert(1, 2);
        let mut sources = BTreeMap::from([(0, new)]);
        // Builder 1 died too after the restart and was restarted: its tally holds 1 of
        // the 5 frames sent to it (3 from the dead source, 2 from the new one).
        let mut b0 = BuilderTally::default();
        b0.received.insert(0, 7);
        b0.delivered = 7;
        let mut b1 = BuilderTally::default();
        b1.received.insert(0, 1);
        b1.delivered = 1;
        let builders = BTreeMap::from([(0, b0), (1, b1)]);
        Ledger::attribute_departed_sources(&mut sources, &builders, &BTreeMap::from([(0, 10)]));
        let t = &sources[&0];
        assert_eq!((t.produced, t.lost_with_source, t.sent[&0], t.sent[&1]), (15, 6, 7, 2));
        let l = Ledger::combine_with_dead_builders(&sources, &builders, &BTreeSet::from([1]));
        assert!(l.is_balanced(), "{l:?}");
        assert_eq!(l.get(Bucket::LostWithSource), 6);
        assert_eq!(l.get(Bucket::LostWithBuilder), 1, "sent 2 to builder 1, its restart received 1");
        assert_eq!(l.get(Bucket::LostInTransport), 0);
        // More received than the slice estimate: production is at least what arrived.
        let mut sources = BTreeMap::new();
        Ledger::attribute_departed_sources(&mut sources, &builders, &BTreeMap::from([(0, 3)]));
        assert_eq!((sources[&0].produced, sources[&0].lost_with_source), (8, 0));
    }

    #[test]
    fn balanced_books() {
        let mut s0 = SourceTally { produced: 10, ..Default::default() };
        s0.sent.insert(0, 5);
        s0.sent.insert(1, 4);
        s0.dropped_at_source = 1;
        let mut b0 = BuilderTally::default();
        b0.received.insert(0, 5);
        b0.delivered = 4;
        b0.late = 1;
        let mut b1 = BuilderTally::default();
        b1.received.insert(0, 3); // one lost in transport
        b1.delivered = 3;
        let l = Ledger::combine(&BTreeMap::from([(0, s0)]), &BTreeMap::from([(0, b0), (1, b1)]));
        assert_eq!(l.produced, 10);
        assert_eq!(l.get(Bucket::LostInTransport), 1);
        assert_eq!(l.get(Bucket::Delivered), 7);
        assert_eq!(l.unaccounted(), 0);
        assert!(l.is_balanced());
        assert_eq!(l.lost(), 3);
    }

    #[test]
    fn datagram_losses_split_into_recovered_damaged_and_lost() {
        // 10 sent over UDP: 6 arrived at once, 2 after a NACK, 1 partly (damaged), 1 not
        // at all (lost in transport).
        let mut s0 = SourceTally { produced: 10, ..Default::default() };
        s0.sent.insert(0, 10);
        let mut b0 = BuilderTally::default();
        b0.received.insert(0, 8);
        b0.delivered = 6;
        b0.recovered = 2;
        b0.damaged.insert(0, 1);
        let l = Ledger::combine(&BTreeMap::from([(0, s0)]), &BTreeMap::from([(0, b0)]));
        assert_eq!(
            [Bucket::Delivered, Bucket::Recovered, Bucket::Damaged, Bucket::LostInTransport].map(|b| l.get(b)),
            [6, 2, 1, 1]
        );
        assert!(l.is_balanced());
        assert_eq!(l.lost(), 2);
    }

    #[test]
    fn a_builder_without_tally_takes_what_was_sent_to_it() {
        let mut s0 = SourceTally { produced: 10, ..Default::default() };
        s0.sent.insert(0, 5);
        s0.sent.insert(1, 3);
        s0.unsent = 2; // queued for the dead builder at the end
        let mut b0 = BuilderTally::default();
        b0.received.insert(0, 5);
        b0.delivered = 5;
        let l = Ledger::combine(&BTreeMap::from([(0, s0)]), &BTreeMap::from([(0, b0)]));
        assert_eq!(l.get(Bucket::LostWithBuilder), 3);
        assert_eq!(l.get(Bucket::LostInTransport), 0);
        assert!(l.is_balanced());
        assert_eq!(l.lost(), 5);
    }

    #[test]
    fn counting_errors_show() {
        let mut s0 = SourceTally { produced: 2, ..Default::default() };
        s0.sent.insert(0, 2);
        let mut b0 = BuilderTally::default();
        b0.received.insert(0, 2);
        b0.delivered = 1; // one received frame never classified
        let l = Ledger::combine(&BTreeMap::from([(0, s0.clone())]), &BTreeMap::from([(0, b0.clone())]));
        assert_ne!(l.unaccounted(), 0);
        assert!(!l.is_balanced());
        // A builder receiving from a source that claims it never sent there.
        b0.delivered = 2;
        b0.received.insert(9, 1);
        b0.delivered += 1;
        let l = Ledger::combine(&BTreeMap::from([(0, s0)]), &BTreeMap::from([(0, b0)]));
        assert_eq!(l.excess_received, 1);
        assert!(!l.is_balanced());
    }
}
