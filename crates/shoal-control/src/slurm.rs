//! `launch = "slurm"`: the cluster's processes as the steps of one Slurm job
//! (docs/deployment.md).
//!
//! Run control asks Slurm for one allocation over the hosts (Slurm node names) of the
//! `slurm` processes ([`Allocation::request`], `salloc`), then starts each process as a
//! step of that job pinned to its host ([`SlurmJob::step`]: `srun --jobid J --nodelist HOST
//! --overlap`), as CBM's flesctl runs a run as one job with a line per process. The
//! local `srun` is run control's child: it exits when its step ends, whoever ended it (a
//! crash, `scancel J.S`, the job's time limit, the node lost), so a step that Slurm ends is
//! a process down like any other, started again if `cluster.restarts` allows and named by
//! the diagnosis.
//!
//! The allocation lives no longer than run control. Its command is `cat` reading a pipe
//! whose only writer is run control: when `shoal run` exits, however it exits (SIGKILL
//! too), the pipe closes, `cat` ends, `salloc` gives the allocation back and Slurm ends
//! every step still running. At the end of a run [`Allocation::release`] cancels the job
//! at once (`scancel`) and waits for `salloc` to say it is gone.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};

use crate::cluster::{ClusterFile, Launch, ProcessSpec};

/// The tools a Slurm launch runs, looked for on `PATH` before anything is asked of Slurm.
const TOOLS: [&str; 3] = ["salloc", "srun", "scancel"];

/// The job the `slurm` processes run in: what a step needs to join it.
#[derive(Clone, Debug)]
pub struct SlurmJob {
    pub id: u64,
    srun_args: Vec<String>,
    /// `SLURM_CONF` for its commands, if not the hosts' own.
    pub conf: Option<PathBuf>,
}

/// A Slurm command, with the cluster's `SLURM_CONF` if it names one.
fn slurm_command(program: &str, conf: &Option<PathBuf>) -> Command {
    let mut cmd = Command::new(program);
    if let Some(c) = conf {
        cmd.env("SLURM_CONF", c);
    }
    cmd
}

impl SlurmJob {
    /// `srun` and its arguments that run `binary args` as a step of the job on `spec`'s host.
    pub fn step(&self, spec: &ProcessSpec, binary: &Path, args: &[String]) -> (PathBuf, Vec<String>) {
        let mut a: Vec<String> = [
            format!("--jobid={}", self.id),
            format!("--nodelist={}", spec.host),
            "--nodes=1".into(),
            "--ntasks=1".into(),
            // Steps share the allocation's CPUs: a host may run a builder and a source.
            "--overlap".into(),
            format!("--job-name={}", spec.name),
            "--input=none".into(),
        ]
        .into();
        a.extend(self.srun_args.iter().cloned());
        a.push(binary.display().to_string());
        a.extend(args.iter().cloned());
        (PathBuf::from("srun"), a)
    }
}

/// The job's allocation, held by run control (see the module documentation).
pub struct Allocation {
    pub job: SlurmJob,
    salloc: Child,
    /// `cat`'s input: closing it ends the allocation.
    hold: Option<ChildStdin>,
    /// How long `salloc` may take to go after the end's `scancel` (`release_timeout_s`).
    grace: Duration,
}

/// The hosts of the `slurm` processes, in the file's order, each once.
pub fn hosts(file: &ClusterFile) -> Vec<String> {
    let mut hosts: Vec<String> = Vec::new();
    for p in file.processes.iter().filter(|p| p.launch == Launch::Slurm) {
        if !hosts.contains(&p.host) {
            hosts.push(p.host.clone());
        }
    }
    hosts
}

/// The job id in a line of `salloc`'s ("salloc: Granted job allocation 42").
fn granted(line: &str) -> Option<u64> {
    line.split_once("Granted job allocation ")?.1.trim().parse().ok()
}

