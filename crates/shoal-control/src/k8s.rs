//! `launch = "k8s"`: the cluster's processes as Pods of a Kubernetes cluster
//! (docs/deployment.md).
//!
//! Run control opens a [`Session`] with the API server (a kubeconfig, or the in-cluster
//! service account), makes one ConfigMap for this `shoal run` (the cluster file, and the
//! owner of every Pod it makes: deleting it lets Kubernetes's garbage collector remove
//! them), and then one Pod per process ([`pod_for`]), as DUNE's drunc and ALICE's bridge
//! do: pinned to its node (`nodeName`: no scheduler decides where a builder runs),
//! `hostNetwork` (the data ports are the host's, as in every other launch kind),
//! `dnsPolicy: ClusterFirstWithHostNet` and `restartPolicy: Never` (run control, not the
//! kubelet, decides about restarts: a restarted process must rejoin the run, and
//! `cluster.restarts` counts it). Labels name the cluster, this `shoal run` and the
//! process.
//!
//! The session watches its Pods, its Pods' events and the nodes. A Pod that fails (its
//! container exited non-zero, evicted), that someone else deletes, or whose node stops
//! being Ready is a process down ([`PodHandle::wait`]), like a local child that exits; a
//! Pod that succeeds is a clean exit (after OFF). Warnings among the Pods' events (an image
//! that cannot be pulled, a volume that cannot be mounted) are noted on the UI and in
//! `logs/k8s.log`. At the end, [`Session::end`] deletes the Pods and the ConfigMap and
//! waits until they are gone.
//!
//! A `shoal run` killed outright cannot delete anything: its Pods stay until the next
//! `shoal run` of the same cluster name in the namespace, which deletes every Pod and
//! ConfigMap a previous one left (or `kubectl delete configmap -l shoal.io/cluster=NAME`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, EnvVar, Event as KubeEvent, HostPathVolumeSource, Node, Pod, PodSpec, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, ListParams, PostParams, PropagationPolicy};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::mpsc;

use crate::cluster::{ClusterFile, K8sSettings, Launch, ProcessSpec};
pub use crate::k8s_names::pod_name;
use crate::status::Shared;

/// The labels of every object a session makes.
pub const LABEL_APP: &str = "app.kubernetes.io/name";
pub const LABEL_CLUSTER: &str = "shoal.io/cluster";
/// This `shoal run`'s id (one `shoal run` may drive several runs with `--interactive`).
pub const LABEL_RUN: &str = "shoal.io/run";
pub const LABEL_PROCESS: &str = "shoal.io/process";
pub const LABEL_ROLE: &str = "shoal.io/role";

/// Everything a Pod needs besides the process.
pub struct PodContext<'a> {
    pub cluster: &'a str,
    pub run: &'a str,
    pub namespace: &'a str,
    pub owner: &'a OwnerReference,
    pub settings: &'a K8sSettings,
    /// Host directories the process reads (its credentials, the metrics web config),
    /// mounted read-only at the same path.
    pub host_paths: &'a [PathBuf],
}

/// The labels of session `run` of `cluster`.
fn session_labels(cluster: &str, run: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_APP.to_string(), "shoal".to_string()),
        (LABEL_CLUSTER.to_string(), cluster.to_string()),
        (LABEL_RUN.to_string(), run.to_string()),
    ])
}

