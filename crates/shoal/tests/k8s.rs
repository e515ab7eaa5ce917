//! `launch = "k8s"` against a real Kubernetes control plane (docs/deployment.md): etcd and
//! kube-apiserver with RBAC (a token bound to a Role over the namespace `daq`, one bound
//! to nothing), and kwok playing a kubelet per node (node1, node2, node3: their status and
//! the Pods' phases). No kubelet can run on this machine, so the test stands in for the
//! one thing kwok does not do: it runs each Pod's command on this host once kwok has the
//! Pod Running, kills it when the Pod is deleted, and reports its exit as the Pod's phase.
//!
//! Checked: a token without the Role is refused before anything is made, the API's 403
//! in what `shoal run` says; with the Role, every process is a Pod pinned to its node on
//! the host network, labelled and owned by the run's ConfigMap, the run takes data; an
//! evicted Pod is a process down and a new Pod that rejoins the run; a node lost (its
//! kwok stopped, Ready=Unknown as the node controller sets it) is its process down, named
//! by the diagnosis; the run's end leaves no Pod and no ConfigMap.
//!
//! The tools come from scripts/k8s_tools.sh (`SHOAL_K8S_BIN`, which `make test` sets) and
//! Debian's etcd-server; without them the test says so and skips, unless
//! `SHOAL_REQUIRE_K8S=1`.

mod common;

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};

const NS: &str = "daq";
const NODES: [&str; 3] = ["node1", "node2", "node3"];

/// Where the writer, builders and sources run.
fn node_of(process: &str) -> &'static str {
    match process {
        "writer" | "source0" => "node1",
        "builder0" | "builder1" | "source1" => "node2",
        _ => "node3",
    }
}

fn tools() -> Option<PathBuf> {
    let bin = std::env::var_os("SHOAL_K8S_BIN").map(PathBuf::from).unwrap_or_else(|| {
        let cache = std::env::var_os("SHOAL_K8S_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/shoal-k8s"));
        cache.join("bin-v1.34.0-kwok-v0.7.0")
    });
    let etcd = std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("etcd").is_file()));
    let have = bin.join("kube-apiserver").is_file() && bin.join("kwok").is_file() && etcd;
    let required = std::env::var_os("SHOAL_REQUIRE_K8S").is_some_and(|v| v == "1");
    match (have, required) {
        (true, _) => Some(bin),
        (false, true) => panic!("SHOAL_REQUIRE_K8S=1 but kube-apiserver/kwok in {} or etcd missing", bin.display()),
        (false, false) => {
            eprintln!(
                "SKIPPED: kube-apiserver and kwok (scripts/k8s_tools.sh) in {} and etcd (Debian etcd-server) needed",
                bin.display()
            );
            None
        }
    }
}

