//! The writer: accepts event frames from every builder and stores them in one Parquet file
//! per run (`run{N:06}.events.parquet`), plus a JSON summary (`run{N:06}.writer.json`).
//! Raw data the builders save (alert windows, late fragments; `RAW` frames) go to
//! `run{N:06}.raw.parquet`, created at the first one; processed slices stored whole
//! (`builder.store_slices`, raw records of kind slice data) to `run{N:06}.slices.parquet`,
//! same schema.
//! Parquet writing runs on a thread of its own so that receiving never waits for disk.

pub mod archiving;
pub mod disk;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use shoal_core::custody::ArchiveLedger;
use shoal_core::frame::Flags;
use shoal_core::rawrec::{RawKind, RawRecord};
use shoal_core::saver::AlertReport;
use shoal_store::{EventFileStats, EventFileWriter, RawFileStats, RawFileWriter, RawRow};
use shoal_trigger::{Event, decode_events};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::Config;
use crate::live::Live;
use crate::transport::framed::{FrameReader, ReadEnd};
use crate::transport::secure::Speaker;

/// What the writer reports at the end (also written as `run{N:06}.writer.json`).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct WriterReport {
    pub run: u64,
    /// The events files' totals (`path`: the first one this writer wrote).
    pub file: EventFileStats,
    /// Every events file this writer closed, in order (also in the run's manifest).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<ClosedEventFile>,
    /// Started again during the run: what the previous incarnation(s) left unclosed, and
    /// the slices whose events were lost with them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lost_with_previous: Option<LostWithWriter>,
    /// The disk failed: the file open then (lost, never closed) and the slices whose
    /// events were not stored (after the last slice of a file closed before the failure,
    /// to the end of the run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_stored: Option<LostWithWriter>,
    pub summary_path: PathBuf,
    /// Processed slices reported by the builders (one EVENTS frame each).
    pub slices: u64,
    pub events_per_builder: BTreeMap<u32, u64>,
    pub rejected_connections: BTreeMap<String, u64>,
    /// Builders that ended their stream cleanly.
    pub builders_ended: usize,
    pub error: Option<String>,
    /// Events received and not stored: the disk failed (full, gone); the writer kept
    /// taking the builders' streams, so the builders were not held up.
    pub events_not_stored: u64,
    /// Raw records (saved and late fragments) received and not stored, likewise.
    pub raw_not_stored: u64,
    /// Raw data saved by the builders (none: no alert and no late fragment).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub raw: Option<RawFileStats>,
    /// Processed slices stored whole (`builder.store_slices`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slices_file: Option<RawFileStats>,
    /// Every alert's report, one per builder.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub alerts: Vec<AlertReport>,
    /// With `writer.archive`: the archive's ledger of this run's files at the run's end
    /// (files still pending say so; `shoal archive status` shows them become safe).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub archive: Option<shoal_core::custody::ArchiveLedger>,
}

/// The disk thread's failure: the error, the files it had closed whole before it, and the
/// one open then (lost).
struct DiskFailure {
    error: shoal_store::StoreError,
    closed: Vec<ClosedEventFile>,
    open: Option<PathBuf>,
}

/// One closed events file: a line of `run{N:06}.events.manifest.jsonl`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClosedEventFile {
    pub path: PathBuf,
    pub first_slice: u64,
    pub last_slice: u64,
    pub slices: u64,
    pub events: u64,
    pub hits: u64,
    pub bytes: u64,
    /// `adler32:` and 8 hex digits, computed while the file was written (also in the
    /// metadata beside it, `NAME.json`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub checksum: String,
}

/// Writes the metadata of a closed file beside it (`NAME.json`: size, adler32, run,
/// rows, tier; `shoal_store::custody`), the sign for an archiver that the file is whole.
#[allow(clippy::too_many_arguments)]
fn describe(
    path: &std::path::Path,
    seal: shoal_store::custody::FileSeal,
    run: u64,
    run_type: &str,
    events: u64,
    data_tier: &str,
    slices: Option<(u64, u64)>,
) -> Result<(), shoal_store::StoreError> {
    let meta = shoal_store::custody::FileMetadata {
        file_name: path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        file_size: seal.bytes,
        checksum: seal.checksum(),
        runs: vec![(run, 0, run_type.to_string())],
        events,
        data_tier: data_tier.into(),
        file_format: "parquet".into(),
        producer: "writer".into(),
        first_slice: slices.map(|s| s.0),
        last_slice: slices.map(|s| s.1),
        closed_at: shoal_store::custody::unix_now(),
        application_version: env!("CARGO_PKG_VERSION").into(),
    };
    meta.write_beside(path).map(|_| ()).map_err(|source| shoal_store::StoreError::Sync { path: path.into(), source })
}