/// The Pod that runs `spec` with `args` (`shoal node ...`) on its host.
pub fn pod_for(cx: &PodContext, spec: &ProcessSpec, args: &[String], attempt: u32) -> anyhow::Result<Pod> {
    let s = cx.settings;
    let mut labels = session_labels(cx.cluster, cx.run);
    labels.insert(LABEL_PROCESS.into(), spec.name.clone());
    labels.insert(LABEL_ROLE.into(), spec.role.name().into());
    let volumes: Vec<(String, &PathBuf)> =
        cx.host_paths.iter().enumerate().map(|(i, p)| (format!("host{i}"), p)).collect();
    let env: Vec<EnvVar> =
        s.env.iter().map(|(k, v)| EnvVar { name: k.clone(), value: Some(v.clone()), ..Default::default() }).collect();
    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(pod_name(cx.cluster, &spec.name, cx.run, attempt)?),
            namespace: Some(cx.namespace.to_string()),
            labels: Some(labels),
            owner_references: Some(vec![cx.owner.clone()]),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(spec.host.clone()),
            host_network: Some(true),
            host_ipc: s.host_ipc.then_some(true),
            dns_policy: Some("ClusterFirstWithHostNet".into()),
            restart_policy: Some("Never".into()),
            service_account_name: s.service_account.clone(),
            // OFF has already asked the process to end; this is the rest of its time.
            termination_grace_period_seconds: Some(10),
            containers: vec![Container {
                name: "shoal".into(),
                image: s.image.clone(),
                image_pull_policy: s.image_pull_policy.clone(),
                command: Some(vec![s.binary.display().to_string()]),
                args: Some(args.to_vec()),
                env: (!env.is_empty()).then_some(env),
                volume_mounts: (!volumes.is_empty()).then(|| {
                    volumes
                        .iter()
                        .map(|(name, path)| VolumeMount {
                            name: name.clone(),
                            mount_path: path.display().to_string(),
                            read_only: Some(true),
                            ..Default::default()
                        })
                        .collect()
                }),
                ..Default::default()
            }],
            volumes: (!volumes.is_empty()).then(|| {
                volumes
                    .iter()
                    .map(|(name, path)| Volume {
                        name: name.clone(),
                        host_path: Some(HostPathVolumeSource {
                            path: path.display().to_string(),
                            type_: Some("Directory".into()),
                        }),
                        ..Default::default()
                    })
                    .collect()
            }),
            ..Default::default()
        }),
        status: None,
    })
}

/// How a Pod ended, as a process's exit: `failed` false only for a clean exit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodEnd {
    pub how: String,
    pub failed: bool,
}

/// Whether `pod`, as the API shows it, has ended, and how.
pub fn pod_ended(pod: &Pod) -> Option<PodEnd> {
    let name = pod.metadata.name.as_deref().unwrap_or("?");
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("");
    let terminated = status
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.terminated.as_ref());
    let exit = terminated.map(|t| {
        let mut e = format!("exit code {}", t.exit_code);
        if let Some(sig) = t.signal {
            e += &format!(", signal {sig}");
        }
        if let Some(r) = &t.reason {
            e += &format!(", {r}");
        }
        e
    });
    match phase {
        "Succeeded" => {
            Some(PodEnd { how: format!("Pod {name} succeeded ({})", exit.unwrap_or_default()), failed: false })
        }
        "Failed" => {
            let mut how = format!("Pod {name} failed");
            if let Some(r) = status.and_then(|s| s.reason.as_deref()) {
                how += &format!(": {r}");
            }
            if let Some(m) = status.and_then(|s| s.message.as_deref()) {
                how += &format!(": {m}");
            }
            if let Some(e) = exit {
                how += &format!(" ({e})");
            }
            Some(PodEnd { how, failed: true })
        }
        _ if pod.metadata.deletion_timestamp.is_some() => {
            Some(PodEnd { how: format!("Pod {name} is being deleted (not by run control)"), failed: true })
        }
        _ => None,
    }
}

/// Why `node` is not Ready (None: it is).
pub fn node_not_ready(node: &Node) -> Option<String> {
    let name = node.metadata.name.as_deref().unwrap_or("?");
    let ready =
        node.status.as_ref().and_then(|s| s.conditions.as_ref()).and_then(|c| c.iter().find(|c| c.type_ == "Ready"));
    match ready {
        Some(c) if c.status == "True" => None,
        Some(c) => Some(format!(
            "node {name} NotReady (Ready={}{}{})",
            c.status,
            c.reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default(),
            c.message.as_deref().map(|m| format!(": {m}")).unwrap_or_default()
        )),
        // A node without its Ready condition has not been seen by a kubelet yet.
        None => None,
    }
}

