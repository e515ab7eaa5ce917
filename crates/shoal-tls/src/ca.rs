//! The cluster's certificate authority: `shoal ca init DIR` and `shoal ca issue DIR NAME`.
//!
//! A certificate names one process: its common name is the process name (`builder1`), its
//! organisational unit the process's role (`source`, `builder`, `writer`, `dfm`,
//! `runcontrol`, `dispatcher`, or `client` for tools such as Prometheus), and its subject
//! alternative names the process name and the hosts it may be reached at. A port checks the
//! role of the certificate its peer presents ([`crate::peer`]): a builder's data port takes
//! sources, a writer's builders. Keys are Ed25519 (rcgen on *ring*: the cheapest handshakes,
//! `tls-bench handshakes`), written mode 0600.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use time::{Duration, OffsetDateTime};

/// The roles a certificate may carry.
pub const ROLES: [&str; 7] = ["source", "builder", "writer", "dfm", "runcontrol", "dispatcher", "client"];

/// The CA's certificate in a CA directory.
pub const CA_CERT: &str = "ca.pem";
/// The CA's private key in a CA directory (mode 0600).
pub const CA_KEY: &str = "ca.key";

/// What one certificate is for.
#[derive(Clone, Debug)]
pub struct IssueRequest {
    pub name: String,
    pub role: String,
    /// Host names or IP addresses the process is reached at (besides its name).
    pub hosts: Vec<String>,
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
}

impl IssueRequest {
    /// A certificate valid from a minute ago (clocks of a cluster differ a little) for
    /// `days` days.
    pub fn new(name: &str, role: &str, hosts: &[String], days: u32) -> anyhow::Result<Self> {
        if !ROLES.contains(&role) {
            bail!("role {role:?} is none of {}", ROLES.join(", "));
        }
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.') {
            bail!("a certificate's name is a process name (letters, digits, '-', '_', '.'), not {name:?}");
        }
        let now = OffsetDateTime::now_utc();
        Ok(Self {
            name: name.into(),
            role: role.into(),
            hosts: hosts.to_vec(),
            not_before: now - Duration::minutes(1),
            not_after: now + Duration::days(i64::from(days.max(1))),
        })
    }

    /// The role a process name implies (`builder1` is a builder), if it starts with one.
    pub fn role_of(name: &str) -> Option<&'static str> {
        ROLES.into_iter().find(|r| name.starts_with(r))
    }
}

/// A certificate and its key, PEM.
#[derive(Clone, Debug)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

/// A cluster CA in memory: its certificate and the key that signs.
pub struct ClusterCa {
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCa").finish_non_exhaustive()
    }
}

impl ClusterCa {
    /// A new CA for the cluster `cluster`, valid for `days` days.
    pub fn generate(cluster: &str, days: u32) -> anyhow::Result<Self> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ED25519).context("generating the CA's key")?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, format!("shoal cluster CA {cluster}"));
        dn.push(DnType::OrganizationName, format!("shoal cluster {cluster}"));
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::minutes(1);
        params.not_after = now + Duration::days(i64::from(days.max(1)));
        let cert = params.self_signed(&key).context("signing the CA's certificate")?;
        Ok(Self { cert_pem: cert.pem(), issuer: Issuer::new(params, key) })
    }

    /// `shoal ca init DIR`: a new CA written to `DIR/ca.pem` and `DIR/ca.key` (0600);
    /// refuses to replace an existing key (every certificate it signed would be orphaned).
    pub fn init(dir: &Path, cluster: &str, days: u32) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let key_path = dir.join(CA_KEY);
        if key_path.exists() {
            bail!("{} exists: a cluster keeps its CA (remove it by hand to start over)", key_path.display());
        }
        let ca = Self::generate(cluster, days)?;
        write_private(&key_path, &pkcs8_v1_pem(ca.issuer.key()))?;
        std::fs::write(dir.join(CA_CERT), &ca.cert_pem)
            .with_context(|| format!("writing {}", dir.join(CA_CERT).display()))?;
        Ok(ca)
    }

    /// The CA of `dir` (written by [`ClusterCa::init`]).
    pub fn load(dir: &Path) -> anyhow::Result<Self> {
        let cert_pem = read(&dir.join(CA_CERT))?;
        let key = KeyPair::from_pem(&read(&dir.join(CA_KEY))?).context("reading the CA's key")?;
        let issuer = Issuer::from_ca_cert_pem(&cert_pem, key).context("reading the CA's certificate")?;
        Ok(Self { cert_pem, issuer })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A certificate and key for one process.
    pub fn issue(&self, req: &IssueRequest) -> anyhow::Result<Issued> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ED25519).context("generating a key")?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, req.name.clone());
        dn.push(DnType::OrganizationalUnitName, req.role.clone());
        params.distinguished_name = dn;
        let mut sans = vec![SanType::DnsName(req.name.clone().try_into()?)];
        for h in &req.hosts {
            sans.push(match h.parse::<std::net::IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName(h.clone().try_into().with_context(|| format!("host {h:?}"))?),
            });
        }
        params.subject_alt_names = sans;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        params.not_before = req.not_before;
        params.not_after = req.not_after;
        let cert = params.signed_by(&key, &self.issuer).context("signing the certificate")?;
        Ok(Issued { cert_pem: cert.pem(), key_pem: pkcs8_v1_pem(&key) })
    }

    /// `shoal ca issue DIR NAME`: [`ClusterCa::issue`] written to `DIR/NAME.pem` and
    /// `DIR/NAME.key` (0600); returns the two paths.
    pub fn issue_into(&self, dir: &Path, req: &IssueRequest) -> anyhow::Result<(PathBuf, PathBuf)> {
        let issued = self.issue(req)?;
        let cert = dir.join(format!("{}.pem", req.name));
        let key = dir.join(format!("{}.key", req.name));
        write_private(&key, &issued.key_pem)?;
        std::fs::write(&cert, &issued.cert_pem).with_context(|| format!("writing {}", cert.display()))?;
        Ok((cert, key))
    }
}

fn read(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// Writes `text` to a file only its owner may read (created 0600, never readable between).
pub fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(text.as_bytes()).with_context(|| format!("writing {}", path.display()))
}

/// An Ed25519 key as PKCS#8 v1 (RFC 5208: the seed alone). *ring*, and so rcgen, write v2
/// (RFC 5958, the public key beside it), which OpenSSL 3.0 cannot read ("unsupported"): a
/// key shoal issued did not work with curl, Python's `ssl` or other OpenSSL tools. *ring*
/// and rustls read either. A key of another shape is written as it is.
fn pkcs8_v1_pem(key: &KeyPair) -> String {
    // SEQUENCE { INTEGER 0, SEQUENCE { OID 1.3.101.112 }, OCTET STRING { OCTET STRING (32) } }
    const V1_PREFIX: [u8; 16] =
        [0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20];
    // v2 differs in its length, its version (1) and the public key after the seed.
    const V2_SEED_AT: [u8; 11] = [0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20];
    let der = key.serialize_der();
    if der.len() < 48 || der[5..16] != V2_SEED_AT {
        return key.serialize_pem();
    }
    let mut v1 = V1_PREFIX.to_vec();
    v1.extend_from_slice(&der[16..48]);
    let config = pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF);
    pem::encode_config(&pem::Pem::new("PRIVATE KEY", v1), config)
}
