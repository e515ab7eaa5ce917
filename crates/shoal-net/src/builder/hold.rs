//! Back-pressure on free-running sources: the builder stops reading a source that runs
//! too far ahead, and TCP's flow control holds the source.
//!
//! Sources that saturate (`source.saturate`: no slice clock, each produces its next
//! fragment as soon as its transport has taken the last) drift apart. Without this, a
//! builder takes in whatever arrives: a fragment that opens a slice past its window
//! (`builder.max_active` active slices) pushes the oldest one out incomplete, so
//! throughput tests opened the window wide and paid for the drift in memory (a builder of
//! 10,000 connections held its whole run, 1.5 GB of fresh pages, at once).
//!
//! Here a fragment that would open a slice past the window
//! ([`BuilderNode::opens_past_window`]) is held, with everything its connection sends
//! after it, and the connection's reader waits at its [`ReadGate`] before reading more.
//! Held fragments go in, oldest slice first, as soon as they no longer open a slice past
//! the window. Only a connection that has carried one source is held: its source sends
//! its slices in order, so nothing behind the held fragment can be what an older slice
//! waits for (a connection shared by several sources is read as before). A slice that
//! waits for a source that sends nothing is processed at the wall-clock timeout, as
//! before, and the held fragments then go in. The assembler's proptest
//! `holding_back_past_the_window_builds_every_slice` checks the rule: no stall, every slice
//! complete.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use shoal_core::frame::{Flags, Frame};
use shoal_core::node::BuilderNode;
use shoal_core::slice::SliceNumber;
use shoal_core::{Instant, SourceId};
use tokio::sync::Notify;

/// One connection's gate: shut while the builder holds fragments of it.
#[derive(Debug)]
pub(crate) struct ReadGate {
    id: u64,
    shut: AtomicBool,
    opened: Notify,
}

static NEXT_GATE: AtomicU64 = AtomicU64::new(0);

impl ReadGate {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            id: NEXT_GATE.fetch_add(1, Ordering::Relaxed),
            shut: AtomicBool::new(false),
            opened: Notify::new(),
        })
    }

    /// Returns once the gate is open, or when `closed` completes (the builder is gone).
    pub(crate) async fn pass(&self, closed: impl std::future::Future<Output = ()>) {
        tokio::pin!(closed);
        loop {
            // Created before the check: `notify_waiters` reaches a `Notified` from its creation.
            let opened = self.opened.notified();
            if !self.shut.load(Ordering::Acquire) {
                return;
            }
            tokio::select! {
                _ = opened => {}
                _ = &mut closed => return,
            }
        }
    }

    fn shut(&self) {
        self.shut.store(true, Ordering::Release);
    }

    fn open(&self) {
        self.shut.store(false, Ordering::Release);
        self.opened.notify_waiters();
    }
}

/// The builder's window as its readers see it: the newest active slice while the window
/// is full (`u64::MAX` while it has room), published after every turn of the builder's
/// loop. A reader waits here before it sends a fragment that would be held: without it, a
/// reader sent what its read buffer held (up to 16 fragments of 4 kB) before the builder
/// had shut its gate, and the builder held those.
#[derive(Debug)]
pub(crate) struct WindowEdge {
    newest: AtomicU64,
    moved: Notify,
}

impl WindowEdge {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self { newest: AtomicU64::new(u64::MAX), moved: Notify::new() })
    }

    /// The builder's window now ([`BuilderNode::window_edge`]); wakes the waiting readers
    /// if it moved.
    pub(crate) fn publish(&self, edge: Option<SliceNumber>) {
        let newest = edge.unwrap_or(u64::MAX);
        if self.newest.swap(newest, Ordering::AcqRel) != newest {
            self.moved.notify_waiters();
        }
    }

    /// Whether a fragment of `slice` stays within the window as last published.
    fn fits(&self, slice: SliceNumber) -> bool {
        slice <= self.newest.load(Ordering::Acquire)
    }

    /// Returns once a fragment of `slice` no longer opens a slice past the window as last
    /// published, or when `closed` completes. The published window can be a turn old: the
    /// builder holds what still does not fit.
    async fn wait_for_room(&self, slice: SliceNumber, closed: impl std::future::Future<Output = ()>) {
        tokio::pin!(closed);
        loop {
            let moved = self.moved.notified();
            if self.fits(slice) {
                return;
            }
            tokio::select! {
                _ = moved => {}
                _ = &mut closed => return,
            }
        }
    }
}

/// The reader's side: which gate its frames carry, if its connection may be held.
#[derive(Debug)]
pub(crate) struct ConnectionGate {
    gate: Option<Arc<ReadGate>>,
    edge: Option<Arc<WindowEdge>>,
    source: Option<SourceId>,
}

