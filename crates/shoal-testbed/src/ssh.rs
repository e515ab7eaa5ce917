//! The `ssh` launch mode on the testbed: an `sshd` in every host namespace, listening on
//! the host's address, with a host key and a client key made for the run, so that
//! `shoal run` starts every process as it would on a farm of real machines
//! (`ssh <address> shoal node ...`).
//!
//! Everything lives in `<dir>/ssh`: the keys, `authorized_keys`, a `known_hosts` naming
//! every host address (so the client checks host keys strictly), and each daemon's log.
//! Nothing of the machine's own ssh configuration is read or changed. The daemons run in
//! the testbed's namespaces, so tearing the testbed down ends them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

use crate::plan::Plan;

/// Where sshd is on Debian (openssh-server).
pub const SSHD: &str = "/usr/sbin/sshd";

/// Why the ssh launch mode cannot run here, if it cannot.
pub fn unavailable() -> Option<String> {
    if !Path::new(SSHD).is_file() {
        return Some(format!("{SSHD} is missing (Debian package openssh-server)"));
    }
    for tool in ["ssh", "ssh-keygen"] {
        if !crate::netns::on_path(tool) {
            return Some(format!("`{tool}` is missing (Debian package openssh-client)"));
        }
    }
    None
}

/// The keys and files of one testbed's ssh.
#[derive(Clone, Debug)]
pub struct SshKeys {
    pub dir: PathBuf,
}

impl SshKeys {
    fn host_key(&self) -> PathBuf {
        self.dir.join("host_ed25519")
    }
    fn client_key(&self) -> PathBuf {
        self.dir.join("id_ed25519")
    }
    fn authorized_keys(&self) -> PathBuf {
        self.dir.join("authorized_keys")
    }
    fn known_hosts(&self) -> PathBuf {
        self.dir.join("known_hosts")
    }

    /// Makes a host key and a client key in `dir` (replacing any there).
    pub fn make(dir: &Path, plan: &Plan) -> anyhow::Result<SshKeys> {
        if let Some(why) = unavailable() {
            bail!("cannot use the ssh launch mode: {why}");
        }
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let keys = SshKeys { dir: dir.to_path_buf() };
        for (key, comment) in [(keys.host_key(), "shoal-testbed-host"), (keys.client_key(), "shoal-testbed-client")] {
            let out = Command::new("ssh-keygen")
                .args(["-q", "-t", "ed25519", "-N", "", "-C", comment, "-f"])
                .arg(&key)
                .stdin(Stdio::null())
                .output()
                .context("running ssh-keygen")?;
            if !out.status.success() {
                bail!("ssh-keygen failed: {}", String::from_utf8_lossy(&out.stderr).trim());
            }
        }
        let client_pub = std::fs::read_to_string(keys.client_key().with_extension("pub"))?;
        std::fs::write(keys.authorized_keys(), client_pub)?;
        let host_pub = std::fs::read_to_string(keys.host_key().with_extension("pub"))?;
        let host_pub = host_pub.split_whitespace().take(2).collect::<Vec<_>>().join(" ");
        let addrs: Vec<String> = plan.hosts.iter().map(|h| h.addr.to_string()).collect();
        std::fs::write(keys.known_hosts(), format!("{} {host_pub}\n", addrs.join(",")))?;
        Ok(keys)
    }

    /// What `ssh` needs to reach the testbed's hosts: this key, these host keys, and the
    /// one runtime worker per process the testbed gives its processes.
    pub fn client_options(&self) -> Vec<String> {
        vec![
            "-i".into(),
            self.client_key().display().to_string(),
            "-o".into(),
            "IdentitiesOnly=yes".into(),
            "-o".into(),
            format!("UserKnownHostsFile={}", self.known_hosts().display()),
            "-o".into(),
            "StrictHostKeyChecking=yes".into(),
            "-o".into(),
            "ConnectTimeout=10".into(),
            "-o".into(),
            "SetEnv=TOKIO_WORKER_THREADS=1".into(),
        ]
    }

    /// Starts an sshd in every host namespace of `plan`, on the host's address. It forks
    /// into the background once it listens.
    pub fn start_daemons(&self, plan: &Plan) -> anyhow::Result<()> {
        // Its privilege separation directory.
        std::fs::create_dir_all("/run/sshd").context("creating /run/sshd")?;
        for h in &plan.hosts {
            let opt = |o: String| ["-o".to_string(), o];
            let mut args: Vec<String> = vec!["netns".into(), "exec".into(), h.netns.clone(), SSHD.into()];
            args.extend(["-f".into(), "/dev/null".into(), "-h".into(), self.host_key().display().to_string()]);
            args.extend(["-E".into(), self.dir.join(format!("sshd-{}.log", h.netns)).display().to_string()]);
            for o in [
                format!("ListenAddress={}", h.addr),
                format!("AuthorizedKeysFile={}", self.authorized_keys().display()),
                format!("PidFile={}", self.dir.join(format!("sshd-{}.pid", h.netns)).display()),
                "StrictModes=no".into(),
                "PermitRootLogin=prohibit-password".into(),
                "PasswordAuthentication=no".into(),
                "KbdInteractiveAuthentication=no".into(),
                "UsePAM=no".into(),
                "AcceptEnv=TOKIO_WORKER_THREADS".into(),
            ] {
                args.extend(opt(o));
            }
            let out = Command::new("ip").args(&args).stdin(Stdio::null()).output().context("starting sshd")?;
            if !out.status.success() {
                bail!("sshd in {} failed ({}): {}", h.netns, out.status, String::from_utf8_lossy(&out.stderr).trim());
            }
        }
        Ok(())
    }
}
