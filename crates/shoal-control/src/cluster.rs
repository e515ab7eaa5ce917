//! The cluster file of `shoal run`: which processes make up the DAQ, where they run, and
//! the run configuration they all receive with CONFIGURE.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use shoal_net::config::Config;
use shoal_net::node::Role;

/// The whole cluster file.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterFile {
    pub cluster: ClusterSettings,
    #[serde(rename = "process")]
    pub processes: Vec<ProcessSpec>,
    /// The run configuration (the schema of `shoal config`) sent with CONFIGURE; each
    /// process gets it with its own builder id / source ids filled in.
    #[serde(default)]
    pub config: Config,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterSettings {
    pub name: String,
    /// The dispatcher every process connects to.
    pub dispatcher: String,
    /// Start the dispatcher as a child process (false: one is already running there).
    pub start_dispatcher: bool,
    /// The started dispatcher's HTTP `/status` and Prometheus `/metrics` ("off": none).
    pub dispatcher_http: String,
    /// Web UI and HTTP API of run control ("off" to disable).
    pub http: String,
    /// Run records, the last run number, process logs.
    pub state_dir: PathBuf,
    /// A process that does not answer a command within this time is marked inactive.
    pub reply_timeout_ms: u64,
    /// Statistics period of every process.
    pub stats_interval_ms: u64,
    /// Without `--interactive`: how long a run takes before run control stops it.
    pub seconds: f64,
    /// The shoal executable for launched processes (default: this one).
    pub binary: Option<PathBuf>,
    /// START even when some processes are inactive (never announced, did not answer, left
    /// the dispatcher). Default false: a run with a missing builder or source loses data by
    /// design, so run control refuses and says which processes are missing.
    pub start_with_missing: bool,
    /// Processes started by run control (`local`, `netns`, `ssh`, `slurm`, `k8s`) that exit without being
    /// told OFF (a crash, a kill) are started again, at most this many times each per
    /// `shoal run`; during a run they rejoin it (0: never restart).
    pub restarts: u32,
    /// Options for `ssh` before the host of every `launch = "ssh"` process, e.g.
    /// `["-i", "/etc/shoal/id_ed25519", "-o", "UserKnownHostsFile=/etc/shoal/known_hosts"]`
    /// (`-o BatchMode=yes` is always given: run control never waits for a password).
    pub ssh_options: Vec<String>,
    /// How run control measures and corrects the processes' clocks (docs/clocks.md).
    pub clock: crate::clocks::ClockSettings,
    /// Automatic recovery per diagnosis rule (docs/monitoring.md), none by default:
    /// `[{ rule = "process_hung", after_s = 10 }]` kills a process hung for 10 s so that
    /// run control starts it again and it rejoins the run (processes it launched).
    pub auto_recover: Vec<AutoRecover>,
    /// Tokens and roles for the HTTP API (docs/security.md). Without it every address in
    /// the file must be on loopback.
    pub security: Option<crate::security::SecuritySettings>,
    /// Networks (ADDRESS/PREFIX) besides this host whose ControlHost clients may publish
    /// command tags (`RC_CMD`, `ALERT`) on the dispatcher run control starts, e.g. a KM3NeT
    /// control host's; from anywhere else they are dropped and counted (docs/security.md).
    pub command_from: Vec<String>,
    /// Run with addresses off loopback that nothing authenticates (a closed network, the
    /// testbed's namespaces): said at start, on the UI and in every run record.
    pub insecure: bool,
    /// How the `launch = "slurm"` processes' job is asked for (docs/deployment.md).
    pub slurm: SlurmSettings,
    /// Where and how the `launch = "k8s"` processes' Pods are made (docs/deployment.md).
    pub k8s: K8sSettings,
}

/// One rule's automatic recovery.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AutoRecover {
    /// A diagnosis rule with an automatic action: `process_hung` (restart the process).
    pub rule: String,
    /// How long the problem must last before the action.
    pub after_s: f64,
}

/// The rules run control knows an automatic action for.
pub const RECOVERABLE_RULES: [&str; 1] = ["process_hung"];