impl ConnectionGate {
    /// `edge`: the builder's window, when the run's sources are free-running
    /// (`source.saturate`); `None`: never held.
    pub(crate) fn new(edge: Option<Arc<WindowEdge>>) -> Self {
        Self { gate: edge.as_ref().map(|_| ReadGate::new()), edge, source: None }
    }

    /// Before sending a data fragment of `slice`: waits while it would open a slice past
    /// the builder's window (a connection that may be held only).
    pub(crate) async fn wait_for_room(&self, slice: SliceNumber, closed: impl std::future::Future<Output = ()>) {
        if let (Some(_), Some(edge)) = (&self.gate, &self.edge) {
            edge.wait_for_room(slice, closed).await;
        }
    }

    /// Whether a data fragment of `slice` may go in now without waiting at
    /// [`Self::wait_for_room`].
    pub(crate) fn has_room(&self, slice: SliceNumber) -> bool {
        match (&self.gate, &self.edge) {
            (Some(_), Some(edge)) => edge.fits(slice),
            _ => true,
        }
    }

    /// Whether the builder holds this connection's fragments now (they would wait at
    /// [`Self::pass`]).
    pub(crate) fn is_shut(&self) -> bool {
        self.gate.as_ref().is_some_and(|g| g.shut.load(Ordering::Acquire))
    }

    /// The gate to send with a frame of `source`: none once the connection has carried a
    /// second source (it is never held from then on).
    pub(crate) fn for_frame(&mut self, source: SourceId) -> Option<Arc<ReadGate>> {
        match self.source {
            None => self.source = Some(source),
            Some(s) if s != source => self.gate = None,
            Some(_) => {}
        }
        self.gate.clone()
    }

    /// Waits while the builder holds this connection's fragments.
    pub(crate) async fn pass(&self, closed: impl std::future::Future<Output = ()>) {
        if let Some(g) = &self.gate {
            g.pass(closed).await;
        }
    }
}

/// One held connection: its gate and its fragments in arrival order.
type HeldConnection = (Arc<ReadGate>, VecDeque<(Frame, Instant)>);

/// The builder's side: the fragments held, per connection.
#[derive(Debug, Default)]
pub(crate) struct Held {
    queues: HashMap<u64, HeldConnection>,
    /// Each held connection's first fragment: (its slice, the gate). An end of stream is
    /// keyed slice 0, which is never past the window: it goes in as soon as it is first.
    heads: BTreeSet<(SliceNumber, u64)>,
    frames: usize,
    /// Times a connection was held.
    pub(crate) holds: u64,
    /// Most fragments held at once.
    pub(crate) most_frames: usize,
}

fn key(frame: &Frame) -> SliceNumber {
    if frame.header.flags.contains(Flags::END_OF_STREAM) { 0 } else { frame.header.slice }
}

impl Held {
    /// A frame from a connection with `gate`: held if its connection is held already or it
    /// would open a slice past the window (`None`); otherwise given back for the caller to
    /// take in.
    pub(crate) fn offer<T>(
        &mut self,
        node: &BuilderNode<T>,
        gate: &Arc<ReadGate>,
        frame: Frame,
        arrival: Instant,
    ) -> Option<(Frame, Instant)> {
        if let Some((_, q)) = self.queues.get_mut(&gate.id) {
            q.push_back((frame, arrival));
        } else if node.opens_past_window(key(&frame)) {
            gate.shut();
            self.heads.insert((key(&frame), gate.id));
            self.queues.insert(gate.id, (gate.clone(), VecDeque::from([(frame, arrival)])));
            self.holds += 1;
        } else {
            return Some((frame, arrival));
        }
        self.frames += 1;
        self.most_frames = self.most_frames.max(self.frames);
        None
    }

