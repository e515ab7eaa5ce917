//! KM3NeT's DataQueue, sans-IO: CLB optical packets reassembled into one frame per DOM
//! and timeslice, in UDP sequence order; a gap in the sequence marks the frame incomplete
//! (counted, as the DataQueue status says it), nothing else is fatal.
//!
//! The driver hands every datagram to [`DataQueue::handle_packet`] and, as time passes,
//! closes the timeslices it will no longer wait for with [`DataQueue::close_below`]
//! (the host's clock plus a latency: no trailer packet is relied on). A packet for a
//! closed timeslice is counted `late`.

use std::collections::{BTreeMap, BTreeSet};

use super::clb::{ClbDataType, ClbHit, decode_packet};

/// What a DataQueue is told at start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataQueueConfig {
    /// Timeslice length (KM3NeT: 100 ms).
    pub slice_ns: u64,
    /// The DOMs of the detector (from its detector file); `None` takes any.
    pub doms: Option<BTreeSet<u32>>,
    /// Most packets held per open frame (a bound on what one DOM can hold).
    pub max_packets_per_frame: usize,
}

/// One DOM's frame of one timeslice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DomFrame {
    pub dom_id: u32,
    pub run: u32,
    /// The timeslice start, UNIX ns.
    pub timeslice_start_ns: u64,
    /// The DOM status of its last packet.
    pub dom_status: u32,
    /// Hits in UDP sequence order (each packet's hits in their order).
    pub hits: Vec<ClbHit>,
    /// Packets received, and missing from the sequence (gaps below the highest received).
    pub packets: u32,
    pub missing: u32,
}

impl DomFrame {
    /// No packet missing (that the sequence shows).
    pub fn is_complete(&self) -> bool {
        self.missing == 0
    }
}

/// What a DataQueue counted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct DataQueueReport {
    pub packets: u64,
    pub optical_packets: u64,
    pub hits: u64,
    /// Acoustic and monitoring packets, counted and skipped.
    pub skipped: BTreeMap<String, u64>,
    /// Packets refused, by reason (`short`, `unknown_type`, `ragged_hits`, `unknown_dom`,
    /// `misaligned`, `late`, `duplicate`, `frame_full`).
    pub refused: BTreeMap<String, u64>,
    pub frames: u64,
    pub frames_incomplete: u64,
    pub packets_missing: u64,
    /// Datagrams the host's kernel dropped before the DataQueue saw them (its receive
    /// buffer was full; filled in by the driver, which owns the socket).
    #[cfg_attr(feature = "serde", serde(default))]
    pub dropped_by_kernel: u64,
}

impl DataQueueReport {
    /// Adds another DataQueue's counters (several source processes of one run).
    pub fn merge(&mut self, o: &DataQueueReport) {
        self.packets += o.packets;
        self.optical_packets += o.optical_packets;
        self.hits += o.hits;
        for (k, v) in &o.skipped {
            *self.skipped.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &o.refused {
            *self.refused.entry(k.clone()).or_default() += v;
        }
        self.frames += o.frames;
        self.frames_incomplete += o.frames_incomplete;
        self.packets_missing += o.packets_missing;
        self.dropped_by_kernel += o.dropped_by_kernel;
    }
}

#[derive(Debug, Default)]
struct Open {
    run: u32,
    dom_status: u32,
    by_sequence: BTreeMap<u32, Vec<ClbHit>>,
}

/// The reassembler. See the module documentation.
#[derive(Debug)]
pub struct DataQueue {
    cfg: DataQueueConfig,
    open: BTreeMap<(u64, u32), Open>,
    closed_below_ns: u64,
    report: DataQueueReport,
}

impl DataQueue {
    pub fn new(cfg: DataQueueConfig) -> Self {
        Self { cfg, open: BTreeMap::new(), closed_below_ns: 0, report: DataQueueReport::default() }
    }

    fn refuse(&mut self, kind: &str) {
        *self.report.refused.entry(kind.to_string()).or_default() += 1;
    }

    /// One datagram's payload. Returns whether its hits were taken.
    pub fn handle_packet(&mut self, bytes: &[u8]) -> bool {
        self.report.packets += 1;
        let p = match decode_packet(bytes) {
            Ok(p) => p,
            Err(e) => {
                self.refuse(e.kind());
                return false;
            }
        };
        let h = p.header;
        match h.data_type {
            ClbDataType::Optical => {}
            other => {
                let name = if other == ClbDataType::Acoustic { "acoustic" } else { "monitoring" };
                *self.report.skipped.entry(name.to_string()).or_default() += 1;
                return false;
            }
        }
        if self.cfg.doms.as_ref().is_some_and(|d| !d.contains(&h.dom_id)) {
            self.refuse("unknown_dom");
            return false;
        }
        let start = h.timeslice_start_ns();
        if self.cfg.slice_ns == 0 || !start.is_multiple_of(self.cfg.slice_ns) {
            self.refuse("misaligned");
            return false;
        }
        if start < self.closed_below_ns {
            self.refuse("late");
            return false;
        }
        let max = self.cfg.max_packets_per_frame;
        let open = self.open.entry((start, h.dom_id)).or_default();
        if open.by_sequence.contains_key(&h.udp_sequence) {
            self.refuse("duplicate");
            return false;
        }
        if open.by_sequence.len() >= max {
            self.refuse("frame_full");
            return false;
        }
        open.run = h.run;
        open.dom_status = h.dom_status;
        let hits: Vec<ClbHit> = p.hits().collect();
        self.report.optical_packets += 1;
        self.report.hits += hits.len() as u64;
        open.by_sequence.insert(h.udp_sequence, hits);
        true
    }

