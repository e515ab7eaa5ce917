//! A builder's spool: what its burst saver and late-data side stream hand out is written
//! to a local file first (fast, bounded, never waiting for the network), then shipped to
//! the writer as `RAW` frames (`shoal_core::rawrec`) on the builder's writer link.
//!
//! One thread per builder. Records are appended to `run{N:06}-builder{B}.spool` in the
//! spool directory, in the frame format they are shipped in. When no alert is open any
//! more (an alert's window and what followed are on disk), the file is shipped from where
//! the last shipment stopped; at the end of the run the rest (late fragments) follows, and
//! a completely shipped file is removed. Shipping sends whole frames in groups of about
//! 1 MiB, straight from the file (the writer checks every CRC), at most
//! `saver.ship_mb_per_s`, and waits while the link holds more than [`SHIP_QUEUE_BYTES`], so
//! that saved data never pile up in memory behind the network.
//!
//! Saving is background work: the spool thread runs at a lower CPU priority (nice +10), so
//! on a loaded machine the builder and its filter keep theirs. Every record refused (spool
//! full) or lost (disk error) is counted.

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use bytes::BytesMut;
use shoal_core::frame::{self, HEADER_LEN};
use shoal_core::rawrec::{self, RawHead, RawKind};
use shoal_core::saver::{AlertReport, SaverOutput};
use shoal_core::slice::SliceClock;
use shoal_trigger::FragmentData;
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::transport::link::{Chunk, Link};

/// Shipping pauses while the writer link holds more than this.
pub const SHIP_QUEUE_BYTES: u64 = 4 << 20;
/// Frames are shipped in groups of about this size.
const SHIP_GROUP_BYTES: usize = 1 << 20;
/// The spool thread's nice value (background work).
const NICE: i32 = 10;

/// Work for the spool thread.
#[derive(Debug)]
pub enum SpoolWork {
    Save(SaverOutput<FragmentData>),
    /// End of run: ship what is left and stop.
    Finish,
}

/// What the spool did in a run.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SpoolReport {
    pub path: PathBuf,
    /// Records written to the spool file (fragments and alert descriptions), and bytes.
    pub records: u64,
    pub bytes: u64,
    /// Saved fragments refused because the spool file reached its limit.
    pub refused_full: u64,
    /// Records lost to a disk error (with the first error).
    pub write_failed: u64,
    pub error: Option<String>,
    /// Records handed to the writer link, and bytes.
    pub shipped_records: u64,
    pub shipped_bytes: u64,
    /// The spool file was removed after everything in it was shipped.
    pub removed: bool,
    /// Alerts closed, with what each saved.
    pub alerts: Vec<AlertReport>,
}

/// Where and how much a builder spools.
#[derive(Clone, Debug)]
pub struct SpoolConfig {
    pub builder: u32,
    pub run: u64,
    pub dir: PathBuf,
    pub max_bytes: u64,
    pub slice_clock: SliceClock,
    /// Most shipping rate to the writer, bytes per second (0: unlimited).
    pub ship_bytes_per_s: u64,
}

struct Spool {
    cfg: SpoolConfig,
    path: PathBuf,
    file: Option<BufWriter<File>>,
    written: u64,
    shipped_to: u64,
    open_alerts: usize,
    link: Arc<Link>,
    /// Milliseconds left to wait for a slow writer link over the whole run; after that,
    /// records go to the link at once (its failures are counted there).
    patience_ms: u32,
    report: SpoolReport,
}

