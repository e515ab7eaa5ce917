//! shoal's cluster identity: who may talk to a shoal process, proven by certificates.
//!
//! - [`ca`]: the cluster's CA ([`ca::ClusterCa`]: `shoal ca init`, `shoal ca issue`), a
//!   certificate per process naming it and its role;
//! - [`identity`]: a process's [`identity::Credentials`] loaded into rustls configurations
//!   ([`identity::Identity`]) that check both ends (TLS 1.3, *ring*);
//! - [`peer`]: the verifiers that take only the roles a port expects ([`peer::PeerName`]);
//! - [`data`]: the bulk path's setting ([`data::DataSecurity`]: `off`, `authenticated`,
//!   `tls`) with its [`data::Connector`] and [`data::Acceptor`] and the stream they yield
//!   ([`data::DataStream`]);
//! - [`web`]: Prometheus' `web.yml` for HTTP servers ([`web::WebConfig`]: TLS, client
//!   certificates, bcrypt basic-auth users).
//!
//! docs/security.md says what each protects and what it does not.

pub mod ca;
pub mod data;
pub mod identity;
pub mod peer;
pub mod web;

pub use data::{Acceptor, Connector, DataSecurity, DataStream};
pub use identity::{Credentials, Identity};