impl Default for ClusterSettings {
    fn default() -> Self {
        Self {
            name: "shoal".into(),
            dispatcher: "127.0.0.1:5553".into(),
            start_dispatcher: true,
            dispatcher_http: "127.0.0.1:5554".into(),
            http: "127.0.0.1:8080".into(),
            state_dir: PathBuf::from("shoal-runs"),
            reply_timeout_ms: 5_000,
            stats_interval_ms: 1_000,
            seconds: 10.0,
            binary: None,
            start_with_missing: false,
            restarts: 3,
            ssh_options: Vec::new(),
            clock: Default::default(),
            auto_recover: Vec::new(),
            command_from: Vec::new(),
            security: None,
            insecure: false,
            slurm: Default::default(),
            k8s: Default::default(),
        }
    }
}

/// `[cluster.slurm]`: how run control asks Slurm for the job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SlurmSettings {
    /// The partition (`salloc --partition`); default: the cluster's default partition.
    pub partition: Option<String>,
    /// The job's name (default `shoal-<cluster.name>`); each step is named after its process.
    pub job_name: Option<String>,
    /// More options for `salloc`, e.g. `["--account=daq", "--time=12:00:00", "--exclusive"]`.
    pub salloc_args: Vec<String>,
    /// More options for every `srun`, e.g. `["--cpus-per-task=4", "--cpu-bind=cores"]`.
    pub srun_args: Vec<String>,
    /// How long to wait for the allocation (`salloc --immediate`): a run does not queue.
    pub allocate_timeout_s: u32,
    /// A Slurm configuration other than the hosts' (`SLURM_CONF` for salloc, srun, scancel).
    pub conf: Option<PathBuf>,
    /// How long `salloc` may take to exit after the job is cancelled at the end (Slurm
    /// first ends every step: `KillWait`, epilogs, a busy slurmctld).
    pub release_timeout_s: u32,
}

impl Default for SlurmSettings {
    fn default() -> Self {
        Self {
            partition: None,
            job_name: None,
            salloc_args: Vec::new(),
            srun_args: Vec::new(),
            allocate_timeout_s: 60,
            conf: None,
            release_timeout_s: 120,
        }
    }
}

/// `[cluster.k8s]`: the Pods of the `launch = "k8s"` processes (crate::k8s).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct K8sSettings {
    /// The container image with the shoal binary (deploy/Containerfile); needed by any
    /// `k8s` process.
    pub image: Option<String>,
    /// The shoal executable inside the image.
    pub binary: PathBuf,
    /// The namespace of the Pods (default: the kubeconfig context's, else `default`).
    pub namespace: Option<String>,
    /// A kubeconfig to read (default: `KUBECONFIG`, `~/.kube/config`, or the in-cluster
    /// service account when run control itself runs in a Pod).
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context (default: its current one).
    pub context: Option<String>,
    /// The Pods' service account (default: the namespace's `default`).
    pub service_account: Option<String>,
    /// `imagePullPolicy` (`Always`, `IfNotPresent`, `Never`; default: Kubernetes's).
    pub image_pull_policy: Option<String>,
    /// Environment for every process's container, e.g. `{ UCX_TLS = "rc_mlx5,self" }`.
    pub env: std::collections::BTreeMap<String, String>,
    /// `hostIPC`: the host's System V shared memory (UCX's `sysv`, shm consumers on the
    /// host).
    pub host_ipc: bool,
    /// How long run control waits for its Pods to be gone at the end.
    pub delete_timeout_s: u32,
}

impl Default for K8sSettings {
    fn default() -> Self {
        Self {
            image: None,
            binary: PathBuf::from("/usr/local/bin/shoal"),
            namespace: None,
            kubeconfig: None,
            context: None,
            service_account: None,
            image_pull_policy: None,
            env: Default::default(),
            host_ipc: false,
            delete_timeout_s: 60,
        }
    }
}