/// Starts the spool thread. `spooled` receives the saver's bytes as they reach the disk
/// (or are refused), so the saver's pending bound drains.
pub fn spawn(
    cfg: SpoolConfig,
    link: Arc<Link>,
    work: std::sync::mpsc::Receiver<SpoolWork>,
    spooled: mpsc::UnboundedSender<u64>,
) -> std::thread::JoinHandle<SpoolReport> {
    let path = cfg.dir.join(format!("run{:06}-builder{}.spool", cfg.run, cfg.builder));
    let name = format!("spool-{}", cfg.builder);
    let mut spool = Spool {
        report: SpoolReport { path: path.clone(), ..Default::default() },
        cfg,
        path,
        file: None,
        written: 0,
        shipped_to: 0,
        open_alerts: 0,
        link,
        patience_ms: 60_000,
    };
    std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            lower_priority();
            for w in work {
                match w {
                    SpoolWork::Save(out) => spool.save(out, &spooled),
                    SpoolWork::Finish => break,
                }
            }
            spool.ship();
            spool.finish()
        })
        .expect("spawn spool thread")
}

/// Background work: this thread yields the CPU to the data path (Linux sets a thread's nice
/// value through its thread id).
fn lower_priority() {
    let tid = rustix::thread::gettid();
    if let Err(e) = rustix::process::setpriority_process(Some(tid), NICE) {
        tracing::debug!(error = %e, "could not lower the spool thread's priority");
    }
}

impl Spool {
    fn save(&mut self, out: SaverOutput<FragmentData>, spooled: &mpsc::UnboundedSender<u64>) {
        let b = self.cfg.builder;
        match out {
            SaverOutput::Opened { id, alert } => {
                self.open_alerts += 1;
                let text = alert.encode();
                let parts = RawHead::description(b, id, RawKind::AlertOpened).encode_parts(text.as_bytes());
                self.append(parts, text.as_bytes(), true);
            }
            SaverOutput::Fragment { record, slice, source, bytes, data } => {
                let head = RawHead {
                    builder: b,
                    record: record.number(),
                    kind: RawKind::Fragment,
                    source,
                    slice,
                    slice_start: self.cfg.slice_clock.start_of(slice),
                    hit_count: data.hit_count,
                };
                let parts = head.encode_parts(&data.payload);
                self.append(parts, &data.payload, false);
                let _ = spooled.send(bytes);
            }
            SaverOutput::Closed(report) => {
                let json = serde_json::to_vec(&report).unwrap_or_default();
                let parts = RawHead::description(b, report.id, RawKind::AlertClosed).encode_parts(&json);
                self.append(parts, &json, true);
                info!(builder = b, "{}", report.describe());
                self.report.alerts.push(report);
                self.open_alerts = self.open_alerts.saturating_sub(1);
                if self.open_alerts == 0 {
                    self.ship();
                }
            }
        }
    }

    /// Appends one record; descriptions are written even past the size limit (they are
    /// small, and without them the writer could not name what it stores).
    fn append(
        &mut self,
        (header, prefix): ([u8; HEADER_LEN], [u8; rawrec::PREFIX_LEN]),
        body: &[u8],
        description: bool,
    ) {
        let len = (HEADER_LEN + rawrec::PREFIX_LEN + body.len()) as u64;
        if !description && self.written + len > self.cfg.max_bytes {
            self.report.refused_full += 1;
            return;
        }
        if self.file.is_none() {
            let opened = std::fs::create_dir_all(&self.cfg.dir).and_then(|_| File::create(&self.path));
            match opened {
                Ok(f) => self.file = Some(BufWriter::with_capacity(1 << 20, f)),
                Err(e) => return self.failed(format!("creating {}: {e}", self.path.display())),
            }
        }
        let f = self.file.as_mut().expect("opened above");
        match f.write_all(&header).and_then(|_| f.write_all(&prefix)).and_then(|_| f.write_all(body)) {
            Ok(()) => {
                self.written += len;
                self.report.records += 1;
                self.report.bytes += len;
            }
            Err(e) => self.failed(format!("writing {}: {e}", self.path.display())),
        }
    }

    fn failed(&mut self, error: String) {
        self.report.write_failed += 1;
        if self.report.error.is_none() {
            warn!(builder = self.cfg.builder, %error, "spool write failed; saved data are lost (counted)");
            self.report.error = Some(error);
        }
    }