/// The API's answer in words, with its HTTP code (a refusal says 403 and who was refused).
fn api_error(what: &str, e: kube::Error) -> anyhow::Error {
    match e {
        kube::Error::Api(s) => {
            anyhow::anyhow!("{what}: the Kubernetes API answered {} {}: {}", s.code, s.reason, s.message)
        }
        other => anyhow::Error::new(other).context(what.to_string()),
    }
}

/// A Pod run control made, followed until it ends.
struct Tracked {
    process: String,
    node: String,
    ends: mpsc::UnboundedSender<PodEnd>,
    /// Its end was told (once), or run control deleted it.
    done: bool,
}

type Pods = Arc<Mutex<BTreeMap<String, Tracked>>>;

/// Tells the Pod's end once.
fn tell(pods: &Pods, pod: &str, end: PodEnd) {
    let mut pods = pods.lock().unwrap();
    if let Some(t) = pods.get_mut(pod)
        && !t.done
    {
        t.done = true;
        let _ = t.ends.send(end);
    }
}

/// Run control's hold on Kubernetes for one `shoal run` (see the module documentation).
pub struct Session {
    client: kube::Client,
    pub namespace: String,
    cluster: String,
    /// This `shoal run`'s id: the `shoal.io/run` label of everything it makes.
    pub run: String,
    owner: OwnerReference,
    settings: K8sSettings,
    host_paths: Vec<PathBuf>,
    pods: Pods,
    shared: Arc<Shared>,
    watches: Vec<tokio::task::JoinHandle<()>>,
}

/// A process's Pod: [`PodHandle::wait`] is its exit.
pub struct PodHandle {
    pub name: String,
    ends: mpsc::UnboundedReceiver<PodEnd>,
    session: Arc<Session>,
}

impl PodHandle {
    /// Until the Pod ends (fails, succeeds, is deleted by someone else, or its node is no
    /// longer Ready).
    pub async fn wait(&mut self) -> PodEnd {
        self.ends
            .recv()
            .await
            .unwrap_or_else(|| PodEnd { how: format!("Pod {}: watch ended", self.name), failed: true })
    }

    /// Deletes the Pod at once (a process that did not end after OFF, or one to restart).
    pub async fn kill(&mut self) {
        self.session.forget(&self.name);
        if let Err(e) = self.session.delete_pod(&self.name).await {
            self.session.note(format!("deleting Pod {}: {e:#}", self.name));
        }
    }
}

/// A random id for this `shoal run` (8 hex digits).
fn session_id() -> anyhow::Result<String> {
    let mut b = [0u8; 4];
    getrandom::fill(&mut b).map_err(|e| anyhow::anyhow!("random bytes: {e}"))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// The client the settings ask for: their kubeconfig, else the usual places.
async fn client_for(s: &K8sSettings) -> anyhow::Result<kube::Config> {
    use kube::config::{KubeConfigOptions, Kubeconfig};
    let options = KubeConfigOptions { context: s.context.clone(), ..Default::default() };
    match &s.kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path).with_context(|| format!("reading {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &options)
                .await
                .with_context(|| format!("kubeconfig {}", path.display()))
        }
        None if s.context.is_some() => kube::Config::from_kubeconfig(&options).await.context("the kubeconfig"),
        None => {
            kube::Config::infer().await.context("no kubeconfig (KUBECONFIG, ~/.kube/config) nor in-cluster account")
        }
    }
}

