//! The credentials run control hands the processes it launches (`[cluster.security]`).
//!
//! With `ca_dir` (a CA made by `shoal ca init`), run control issues every process it starts
//! on this host (`launch = "local"` or `"netns"`) a certificate of its own at the start of
//! `shoal run`, into `STATE_DIR/credentials` (keys 0600), naming the process, its role and
//! the address peers dial it at; the process gets `--credentials` pointing there. Processes
//! on other hosts (`ssh`, `external`) read theirs from `credentials_dir` on their host,
//! issued there with `shoal ca issue` (docs/security.md, "Several hosts").
//!
//! The control plane ([`control_plane`]): with `ca_dir` run control also issues itself
//! (`runcontrol`) and the dispatcher it starts (`dispatcher`, naming the dispatcher's
//! address) certificates there, and every connection to the dispatcher is mutual TLS;
//! with `credentials_dir` alone it reads `runcontrol.pem` (and the dispatcher its
//! `dispatcher.pem`) from there.

use std::path::{Path, PathBuf};

use anyhow::Context;
use shoal_net::node::Role;

use crate::cluster::{ClusterFile, Launch, ProcessSpec};

/// Where run control puts what it issues.
pub fn issued_dir(file: &ClusterFile) -> PathBuf {
    file.cluster.state_dir.join("credentials")
}

/// `--credentials DIR` for `spec`, if the cluster has any.
pub fn dir_for(spec: &ProcessSpec, file: &ClusterFile) -> Option<PathBuf> {
    let s = file.cluster.security.as_ref()?;
    match spec.launch {
        Launch::Local | Launch::Netns if s.ca_dir.is_some() => Some(issued_dir(file)),
        _ => s.credentials_dir.clone(),
    }
}

/// The hosts a process's certificate names: the address its peers dial (a builder's data
/// address, the writer's, the manager's), its host, and loopback.
fn hosts_of(spec: &ProcessSpec, file: &ClusterFile) -> Vec<String> {
    let cfg = &file.config;
    let dialled = match spec.role {
        Role::Builder => spec.ids.first().and_then(|&b| cfg.builder_addr(b).ok()),
        Role::Writer => cfg.writer_addr().ok(),
        Role::Dfm => cfg.dfm_addr().ok(),
        Role::Source => None,
    };
    let mut hosts: Vec<String> = dialled.map(|a| a.ip().to_string()).into_iter().collect();
    for h in [spec.host.as_str(), "127.0.0.1", "::1", "localhost"] {
        if !hosts.iter().any(|k| k == h) {
            hosts.push(h.to_string());
        }
    }
    hosts
}

/// Issues a certificate for every process run control starts on this host (with `ca_dir`),
/// and the CA's certificate beside them; returns how many.
pub fn issue_all(file: &ClusterFile) -> anyhow::Result<usize> {
    let Some(ca_dir) = file.cluster.security.as_ref().and_then(|s| s.ca_dir.as_ref()) else { return Ok(0) };
    let (ca, out) = open_issuing(file, ca_dir)?;
    let mut n = 0;
    for spec in file.processes.iter().filter(|p| matches!(p.launch, Launch::Local | Launch::Netns)) {
        let req = shoal_tls::ca::IssueRequest::new(&spec.name, spec.role.name(), &hosts_of(spec, file), 30)?;
        ca.issue_into(&out, &req)?;
        n += 1;
    }
    Ok(n)
}

/// The control plane's credentials: where run control's (`runcontrol`) and the started
/// dispatcher's (`dispatcher`) certificates are, and run control's identity. `None` where the
/// cluster has no CA and no `runcontrol.pem` in `credentials_dir`: the control plane is then
/// plain, as without security.
#[derive(Clone, Debug)]
pub struct ControlPlane {
    pub dir: PathBuf,
    pub tls: shoal_dispatcher::client::ControlTls,
}

/// Run control's own certificate's name.
pub const RUN_CONTROL: &str = "runcontrol";
/// The started dispatcher's certificate's name.
pub const DISPATCHER: &str = "dispatcher";

/// Whether the cluster's control plane is authenticated ([`control_plane`] finds credentials),
/// without issuing anything.
pub fn has_control_plane(file: &ClusterFile) -> bool {
    file.cluster.security.as_ref().is_some_and(|s| {
        s.ca_dir.is_some() || s.credentials_dir.as_ref().is_some_and(|d| d.join(format!("{RUN_CONTROL}.pem")).exists())
    })
}

/// Issues (with `ca_dir`) or finds (in `credentials_dir`) the control plane's certificates.
pub fn control_plane(file: &ClusterFile) -> anyhow::Result<Option<ControlPlane>> {
    let Some(s) = file.cluster.security.as_ref() else { return Ok(None) };
    let dir = match (&s.ca_dir, &s.credentials_dir) {
        (Some(ca_dir), _) => {
            let (ca, out) = open_issuing(file, ca_dir)?;
            let local = ["127.0.0.1".to_string(), "::1".into(), "localhost".into()];
            ca.issue_into(&out, &shoal_tls::ca::IssueRequest::new(RUN_CONTROL, "runcontrol", &local, 30)?)?;
            let addr = file.dispatcher_addr()?.ip().to_string();
            let hosts: Vec<String> = std::iter::once(addr).chain(local).collect();
            ca.issue_into(&out, &shoal_tls::ca::IssueRequest::new(DISPATCHER, "dispatcher", &hosts, 30)?)?;
            out
        }
        (None, Some(dir)) if dir.join(format!("{RUN_CONTROL}.pem")).exists() => dir.clone(),
        (None, _) => return Ok(None),
    };
    let identity = shoal_tls::Identity::load(&shoal_tls::Credentials::in_dir(&dir, RUN_CONTROL))
        .context("run control's certificate for the control plane")?;
    Ok(Some(ControlPlane { dir, tls: shoal_dispatcher::client::ControlTls::new(&identity)? }))
}

/// The cluster's CA from `ca_dir`, and the directory run control issues into (made 0700,
/// the CA's certificate beside what it will hold).
fn open_issuing(file: &ClusterFile, ca_dir: &Path) -> anyhow::Result<(shoal_tls::ca::ClusterCa, PathBuf)> {
    let ca = shoal_tls::ca::ClusterCa::load(ca_dir)
        .with_context(|| format!("cluster.security.ca_dir {}", ca_dir.display()))?;
    let out = issued_dir(file);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    restrict(&out)?;
    std::fs::write(out.join(shoal_tls::ca::CA_CERT), ca.cert_pem())?;
    Ok((ca, out))
}

fn restrict(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).with_context(|| format!("{}", dir.display()))
}