/// How a process gets started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Launch {
    /// A child process on this machine.
    #[default]
    Local,
    /// `ssh <host> <binary> node ...` (the binary path must exist on the host).
    Ssh,
    /// Started by someone else (a systemd unit, a batch system); run control only waits
    /// for it to announce itself on the dispatcher.
    External,
    /// A child process inside the network namespace named by `host`
    /// (`ip netns exec <host> <binary> node ...`), as `shoal testbed` runs every host.
    Netns,
    /// A step of the cluster's Slurm job on the Slurm node named by `host` (`srun --jobid
    /// J --nodelist <host> <binary> node ...`; crate::slurm).
    Slurm,
    /// A Pod on the Kubernetes node named by `host` (`nodeName`, `hostNetwork`,
    /// `restartPolicy: Never`; crate::k8s).
    K8s,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessSpec {
    pub name: String,
    pub role: Role,
    /// Builder: its id (one). Source: the source ids it hosts.
    #[serde(default)]
    pub ids: Vec<u32>,
    #[serde(default)]
    pub launch: Launch,
    #[serde(default = "localhost")]
    pub host: String,
    /// Prometheus `/metrics` address of the process (default: any free port on 127.0.0.1,
    /// announced in its statistics).
    #[serde(default)]
    pub metrics: Option<String>,
    /// Source process: its own `source.input` (e.g. each KM3NeT DataQueue process its
    /// `clb:` port), passed as `--input`.
    #[serde(default)]
    pub input: Option<String>,
    /// Test only: this process's clock runs this far ahead of its host's, us (negative:
    /// behind), to emulate hosts with different clocks on one machine (docs/clocks.md).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub test_clock_offset_us: f64,
    /// Test only: and runs fast by this many parts per million.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub test_clock_drift_ppm: f64,
}

impl ProcessSpec {
    /// The clock this process reads: its host's. Processes run on this machine (`local`,
    /// `netns`: namespaces share the kernel's clock) read one; a host of `ssh` or
    /// `external` processes its own; a test's emulated host clock (`test_clock_offset_us`,
    /// `test_clock_drift_ppm`) is one of its own. Run control compares the processes of
    /// one clock as one (docs/clocks.md).
    pub fn clock(&self) -> String {
        let host = match self.launch {
            Launch::Local | Launch::Netns => "this machine".to_string(),
            Launch::Ssh | Launch::External | Launch::Slurm | Launch::K8s => self.host.clone(),
        };
        if self.test_clock_offset_us != 0.0 || self.test_clock_drift_ppm != 0.0 {
            format!("{host} {:+} us {:+} ppm ({})", self.test_clock_offset_us, self.test_clock_drift_ppm, self.name)
        } else {
            host
        }
    }
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

fn localhost() -> String {
    "localhost".into()
}

impl ClusterFile {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let file: ClusterFile = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        file.validate().with_context(|| format!("checking {}", path.display()))?;
        Ok(file)
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        self.config.validate()?;
        for a in &self.cluster.auto_recover {
            if !RECOVERABLE_RULES.contains(&a.rule.as_str()) {
                bail!(
                    "cluster.auto_recover: rule {:?} has no automatic recovery (known: {})",
                    a.rule,
                    RECOVERABLE_RULES.join(", ")
                );
            }
            if !(a.after_s.is_finite() && a.after_s >= 0.0) {
                bail!("cluster.auto_recover: after_s of {:?} must be a non-negative number of seconds", a.rule);
            }
        }
        self.dispatcher_addr()?;
        self.check_security()?;
        self.check_listeners()?;
        for net in &self.cluster.command_from {
            net.parse::<shoal_core::controlhost::IpNet>().map_err(|e| anyhow::anyhow!("cluster.command_from: {e}"))?;
        }
        let mut names = std::collections::BTreeSet::new();
        let run = &self.config.run;
        let mut builders = vec![0u32; run.builders as usize];
        let mut sources = vec![0u32; run.sources as usize];
        let mut writers = 0;
        let mut managers = 0;
        for p in &self.processes {
            if !names.insert(p.name.as_str()) {
                bail!("process name {:?} is used twice", p.name);
            }
            if p.name.is_empty() || p.name.contains(char::is_whitespace) || p.name == "*" {
                bail!("process name {:?} must be one word (it is the run-control target)", p.name);
            }
            match p.role {
                Role::Writer => writers += 1,
                Role::Dfm => {
                    if !p.ids.is_empty() {
                        bail!("the data-flow manager {:?} takes no ids", p.name);
                    }
                    managers += 1;
                }
                Role::Builder => match p.ids.as_slice() {
                    [id] if *id < run.builders => builders[*id as usize] += 1,
                    _ => bail!("builder {:?} needs ids = [one id below run.builders = {}]", p.name, run.builders),
                },
                Role::Source => {
                    if let Some(input) = &p.input {
                        let mut c = self.config.clone();
                        c.source.input = input.clone();
                        c.input().with_context(|| format!("process {:?}", p.name))?;
                    }
                    if p.ids.is_empty() {
                        bail!("source process {:?} needs ids = [...] (the sources it hosts)", p.name);
                    }
                    for &id in &p.ids {
                        let Some(n) = sources.get_mut(id as usize) else {
                            bail!("source process {:?}: id {id} but run.sources = {}", p.name, run.sources);
                        };
                        *n += 1;
                    }
                }
            }
        }
        self.check_k8s()?;
        if writers != 1 {
            bail!("exactly one writer process is needed, found {writers}");
        }
        let pull = self.config.policy()?.pull().is_some();
        match (pull, managers) {
            (true, 1) | (false, 0) => {}
            (true, n) => bail!("a pull policy needs exactly one process with role = \"dfm\", found {n}"),
            (false, _) => bail!("role = \"dfm\" is only for pull policies (config.run.policy = {:?})", run.policy),
        }
        if let Some(b) = builders.iter().position(|&n| n != 1) {
            bail!("builder {b} must be played by exactly one process (found {})", builders[b]);
        }
        if let Some(s) = sources.iter().position(|&n| n != 1) {
            bail!("source {s} must be hosted by exactly one process (found {})", sources[s]);
        }
        Ok(())
    }

