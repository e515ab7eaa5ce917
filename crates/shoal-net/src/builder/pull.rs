//! Pull: the builder's client of the data-flow manager, and where its requests and
//! returned credits go.

use std::net::SocketAddr;
use std::time::Duration as StdDuration;

use bytes::Bytes;
use shoal_core::SourceId;
use shoal_core::node::BuilderNode;
use shoal_core::pullmsg::PullMessage;
use shoal_core::slice::SliceNumber;
use shoal_trigger::FragmentData;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::builder::accept::Incoming;
use crate::transport::framed::{FrameReader, ReadEnd};
use crate::transport::write_queue::write_queued;

/// Pull: the connection to the data-flow manager, reconnecting until `cancel`.
pub(super) async fn dfm_client(
    addr: SocketAddr,
    builder: u32,
    connector: shoal_tls::Connector,
    tx: mpsc::Sender<Incoming>,
    cancel: CancellationToken,
) {
    let mut delay = StdDuration::from_millis(20);
    loop {
        let connect = async {
            let s = TcpStream::connect(addr).await?;
            let _ = s.set_nodelay(true);
            crate::transport::secure::connect(&connector, s, addr).await
        };
        let stream = tokio::select! {
            r = connect => r,
            _ = cancel.cancelled() => return,
        };
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(builder, %addr, error = %e, "data-flow manager unreachable; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = cancel.cancelled() => return,
                }
                delay = (delay * 2).min(StdDuration::from_secs(1));
                continue;
            }
        };
        delay = StdDuration::from_millis(20);
        let (read, write) = stream.into_split();
        let (out, out_rx) = mpsc::unbounded_channel();
        tokio::spawn(write_queued(write, out_rx));
        if tx.send(Incoming::DfmUp { out }).await.is_err() {
            return;
        }
        let mut reader = FrameReader::new(read, addr, shoal_core::frame::DEFAULT_MAX_PAYLOAD, cancel.clone());
        loop {
            let frame = match reader.next().await {
                Ok(f) => f,
                Err(ReadEnd::Cancelled) => return,
                Err(_) => break,
            };
            match PullMessage::from_frame(&frame) {
                Ok(Some(PullMessage::Assign { builder: b, slice })) if b == builder => {
                    if tx.send(Incoming::Assign { slice }).await.is_err() {
                        return;
                    }
                }
                Ok(_) => {
                    reader.reject("unexpected_frame", "only assignments for this builder are expected");
                    break;
                }
                Err(e) => {
                    reader.reject(e.kind(), &e.to_string());
                    break;
                }
            }
        }
        warn!(builder, %addr, "lost the data-flow manager; reconnecting");
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = cancel.cancelled() => return,
        }
    }
}

/// Pull: where a source's requests go.
pub(super) enum RequestRoute {
    /// Encoded request frames, written on the source's TCP connection.
    Tcp(mpsc::UnboundedSender<Bytes>),
    /// (source, slice) to the datagram endpoint, sent as a `REQUEST` datagram.
    Udp(mpsc::UnboundedSender<(SourceId, SliceNumber)>),
}

/// Pull: where requests and credits go.
#[derive(Default)]
pub(super) struct Routes {
    pub(super) sources: std::collections::HashMap<SourceId, RequestRoute>,
    pub(super) dfm: Option<mpsc::UnboundedSender<Bytes>>,
    /// The manager's connection before this builder has greeted it, and until when the
    /// greeting waits for the sources (see [`Routes::greet_dfm`]).
    pub(super) dfm_waiting: Option<(mpsc::UnboundedSender<Bytes>, std::time::Instant)>,
    pub(super) unroutable: u64,
}

/// How long a builder's hello to the manager waits for every source to have greeted it.
pub(super) const HELLO_WAITS_FOR_SOURCES: StdDuration = StdDuration::from_secs(2);

impl Routes {
    /// Greets the manager (the slices this builder holds) once every source has greeted
    /// this builder, or [`HELLO_WAITS_FOR_SOURCES`] after the manager's connection came up.
    /// A builder restarted mid-run would otherwise take assignments before the sources
    /// have connected to it again, find its requests unroutable, give their fragments up
    /// after the re-asks and process every one of those slices empty.
    pub(super) fn greet_dfm(&mut self, node: &BuilderNode<FragmentData>) {
        let Some((_, until)) = &self.dfm_waiting else { return };
        let all_greeted = self.sources.len() as u32 >= node.config().assembler.n_sources;
        if !all_greeted && std::time::Instant::now() < *until {
            return;
        }
        let (out, _) = self.dfm_waiting.take().expect("checked");
        let (open, history) = match node.pull() {
            Some(p) => (p.assigned().collect(), p.history().collect()),
            None => (Vec::new(), Vec::new()),
        };
        let hello = PullMessage::BuilderHello { builder: node.config().id, open, history };
        let _ = out.send(hello.encode());
        self.dfm = Some(out);
    }

    /// The node's requests to the sources, its returned credits to the manager.
    pub(super) fn send_pull(&mut self, node: &mut BuilderNode<FragmentData>, id: u32) {
        while let Some(r) = node.poll_request() {
            let sent = match self.sources.get(&r.source) {
                Some(RequestRoute::Tcp(tx)) => {
                    tx.send(PullMessage::Request { source: r.source, slice: r.slice }.encode()).is_ok()
                }
                Some(RequestRoute::Udp(tx)) => tx.send((r.source, r.slice)).is_ok(),
                None => false,
            };
            if !sent {
                // Not greeted yet (or gone): the re-ask timer tries again.
                self.unroutable += 1;
            }
        }
        while let Some(slice) = node.poll_done() {
            if let Some(out) = &self.dfm {
                let _ = out.send(
                    PullMessage::Credit { builder: id, slice: Some(slice), memory: node.memory_in_use() }.encode(),
                );
            }
        }
    }
}
