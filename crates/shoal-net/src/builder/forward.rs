//! Processed slices on their way to the filter thread, the burst saver's history and the
//! raw tap.

use bytes::Bytes;
use shoal_core::Instant;
use shoal_core::assembly::SliceOutcome;
use shoal_core::frame::{self, Flags, FrameHeader};
use shoal_core::slice::SliceClock;
use shoal_trigger::FragmentData;

use crate::builder::assemble::Assembly;
use crate::builder::filter_queue::FilterQueue;
use crate::live::Live;

/// Picks the slices the raw tap publishes: every `every`-th this builder processes.
pub(super) struct RawSampler {
    pub(super) every: u64,
    pub(super) seen: u64,
    pub(super) slice_clock: SliceClock,
}

impl RawSampler {
    /// The slice's fragments as data frames, concatenated, if this one is sampled.
    fn sample(&mut self, o: &SliceOutcome<FragmentData>) -> Option<Bytes> {
        if self.every == 0 {
            return None;
        }
        self.seen += 1;
        if !(self.seen - 1).is_multiple_of(self.every) {
            return None;
        }
        let mut buf = bytes::BytesMut::new();
        for f in o.fragments.iter().filter(|f| !f.cut_off) {
            // The fragment's own data flags (opaque data, a burst, truncated), so that a
            // tap client reads each payload as what it is.
            let kept = Flags::OPAQUE.union(Flags::BURST).union(Flags::TRUNCATED).bits();
            let header = FrameHeader {
                flags: Flags::from_bits(f.data.flags & kept).unwrap_or(Flags::EMPTY),
                source: f.source,
                hit_count: f.data.hit_count,
                slice: o.slice,
                slice_start: self.slice_clock.start_of(o.slice),
                send_time: Instant::ZERO,
                payload_len: f.data.payload.len() as u32,
            };
            frame::encode_into(&header, &f.data.payload, &mut buf);
        }
        Some(buf.freeze())
    }
}

/// What goes from the assembler to the filter thread: processed slices (a batch a round),
/// the raw tap's samples of them, and the count of those the filter could not take.
pub(super) struct Forwarding {
    pub(super) sampler: RawSampler,
    pub(super) to_filter: FilterQueue<SliceOutcome<FragmentData>>,
    pub(super) not_filtered: Unfiltered,
}

impl Forwarding {
    /// Hands processed slices to the filter thread, keeping them in the burst saver's
    /// history and offering the sampled ones to the raw tap.
    pub(super) fn forward(&mut self, a: &mut Assembly) {
        let Assembly { node, saving, live, clock, .. } = a;
        if let Some(s) = saving.as_mut() {
            s.drain();
        }
        while let Some(o) = node.poll_slice() {
            if let Some(s) = saving.as_mut() {
                // The payloads are shared, not copied: the frame decoder hands out frames
                // that own their buffer (copied out of a shared one when small, read into
                // one of about their size when large:
                // shoal_core::frame::StreamDecoder::prepare_read), so the history keeps
                // alive about what it counts (an eighth more once a connection's frame
                // size is known; up to four times a frame's size before). Copying them
                // here cost 8-17 % of the CPU of a full-shape run.
                s.saver.handle_slice(clock.now(), &o);
                s.drain();
                // One builder per run-controlled process: the gauge is its saver's.
                s.live.saver_bytes.store(s.saver.memory_in_use(), std::sync::atomic::Ordering::Relaxed);
            }
            if live.tap.is_open()
                && let Some(raw) = self.sampler.sample(&o)
            {
                live.tap.offer(crate::tap::TAG_RAW, raw);
            }
            if o.is_complete() {
                Live::add(&live.slices_complete, 1);
            } else {
                Live::add(&live.slices_incomplete, 1);
            }
            if let Err(o) = self.to_filter.offer(o) {
                self.not_filtered.add(o.slice);
                Live::add(&live.slices_not_filtered, 1);
                node.handle_released(o.bytes);
            }
        }
        // One hand-off for every slice of this round.
        if let Err(batch) = self.to_filter.flush() {
            // The filter thread is gone (it only ends after we drop the sender).
            for o in batch {
                node.handle_released(o.bytes);
            }
        }
    }
}

/// Slices assembled but never filtered: counted, and listed up to a bound (the diagnosis
/// names a cause for each).
#[derive(Debug, Default)]
pub(super) struct Unfiltered {
    pub(super) count: u64,
    pub(super) slices: Vec<u64>,
}

impl Unfiltered {
    pub(super) fn add(&mut self, slice: u64) {
        self.count += 1;
        if self.slices.len() < shoal_core::node::MAX_LISTED_SLICES {
            self.slices.push(slice);
        }
    }
}
