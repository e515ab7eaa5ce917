//! A builder in KM3NeT mode (`[km3net]`; docs/km3net.md): its fragments are JDAQ
//! superframes (one DOM's frame of one timeslice, from a `clb:` input). For each complete
//! slice it gives the filter the frames' hits in shoal's hit format, then publishes what
//! KM3NeT's DataFilter publishes, on the dispatcher (through the monitoring tap's bounded
//! queue: a slow dispatcher costs messages, counted, never slices) and in DAQ files (the
//! objects one after another, what km3pipe's `DAQPump` reads):
//! - `IO_TSL0`: the timeslice with every frame as the DataQueue built it (bytes as sent);
//! - `IO_TSL1` / `IO_TSL2` / `IO_TSSN`: frames holding only L1 / L2 / supernova hits;
//! - `IO_EVT`: one JDAQEvent per selected event (triggered hits and the snapshot);
//! - `IO_SUM`: the summaryslice, every DOM's per-PMT rates.
//!
//! The decisions are shoal-core's (`km3net::datafilter`, `km3net::jdaq`); this module
//! moves bytes.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::PathBuf;

use bytes::{BufMut, Bytes, BytesMut};
use shoal_core::SourceId;
use shoal_core::km3net::datafilter::{DataFilterParams, filtered_frame, l2_frame, summary_frame};
use shoal_core::km3net::jdaq::{
    JdaqEvent, JdaqFrame, JdaqHeader, JdaqHit, JdaqSummaryslice, TYPE_L0, TYPE_L1, TYPE_L2, TYPE_SN, decode_superframe,
    encode_event, encode_summaryslice, encode_superframe, timeslice_of_superframes,
};
use shoal_core::slice::SliceClock;
use shoal_trigger::{Event, FragmentData};
use tracing::warn;

use crate::config::{Config, ConfigError};
use crate::live::Live;

/// What a KM3NeT builder published and refused (part of its end-of-run report).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Km3OutReport {
    /// Timeslices with at least one frame.
    pub timeslices: u64,
    pub frames: u64,
    /// Hits in those frames (the filter's input).
    pub hits: u64,
    /// Fragments that are not a superframe (counted, left out of the outputs).
    pub bad_frames: u64,
    /// Messages offered to the dispatcher, per tag (the tap counts what it dropped).
    pub offered: BTreeMap<String, u64>,
    /// Bytes written to the DAQ files, per tag.
    pub file_bytes: BTreeMap<String, u64>,
    /// Files that failed (their tag's file is closed, the run goes on).
    pub file_errors: u64,
}

impl Km3OutReport {
    /// Adds another builder's counters.
    pub fn merge(&mut self, o: &Km3OutReport) {
        self.timeslices += o.timeslices;
        self.frames += o.frames;
        self.hits += o.hits;
        self.bad_frames += o.bad_frames;
        for (k, v) in &o.offered {
            *self.offered.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &o.file_bytes {
            *self.file_bytes.entry(k.clone()).or_default() += v;
        }
        self.file_errors += o.file_errors;
    }
}

/// One slice's frames as the builder got them.
struct Frames {
    header: Option<JdaqHeader>,
    /// (source, the superframe bytes, the decoded frame).
    frames: Vec<(SourceId, Bytes, JdaqFrame)>,
}

/// What the KM3NeT stage runs with, derived from the configuration at start (the detector
/// file read once).
#[derive(Clone, Debug)]
pub struct Km3Settings {
    det_id: i32,
    /// The run number as KM3NeT's headers carry it.
    run: i32,
    first_slice: Option<u64>,
    slice_clock: SliceClock,
    params: DataFilterParams,
    /// Source id to DOM id (for event hits).
    doms: Vec<u32>,
    /// Each DOM's PMT directions (for L2), from the detector file.
    directions: HashMap<u32, Vec<[f64; 3]>>,
    l2_ct_min: f64,
    publish: Vec<&'static str>,
    /// The DAQ files' directory, run number and run type.
    files: Option<(PathBuf, u64, String)>,
}

impl Km3Settings {
    /// `None` when KM3NeT mode is off.
    pub fn from_config(cfg: &Config) -> Result<Option<Self>, ConfigError> {
        let k = &cfg.km3net;
        if !k.is_on() {
            return Ok(None);
        }
        let publish = crate::config::KM3NET_TAGS.iter().copied().filter(|t| k.publish.iter().any(|p| p == t)).collect();
        Ok(Some(Self {
            det_id: k.det_id,
            run: cfg.run.run_number as i32,
            first_slice: cfg.run.start_slice,
            slice_clock: cfg.slice_clock()?,
            params: k.params(),
            doms: k.dom_ids()?,
            directions: if k.publish.iter().any(|t| t == "IO_TSL2") { k.pmt_directions()? } else { HashMap::new() },
            l2_ct_min: k.l2_ct_min,
            publish,
            files: k.files.then(|| (cfg.writer.out_dir.clone(), cfg.run.run_number, cfg.run.run_type.clone())),
        }))
    }
}

/// The KM3NeT stage of one builder's filter thread.
type DaqFile = std::io::BufWriter<shoal_store::custody::ChecksumWriter<std::fs::File>>;

pub struct Km3Out {
    builder: u32,
    s: Km3Settings,
    /// The open DAQ files by tag, each counting its bytes and adler32 as they are written,
    /// with the objects written to it.
    open: HashMap<&'static str, (DaqFile, u64)>,
    trigger_counter: u64,
    report: Km3OutReport,
}

impl Km3Out {
    /// The stage for builder `builder`.
    pub fn new(s: Km3Settings, builder: u32) -> Self {
        Self { builder, s, open: HashMap::new(), trigger_counter: 0, report: Km3OutReport::default() }
    }