    /// Every address of the file on loopback, or security or `insecure` saying otherwise
    /// ([`crate::security::check_listeners`]).
    pub fn check_listeners(&self) -> anyhow::Result<()> {
        use crate::security::Listener;
        let c = &self.cluster;
        let run = &self.config.run;
        let mut listeners = vec![("cluster.dispatcher".to_string(), c.dispatcher.clone(), Listener::Dispatcher)];
        if c.start_dispatcher {
            listeners.push(("cluster.dispatcher_http".into(), c.dispatcher_http.clone(), Listener::Metrics));
        }
        for (i, a) in run.builder_addrs.iter().enumerate() {
            listeners.push((format!("config.run.builder_addrs[{i}]"), a.clone(), Listener::Data));
        }
        listeners.push(("config.run.writer_addr".into(), run.writer_addr.clone(), Listener::Data));
        for (setting, listen) in [
            ("config.builder.listen", &self.config.builder.listen),
            ("config.writer.listen", &self.config.writer.listen),
        ] {
            if let Some(a) = listen {
                listeners.push((setting.into(), a.clone(), Listener::Data));
            }
        }
        if self.config.policy()?.pull().is_some() {
            listeners.push(("config.run.dfm_addr".into(), run.dfm_addr.clone(), Listener::Data));
        }
        for p in &self.processes {
            if let Some(m) = &p.metrics {
                listeners.push((format!("process {:?} metrics", p.name), m.clone(), Listener::Metrics));
            }
        }
        crate::security::check_listeners(c.security.as_ref(), c.insecure, &c.http, &listeners)
    }

