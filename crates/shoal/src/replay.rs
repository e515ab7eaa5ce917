//! `shoal replay`: real KM3NeT data through the builder's assembly and the muon filter.
//!
//! Input is a hit table written by `scripts/km3net_to_shoal.py` (format in that script):
//! - time slices (kind 1): each slice's per-DOM hits become shoal frames (encoded and
//!   decoded with the wire format), go through the builder's `BuilderNode`, then the
//!   filter; events are written to Parquet like a builder's;
//! - triggered events (kind 2): each event's snapshot hits go through the filter and our
//!   triggered hits are compared with the flags the KM3NeT trigger stored.
//!
//! Geometry (positions and time calibration) comes from a `.detx` file; DOMs it does not
//! know are kept (their hits are in slices and events) but cannot take part in the 3D
//! trigger, and are counted.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use bytes::BytesMut;
use clap::Parser;
use serde::Serialize;
use shoal_core::assembly::AssemblerConfig;
use shoal_core::frame::{self, Flags, FrameHeader};
use shoal_core::hit::Hit;
use shoal_core::node::{BuilderNode, BuilderNodeConfig};
use shoal_core::slice::SliceClock;
use shoal_core::{Duration, Instant};
use shoal_detector::geometry::Geometry;
use shoal_trigger::muon::{L1Kind, MuonConfig, MuonFilter};
use shoal_trigger::{FragmentData, SliceData};

#[derive(Parser)]
pub struct ReplayArgs {
    /// Hit table from scripts/km3net_to_shoal.py.
    pub input: PathBuf,
    /// KM3NeT geometry (.detx) for positions and time calibration.
    #[arg(long)]
    pub detx: PathBuf,
    /// Slice length of the data, ms (KM3NeT: 100).
    #[arg(long, default_value_t = 100)]
    pub slice_ms: u64,
    /// Causality cluster: minimum L1 hits and DOMs (ARCA 5, ORCA 4).
    #[arg(long, default_value_t = 5)]
    pub min_hits: usize,
    /// KM3NeT L1 window TMaxLocal, ns.
    #[arg(long, default_value_t = 25)]
    pub l1_window_ns: u32,
    /// Longest cluster, ns.
    #[arg(long, default_value_t = 5_000)]
    pub window_ns: u32,
    /// Confirm clusters with the direction scan (1 degree steps, as ARCA).
    #[arg(long)]
    pub direction_scan: bool,
    /// Write the events of time slices here (Parquet).
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Clone, Copy)]
struct Record {
    group: u32,
    dom: u32,
    hit: Hit,
    flagged: bool,
}

fn read_table(path: &std::path::Path) -> anyhow::Result<(u32, Vec<Record>)> {
    let b = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    if b.len() < 20 || &b[..4] != b"SHKM" {
        bail!("{}: not a shoal hit table (magic SHKM)", path.display());
    }
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
    if u32_at(4) != 1 {
        bail!("{}: hit table version {} (this shoal reads 1)", path.display(), u32_at(4));
    }
    let kind = u32_at(8);
    let n = u64::from_le_bytes(b[12..20].try_into().expect("8 bytes")) as usize;
    if b.len() != 20 + 15 * n {
        bail!("{}: {} records announced but {} bytes of records", path.display(), n, b.len() - 20);
    }
    let records = b[20..]
        .chunks_exact(15)
        .map(|r| Record {
            group: u32::from_le_bytes(r[0..4].try_into().expect("4")),
            dom: u32::from_le_bytes(r[4..8].try_into().expect("4")),
            hit: Hit { channel: r[8], time_ns: u32::from_le_bytes(r[9..13].try_into().expect("4")), amplitude: r[13] },
            flagged: r[14] & 1 == 1,
        })
        .collect();
    Ok((kind, records))
}

/// Module indices: the detx modules first, unknown DOMs after them.
struct DomMap {
    index: HashMap<u32, u32>,
    unknown: Vec<u32>,
}

impl DomMap {
    fn new(g: &Geometry, records: &[Record]) -> Self {
        let mut index: HashMap<u32, u32> = g.modules.iter().enumerate().map(|(i, m)| (m.id, i as u32)).collect();
        let known = index.len();
        let mut unknown: Vec<u32> = records.iter().map(|r| r.dom).filter(|d| !index.contains_key(d)).collect();
        unknown.sort_unstable();
        unknown.dedup();
        for (k, d) in unknown.iter().enumerate() {
            index.insert(*d, (known + k) as u32);
        }
        Self { index, unknown }
    }
}

fn fragments(records: &[Record], map: &DomMap) -> BTreeMap<u32, Vec<(Hit, bool)>> {
    let mut by_source: BTreeMap<u32, Vec<(Hit, bool)>> = BTreeMap::new();
    for r in records {
        by_source.entry(map.index[&r.dom]).or_default().push((r.hit, r.flagged));
    }
    for v in by_source.values_mut() {
        v.sort_by_key(|(h, _)| *h);
    }
    by_source
}