impl Session {
    /// Opens the session for the file's `k8s` processes (none: no session): the client,
    /// what a previous `shoal run` of this cluster left deleted, and this one's ConfigMap.
    /// A refusal (RBAC's 403) ends it here, before any process is started.
    pub async fn open(file: &ClusterFile, shared: &Arc<Shared>) -> anyhow::Result<Option<Arc<Session>>> {
        if !file.processes.iter().any(|p| p.launch == Launch::K8s) {
            return Ok(None);
        }
        let s = file.cluster.k8s.clone();
        let config = client_for(&s).await?;
        let server = config.cluster_url.to_string();
        let namespace = s.namespace.clone().unwrap_or_else(|| config.default_namespace.clone());
        let client = kube::Client::try_from(config).context("the Kubernetes client")?;
        let cluster = file.cluster.name.clone();
        let run = session_id()?;
        let whom = format!("Kubernetes at {server}, namespace {namespace}");

        // What a killed `shoal run` of this cluster left behind.
        let maps: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
        let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
        let ours = ListParams::default().labels(&format!("{LABEL_APP}=shoal,{LABEL_CLUSTER}={cluster}"));
        let left = maps.list(&ours).await.map_err(|e| api_error(&format!("{whom}: listing ConfigMaps"), e))?;
        let left_pods = pods.list(&ours).await.map_err(|e| api_error(&format!("{whom}: listing Pods"), e))?;
        if !left.items.is_empty() || !left_pods.items.is_empty() {
            shared.update(|st| {
                st.warn(format!(
                    "Kubernetes: {} Pods and {} ConfigMaps of cluster {cluster} left by an earlier shoal run: deleting them",
                    left_pods.items.len(),
                    left.items.len()
                ))
            });
            let now = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
            pods.delete_collection(&now, &ours)
                .await
                .map_err(|e| api_error(&format!("{whom}: deleting old Pods"), e))?;
            maps.delete_collection(&DeleteParams::default(), &ours)
                .await
                .map_err(|e| api_error(&format!("{whom}: deleting old ConfigMaps"), e))?;
        }

        let map = ConfigMap {
            metadata: ObjectMeta {
                name: Some(pod_name(&cluster, "run", &run, 0)?),
                labels: Some(session_labels(&cluster, &run)),
                ..Default::default()
            },
            data: Some(BTreeMap::from([("cluster.toml".to_string(), toml::to_string(file)?)])),
            ..Default::default()
        };
        let map = maps
            .create(&PostParams::default(), &map)
            .await
            .map_err(|e| api_error(&format!("{whom}: creating this run's ConfigMap"), e))?;
        let owner = OwnerReference {
            api_version: "v1".into(),
            kind: "ConfigMap".into(),
            name: map.metadata.name.clone().unwrap_or_default(),
            uid: map.metadata.uid.clone().context("the ConfigMap has no uid")?,
            ..Default::default()
        };
        let mut host_paths: Vec<PathBuf> = Vec::new();
        if let Some(sec) = &file.cluster.security {
            host_paths.extend(sec.credentials_dir.clone());
            host_paths.extend(sec.metrics_web_config.as_ref().and_then(|w| w.parent()).map(Path::to_path_buf));
        }
        host_paths.dedup();
        shared.update(|st| st.note(format!("{whom}: session {run}, ConfigMap {}", owner.name)));
        let mut session = Session {
            client,
            namespace,
            cluster,
            run,
            owner,
            settings: s,
            host_paths,
            pods: Arc::new(Mutex::new(BTreeMap::new())),
            shared: shared.clone(),
            watches: Vec::new(),
        };
        session.watches = vec![session.watch_pods(), session.watch_nodes(), session.watch_events()];
        Ok(Some(Arc::new(session)))
    }

    fn note(&self, what: String) {
        tracing::info!(target: "shoal_control::k8s", "{what}");
        self.shared.update(|s| s.note(what));
    }

    fn selector(&self) -> String {
        format!("{LABEL_APP}=shoal,{LABEL_CLUSTER}={},{LABEL_RUN}={}", self.cluster, self.run)
    }

