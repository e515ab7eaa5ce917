//! The bulk path's security in the runtime: which certificate each role presents, the
//! handshakes of a role's links and ports, and the refusals they count.
//!
//! `[security] data` chooses `off`, `authenticated` or `tls` ([`shoal_tls::data`]). The
//! credentials are not part of the configuration's text: a node loads its own from the
//! directory run control gives it (`shoal node --credentials DIR`), the embedded demo makes
//! a throw-away CA and one certificate per role ([`DataCredentials::ephemeral`]). Every
//! role's ports take only the roles that belong there ([`accepts`]), and every link checks
//! that the peer is the role it dials.
//!
//! A handshake proves *who* dials; what it may then send is bound to that name
//! ([`DataPort`], [`Speaker`]): `[security] peers` (run control fills it from the cluster
//! file) gives each certificate's process the ids it may send as, so that one source's
//! certificate cannot send another source's fragments or end its stream, nor a builder's
//! another builder's events. A connection that tries is closed with reason `identity`
//! ([`DATA_REFUSED`]), logged with the certificate's name.

use std::collections::{BTreeMap, BTreeSet};
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

/// Data refused after a handshake, by reason, for `/metrics` (`shoal_data_refused_total`).
pub static DATA_REFUSED: DataRefusals =
    DataRefusals { identity: std::sync::atomic::AtomicU64::new(0), window: std::sync::atomic::AtomicU64::new(0) };

/// Counts of [`DATA_REFUSED`].
#[derive(Debug)]
pub struct DataRefusals {
    /// Connections closed for sending an id their certificate does not hold, or from a
    /// certificate that names no process of the cluster.
    pub identity: std::sync::atomic::AtomicU64,
    /// Fragments refused for a slice outside the window the run can hold.
    pub window: std::sync::atomic::AtomicU64,
}

impl DataRefusals {
    /// (reason, count) for every reason.
    pub fn snapshot(&self) -> [(&'static str, u64); 2] {
        use std::sync::atomic::Ordering::Relaxed;
        [("identity", self.identity.load(Relaxed)), ("window", self.window.load(Relaxed))]
    }
}

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

    /// What the [`DataCredentials::ephemeral`] certificates speak for in a run of `sources`
    /// and `builders`: the one named `source` every source, `builder` every builder.
    pub fn ephemeral_peers(sources: u32, builders: u32) -> Peers {
        Peers::from([("source".to_string(), (0..sources).collect()), ("builder".to_string(), (0..builders).collect())])
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

    /// The acceptor of a port of `role` in `mode`, binding what each peer sends to `peers`.
    pub fn data_port(&self, mode: DataSecurity, role: &str, peers: &Peers) -> anyhow::Result<DataPort> {
        let acceptor = match mode {
            DataSecurity::Off => Acceptor::off(),
            _ => Acceptor::new(mode, self.identity(role)?, accepts(role))?,
        };
        Ok(DataPort::new(acceptor, peers))
    }

    /// The connector of `role`'s links to peers of `peer_role`.
    pub fn connector(&self, mode: DataSecurity, role: &str, peer_role: &str) -> anyhow::Result<Connector> {
        match mode {
            DataSecurity::Off => Ok(Connector::off()),
            _ => Connector::new(mode, self.identity(role)?, &[peer_role]),
        }
    }
}

/// The ids each process of the cluster may send as (`[security] peers`), by the name its
/// certificate gives it.
pub type Peers = BTreeMap<String, Vec<u32>>;

/// A port's handshake and what each certificate it takes may send as.
#[derive(Clone, Debug, Default)]
pub struct DataPort {
    acceptor: Acceptor,
    peers: Arc<BTreeMap<String, Arc<BTreeSet<u32>>>>,
}

impl DataPort {
    /// Whether this port knows its peers by certificate (a handshake names each).
    pub fn identifies(&self) -> bool {
        self.mode() != DataSecurity::Off
    }

    /// `acceptor` (off: no handshake, nothing bound) with `peers`.
    pub fn new(acceptor: Acceptor, peers: &Peers) -> Self {
        let peers = peers.iter().map(|(name, ids)| (name.clone(), Arc::new(ids.iter().copied().collect()))).collect();
        Self { acceptor, peers: Arc::new(peers) }
    }

    pub fn mode(&self) -> DataSecurity {
        self.acceptor.mode()
    }

    /// Who `name` (a certificate's process) is on this port: `None` when the cluster has no
    /// such process.
    fn speaker(&self, name: &str) -> Option<Speaker> {
        let ids = self.peers.get(name)?;
        Some(Speaker { name: Some(name.into()), ids: Some(ids.clone()) })
    }
}

/// Who is on the other end of an accepted data connection, and the ids it may send as:
/// a source's its source ids, a builder's its builder id. Without `[security] data`
/// nobody is known and anything goes ([`Speaker::anyone`]).
#[derive(Clone, Debug)]
pub struct Speaker {
    name: Option<Arc<str>>,
    ids: Option<Arc<BTreeSet<u32>>>,
}

impl Speaker {
    /// A connection nothing authenticated (`data = "off"`).
    pub fn anyone() -> Self {
        Self { name: None, ids: None }
    }

    /// Whether this connection may send as `id` (a source id, a builder id).
    pub fn may_send_as(&self, id: u32) -> bool {
        self.ids.as_ref().is_none_or(|ids| ids.contains(&id))
    }

    /// The process the certificate names, where the connection was authenticated.
    pub fn identity(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The certificate's name, for logs.
    pub fn name(&self) -> &str {
        self.name.as_deref().unwrap_or("an unauthenticated peer")
    }

    /// `id` sent as `what` (`"source"`, `"builder"`) by a connection that may not: counted
    /// ([`DATA_REFUSED`]), and the detail for the log that closes it.
    pub fn refuse(&self, what: &str, id: u32) -> String {
        DATA_REFUSED.identity.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let held: Vec<String> = self.ids.iter().flat_map(|ids| ids.iter().map(u32::to_string)).collect();
        format!("{} sent as {what} {id}; its certificate speaks for {what} [{}] only", self.name(), held.join(", "))
    }
}

/// The handshake of one accepted connection on `port`: the stream and who it is, or `None`
/// once the refusal is counted ([`REFUSED`], [`DATA_REFUSED`]) and logged with the peer's
/// address. A certificate of the cluster CA whose name is no process of this cluster is
/// refused here (reason `identity`): it holds no id to send as.
pub async fn accept(
    port: &DataPort,
    tcp: TcpStream,
    peer: SocketAddr,
    what: &'static str,
) -> Option<(DataStream, Speaker)> {
    if port.mode() == DataSecurity::Off {
        return Some((DataStream::Plain(tcp), Speaker::anyone()));
    }
    match port.acceptor.accept(tcp).await {
        Ok((stream, name)) => {
            REFUSED.accepted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let name = name.map(|n| n.name).unwrap_or_default();
            match port.speaker(&name) {
                Some(speaker) => Some((stream, speaker)),
                None => {
                    DATA_REFUSED.identity.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if let Some(held_back) = REFUSAL_LOG.check() {
                        tracing::warn!(%peer, port = what, certificate = %name, reason = "identity", held_back,
                            "a certificate of the cluster CA that names no process of this cluster: connection closed");
                    }
                    None
                }
            }
        }
        Err(r) => {
            REFUSED.count(&r);
            if let Some(held_back) = REFUSAL_LOG.check() {
                tracing::warn!(%peer, port = what, reason = r.kind(), error = %r, held_back, "handshake refused: connection closed");
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
