//! shoal-net: the tokio runtime that deploys shoal-core on real sockets.
//!
//! Every decision of a source or builder process is shoal-core's node machines
//! ([`shoal_core::node::SourceNode`], [`shoal_core::node::BuilderNode`]); this crate moves
//! their bytes and gives them time. Roles, each runnable alone (`shoal node --role ...`) or
//! all in one process (`shoal demo`, [`demo::run_embedded`]) with the same code:
//! - [`source::run_source_node`]: the workload and a `SourceNode` on one TCP
//!   [`link::Link`] per builder with reconnect and backoff;
//! - [`builder::run_builder`]: stream decoding into a `BuilderNode`, the filter thread,
//!   events to the writer; free-running sources that run past its window are held back
//!   by their connections (`hold`);
//! - [`writer::run_writer`]: events into Parquet plus a JSON summary;
//! - [`dfm::run_dfm`] (pull policies): the data-flow manager that assigns slices to
//!   builders.
//!
//! Under run control ([`node::run_controlled`], `shoal node --dispatcher ...`) a process
//! follows `RC_CMD` commands from the dispatcher through its [`rcagent::RcAgent`], starts and
//! stops the same role functions, publishes statistics and its end-of-run report, and
//! serves Prometheus `/metrics`.
//!
//! [`probe`] is `shoal probe-switch` on real sockets: paced UDP floods, kernel receive
//! timestamps.
//!
//! Two pieces of the data path step outside tokio's defaults: sources wait for slice ends
//! and tokens on a microsecond [`timer::FineTimer`] (tokio's timer counts milliseconds),
//! and a builder can read its connections through io_uring ([`uring`],
//! `builder.receive = "io_uring"`).
//!
//! Real data in: [`sdk::SourceHandle`] is the source SDK's Rust face (open from the
//! configuration, `submit`, `flush`, `close`); [`ingest`] holds the ingest its submitters
//! share with the source loop and the input sockets (`source.input = "unix:PATH"` or
//! `"udp:ADDR"`). The C ABI (`shoal-ffi`) and the Python module (`shoal-py`) wrap the SDK.
//!
//! Every process divides one memory budget among its queues at start, or refuses to start
//! with what would fit ([`budget::plan`]); the `shoal` binary turns transparent huge pages
//! off for itself ([`memory::disable_huge_pages`]: the kernel cleared a 2-MiB page for
//! every fresh allocator page).
//!
//! [`config::Config`] is the one TOML schema for every role; [`clock::WallClock`] maps the
//! system clock onto shoal-core's [`shoal_core::Instant`] (UNIX nanoseconds).

pub mod budget;
pub mod builder;
pub mod clock;
pub mod config;
pub mod demo;
pub mod dfm;
pub mod filter_queue;
pub mod framed;
mod hold;
pub mod ingest;
pub mod km3out;
pub mod link;
pub mod listen;
pub mod live;
pub mod memory;
pub use shoal_dispatcher::lograte;
pub mod node;
pub mod paths;
pub mod prefetch;
pub mod probe;
pub mod rcagent;
pub mod schedstat;
pub mod sdk;
pub mod source;
pub mod spool;
pub mod tap;
pub mod timer;
pub mod udp;
pub mod uring;
pub mod writer;