/// The archive's ledger of the run at its end (none: no archiver): what the archiver has
/// taken up of the run's files, and those it has not seen yet (closed a moment ago) as
/// pending, so that the bytes written are the writer's.
fn archive_at_end(report: &WriterReport, archive: &crate::archive::ArchiveLive) -> Option<ArchiveLedger> {
    let mut l = archive.ledger_of(report.run).or_else(|| archive.total().map(|_| ArchiveLedger::default()))?;
    let raw = [&report.raw, &report.slices_file].into_iter().flatten();
    let files = report.files.len() as u64 + raw.clone().count() as u64;
    let bytes = report.files.iter().map(|f| f.bytes).sum::<u64>() + raw.map(|r| r.bytes).sum::<u64>();
    if bytes > l.bytes_written {
        l.files_pending += files.saturating_sub(l.files);
        l.bytes_pending += bytes - l.bytes_written;
        l.oldest_pending_closed_at.get_or_insert_with(shoal_store::custody::unix_now);
        (l.files, l.bytes_written) = (files.max(l.files), bytes);
    }
    Some(l)
}

/// What a writer started again during a run finds of its predecessor's: the files it did
/// not close (unreadable, their events lost) and the slices whose events were lost: after
/// the last slice of a closed file (`after_slice`; none: from the run's first slice) and
/// before the first slice this writer received (`before_slice`; none: it received none).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LostWithWriter {
    pub unclosed_files: Vec<PathBuf>,
    pub after_slice: Option<u64>,
    pub before_slice: Option<u64>,
}

/// The events files of a run: one open at a time, closed and listed in the manifest once
/// its events span `checkpoint_ns` of data time, the next part opened.
struct EventFiles {
    run: u64,
    run_type: String,
    dir: PathBuf,
    keep_existing: bool,
    checkpoint_ns: u64,
    manifest: PathBuf,
    open: Option<OpenEventFile>,
    parts: u32,
    closed: Vec<ClosedEventFile>,
    first_path: PathBuf,
    /// The file whose closing failed (its writer is gone with it).
    failed_to_close: Option<PathBuf>,
}

struct OpenEventFile {
    writer: EventFileWriter,
    path: PathBuf,
    /// Data time of the first slice it holds (none: empty).
    opened_data_ns: Option<u64>,
    first_slice: u64,
    last_slice: u64,
    slices: u64,
}

impl EventFiles {
    fn new(s: &WriterSettings) -> Result<Self, shoal_store::StoreError> {
        let run = s.run;
        let dir = s.out_dir.clone();
        let checkpoint_ns = s.checkpoint_ns;
        let manifest = dir.join(format!("run{run:06}.events.manifest.jsonl"));
        let mut files = Self {
            run,
            run_type: s.run_type.clone(),
            dir,
            keep_existing: s.keep_existing,
            checkpoint_ns,
            manifest,
            open: None,
            parts: 0,
            closed: Vec::new(),
            first_path: PathBuf::new(),
            failed_to_close: None,
        };
        if !files.keep_existing {
            // A run number used again outside run control: its old manifest goes.
            let _ = std::fs::remove_file(&files.manifest);
        }
        // The first file exists from the start, events or not.
        files.open_next()?;
        files.first_path = files.open.as_ref().map(|o| o.path.clone()).unwrap_or_default();
        Ok(files)
    }

    fn open_next(&mut self) -> Result<(), shoal_store::StoreError> {
        self.parts += 1;
        let stem = format!("run{:06}.events", self.run);
        let path = match (self.keep_existing, self.parts) {
            (true, _) => unused_path(&self.dir, &stem, "parquet"),
            (false, 1) => self.dir.join(format!("{stem}.parquet")),
            (false, k) => self.dir.join(format!("{stem}.part{k}.parquet")),
        };
        let writer = EventFileWriter::create(&path, self.run)?;
        self.open =
            Some(OpenEventFile { writer, path, opened_data_ns: None, first_slice: 0, last_slice: 0, slices: 0 });
        Ok(())
    }

    fn write(
        &mut self,
        builder: u32,
        slice: u64,
        start_ns: u64,
        events: &[Event],
    ) -> Result<(), shoal_store::StoreError> {
        let due = self
            .open
            .as_ref()
            .and_then(|o| o.opened_data_ns)
            .is_some_and(|t| self.checkpoint_ns > 0 && start_ns >= t.saturating_add(self.checkpoint_ns));
        if due {
            self.close_open()?;
            self.open_next()?;
        }
        let o = self.open.as_mut().expect("a file is open between checkpoints");
        o.writer.write_slice(builder, slice, start_ns, events)?;
        if o.opened_data_ns.is_none() {
            o.opened_data_ns = Some(start_ns);
            o.first_slice = slice;
            o.last_slice = slice;
        }
        o.first_slice = o.first_slice.min(slice);
        o.last_slice = o.last_slice.max(slice);
        o.slices += 1;
        Ok(())
    }