    /// The slice's superframes decoded, and their hits as the filter's fragments.
    pub fn decode(&mut self, fragments: &[FragmentData]) -> (Vec<FragmentData>, KmSlice) {
        let mut out = Frames { header: None, frames: Vec::with_capacity(fragments.len()) };
        let mut for_filter = Vec::with_capacity(fragments.len());
        for f in fragments {
            if f.payload.is_empty() {
                // The DOM sent nothing this timeslice.
                continue;
            }
            match decode_superframe(&f.payload) {
                Ok((h, frame)) => {
                    out.header.get_or_insert(h);
                    self.report.hits += frame.hits.len() as u64;
                    let mut hits = BytesMut::with_capacity(6 * frame.hits.len());
                    for hit in &frame.hits {
                        hits.put_u8(hit.channel);
                        hits.put_u32_le(hit.time_ns);
                        hits.put_u8(hit.tot);
                    }
                    for_filter.push(FragmentData {
                        source: f.source,
                        flags: f.flags,
                        hit_count: frame.hits.len() as u32,
                        payload: hits.freeze(),
                    });
                    out.frames.push((f.source, f.payload.clone(), frame));
                }
                Err(e) => {
                    if self.report.bad_frames.is_multiple_of(1000) {
                        warn!(source = f.source, kind = e.kind(), "km3net: a fragment is not a JDAQ superframe: {e}");
                    }
                    self.report.bad_frames += 1;
                }
            }
        }
        (for_filter, KmSlice(out))
    }

    /// Publishes and writes the slice's outputs.
    pub fn publish(&mut self, slice: u64, frames: KmSlice, events: &[Event], live: &Live) {
        let KmSlice(mut f) = frames;
        if f.frames.is_empty() && events.is_empty() {
            return;
        }
        f.frames.sort_by_key(|(_, _, fr)| fr.dom_id);
        let header = f.header.unwrap_or_else(|| {
            let index = self.s.first_slice.map_or(0, |first| slice.saturating_sub(first) + 1);
            JdaqHeader::at(self.s.det_id, self.s.run, index as i32, self.s.slice_clock.start_of(slice).as_nanos())
        });
        self.report.timeslices += 1;
        self.report.frames += f.frames.len() as u64;
        let dom_of: HashMap<SourceId, u32> = f.frames.iter().map(|(s, _, fr)| (*s, fr.dom_id)).collect();
        for tag in self.s.publish.clone() {
            let messages: Vec<Vec<u8>> = match tag {
                "IO_TSL0" => vec![timeslice_of_superframes(TYPE_L0, &header, f.frames.iter().map(|(_, b, _)| &b[..]))],
                "IO_TSL1" | "IO_TSSN" => {
                    let sn = tag == "IO_TSSN";
                    let enc: Vec<Vec<u8>> = f
                        .frames
                        .iter()
                        .map(|(_, _, fr)| encode_superframe(&header, &filtered_frame(fr, &self.s.params, sn)))
                        .collect();
                    let kind = if sn { TYPE_SN } else { TYPE_L1 };
                    vec![timeslice_of_superframes(kind, &header, enc.iter().map(Vec::as_slice))]
                }
                "IO_TSL2" => {
                    let enc: Vec<Vec<u8>> = f
                        .frames
                        .iter()
                        .map(|(_, _, fr)| {
                            let dirs = self.s.directions.get(&fr.dom_id).map_or(&[][..], Vec::as_slice);
                            encode_superframe(
                                &header,
                                &l2_frame(fr, self.s.params.l1_window_ns, dirs, self.s.l2_ct_min),
                            )
                        })
                        .collect();
                    vec![timeslice_of_superframes(TYPE_L2, &header, enc.iter().map(Vec::as_slice))]
                }
                "IO_SUM" => {
                    let slice_ns = self.s.slice_clock.length().as_nanos() as u64;
                    let s = JdaqSummaryslice {
                        header,
                        frames: f.frames.iter().map(|(_, _, fr)| summary_frame(fr, slice_ns)).collect(),
                    };
                    vec![encode_summaryslice(&s)]
                }
                "IO_EVT" => events
                    .iter()
                    .map(|e| {
                        self.trigger_counter += 1;
                        encode_event(&self.event(&header, e, &dom_of))
                    })
                    .collect(),
                _ => Vec::new(),
            };
            for m in messages {
                *self.report.offered.entry(tag.to_string()).or_default() += 1;
                self.write(tag, &m);
                live.tap.offer(tag, Bytes::from(m));
            }
        }
    }