    /// `data` set in two places must agree; certificates must come from somewhere.
    fn check_security(&self) -> anyhow::Result<()> {
        let off = shoal_tls::DataSecurity::Off;
        let Some(s) = &self.cluster.security else { return Ok(()) };
        if s.data != off && self.config.security.data != off && s.data != self.config.security.data {
            bail!(
                "cluster.security.data = {:?} but config.security.data = {:?}: say it once",
                s.data.as_str(),
                self.config.security.data.as_str()
            );
        }
        if self.data_security() != off && s.ca_dir.is_none() && s.credentials_dir.is_none() {
            bail!(
                "data = {:?} needs certificates: set [cluster.security] ca_dir (`shoal ca init DIR`; run control \
                 issues each local process its own) or credentials_dir (where each host keeps its own)",
                self.data_security().as_str()
            );
        }
        if let Some(w) = &s.web_config {
            let web = shoal_tls::web::WebConfig::load(w).context("cluster.security.web_config")?;
            if web.tls.is_none() {
                bail!("cluster.security.web_config {}: no tls_server_config", w.display());
            }
            if web.requires_basic_auth() {
                bail!(
                    "cluster.security.web_config {}: run control's API takes tokens, not basic_auth_users",
                    w.display()
                );
            }
        }
        Ok(())
    }

    /// `k8s` processes need an image, and names a Pod can carry.
    fn check_k8s(&self) -> anyhow::Result<()> {
        let pods: Vec<&ProcessSpec> = self.processes.iter().filter(|p| p.launch == Launch::K8s).collect();
        if pods.is_empty() {
            return Ok(());
        }
        let k = &self.cluster.k8s;
        if k.image.as_deref().is_none_or(str::is_empty) {
            bail!("launch = \"k8s\" needs [cluster.k8s] image = \"...\" (the image with shoal: deploy/Containerfile)");
        }
        if let Some(p) = &k.image_pull_policy
            && !["Always", "IfNotPresent", "Never"].contains(&p.as_str())
        {
            bail!("cluster.k8s.image_pull_policy {p:?}: one of Always, IfNotPresent, Never");
        }
        for p in pods {
            crate::k8s_names::pod_name(&self.cluster.name, &p.name, "00000000", 0)
                .with_context(|| format!("process {:?}", p.name))?;
            if p.host.is_empty() || p.host == "localhost" {
                bail!("process {:?}: launch = \"k8s\" needs host = the Kubernetes node to run on", p.name);
            }
        }
        Ok(())
    }

    pub fn dispatcher_addr(&self) -> anyhow::Result<SocketAddr> {
        let d = &self.cluster.dispatcher;
        d.parse().with_context(|| format!("cluster.dispatcher {d:?} is not an address:port"))
    }

    /// The CONFIGURE payload of the run.
    /// `[cluster.security] data` is the run configuration's `[security] data`, and with it
    /// `[security] peers` says what each process may send as: a source process its source
    /// ids (none listed: every source), a builder its builder id. Run control writes it from
    /// the processes of this file, whatever the file's `config` says of it.
    pub fn config_text(&self) -> anyhow::Result<String> {
        let mut config = self.config.clone();
        if let Some(s) = &self.cluster.security
            && s.data != shoal_tls::DataSecurity::Off
        {
            config.security.data = s.data;
        }
        if config.security.data != shoal_tls::DataSecurity::Off {
            config.security.peers = self.peers();
            // A fresh datagram key for every CONFIGURE: it goes to the processes with it
            // (over the authenticated control plane) and is written nowhere.
            config.security.udp_key = shoal_net::transport::udp::mac::DatagramMac::new_key_hex()?;
        }
        Ok(toml::to_string(&config)?)
    }

    /// The ids each data-sending process of the cluster holds, by name (its certificate's).
    pub fn peers(&self) -> shoal_net::transport::secure::Peers {
        let all_sources = || (0..self.config.run.sources).collect();
        self.processes
            .iter()
            .filter_map(|p| match p.role {
                Role::Source if p.ids.is_empty() => Some((p.name.clone(), all_sources())),
                Role::Source | Role::Builder => Some((p.name.clone(), p.ids.clone())),
                Role::Writer | Role::Dfm => None,
            })
            .collect()
    }