    /// Phases and deletions of this session's Pods.
    fn watch_pods(&self) -> tokio::task::JoinHandle<()> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let pods = self.pods.clone();
        let shared = self.shared.clone();
        let config = watcher::Config::default().labels(&self.selector());
        tokio::spawn(async move {
            let mut events = std::pin::pin!(watcher(api, config).default_backoff());
            while let Some(e) = events.next().await {
                match e {
                    Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => {
                        if let (Some(name), Some(end)) = (pod.metadata.name.clone(), pod_ended(&pod)) {
                            tell(&pods, &name, end);
                        }
                    }
                    Ok(watcher::Event::Delete(pod)) => {
                        if let Some(name) = pod.metadata.name.clone() {
                            let end = pod_ended(&pod).filter(|e| !e.how.contains("being deleted")).unwrap_or(PodEnd {
                                how: format!("Pod {name} deleted (not by run control)"),
                                failed: true,
                            });
                            tell(&pods, &name, end);
                        }
                    }
                    Ok(_) => {}
                    Err(e) => shared.update(|s| s.warn(format!("Kubernetes: watching the Pods: {e}"))),
                }
            }
        })
    }

    /// The nodes' Ready condition: a Pod on a node that is not Ready is a process down
    /// (its kubelet is gone; the Pod's phase would change only much later, if ever).
    fn watch_nodes(&self) -> tokio::task::JoinHandle<()> {
        let api: Api<Node> = Api::all(self.client.clone());
        let pods = self.pods.clone();
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let mut events = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff());
            while let Some(e) = events.next().await {
                let (node, down) = match e {
                    Ok(watcher::Event::Apply(n) | watcher::Event::InitApply(n)) => {
                        let down = node_not_ready(&n);
                        (n.metadata.name.unwrap_or_default(), down)
                    }
                    Ok(watcher::Event::Delete(n)) => {
                        let name = n.metadata.name.unwrap_or_default();
                        let down = Some(format!("node {name} deleted"));
                        (name, down)
                    }
                    Ok(_) => continue,
                    Err(watcher::Error::InitialListFailed(kube::Error::Api(s))) if s.code == 403 => {
                        shared.update(|st| {
                            st.warn(format!(
                                "Kubernetes: run control may not watch the nodes ({}): a Pod on a lost node is \
                                 seen down only once Kubernetes fails it (docs/deployment.md)",
                                s.message
                            ))
                        });
                        return;
                    }
                    Err(e) => {
                        shared.update(|s| s.warn(format!("Kubernetes: watching the nodes: {e}")));
                        continue;
                    }
                };
                let Some(why) = down else { continue };
                let on_node: Vec<String> = pods
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|(_, t)| t.node == node && !t.done)
                    .map(|(name, _)| name.clone())
                    .collect();
                for pod in on_node {
                    tell(&pods, &pod, PodEnd { how: format!("Pod {pod}: {why}"), failed: true });
                }
            }
        })
    }

    /// The warnings among this namespace's events about our Pods, noted.
    fn watch_events(&self) -> tokio::task::JoinHandle<()> {
        let api: Api<KubeEvent> = Api::namespaced(self.client.clone(), &self.namespace);
        let pods = self.pods.clone();
        let shared = self.shared.clone();
        let config = watcher::Config::default().fields("involvedObject.kind=Pod,type=Warning");
        tokio::spawn(async move {
            let mut events = std::pin::pin!(watcher(api, config).default_backoff());
            while let Some(e) = events.next().await {
                match e {
                    Ok(watcher::Event::Apply(ev)) => {
                        let pod = ev.involved_object.name.clone().unwrap_or_default();
                        let process = pods.lock().unwrap().get(&pod).map(|t| t.process.clone());
                        if let Some(process) = process {
                            shared.update(|s| {
                                s.warn(format!(
                                    "Kubernetes: {process} (Pod {pod}): {}: {}",
                                    ev.reason.unwrap_or_default(),
                                    ev.message.unwrap_or_default()
                                ))
                            });
                        }
                    }
                    Ok(_) => {}
                    Err(watcher::Error::InitialListFailed(kube::Error::Api(s))) if s.code == 403 => {
                        shared.update(|st| {
                            st.warn(format!("Kubernetes: run control may not read events: {}", s.message))
                        });
                        return;
                    }
                    Err(e) => shared.update(|s| s.warn(format!("Kubernetes: watching events: {e}"))),
                }
            }
        })
    }

    /// Makes the Pod of `spec` (`attempt` > 0: a restart) and follows it.
    pub async fn launch(
        self: &Arc<Self>,
        spec: &ProcessSpec,
        args: &[String],
        attempt: u32,
    ) -> anyhow::Result<PodHandle> {
        let cx = PodContext {
            cluster: &self.cluster,
            run: &self.run,
            namespace: &self.namespace,
            owner: &self.owner,
            settings: &self.settings,
            host_paths: &self.host_paths,
        };
        let pod = pod_for(&cx, spec, args, attempt)?;
        let name = pod.metadata.name.clone().unwrap_or_default();
        let (tx, rx) = mpsc::unbounded_channel();
        // Followed before it exists: its first phase cannot be missed.
        self.pods.lock().unwrap().insert(
            name.clone(),
            Tracked { process: spec.name.clone(), node: spec.host.clone(), ends: tx, done: false },
        );
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        if let Err(e) = api.create(&PostParams::default(), &pod).await {
            self.forget(&name);
            return Err(api_error(&format!("creating Pod {name} for {} on node {}", spec.name, spec.host), e));
        }
        Ok(PodHandle { name, ends: rx, session: self.clone() })
    }

    /// Stops following `pod`: what happens to it now is run control's doing.
    fn forget(&self, pod: &str) {
        if let Some(t) = self.pods.lock().unwrap().get_mut(pod) {
            t.done = true;
        }
    }

    async fn delete_pod(&self, name: &str) -> anyhow::Result<()> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        match api.delete(name, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(api_error(&format!("deleting Pod {name}"), e)),
        }
    }

    /// Deletes this session's Pods and its ConfigMap, and waits up to
    /// `cluster.k8s.delete_timeout_s` until no Pod of it is left.
    pub async fn end(&self) -> anyhow::Result<()> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let maps: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
        let ours = ListParams::default().labels(&self.selector());
        for t in self.pods.lock().unwrap().values_mut() {
            t.done = true;
        }
        let now = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
        pods.delete_collection(&now, &ours).await.map_err(|e| api_error("deleting the run's Pods", e))?;
        let background = DeleteParams { propagation_policy: Some(PropagationPolicy::Background), ..Default::default() };
        match maps.delete(&self.owner.name, &background).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(api_error("deleting the run's ConfigMap", e)),
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(self.settings.delete_timeout_s.into());
        loop {
            let left = pods.list(&ours).await.map_err(|e| api_error("listing the run's Pods", e))?;
            if left.items.is_empty() {
                self.note(format!("Kubernetes: the Pods of session {} are gone", self.run));
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                let names: Vec<String> = left.items.iter().filter_map(|p| p.metadata.name.clone()).collect();
                bail!(
                    "Pods still there {}s after their deletion: {}",
                    self.settings.delete_timeout_s,
                    names.join(", ")
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        for w in &self.watches {
            w.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_net::node::Role;

    fn spec() -> ProcessSpec {
        toml::from_str("name = \"builder1\"\nrole = \"builder\"\nids = [1]\nlaunch = \"k8s\"\nhost = \"node3\"\n")
            .unwrap()
    }

    #[test]
    fn a_pod_is_pinned_to_its_node_on_the_host_network_and_never_restarted_by_kubernetes() {
        let owner = OwnerReference {
            api_version: "v1".into(),
            kind: "ConfigMap".into(),
            name: "c-run-1".into(),
            uid: "u1".into(),
            ..Default::default()
        };
        let mut settings = K8sSettings { image: Some("shoal:1".into()), ..Default::default() };
        settings.env.insert("UCX_TLS".into(), "tcp".into());
        let paths = [PathBuf::from("/etc/shoal/credentials")];
        let cx = PodContext {
            cluster: "c",
            run: "0a1b2c3d",
            namespace: "daq",
            owner: &owner,
            settings: &settings,
            host_paths: &paths,
        };
        let s = spec();
        assert_eq!(s.role, Role::Builder);
        let pod = pod_for(&cx, &s, &["node".into(), "--name".into(), "builder1".into()], 0).unwrap();
        let p = pod.spec.as_ref().unwrap();
        assert_eq!(p.node_name.as_deref(), Some("node3"));
        assert_eq!(p.host_network, Some(true));
        assert_eq!(p.dns_policy.as_deref(), Some("ClusterFirstWithHostNet"));
        assert_eq!(p.restart_policy.as_deref(), Some("Never"));
        let c = &p.containers[0];
        assert_eq!(c.image.as_deref(), Some("shoal:1"));
        assert_eq!(c.command.as_ref().unwrap(), &["/usr/local/bin/shoal".to_string()]);
        assert_eq!(c.args.as_ref().unwrap()[2], "builder1");
        assert_eq!(c.env.as_ref().unwrap()[0].name, "UCX_TLS");
        assert_eq!(c.volume_mounts.as_ref().unwrap()[0].mount_path, "/etc/shoal/credentials");
        let labels = pod.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[LABEL_CLUSTER], "c");
        assert_eq!(labels[LABEL_RUN], "0a1b2c3d");
        assert_eq!(labels[LABEL_PROCESS], "builder1");
        assert_eq!(pod.metadata.owner_references.as_ref().unwrap()[0].uid, "u1");
    }

    fn pod_with(json: serde_json::Value) -> Pod {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn a_failed_or_evicted_pod_is_a_process_down_a_succeeded_one_a_clean_exit() {
        let running = pod_with(serde_json::json!({"metadata": {"name": "p"}, "status": {"phase": "Running"}}));
        assert_eq!(pod_ended(&running), None);
        let evicted = pod_with(serde_json::json!({"metadata": {"name": "p"}, "status": {
            "phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory."}}));
        let end = pod_ended(&evicted).unwrap();
        assert!(end.failed && end.how.contains("Evicted"), "{end:?}");
        let crashed = pod_with(serde_json::json!({"metadata": {"name": "p"}, "status": {"phase": "Failed",
            "containerStatuses": [{"name": "shoal", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
              "state": {"terminated": {"exitCode": 139, "signal": 11, "reason": "Error"}}}]}}));
        let end = pod_ended(&crashed).unwrap();
        assert!(end.failed && end.how.contains("exit code 139, signal 11"), "{end:?}");
        let done = pod_with(serde_json::json!({"metadata": {"name": "p"}, "status": {"phase": "Succeeded"}}));
        assert!(!pod_ended(&done).unwrap().failed);
    }

    #[test]
    fn a_node_whose_kubelet_stopped_posting_is_not_ready() {
        let node = |status: &str| -> Node {
            serde_json::from_value(serde_json::json!({"metadata": {"name": "node2"}, "status": {"conditions": [
                {"type": "Ready", "status": status, "reason": "NodeStatusUnknown",
                 "message": "Kubelet stopped posting node status."}]}}))
            .unwrap()
        };
        assert_eq!(node_not_ready(&node("True")), None);
        let why = node_not_ready(&node("Unknown")).unwrap();
        assert!(why.contains("node2 NotReady (Ready=Unknown: NodeStatusUnknown"), "{why}");
    }
}