    /// Closes every timeslice starting before `ns`: their frames, ordered by (timeslice,
    /// DOM). Later packets for them are counted `late`.
    pub fn close_below(&mut self, ns: u64) -> Vec<DomFrame> {
        self.closed_below_ns = self.closed_below_ns.max(ns);
        let keep = self.open.split_off(&(ns, 0));
        let done = std::mem::replace(&mut self.open, keep);
        done.into_iter()
            .map(|((start, dom_id), open)| {
                let packets = open.by_sequence.len() as u32;
                let highest = open.by_sequence.keys().next_back().copied().unwrap_or(0);
                // Sequence numbers start at 0 in every timeslice: those below the highest
                // that never came are missing (a lost tail cannot be seen without a trailer).
                let missing = highest.saturating_add(1).saturating_sub(packets);
                self.report.frames += 1;
                if missing > 0 {
                    self.report.frames_incomplete += 1;
                    self.report.packets_missing += u64::from(missing);
                }
                DomFrame {
                    dom_id,
                    run: open.run,
                    timeslice_start_ns: start,
                    dom_status: open.dom_status,
                    hits: open.by_sequence.into_values().flatten().collect(),
                    packets,
                    missing,
                }
            })
            .collect()
    }

    /// Frames still open.
    pub fn open_frames(&self) -> usize {
        self.open.len()
    }

    pub fn report(&self) -> &DataQueueReport {
        &self.report
    }
}

#[cfg(test)]
mod tests {
    use super::super::clb::{ClbHeader, encode_optical};
    use super::*;

    const SLICE: u64 = 100_000_000;

    fn packet(dom: u32, slice: u64, seq: u32, hits: &[(u8, u32)]) -> Vec<u8> {
        let start = 1_700_000_000 * 1_000_000_000 + slice * SLICE;
        let h = ClbHeader {
            data_type: ClbDataType::Optical,
            run: 5,
            udp_sequence: seq,
            timestamp_s: (start / 1_000_000_000) as u32,
            ticks: ((start % 1_000_000_000) / 16) as u32,
            dom_id: dom,
            dom_status: 0x8000_0000,
        };
        let hits: Vec<_> = hits.iter().map(|&(channel, time_ns)| ClbHit { channel, time_ns, tot: 20 }).collect();
        encode_optical(&h, &hits)
    }

    fn dq() -> DataQueue {
        DataQueue::new(DataQueueConfig { slice_ns: SLICE, doms: Some([11, 12].into()), max_packets_per_frame: 4 })
    }

    fn start(slice: u64) -> u64 {
        1_700_000_000 * 1_000_000_000 + slice * SLICE
    }

    #[test]
    fn packets_out_of_order_make_one_frame_in_sequence_order() {
        let mut q = dq();
        assert!(q.handle_packet(&packet(11, 0, 1, &[(2, 50)])));
        assert!(q.handle_packet(&packet(11, 0, 0, &[(1, 10), (1, 20)])));
        assert!(q.handle_packet(&packet(12, 0, 0, &[(5, 7)])));
        assert!(q.handle_packet(&packet(11, 1, 0, &[(9, 1)])));
        let frames = q.close_below(start(1));
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[0].dom_id, 11);
        assert_eq!(frames[0].hits.iter().map(|h| h.time_ns).collect::<Vec<_>>(), [10, 20, 50]);
        assert!(frames.iter().all(DomFrame::is_complete));
        assert_eq!(q.open_frames(), 1, "slice 1 still open");
        assert_eq!(q.report().hits, 5);
    }

    #[test]
    fn gaps_late_duplicates_and_strangers_are_counted_never_fatal() {
        let mut q = dq();
        assert!(q.handle_packet(&packet(11, 0, 0, &[(1, 1)])));
        assert!(q.handle_packet(&packet(11, 0, 3, &[(1, 2)])));
        assert!(!q.handle_packet(&packet(11, 0, 3, &[(1, 2)])), "duplicate");
        assert!(!q.handle_packet(&packet(99, 0, 0, &[])), "not in the detector");
        assert!(!q.handle_packet(&[1, 2, 3]), "short");
        let mut acoustic = packet(11, 0, 9, &[]);
        acoustic[..4].copy_from_slice(b"TAES");
        assert!(!q.handle_packet(&acoustic));
        let frames = q.close_below(start(1));
        assert_eq!((frames[0].packets, frames[0].missing), (2, 2), "1 and 2 never came");
        assert!(!q.handle_packet(&packet(12, 0, 0, &[])), "its timeslice is closed");
        for s in 4..9 {
            q.handle_packet(&packet(12, 2, s, &[]));
        }
        let r = q.report();
        let refused: Vec<_> = r.refused.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        assert_eq!(refused, [("duplicate", 1), ("frame_full", 1), ("late", 1), ("short", 1), ("unknown_dom", 1)]);
        assert_eq!(r.skipped["acoustic"], 1);
        assert_eq!((r.frames, r.frames_incomplete, r.packets_missing), (1, 1, 2));
    }
}
