//! A builder's spool: what its burst saver and late-data side stream hand out is written
//! to a local file first (fast, bounded, never waiting for the network), then shipped to
//! the writer as `RAW` frames (`shoal_core::rawrec`) on the builder's writer link.
//!
//! One thread per builder. Records are appended to `run{N:06}-builder{B}.spool` in the
//! spool directory, in the frame format they are shipped in. When no alert is open any
//! more (an alert's window and what followed are on disk), the file is shipped from where
//! the last shipment stopped; at the end of the run the rest (late fragments) follows, and
//! a completely shipped file is removed. Shipping waits while the link holds more than
//! [`SHIP_QUEUE_BYTES`] so that saved data never piles up in memory behind the network.
//! Every record refused (spool full) or lost (disk error) is counted.

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::sync::Arc;

use shoal_core::frame::{HEADER_LEN, StreamDecoder};
use shoal_core::rawrec::{self, RawKind};
use shoal_core::saver::{AlertReport, SaverOutput};
use shoal_core::slice::SliceClock;
use shoal_trigger::FragmentData;
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::link::{Chunk, Link};

/// Shipping pauses while the writer link holds more than this.
pub const SHIP_QUEUE_BYTES: u64 = 16 << 20;

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

impl Spool {
    fn save(&mut self, out: SaverOutput<FragmentData>, spooled: &mpsc::UnboundedSender<u64>) {
        let b = self.cfg.builder;
        match out {
            SaverOutput::Opened { id, alert } => {
                self.open_alerts += 1;
                let rec = rawrec::encode(
                    b,
                    id,
                    RawKind::AlertOpened,
                    b,
                    0,
                    shoal_core::Instant::ZERO,
                    0,
                    alert.encode().as_bytes(),
                );
                self.append(&rec, true);
            }
            SaverOutput::Fragment { record, slice, source, bytes, data } => {
                let start = self.cfg.slice_clock.start_of(slice);
                let rec = rawrec::encode(
                    b,
                    record.number(),
                    RawKind::Fragment,
                    source,
                    slice,
                    start,
                    data.hit_count,
                    &data.payload,
                );
                self.append(&rec, false);
                let _ = spooled.send(bytes);
            }
            SaverOutput::Closed(report) => {
                let json = serde_json::to_vec(&report).unwrap_or_default();
                let rec = rawrec::encode(b, report.id, RawKind::AlertClosed, b, 0, shoal_core::Instant::ZERO, 0, &json);
                self.append(&rec, true);
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
    fn append(&mut self, rec: &[u8], description: bool) {
        if !description && self.written + rec.len() as u64 > self.cfg.max_bytes {
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
        match f.write_all(rec) {
            Ok(()) => {
                self.written += rec.len() as u64;
                self.report.records += 1;
                self.report.bytes += rec.len() as u64;
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

    /// Ships everything written since the last shipment.
    fn ship(&mut self) {
        let Some(f) = self.file.as_mut() else { return };
        if let Err(e) = f.flush() {
            return self.failed(format!("flushing {}: {e}", self.path.display()));
        }
        if self.shipped_to >= self.written {
            return;
        }
        let mut reader =
            match File::open(&self.path).and_then(|mut r| r.seek(SeekFrom::Start(self.shipped_to)).map(|_| r)) {
                Ok(r) => r,
                Err(e) => return self.failed(format!("reading {}: {e}", self.path.display())),
            };
        let mut decoder = StreamDecoder::new(u32::MAX >> 1);
        let mut left = self.written - self.shipped_to;
        let mut buf = vec![0u8; 1 << 20];
        while left > 0 {
            let want = buf.len().min(left as usize);
            let n = match reader.read(&mut buf[..want]) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) => return self.failed(format!("reading {}: {e}", self.path.display())),
            };
            left -= n as u64;
            decoder.extend(&buf[..n]);
            loop {
                match decoder.next_frame() {
                    Ok(Some(frame)) => self.send(frame),
                    Ok(None) => break,
                    Err(e) => return self.failed(format!("spool {} is corrupt: {e}", self.path.display())),
                }
            }
        }
        self.shipped_to = self.written;
    }

    fn send(&mut self, frame: shoal_core::frame::Frame) {
        // Wait for the link to drain (bounded over the run): saved data never pile up in
        // memory behind a slow network.
        while self.link.queued_bytes() > SHIP_QUEUE_BYTES && self.patience_ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(1));
            self.patience_ms -= 1;
        }
        let len = frame.wire_len() as u64;
        let header = shoal_core::frame::encode_header(&frame.header, &frame.payload);
        debug_assert_eq!(header.len(), HEADER_LEN);
        self.link.send(Chunk::frame(self.cfg.builder, frame.header.slice, header, frame.payload));
        self.report.shipped_records += 1;
        self.report.shipped_bytes += len;
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