impl Allocation {
    /// Asks Slurm for one allocation over the hosts of the file's `slurm` processes (none:
    /// no such process). `salloc`'s messages go to `logs/slurm.log`.
    pub async fn request(file: &ClusterFile, logs: &Path) -> anyhow::Result<Option<Allocation>> {
        let hosts = hosts(file);
        if hosts.is_empty() {
            return Ok(None);
        }
        let missing: Vec<&str> = TOOLS.iter().copied().filter(|t| !crate::on_path(t)).collect();
        if !missing.is_empty() {
            bail!(
                "launch = \"slurm\" needs Slurm's client commands on PATH ({} missing; Debian package slurm-client)",
                missing.join(", ")
            );
        }
        let s = file.cluster.slurm.clone();
        let name = s.job_name.clone().unwrap_or_else(|| format!("shoal-{}", file.cluster.name));
        let mut cmd = slurm_command("salloc", &s.conf);
        cmd.arg(format!("--job-name={name}"))
            .arg(format!("--nodes={}", hosts.len()))
            .arg(format!("--nodelist={}", hosts.join(",")))
            .arg(format!("--immediate={}", s.allocate_timeout_s.max(1)));
        if let Some(p) = &s.partition {
            cmd.arg(format!("--partition={p}"));
        }
        cmd.args(&s.salloc_args).arg("cat");
        // Not killed on drop: a killed salloc would leave the job; closing `hold` ends it.
        cmd.stdin(Stdio::piped()).stdout(Stdio::null()).stderr(Stdio::piped()).process_group(0);
        let mut salloc = cmd.spawn().context("starting salloc")?;
        let hold = salloc.stdin.take();
        let mut lines = BufReader::new(salloc.stderr.take().expect("piped")).lines();
        let mut said = Vec::new();
        let wait = Duration::from_secs(u64::from(s.allocate_timeout_s) + 10);
        let id = tokio::time::timeout(wait, async {
            while let Some(line) = lines.next_line().await? {
                if let Some(id) = granted(&line) {
                    said.push(line);
                    return Ok(Some(id));
                }
                said.push(line);
            }
            Ok::<_, std::io::Error>(None)
        })
        .await;
        let id = match id {
            Ok(Ok(Some(id))) => id,
            Ok(Ok(None)) | Ok(Err(_)) => {
                let status = salloc.wait().await.ok();
                bail!(
                    "Slurm gave no allocation over {} (salloc {}): {}",
                    hosts.join(","),
                    status.map_or("failed".into(), |s| s.to_string()),
                    said.join(" / ")
                );
            }
            Err(_) => {
                drop(hold);
                let _ = salloc.start_kill();
                bail!("Slurm gave no allocation over {} within {wait:?}: {}", hosts.join(","), said.join(" / "));
            }
        };
        // The rest of what salloc says (the allocation revoked, relinquished) to its log.
        let log_path = logs.join("slurm.log");
        let mut log =
            tokio::fs::File::create(&log_path).await.with_context(|| format!("creating {}", log_path.display()))?;
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            for line in said {
                let _ = log.write_all(format!("{line}\n").as_bytes()).await;
            }
            while let Ok(Some(line)) = lines.next_line().await {
                let _ = log.write_all(format!("{line}\n").as_bytes()).await;
            }
        });
        tracing::info!(job = id, hosts = %hosts.join(","), "Slurm allocation granted");
        let grace = Duration::from_secs(s.release_timeout_s.into());
        Ok(Some(Allocation { job: SlurmJob { id, srun_args: s.srun_args, conf: s.conf }, salloc, hold, grace }))
    }

    /// Ends the job (`scancel`: every step still running is ended by Slurm) and waits up to
    /// `[cluster.slurm] release_timeout_s` for `salloc` to exit. An error only when Slurm
    /// refused the cancel: once it took it, the job ends whatever `salloc` does, so a
    /// `salloc` still there after that time is a warning (and killed), not a failed run.
    pub async fn release(mut self) -> anyhow::Result<()> {
        let grace = self.grace;
        let cancel = slurm_command("scancel", &self.job.conf)
            .arg(self.job.id.to_string())
            .output()
            .await
            .context("running scancel")?;
        self.hold.take();
        if !cancel.status.success() {
            let _ = self.salloc.start_kill();
            bail!("scancel {} failed: {}", self.job.id, String::from_utf8_lossy(&cancel.stderr).trim());
        }
        let started = tokio::time::Instant::now();
        match tokio::time::timeout(grace, self.salloc.wait()).await {
            Ok(_) => tracing::info!(job = self.job.id, after = ?started.elapsed(), "Slurm job ended"),
            Err(_) => {
                tracing::warn!(
                    job = self.job.id,
                    "salloc still there {grace:?} after scancel was accepted; killing it (Slurm ends the job)"
                );
                let _ = self.salloc.start_kill();
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_job_id_is_read_from_what_salloc_says() {
        assert_eq!(granted("salloc: Granted job allocation 42"), Some(42));
        assert_eq!(granted("salloc: Pending job allocation 42"), None);
        assert_eq!(granted("salloc: job 42 queued and waiting for resources"), None);
    }

    #[test]
    fn a_step_is_pinned_to_its_host_and_named_after_its_process() {
        let spec: ProcessSpec =
            toml::from_str("name = \"builder0\"\nrole = \"builder\"\nids = [0]\nlaunch = \"slurm\"\nhost = \"node2\"")
                .unwrap();
        let job = SlurmJob { id: 7, srun_args: vec!["--cpus-per-task=2".into()], conf: None };
        let (program, args) = job.step(&spec, Path::new("/opt/shoal"), &["node".into(), "--role".into()]);
        assert_eq!(program, PathBuf::from("srun"));
        for want in ["--jobid=7", "--nodelist=node2", "--job-name=builder0", "--overlap", "--cpus-per-task=2"] {
            assert!(args.iter().any(|a| a == want), "{want} in {args:?}");
        }
        assert_eq!(&args[args.len() - 3..], ["/opt/shoal", "node", "--role"]);
    }
}
