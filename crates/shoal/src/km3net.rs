//! `shoal clb-emulate` and `shoal clb-assemble`: KM3NeT's CLB optical packets from a
//! recorded timeslice file, and back into JDAQTimeslices through the DataQueue (issue 31,
//! first part; checked with km3pipe's readers in tests/python/test_km3net.py).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use shoal_core::hit::HitPayload;
use shoal_core::km3net::clb::{ClbDataType, ClbHeader, ClbHit, dump_append, dump_records, encode_optical};
use shoal_core::km3net::dataqueue::{DataQueue, DataQueueConfig};
use shoal_core::km3net::jdaq::{JdaqFrame, JdaqTimeslice, encode_timeslice, timeslices};

#[derive(clap::Args)]
pub struct EmulateArgs {
    /// A JDAQTimeslice file (IO_TSL*: L0, L1, L2 or SN): each DOM's frame of each timeslice
    /// becomes that DOM's CLB packets.
    #[arg(long, group = "from")]
    timeslices: Option<PathBuf>,
    /// A CLB dump (what --dump writes, km3pipe's CLBPump reads): its optical packets,
    /// sent again timeslice by timeslice.
    #[arg(long, group = "from")]
    from_dump: Option<PathBuf>,
    /// The physics generator (K-40 singles and coincidences, atmospheric muons) on the
    /// DOMs of --detx, or of an ARCA-like block of --lines x --doms-per-line, at KM3NeT's
    /// rates, for --seconds.
    #[arg(long, group = "from")]
    physics: bool,
    #[arg(long, requires = "physics")]
    detx: Option<PathBuf>,
    #[arg(long, default_value_t = 2)]
    lines: u32,
    #[arg(long, default_value_t = 18)]
    doms_per_line: u32,
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Seed of the physics generator.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the packets to this CLB dump (each packet prefixed by its length, u32 LE; what
    /// km3pipe's CLBPump reads).
    #[arg(long)]
    dump: Option<PathBuf>,
    /// Send the packets as UDP datagrams to this address at the real pace: a timeslice's
    /// packets when its time comes. Times are moved to now (the first timeslice starts on
    /// the second after next) unless --keep-time.
    #[arg(long)]
    send: Option<String>,
    /// Keep the recorded times when sending.
    #[arg(long)]
    keep_time: bool,
    /// Run number in the packets (default: the recorded one; physics: 1).
    #[arg(long)]
    run: Option<u32>,
    /// Most hits per packet (the CLB fills a jumbo frame; 200 hits are 1,228 bytes).
    #[arg(long, default_value_t = 200)]
    hits_per_packet: usize,
    /// Timeslice length, ms (KM3NeT: 100).
    #[arg(long, default_value_t = 100)]
    slice_ms: u64,
}

/// One DOM's data of one timeslice, before it is cut into packets.
struct DomSlice {
    run: u32,
    dom_id: u32,
    dom_status: u32,
    hits: Vec<ClbHit>,
}

/// The emulator's timeslices: start (UNIX ns) and every DOM's data.
type Timeslices = Vec<(u64, Vec<DomSlice>)>;

fn from_timeslice_file(path: &PathBuf) -> anyhow::Result<Timeslices> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for ts in timeslices(&bytes) {
        let ts = ts.with_context(|| format!("{}", path.display()))?;
        let start = ts.start_ns();
        let doms = ts
            .frames
            .into_iter()
            .map(|f| DomSlice { run: ts.run as u32, dom_id: f.dom_id, dom_status: f.dom_status[0], hits: f.hits })
            .collect();
        out.push((start, doms));
    }
    Ok(out)
}