/// etcd, kube-apiserver and a kwok per node, ended when dropped.
struct ControlPlane {
    dir: PathBuf,
    bin: PathBuf,
    server: String,
    daemons: Vec<(String, Child)>,
    rt: tokio::runtime::Runtime,
    admin: kube::Client,
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        for (_, d) in self.daemons.iter_mut().rev() {
            let _ = d.kill();
            let _ = d.wait();
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Polls `ok` for up to 120 s (a condition, not a time: busy machines are slow).
fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let waiting = Instant::now();
    while !ok() {
        assert!(waiting.elapsed() < Duration::from_secs(120), "waited 120 s for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn json<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).unwrap()
}

impl ControlPlane {
    fn start(bin: PathBuf) -> ControlPlane {
        let dir = std::env::temp_dir().join(format!("shoal-k8s-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["etcd", "certs", "log"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        // Tokens: the cluster's admin (the test), the DAQ's run control, a stranger.
        std::fs::write(
            dir.join("tokens.csv"),
            "admin-token,admin,1,system:masters\ndaq-token,daq,2,\nstranger-token,stranger,3,\n",
        )
        .unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        std::fs::write(dir.join("sa.key"), key.serialize_pem()).unwrap();
        std::fs::write(dir.join("sa.pub"), key.public_key_pem()).unwrap();
        let (client, peer, secure) = (free_port(), free_port(), free_port());
        let mut daemons = Vec::new();
        let etcd_url = format!("http://127.0.0.1:{client}");
        daemons.push(spawn(
            &dir,
            "etcd",
            Command::new("etcd")
                .arg("--data-dir")
                .arg(dir.join("etcd"))
                .args(["--listen-client-urls", &etcd_url, "--advertise-client-urls", &etcd_url])
                .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
                .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{peer}")])
                .args(["--initial-cluster", &format!("default=http://127.0.0.1:{peer}")]),
        ));
        let sa = dir.join("sa.key");
        daemons.push(spawn(
            &dir,
            "kube-apiserver",
            Command::new(bin.join("kube-apiserver"))
                .args(["--etcd-servers", &etcd_url, "--bind-address", "127.0.0.1"])
                .args(["--secure-port", &secure.to_string()])
                .arg("--cert-dir")
                .arg(dir.join("certs"))
                .arg("--token-auth-file")
                .arg(dir.join("tokens.csv"))
                .args(["--authorization-mode", "RBAC"])
                .arg("--service-account-key-file")
                .arg(dir.join("sa.pub"))
                .arg("--service-account-signing-key-file")
                .arg(&sa)
                .args(["--service-account-issuer", "https://kubernetes.default.svc"])
                .args(["--service-cluster-ip-range", "10.96.0.0/24"]),
        ));
        let server = format!("https://127.0.0.1:{secure}");
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        // The serving certificate appears once the server starts.
        let cert = dir.join("certs/apiserver.crt");
        wait_until("kube-apiserver's certificate", || cert.is_file() && std::fs::metadata(&cert).unwrap().len() > 0);
        let admin_config = write_kubeconfig(&dir, "admin", &server, "admin-token");
        let admin = rt.block_on(client_from(&admin_config));
        let mut plane = ControlPlane { dir, bin, server, daemons, rt, admin };
        wait_until("kube-apiserver ready", || {
            plane.alive();
            let nss: Api<Namespace> = Api::all(plane.admin.clone());
            plane.rt.block_on(nss.list(&ListParams::default())).is_ok()
        });
        plane.objects();
        for n in NODES {
            let kubeconfig = plane.dir.join("admin.kubeconfig");
            let child = spawn(
                &plane.dir,
                &format!("kwok-{n}"),
                Command::new(plane.bin.join("kwok"))
                    .arg("--kubeconfig")
                    .arg(&kubeconfig)
                    .args(["--manage-all-nodes=false", &format!("--manage-single-node={n}")])
                    .args(["--server-address", &format!("127.0.0.1:{}", free_port())]),
            );
            plane.daemons.push(child);
        }
        wait_until("kwok's nodes Ready", || {
            plane.alive();
            let nodes: Api<Node> = Api::all(plane.admin.clone());
            let list = plane.rt.block_on(nodes.list(&ListParams::default())).unwrap();
            list.items.len() == 3 && list.items.iter().all(node_ready)
        });
        plane
    }

    /// The namespace and its default service account, the nodes, and RBAC: `daq` may do
    /// what run control does in `daq` (a Role) and read the nodes (a ClusterRole); nobody
    /// grants `stranger` anything.
    fn objects(&mut self) {
        let c = self.admin.clone();
        let pp = PostParams::default();
        self.rt.block_on(async {
            let nss: Api<Namespace> = Api::all(c.clone());
            nss.create(&pp, &json(serde_json::json!({"metadata": {"name": NS}}))).await.unwrap();
            let sas: Api<ServiceAccount> = Api::namespaced(c.clone(), NS);
            sas.create(&pp, &json(serde_json::json!({"metadata": {"name": "default"}}))).await.unwrap();
            let nodes: Api<Node> = Api::all(c.clone());
            for n in NODES {
                let node = serde_json::json!({"metadata": {"name": n, "annotations": {"kwok.x-k8s.io/node": "fake"},
                    "labels": {"kubernetes.io/hostname": n, "type": "kwok"}}});
                nodes.create(&pp, &json(node)).await.unwrap();
            }
            let roles: Api<Role> = Api::namespaced(c.clone(), NS);
            let verbs = ["get", "list", "watch", "create", "delete", "deletecollection"];
            roles
                .create(
                    &pp,
                    &json(serde_json::json!({"metadata": {"name": "shoal-run-control"}, "rules": [
                        {"apiGroups": [""], "resources": ["pods", "configmaps"], "verbs": verbs},
                        {"apiGroups": [""], "resources": ["events"], "verbs": ["get", "list", "watch"]}]})),
                )
                .await
                .unwrap();
            let bindings: Api<RoleBinding> = Api::namespaced(c.clone(), NS);
            bindings
                .create(
                    &pp,
                    &json(serde_json::json!({"metadata": {"name": "shoal-run-control"},
                        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "shoal-run-control"},
                        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "daq"}]})),
                )
                .await
                .unwrap();
            let cr: Api<ClusterRole> = Api::all(c.clone());
            cr.create(
                &pp,
                &json(serde_json::json!({"metadata": {"name": "shoal-nodes"}, "rules": [
                    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]})),
            )
            .await
            .unwrap();
            let crb: Api<ClusterRoleBinding> = Api::all(c.clone());
            crb.create(
                &pp,
                &json(serde_json::json!({"metadata": {"name": "shoal-nodes"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "shoal-nodes"},
                    "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "daq"}]})),
            )
            .await
            .unwrap();
        });
    }

    /// Every daemon still running (else its log says why).
    fn alive(&mut self) {
        for (name, d) in &mut self.daemons {
            if let Some(st) = d.try_wait().unwrap() {
                let log = std::fs::read_to_string(self.dir.join("log").join(format!("{name}.log"))).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(5).collect();
                panic!("{name} exited {st}: {}", tail.join(" / "));
            }
        }
    }

    fn pods(&self) -> Vec<Pod> {
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), NS);
        self.rt.block_on(pods.list(&ListParams::default())).unwrap().items
    }

    fn config_maps(&self) -> Vec<ConfigMap> {
        let maps: Api<ConfigMap> = Api::namespaced(self.admin.clone(), NS);
        self.rt.block_on(maps.list(&ListParams::default().labels("app.kubernetes.io/name=shoal"))).unwrap().items
    }

    /// The node's kubelet gone: its kwok stopped, and Ready=Unknown as the node
    /// controller sets it once the kubelet stops posting.
    fn lose_node(&mut self, node: &str) {
        let i = self.daemons.iter().position(|(n, _)| *n == format!("kwok-{node}")).unwrap();
        let (_, mut kwok) = self.daemons.remove(i);
        kwok.kill().unwrap();
        kwok.wait().unwrap();
        let nodes: Api<Node> = Api::all(self.admin.clone());
        let patch = serde_json::json!({"status": {"conditions": [{"type": "Ready", "status": "Unknown",
            "reason": "NodeStatusUnknown", "message": "Kubelet stopped posting node status.",
            "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
        self.rt.block_on(nodes.patch_status(node, &PatchParams::default(), &Patch::Strategic(patch))).unwrap();
    }
}

fn node_ready(n: &Node) -> bool {
    n.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn spawn(dir: &Path, name: &str, cmd: &mut Command) -> (String, Child) {
    let log = std::fs::File::create(dir.join("log").join(format!("{name}.log"))).unwrap();
    let child = cmd
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"));
    (name.to_string(), child)
}

/// A kubeconfig for `user` with `token`, trusting the API server's own certificate.
fn write_kubeconfig(dir: &Path, user: &str, server: &str, token: &str) -> PathBuf {
    let path = dir.join(format!("{user}.kubeconfig"));
    let ca = dir.join("certs/apiserver.crt");
    // JSON is YAML: no YAML writer needed.
    let config = serde_json::json!({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority": ca}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": user, "namespace": NS}}]
    });
    std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
    path
}

async fn client_from(path: &Path) -> kube::Client {
    let kc = kube::config::Kubeconfig::read_from(path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await.unwrap();
    kube::Client::try_from(config).unwrap()
}

/// What a kubelet would do that kwok does not: run the command of every Pod kwok has
/// made Running on a node still alive, kill it when the Pod goes (or its node is lost),
/// and report its exit as the Pod's phase; evict a process's Pod when told (kill it, then
/// `Failed`, `Evicted`, as a kubelet short of memory does).
struct StandInKubelet {
    stop: Arc<AtomicBool>,
    lost: Arc<Mutex<Vec<String>>>,
    evict: Arc<Mutex<Vec<String>>>,
    /// The pid of each process it runs, by node.
    pids: Arc<Mutex<BTreeMap<String, (String, u32)>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StandInKubelet {
    fn start(client: kube::Client, dir: PathBuf) -> StandInKubelet {
        let stop = Arc::new(AtomicBool::new(false));
        let lost: Arc<Mutex<Vec<String>>> = Arc::default();
        let evict: Arc<Mutex<Vec<String>>> = Arc::default();
        let pids: Arc<Mutex<BTreeMap<String, (String, u32)>>> = Arc::default();
        let (s, l, ev, pp) = (stop.clone(), lost.clone(), evict.clone(), pids.clone());
        std::fs::create_dir_all(&dir).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let thread = std::thread::spawn(move || {
            let pods: Api<Pod> = Api::namespaced(client, NS);
            let mut running: BTreeMap<String, (String, String, Child)> = BTreeMap::new();
            let mut reported = std::collections::BTreeSet::new();
            while !s.load(Ordering::SeqCst) {
                let Ok(list) = rt.block_on(pods.list(&ListParams::default())) else {
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                };
                let lost_nodes = l.lock().unwrap().clone();
                let mut present = std::collections::BTreeSet::new();
                for pod in &list.items {
                    let name = pod.metadata.name.clone().unwrap_or_default();
                    let spec = pod.spec.as_ref().unwrap();
                    let node = spec.node_name.clone().unwrap_or_default();
                    let phase = pod.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default();
                    if pod.metadata.deletion_timestamp.is_some() || lost_nodes.contains(&node) {
                        continue;
                    }
                    present.insert(name.clone());
                    if phase == "Running" && !running.contains_key(&name) && !reported.contains(&name) {
                        let c = &spec.containers[0];
                        let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
                        let mut cmd = Command::new(&c.command.as_ref().unwrap()[0]);
                        cmd.args(c.args.clone().unwrap_or_default());
                        for e in c.env.clone().unwrap_or_default() {
                            cmd.env(e.name, e.value.unwrap_or_default());
                        }
                        let child = cmd
                            .stdin(Stdio::null())
                            .stdout(log.try_clone().unwrap())
                            .stderr(log)
                            .process_group(0)
                            .spawn()
                            .unwrap();
                        let process = pod.metadata.labels.as_ref().unwrap()["shoal.io/process"].clone();
                        running.insert(name.clone(), (node, process, child));
                    }
                }
                // Deleted Pods and lost nodes: their processes end with them.
                let gone: Vec<String> = running
                    .iter()
                    .filter(|(name, (node, _, _))| !present.contains(*name) || lost_nodes.contains(node))
                    .map(|(name, _)| name.clone())
                    .collect();
                for name in gone {
                    let (_, _, mut child) = running.remove(&name).unwrap();
                    let _ = child.kill();
                    let _ = child.wait();
                }
                let evicted: Vec<String> = {
                    let mut e = ev.lock().unwrap();
                    let names = running.iter().filter(|(_, (_, p, _))| e.contains(p)).map(|(n, _)| n.clone()).collect();
                    e.retain(|p| !running.values().any(|(_, q, _)| q == p));
                    names
                };
                for name in evicted {
                    let (_, _, mut child) = running.remove(&name).unwrap();
                    let _ = child.kill();
                    let _ = child.wait();
                    reported.insert(name.clone());
                    let patch = serde_json::json!({"status": {"phase": "Failed", "reason": "Evicted",
                        "message": "The node was low on resource: memory."}});
                    rt.block_on(pods.patch_status(&name, &PatchParams::default(), &Patch::Merge(patch))).unwrap();
                }
                // Exits, reported as the kubelet does: the phase and the container's end.
                let exited: Vec<(String, i32)> = running
                    .iter_mut()
                    .filter_map(|(name, (_, _, child))| {
                        child.try_wait().unwrap().map(|st| (name.clone(), st.code().unwrap_or(128 + 9)))
                    })
                    .collect();
                for (name, code) in exited {
                    running.remove(&name);
                    reported.insert(name.clone());
                    let patch = serde_json::json!({"status": {
                        "phase": if code == 0 { "Succeeded" } else { "Failed" },
                        "containerStatuses": [{"name": "shoal", "image": "shoal", "imageID": "", "ready": false,
                            "restartCount": 0, "state": {"terminated": {"exitCode": code,
                            "reason": if code == 0 { "Completed" } else { "Error" }}}}]}});
                    let _ = rt.block_on(pods.patch_status(&name, &PatchParams::default(), &Patch::Merge(patch)));
                }
                *pp.lock().unwrap() =
                    running.iter().map(|(name, (node, _, child))| (name.clone(), (node.clone(), child.id()))).collect();
                std::thread::sleep(Duration::from_millis(100));
            }
            for (_, (_, _, mut child)) in running {
                let _ = child.kill();
                let _ = child.wait();
            }
        });
        StandInKubelet { stop, lost, evict, pids, thread: Some(thread) }
    }

    /// The processes on `node` stopped (SIGSTOP): a node cut off sends nothing, and its
    /// connections stay open until someone gives up on them.
    fn freeze(&self, node: &str) {
        let pids: Vec<u32> = self.pids.lock().unwrap().values().filter(|(n, _)| n == node).map(|(_, p)| *p).collect();
        assert!(!pids.is_empty(), "processes on {node}");
        for pid in pids {
            assert!(Command::new("kill").args(["-STOP", &pid.to_string()]).status().unwrap().success());
        }
    }

    /// `node`'s processes killed, and nothing started there again.
    fn lose(&self, node: &str) {
        self.lost.lock().unwrap().push(node.to_string());
    }

    fn evict(&self, process: &str) {
        self.evict.lock().unwrap().push(process.to_string());
    }
}

impl Drop for StandInKubelet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The cluster file: 3 sources, 2 builders and the writer as Pods over the three nodes.
fn cluster_file(dir: &Path, name: &str, kubeconfig: &Path, restarts: u32) -> PathBuf {
    let dispatcher = format!("127.0.0.1:{}", free_port());
    let binary = env!("CARGO_BIN_EXE_shoal");
    let place = |p: &str| format!("launch = \"k8s\"\nhost = \"{}\"\n", node_of(p));
    let mut text = format!(
        "[cluster]\nname = \"{name}\"\ndispatcher = \"{dispatcher}\"\ndispatcher_http = \"off\"\nstate_dir = \"{}\"\n\
         reply_timeout_ms = 30000\nstats_interval_ms = 500\nrestarts = {restarts}\n\n\
         [cluster.k8s]\nimage = \"shoal:test\"\nbinary = \"{binary}\"\nkubeconfig = \"{}\"\n\
         env = {{ SHOAL_TEST_POD = \"1\" }}\n\n\
         [[process]]\nname = \"writer\"\nrole = \"writer\"\n{}",
        dir.join("state").display(),
        kubeconfig.display(),
        place("writer")
    );
    for b in 0..2 {
        text += &format!(
            "[[process]]\nname = \"builder{b}\"\nrole = \"builder\"\nids = [{b}]\n{}",
            place(&format!("builder{b}"))
        );
    }
    for s in 0..3 {
        text += &format!(
            "[[process]]\nname = \"source{s}\"\nrole = \"source\"\nids = [{s}]\n{}",
            place(&format!("source{s}"))
        );
    }
    text += &format!(
        "[config.run]\nsources = 3\nbuilders = 2\nslice_ms = 100\npolicy = \"direct\"\n\
         builder_addrs = [\"127.0.0.1:{}\", \"127.0.0.1:{}\"]\nwriter_addr = \"127.0.0.1:{}\"\n\
         [config.source]\ndrain_timeout_ms = 2000\nreconnect_max_ms = 500\n[config.source.noise]\nrate_hz = 20000.0\n\
         [config.builder]\ndrain_timeout_ms = 4000\nwall_timeout_ms = 1500\n[config.writer]\nout_dir = \"{}\"\n",
        free_port(),
        free_port(),
        free_port(),
        dir.join("data").display()
    );
    let file = dir.join("cluster.toml");
    std::fs::write(&file, text).unwrap();
    file
}

/// `shoal run` of `file` for `seconds` (long: the test ends it with Ctrl-C's SIGINT).
fn shoal_run(dir: &Path, file: &Path, seconds: u32) -> Cluster {
    let mut child = shoal()
        .args(["run", file.to_str().unwrap(), "--seconds", &seconds.to_string(), "--http", "127.0.0.1:0"])
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join("run-control.log")).unwrap())
        .process_group(0)
        .spawn()
        .unwrap();
    let rx = ui_address(&mut child);
    let ui = rx.recv_timeout(Duration::from_secs(180)).unwrap_or_else(|_| {
        panic!("shoal run printed no UI address: {}", std::fs::read_to_string(dir.join("run-control.log")).unwrap())
    });
    Cluster { child, dir: dir.to_path_buf(), ui, dispatcher: String::new(), external: Vec::new() }
}

#[test]
fn a_cluster_runs_as_pods_pinned_to_their_nodes() {
    let Some(bin) = tools() else { return };
    let mut plane = ControlPlane::start(bin);
    let work = plane.dir.join("work");

    // 1. A token without the Role: refused before anything is made, the 403 said.
    let stranger = write_kubeconfig(&plane.dir, "stranger", &plane.server, "stranger-token");
    let dir = work.join("refused");
    std::fs::create_dir_all(&dir).unwrap();
    let file = cluster_file(&dir, "refused", &stranger, 0);
    let out = shoal().args(["run", file.to_str().unwrap(), "--seconds", "1", "--http", "off"]).output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "shoal run with a stranger's token: {said}");
    assert!(said.contains("403") && said.contains("Forbidden") && said.contains("stranger"), "{said}");
    assert!(plane.pods().is_empty() && plane.config_maps().is_empty(), "nothing made for the stranger");
    println!("k8s: refused: {}", said.lines().find(|l| l.contains("403")).unwrap_or_default());

    // 2. With the Role: a Pod per process, the run takes data; node3 lost mid-run is
    //    source2 down; the end leaves nothing.
    let daq = write_kubeconfig(&plane.dir, "daq", &plane.server, "daq-token");
    let kubelet = StandInKubelet::start(plane.admin.clone(), work.join("pods"));
    let dir = work.join("run");
    std::fs::create_dir_all(&dir).unwrap();
    let file = cluster_file(&dir, "sector", &daq, 1);
    let c = shoal_run(&dir, &file, 600);
    c.wait_for("the cluster RUNNING", |s| s["state"] == "RUNNING");
    let pods = plane.pods();
    assert_eq!(pods.len(), 6, "a Pod per process");
    let maps = plane.config_maps();
    assert_eq!(maps.len(), 1, "one ConfigMap for the run");
    let owner_uid = maps[0].metadata.uid.clone().unwrap();
    for pod in &pods {
        let labels = pod.metadata.labels.clone().unwrap();
        let process = &labels["shoal.io/process"];
        assert_eq!(labels["shoal.io/cluster"], "sector");
        assert_eq!(labels["shoal.io/run"], maps[0].metadata.labels.as_ref().unwrap()["shoal.io/run"]);
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some(node_of(process)), "{process} pinned to its node");
        assert_eq!(spec.host_network, Some(true));
        assert_eq!(spec.dns_policy.as_deref(), Some("ClusterFirstWithHostNet"));
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert_eq!(spec.containers[0].image.as_deref(), Some("shoal:test"));
        let args = spec.containers[0].args.clone().unwrap();
        assert!(args.windows(2).any(|w| w[0] == "--name" && w[1] == *process), "{args:?}");
        let owners = pod.metadata.owner_references.clone().unwrap();
        assert_eq!((owners[0].kind.as_str(), owners[0].uid.as_str()), ("ConfigMap", owner_uid.as_str()));
        assert_eq!(pod.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Running"), "kwok ran {process}");
    }
    c.wait_for("slices built", |s| {
        Cluster::process(s, "builder0")["stats"]["slices_complete"].as_u64().is_some_and(|n| n > 10)
    });
    // source1's Pod evicted: process down, and (restarts = 1) a new Pod that rejoins.
    kubelet.evict("source1");
    wait_until("source1's second Pod Running", || {
        plane.pods().iter().any(|p| {
            p.metadata.name.as_deref().is_some_and(|n| n.contains("-source1-") && n.ends_with("-r1"))
                && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        })
    });
    let s = c.wait_for("source1 back in the run", |s| {
        let p = Cluster::process(s, "source1");
        p["active"] == true && p["state"] == "RUNNING"
    });
    // It left the dispatcher first (the kubelet kills, then reports); the restart says why.
    assert!(s["log"].to_string().contains("Evicted: The node was low on resource"), "{}", s["log"]);
    // node3 cut off and its kubelet gone: source2 down by the node's Ready condition (its
    // connection to the dispatcher is still open), then its process gone; its new Pod
    // waits for a node that does not come back.
    kubelet.freeze("node3");
    plane.lose_node("node3");
    let s = c.wait_for("source2 down with node3", |s| Cluster::process(s, "source2")["active"] == false);
    let why = Cluster::process(&s, "source2")["inactive_reason"].to_string();
    assert!(why.contains("node3 NotReady"), "{why}");
    kubelet.lose("node3");
    assert!(Command::new("kill").args(["-INT", &c.child.id().to_string()]).status().unwrap().success());
    let (record, dir) = c.finish();
    assert_accounted(&record);
    assert!(record["slices_complete"].as_u64().unwrap() > 0);
    assert!(timeline(&record).contains(&("process_down".into(), "source2".into())), "{}", record["diagnosis"]);
    assert!(timeline(&record).contains(&("process_down".into(), "source1".into())), "{}", record["diagnosis"]);
    // Every lost slice is put on the two (source2, seen down at once, may have cost none).
    let causes = assert_causes_allowing(&record, &[], &[("process_down", "source1"), ("process_down", "source2")]);
    wait_until("no Pod and no ConfigMap after the run", || plane.pods().is_empty() && plane.config_maps().is_empty());
    drop(kubelet);
    no_process_left(&dir);
    println!(
        "k8s: {} slices; source1 evicted and back; node3 lost: {why}; causes {causes:?}; nothing left",
        record["slices_complete"]
    );
}
