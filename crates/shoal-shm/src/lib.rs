//! shoal-shm: complete slices in shared memory for consumers in other processes.
//!
//! A builder's [`SlicePublisher`] copies each filtered slice once into a ring in a memfd
//! and tells every attached consumer where it is over a `SOCK_SEQPACKET` socket in the
//! abstract namespace; a [`SliceConsumer`] maps the memfd read-only, reads the slice in
//! place ([`SliceRef`]) and releases it. The decisions (where a slot goes, who is offered
//! it, when held space is taken back) are shoal-core's [`shoal_core::slicering`]; the
//! formats are byte for byte in docs/plugins.md.
//!
//! [`workers::WorkerPool`] runs filters out of the builder's process on the same formats:
//! Python filters (`builder.filter.python`) and isolated C plug-ins (`shoal filter-worker`,
//! whose side of the protocol is [`workers::serve`]).
//!
//! Nothing here has a name in a file system: the memfd lives as long as a process maps it
//! and the abstract socket as long as the builder, so a builder or consumer killed with
//! SIGKILL leaves nothing behind and the next start needs no cleanup.

// Mapping shared memory and reading a sequence number other processes write is unsafe by
// nature; each block says why it holds.
#![allow(unsafe_code)]

mod consumer;
mod publisher;
mod sock;
pub mod workers;

pub use consumer::{ConsumerOptions, FragmentRef, Next, SliceConsumer, SliceRef};
pub use publisher::{PublisherConfig, PublisherReport, SlicePublisher};
pub use shoal_core::slicering::{ConsumerCounters, Policy};
pub use sock::socket_name;

/// The Python consumer (`python/shoal_slices.py`: standard library and numpy only), embedded
/// in the `shoal` Python module as `shoal.slices` and run by the builder's Python workers.
pub const PYTHON_CLIENT: &str = include_str!("../python/shoal_slices.py");