fn from_dump(path: &PathBuf, slice_ns: u64) -> anyhow::Result<Timeslices> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut q = DataQueue::new(DataQueueConfig { slice_ns, doms: None, max_packets_per_frame: 1 << 20 });
    for rec in dump_records(&bytes) {
        q.handle_packet(rec.with_context(|| format!("{}", path.display()))?);
    }
    let mut by_slice: BTreeMap<u64, Vec<DomSlice>> = BTreeMap::new();
    for f in q.close_below(u64::MAX) {
        by_slice.entry(f.timeslice_start_ns).or_default().push(DomSlice {
            run: f.run,
            dom_id: f.dom_id,
            dom_status: f.dom_status,
            hits: f.hits,
        });
    }
    if q.report().optical_packets == 0 {
        bail!("{}: no optical packet", path.display());
    }
    Ok(by_slice.into_iter().collect())
}

fn from_physics(args: &EmulateArgs, slice_ns: u64) -> anyhow::Result<Timeslices> {
    use shoal_detector::geometry::Geometry;
    use shoal_detector::physics::{PhysicsConfig, PhysicsGenerator};
    let geometry = match &args.detx {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            Geometry::from_detx(&text).with_context(|| format!("{}", p.display()))?
        }
        None => Geometry::arca_like(args.lines, args.doms_per_line),
    };
    let cfg = PhysicsConfig { seed: args.seed, ..PhysicsConfig::km3net() };
    let generator = PhysicsGenerator::new(cfg, geometry, Duration::from_nanos(slice_ns))
        .map_err(|e| anyhow::anyhow!("physics generator: {e}"))?;
    let n = ((args.seconds * 1e9) as u64).div_ceil(slice_ns).max(1);
    let modules = generator.geometry().modules.len();
    let mut out = Vec::new();
    for slice in 0..n {
        let doms = (0..modules)
            .map(|m| {
                let f = generator.generate(m, slice);
                let hits = HitPayload::parse(&f.payload, f.hit_count)
                    .map(|p| {
                        p.hits().map(|h| ClbHit { channel: h.channel, time_ns: h.time_ns, tot: h.amplitude }).collect()
                    })
                    .unwrap_or_default();
                DomSlice {
                    run: args.run.unwrap_or(1),
                    dom_id: generator.geometry().modules[m].id,
                    dom_status: 1 << 31,
                    hits,
                }
            })
            .collect();
        out.push((slice * slice_ns, doms));
    }
    Ok(out)
}

