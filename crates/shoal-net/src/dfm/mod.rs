//! The data-flow manager process (pull policies): shoal-core's
//! [`DataFlowManager`] on a TCP listener that the builders connect to.
//!
//! Each builder connection starts with the builder's hello (the slices it holds); then the
//! manager writes assignments and reads returned credits and heartbeats. A connection that
//! closes is a builder that left: it gets no more assignments and its unprocessed slices go
//! to the others. A builder whose sources all ended says so first (an end-of-stream
//! frame): what it still holds then is past the end of the run and goes to nobody. The manager ends when every slice of the run is assigned and processed
//! (or at `cancel`). Restarted mid-run, it rebuilds its state from the hellos of the
//! builders reconnecting to it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration as StdDuration;

use bytes::Bytes;
use shoal_core::frame::Flags;
use shoal_core::node::{DataFlowManager, DfmConfig, DfmEvent, DfmStats};
use shoal_core::pullmsg::PullMessage;
use shoal_core::shaping::PullConfig;
use shoal_core::slice::{SliceClock, SliceNumber};
use shoal_core::{BuilderId, Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::clock::WallClock;
use crate::config::{Config, ConfigError};
use crate::live::Live;
use crate::transport::framed::{FrameReader, ReadEnd};
use crate::transport::write_queue::write_queued;

/// What the manager reports at the end.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct DfmReport {
    #[serde(flatten)]
    pub stats: DfmStats,
    /// Builder connections accepted, and closed for bad input.
    pub connections: u64,
    pub rejected_connections: u64,
    /// Every slice was assigned and processed (false: cancelled first).
    pub done: bool,
}

enum FromBuilder {
    Message {
        conn: u64,
        msg: PullMessage,
    },
    /// The builder's end of stream: every source ended its stream to it.
    Ended {
        conn: u64,
    },
    Closed {
        conn: u64,
        rejected: bool,
    },
}

/// One builder's connection: the handshake (`[security] data`) in a task of its own, not
/// in the manager's loop; then its writer and its reader.
fn serve_builder(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    conn: u64,
    port: crate::transport::secure::DataPort,
    wrx: mpsc::UnboundedReceiver<Bytes>,
    tx: mpsc::UnboundedSender<FromBuilder>,
    readers: CancellationToken,
) {
    tokio::spawn(async move {
        let Some((stream, speaker)) = crate::transport::secure::accept(&port, stream, peer, "dfm").await else {
            // Refused (counted and logged there): its writer's place goes too, or every
            // stranger's connection would leave one behind in the manager's loop.
            let _ = tx.send(FromBuilder::Closed { conn, rejected: true });
            return;
        };
        let (read, write) = stream.into_split();
        tokio::spawn(write_queued(write, wrx));
        read_builder(read, peer, speaker, conn, tx, readers).await;
    });
}

async fn read_builder(
    stream: shoal_tls::data::DataRead,
    peer: SocketAddr,
    speaker: crate::transport::secure::Speaker,
    conn: u64,
    tx: mpsc::UnboundedSender<FromBuilder>,
    cancel: CancellationToken,
) {
    let mut reader = FrameReader::new(stream, peer, shoal_core::frame::DEFAULT_MAX_PAYLOAD, cancel);
    let rejected = loop {
        let frame = match reader.next().await {
            Ok(f) => f,
            Err(end) => break matches!(end, ReadEnd::Rejected(_)),
        };
        // Every message names its builder in the header (hellos, credits, the end of stream):
        // it must be the one the certificate holds.
        if !speaker.may_send_as(frame.header.source) {
            reader.reject("identity", &speaker.refuse("builder", frame.header.source));
            break true;
        }
        match PullMessage::from_frame(&frame) {
            Ok(Some(msg @ (PullMessage::BuilderHello { .. } | PullMessage::Credit { .. }))) => {
                if tx.send(FromBuilder::Message { conn, msg }).is_err() {
                    return;
                }
            }
            Ok(None) if frame.header.flags == Flags::END_OF_STREAM && frame.payload.is_empty() => {
                if tx.send(FromBuilder::Ended { conn }).is_err() {
                    return;
                }
            }
            Ok(_) => {
                reader.reject("unexpected_frame", "only builder hellos, credits and an end of stream are expected");
                break true;
            }
            Err(e) => {
                reader.reject(e.kind(), &e.to_string());
                break true;
            }
        }
    };
    let _ = tx.send(FromBuilder::Closed { conn, rejected });
}

