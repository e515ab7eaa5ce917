//! The writer: accepts event frames from every builder and stores them in one Parquet file
//! per run (`run{N:06}.events.parquet`), plus a JSON summary (`run{N:06}.writer.json`).
//! Parquet writing runs on a thread of its own so that receiving never waits for disk.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration as StdDuration;

use shoal_core::frame::Flags;
use shoal_store::{EventFileStats, EventFileWriter};
use shoal_trigger::{Event, decode_events};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::Config;
use crate::framed::{FrameReader, ReadEnd};

/// What the writer reports at the end (also written as `run{N:06}.writer.json`).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct WriterReport {
    pub run: u64,
    pub file: EventFileStats,
    pub summary_path: PathBuf,
    /// Processed slices reported by the builders (one EVENTS frame each).
    pub slices: u64,
    pub events_per_builder: BTreeMap<u32, u64>,
    pub rejected_connections: BTreeMap<String, u64>,
    /// Builders that ended their stream cleanly.
    pub builders_ended: usize,
    pub error: Option<String>,
}

enum Incoming {
    Slice { builder: u32, slice: u64, slice_start_ns: u64, events: Vec<Event> },
    Ended { builder: u32 },
    Rejected { reason: &'static str },
}

async fn read_connection(stream: TcpStream, peer: SocketAddr, tx: mpsc::Sender<Incoming>, cancel: CancellationToken) {
    let mut reader = FrameReader::new(stream, peer, 256 << 20, cancel);
    let end = loop {
        let frame = match reader.next().await {
            Ok(f) => f,
            Err(end) => break end,
        };
        let h = frame.header;
        let msg = if h.flags.contains(Flags::END_OF_STREAM) {
            Incoming::Ended { builder: h.source }
        } else if !h.flags.contains(Flags::EVENTS) {
            break reader.reject("not_events", "a data frame on the event port");
        } else {
            match decode_events(&frame.payload) {
                Ok(events) => Incoming::Slice {
                    builder: h.source,
                    slice: h.slice,
                    slice_start_ns: h.slice_start.as_nanos(),
                    events,
                },
                Err(e) => break reader.reject("bad_events", &e.to_string()),
            }
        };
        if tx.send(msg).await.is_err() {
            break ReadEnd::Clean;
        }
    };
    if let ReadEnd::Rejected(reason) = end {
        let _ = tx.send(Incoming::Rejected { reason }).await;
    }
}

/// Runs the writer on a bound listener until every builder has ended its stream (or
/// `cancel`), then closes the files.
pub async fn run_writer(cfg: Config, listener: TcpListener, cancel: CancellationToken) -> anyhow::Result<WriterReport> {
    let run = cfg.run.run_number;
    let n_builders = cfg.run.builders as usize;
    std::fs::create_dir_all(&cfg.writer.out_dir)?;
    let path = cfg.writer.out_dir.join(format!("run{run:06}.events.parquet"));
    let summary_path = cfg.writer.out_dir.join(format!("run{run:06}.writer.json"));
    let mut file = EventFileWriter::create(&path, run)?;

    let (tx, mut rx) = mpsc::channel::<Incoming>(1024);
    let readers = CancellationToken::new();
    let accept_cancel = readers.clone();
    let accept = tokio::spawn(async move {
        loop {
            tokio::select! {
                r = listener.accept() => match r {
                    Ok((stream, peer)) => { tokio::spawn(read_connection(stream, peer, tx.clone(), accept_cancel.clone())); }
                    Err(e) => { warn!(error = %e, "accept failed"); tokio::time::sleep(StdDuration::from_millis(50)).await; }
                },
                _ = accept_cancel.cancelled() => return,
            }
        }
    });

    // Parquet encoding on its own thread.
    let (disk_tx, disk_rx) = std::sync::mpsc::channel::<(u32, u64, u64, Vec<Event>)>();
    let disk = std::thread::Builder::new().name("writer-disk".into()).spawn(move || {
        for (builder, slice, start, events) in disk_rx {
            file.write_slice(builder, slice, start, &events)?;
        }
        file.close()
    })?;

    let mut report = WriterReport { run, summary_path: summary_path.clone(), ..Default::default() };
    let mut ended = BTreeSet::new();
    info!(path = %path.display(), n_builders, "writer started");
    while ended.len() < n_builders {
        tokio::select! {
            m = rx.recv() => match m {
                Some(Incoming::Slice { builder, slice, slice_start_ns, events }) => {
                    report.slices += 1;
                    *report.events_per_builder.entry(builder).or_default() += events.len() as u64;
                    if disk_tx.send((builder, slice, slice_start_ns, events)).is_err() {
                        break; // the disk thread failed; its error is reported below
                    }
                }
                Some(Incoming::Ended { builder }) => { ended.insert(builder); }
                Some(Incoming::Rejected { reason }) => *report.rejected_connections.entry(reason.into()).or_default() += 1,
                None => break,
            },
            _ = cancel.cancelled() => {
                warn!(ended = ended.len(), n_builders, "writer stopping before every builder ended its stream");
                break;
            }
        }
    }
    readers.cancel();
    let _ = accept.await;
    drop(disk_tx);
    report.builders_ended = ended.len();
    match tokio::task::spawn_blocking(move || disk.join()).await? {
        Ok(Ok(stats)) => report.file = stats,
        Ok(Err(e)) => report.error = Some(format!("writing {}: {e}", path.display())),
        Err(_) => report.error = Some("writer disk thread panicked".into()),
    }
    std::fs::write(&summary_path, serde_json::to_vec_pretty(&report)?)?;
    info!(events = report.file.events, path = %path.display(), "writer finished");
    Ok(report)
}