    /// Closes the open file and lists it in the manifest (written through to the disk:
    /// what the manifest lists survives a crash).
    fn close_open(&mut self) -> Result<(), shoal_store::StoreError> {
        use std::io::Write;
        let Some(o) = self.open.take() else { return Ok(()) };
        let path = o.path.clone();
        let stats = o.writer.close().inspect_err(|_| self.failed_to_close = Some(path.clone()))?;
        let seal = stats.seal.unwrap_or_default();
        let slices = (o.slices > 0).then_some((o.first_slice, o.last_slice));
        describe(&path, seal, self.run, &self.run_type, stats.events, "filtered", slices)
            .inspect_err(|_| self.failed_to_close = Some(path.clone()))?;
        let closed = ClosedEventFile {
            path,
            first_slice: o.first_slice,
            last_slice: o.last_slice,
            slices: o.slices,
            events: stats.events,
            hits: stats.hits,
            bytes: stats.bytes,
            checksum: seal.checksum(),
        };
        let mut line = serde_json::to_vec(&closed).expect("a closed file's line serialises");
        line.push(b'\n');
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.manifest)
            .and_then(|mut m| {
                m.write_all(&line)?;
                m.sync_data()
            })
            .map_err(|source| shoal_store::StoreError::Create { path: self.manifest.clone(), source })?;
        self.closed.push(closed);
        Ok(())
    }

    /// The file not closed whole: the one open now, or the one whose closing failed.
    fn unclosed(&self) -> Option<PathBuf> {
        self.open.as_ref().map(|o| o.path.clone()).or_else(|| self.failed_to_close.clone())
    }

    /// Closes the last file; the totals and every file closed.
    fn finish(&mut self) -> Result<(EventFileStats, Vec<ClosedEventFile>), shoal_store::StoreError> {
        self.close_open()?;
        Ok((totals(&self.first_path, &self.closed), std::mem::take(&mut self.closed)))
    }
}

/// The totals of the events files closed (`path`: the run's first).
fn totals(path: &std::path::Path, closed: &[ClosedEventFile]) -> EventFileStats {
    EventFileStats {
        path: path.to_path_buf(),
        events: closed.iter().map(|f| f.events).sum(),
        hits: closed.iter().map(|f| f.hits).sum(),
        bytes: closed.iter().map(|f| f.bytes).sum(),
        seal: None,
    }
}

/// Whether `path` ends with Parquet's footer magic (a file closed whole); reads its last
/// four bytes only (an unclosed file can hold a minute of events).
fn has_parquet_footer(path: &std::path::Path) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let mut tail = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| {
            if f.metadata()?.len() < 8 {
                return Ok(false);
            }
            f.seek(SeekFrom::End(-4))?;
            f.read_exact(&mut tail)?;
            Ok(&tail == b"PAR1")
        })
        .unwrap_or(false)
}

/// A writer started again during its run: the files of the run its predecessors left
/// unclosed (not in the manifest, no Parquet footer) and the last slice a closed file holds.
fn find_previous(dir: &std::path::Path, run: u64, own_first: &std::path::Path) -> Option<LostWithWriter> {
    let stem = format!("run{run:06}.events");
    let manifest = std::fs::read_to_string(dir.join(format!("{stem}.manifest.jsonl"))).unwrap_or_default();
    let closed: Vec<ClosedEventFile> = manifest.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let mut unclosed: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with(&stem) && name.ends_with(".parquet") && p != own_first
        })
        .filter(|p| !closed.iter().any(|c| &c.path == p))
        .filter(|p| !has_parquet_footer(p))
        .collect();
    unclosed.sort();
    if unclosed.is_empty() {
        return None;
    }
    Some(LostWithWriter {
        unclosed_files: unclosed,
        after_slice: closed.iter().map(|c| c.last_slice).max(),
        before_slice: None,
    })
}

