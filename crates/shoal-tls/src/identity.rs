//! A process's credentials (the cluster CA, its certificate and key) and the rustls
//! configurations made from them: TLS 1.3 only, *ring*, both ends proving themselves.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use crate::peer::{RoleClientVerifier, RoleServerVerifier};

/// Where a process's credentials are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credentials {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Credentials {
    /// `DIR/ca.pem`, `DIR/NAME.pem` and `DIR/NAME.key`, as `shoal ca issue` writes them.
    pub fn in_dir(dir: &Path, name: &str) -> Self {
        Self {
            ca: dir.join(crate::ca::CA_CERT),
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}.key")),
        }
    }
}

/// The crypto provider every configuration uses (*ring*, chosen explicitly: a process
/// never depends on which provider another crate installed as the default), with
/// AES-128-GCM first: the bulk path's cost per byte is the cipher's, and AES-128 is the
/// faster of the two AES-GCM suites with no weaker guarantee that matters here
/// (docs/benchmarks.md, "Security").
pub fn provider() -> Arc<CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    let first = rustls::CipherSuite::TLS13_AES_128_GCM_SHA256;
    p.cipher_suites.sort_by_key(|s| s.suite() != first);
    Arc::new(p)
}

/// A process's identity, ready for rustls.
#[derive(Clone, Debug)]
pub struct Identity {
    roots: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: Arc<PrivateKeyDer<'static>>,
}

impl Identity {
    pub fn load(c: &Credentials) -> anyhow::Result<Self> {
        let read = |p: &Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
        Self::from_pem(&read(&c.ca)?, &read(&c.cert)?, &read(&c.key)?)
            .with_context(|| format!("credentials {} and {}", c.cert.display(), c.key.display()))
    }

    /// From PEM text: the CA's certificate, the process's certificate (chain) and key.
    pub fn from_pem(ca: &[u8], cert: &[u8], key: &[u8]) -> anyhow::Result<Self> {
        let mut roots = RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(ca) {
            roots.add(c.context("the CA file")?).context("the CA's certificate")?;
        }
        if roots.is_empty() {
            bail!("the CA file holds no certificate");
        }
        let chain = CertificateDer::pem_slice_iter(cert).collect::<Result<Vec<_>, _>>().context("the certificate")?;
        if chain.is_empty() {
            bail!("the certificate file holds no certificate");
        }
        let key = PrivateKeyDer::from_pem_slice(key).context("the key file")?;
        Ok(Self { roots: Arc::new(roots), chain, key: Arc::new(key) })
    }

    /// The names in this process's own certificate.
    pub fn name(&self) -> Option<crate::peer::PeerName> {
        crate::peer::PeerName::of(&self.chain[0])
    }

    /// A server that requires a client certificate from the cluster CA with one of `roles`
    /// (empty: any role). No session tickets: nothing follows the handshake unasked
    /// (the `authenticated` data mode continues in plain text after it).
    pub fn server_config(&self, roles: &[&str]) -> anyhow::Result<Arc<ServerConfig>> {
        let inner = WebPkiClientVerifier::builder_with_provider(self.roots.clone(), provider())
            .build()
            .context("the client verifier")?;
        let verifier = Arc::new(RoleClientVerifier { inner, roles: role_list(roles) });
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .context("this process's certificate and key")?;
        config.send_tls13_tickets = 0;
        Ok(Arc::new(config))
    }

    /// A server that asks for no client certificate (an HTTP API whose callers bring
    /// tokens, a `/metrics` whose web configuration takes basic auth).
    pub fn server_config_without_client_auth(&self) -> anyhow::Result<Arc<ServerConfig>> {
        let config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_no_client_auth()
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .context("this process's certificate and key")?;
        Ok(Arc::new(config))
    }

    /// A client that presents this process's certificate and takes a server from the
    /// cluster CA, named for the address it connects to, with one of `roles`.
    pub fn client_config(&self, roles: &[&str]) -> anyhow::Result<Arc<ClientConfig>> {
        let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(self.roots.clone(), provider())
            .build()
            .context("the server verifier")?;
        let verifier = Arc::new(RoleServerVerifier { inner, roles: role_list(roles) });
        let config = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .context("this process's certificate and key")?;
        Ok(Arc::new(config))
    }
}

fn role_list(roles: &[&str]) -> Vec<String> {
    if roles.is_empty() {
        crate::ca::ROLES.iter().map(|r| r.to_string()).collect()
    } else {
        roles.iter().map(|r| r.to_string()).collect()
    }
}
