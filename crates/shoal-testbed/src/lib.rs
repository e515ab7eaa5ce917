//! shoal-testbed: the real runtime on an emulated network (`shoal testbed`).
//!
//! A scenario file of the simulator becomes a set of Linux network namespaces: one per
//! source, builder, writer and control host, bridges in namespaces of their own as the
//! sector and central switches, veth links shaped in both directions to the scenario's
//! rates with drop-tail buffers of its size (see ../shared/testbed.md for what this kernel
//! can emulate). The production processes run there under `shoal run`, each on its own
//! address, and the run is summarised with the simulator's metrics so the two can be set
//! side by side (`shoal validate`).
//!
//! - [`plan`]: the layout as data ([`plan::Plan`]), tested without root;
//! - [`netns`]: building and tearing it down, the kernel's counters;
//! - [`run`]: one run ([`run::run`]) and its [`run::TestbedSummary`], and the
//!   [`run::Verdict`] applied to both simulator and testbed;
//! - [`ssh`]: the `ssh` launch mode, an sshd per host namespace with keys made for the run;
//! - [`delay`]: propagation delay without netem, a [`delay::DelayLine`] on a netfilter
//!   queue in each sector switch, through the small [`nfqueue`] client.

pub mod delay;
pub mod netns;
pub mod nfqueue;
pub mod plan;
pub mod run;
pub mod ssh;
