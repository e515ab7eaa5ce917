//! Who may use run control's HTTP API: bearer tokens with roles, and the rule that keeps a
//! cluster without security on loopback.
//!
//! A token file (`[cluster.security] tokens = "PATH"`, written by `shoal token add`) holds
//! one entry per token: its name, its [`Role`] and the SHA-256 of the token, never the
//! token itself. A request's `Authorization: Bearer TOKEN` is hashed and compared with
//! every entry in constant time ([`Tokens::identify`]). Tokens are 256 random bits, so a
//! plain hash is enough: there is nothing to guess that a slow hash would protect.
//!
//! [`check_listeners`] is the secure-by-default rule: every address run control listens on
//! or hands its processes must be on loopback unless what protects it is set (tokens and
//! TLS for the HTTP API, `data` for data ports, `metrics_web_config` for `/metrics`,
//! `[cluster.security]` itself for the dispatcher, whose command tags it then guards); a
//! cluster file that says otherwise is refused at start, naming the setting, unless it
//! says `insecure = true` (then every run record and the UI say so).

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// What a token may do. Each role may do what the ones before it may.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Read: the status, run records, metrics, the live view.
    Viewer,
    /// And command the cluster (INIT ... OFF) and send alerts.
    Operator,
    /// And everything an operator may; reserved for administration.
    Admin,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "viewer" => Ok(Role::Viewer),
            "operator" => Ok(Role::Operator),
            "admin" => Ok(Role::Admin),
            _ => Err(format!("role {s:?}: one of viewer, operator, admin")),
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `[cluster.security]` of the cluster file.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SecuritySettings {
    /// The token file (`shoal token add`): every HTTP API request then needs a token.
    pub tokens: Option<PathBuf>,
    /// Origins besides the UI's own that may POST and open the live view (a browser
    /// sends `Origin`; scripts and curl send none and are judged by their token alone).
    pub allowed_origins: Vec<String>,
    /// The cluster CA (`shoal ca init DIR`): run control issues each process it launches
    /// on this host a certificate from it, into `STATE_DIR/credentials` (0600).
    pub ca_dir: Option<PathBuf>,
    /// Where processes run by ssh or started by others find their credentials on their
    /// host (`shoal ca issue` output: ca.pem, NAME.pem, NAME.key).
    pub credentials_dir: Option<PathBuf>,
    /// The bulk path: `off`, `authenticated` or `tls` (sets the run configuration's
    /// `[security] data`; docs/security.md).
    pub data: shoal_tls::DataSecurity,
    /// A Prometheus web configuration for run control's HTTP API and UI (its
    /// `tls_server_config`; tokens are the API's credentials, so no basic-auth users).
    pub web_config: Option<PathBuf>,
    /// A Prometheus web configuration for every process's `/metrics` (a path on each
    /// host), passed as `shoal node --web-config`.
    pub metrics_web_config: Option<PathBuf>,
}

/// What a listening address serves, for the secure-by-default rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listener {
    /// The dispatcher's ControlHost port (open to subscribers by design; command tags only
    /// from `command_from`).
    Dispatcher,
    /// A data port (builders, writer, data-flow manager): `data`.
    Data,
    /// A `/metrics` or the dispatcher's status page: `metrics_web_config`.
    Metrics,
}

/// One entry of the token file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenEntry {
    pub name: String,
    pub role: Role,
    /// SHA-256 of the token, hex.
    pub sha256: String,
    /// When it was made, UNIX seconds.
    pub created: u64,
    /// When it stops being accepted, UNIX seconds (0: never).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub expires: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The token file: `[[token]]` entries.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenFile {
    #[serde(default, rename = "token")]
    pub tokens: Vec<TokenEntry>,
}

/// Who a request is: the token's name and role.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub name: String,
    pub role: Role,
}

/// The prefix of every token, so that one found in a log or a file says what it is.
pub const TOKEN_PREFIX: &str = "shoal_";

fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