enum Incoming {
    Slice { builder: u32, slice: u64, slice_start_ns: u64, events: Vec<Event> },
    Raw(RawRecord),
    Ended { builder: u32 },
    Rejected { reason: &'static str },
}

/// Most frames of one connection handed on in one message: those one read brought.
const READ_BATCH: usize = 64;

/// Reads one builder's connection; the frames each read brings go on in one message (a
/// builder sends one EVENTS frame per slice, hundreds of thousands a second at small
/// fragments, and a message per frame cost a wake-up each).
async fn read_connection(
    stream: shoal_tls::DataStream,
    peer: SocketAddr,
    speaker: Speaker,
    tx: mpsc::Sender<Vec<Incoming>>,
    cancel: CancellationToken,
) {
    let mut reader = FrameReader::new(stream, peer, 256 << 20, cancel)
        .first_frame_within(crate::transport::listen::FIRST_FRAME_WITHIN);
    let end = loop {
        let mut next = match reader.next().await {
            Ok(f) => Some(f),
            Err(end) => break end,
        };
        let mut batch = Vec::new();
        let mut ended = None;
        while let Some(frame) = next.take() {
            match incoming(&frame, &speaker) {
                Ok(msg) => batch.push(msg),
                Err((reason, detail)) => {
                    ended = Some(reader.reject(reason, &detail));
                    break;
                }
            }
            if batch.len() < READ_BATCH {
                match reader.next_buffered() {
                    Ok(f) => next = f,
                    Err(end) => ended = Some(end),
                }
            }
        }
        // What came before a bad frame is kept.
        if !batch.is_empty() && tx.send(batch).await.is_err() {
            break ReadEnd::Clean;
        }
        if let Some(end) = ended {
            break end;
        }
    };
    if let ReadEnd::Rejected(reason) = end {
        let _ = tx.send(vec![Incoming::Rejected { reason }]).await;
    }
}

/// What a frame from a builder says, or why it is refused (a counter label and a detail).
/// Every builder id a frame carries must be one the connection's certificate holds.
fn incoming(frame: &shoal_core::frame::Frame, speaker: &Speaker) -> Result<Incoming, (&'static str, String)> {
    let h = &frame.header;
    let builder = |id: u32| match speaker.may_send_as(id) {
        true => Ok(id),
        false => Err(("identity", speaker.refuse("builder", id))),
    };
    if h.flags.contains(Flags::END_OF_STREAM) {
        Ok(Incoming::Ended { builder: builder(h.source)? })
    } else if h.flags.contains(Flags::RAW) {
        let raw = RawRecord::from_frame(frame).map_err(|e| (e.kind(), e.to_string()))?;
        builder(raw.head.builder)?;
        Ok(Incoming::Raw(raw))
    } else if !h.flags.contains(Flags::EVENTS) {
        Err(("not_events", "a data frame on the event port".into()))
    } else {
        match decode_events(&frame.payload) {
            Ok(events) => Ok(Incoming::Slice {
                builder: builder(h.source)?,
                slice: h.slice,
                slice_start_ns: h.slice_start.as_nanos(),
                events,
            }),
            Err(e) => Err(("bad_events", e.to_string())),
        }
    }
}

/// Slices and raw records waiting for the disk thread ...
const DISK_QUEUE: usize = 256;
/// ... and their bytes, KiB: the writer's share of its process's memory budget
/// (`crate::budget`: 256 MiB). A disk slower than the network holds up the builders'
/// connections (they queue at the builders, counted there) instead of growing this.
pub const DISK_QUEUE_KIB: usize = 256 << 10;

/// Most slices and raw records the receiving side hands the disk thread at once, and
/// bytes after which it adds no more.
const DISK_BATCH: usize = 256;
const DISK_BATCH_BYTES: usize = 16 << 20;

/// What the disk thread writes: what the receiving side took in one round, with its room
/// in the queue (given back once all of it is written).
struct DiskWork {
    items: Vec<DiskItem>,
    _room: tokio::sync::OwnedSemaphorePermit,
}

enum DiskItem {
    Events(u32, u64, u64, Vec<Event>),
    Raw(RawRecord),
}

/// What the disk thread closed at the end: the events files' totals and list, the raw and
/// whole-slice files.
type DiskDone = ((EventFileStats, Vec<ClosedEventFile>), Option<RawFileStats>, Option<RawFileStats>);

/// The writer's disk thread: events into the run's events files, raw records (alert
/// windows, late fragments, whole slices) into theirs. A disk that refused once (full,
/// gone) is not tried again: the thread ends, and what arrives after is counted as not
/// stored by the receiving side.
struct DiskWriter {
    run: u64,
    files: EventFiles,
    raw: Option<RawFileWriter>,
    slices: Option<RawFileWriter>,
    raw_path: PathBuf,
    slices_path: PathBuf,
    /// Alert names by (builder, alert record), for the raw rows.
    names: BTreeMap<(u32, u32), String>,
    /// The disk's busy time, and whether it failed (run control's `storage_failing`).
    live: Arc<Live>,
}

impl DiskWriter {
    /// Stores what comes until the queue closes, then closes every file.
    fn run(mut self, mut rx: mpsc::Receiver<DiskWork>) -> Result<DiskDone, DiskFailure> {
        while let Some(work) = rx.blocking_recv() {
            let began = std::time::Instant::now();
            let stored = work.items.into_iter().try_for_each(|item| self.store(item));
            Live::add(&self.live.storage_busy_ns, began.elapsed().as_nanos() as u64);
            stored.map_err(|e| self.failed(e))?;
        }
        self.close().map_err(|e| self.failed(e))
    }

