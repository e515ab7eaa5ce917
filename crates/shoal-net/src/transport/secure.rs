//! The bulk path's security in the runtime: which certificate each role presents, the
//! handshakes of a role's links and ports, and the refusals they count.
//!
//! `[security] data` chooses `off`, `authenticated` or `tls` ([`shoal_tls::data`]). The
//! credentials are not part of the configuration's text: a node loads its own from the
//! directory run control gives it (`shoal node --credentials DIR`), the embedded demo makes
//! a throw-away CA and one certificate per role ([`DataCredentials::ephemeral`]). Every
//! role's ports take only the roles that belong there ([`accepts`]), and every link checks
//! that the peer is the role it dials.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use shoal_tls::data::{Acceptor, Connector, DataSecurity, DataStream, RefusalCounts};
use shoal_tls::identity::Identity;
use tokio::net::TcpStream;

/// Refused handshakes on this process's data ports, for `/metrics` and the statistics.
pub static REFUSED: RefusalCounts = RefusalCounts {
    timeout: std::sync::atomic::AtomicU64::new(0),
    certificate: std::sync::atomic::AtomicU64::new(0),
    not_tls: std::sync::atomic::AtomicU64::new(0),
    accepted: std::sync::atomic::AtomicU64::new(0),
};

/// Refusals logged at most once a second, with the count held back.
static REFUSAL_LOG: crate::lograte::LogRate = crate::lograte::LogRate::new(std::time::Duration::from_secs(1));

/// The roles whose certificates a port of `role` takes: a builder's data port sources
/// (and the data-flow manager's builders dial the manager), the writer's builders.
pub fn accepts(role: &str) -> &'static [&'static str] {
    match role {
        "builder" => &["source"],
        "writer" => &["builder"],
        "dfm" => &["builder"],
        _ => &[],
    }
}

/// The identities of the roles this process plays, by role name.
#[derive(Clone, Debug, Default)]
pub struct DataCredentials {
    by_role: Arc<BTreeMap<String, Identity>>,
}

/// Credentials are not configuration: two configurations compare equal whatever
/// certificates are attached to them.
impl PartialEq for DataCredentials {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl DataCredentials {
    /// One process's identity (a node); its role is what its certificate says.
    pub fn single(identity: Identity) -> anyhow::Result<Self> {
        let role = identity.name().ok_or_else(|| anyhow::anyhow!("this process's certificate names no process"))?.role;
        Ok(Self { by_role: Arc::new(BTreeMap::from([(role, identity)])) })
    }

    /// Several identities, each for the role its certificate names (one process playing
    /// several roles: the demo, tests).
    pub fn of_roles(identities: impl IntoIterator<Item = Identity>) -> anyhow::Result<Self> {
        let mut by_role = BTreeMap::new();
        for id in identities {
            let role = id.name().ok_or_else(|| anyhow::anyhow!("a certificate names no process"))?.role;
            by_role.insert(role, id);
        }
        Ok(Self { by_role: Arc::new(by_role) })
    }

    /// A throw-away CA and a certificate per data role for 127.0.0.1, ::1 and localhost
    /// (the embedded demo: every role in one process).
    pub fn ephemeral() -> anyhow::Result<Self> {
        let ca = shoal_tls::ca::ClusterCa::generate("demo", 1)?;
        let hosts = ["127.0.0.1".to_string(), "::1".into(), "localhost".into()];
        let mut by_role = BTreeMap::new();
        for role in ["source", "builder", "writer", "dfm"] {
            let issued = ca.issue(&shoal_tls::ca::IssueRequest::new(role, role, &hosts, 1)?)?;
            let id =
                Identity::from_pem(ca.cert_pem().as_bytes(), issued.cert_pem.as_bytes(), issued.key_pem.as_bytes())?;
            by_role.insert(role.to_string(), id);
        }
        Ok(Self { by_role: Arc::new(by_role) })
    }

    pub fn is_empty(&self) -> bool {
        self.by_role.is_empty()
    }

    fn identity(&self, role: &str) -> anyhow::Result<&Identity> {
        self.by_role.get(role).ok_or_else(|| {
            anyhow::anyhow!(
                "security.data needs a certificate for this {role}: run control hands one out with \
                 [cluster.security] ca_dir, or give `shoal node --credentials DIR` (docs/security.md)"
            )
        })
    }

    /// The acceptor of a port of `role` in `mode`.
    pub fn acceptor(&self, mode: DataSecurity, role: &str) -> anyhow::Result<Acceptor> {
        match mode {
            DataSecurity::Off => Ok(Acceptor::off()),
            _ => Acceptor::new(mode, self.identity(role)?, accepts(role)),
        }
    }

    /// The connector of `role`'s links to peers of `peer_role`.
    pub fn connector(&self, mode: DataSecurity, role: &str, peer_role: &str) -> anyhow::Result<Connector> {
        match mode {
            DataSecurity::Off => Ok(Connector::off()),
            _ => Connector::new(mode, self.identity(role)?, &[peer_role]),
        }
    }
}

/// The handshake of one accepted connection on `port`: the stream, or `None` once the
/// refusal is counted ([`REFUSED`]) and logged with the peer's address.
pub async fn accept(acceptor: &Acceptor, tcp: TcpStream, peer: SocketAddr, port: &'static str) -> Option<DataStream> {
    match acceptor.accept(tcp).await {
        Ok((stream, _)) => {
            REFUSED.accepted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Some(stream)
        }
        Err(r) => {
            REFUSED.count(&r);
            if let Some(held_back) = REFUSAL_LOG.check() {
                tracing::warn!(%peer, port, reason = r.kind(), error = %r, held_back, "handshake refused: connection closed");
            }
            None
        }
    }
}

/// The handshake of a link just connected to `addr`; a refusal becomes the link's
/// connect error (it retries with backoff), logged at a bounded rate.
pub async fn connect(connector: &Connector, tcp: TcpStream, addr: SocketAddr) -> std::io::Result<DataStream> {
    connector.connect(tcp, addr).await.map_err(|r| {
        if let Some(held_back) = REFUSAL_LOG.check() {
            tracing::warn!(%addr, reason = r.kind(), error = %r, held_back, "handshake with the peer failed");
        }
        std::io::Error::new(std::io::ErrorKind::PermissionDenied, r.to_string())
    })
}