/// Equal without an early exit: the time taken does not say how much matched.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl TokenFile {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading the token file {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("the token file {}", path.display()))
    }

    /// A token file's text, every entry checked.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let file: TokenFile = toml::from_str(text).context("parsing")?;
        for t in &file.tokens {
            if t.sha256.len() != 64 || !t.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                bail!("{:?} has no SHA-256 (64 hex digits)", t.name);
            }
        }
        Ok(file)
    }

    /// Adds a token named `name` with `role` to the file at `path` (made, mode 0600, if
    /// missing) and returns the token, which is stored nowhere.
    pub fn add(path: &Path, name: &str, role: Role) -> anyhow::Result<String> {
        Self::add_expiring(path, name, role, 0)
    }

    /// [`TokenFile::add`] of a token accepted until `expires` (UNIX seconds; 0: always).
    pub fn add_expiring(path: &Path, name: &str, role: Role, expires: u64) -> anyhow::Result<String> {
        if name.is_empty() || name.contains(char::is_whitespace) {
            bail!("token name {name:?} must be one word (it names the holder in the audit log)");
        }
        let mut file = if path.exists() { Self::load(path)? } else { Self::default() };
        if file.tokens.iter().any(|t| t.name == name) {
            bail!("{}: a token named {name:?} exists already", path.display());
        }
        let mut secret = [0u8; 32];
        getrandom::fill(&mut secret).map_err(|e| anyhow::anyhow!("no randomness for a token: {e}"))?;
        let token = format!("{TOKEN_PREFIX}{}", secret.iter().map(|b| format!("{b:02x}")).collect::<String>());
        let created = unix_now();
        file.tokens.push(TokenEntry {
            name: name.into(),
            role,
            sha256: sha256_hex(token.as_bytes()),
            created,
            expires,
        });
        write_private(path, &toml::to_string(&file)?)?;
        Ok(token)
    }
}

impl TokenFile {
    /// Removes the token named `name` from the file at `path`; the entry removed.
    pub fn remove(path: &Path, name: &str) -> anyhow::Result<TokenEntry> {
        let mut file = Self::load(path)?;
        let Some(i) = file.tokens.iter().position(|t| t.name == name) else {
            let names: Vec<&str> = file.tokens.iter().map(|t| t.name.as_str()).collect();
            bail!("{}: no token named {name:?} (it has: {})", path.display(), names.join(", "));
        };
        let removed = file.tokens.remove(i);
        write_private(path, &toml::to_string(&file)?)?;
        Ok(removed)
    }
}

/// Writes `text` to `path` readable by its owner only, replacing it whole.
fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))?;
    Ok(())
}

/// The tokens run control accepts.
#[derive(Clone, Debug, Default)]
pub struct Tokens {
    entries: Vec<TokenEntry>,
    /// The SHA-256 of tokens removed from the file while run control read it: refused as
    /// `revoked`, not `bad_token`.
    revoked: Vec<String>,
}

/// The token file as it is now: read again whenever it changed (its inode, size or
/// modification time, looked at on every request, a `stat` each), so that a token removed
/// from it is refused from the next request on. A file that cannot be read or parsed keeps
/// the tokens last read (logged, at most once a second); a file that is gone takes every
/// token with it.
#[derive(Debug)]
pub struct WatchedTokens {
    path: PathBuf,
    state: std::sync::Mutex<(Option<FileStamp>, Tokens)>,
    bad_file_log: std::sync::Mutex<Option<std::time::Instant>>,
}

/// What says a file changed without reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileStamp {
    inode: u64,
    len: u64,
    modified: Option<std::time::SystemTime>,
}

impl FileStamp {
    fn of(path: &Path) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).ok()?;
        Some(Self { inode: m.ino(), len: m.len(), modified: m.modified().ok() })
    }
}

