//! Who a certificate names, and verifiers that take only the roles a port expects.
//!
//! rustls' WebPKI verifiers check the chain to the cluster CA, the validity period and (on
//! the client's side) that the certificate names the address connected to. These wrap them
//! and then check the certificate's role ([`crate::ca`]): a source's certificate on a
//! writer's port fails the handshake, as a foreign CA's or an expired one does.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, Error, SignatureScheme};

/// The process a certificate names: its common name and its role (organisational unit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerName {
    pub name: String,
    pub role: String,
}

impl std::fmt::Display for PeerName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name, self.role)
    }
}

impl PeerName {
    /// The names in `cert`; `None` if it is no X.509 certificate or has no common name.
    pub fn of(cert: &CertificateDer<'_>) -> Option<PeerName> {
        Self::of_der(cert.as_ref())
    }

    /// [`PeerName::of`] DER bytes.
    pub fn of_der(der: &[u8]) -> Option<PeerName> {
        let (_, x509) = x509_parser::parse_x509_certificate(der).ok()?;
        let subject = x509.subject();
        let name = subject.iter_common_name().next()?.as_str().ok()?.to_string();
        let role =
            subject.iter_organizational_unit().next().and_then(|ou| ou.as_str().ok()).unwrap_or_default().to_string();
        Some(PeerName { name, role })
    }
}

/// The refusal for a certificate whose role the port does not take.
fn wrong_role(cert: &CertificateDer<'_>, roles: &[String]) -> Result<PeerName, Error> {
    let peer = PeerName::of(cert).ok_or_else(|| Error::General("the certificate names no process".into()))?;
    if roles.contains(&peer.role) {
        Ok(peer)
    } else {
        Err(Error::General(format!("{peer} is not a process this port takes (it takes: {})", roles.join(", "))))
    }
}

/// A client verifier: the WebPKI one (chain to the cluster CA, validity), then the role.
#[derive(Debug)]
pub struct RoleClientVerifier {
    pub inner: Arc<dyn ClientCertVerifier>,
    pub roles: Vec<String>,
}

impl ClientCertVerifier for RoleClientVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, Error> {
        self.inner.verify_client_cert(end_entity, intermediates, now)?;
        wrong_role(end_entity, &self.roles)?;
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// A server verifier: the WebPKI one (chain, validity, the address connected to), then
/// the role.
#[derive(Debug)]
pub struct RoleServerVerifier {
    pub inner: Arc<dyn ServerCertVerifier>,
    pub roles: Vec<String>,
}

impl ServerCertVerifier for RoleServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        self.inner.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)?;
        wrong_role(end_entity, &self.roles)?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}
