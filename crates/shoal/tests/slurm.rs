//! `launch = "slurm"` against a real Slurm (docs/deployment.md): munge, slurmctld and
//! three slurmd (node1, node2, node3: several node names on this one host, as Slurm
//! allows) started by the test with a configuration of its own, as root. The cluster's
//! processes run as the steps of one job; a run keeps every slice with its ledger
//! balanced; a step cancelled mid-run is a process down, named by the diagnosis; `shoal
//! run` killed leaves no job and no process behind. Skipped (said) when not root or
//! without Debian's slurm-wlm and munge.

mod common;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const NODES: [&str; 3] = ["node1", "node2", "node3"];

/// munged, slurmctld and a slurmd per node, ended when dropped.
struct Slurm {
    dir: PathBuf,
    conf: PathBuf,
    daemons: Vec<Child>,
}

impl Drop for Slurm {
    fn drop(&mut self) {
        for d in self.daemons.iter_mut().rev() {
            let _ = Command::new("kill").args(["-TERM", &d.id().to_string()]).status();
        }
        for d in &mut self.daemons {
            let waiting = Instant::now();
            while d.try_wait().ok().flatten().is_none() && waiting.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = d.kill();
            let _ = d.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

impl Slurm {
    fn start() -> Option<Slurm> {
        if !is_root() {
            eprintln!("SKIPPED: the Slurm test runs munged and slurmd as root");
            return None;
        }
        let missing: Vec<&str> = ["munged", "slurmctld", "slurmd", "salloc", "srun", "scancel", "squeue", "sinfo"]
            .into_iter()
            .filter(|t| !on_path(t))
            .collect();
        if !missing.is_empty() {
            eprintln!("SKIPPED: {} missing (Debian packages slurm-wlm, munge)", missing.join(", "));
            return None;
        }
        let dir = std::env::temp_dir().join(format!("shoal-slurm-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["munge", "state", "log", "spool"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        let mut slurm = Slurm { conf: dir.join("slurm.conf"), dir, daemons: Vec::new() };
        let d = slurm.dir.clone();
        // munge: a key of the test's own, its socket in the test's directory.
        let mut key = [0u8; 128];
        std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom").unwrap(), &mut key).unwrap();
        std::fs::write(d.join("munge/munge.key"), key).unwrap();
        set_mode(&d.join("munge/munge.key"), 0o400);
        set_mode(&d.join("munge"), 0o755);
        let socket = d.join("munge/socket");
        slurm.spawn(
            Command::new("munged")
                .args(["-F", "--force"])
                .arg(format!("--key-file={}", d.join("munge/munge.key").display()))
                .arg(format!("--socket={}", socket.display()))
                .arg(format!("--pid-file={}", d.join("munge/pid").display()))
                .arg(format!("--seed-file={}", d.join("munge/seed").display()))
                .arg(format!("--log-file={}", d.join("log/munged.log").display())),
            "munged",
        );
        wait_until("munged's socket", || socket.exists());
        let ctld_port = free_port();
        let mut conf = format!(
            "ClusterName=shoaltest\nSlurmctldHost=localhost\nSlurmctldPort={ctld_port}\n\
             AuthType=auth/munge\nAuthInfo=socket={socket}\nCredType=cred/munge\n\
             SlurmUser=root\nSlurmdUser=root\nStateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool/%n\n\
             SlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd-%n.pid\n\
             SlurmctldLogFile={d}/log/slurmctld.log\nSlurmdLogFile={d}/log/slurmd-%n.log\n\
             ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSchedulerType=sched/builtin\n\
             SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nMpiDefault=none\nReturnToService=2\n\
             SlurmdTimeout=30\nInactiveLimit=0\nKillWait=2\nJobAcctGatherType=jobacct_gather/none\n\
             AccountingStorageType=accounting_storage/none\n",
            socket = socket.display(),
            d = d.display()
        );
        for n in NODES {
            std::fs::create_dir_all(d.join("spool").join(n)).unwrap();
            conf += &format!(
                "NodeName={n} NodeHostname=localhost Port={} CPUs=2 RealMemory=1000 State=UNKNOWN\n",
                free_port()
            );
        }
        conf += "PartitionName=shoal Nodes=node[1-3] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4\n";
        std::fs::write(&slurm.conf, conf).unwrap();
        let c = slurm.conf.clone();
        slurm.spawn(Command::new("slurmctld").arg("-D").arg("-f").arg(&c), "slurmctld");
        for n in NODES {
            slurm.spawn(Command::new("slurmd").args(["-D", "-N", n]).arg("-f").arg(&c), &format!("slurmd-{n}"));
        }
        wait_until("the three nodes idle", || {
            let idle = slurm.cmd("sinfo", &["-h", "-N", "-o", "%N %T"]);
            NODES.iter().all(|n| idle.lines().any(|l| l == format!("{n} idle")))
        });
        Some(slurm)
    }

    fn spawn(&mut self, cmd: &mut Command, name: &str) {
        let log = std::fs::File::create(self.dir.join("log").join(format!("{name}.out"))).unwrap();
        let child = cmd
            .env("SLURM_CONF", &self.conf)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        self.daemons.push(child);
    }

    /// A Slurm client command's output ("" when it fails: a daemon still starting).
    fn cmd(&self, program: &str, args: &[&str]) -> String {
        let out = Command::new(program).args(args).env("SLURM_CONF", &self.conf).output().unwrap();
        if out.status.success() { String::from_utf8_lossy(&out.stdout).trim().to_string() } else { String::new() }
    }

    /// The jobs named `name` (queued or running).
    fn jobs(&self, name: &str) -> String {
        self.cmd("squeue", &["-h", "-n", name, "-o", "%i %T"])
    }

    /// The job's steps as (step id, step name).
    fn steps(&self) -> Vec<(String, String)> {
        self.cmd("squeue", &["-h", "-s", "-o", "%i %j"])
            .lines()
            .filter_map(|l| l.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())))
            .collect()
    }

    /// A cluster of 3 sources, 2 builders and the writer spread over the three nodes, its
    /// processes the steps of one job.
    fn cluster(&self, name: &str, seconds: u32, restarts: u32) -> Cluster {
        let conf = self.conf.display().to_string();
        Cluster::start_placed(
            name,
            seconds,
            "direct",
            [
                &format!("restarts = {restarts}\n[cluster.slurm]\nconf = \"{conf}\"\nallocate_timeout_s = 30"),
                "",
                "wall_timeout_ms = 1500",
                "",
            ],
            &[],
            &|process| {
                let node = match process {
                    "writer" | "source0" => "node1",
                    "builder0" | "source1" => "node2",
                    _ => "node3",
                };
                format!("launch = \"slurm\"\nhost = \"{node}\"\n")
            },
        )
    }
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Polls `ok` for up to 120 s (a condition, not a time: busy machines are slow).
fn wait_until(what: &str, ok: impl Fn() -> bool) {
    let waiting = Instant::now();
    while !ok() {
        assert!(waiting.elapsed() < Duration::from_secs(120), "waited 120 s for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The three cases share one Slurm (its start takes seconds), one after the other.
#[test]
fn a_cluster_runs_as_the_steps_of_one_slurm_job() {
    let Some(slurm) = Slurm::start() else { return };

    // 1. Every process a step of the run's job, pinned to its node; every slice kept.
    let c = slurm.cluster("slurmrun", 6, 3);
    let steps = slurm.steps();
    for p in ["writer", "builder0", "builder1", "source0", "source1", "source2"] {
        assert!(steps.iter().any(|(_, name)| name == p), "{p} is a step of the job: {steps:?}");
    }
    let (record, dir) = c.finish();
    assert_accounted(&record);
    assert!(record["slices_complete"].as_u64().unwrap() > 0, "{}", record["slices_complete"]);
    assert_eq!(record["slices_incomplete"], 0, "every slice kept: {}", record["diagnosis"]);
    wait_until("the job gone after the run", || slurm.jobs("shoal-slurmrun").is_empty());
    println!("slurm: {} slices over steps {steps:?}; the job gone after the run", record["slices_complete"]);
    no_process_left(&dir);

    // 2. A step Slurm ends mid-run (scancel of source1's step): a process down, named.
    let c = slurm.cluster("slurmcancel", 6, 0);
    let step = slurm.steps().into_iter().find(|(_, name)| name == "source1").expect("source1's step").0;
    let cancel = Command::new("scancel").arg(&step).env("SLURM_CONF", &slurm.conf).output().unwrap();
    assert!(cancel.status.success(), "scancel {step}: {}", String::from_utf8_lossy(&cancel.stderr));
    let (record, dir) = c.finish();
    assert_accounted(&record);
    assert!(timeline(&record).contains(&("process_down".into(), "source1".into())), "{}", record["diagnosis"]);
    let causes = assert_causes(&record, &[("process_down", "source1")]);
    wait_until("the job gone after the run", || slurm.jobs("shoal-slurmcancel").is_empty());
    println!("slurm: step {step} (source1) cancelled mid-run: {causes:?}");
    no_process_left(&dir);

    // 3. `shoal run` killed mid-run: the allocation goes with it, and every step.
    let mut c = slurm.cluster("slurmkilled", 60, 3);
    assert!(!slurm.jobs("shoal-slurmkilled").is_empty(), "the job runs");
    c.child.kill().unwrap();
    c.child.wait().unwrap();
    wait_until("no job left once shoal run was killed", || slurm.jobs("shoal-slurmkilled").is_empty());
    let file = c.dir.join("cluster.toml");
    wait_until("no process left once shoal run was killed", || {
        Command::new("pgrep").args(["-f", file.to_str().unwrap()]).output().unwrap().stdout.is_empty()
    });
    let dir = c.dir.clone();
    drop(c);
    no_process_left(&dir);
}
