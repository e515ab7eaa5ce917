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
    /// packets during its time. Several addresses, comma-separated: the DOMs in as many
    /// contiguous blocks, in detector order (one per DataQueue source process). Times are moved to now (the first timeslice starts on
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
        let doms = (0..modules).map(|m| physics_dom(&generator, m, slice, args.run.unwrap_or(1))).collect();
        out.push((slice * slice_ns, doms));
    }
    Ok(out)
}

/// One timeslice's CLB packets: every DOM's hits cut into packets of at most
/// `hits_per_packet`, sequence numbers from 0 per DOM (an empty frame is one packet without
/// hits, so that the DOM is seen).
fn clb_packets(start: u64, doms: &[DomSlice], run: Option<u32>, hits_per_packet: usize) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for d in doms {
        let chunks = d.hits.chunks(hits_per_packet).chain(d.hits.is_empty().then_some(&[][..]));
        for (seq, hits) in chunks.enumerate() {
            let h = ClbHeader {
                data_type: ClbDataType::Optical,
                run: run.unwrap_or(d.run),
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
}

/// Which socket a DOM's packets go to.
struct Route(std::collections::HashMap<u32, usize>);

impl Route {
    /// `n` contiguous blocks of `doms` (source ids are DOMs in detector order, and source
    /// processes host contiguous blocks of them).
    fn blocks(doms: &[u32], n: usize) -> Self {
        let n = n.max(1);
        Self(doms.iter().enumerate().map(|(k, &d)| (d, k * n / doms.len().max(1))).collect())
    }

    /// Every DOM to the one socket.
    fn single() -> Self {
        Self(std::collections::HashMap::new())
    }

    fn of(&self, packet: &[u8]) -> usize {
        // The DOM id is the header's sixth word (big-endian).
        let dom = packet.get(20..24).map_or(0, |b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
        self.0.get(&dom).copied().unwrap_or(0)
    }
}

/// Sends a timeslice's packets from `due` on, in ten bursts over the timeslice (a CLB
/// streams its hits as they come).
fn send_paced(
    sockets: &[std::net::UdpSocket],
    route: &Route,
    due: Instant,
    packets: &[Vec<u8>],
    slice_ns: u64,
) -> std::io::Result<()> {
    let burst = packets.len().div_ceil(10).max(1);
    for (k, chunk) in packets.chunks(burst).enumerate() {
        let at = due + Duration::from_nanos(k as u64 * slice_ns / 10);
        if let Some(wait) = at.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        for p in chunk {
            match sockets[route.of(p)].send(p) {
                // Nobody listens (yet, or any more): the packet is gone, as on a network.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
                r => {
                    r?;
                }
            }
        }
    }
    Ok(())
}

/// The physics generator's data of one DOM and timeslice.
fn physics_dom(generator: &shoal_detector::physics::PhysicsGenerator, module: usize, slice: u64, run: u32) -> DomSlice {
    let f = generator.generate(module, slice);
    let hits = HitPayload::parse(&f.payload, f.hit_count)
        .map(|p| p.hits().map(|h| ClbHit { channel: h.channel, time_ns: h.time_ns, tot: h.amplitude }).collect())
        .unwrap_or_default();
    DomSlice { run, dom_id: generator.geometry().modules[module].id, dom_status: 1 << 31, hits }
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
    let packets: Vec<Vec<Vec<u8>>> =
        slices.iter().map(|(start, doms)| clb_packets(*start, doms, args.run, args.hits_per_packet)).collect();
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
    if let Some(addrs) = &args.send {
        let addrs: Vec<&str> = addrs.split(',').map(str::trim).filter(|a| !a.is_empty()).collect();
        let mut sockets = Vec::new();
        for addr in &addrs {
            let socket = std::net::UdpSocket::bind("0.0.0.0:0").context("binding a UDP socket")?;
            socket.connect(addr).with_context(|| format!("UDP to {addr}"))?;
            sockets.push(socket);
        }
        // Several DataQueues: the DOMs in blocks, in detector order (as source ids are).
        let doms: Vec<u32> = slices.first().map(|s| s.1.iter().map(|d| d.dom_id).collect()).unwrap_or_default();
        let route = Route::blocks(&doms, sockets.len());
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
            send_paced(&sockets, &route, due, packets, slice_ns).context("sending CLB packets")?;
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

/// `shoal demo --detector km3net`: the KM3NeT chain on one machine. An ARCA-like block
/// of DOMs (its `.detx` written next to the output), the physics generator's hits sent
/// as CLB packets at the real pace to the sources' `clb:` input, builders running the
/// muon trigger with KM3NeT's L1 on that geometry and publishing `IO_*` on a dispatcher
/// started in-process, a subscriber counting what arrives, DAQ files and Parquet out.
pub struct KmDemo {
    dispatcher: std::net::SocketAddr,
    dispatcher_cancel: tokio_util::sync::CancellationToken,
    subscriber: tokio::task::JoinHandle<()>,
    received: std::sync::Arc<std::sync::Mutex<BTreeMap<String, (u64, u64)>>>,
    subscriber_stop: tokio_util::sync::CancellationToken,
    emulator: Option<std::thread::JoinHandle<anyhow::Result<(u64, u64)>>>,
    detx: PathBuf,
}

/// What the demo's KM3NeT side saw.
#[derive(serde::Serialize)]
pub struct KmDemoReport {
    pub detx: PathBuf,
    pub dispatcher: String,
    pub emulated_packets: u64,
    pub emulated_hits: u64,
    /// Messages and bytes a subscriber received from the dispatcher, per tag.
    pub received: BTreeMap<String, (u64, u64)>,
}

impl KmDemo {
    /// Sets `cfg` up for the chain (sources, DOMs, input, filter) and starts the
    /// dispatcher, the subscriber and the tap. Call [`KmDemo::start_emulator`] next.
    pub async fn prepare(
        cfg: &mut shoal_net::config::Config,
        lines: u32,
        doms_per_line: u32,
        live: &shoal_net::live::Live,
    ) -> anyhow::Result<Self> {
        use shoal_core::controlhost::subscription::Mode;
        use shoal_detector::geometry::Geometry;
        let geometry = Geometry::arca_like(lines.max(1), doms_per_line.max(1));
        std::fs::create_dir_all(&cfg.writer.out_dir)
            .with_context(|| format!("creating {}", cfg.writer.out_dir.display()))?;
        let detx = cfg.writer.out_dir.join("demo-arca.detx");
        std::fs::write(&detx, geometry.to_detx(133)).with_context(|| format!("writing {}", detx.display()))?;
        cfg.run.sources = geometry.modules.len() as u32;
        cfg.run.slice_ms = 100;
        cfg.source.ids.clear();
        cfg.km3net.detx = Some(detx.clone());
        cfg.km3net.doms.clear();
        cfg.km3net.det_id = 133;
        // With the detector file's PMT directions, L2 too.
        cfg.km3net.publish = shoal_net::config::KM3NET_TAGS.map(String::from).to_vec();
        // The port the emulator sends to: free now, bound by the source when it starts.
        let port = std::net::UdpSocket::bind("127.0.0.1:0")?.local_addr()?.port();
        cfg.source.input = format!("clb:127.0.0.1:{port}");
        cfg.source.input_time_base = "unix".into();
        cfg.source.input_latency_ms = 200;
        let f = &mut cfg.builder.filter;
        f.name = "muon".into();
        f.muon.geometry = detx.display().to_string();
        f.muon.l1.kind = shoal_trigger::muon::L1Kind::Km3net;
        f.muon.l1.window_ns = 10;
        // Every source of the run starts with the same slice, a little ahead of now; the
        // emulator stamps its timeslices from it.
        let slice_clock = cfg.slice_clock()?;
        let now = shoal_net::clock::WallClock::new().now();
        cfg.run.start_slice = Some(slice_clock.slice_at(now + shoal_core::Duration::from_millis(1_500)) + 1);

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let dispatcher_cancel = tokio_util::sync::CancellationToken::new();
        let (handle, _core) = shoal_dispatcher::server::spawn_dispatcher(
            listener,
            shoal_dispatcher::server::DispatcherConfig::default(),
            dispatcher_cancel.clone(),
        )?;
        let dispatcher = handle.addr;
        live.tap.open(dispatcher, None, dispatcher_cancel.clone());
        let mut client = shoal_dispatcher::client::ChClient::connect(dispatcher).await?;
        for tag in shoal_net::config::KM3NET_TAGS {
            client.subscribe(tag, Mode::All).await?;
        }
        let subscriber_stop = tokio_util::sync::CancellationToken::new();
        let stop = subscriber_stop.clone();
        let received = std::sync::Arc::new(std::sync::Mutex::new(BTreeMap::<String, (u64, u64)>::new()));
        let seen = received.clone();
        let subscriber = tokio::spawn(async move {
            loop {
                tokio::select! {
                    m = client.next_message() => match m {
                        Ok(m) => {
                            let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
                            let e = seen.entry(m.tag.to_string()).or_default();
                            e.0 += 1;
                            e.1 += m.payload.len() as u64;
                        }
                        Err(_) => break,
                    },
                    _ = stop.cancelled() => break,
                }
            }
        });
        Ok(Self { dispatcher, dispatcher_cancel, subscriber, received, subscriber_stop, emulator: None, detx })
    }

    /// Starts sending the run's timeslices (a thread of its own: it sleeps between them).
    pub fn start_emulator(&mut self, cfg: &shoal_net::config::Config) -> anyhow::Result<()> {
        use shoal_detector::geometry::Geometry;
        use shoal_detector::physics::{PhysicsConfig, PhysicsGenerator};
        let text = std::fs::read_to_string(&self.detx)?;
        let geometry = Geometry::from_detx(&text)?;
        let slice_ns = cfg.slice_clock()?.length().as_nanos() as u64;
        // KM3NeT's rates; the muon rate as the demo's (enriched so that a short run shows
        // events).
        let physics = PhysicsConfig { muon_rate_hz: cfg.source.physics.muon_rate_hz, ..PhysicsConfig::km3net() };
        let generator = PhysicsGenerator::new(physics, geometry, Duration::from_nanos(slice_ns))
            .map_err(|e| anyhow::anyhow!("physics generator: {e}"))?;
        let first = cfg.run.start_slice.context("the run's first slice is set by prepare")?;
        let n = cfg.slices()?.unwrap_or(1);
        let addr = cfg.source.input.trim_start_matches("clb:").to_string();
        let run = cfg.run.run_number as u32;
        // Computed on a thread of its own a few timeslices ahead, sent at the real pace on
        // another: the pacing must not wait for the generator.
        let (tx, rx) = std::sync::mpsc::sync_channel::<(u64, Vec<Vec<u8>>, u64)>(4);
        std::thread::spawn(move || {
            for i in 0..n {
                let doms: Vec<DomSlice> = (0..generator.geometry().modules.len())
                    .map(|m| physics_dom(&generator, m, first + i, run))
                    .collect();
                let hits = doms.iter().map(|d| d.hits.len() as u64).sum::<u64>();
                let start = (first + i) * slice_ns;
                if tx.send((start, clb_packets(start, &doms, None, 200), hits)).is_err() {
                    return;
                }
            }
        });
        self.emulator = Some(std::thread::spawn(move || {
            let socket = std::net::UdpSocket::bind("127.0.0.1:0")?;
            socket.connect(&addr)?;
            let clock = shoal_net::clock::WallClock::new();
            let (mut packets, mut hits) = (0u64, 0u64);
            for (start, p, h) in rx {
                hits += h;
                packets += p.len() as u64;
                let wait = Duration::from_nanos(start.saturating_sub(clock.now().as_nanos()));
                send_paced(std::slice::from_ref(&socket), &Route::single(), Instant::now() + wait, &p, slice_ns)?;
            }
            Ok((packets, hits))
        }));
        Ok(())
    }

    /// After the run: waits for the emulator and for the subscriber to have every message
    /// the builders offered (at most a few seconds), then stops the dispatcher.
    pub async fn finish(mut self, summary: &shoal_net::demo::RunSummary) -> anyhow::Result<KmDemoReport> {
        let (emulated_packets, emulated_hits) = match self.emulator.take() {
            Some(t) => tokio::task::spawn_blocking(move || t.join())
                .await?
                .map_err(|_| anyhow::anyhow!("emulator panicked"))??,
            None => (0, 0),
        };
        // The tap publishes after the builders have finished: wait (bounded) until the
        // subscriber has every message offered.
        let offered: u64 = summary.km3net.as_ref().map_or(0, |k| k.offered.values().sum());
        let count = || self.received.lock().map_or(0, |r| r.values().map(|v| v.0).sum::<u64>());
        let deadline = Instant::now() + Duration::from_secs(10);
        while count() < offered && Instant::now() < deadline && !self.subscriber.is_finished() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.subscriber_stop.cancel();
        let _ = (&mut self.subscriber).await;
        let received = self.received.lock().map(|r| r.clone()).unwrap_or_default();
        self.dispatcher_cancel.cancel();
        Ok(KmDemoReport {
            detx: self.detx,
            dispatcher: self.dispatcher.to_string(),
            emulated_packets,
            emulated_hits,
            received,
        })
    }
}

/// The KM3NeT part of the demo's table.
pub fn demo_table(summary: &shoal_net::demo::RunSummary, k: &KmDemoReport) -> String {
    use std::fmt::Write;
    let mut s = String::from("\nKM3NeT chain\n");
    let _ = writeln!(s, "  detector file        {}", k.detx.display());
    let _ = writeln!(s, "  emulated             {} CLB packets, {} hits", k.emulated_packets, k.emulated_hits);
    if let Some(c) = &summary.clb {
        let _ = writeln!(
            s,
            "  DataQueue            {} packets, {} frames ({} incomplete), refused {:?}, kernel drops {}",
            c.packets, c.frames, c.frames_incomplete, c.refused, c.dropped_by_kernel
        );
    }
    if let Some(o) = &summary.km3net {
        let _ = writeln!(
            s,
            "  builders             {} timeslices, {} frames, {} not superframes",
            o.timeslices, o.frames, o.bad_frames
        );
    }
    let _ = writeln!(s, "  dispatcher           {} (gone with the demo)", k.dispatcher);
    for tag in shoal_net::config::KM3NET_TAGS {
        let offered = summary.km3net.as_ref().and_then(|o| o.offered.get(tag)).copied().unwrap_or(0);
        let (n, bytes) = k.received.get(tag).copied().unwrap_or((0, 0));
        let file = summary.km3net.as_ref().and_then(|o| o.file_bytes.get(tag)).copied().unwrap_or(0);
        let _ = writeln!(
            s,
            "  {tag:<8}             published {offered}, received {n} ({:.1} MB), files {:.1} MB",
            bytes as f64 / 1e6,
            file as f64 / 1e6
        );
    }
    let _ = writeln!(
        s,
        "  files                {}/run{:06}.builder*.IO_*.dat (km3pipe's DAQPump reads them)",
        summary.summary_path.parent().map_or_else(String::new, |p| p.display().to_string()),
        summary.run
    );
    s
}