fn payload(hits: &[(Hit, bool)]) -> bytes::Bytes {
    let mut b = BytesMut::with_capacity(hits.len() * 6);
    for (h, _) in hits {
        h.encode(&mut b);
    }
    b.freeze()
}

#[derive(Serialize)]
struct SliceReport {
    slices: u64,
    complete: u64,
    doms: usize,
    doms_not_in_detx: usize,
    hits: u64,
    l1_hits: u64,
    l1_fraction: f64,
    trigger_hits: u64,
    clusters: u64,
    events: u64,
    event_hits: u64,
    vetoed_module_slices: u64,
    events_file: Option<String>,
}

#[derive(Serialize)]
struct FlagReport {
    events: u64,
    /// Events in which our trigger fired.
    events_triggered: u64,
    snapshot_hits: u64,
    stored_triggered: u64,
    our_triggered: u64,
    /// Hits both triggers flagged, only ours, only the stored one.
    both: u64,
    only_ours: u64,
    only_stored: u64,
    /// both / stored (how many of KM3NeT's triggered hits we also flag).
    recall: f64,
    /// both / ours (how many of ours KM3NeT flagged too).
    precision: f64,
    doms_not_in_detx: usize,
}

pub fn command(args: ReplayArgs) -> anyhow::Result<ExitCode> {
    let text = std::fs::read_to_string(&args.detx).with_context(|| format!("reading {}", args.detx.display()))?;
    let geometry = Geometry::from_detx(&text)?;
    let (kind, records) = read_table(&args.input)?;
    let map = DomMap::new(&geometry, &records);
    let mut cfg = MuonConfig {
        geometry: args.detx.display().to_string(),
        window_ns: args.window_ns,
        min_hits: args.min_hits,
        min_modules: args.min_hits,
        direction_scan: args.direction_scan,
        scan_step_deg: 1.0,
        ..Default::default()
    };
    cfg.l1.kind = L1Kind::Km3net;
    cfg.l1.window_ns = args.l1_window_ns;
    let mut filter = MuonFilter::new(cfg, geometry.clone());
    let slice_ns = args.slice_ms * 1_000_000;
    let mut groups: BTreeMap<u32, Vec<Record>> = BTreeMap::new();
    for r in records {
        groups.entry(r.group).or_default().push(r);
    }
    match kind {
        1 => replay_slices(&args, &map, &mut filter, &groups, slice_ns)?,
        2 => compare_flags(&args, &map, &mut filter, &groups, slice_ns)?,
        other => bail!("hit table kind {other} (1: time slices, 2: events)"),
    }
    Ok(ExitCode::SUCCESS)
}