    fn store(&mut self, item: DiskItem) -> Result<(), shoal_store::StoreError> {
        match item {
            DiskItem::Events(builder, slice, start, events) => self.files.write(builder, slice, start, &events)?,
            DiskItem::Raw(r) => {
                if r.head.kind == RawKind::AlertOpened {
                    let name =
                        shoal_core::alert::Alert::parse(&r.body).map(|a| a.name).unwrap_or_else(|_| "unnamed".into());
                    self.names.insert((r.head.builder, r.head.record), name);
                    return Ok(());
                }
                let (file, path) = if r.head.kind == RawKind::SliceData {
                    (&mut self.slices, &self.slices_path)
                } else {
                    (&mut self.raw, &self.raw_path)
                };
                let w = match file.as_mut() {
                    Some(w) => w,
                    None => file.insert(RawFileWriter::create(path, self.run)?),
                };
                w.write(&RawRow {
                    whole_slice: r.head.kind == RawKind::SliceData,
                    builder: r.head.builder,
                    alert: r.head.record,
                    alert_name: self.names.get(&(r.head.builder, r.head.record)).map(String::as_str),
                    slice: r.head.slice,
                    source: r.head.source,
                    slice_start_ns: r.head.slice_start.as_nanos(),
                    hit_count: r.head.hit_count,
                    payload: &r.body,
                })?;
            }
        }
        Ok(())
    }

    fn close(&mut self) -> Result<DiskDone, shoal_store::StoreError> {
        let raw = self.raw.take().map(RawFileWriter::close).transpose()?;
        let slices = self.slices.take().map(RawFileWriter::close).transpose()?;
        for stats in raw.iter().chain(&slices) {
            let rows = stats.alert_fragments + stats.late_fragments;
            describe(&stats.path, stats.seal.unwrap_or_default(), self.run, &self.files.run_type, rows, "raw", None)?;
        }
        Ok((self.files.finish()?, raw, slices))
    }

