//! A source node's links to the builders, on the run's transport.

use shoal_core::SourceId;
use shoal_core::datagram::SenderStats;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::clock::WallClock;
use crate::config::Transport;
use crate::live::Live;
use crate::source::settings::SourceSettings;
use crate::transport::link::{Chunk, Link, LinkOptions, LinkReport, PullRequestFrame};
use crate::transport::udp::UdpLink;

/// The node's links: one per builder shared by its sources, or one per source and builder.
pub(super) enum Links {
    Shared(Vec<DataLink>),
    PerSource(std::collections::HashMap<SourceId, Vec<DataLink>>),
}

impl Links {
    pub(super) fn to(&self, source: SourceId, builder: usize) -> &DataLink {
        match self {
            Links::Shared(links) => &links[builder],
            // The node transmits only for the sources it hosts, each of which has links.
            Links::PerSource(links) => &links[&source][builder],
        }
    }

    pub(super) fn into_all(self) -> impl Iterator<Item = DataLink> {
        let all: Vec<DataLink> = match self {
            Links::Shared(links) => links,
            Links::PerSource(links) => links.into_values().flatten().collect(),
        };
        all.into_iter()
    }
}

/// A source's link to one builder, on the run's transport.
pub(super) enum DataLink {
    Tcp(Link),
    Udp(UdpLink),
}

impl DataLink {
    pub(super) fn send(&self, chunk: Chunk) {
        match self {
            DataLink::Tcp(l) => l.send(chunk),
            DataLink::Udp(l) => l.send(chunk),
        }
    }

    pub(super) fn close(self) -> LinkTask {
        match self {
            DataLink::Tcp(l) => LinkTask::Tcp(l.close()),
            DataLink::Udp(l) => LinkTask::Udp(l.close()),
        }
    }
}

/// A closing link's task; a datagram link's ends with its streams' totals.
pub(super) enum LinkTask {
    Tcp(tokio::task::JoinHandle<()>),
    Udp(tokio::task::JoinHandle<SenderStats>),
}

impl LinkTask {
    pub(super) fn abort(&self) {
        match self {
            LinkTask::Tcp(t) => t.abort(),
            LinkTask::Udp(t) => t.abort(),
        }
    }
}

/// The ends every link of a node reports to.
pub(super) struct LinkEnds {
    pub(super) reports: mpsc::UnboundedSender<LinkReport>,
    pub(super) closing: CancellationToken,
    /// Pull: each link greets its builder for every hosted source and reads its requests.
    pub(super) requests: Option<mpsc::UnboundedSender<(u32, PullRequestFrame)>>,
    /// `run.transport = "ucx"`: the process's worker, shared by its links.
    pub(super) ucx: Option<std::sync::Arc<shoal_ucx::Worker>>,
}

impl Links {
    /// The node's links on the run's transport: one per builder, or one per hosted source
    /// and builder.
    pub(super) fn spawn(s: &SourceSettings, clock: WallClock, live: &Live, ends: LinkEnds) -> Self {
        // Every data link waits for its builder's close before it ends
        // (`crate::transport::link`'s `PeerEnd`): nothing is left for the kernel to deliver
        // after this process is gone.
        let mut options = LinkOptions {
            paths: Some(live.paths.clone()),
            wait_for_peer_close: true,
            connector: s.connector.clone(),
            ucx: ends.ucx.clone(),
            mac: s.datagram_mac.clone(),
            ..LinkOptions::default()
        };
        if let Some(requests) = ends.requests {
            options.hello = s.node.sources.clone();
            options.requests = Some(requests);
        }
        let spawn = |b: usize, options: LinkOptions| {
            let (b32, addr) = (b as u32, s.builder_addrs[b]);
            match s.transport {
                // ucx: a TCP link whose frames go as the worker's messages.
                Transport::Tcp | Transport::Ucx => DataLink::Tcp(Link::spawn_with(
                    b32,
                    addr,
                    clock,
                    s.backoff,
                    ends.reports.clone(),
                    ends.closing.clone(),
                    options,
                )),
                Transport::Udp => DataLink::Udp(UdpLink::spawn(
                    b32,
                    addr,
                    clock,
                    s.udp,
                    s.run_number as u32,
                    s.udp_socket_buffer,
                    ends.reports.clone(),
                    options,
                )),
            }
        };
        let builders = s.builder_addrs.len();
        if !s.connection_per_source {
            return Links::Shared((0..builders).map(|b| spawn(b, options.clone())).collect());
        }
        let per_source = s
            .node
            .sources
            .iter()
            .map(|&source| {
                // Each connection greets its builder for its own source only.
                let options = LinkOptions { hello: vec![source], ..options.clone() };
                (source, (0..builders).map(|b| spawn(b, options.clone())).collect())
            })
            .collect();
        Links::PerSource(per_source)
    }
}