/// The data-flow manager's settings, derived once from the [`Config`] where the role
/// starts.
#[derive(Clone, Debug)]
pub struct DfmSettings {
    pub pull: PullConfig,
    pub slice_clock: SliceClock,
    /// The run's first slice (none: the first on a second after the start).
    pub start_slice: Option<SliceNumber>,
    /// The run's length in slices (none: until run control's end slice).
    pub slices: Option<u64>,
    pub builders: u32,
    /// A builder is skipped at three quarters of its memory budget, before its assembler
    /// has to drop.
    pub memory_limit: u64,
    /// `run.policy` as written, for the log.
    pub policy: String,
    /// The handshake on the manager's port (`[security] data`).
    pub port: crate::transport::secure::DataPort,
}

impl DfmSettings {
    pub fn from_config(cfg: &Config) -> Result<Self, ConfigError> {
        let pull =
            cfg.policy()?.pull().ok_or_else(|| ConfigError::Invalid("run.policy is not a pull policy".into()))?;
        Ok(Self {
            pull,
            slice_clock: cfg.slice_clock()?,
            start_slice: cfg.run.start_slice,
            slices: cfg.slices()?,
            builders: cfg.run.builders,
            memory_limit: (cfg.builder.memory_budget_mb << 20) / 4 * 3,
            policy: cfg.run.policy.clone(),
            port: cfg.data_port("dfm")?,
        })
    }
}

/// How long a builder holding slices may say nothing before its slices go to the others:
/// half the time the sources hold a fragment nobody asked for, so that what the silent
/// builder held can still be asked for elsewhere; at least four of its heartbeats
/// (`builder::driver`, every 100 ms: a busy host delays one, not four), at most 2 s.
pub fn silence_timeout(s: &DfmSettings) -> Duration {
    let hold = s.slice_clock.length().as_nanos() as u64 * u64::from(s.pull.hold_slices);
    Duration::from_nanos((hold / 2).clamp(400_000_000, 2_000_000_000))
}

