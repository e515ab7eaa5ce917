//! The hand-off of processed slices from a builder's assembler (a task on the runtime) to
//! its filter thread: slices travel in batches, one per round of the assembler's loop, and
//! the queue is bounded in slices.
//!
//! Why batches: a saturated builder can process 200,000 small slices a second, and a
//! hand-off per slice (a futex wake of the filter thread, then a wake of the assembler
//! for each slice's bytes released) cost more than the filtering. Measured in
//! docs/bench/history.md ("Slices to the filter in batches"). The filter thread takes every
//! batch queued when it wakes ([`FilterQueueRx::next_batch`]) and gives the bytes of all
//! of them back at once.
//!
//! The bound counts slices from the moment they are offered until the filter thread starts
//! on each ([`FilterQueueRx::started`]); a slice offered beyond it is handed back
//! ([`FilterQueue::offer`]), for the builder to count as not filtered.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender};

/// The assembler's end.
#[derive(Debug)]
pub struct FilterQueue<T> {
    tx: Sender<Vec<T>>,
    /// Slices offered and not yet started on by the filter thread (this batch included).
    queued: Arc<AtomicUsize>,
    limit: usize,
    batch: Vec<T>,
}

/// The filter thread's end.
#[derive(Debug)]
pub struct FilterQueueRx<T> {
    rx: Receiver<Vec<T>>,
    queued: Arc<AtomicUsize>,
}

/// A queue of at most `limit` slices (at least one).
pub fn filter_queue<T>(limit: usize) -> (FilterQueue<T>, FilterQueueRx<T>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let queued = Arc::new(AtomicUsize::new(0));
    (FilterQueue { tx, queued: queued.clone(), limit: limit.max(1), batch: Vec::new() }, FilterQueueRx { rx, queued })
}

impl<T> FilterQueue<T> {
    /// Adds `item` to this round's batch, or hands it back when the queue is full.
    pub fn offer(&mut self, item: T) -> Result<(), T> {
        if self.queued.load(Ordering::Acquire) >= self.limit {
            return Err(item);
        }
        self.queued.fetch_add(1, Ordering::AcqRel);
        self.batch.push(item);
        Ok(())
    }

    /// Sends this round's batch (nothing when empty); hands it back when the filter thread
    /// is gone.
    pub fn flush(&mut self) -> Result<(), Vec<T>> {
        if self.batch.is_empty() {
            return Ok(());
        }
        let batch = std::mem::take(&mut self.batch);
        let n = batch.len();
        self.tx.send(batch).map_err(|e| {
            self.queued.fetch_sub(n, Ordering::AcqRel);
            e.0
        })
    }

    /// Slices offered and not yet started on.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }
}

impl<T> FilterQueueRx<T> {
    /// Waits for a batch, then takes every other batch already queued with it; `None` once
    /// the assembler's end is dropped and everything was taken.
    pub fn next_batch(&self) -> Option<Vec<T>> {
        let mut all = self.rx.recv().ok()?;
        while let Ok(more) = self.rx.try_recv() {
            all.extend(more);
        }
        Some(all)
    }

    /// The filter thread starts on one slice of its batch: room for another.
    pub fn started(&self) {
        self.queued.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_counts_slices_until_the_filter_starts_on_them() {
        let (mut q, rx) = filter_queue::<u32>(3);
        assert_eq!(q.offer(1), Ok(()));
        assert_eq!(q.offer(2), Ok(()));
        q.flush().unwrap();
        assert_eq!(q.offer(3), Ok(()));
        assert_eq!(q.offer(4), Err(4), "three offered, none finished: full");
        q.flush().unwrap();
        // One wake takes both batches, in order.
        assert_eq!(rx.next_batch(), Some(vec![1, 2, 3]));
        assert_eq!(q.offer(5), Err(5), "taken in a batch is not started");
        rx.started();
        assert_eq!(q.queued(), 2);
        assert_eq!(q.offer(5), Ok(()));
        q.flush().unwrap();
        drop(q);
        assert_eq!(rx.next_batch(), Some(vec![5]));
        assert_eq!(rx.next_batch(), None);
    }

    #[test]
    fn an_empty_round_sends_nothing_and_a_gone_filter_hands_the_batch_back() {
        let (mut q, rx) = filter_queue::<u32>(8);
        q.flush().unwrap();
        q.offer(7).unwrap();
        drop(rx);
        assert_eq!(q.flush(), Err(vec![7]));
        assert_eq!(q.queued(), 0, "what came back is no longer queued");
    }

    #[test]
    fn a_bound_of_zero_still_lets_one_slice_through() {
        let (mut q, rx) = filter_queue::<u32>(0);
        assert_eq!(q.offer(1), Ok(()));
        assert_eq!(q.offer(2), Err(2));
        q.flush().unwrap();
        assert_eq!(rx.next_batch(), Some(vec![1]));
    }
}