    /// The data path's security as the processes get it.
    pub fn data_security(&self) -> shoal_tls::DataSecurity {
        match &self.cluster.security {
            Some(s) if s.data != shoal_tls::DataSecurity::Off => s.data,
            _ => self.config.security.data,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_cluster_files_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
        let f = ClusterFile::load(&dir.join("sector.toml")).unwrap();
        assert_eq!(f.processes.len(), 9, "sector.toml: 5 sources, 3 builders, a writer");
        let f = ClusterFile::load(&dir.join("sector-pull.toml")).unwrap();
        assert_eq!(f.processes.len(), 10, "sector-pull.toml: 5 sources, 3 builders, a manager, a writer");
        assert!(f.config.policy().unwrap().pull().is_some());
    }

    #[test]
    fn inconsistent_files_are_refused_with_a_reason() {
        let base = r#"
[cluster]
name = "t"
[[process]]
name = "w"
role = "writer"
[[process]]
name = "b0"
role = "builder"
ids = [0]
[[process]]
name = "s"
role = "source"
ids = [0]
[config.run]
sources = 1
builders = 1
"#;
        let ok: ClusterFile = toml::from_str(base).unwrap();
        ok.validate().unwrap();
        let err = |text: &str| {
            let f: ClusterFile = toml::from_str(text).unwrap();
            f.validate().unwrap_err().to_string()
        };
        assert!(err(&base.replace("sources = 1", "sources = 2")).contains("source 1"));
        assert!(
            err(&base.replace("ids = [0]\n[[process]]\nname = \"s\"", "ids = [3]\n[[process]]\nname = \"s\""))
                .contains("builder")
        );
        assert!(err(&base.replace("name = \"b0\"", "name = \"w\"")).contains("twice"));
        assert!(err(&base.replace("role = \"writer\"", "role = \"builder\"\nids = [0]")).contains("writer"));
        // A data-flow manager exactly when the policy is pull.
        let manager = "[[process]]\nname = \"m\"\nrole = \"dfm\"\n";
        let with_manager = base.replace("[config.run]\n", &format!("{manager}[config.run]\n"));
        assert!(err(&with_manager).contains("only for pull"));
        let pull = with_manager.replace("builders = 1", "builders = 1\npolicy = \"pull:4\"");
        let f: ClusterFile = toml::from_str(&pull).unwrap();
        f.validate().unwrap();
        assert!(err(&base.replace("builders = 1", "builders = 1\npolicy = \"pull:4\"")).contains("dfm"));
        assert!(err(&pull.replace("role = \"dfm\"", "role = \"dfm\"\nids = [0]")).contains("no ids"));
        // Secure by default: off loopback only with security (the UI) or said insecure.
        let open_ui = base.replace("name = \"t\"", "name = \"t\"\nhttp = \"0.0.0.0:8080\"");
        assert!(err(&open_ui).contains("[cluster.security]"), "{}", err(&open_ui));
        let tokens = open_ui
            .replace("http = \"0.0.0.0:8080\"", "http = \"0.0.0.0:8080\"\n[cluster.security]\ntokens = \"t.toml\"");
        // Tokens alone would cross the network in the clear.
        assert!(err(&tokens).contains("web_config"), "{}", err(&tokens));
        let remote_builder = base.replace("builders = 1", "builders = 1\nbuilder_addrs = [\"192.0.2.7:5601\"]");
        assert!(err(&remote_builder).contains("builder_addrs[0]"), "{}", err(&remote_builder));
        // A data port off loopback with the data path authenticated; `data` needs certificates.
        let guarded = remote_builder
            .replace("name = \"t\"", "name = \"t\"\n[cluster.security]\ndata = \"authenticated\"\nca_dir = \"ca\"");
        toml::from_str::<ClusterFile>(&guarded).unwrap().validate().unwrap();
        let no_certs = guarded.replace("ca_dir = \"ca\"", "");
        assert!(err(&no_certs).contains("needs certificates"), "{}", err(&no_certs));
        let twice = guarded.replace("[config.run]\n", "[config.security]\ndata = \"tls\"\n[config.run]\n");
        assert!(err(&twice).contains("say it once"), "{}", err(&twice));
        let trusted = remote_builder.replace("name = \"t\"", "name = \"t\"\ninsecure = true");
        let f: ClusterFile = toml::from_str(&trusted).unwrap();
        f.validate().unwrap();
    }
}