    fn failed(&self, error: shoal_store::StoreError) -> DiskFailure {
        self.live.storage_failed.store(1, std::sync::atomic::Ordering::Relaxed);
        DiskFailure { error, closed: self.files.closed.clone(), open: self.files.unclosed() }
    }
}

/// What one round of the receiving side takes out of the channel for the disk thread.
#[derive(Default)]
struct Round {
    items: Vec<DiskItem>,
    /// The memory they take in the disk queue.
    bytes: usize,
}

impl Round {
    /// At [`DISK_BATCH`] items or [`DISK_BATCH_BYTES`]: the round takes no more.
    fn is_full(&self) -> bool {
        self.items.len() >= DISK_BATCH || self.bytes >= DISK_BATCH_BYTES
    }
}

/// Counts one message from a builder's connection in `report` (or the builders that
/// `ended`) and adds what it carries for the disk to `round`.
fn take_message(
    m: Incoming,
    report: &mut WriterReport,
    lost_with_previous: &mut Option<LostWithWriter>,
    ended: &mut BTreeSet<u32>,
    round: &mut Round,
) {
    match m {
        Incoming::Slice { builder, slice, slice_start_ns, events } => {
            report.slices += 1;
            // The first slice after a restart: the events lost with the predecessor are
            // those before it.
            if let Some(l) = lost_with_previous.as_mut() {
                l.before_slice = Some(l.before_slice.map_or(slice, |b| b.min(slice)));
            }
            *report.events_per_builder.entry(builder).or_default() += events.len() as u64;
            round.bytes += events_bytes(&events);
            round.items.push(DiskItem::Events(builder, slice, slice_start_ns, events));
        }
        Incoming::Raw(r) if r.head.kind == RawKind::AlertClosed => match serde_json::from_slice::<AlertReport>(&r.body)
        {
            Ok(a) => report.alerts.push(a),
            Err(e) => warn!(builder = r.head.builder, error = %e, "unreadable alert report"),
        },
        Incoming::Raw(r) => {
            round.bytes += r.body.len();
            round.items.push(DiskItem::Raw(r));
        }
        Incoming::Ended { builder } => {
            ended.insert(builder);
        }
        Incoming::Rejected { reason } => *report.rejected_connections.entry(reason.into()).or_default() += 1,
    }
}

/// The bounded queue to the disk thread: its channel, and room for [`DISK_QUEUE_KIB`].
struct DiskQueue {
    tx: mpsc::Sender<DiskWork>,
    room: Arc<tokio::sync::Semaphore>,
    /// The disk thread has failed (it reports why): what arrives after is counted and
    /// dropped.
    failed: bool,
}

impl DiskQueue {
    /// Hands a round to the disk thread once the queue has room for its bytes (waiting
    /// while it is full); returns how many raw records of it will not be stored.
    async fn send(&mut self, round: Round) -> u64 {
        let mut items = round.items;
        if !items.is_empty() && !self.failed {
            let kib = round.bytes.div_ceil(1024).clamp(1, DISK_QUEUE_KIB) as u32;
            let room = self.room.clone().acquire_many_owned(kib).await.expect("the queue's semaphore is never closed");
            items = match self.tx.send(DiskWork { items, _room: room }).await {
                Ok(()) => Vec::new(),
                Err(refused) => {
                    self.failed = true;
                    refused.0.items
                }
            };
        }
        items.iter().filter(|i| matches!(i, DiskItem::Raw(_))).count() as u64
    }
}

/// Memory an event batch takes in the queue (its hits dominate).
fn events_bytes(events: &[Event]) -> usize {
    events.iter().map(|e| 64 + e.hits.len() * std::mem::size_of::<shoal_core::event::EventHit>()).sum()
}

/// `<dir>/<stem>.<ext>`, or, if that exists (a writer started again during the same run,
/// after a crash), `<stem>.part2.<ext>`, `.part3`, ...: a run's files are never
/// overwritten.
pub fn unused_path(dir: &std::path::Path, stem: &str, ext: &str) -> std::path::PathBuf {
    let first = dir.join(format!("{stem}.{ext}"));
    if !first.exists() {
        return first;
    }
    (2u32..).map(|k| dir.join(format!("{stem}.part{k}.{ext}"))).find(|p| !p.exists()).expect("some part number is free")
}

/// The writer's settings, derived once from the [`Config`] where the role starts.
#[derive(Clone, Debug)]
pub struct WriterSettings {
    pub run: u64,
    /// Builders whose end of stream the writer waits for.
    pub builders: usize,
    pub out_dir: PathBuf,
    /// Keep the files of this run already there (a restarted writer under run control).
    pub keep_existing: bool,
    /// A new events file every so much data time (0: one file).
    pub checkpoint_ns: u64,
    /// The run's type, for each file's metadata.
    pub run_type: String,
    /// The handshake on the writer's port (`[security] data`).
    pub data_port: crate::transport::secure::DataPort,
}

impl WriterSettings {
    pub fn from_config(cfg: &Config) -> Result<Self, crate::config::ConfigError> {
        let w = &cfg.writer;
        Ok(Self {
            run: cfg.run.run_number,
            builders: cfg.run.builders as usize,
            out_dir: w.out_dir.clone(),
            keep_existing: w.keep_existing,
            checkpoint_ns: (w.checkpoint_s.max(0.0) * 1e9) as u64,
            run_type: cfg.run.run_type.clone(),
            data_port: cfg.data_port("writer")?,
        })
    }
}

/// Runs the writer on a bound listener until every builder has ended its stream (or
/// `cancel`), then closes the files.
pub async fn run_writer(cfg: Config, listener: TcpListener, cancel: CancellationToken) -> anyhow::Result<WriterReport> {
    run_writer_with(cfg, listener, cancel, Arc::new(Live::default())).await
}

/// [`run_writer`] counting into `live` (a run-controlled writer's statistics: the disk's
/// busy time, whether it failed).
pub async fn run_writer_with(
    cfg: Config,
    listener: TcpListener,
    cancel: CancellationToken,
    live: Arc<Live>,
) -> anyhow::Result<WriterReport> {
    let s = WriterSettings::from_config(&cfg)?;
    let (run, n_builders) = (s.run, s.builders);
    std::fs::create_dir_all(&s.out_dir)?;
    let dir = &s.out_dir;
    // Under run control a run number is never reused: a file of this run is from an
    // earlier incarnation of this writer (restarted after a crash) and is kept.
    let name = |stem: &str, ext: &str| match s.keep_existing {
        true => unused_path(dir, &format!("run{run:06}.{stem}"), ext),
        false => dir.join(format!("run{run:06}.{stem}.{ext}")),
    };
    let summary_path = name("writer", "json");
    let files = EventFiles::new(&s)?;
    let path = files.first_path.clone();
    let mut lost_with_previous = if s.keep_existing { find_previous(dir, run, &path) } else { None };

    let (tx, mut rx) = mpsc::channel::<Vec<Incoming>>(1024);
    let readers = CancellationToken::new();
    let accept_cancel = readers.clone();
    let limit = crate::transport::listen::ConnectionLimit::for_port(n_builders, s.data_port.identifies());
    let secure = s.data_port.clone();
    let accept = tokio::spawn(async move {
        let serve = |stream, peer, mut place: crate::transport::listen::ConnectionPlace| {
            let (tx, c, secure) = (tx.clone(), accept_cancel.clone(), secure.clone());
            tokio::spawn(async move {
                if let Some((stream, speaker)) = crate::transport::secure::accept(&secure, stream, peer, "writer").await
                {
                    if let Some(name) = speaker.identity() {
                        place.identify(name);
                    }
                    read_connection(stream, peer, speaker, tx, c).await;
                }
                drop(place);
            });
        };
        let rejected = || {
            let tx = tx.clone();
            async move {
                let _ = tx.send(vec![Incoming::Rejected { reason: "connection_limit" }]).await;
            }
        };
        crate::transport::listen::accept_loop(listener, "writer", limit, accept_cancel.clone(), serve, rejected).await
    });

    // Parquet encoding on its own thread.
    // Bounded: a disk slower than the network holds up the builders' connections (they
    // queue at the builders, counted there) instead of growing the writer's memory.
    let (disk_tx, disk_rx) = mpsc::channel::<DiskWork>(DISK_QUEUE);
    let queue_room = Arc::new(tokio::sync::Semaphore::new(DISK_QUEUE_KIB));
    let disk = DiskWriter {
        run,
        files,
        raw: None,
        slices: None,
        raw_path: name("raw", "parquet"),
        slices_path: name("slices", "parquet"),
        names: BTreeMap::new(),
        live: live.clone(),
    };
    let disk = std::thread::Builder::new().name("writer-disk".into()).spawn(move || disk.run(disk_rx))?;
    let watching = disk::watch(s.out_dir.clone(), live.clone(), readers.child_token());

    let mut report = WriterReport { run, summary_path: summary_path.clone(), ..Default::default() };
    let mut ended = BTreeSet::new();
    let mut disk_queue = DiskQueue { tx: disk_tx, room: queue_room, failed: false };
    info!(path = %path.display(), n_builders, "writer started");
    while ended.len() < n_builders {
        tokio::select! {
            m = rx.recv() => match m {
                Some(mut messages) => {
                    let mut round = Round::default();
                    loop {
                        for m in messages {
                            take_message(m, &mut report, &mut lost_with_previous, &mut ended, &mut round);
                        }
                        // What else has come goes to the disk thread with it, up to a
                        // bound: what is taken out of the channel waits here for its room.
                        if round.is_full() {
                            break;
                        }
                        match rx.try_recv() {
                            Ok(more) => messages = more,
                            Err(_) => break,
                        }
                    }
                    report.raw_not_stored += disk_queue.send(round).await;
                }
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
    drop(disk_queue);
    report.builders_ended = ended.len();
    match tokio::task::spawn_blocking(move || disk.join()).await? {
        Ok(Ok(((stats, closed), raw, slices))) => {
            report.slices_file = slices;
            report.file = stats;
            report.files = closed;
            report.raw = raw;
        }
        Ok(Err(f)) => {
            report.error = Some(format!("writing {}: {}", f.open.as_ref().unwrap_or(&path).display(), f.error));
            // The files closed before the failure are whole; the events of the file open
            // then, and of everything after, are not stored.
            report.file = totals(&path, &f.closed);
            report.not_stored = Some(LostWithWriter {
                unclosed_files: f.open.into_iter().collect(),
                after_slice: f.closed.iter().map(|c| c.last_slice).max(),
                before_slice: None,
            });
            report.files = f.closed;
        }
        Err(_) => report.error = Some("writer disk thread panicked".into()),
    }
    if let Some(l) = &lost_with_previous {
        warn!(unclosed = ?l.unclosed_files, after_slice = ?l.after_slice, before_slice = ?l.before_slice,
            "a previous writer of this run left files unclosed: their events are lost");
    }
    report.lost_with_previous = lost_with_previous.take();
    if report.error.is_some() {
        // What the failed file held is gone too (a Parquet file is whole only once closed).
        let received: u64 = report.events_per_builder.values().sum();
        report.events_not_stored = received.saturating_sub(report.file.events);
        warn!(error = ?report.error, events_not_stored = report.events_not_stored, raw_not_stored = report.raw_not_stored, "the writer could not store the run");
    }
    watching.abort();
    report.archive = archive_at_end(&report, &live.archive);
    if let Err(e) = std::fs::write(&summary_path, serde_json::to_vec_pretty(&report)?) {
        warn!(path = %summary_path.display(), error = %e, "cannot write the writer's summary");
        report.error.get_or_insert_with(|| format!("writing {}: {e}", summary_path.display()));
    }
    info!(events = report.file.events, path = %path.display(), "writer finished");
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw_fragment(slice: u64, body: &'static [u8]) -> Incoming {
        let head = shoal_core::rawrec::RawHead {
            builder: 0,
            record: 0,
            kind: RawKind::Fragment,
            source: 1,
            slice,
            slice_start: shoal_core::Instant::ZERO,
            hit_count: 0,
        };
        Incoming::Raw(RawRecord { head, body: bytes::Bytes::from_static(body) })
    }

    /// A round counts what it takes and is full at its bound; an alert's closing report
    /// goes into the report, not to the disk.
    #[test]
    fn a_round_takes_slices_and_raw_records_up_to_its_bound() {
        let (mut report, mut lost, mut ended) = (WriterReport::default(), None, BTreeSet::new());
        let mut round = Round::default();
        take_message(raw_fragment(7, b"abcd"), &mut report, &mut lost, &mut ended, &mut round);
        take_message(Incoming::Ended { builder: 3 }, &mut report, &mut lost, &mut ended, &mut round);
        take_message(Incoming::Rejected { reason: "bad_magic" }, &mut report, &mut lost, &mut ended, &mut round);
        assert_eq!((round.items.len(), round.bytes, round.is_full()), (1, 4, false));
        assert_eq!(ended, BTreeSet::from([3]));
        assert_eq!(report.rejected_connections.get("bad_magic"), Some(&1));
        for slice in 0..DISK_BATCH as u64 - 1 {
            let m = Incoming::Slice { builder: 0, slice, slice_start_ns: 0, events: Vec::new() };
            take_message(m, &mut report, &mut lost, &mut ended, &mut round);
        }
        assert!(round.is_full(), "{} items", round.items.len());
        assert_eq!((report.slices, report.events_per_builder.get(&0)), (DISK_BATCH as u64 - 1, Some(&0)));
    }

    /// Once the disk thread is gone, a round is not queued and its raw records are counted
    /// as not stored, then and for every round after (without waiting for room).
    #[tokio::test]
    async fn after_the_disk_thread_is_gone_rounds_are_counted_not_queued() {
        let (tx, rx) = mpsc::channel(1);
        drop(rx);
        let mut queue = DiskQueue { tx, room: Arc::new(tokio::sync::Semaphore::new(DISK_QUEUE_KIB)), failed: false };
        let (mut report, mut lost, mut ended) = (WriterReport::default(), None, BTreeSet::new());
        for _ in 0..2 {
            let mut round = Round::default();
            take_message(raw_fragment(1, b"x"), &mut report, &mut lost, &mut ended, &mut round);
            take_message(raw_fragment(2, b"y"), &mut report, &mut lost, &mut ended, &mut round);
            let m = Incoming::Slice { builder: 0, slice: 1, slice_start_ns: 0, events: Vec::new() };
            take_message(m, &mut report, &mut lost, &mut ended, &mut round);
            assert_eq!(queue.send(round).await, 2);
            assert!(queue.failed);
        }
        assert_eq!(queue.room.available_permits(), DISK_QUEUE_KIB, "the room reserved for a refused round comes back");
    }

    #[test]
    fn checkpoints_close_a_file_a_window_and_a_restart_finds_what_was_left_open() {
        let dir = std::env::temp_dir().join(format!("shoal-checkpoints-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut cfg = Config::default();
        cfg.run.run_number = 3;
        cfg.writer.out_dir = dir.clone();
        cfg.writer.keep_existing = true;
        cfg.writer.checkpoint_s = 1.0;
        let mut files = EventFiles::new(&WriterSettings::from_config(&cfg).unwrap()).unwrap();
        // 100-ms slices over 2.5 s of data: files of slices 10-19, 20-29, 30-34.
        for slice in 10..35u64 {
            files.write(0, slice, slice * 100_000_000, &[]).unwrap();
        }
        // A crash here: the third file is open, the manifest lists two.
        std::mem::forget(files);
        let manifest = std::fs::read_to_string(dir.join("run000003.events.manifest.jsonl")).unwrap();
        let closed: Vec<ClosedEventFile> = manifest.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        let spans: Vec<(u64, u64)> = closed.iter().map(|c| (c.first_slice, c.last_slice)).collect();
        assert_eq!(spans, [(10, 19), (20, 29)]);
        // The writer started again: a fourth part, and the third found unclosed.
        let mut again = EventFiles::new(&WriterSettings::from_config(&cfg).unwrap()).unwrap();
        assert_eq!(again.first_path, dir.join("run000003.events.part4.parquet"));
        let lost = find_previous(&dir, 3, &again.first_path).expect("the open file is found");
        assert_eq!(lost.unclosed_files, [dir.join("run000003.events.part3.parquet")]);
        assert_eq!(lost.after_slice, Some(29));
        let (total, closed) = again.finish().unwrap();
        assert_eq!((total.events, closed.len()), (0, 1));
        // Outside run control (no restart to continue from): no manifest left from before.
        cfg.writer.keep_existing = false;
        let mut fresh = EventFiles::new(&WriterSettings::from_config(&cfg).unwrap()).unwrap();
        assert!(!dir.join("run000003.events.manifest.jsonl").exists());
        drop(fresh.finish().unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_restarted_writer_never_overwrites_the_runs_files() {
        let dir = std::env::temp_dir().join(format!("shoal-unused-path-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let first = super::unused_path(&dir, "run000007.events", "parquet");
        assert_eq!(first, dir.join("run000007.events.parquet"));
        std::fs::write(&first, b"x").unwrap();
        let second = super::unused_path(&dir, "run000007.events", "parquet");
        assert_eq!(second, dir.join("run000007.events.part2.parquet"));
        std::fs::write(&second, b"x").unwrap();
        assert_eq!(super::unused_path(&dir, "run000007.events", "parquet"), dir.join("run000007.events.part3.parquet"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
