//! The event queue: a binary heap keyed by (time, insertion sequence).
//!
//! Most of a simulation's time goes into this heap, so its entries are one `u128` each:
//! the time in the upper 64 bits, then the insertion sequence (40 bits), then the slot
//! holding the event (24 bits). Ordering by that number is ordering by (time, sequence),
//! and a comparison is two machine words instead of a three-field tuple.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use shoal_core::Instant;

const SLOT_BITS: u32 = 24;
/// Events pending at once (the largest scenarios keep a few thousand).
const SLOTS: usize = 1 << SLOT_BITS;
/// Events scheduled over a run (the largest scenarios schedule about 10^9).
const SEQUENCES: u64 = 1 << (64 - SLOT_BITS);

/// A timestamp-ordered queue of events of type `E`. Events at the same instant come out in
/// the order they were scheduled, so a run is deterministic.
#[derive(Debug)]
pub struct EventQueue<E> {
    heap: BinaryHeap<Reverse<u128>>,
    slots: Vec<Option<E>>,
    free: Vec<usize>,
    seq: u64,
    now: Instant,
    processed: u64,
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        Self { heap: BinaryHeap::new(), slots: Vec::new(), free: Vec::new(), seq: 0, now: Instant::ZERO, processed: 0 }
    }
}

impl<E> EventQueue<E> {
    pub fn new() -> Self {
        Self::default()
    }

    /// The time of the event being processed (or last processed).
    pub fn now(&self) -> Instant {
        self.now
    }

    /// Events processed so far.
    pub fn processed(&self) -> u64 {
        self.processed
    }

    pub fn len(&self) -> usize {
        self.heap.len()
    }

    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Schedules `ev` at `at` (never before now: an earlier time is taken as now).
    pub fn schedule(&mut self, at: Instant, ev: E) {
        let at = at.max(self.now);
        let slot = match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(ev);
                i
            }
            None => {
                self.slots.push(Some(ev));
                self.slots.len() - 1
            }
        };
        assert!(slot < SLOTS, "more than {SLOTS} events pending");
        assert!(self.seq < SEQUENCES, "more than {SEQUENCES} events scheduled");
        let key = (u128::from(at.as_nanos()) << 64) | (u128::from(self.seq) << SLOT_BITS) | slot as u128;
        self.heap.push(Reverse(key));
        self.seq += 1;
    }

    /// The next event, advancing the clock to its time; `None` when empty or when the next
    /// event lies after `until`.
    pub fn pop(&mut self, until: Instant) -> Option<(Instant, E)> {
        let &Reverse(key) = self.heap.peek()?;
        let at = Instant::from_nanos((key >> 64) as u64);
        if at > until {
            return None;
        }
        self.heap.pop();
        let slot = (key as usize) & (SLOTS - 1);
        self.now = at;
        self.processed += 1;
        self.free.push(slot);
        Some((at, self.slots[slot].take().expect("scheduled slot holds an event")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_order_then_insertion_order() {
        let mut q = EventQueue::new();
        q.schedule(Instant::from_nanos(20), "c");
        q.schedule(Instant::from_nanos(10), "a");
        q.schedule(Instant::from_nanos(10), "b");
        q.schedule(Instant::from_nanos(30), "d");
        let mut out = Vec::new();
        while let Some((t, e)) = q.pop(Instant::from_nanos(25)) {
            out.push((t.as_nanos(), e));
        }
        assert_eq!(out, [(10, "a"), (10, "b"), (20, "c")]);
        assert_eq!(q.len(), 1);
        assert_eq!(q.now(), Instant::from_nanos(20));
        q.schedule(Instant::from_nanos(5), "late");
        assert_eq!(q.pop(Instant::MAX), Some((Instant::from_nanos(20), "late")));
    }
}