/// Time slices (table kind 1): every DOM's hits of a slice through the wire format into a
/// builder node, each built slice through the filter, its events to a file if asked.
fn replay_slices(
    args: &ReplayArgs,
    map: &DomMap,
    filter: &mut MuonFilter,
    groups: &BTreeMap<u32, Vec<Record>>,
    slice_ns: u64,
) -> anyhow::Result<()> {
    let n_sources = map.index.len() as u32;
    // The builder node, as a builder process runs it; the driver here is a loop.
    let mut node: BuilderNode<FragmentData> = BuilderNode::new(BuilderNodeConfig {
        id: 0,
        assembler: AssemblerConfig {
            n_sources,
            max_active: 2,
            wall_timeout: Duration::from_secs(3600),
            memory_budget: 1 << 34,
        },
        slice_clock: SliceClock::new(Duration::from_nanos(slice_ns)),
    });
    let mut writer = match &args.out {
        Some(dir) => {
            std::fs::create_dir_all(dir)?;
            Some(shoal_store::EventFileWriter::create(dir.join("replay.events.parquet"), 0)?)
        }
        None => None,
    };
    let mut report = SliceReport {
        slices: 0,
        complete: 0,
        doms: map.index.len(),
        doms_not_in_detx: map.unknown.len(),
        hits: 0,
        l1_hits: 0,
        l1_fraction: 0.0,
        trigger_hits: 0,
        clusters: 0,
        events: 0,
        event_hits: 0,
        vetoed_module_slices: 0,
        events_file: None,
    };
    let now = Instant::ZERO;
    let mut process = |node: &mut BuilderNode<FragmentData>, report: &mut SliceReport| -> anyhow::Result<()> {
        while let Some(o) = node.poll_slice() {
            report.slices += 1;
            report.complete += u64::from(o.is_complete());
            let (slice, bytes) = (o.slice, o.bytes);
            let data =
                SliceData { slice, slice_start_ns: slice * slice_ns, slice_ns, fragments: o.into_filter_input() };
            let events = filter.process_slice(&data);
            report.events += events.len() as u64;
            report.event_hits += events.iter().map(|e| e.hits.len() as u64).sum::<u64>();
            if let Some(w) = writer.as_mut() {
                w.write_slice(0, slice, data.slice_start_ns, &events)?;
            }
            node.handle_released(bytes);
        }
        Ok(())
    };
    for (group, recs) in groups {
        let slice = u64::from(*group);
        let by_source = fragments(recs, map);
        for source in 0..n_sources {
            let hits = by_source.get(&source).map(Vec::as_slice).unwrap_or(&[]);
            report.hits += hits.len() as u64;
            // Through the wire format, as a builder receives it.
            let body = payload(hits);
            let header = FrameHeader {
                flags: Flags::default(),
                source,
                hit_count: hits.len() as u32,
                slice,
                slice_start: Instant::from_nanos(slice * slice_ns),
                send_time: Instant::ZERO,
                payload_len: body.len() as u32,
            };
            let wire = frame::encode(&header, &body);
            let (f, _) = frame::decode(&wire, u32::MAX >> 1).context("re-decoding a frame")?;
            let data = FragmentData {
                source,
                flags: f.header.flags.bits(),
                hit_count: f.header.hit_count,
                payload: f.payload,
            };
            node.handle_frame(now, &f.header, data);
        }
        process(&mut node, &mut report)?;
    }
    node.handle_drain(now);
    process(&mut node, &mut report)?;
    if let Some(w) = writer {
        let path = w.path().to_path_buf();
        w.close()?;
        report.events_file = Some(path.display().to_string());
    }
    report.l1_hits = filter.stats.l1_hits;
    report.l1_fraction = report.l1_hits as f64 / report.hits.max(1) as f64;
    report.trigger_hits = filter.stats.trigger_hits;
    report.clusters = filter.stats.clusters;
    report.vetoed_module_slices = filter.stats.vetoed_modules;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "replayed {} slices ({} complete) of {} DOMs ({} not in the detx): {} hits, {} L1 ({:.1}%), {} clusters, {} events ({} hits)",
            report.slices,
            report.complete,
            report.doms,
            report.doms_not_in_detx,
            report.hits,
            report.l1_hits,
            100.0 * report.l1_fraction,
            report.clusters,
            report.events,
            report.event_hits
        );
    }
    Ok(())
}

/// Events (table kind 2): each event's snapshot hits through the filter, our triggered
/// hits compared with the ones KM3NeT's trigger flagged.
fn compare_flags(
    args: &ReplayArgs,
    map: &DomMap,
    filter: &mut MuonFilter,
    groups: &BTreeMap<u32, Vec<Record>>,
    slice_ns: u64,
) -> anyhow::Result<()> {
    let mut r = FlagReport {
        events: 0,
        events_triggered: 0,
        snapshot_hits: 0,
        stored_triggered: 0,
        our_triggered: 0,
        both: 0,
        only_ours: 0,
        only_stored: 0,
        recall: 0.0,
        precision: 0.0,
        doms_not_in_detx: map.unknown.len(),
    };
    for (group, recs) in groups {
        let by_source = fragments(recs, map);
        let stored: std::collections::HashSet<(u32, u8, u32)> = by_source
            .iter()
            .flat_map(|(s, v)| v.iter().filter(|(_, f)| *f).map(move |(h, _)| (*s, h.channel, h.time_ns)))
            .collect();
        let data = SliceData {
            slice: u64::from(*group),
            slice_start_ns: 0,
            slice_ns,
            fragments: by_source
                .iter()
                .map(|(s, v)| FragmentData { source: *s, flags: 0, hit_count: v.len() as u32, payload: payload(v) })
                .collect(),
        };
        let events = filter.process_slice(&data);
        let ours: std::collections::HashSet<(u32, u8, u32)> = events
            .iter()
            .flat_map(|e| e.hits.iter().filter(|h| h.triggered).map(|h| (h.source, h.channel, h.time_ns)))
            .collect();
        r.events += 1;
        r.events_triggered += u64::from(!events.is_empty());
        r.snapshot_hits += recs.len() as u64;
        r.stored_triggered += stored.len() as u64;
        r.our_triggered += ours.len() as u64;
        let both = ours.intersection(&stored).count() as u64;
        r.both += both;
        r.only_ours += ours.len() as u64 - both;
        r.only_stored += stored.len() as u64 - both;
    }
    r.recall = r.both as f64 / r.stored_triggered.max(1) as f64;
    r.precision = r.both as f64 / r.our_triggered.max(1) as f64;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "{} events: our trigger fired in {}; triggered hits: stored {}, ours {}, both {} (recall {:.1}%, precision {:.1}%)",
            r.events,
            r.events_triggered,
            r.stored_triggered,
            r.our_triggered,
            r.both,
            100.0 * r.recall,
            100.0 * r.precision
        );
    }
    Ok(())
}
