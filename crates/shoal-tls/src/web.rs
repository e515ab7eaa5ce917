//! A Prometheus web configuration file (exporter-toolkit's `web.yml`) for `/metrics` and
//! every other HTTP server of shoal: TLS, client certificates, bcrypt basic-auth users.
//!
//! ```yaml
//! tls_server_config:
//!   cert_file: node.pem
//!   key_file: node.key
//!   client_auth_type: RequireAndVerifyClientCert   # or NoClientCert
//!   client_ca_file: ca.pem
//! basic_auth_users:
//!   prometheus: $2y$10$...                         # htpasswd -nBC 10 prometheus
//! ```
//!
//! Relative paths are taken from the file's own directory, as exporter-toolkit does.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{Context, bail};
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WebFile {
    tls_server_config: Option<TlsServerFile>,
    #[serde(default)]
    basic_auth_users: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TlsServerFile {
    cert_file: PathBuf,
    key_file: PathBuf,
    #[serde(default)]
    client_auth_type: Option<String>,
    #[serde(default)]
    client_ca_file: Option<PathBuf>,
    #[serde(default)]
    min_version: Option<String>,
}

/// A loaded web configuration.
pub struct WebConfig {
    pub tls: Option<Arc<ServerConfig>>,
    /// User name to bcrypt hash; empty: no basic auth.
    users: BTreeMap<String, String>,
    /// `Authorization` values already checked (bcrypt costs tens of milliseconds; a
    /// scraper sends the same one every few seconds). At most [`VERIFIED_KEPT`].
    verified: Mutex<Vec<String>>,
}

const VERIFIED_KEPT: usize = 16;

impl std::fmt::Debug for WebConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebConfig")
            .field("tls", &self.tls.is_some())
            .field("users", &self.users.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl WebConfig {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let base = path.parent().unwrap_or(Path::new("."));
        Self::parse(&text, base).with_context(|| format!("web configuration {}", path.display()))
    }

    /// From the file's text; relative paths from `base`.
    pub fn parse(text: &str, base: &Path) -> anyhow::Result<Self> {
        let file: WebFile = serde_yaml_ng::from_str(text)?;
        for (user, hash) in &file.basic_auth_users {
            if !hash.starts_with("$2") {
                bail!("basic_auth_users.{user}: a bcrypt hash ($2a$, $2b$ or $2y$) is expected");
            }
        }
        let tls = match file.tls_server_config {
            None => None,
            Some(t) => Some(server_config(&t, base)?),
        };
        Ok(Self { tls, users: file.basic_auth_users, verified: Mutex::new(Vec::new()) })
    }

    pub fn requires_basic_auth(&self) -> bool {
        !self.users.is_empty()
    }

    /// Whether an `Authorization` header value passes (always, without basic-auth users).
    pub fn authorize(&self, header: Option<&str>) -> bool {
        if self.users.is_empty() {
            return true;
        }
        let Some(value) = header else { return false };
        if self.verified.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|v| v == value) {
            return true;
        }
        let Some(encoded) = value.strip_prefix("Basic ") else { return false };
        let Some(decoded) = decode_base64(encoded.trim()) else { return false };
        let Ok(text) = String::from_utf8(decoded) else { return false };
        let Some((user, password)) = text.split_once(':') else { return false };
        let Some(hash) = self.users.get(user) else { return false };
        if !bcrypt::verify(password, hash).unwrap_or(false) {
            return false;
        }
        let mut kept = self.verified.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() >= VERIFIED_KEPT {
            kept.remove(0);
        }
        kept.push(value.to_string());
        true
    }
}