    fn event(&self, header: &JdaqHeader, e: &Event, dom_of: &HashMap<SourceId, u32>) -> JdaqEvent {
        let dom = |s: SourceId| dom_of.get(&s).copied().or_else(|| self.s.doms.get(s as usize).copied()).unwrap_or(s);
        let hit = |h: &shoal_trigger::EventHit| JdaqHit {
            dom_id: dom(h.source),
            channel: h.channel,
            time_ns: h.time_ns,
            tot: h.amplitude,
        };
        let mask = u64::from(e.trigger_mask);
        JdaqEvent {
            header: *header,
            trigger_counter: self.trigger_counter,
            trigger_mask: mask,
            overlays: e.overlays,
            triggered: e.hits.iter().filter(|h| h.triggered).map(|h| (hit(h), mask)).collect(),
            snapshot: e.hits.iter().map(hit).collect(),
        }
    }

    fn write(&mut self, tag: &'static str, bytes: &[u8]) {
        let Some((dir, run, _)) = &self.s.files else { return };
        let file = match self.open.entry(tag) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let path = dir.join(format!("run{run:06}.builder{}.{tag}.dat", self.builder));
                let opened = std::fs::create_dir_all(dir).and_then(|_| std::fs::File::create(&path));
                match opened {
                    Ok(f) => v.insert((std::io::BufWriter::new(shoal_store::custody::ChecksumWriter::new(f)), 0)),
                    Err(e) => {
                        warn!(path = %path.display(), "km3net: cannot write DAQ file: {e}");
                        self.report.file_errors += 1;
                        self.s.files = None;
                        return;
                    }
                }
            }
        };
        match file.0.write_all(bytes) {
            Ok(()) => {
                file.1 += 1;
                *self.report.file_bytes.entry(tag.to_string()).or_default() += bytes.len() as u64;
            }
            Err(e) => {
                warn!(tag, "km3net: writing the DAQ file failed, closing it: {e}");
                self.report.file_errors += 1;
                self.open.remove(tag);
            }
        }
    }

    /// Closes the files (synced, each with its metadata beside it: size, adler32, run,
    /// objects; `shoal_store::custody`); the report.
    pub fn finish(mut self) -> Km3OutReport {
        let Some((dir, run, run_type)) = self.s.files.clone() else { return self.report };
        for (tag, (f, objects)) in self.open.drain() {
            let path = dir.join(format!("run{run:06}.builder{}.{tag}.dat", self.builder));
            let closed = f.into_inner().map_err(|e| e.into_error()).and_then(|w| {
                let (file, seal) = w.into_parts();
                file.sync_all()?;
                shoal_store::custody::FileMetadata {
                    file_name: path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
                    file_size: seal.bytes,
                    checksum: seal.checksum(),
                    runs: vec![(run, 0, run_type.clone())],
                    events: objects,
                    data_tier: if tag == "IO_EVT" { "filtered" } else { "raw" }.into(),
                    file_format: "km3net-daq".into(),
                    producer: format!("builder{}", self.builder),
                    closed_at: shoal_store::custody::unix_now(),
                    application_version: env!("CARGO_PKG_VERSION").into(),
                    ..Default::default()
                }
                .write_beside(&path)
            });
            if let Err(e) = closed {
                warn!(tag, "km3net: closing the DAQ file failed: {e}");
                self.report.file_errors += 1;
            }
        }
        self.report
    }
}

/// A slice's decoded frames, between [`Km3Out::decode`] and [`Km3Out::publish`].
pub struct KmSlice(Frames);
