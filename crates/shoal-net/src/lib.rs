//! shoal-net: the tokio runtime that deploys shoal-core on real sockets.
//!
//! Every decision of a source or builder process is shoal-core's node machines
//! ([`shoal_core::node::SourceNode`], [`shoal_core::node::BuilderNode`]); this crate moves
//! their bytes and gives them time. It is laid out by role, each role a folder with its
//! settings derived once from the [`config::Config`] where the role starts and a driver
//! that owns the role's tasks:
//! - [`source`]: the workload and a `SourceNode` on one TCP [`transport::link::Link`] per
//!   builder with reconnect and backoff; the source SDK ([`sdk::SourceHandle`]) and the
//!   input sockets ([`source::ingest`]) feed it real data;
//! - [`builder`]: stream decoding into a `BuilderNode`, the filter thread, the burst
//!   saver's spool, events to the writer; the pull client of the data-flow manager;
//! - [`writer`]: events into Parquet plus a JSON summary;
//! - [`dfm`] (pull policies): the data-flow manager that assigns slices to builders.
//!
//! Below the roles: [`transport`] (links, listeners, framed reads, UDP, io_uring, the
//! microsecond timer), and what every role reports with ([`report`], [`live`], [`tap`],
//! [`paths`], [`clock`], [`memory`], [`schedstat`]). Above them, composing roles only:
//! [`demo::run_embedded`] (every role in one process, `shoal demo`) and
//! [`node::run_controlled`] (one role under run control, `shoal node --dispatcher ...`:
//! `RC_CMD` commands through its [`rcagent::RcAgent`], statistics, the end-of-run report,
//! Prometheus `/metrics`).
//!
//! [`probe`] is `shoal probe-switch` on real sockets: paced UDP floods, kernel receive
//! timestamps.
//!
//! Every process divides one memory budget among its queues at start, or refuses to start
//! with what would fit ([`budget::plan`]); the `shoal` binary turns transparent huge pages
//! off for itself ([`memory::disable_huge_pages`]: the kernel cleared a 2-MiB page for
//! every fresh allocator page).
//!
//! [`config::Config`] is the one TOML schema for every role; [`clock::WallClock`] maps the
//! system clock onto shoal-core's [`shoal_core::Instant`] (UNIX nanoseconds).

pub mod archive;
pub mod budget;
pub mod builder;
pub mod clock;
pub mod config;
pub mod demo;
pub mod dfm;
pub mod live;
pub mod memory;
pub use shoal_dispatcher::lograte;
pub mod node;
pub mod paths;
pub mod probe;
pub mod rcagent;
/// The source SDK's Rust face, at the path readouts import it by.
pub use source::sdk;
pub mod report;
pub mod schedstat;
pub mod source;
pub mod stallwatch;
pub mod tap;
pub mod transport;
pub mod writer;