fn server_config(t: &TlsServerFile, base: &Path) -> anyhow::Result<Arc<ServerConfig>> {
    let path = |p: &Path| if p.is_absolute() { p.to_path_buf() } else { base.join(p) };
    let read = |p: &Path| std::fs::read(path(p)).with_context(|| format!("reading {}", path(p).display()));
    if let Some(v) = &t.min_version
        && v != "TLS13"
        && v != "TLS12"
    {
        bail!("tls_server_config.min_version: {v:?} (TLS12 or TLS13; shoal serves TLS 1.3)");
    }
    let chain =
        CertificateDer::pem_slice_iter(&read(&t.cert_file)?).collect::<Result<Vec<_>, _>>().context("cert_file")?;
    let key = PrivateKeyDer::from_pem_slice(&read(&t.key_file)?).context("key_file")?;
    let builder = ServerConfig::builder_with_provider(crate::identity::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?;
    let auth = t.client_auth_type.as_deref().unwrap_or("NoClientCert");
    let builder = match auth {
        "NoClientCert" => builder.with_no_client_auth(),
        "RequireAndVerifyClientCert" | "VerifyClientCertIfGiven" => {
            let ca =
                t.client_ca_file.as_ref().with_context(|| format!("client_auth_type {auth} needs client_ca_file"))?;
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(&read(ca)?) {
                roots.add(c.context("client_ca_file")?)?;
            }
            let v = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                crate::identity::provider(),
            );
            let v = if auth == "VerifyClientCertIfGiven" { v.allow_unauthenticated() } else { v };
            builder.with_client_cert_verifier(v.build()?)
        }
        other => bail!(
            "tls_server_config.client_auth_type: {other:?} (NoClientCert, VerifyClientCertIfGiven or RequireAndVerifyClientCert)"
        ),
    };
    Ok(Arc::new(builder.with_single_cert(chain, key).context("cert_file and key_file")?))
}

/// Standard base64 (RFC 4648, with padding), as HTTP basic auth carries it.
fn decode_base64(s: &str) -> Option<Vec<u8>> {
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let bytes = s.trim_end_matches('=').as_bytes();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= value(c)? << (18 - 6 * i);
        }
        let take = match chunk.len() {
            4 => 3,
            3 => 2,
            2 => 1,
            _ => return None,
        };
        out.extend_from_slice(&n.to_be_bytes()[1..1 + take]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_as_basic_auth_carries_it() {
        assert_eq!(decode_base64("cHJvbWV0aGV1czpzZWNyZXQ=").unwrap(), b"prometheus:secret");
        assert_eq!(decode_base64("YQ==").unwrap(), b"a");
        assert_eq!(decode_base64("YWI=").unwrap(), b"ab");
        assert!(decode_base64("Y").is_none());
        assert!(decode_base64("@@@@").is_none());
    }

    #[test]
    fn basic_auth_users_are_checked_with_bcrypt() {
        let hash = bcrypt::hash("secret", 4).unwrap();
        let web = WebConfig::parse(&format!("basic_auth_users:\n  prometheus: {hash}\n"), Path::new(".")).unwrap();
        assert!(web.requires_basic_auth());
        assert!(web.authorize(Some("Basic cHJvbWV0aGV1czpzZWNyZXQ=")));
        // Again, from the kept ones.
        assert!(web.authorize(Some("Basic cHJvbWV0aGV1czpzZWNyZXQ=")));
        // prometheus:wrong
        assert!(!web.authorize(Some("Basic cHJvbWV0aGV1czp3cm9uZw==")));
        assert!(!web.authorize(None));
        assert!(!web.authorize(Some("Bearer x")));
    }

    #[test]
    fn a_malformed_file_is_refused_with_its_reason() {
        let e = WebConfig::parse("basic_auth_users:\n  a: plain\n", Path::new(".")).unwrap_err();
        assert!(e.to_string().contains("bcrypt"), "{e}");
        let e = WebConfig::parse(
            "tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth_type: Odd\n",
            Path::new("/nonexistent"),
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("reading"), "{e:#}");
        assert!(WebConfig::parse("unknown_key: 1\n", Path::new(".")).is_err());
    }
}