/// Runs the manager on a bound listener until every slice of the run is assigned and
/// processed (the end slice from the configuration's run length, or from run control's
/// `live.end_slice`), or `cancel`.
pub async fn run_dfm(
    cfg: Config,
    listener: TcpListener,
    clock: WallClock,
    live: Arc<Live>,
    cancel: CancellationToken,
) -> Result<DfmReport, ConfigError> {
    let s = DfmSettings::from_config(&cfg)?;
    let now = clock.now();
    let first = s.start_slice.unwrap_or_else(|| s.slice_clock.first_on_a_second_after(now));
    let mut dcfg = DfmConfig::new(s.pull, s.slice_clock, first, s.builders);
    dcfg.end_slice = s.slices.map(|n| first + n);
    dcfg.memory_limit = s.memory_limit;
    dcfg.silence_timeout = silence_timeout(&s);
    let mut dfm = DataFlowManager::new(dcfg, now);
    info!(first_slice = first, end_slice = ?dcfg.end_slice, builders = s.builders, policy = %s.policy,
        "data-flow manager started");

    let (tx, mut rx) = mpsc::unbounded_channel();
    let readers = CancellationToken::new();
    // The tasks spawned for this process (accept loop, connection readers, the manager's
    // client) end with it, also when it is aborted: a killed process leaves no listener or
    // connection open behind it.
    let _end_tasks = readers.clone().drop_guard();
    let mut writers: HashMap<u64, mpsc::UnboundedSender<Bytes>> = HashMap::new();
    let mut builder_of: HashMap<u64, BuilderId> = HashMap::new();
    let mut conn_of: HashMap<BuilderId, u64> = HashMap::new();
    let mut report = DfmReport::default();
    let mut next_conn = 0u64;

    loop {
        let now = clock.now();
        let end = live.end_slice.load(Ordering::Relaxed);
        if end != 0 {
            dfm.handle_end_slice(now, end);
        }
        dfm.handle_timeout(now);
        while let Some(a) = dfm.poll_assignment() {
            let sent = conn_of
                .get(&a.builder)
                .and_then(|c| writers.get(c))
                .is_some_and(|w| w.send(PullMessage::Assign { builder: a.builder, slice: a.slice }.encode()).is_ok());
            if !sent {
                // Its connection is gone: the manager hears of it from the reader next.
                warn!(builder = a.builder, slice = a.slice, "assignment to a builder without a connection");
            }
        }
        while let Some(e) = dfm.poll_event() {
            match e {
                DfmEvent::Started { builders, claimed, unclaimed } => {
                    info!(builders, claimed, unclaimed, "assigning (slices claimed by builders, slices to assign)")
                }
                // At the end of a run builders close their connection once their sources
                // have ended, possibly before run control has told the manager the end
                // slice: with nothing to hand on, no cause for alarm.
                DfmEvent::BuilderLeft { builder, reassigned: 0, silent: false } => {
                    info!(builder, "builder disconnected with no slice outstanding")
                }
                DfmEvent::BuilderLeft { builder, reassigned, silent } => {
                    warn!(builder, reassigned, silent, "builder left; its slices go to the others")
                }
                DfmEvent::BuilderRejoined { builder } => {
                    warn!(builder, "builder speaks again after falling silent; it takes assignments again")
                }
                DfmEvent::BuilderEnded { builder, dropped } => {
                    info!(builder, dropped, "builder ended (its sources did); assignments it had not taken are dropped")
                }
            }
        }
        if dfm.is_done() {
            report.done = true;
            break;
        }
        // At least every 50 ms: a longer gap between two looks is the manager's own stall
        // (`DataFlowManager::handle_timeout`).
        let wake = dfm.poll_timeout().unwrap_or(Instant::MAX).min(now + Duration::from_millis(50));
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    let conn = next_conn;
                    next_conn += 1;
                    report.connections += 1;
                    let (wtx, wrx) = mpsc::unbounded_channel();
                    writers.insert(conn, wtx);
                    serve_builder(stream, peer, conn, s.port.clone(), wrx, tx.clone(), readers.clone());
                }
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(StdDuration::from_millis(50)).await;
                }
            },
            Some(m) = rx.recv() => {
                let now = clock.now();
                match m {
                    FromBuilder::Message { conn, msg: PullMessage::BuilderHello { builder, open, history } } => {
                        builder_of.insert(conn, builder);
                        if let Some(old) = conn_of.insert(builder, conn) {
                            writers.remove(&old);
                        }
                        dfm.handle_hello(now, builder, open, history);
                    }
                    FromBuilder::Message { conn, msg: PullMessage::Credit { builder, slice, memory } } => {
                        if builder_of.get(&conn) == Some(&builder) {
                            dfm.handle_memory(now, builder, memory);
                            if let Some(slice) = slice {
                                dfm.handle_done(now, builder, slice);
                            }
                        }
                    }
                    FromBuilder::Message { .. } => {}
                    FromBuilder::Ended { conn } => {
                        if let Some(&b) = builder_of.get(&conn)
                            && conn_of.get(&b) == Some(&conn)
                        {
                            dfm.handle_builder_ended(now, b);
                        }
                    }
                    FromBuilder::Closed { conn, rejected } => {
                        writers.remove(&conn);
                        report.rejected_connections += u64::from(rejected);
                        if let Some(b) = builder_of.remove(&conn)
                            && conn_of.get(&b) == Some(&conn)
                        {
                            conn_of.remove(&b);
                            dfm.handle_builder_left(now, b);
                        }
                    }
                }
            },
            _ = tokio::time::sleep_until(clock.deadline(wake)) => {}
            _ = cancel.cancelled() => break,
        }
    }
    readers.cancel();
    report.stats = dfm.stats().clone();
    info!(
        assigned = report.stats.assigned,
        reassigned = report.stats.reassigned,
        credit_waits = report.stats.credit_waits,
        done = report.done,
        "data-flow manager finished"
    );
    Ok(report)
}
