//! The event queue: a binary heap keyed by (time, insertion sequence).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use shoal_core::Instant;

/// A timestamp-ordered queue of events of type `E`. Events at the same instant come out in
/// the order they were scheduled, so a run is deterministic.
#[derive(Debug)]
pub struct EventQueue<E> {
    heap: BinaryHeap<Reverse<(Instant, u64, usize)>>,
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
        self.heap.push(Reverse((at, self.seq, slot)));
        self.seq += 1;
    }

    /// The next event, advancing the clock to its time; `None` when empty or when the next
    /// event lies after `until`.
    pub fn pop(&mut self, until: Instant) -> Option<(Instant, E)> {
        let &Reverse((at, _, _)) = self.heap.peek()?;
        if at > until {
            return None;
        }
        let Reverse((at, _, slot)) = self.heap.pop().expect("peeked");
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
