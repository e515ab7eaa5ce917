//! shoal-core: the sans-IO heart of shoal.
//!
//! Every decision the event builder makes lives here, written once as plain state machines
//! that own no socket, task, thread, clock or random source. Time comes in as an
//! [`Instant`] argument, seeds come from the caller, and outputs are drained with `poll_*`.
//! The tokio runtime (`shoal-net`), the packet-level simulator and the testbed all drive
//! this same code.
//!
//! Main types:
//! - [`frame`]: the data-frame wire format v1 ([`frame::FrameHeader`], checked
//!   [`frame::decode`], [`frame::StreamDecoder`] for TCP byte streams).
//! - [`event`]: selected events and the `EVENTS` payload codec (builder to writer).
//! - [`hit`]: the 6-byte hit record and the waveform record carried in frame payloads.
//! - [`slice`](mod@slice): slice numbers, the slice clock and the slice-to-builder rule.
//! - [`shaping`]: traffic-shaping policies behind the [`shaping::Shaper`] trait
//!   (`Direct`, `Delayed { k, window }` barrel shifter, `TokenBucket`, credit-based `Pull`), plus
//!   [`shaping::BurstCutoff`].
//! - [`assembly`]: the builder's [`assembly::SliceAssembler`].
//! - [`budget`]: one memory budget per process, divided among its queues
//!   ([`budget::MemoryDemand::plan`]) or a refusal that says why.
//! - [`saver`]: the builder's burst saver ([`saver::BurstSaver`]): the last seconds of raw
//!   slices, saved on an external [`alert::Alert`], and the late-data side stream.
//! - [`rawrec`]: raw-data records (saved fragments, alert descriptions) as `RAW` frames.
//! - [`ledger`]: fragment accounting; every fragment ends in exactly one bucket.
//! - [`loghist`]: a small log-linear histogram of durations ([`loghist::LogHistogram`]),
//!   the shape of a measured lag carried to the simulator's model of it.
//! - [`ingest`]: fragments submitted by user code (the source SDK, input sockets): slice
//!   assignment from the data's own time, refusals, back-pressure, late data, end of run,
//!   and the input sockets' framing ([`ingest::wire`]).
//! - [`km3net`]: KM3NeT's CLB optical packets and the DataQueue reassembling them per
//!   DOM and timeslice (the KM3NeT drop-in's input side, in progress).
//! - [`node`]: the source and builder node machines that own every decision of a source
//!   or builder process ([`node::SourceNode`], [`node::BuilderNode`]), the pull data-flow
//!   manager ([`node::DataFlowManager`]), and the [`node::Workload`] interface.
//! - [`slicering`]: complete slices published into shared memory for consumers in other
//!   processes: the ring's bookkeeping ([`slicering::RingLedger`]), slot format, messages.
//! - [`probe`]: the switch buffer probe's datagrams and the analysis of a flood
//!   ([`probe::analyse_flood`], [`probe::classify`]).
//! - [`pullmsg`]: the pull control messages (hello, request, assignment, credit) as
//!   frames, with their checked decoder.
//! - [`runstate`]: the run-control state machine (IDLE, STANDBY, READY, RUNNING, PAUSED).
//! - [`clocksync`]: the hosts' clock offsets, measured NTP-style by run control
//!   ([`clocksync::ClockProber`]), and the tolerance rule ([`clocksync::judge`]).
//! - [`diagnosis`]: the diagnosis rules over run control's snapshot, the timeline of the
//!   problems they find ([`diagnosis::Diagnoser`]), and one primary cause for every slice a
//!   run lost ([`diagnosis::attribute`]).
//! - [`cluster`]: run control of a whole cluster ([`cluster::ClusterControl`]): command
//!   order, start and end slices, reply deadlines, inactive processes, discovery.
//! - [`controlhost`]: the ControlHost dispatcher protocol and routing.
//! - [`checksum`]: CRC32C, the end-to-end check of frames, datagrams and raw records.
//! - [`datagram`]: the UDP transport's datagrams and its selective retransmission
//!   ([`datagram::DatagramSender`], [`datagram::DatagramReceiver`],
//!   [`datagram::BuilderEndpoint`]).

pub mod alert;
pub mod assembly;
pub mod budget;
pub mod buffer;
pub mod checksum;
pub mod clocksync;
pub mod cluster;
pub mod controlhost;
pub mod custody;
pub mod datagram;
pub mod diagnosis;
pub mod event;
pub mod frame;
pub mod hit;
pub mod ingest;
pub mod km3net;
pub mod ledger;
pub mod loghist;
pub mod node;
pub mod probe;
pub mod pullmsg;
pub mod rawrec;
pub mod runstate;
pub mod saver;
pub mod shaping;
pub mod slice;
pub mod slicering;
mod time;

pub use time::{Duration, Instant};

/// Identifies one source (front-end board). Sources are numbered `0..n_sources`.
pub type SourceId = u32;
/// Identifies one builder. Builders are numbered `0..n_builders`.
pub type BuilderId = u32;