impl WatchedTokens {
    /// The file at `path`, read now (an error if it cannot be: run control does not start).
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let stamp = FileStamp::of(path);
        let tokens = Tokens::new(TokenFile::load(path)?);
        Ok(Self {
            path: path.to_path_buf(),
            state: std::sync::Mutex::new((stamp, tokens)),
            bad_file_log: std::sync::Mutex::new(None),
        })
    }

    /// The tokens as the file says now.
    pub fn current(&self) -> Tokens {
        let stamp = FileStamp::of(&self.path);
        let mut state = self.state.lock().expect("tokens lock");
        if stamp != state.0 {
            let read = match stamp {
                None => Ok(TokenFile::default()),
                Some(_) => TokenFile::load(&self.path),
            };
            match read {
                Ok(file) => {
                    let next = state.1.replaced_by(file);
                    for name in state.1.entries.iter().filter(|e| next.revoked.contains(&e.sha256)).map(|e| &e.name) {
                        tracing::warn!(token = %name, file = %self.path.display(), "token removed from the file: revoked");
                    }
                    *state = (stamp, next);
                }
                Err(e) => {
                    let mut last = self.bad_file_log.lock().expect("log lock");
                    if last.is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(1)) {
                        *last = Some(std::time::Instant::now());
                        tracing::error!(error = %format!("{e:#}"), "the token file changed and cannot be read: the tokens read before stay");
                    }
                }
            }
        }
        state.1.clone()
    }
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization: Bearer` (401).
    NoToken,
    /// A token no entry matches (401).
    BadToken,
    /// A known token whose role may not do this (403).
    Role { have: Role, need: Role },
    /// A known token past its expiry (401).
    Expired,
    /// A browser page of another origin (403).
    Origin,
    /// A token that was in the file and has been removed from it (401).
    Revoked,
}

impl Refusal {
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::NoToken => "no_token",
            Refusal::BadToken => "bad_token",
            Refusal::Role { .. } => "role",
            Refusal::Expired => "expired",
            Refusal::Origin => "origin",
            Refusal::Revoked => "revoked",
        }
    }
}

impl Tokens {
    pub fn new(file: TokenFile) -> Self {
        Self { entries: file.tokens, revoked: Vec::new() }
    }

    /// The tokens of `file`, which replaces this one's: what this one had and `file` has
    /// not is revoked from now on (a token added again under a new name is not).
    fn replaced_by(&self, file: TokenFile) -> Tokens {
        let kept = |h: &String| file.tokens.iter().all(|t| &t.sha256 != h);
        let mut revoked: Vec<String> = self.revoked.iter().filter(|h| kept(h)).cloned().collect();
        revoked.extend(self.entries.iter().map(|e| e.sha256.clone()).filter(kept));
        Tokens { entries: file.tokens, revoked }
    }

    /// Whose token `presented` is. Every entry is compared, in constant time each.
    pub fn identify(&self, presented: &str) -> Option<Identity> {
        self.entry(presented).map(|e| Identity { name: e.name.clone(), role: e.role })
    }

    fn entry(&self, presented: &str) -> Option<&TokenEntry> {
        let hash = sha256_hex(presented.as_bytes());
        let mut found = None;
        for e in &self.entries {
            if constant_time_eq(e.sha256.as_bytes(), hash.as_bytes()) && found.is_none() {
                found = Some(e);
            }
        }
        found
    }

    /// The identity behind an `Authorization` header's value, if it may act as `need`.
    pub fn authorize(&self, authorization: Option<&str>, need: Role) -> Result<Identity, Refusal> {
        self.authorize_at(authorization, need, unix_now())
    }

    /// [`Tokens::authorize`] at `now` (UNIX seconds).
    pub fn authorize_at(&self, authorization: Option<&str>, need: Role, now: u64) -> Result<Identity, Refusal> {
        let token = authorization.and_then(|v| v.strip_prefix("Bearer ")).map(str::trim).ok_or(Refusal::NoToken)?;
        let Some(entry) = self.entry(token) else {
            let hash = sha256_hex(token.as_bytes());
            let revoked = self.revoked.iter().any(|h| constant_time_eq(h.as_bytes(), hash.as_bytes()));
            return Err(if revoked { Refusal::Revoked } else { Refusal::BadToken });
        };
        if entry.expires != 0 && now >= entry.expires {
            return Err(Refusal::Expired);
        }
        let who = Identity { name: entry.name.clone(), role: entry.role };
        if who.role < need {
            return Err(Refusal::Role { have: who.role, need });
        }
        Ok(who)
    }
}

/// Whether `addr` (an `address:port`, or "off") listens on loopback only.
fn on_loopback(addr: &str) -> bool {
    if addr == "off" || addr.is_empty() {
        return true;
    }
    match addr.parse::<SocketAddr>() {
        Ok(a) => a.ip().is_loopback(),
        Err(_) => {
            let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h).trim_matches(['[', ']']);
            host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
        }
    }
}

/// The secure-by-default rule (module docs). `listeners` names each address with the
/// setting it comes from and what it serves; `http` is run control's own.
pub fn check_listeners(
    security: Option<&SecuritySettings>,
    insecure: bool,
    http: &str,
    listeners: &[(String, String, Listener)],
) -> anyhow::Result<()> {
    if insecure {
        return Ok(());
    }
    let trust = "or cluster.insecure = true on a network you trust (docs/security.md)";
    if !on_loopback(http) {
        match security {
            Some(s) if s.tokens.is_some() && s.web_config.is_some() => {}
            Some(s) if s.tokens.is_some() => bail!(
                "cluster.http = {http:?} is not a loopback address and its tokens would cross the network in \
                 the clear: set [cluster.security] web_config = \"web.yml\" (its tls_server_config), {trust}"
            ),
            _ => bail!(
                "cluster.http = {http:?} is not a loopback address: anyone who reaches it could command the run. \
                 Set [cluster.security] tokens = \"FILE\" (tokens made by `shoal token add FILE --name N --role R`) \
                 and web_config = \"web.yml\", {trust}"
            ),
        }
    }
    for (setting, addr, kind) in listeners.iter().filter(|(_, a, _)| !on_loopback(a)) {
        match (kind, security) {
            (Listener::Dispatcher, Some(_)) => {}
            (Listener::Data, Some(s)) if s.data != shoal_tls::DataSecurity::Off => {}
            (Listener::Metrics, Some(s)) if s.metrics_web_config.is_some() => {}
            (Listener::Dispatcher, None) => bail!(
                "{setting} = {addr:?} is not a loopback address: set [cluster.security] (its command tags are \
                 then taken only from command_from), {trust}"
            ),
            (Listener::Data, _) => bail!(
                "{setting} = {addr:?} is not a loopback address, and anyone who reaches it could feed the run: \
                 set [cluster.security] ca_dir and data = \"authenticated\" or \"tls\", {trust}"
            ),
            (Listener::Metrics, _) => bail!(
                "{setting} = {addr:?} is not a loopback address: set [cluster.security] metrics_web_config \
                 (TLS and client certificates or basic auth), {trust}"
            ),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_added_is_known_by_its_hash_only_and_keeps_its_role() {
        let dir = std::env::temp_dir().join(format!("shoal-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokens.toml");
        let _ = std::fs::remove_file(&path);
        let viewer = TokenFile::add(&path, "alice", Role::Viewer).unwrap();
        let operator = TokenFile::add(&path, "bob", Role::Operator).unwrap();
        assert!(TokenFile::add(&path, "bob", Role::Admin).unwrap_err().to_string().contains("exists"));
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains(&viewer) && !text.contains(&operator), "only hashes are stored");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let tokens = Tokens::new(TokenFile::load(&path).unwrap());
        let bearer = |t: &str| format!("Bearer {t}");
        assert_eq!(tokens.authorize(Some(&bearer(&viewer)), Role::Viewer).unwrap().name, "alice");
        assert_eq!(
            tokens.authorize(Some(&bearer(&viewer)), Role::Operator),
            Err(Refusal::Role { have: Role::Viewer, need: Role::Operator })
        );
        assert_eq!(tokens.authorize(Some(&bearer(&operator)), Role::Operator).unwrap().role, Role::Operator);
        assert_eq!(tokens.authorize(None, Role::Viewer), Err(Refusal::NoToken));
        assert_eq!(tokens.authorize(Some("Basic abc"), Role::Viewer), Err(Refusal::NoToken));
        // Its last character changed (to another one: a token may end in "0").
        let last = if viewer.ends_with('0') { '1' } else { '0' };
        let wrong = format!("{}{last}", &viewer[..viewer.len() - 1]);
        assert_eq!(tokens.authorize(Some(&bearer(&wrong)), Role::Viewer), Err(Refusal::BadToken));
        // A token with an expiry: accepted before it, refused from it on.
        let until = unix_now() + 3600;
        let shift = TokenFile::add_expiring(&path, "carol", Role::Operator, until).unwrap();
        let tokens = Tokens::new(TokenFile::load(&path).unwrap());
        assert_eq!(tokens.authorize_at(Some(&bearer(&shift)), Role::Operator, until - 1).unwrap().name, "carol");
        assert_eq!(tokens.authorize_at(Some(&bearer(&shift)), Role::Viewer, until), Err(Refusal::Expired));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_token_removed_from_the_watched_file_is_refused_as_revoked_at_the_next_request() {
        let dir = std::env::temp_dir().join(format!("shoal-tokens-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokens.toml");
        let _ = std::fs::remove_file(&path);
        let alice = TokenFile::add(&path, "alice", Role::Operator).unwrap();
        let bob = TokenFile::add(&path, "bob", Role::Viewer).unwrap();
        let watched = WatchedTokens::load(&path).unwrap();
        let bearer = |t: &str| format!("Bearer {t}");
        assert_eq!(watched.current().authorize(Some(&bearer(&alice)), Role::Operator).unwrap().name, "alice");
        assert_eq!(TokenFile::remove(&path, "alice").unwrap().name, "alice");
        assert!(TokenFile::remove(&path, "alice").unwrap_err().to_string().contains("bob"), "names what there is");
        assert_eq!(watched.current().authorize(Some(&bearer(&alice)), Role::Viewer), Err(Refusal::Revoked));
        assert_eq!(watched.current().authorize(Some(&bearer(&bob)), Role::Viewer).unwrap().name, "bob");
        // A token added meanwhile is taken; one never known is a bad token.
        let carol = TokenFile::add(&path, "carol", Role::Viewer).unwrap();
        assert_eq!(watched.current().authorize(Some(&bearer(&carol)), Role::Viewer).unwrap().name, "carol");
        assert_eq!(watched.current().authorize(Some(&bearer("shoal_00")), Role::Viewer), Err(Refusal::BadToken));
        // A file broken by hand keeps what was read; one removed takes every token.
        std::fs::write(&path, "[[token]]\nname = 1\n").unwrap();
        assert_eq!(watched.current().authorize(Some(&bearer(&bob)), Role::Viewer).unwrap().name, "bob");
        assert_eq!(watched.current().authorize(Some(&bearer(&alice)), Role::Viewer), Err(Refusal::Revoked));
        std::fs::remove_file(&path).unwrap();
        assert_eq!(watched.current().authorize(Some(&bearer(&bob)), Role::Viewer), Err(Refusal::Revoked));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn without_security_only_loopback_listeners_are_accepted() {
        let none: &[(String, String, Listener)] = &[];
        check_listeners(None, false, "127.0.0.1:8080", none).unwrap();
        check_listeners(None, false, "[::1]:8080", none).unwrap();
        check_listeners(None, false, "localhost:8080", none).unwrap();
        check_listeners(None, false, "off", none).unwrap();
        let e = check_listeners(None, false, "0.0.0.0:8080", none).unwrap_err().to_string();
        assert!(e.contains("[cluster.security]") && e.contains("insecure"), "{e}");
        let with_tokens = SecuritySettings { tokens: Some("t.toml".into()), ..Default::default() };
        // Tokens in the clear over the network: refused, naming web_config.
        let e = check_listeners(Some(&with_tokens), false, "0.0.0.0:8080", none).unwrap_err().to_string();
        assert!(e.contains("web_config"), "{e}");
        let with_tls = SecuritySettings { web_config: Some("web.yml".into()), ..with_tokens.clone() };
        check_listeners(Some(&with_tls), false, "0.0.0.0:8080", none).unwrap();
        // Security that protects nothing of the HTTP API does not open it.
        let empty = SecuritySettings::default();
        assert!(check_listeners(Some(&empty), false, "0.0.0.0:8080", none).is_err());
        let data = [("config.run.builder_addrs".to_string(), "198.19.0.1:7000".to_string(), Listener::Data)];
        let e = check_listeners(Some(&with_tokens), false, "127.0.0.1:8080", &data).unwrap_err().to_string();
        assert!(e.contains("builder_addrs") && e.contains("data = ") && e.contains("insecure"), "{e}");
        let authenticated = SecuritySettings { data: shoal_tls::DataSecurity::Authenticated, ..with_tokens.clone() };
        check_listeners(Some(&authenticated), false, "127.0.0.1:8080", &data).unwrap();
        let metrics = [("process \"b\" metrics".to_string(), "0.0.0.0:9100".to_string(), Listener::Metrics)];
        let e = check_listeners(Some(&authenticated), false, "127.0.0.1:8080", &metrics).unwrap_err().to_string();
        assert!(e.contains("metrics_web_config"), "{e}");
        let dispatcher = [("cluster.dispatcher".to_string(), "0.0.0.0:5553".to_string(), Listener::Dispatcher)];
        assert!(check_listeners(None, false, "127.0.0.1:8080", &dispatcher).is_err());
        check_listeners(Some(&empty), false, "127.0.0.1:8080", &dispatcher).unwrap();
        check_listeners(None, true, "0.0.0.0:8080", &data).unwrap();
    }
}