pub fn emulate(args: EmulateArgs) -> anyhow::Result<std::process::ExitCode> {
    if args.hits_per_packet == 0 {
        bail!("--hits-per-packet must be at least 1");
    }
    if args.slice_ms == 0 {
        bail!("--slice-ms must be at least 1");
    }
    if args.dump.is_none() && args.send.is_none() {
        bail!("nothing to do: give --dump FILE and/or --send ADDR");
    }
    let slice_ns = args.slice_ms * 1_000_000;
    let mut slices = if let Some(p) = &args.timeslices {
        from_timeslice_file(p)?
    } else if let Some(p) = &args.from_dump {
        from_dump(p, slice_ns)?
    } else if args.physics {
        from_physics(&args, slice_ns)?
    } else {
        bail!("no data: give --timeslices FILE, --from-dump FILE or --physics");
    };
    // Sent live, the data are moved to now: timeslice i starts i slices after the second
    // after next (the DataQueue takes what is current, as a real detector's would be).
    if args.send.is_some() && !args.keep_time {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos() as u64;
        let first = (now / 1_000_000_000 + 2) * 1_000_000_000;
        for (i, (start, _)) in slices.iter_mut().enumerate() {
            *start = first + i as u64 * slice_ns;
        }
    }
    let packets: Vec<Vec<Vec<u8>>> = slices
        .iter()
        .map(|(start, doms)| {
            let mut out = Vec::new();
            for d in doms {
                // An empty frame is one packet without hits, so that the DOM is seen.
                let chunks = d.hits.chunks(args.hits_per_packet).chain(d.hits.is_empty().then_some(&[][..]));
                for (seq, hits) in chunks.enumerate() {
                    let h = ClbHeader {
                        data_type: ClbDataType::Optical,
                        run: args.run.unwrap_or(d.run),
                        udp_sequence: seq as u32,
                        timestamp_s: (start / 1_000_000_000) as u32,
                        ticks: ((start % 1_000_000_000) / 16) as u32,
                        dom_id: d.dom_id,
                        dom_status: d.dom_status,
                    };
                    out.push(encode_optical(&h, hits));
                }
            }
            out
        })
        .collect();
    let total: usize = packets.iter().map(Vec::len).sum();
    let hits: usize = slices.iter().flat_map(|(_, d)| d.iter().map(|d| d.hits.len())).sum();
    if let Some(path) = &args.dump {
        let mut dump = Vec::new();
        for p in packets.iter().flatten() {
            dump_append(&mut dump, p);
        }
        std::fs::write(path, dump).with_context(|| format!("writing {}", path.display()))?;
    }
    // What was sent, for whoever checks it (one JSON line on stdout).
    println!(
        "{}",
        serde_json::json!({
            "timeslices": slices.len(),
            "first_timeslice_ns": slices.first().map_or(0, |s| s.0),
            "slice_ns": slice_ns,
            "dom_ids": slices.first().map(|s| s.1.iter().map(|d| d.dom_id).collect::<Vec<_>>()).unwrap_or_default(),
            "packets": total,
            "hits": hits,
        })
    );
    if let Some(addr) = &args.send {
        let socket = std::net::UdpSocket::bind("0.0.0.0:0").context("binding a UDP socket")?;
        socket.connect(addr).with_context(|| format!("UDP to {addr}"))?;
        let unix_now =
            || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        let start = Instant::now();
        let t0 = unix_now();
        for (i, ((slice_start, _), packets)) in slices.iter().zip(&packets).enumerate() {
            // The real pace: a timeslice's packets during its time, in ten bursts (a CLB
            // streams its hits as they come; recorded times are sent one timeslice per
            // timeslice length).
            let due = if args.keep_time {
                start + Duration::from_nanos(i as u64 * slice_ns)
            } else {
                start + Duration::from_nanos(slice_start.saturating_sub(t0))
            };
            let burst = packets.len().div_ceil(10).max(1);
            for (k, chunk) in packets.chunks(burst).enumerate() {
                let at = due + Duration::from_nanos(k as u64 * slice_ns / 10);
                if let Some(wait) = at.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                for p in chunk {
                    socket.send(p).with_context(|| format!("sending to {addr}"))?;
                }
            }
        }
    }
    eprintln!("clb-emulate: {} timeslices, {total} packets, {hits} hits", slices.len());
    Ok(std::process::ExitCode::SUCCESS)
}

#[derive(clap::Args)]
pub struct AssembleArgs {
    /// A CLB dump.
    #[arg(long)]
    dump: PathBuf,
    /// The JDAQTimeslice file to write (one timeslice per timeslice in the dump).
    #[arg(long)]
    out: PathBuf,
    /// Detector id written into the timeslices.
    #[arg(long, default_value_t = 0)]
    det_id: i32,
    /// Timeslice data type: 1002 L0, 1003 L1, 1004 L2, 1005 SN.
    #[arg(long, default_value_t = 1002)]
    data_type: i32,
    /// Timeslice length, ms (KM3NeT: 100).
    #[arg(long, default_value_t = 100)]
    slice_ms: u64,
}