    /// Ships everything written since the last shipment: whole frames, in groups.
    fn ship(&mut self) {
        let Some(f) = self.file.as_mut() else { return };
        if let Err(e) = f.flush() {
            return self.failed(format!("flushing {}: {e}", self.path.display()));
        }
        if self.shipped_to >= self.written {
            return;
        }
        let opened = File::open(&self.path).and_then(|mut r| r.seek(SeekFrom::Start(self.shipped_to)).map(|_| r));
        let mut reader = match opened {
            Ok(r) => r,
            Err(e) => return self.failed(format!("reading {}: {e}", self.path.display())),
        };
        let started = StdInstant::now();
        let mut sent_bytes = 0u64;
        let mut left = self.written - self.shipped_to;
        let mut buf = BytesMut::new();
        while left > 0 || !buf.is_empty() {
            // Read up to two groups, then send the whole frames of (about) one.
            let room = (2 * SHIP_GROUP_BYTES).saturating_sub(buf.len()).min(left as usize);
            if room > 0 {
                let at = buf.len();
                buf.resize(at + room, 0);
                if let Err(e) = reader.read_exact(&mut buf[at..]) {
                    return self.failed(format!("reading {}: {e}", self.path.display()));
                }
                left -= room as u64;
            }
            let (mut group, mut frames) = (0usize, 0u64);
            while group < SHIP_GROUP_BYTES && buf.len() - group >= HEADER_LEN {
                match frame::decode_header(&buf[group..group + HEADER_LEN], u32::MAX) {
                    Ok(h) if group + HEADER_LEN + h.payload_len as usize <= buf.len() => {
                        group += HEADER_LEN + h.payload_len as usize;
                        frames += 1;
                    }
                    Ok(h) if group == 0 => {
                        // One frame larger than two groups: read the rest of it.
                        let need = HEADER_LEN + h.payload_len as usize - buf.len();
                        if need as u64 > left {
                            return self.failed(format!("spool {} ends inside a frame", self.path.display()));
                        }
                        let at = buf.len();
                        buf.resize(at + need, 0);
                        if let Err(e) = reader.read_exact(&mut buf[at..]) {
                            return self.failed(format!("reading {}: {e}", self.path.display()));
                        }
                        left -= need as u64;
                    }
                    Ok(_) => break,
                    Err(e) => return self.failed(format!("spool {} is corrupt: {e}", self.path.display())),
                }
            }
            if group == 0 {
                return self.failed(format!("spool {} ends inside a frame", self.path.display()));
            }
            let chunk = buf.split_to(group).freeze();
            self.pace(sent_bytes, started);
            sent_bytes += group as u64;
            let b = self.cfg.builder;
            self.link.send(Chunk {
                source: b,
                slice: 0,
                first: false,
                last: true,
                head: chunk,
                body: bytes::Bytes::new(),
            });
            self.report.shipped_records += frames;
            self.report.shipped_bytes += group as u64;
        }
        self.shipped_to = self.written;
    }

    /// Waits until sending more keeps to the shipping rate, and while the link is full
    /// (bounded over the run by `patience_ms`).
    fn pace(&mut self, sent_bytes: u64, started: StdInstant) {
        if self.cfg.ship_bytes_per_s > 0 {
            let due = Duration::from_secs_f64(sent_bytes as f64 / self.cfg.ship_bytes_per_s as f64);
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                std::thread::sleep(wait);
            }
        }
        while self.link.queued_bytes() > SHIP_QUEUE_BYTES && self.patience_ms > 0 {
            std::thread::sleep(Duration::from_millis(1));
            self.patience_ms -= 1;
        }
    }

    fn finish(mut self) -> SpoolReport {
        if let Some(f) = self.file.take() {
            drop(f);
            if self.shipped_to == self.written && self.report.write_failed == 0 {
                self.report.removed = std::fs::remove_file(&self.path).is_ok();
            }
        }
        self.report
    }
}
