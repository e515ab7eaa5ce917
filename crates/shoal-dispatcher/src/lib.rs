//! shoal-dispatcher: a ControlHost-compatible message dispatcher (the KM3NeT "Ligier"
//! dialect) and its client, on tokio.
//!
//! The protocol decisions (prefix codec, subscription grammar, routing, queues and
//! back-pressure) are shoal-core's [`shoal_core::controlhost`]; this crate moves bytes:
//! - [`server`]: the dispatcher (`shoal dispatcher`), one reader and one writer task per
//!   connection around one [`shoal_core::controlhost::Router`], with `/status` and
//!   Prometheus `/metrics` over HTTP;
//! - [`client`]: [`client::ChClient`], the async client that run control, the nodes' agents
//!   and the tests use;
//! - [`authority`]: who may publish and subscribe what on a secured dispatcher;
//! - [`audit`]: the audit log (commands, alerts and refusals, with who and from where)
//!   that run control and the dispatcher write;
//! - [`httpd`]: the HTTP server every shoal process uses (limits per peer and in all,
//!   header and request timeouts), so a hostile HTTP client cannot hold a process.
//!
//! Real third-party clients (Python `controlhost`, `km3pipe`) talk to it unchanged; see
//! `docs/dispatcher.md`.

pub mod audit;
pub mod authority;
pub mod client;
pub mod httpd;
pub mod lograte;
pub mod server;
