//! Assembly: what every arrival does to the builder's node machine, and what the driver
//! measures beside it (delays, hits, the largest delay per second).

use std::sync::Arc;

use hdrhistogram::Histogram;
use shoal_core::assembly::Admission;
use shoal_core::frame::{self, Flags, Frame};
use shoal_core::node::{Arrival, BuilderNode};
use shoal_core::slice::{SliceClock, SliceNumber};
use shoal_core::{Instant, SourceId};
use shoal_trigger::FragmentData;
use tokio::sync::mpsc;

use crate::builder::accept::Incoming;
use crate::builder::hold::Held;
use crate::builder::pull::{HELLO_WAITS_FOR_SOURCES, RequestRoute, Routes};
use crate::builder::saving::Saving;
use crate::clock::WallClock;
use crate::live::Live;
use crate::report::new_histogram;
use crate::transport::udp::Received;

/// What the driver measures beside the node: delays and the filter's input.
pub(super) struct Measured {
    pub(super) net: Histogram<u64>,
    pub(super) shaping: Histogram<u64>,
    pub(super) hits: u64,
    first_arrival: Option<Instant>,
    pub(super) max_by_second: Vec<u64>,
    /// Delays from `steady_from` on (the run's first slice plus the warm-up; without a
    /// start slice, counted from the first fragment's).
    pub(super) steady: Histogram<u64>,
    steady_from: Option<SliceNumber>,
    slice_clock: SliceClock,
}

impl Measured {
    pub(super) fn new(slice_clock: SliceClock, steady_from: Option<SliceNumber>) -> Self {
        Self {
            net: new_histogram(),
            shaping: new_histogram(),
            hits: 0,
            first_arrival: None,
            max_by_second: Vec::new(),
            steady: new_histogram(),
            steady_from,
            slice_clock,
        }
    }

    /// Keeps the largest delay per second of arrival (bounded: a second is one entry).
    fn record_by_second(&mut self, arrival: Instant, us: u64) {
        let first = *self.first_arrival.get_or_insert(arrival);
        let second = (arrival.saturating_duration_since(first).as_secs()) as usize;
        if second >= self.max_by_second.len() {
            self.max_by_second.resize(second + 1, 0);
        }
        self.max_by_second[second] = self.max_by_second[second].max(us);
    }
}

/// The state every arrival touches: the node, what is measured beside it, where pull
/// requests go, the burst saver, and the fragments held back from free-running sources.
pub(super) struct Assembly {
    pub(super) node: BuilderNode<FragmentData>,
    pub(super) measured: Measured,
    pub(super) routes: Routes,
    pub(super) saving: Option<Saving>,
    pub(super) held: Held,
    pub(super) live: Arc<Live>,
    pub(super) clock: WallClock,
}

impl Assembly {
    /// A message from a connection's reader or the data-flow manager's client.
    pub(super) fn on_incoming(&mut self, m: Incoming) {
        let (frame, arrival) = match m {
            Incoming::Frame { frame, arrival, gate: None } => (frame, arrival),
            Incoming::Frame { frame, arrival, gate: Some(gate) } => {
                match self.held.offer(&self.node, &gate, frame, arrival) {
                    Some(taken) => taken,
                    None => return,
                }
            }
            Incoming::Rejected { reason } => {
                self.node.handle_rejected(reason);
                Live::add(&self.live.rejected_connections, 1);
                return;
            }
            Incoming::Hello { source, requests } => {
                self.routes.sources.insert(source, RequestRoute::Tcp(requests));
                self.routes.greet_dfm(&self.node);
                return;
            }
            Incoming::DfmUp { out } => {
                // The manager (new, or restarted) learns what this builder holds, once
                // the sources can be asked.
                self.routes.dfm = None;
                self.routes.dfm_waiting = Some((out, std::time::Instant::now() + HELLO_WAITS_FOR_SOURCES));
                self.routes.greet_dfm(&self.node);
                return;
            }
            Incoming::Assign { slice } => {
                self.node.handle_assignment(self.clock.now(), slice);
                return;
            }
            Incoming::Batch { messages, _room } => {
                for m in messages {
                    self.on_incoming(m);
                }
                return;
            }
        };
        self.on_frame(frame, arrival, false);
    }

    /// What the datagram endpoint hands over: whole frames, damage, ends of stream.
    pub(super) fn on_received(&mut self, r: Received, udp_requests: &mpsc::UnboundedSender<(SourceId, SliceNumber)>) {
        match r {
            Received::Frame { frame, recovered } => self.on_frame(frame, self.clock.now(), recovered),
            Received::Damaged { source, n } => self.node.handle_damaged(source, n),
            Received::Ended { source } => self.node.handle_end_of_stream(self.clock.now(), source),
            Received::Greeted { source } => {
                self.routes.sources.insert(source, RequestRoute::Udp(udp_requests.clone()));
                self.routes.greet_dfm(&self.node);
            }
        }
    }

    /// Takes in what was held back from free-running sources once there is room for it
    /// (`all`: everything, at the end of a run).
    pub(super) fn release_held(&mut self, all: bool) {
        if !all && self.held.is_empty() {
            return;
        }
        let Self { node, measured, saving, held, live, .. } = self;
        held.release(node, all, |node, frame, at| take_frame(node, measured, saving, live, frame, at, false));
    }

    fn on_frame(&mut self, frame: Frame, arrival: Instant, recovered: bool) {
        take_frame(&mut self.node, &mut self.measured, &mut self.saving, &self.live, frame, arrival, recovered);
    }
}

/// One frame into the node: an end of stream, or a fragment (its delays measured, a late
/// one offered to the burst saver's late-data stream).
fn take_frame(
    node: &mut BuilderNode<FragmentData>,
    measured: &mut Measured,
    saving: &mut Option<Saving>,
    live: &Live,
    frame: Frame,
    arrival: Instant,
    recovered: bool,
) {
    let h = frame.header;
    let data = FragmentData { source: h.source, flags: h.flags.bits(), hit_count: h.hit_count, payload: frame.payload };
    if h.flags.contains(Flags::END_OF_STREAM) {
        node.handle_end_of_stream(arrival, h.source);
        return;
    }
    let a = Arrival { recovered, ..Arrival::from_header(&h) };
    let (o, late) = node.handle_fragment_keep(arrival, a, data);
    // A late fragment goes to the late-data side stream if it has room.
    if let (Some(data), Some(s)) = (late, saving.as_mut())
        && s.saver.handle_late(a.source, a.slice, a.wire_bytes, data)
    {
        node.handle_salvaged();
        s.drain();
    }
    if let Some(d) = o.network_delay {
        let us = (d.as_micros() as u64).max(1);
        let _ = measured.net.record(us);
        measured.record_by_second(arrival, us);
        let clock = measured.slice_clock;
        if a.slice >= *measured.steady_from.get_or_insert_with(|| shoal_core::node::steady_from(a.slice, clock)) {
            let _ = measured.steady.record(us);
        }
        live.record_delay(us);
    }
    if let Some(d) = o.shaping_delay {
        let _ = measured.shaping.record((d.as_micros() as u64).max(1));
    }
    if o.admission == Admission::Accepted {
        measured.hits += u64::from(h.hit_count);
        Live::add(&live.fragments_received, 1);
        Live::add(&live.bytes_received, h.payload_len as u64 + frame::HEADER_LEN as u64);
    } else {
        Live::add(&live.fragments_discarded_at_builder, 1);
        if o.admission == Admission::DroppedOverload {
            Live::add(&live.fragments_refused_by_budget, 1);
        }
    }
}
