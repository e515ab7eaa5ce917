//! `shoal clb-emulate` and `shoal clb-assemble`: KM3NeT's CLB optical packets from a
//! recorded timeslice file, and back into JDAQTimeslices through the DataQueue (issue 31,
//! first part; checked with km3pipe's readers in tests/python/test_km3net.py).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use shoal_core::km3net::clb::{ClbDataType, ClbHeader, dump_append, dump_records, encode_optical};
use shoal_core::km3net::dataqueue::{DataQueue, DataQueueConfig};
use shoal_core::km3net::jdaq::{JdaqFrame, JdaqTimeslice, encode_timeslice, timeslices};

#[derive(clap::Args)]
pub struct EmulateArgs {
    /// A JDAQTimeslice file (IO_TSL*: L0, L1, L2 or SN): each DOM's frame of each timeslice
    /// becomes that DOM's CLB packets.
    #[arg(long)]
    timeslices: PathBuf,
    /// Write the packets to this CLB dump (each packet prefixed by its length, u32 LE; what
    /// km3pipe's CLBPump reads).
    #[arg(long)]
    dump: Option<PathBuf>,
    /// Send the packets as UDP datagrams to this address, one timeslice per timeslice length.
    #[arg(long)]
    send: Option<String>,
    /// Most hits per packet (the CLB fills a jumbo frame; 200 hits are 1,228 bytes).
    #[arg(long, default_value_t = 200)]
    hits_per_packet: usize,
    /// Timeslice length when sending, ms.
    #[arg(long, default_value_t = 100)]
    slice_ms: u64,
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

pub fn emulate(args: EmulateArgs) -> anyhow::Result<std::process::ExitCode> {
    if args.hits_per_packet == 0 {
        bail!("--hits-per-packet must be at least 1");
    }
    if args.dump.is_none() && args.send.is_none() {
        bail!("nothing to do: give --dump FILE and/or --send ADDR");
    }
    let bytes = std::fs::read(&args.timeslices).with_context(|| format!("reading {}", args.timeslices.display()))?;
    let mut slices: Vec<Vec<Vec<u8>>> = Vec::new();
    for ts in timeslices(&bytes) {
        let ts = ts.with_context(|| format!("{}", args.timeslices.display()))?;
        let mut packets = Vec::new();
        for f in &ts.frames {
            for (seq, hits) in
                f.hits.chunks(args.hits_per_packet).chain(f.hits.is_empty().then_some(&[][..])).enumerate()
            {
                let h = ClbHeader {
                    data_type: ClbDataType::Optical,
                    run: ts.run as u32,
                    udp_sequence: seq as u32,
                    timestamp_s: ts.timestamp & 0x7fff_ffff,
                    ticks: ts.ticks,
                    dom_id: f.dom_id,
                    dom_status: f.dom_status[0],
                };
                packets.push(encode_optical(&h, hits));
            }
        }
        slices.push(packets);
    }
    let packets: usize = slices.iter().map(Vec::len).sum();
    if let Some(path) = &args.dump {
        let mut dump = Vec::new();
        for p in slices.iter().flatten() {
            dump_append(&mut dump, p);
        }
        std::fs::write(path, dump).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(addr) = &args.send {
        let socket = std::net::UdpSocket::bind("0.0.0.0:0").context("binding a UDP socket")?;
        socket.connect(addr).with_context(|| format!("UDP to {addr}"))?;
        let start = Instant::now();
        for (i, packets) in slices.iter().enumerate() {
            // The real pace: a timeslice's packets once its time has come.
            let due = start + Duration::from_millis(args.slice_ms * i as u64);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            for p in packets {
                socket.send(p).with_context(|| format!("sending to {addr}"))?;
            }
        }
    }
    eprintln!("clb-emulate: {} timeslices, {packets} packets", slices.len());
    Ok(std::process::ExitCode::SUCCESS)
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