pub fn assemble(args: AssembleArgs) -> anyhow::Result<std::process::ExitCode> {
    let bytes = std::fs::read(&args.dump).with_context(|| format!("reading {}", args.dump.display()))?;
    let mut q = DataQueue::new(DataQueueConfig {
        slice_ns: args.slice_ms * 1_000_000,
        doms: None,
        max_packets_per_frame: 4096,
    });
    let mut truncated = false;
    for rec in dump_records(&bytes) {
        match rec {
            Ok(p) => {
                q.handle_packet(p);
            }
            Err(e) => {
                eprintln!("clb-assemble: {e}");
                truncated = true;
            }
        }
    }
    let mut by_slice: BTreeMap<u64, Vec<_>> = BTreeMap::new();
    for f in q.close_below(u64::MAX) {
        by_slice.entry(f.timeslice_start_ns).or_default().push(f);
    }
    let mut out = Vec::new();
    for (i, (start, frames)) in by_slice.into_iter().enumerate() {
        let run = frames.first().map_or(0, |f| f.run as i32);
        let ts = JdaqTimeslice {
            data_type: args.data_type,
            det_id: args.det_id,
            run,
            frame_index: i as i32 + 1,
            timestamp: (start / 1_000_000_000) as u32,
            ticks: ((start % 1_000_000_000) / 16) as u32,
            frames: frames
                .into_iter()
                .map(|f| JdaqFrame {
                    dom_id: f.dom_id,
                    // The low 16 bits of KM3NeT's DataQueue status count the packets received.
                    dataqueue_status: f.packets & 0xffff,
                    dom_status: [f.dom_status, 0, 0, 0],
                    hits: f.hits,
                })
                .collect(),
        };
        out.extend(encode_timeslice(&ts));
    }
    std::fs::write(&args.out, out).with_context(|| format!("writing {}", args.out.display()))?;
    let r = q.report();
    println!("{}", serde_json::to_string(r)?);
    Ok(if truncated || !r.refused.is_empty() || r.frames_incomplete > 0 {
        std::process::ExitCode::from(1)
    } else {
        std::process::ExitCode::SUCCESS
    })
}

#[derive(clap::Args)]
pub struct JdaqCheckArgs {
    /// DAQ files (JDAQ objects one after another: timeslices, events, summaryslices).
    #[arg(required = true)]
    files: Vec<PathBuf>,
}

/// `shoal jdaq-check`: decodes every object of DAQ files with shoal's codecs and encodes
/// it again; the bytes must be the very bytes read. Prints what it found per file.
pub fn jdaq_check(args: JdaqCheckArgs) -> anyhow::Result<std::process::ExitCode> {
    use shoal_core::km3net::jdaq::{
        TYPE_EVENT, TYPE_L0, TYPE_SN, TYPE_SUMMARYSLICE, decode_event, decode_summaryslice, decode_timeslice,
        encode_event, encode_summaryslice, peek_preamble,
    };
    let mut ok = true;
    for path in &args.files {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let mut counts: BTreeMap<String, u64> = BTreeMap::new();
        let mut problems = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let rest = &bytes[at..];
            let Some((data_type, size)) = peek_preamble(rest) else {
                problems.push(format!("offset {at}: not a JDAQ preamble"));
                break;
            };
            let object = &rest[..size];
            let (name, again) = match data_type {
                TYPE_L0..=TYPE_SN => ("timeslice", decode_timeslice(object).map(|(t, _)| encode_timeslice(&t))),
                TYPE_EVENT => ("event", decode_event(object).map(|(e, _)| encode_event(&e))),
                TYPE_SUMMARYSLICE => {
                    ("summaryslice", decode_summaryslice(object).map(|(s, _)| encode_summaryslice(&s)))
                }
                other => {
                    *counts.entry(format!("other_{other}")).or_default() += 1;
                    at += size;
                    continue;
                }
            };
            match again {
                Ok(b) if b == object => *counts.entry(name.to_string()).or_default() += 1,
                Ok(_) => problems.push(format!("offset {at}: {name} encodes to different bytes")),
                Err(e) => problems.push(format!("offset {at}: {name}: {e}")),
            }
            at += size;
        }
        ok &= problems.is_empty();
        println!(
            "{}",
            serde_json::json!({ "file": path.display().to_string(), "identical": counts, "problems": problems })
        );
    }
    Ok(if ok { std::process::ExitCode::SUCCESS } else { std::process::ExitCode::from(1) })
}