    /// Takes held fragments in (`admit`), oldest slice first, while they fit in the window
    /// (all of them with `all`: the run is ending); opens the gate of every connection
    /// emptied.
    pub(crate) fn release<T>(
        &mut self,
        node: &mut BuilderNode<T>,
        all: bool,
        mut admit: impl FnMut(&mut BuilderNode<T>, Frame, Instant),
    ) {
        while let Some(&(slice, id)) = self.heads.first() {
            if !all && node.opens_past_window(slice) {
                return;
            }
            self.heads.pop_first();
            let (gate, q) = self.queues.get_mut(&id).expect("a head has a queue");
            let (frame, arrival) = q.pop_front().expect("a held queue is not empty");
            self.frames -= 1;
            match q.front() {
                Some((next, _)) => {
                    self.heads.insert((key(next), id));
                }
                None => {
                    gate.open();
                    self.queues.remove(&id);
                }
            }
            admit(node, frame, arrival);
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.frames == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_core::assembly::AssemblerConfig;
    use shoal_core::frame::FrameHeader;
    use shoal_core::node::BuilderNodeConfig;
    use shoal_core::slice::SliceClock;

    fn frame(source: SourceId, slice: SliceNumber, eos: bool) -> Frame {
        let header = FrameHeader {
            flags: if eos { Flags::END_OF_STREAM } else { Flags::EMPTY },
            source,
            hit_count: 0,
            slice,
            slice_start: Instant::ZERO,
            send_time: Instant::ZERO,
            payload_len: 0,
        };
        Frame { header, payload: bytes::Bytes::new() }
    }

    fn admit(node: &mut BuilderNode<()>, f: Frame, at: Instant) {
        node.handle_frame(at, &f.header, ());
    }

    #[tokio::test]
    async fn a_source_ahead_is_held_with_its_end_of_stream_and_let_go_in_order() {
        let mut node = BuilderNode::<()>::new(BuilderNodeConfig {
            id: 0,
            assembler: AssemblerConfig { max_active: 1, ..AssemblerConfig::new(2) },
            slice_clock: SliceClock::new(shoal_core::Duration::from_millis(10)),
        });
        let mut held = Held::default();
        let fast = ReadGate::new();
        let now = Instant::ZERO;
        // Source 0 delivers slice 0; its slice 1 would push slice 0 out incomplete.
        assert!(held.offer(&node, &fast, frame(0, 0, false), now).is_some());
        admit(&mut node, frame(0, 0, false), now);
        assert!(held.offer(&node, &fast, frame(0, 1, false), now).is_none());
        assert!(held.offer(&node, &fast, frame(0, 2, true), now).is_none(), "behind a held fragment");
        assert!(fast.shut.load(Ordering::Acquire));
        held.release(&mut node, false, admit);
        assert_eq!(held.frames, 2, "slice 0 still waits for source 1");
        // Source 1 completes slice 0: slice 1 fits, then the end of stream follows it.
        admit(&mut node, frame(1, 0, false), now);
        held.release(&mut node, false, admit);
        assert!(held.is_empty() && !fast.shut.load(Ordering::Acquire));
        assert_eq!(node.sources_ended(), 1);
        assert_eq!((held.holds, held.most_frames), (1, 2));
        let passed = tokio::time::timeout(std::time::Duration::from_secs(60), fast.pass(std::future::pending()));
        assert!(passed.await.is_ok(), "an open gate lets its reader through");
        let mut slices = Vec::new();
        while let Some(o) = node.poll_slice() {
            slices.push((o.slice, o.is_complete()));
        }
        assert_eq!(slices, [(0, true)]);
    }

    #[test]
    fn a_connection_of_two_sources_is_never_held() {
        let mut c = ConnectionGate::new(Some(WindowEdge::new()));
        assert!(c.for_frame(3).is_some());
        assert!(c.for_frame(3).is_some());
        assert!(c.for_frame(4).is_none());
        assert!(c.for_frame(3).is_none(), "once shared, always read");
        assert!(ConnectionGate::new(None).for_frame(1).is_none(), "clocked sources: never held");
    }

    #[tokio::test]
    async fn a_reader_waits_for_room_in_the_window_as_published() {
        let edge = WindowEdge::new();
        let mut c = ConnectionGate::new(Some(edge.clone()));
        assert!(c.for_frame(0).is_some());
        c.wait_for_room(10, std::future::pending()).await;
        edge.publish(Some(7));
        let waiting = tokio::spawn(async move { c.wait_for_room(10, std::future::pending()).await });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "slice 10 is past a full window ending at 7");
        edge.publish(Some(9));
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "and past one ending at 9");
        edge.publish(Some(10));
        waiting.await.expect("slice 10 is in a window ending at 10");
        edge.publish(Some(3));
        let shared = ConnectionGate::new(Some(edge.clone()));
        shared.wait_for_room(10, std::future::ready(())).await;
    }

    #[tokio::test]
    async fn a_shut_gate_waits_until_opened_or_the_builder_is_gone() {
        let gate = ReadGate::new();
        gate.shut();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let waiting = tokio::spawn({
            let gate = gate.clone();
            async move { gate.pass(async { rx.await.unwrap_or(()) }).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        gate.open();
        waiting.await.expect("opened");
        gate.shut();
        drop(tx);
        gate.pass(std::future::ready(())).await;
    }
}
