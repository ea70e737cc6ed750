//! The API's JSON shapes. Kept apart from the runtime's types so the HTTP contract (openapi.yaml) only changes
//! when we mean it to.

use std::collections::BTreeMap;

use grove_runtime::{
    EgressRule, ExecResult, IdlePolicy, JobStatus, JobsConfig, Limits, NetworkPolicy, OnIdle,
    PoolMode, PoolSpec, PoolStatus, PoolsConfig, PortMapping, SandboxInfo, SandboxState,
};
use serde::{Deserialize, Serialize};

/// Limits as a client gives them: any field left out takes the node's default.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LimitsRequest {
    pub cpu_millis: Option<u32>,
    pub memory_mb: Option<u64>,
    pub pids: Option<u32>,
    pub open_files: Option<u32>,
    pub disk_mb: Option<u64>,
}

impl LimitsRequest {
    pub fn fill(&self, d: &Limits) -> Limits {
        Limits {
            cpu_millis: self.cpu_millis.unwrap_or(d.cpu_millis),
            memory_mb: self.memory_mb.unwrap_or(d.memory_mb),
            pids: self.pids.unwrap_or(d.pids),
            open_files: self.open_files.unwrap_or(d.open_files),
            disk_mb: self.disk_mb.unwrap_or(d.disk_mb),
        }
    }
}

/// Network policy on the wire: `{"mode": "none"}` or `{"mode": "egress", "allow": [{cidr, ports}]}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NetworkRequest {
    pub mode: String,
    #[serde(default)]
    pub allow: Vec<EgressRuleRequest>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct EgressRuleRequest {
    pub cidr: String,
    #[serde(default)]
    pub ports: Vec<u16>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PortRequest {
    pub host_port: u16,
    pub sandbox_port: u16,
}

/// POST /v1/sandboxes.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxRequest {
    pub image: Option<String>,
    pub snapshot: Option<String>,
    /// A batch: the response is a list of results, one per sandbox.
    pub count: Option<u32>,
    pub limits: Option<LimitsRequest>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub workdir: Option<String>,
    pub hostname: Option<String>,
    pub network: Option<NetworkRequest>,
    #[serde(default)]
    pub ports: Vec<PortRequest>,
    pub ttl_secs: Option<u64>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Idle reclaim: after this long with no exec, file access or CPU use the sandbox is
    /// paused to the store (or destroyed, per `on_idle`). Unset: the node's default.
    pub idle_timeout_secs: Option<u64>,
    /// "pause" (default) or "destroy".
    pub on_idle: Option<String>,
    /// The job (tenant) it belongs to; "default" when left out.
    pub job: Option<String>,
    /// Order among the job's own queued creates (higher first).
    pub priority: Option<i32>,
    /// How long this create may wait for room (ms) instead of the node's queue timeout; 0 answers
    /// 429 `capacity_exceeded` at once when the node is full.
    pub queue_timeout_ms: Option<u64>,
    /// Capabilities kept beyond the default set: only "MKNOD" (CAP_MKNOD) today.
    #[serde(default)]
    pub cap_add: Vec<String>,
    /// Run in a user namespace of its own (sandbox root unprivileged on the host).
    #[serde(default)]
    pub userns: bool,
}

/// A sandbox as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sandbox {
    pub id: String,
    pub state: SandboxState,
    pub image: String,
    pub limits: Option<Limits>,
    pub env: BTreeMap<String, String>,
    pub workdir: Option<String>,
    pub hostname: String,
    pub network: NetworkRequest,
    pub ports: Vec<PortRequest>,
    pub labels: BTreeMap<String, String>,
    pub ttl_secs: Option<u64>,
    pub created_at_ms: u64,
    pub expires_at_ms: Option<u64>,
    pub init_pid: Option<i32>,
    pub address: Option<String>,
    /// The sandbox's own idle policy (null: the node's default applies).
    pub idle_timeout_secs: Option<u64>,
    pub on_idle: Option<String>,
    pub job: String,
    pub priority: i32,
    /// Capabilities kept beyond the default set (`cap_add` at create).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cap_add: Vec<String>,
    /// In a user namespace of its own (`userns` at create; absent when not).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub userns: bool,
}

impl From<&SandboxInfo> for Sandbox {
    fn from(i: &SandboxInfo) -> Self {
        Sandbox {
            id: i.id.to_string(),
            state: i.state,
            image: i.spec.image.clone(),
            limits: i.spec.limits,
            env: i.spec.env.clone(),
            workdir: i.spec.workdir.clone(),
            hostname: i.hostname.clone(),
            network: network_to_wire(&i.spec.network),
            ports: i
                .spec
                .ports
                .iter()
                .map(|p| PortRequest {
                    host_port: p.host_port,
                    sandbox_port: p.sandbox_port,
                })
                .collect(),
            labels: i.spec.labels.clone(),
            ttl_secs: i.spec.ttl_secs,
            created_at_ms: i.created_at_ms,
            expires_at_ms: i.expires_at_ms,
            init_pid: i.init_pid,
            address: i.address.clone(),
            idle_timeout_secs: i.spec.idle.map(|p| p.timeout_secs),
            on_idle: i.spec.idle.map(|p| on_idle_to_wire(p.on_idle).to_string()),
            job: i
                .spec
                .job
                .clone()
                .unwrap_or_else(|| grove_runtime::jobs::DEFAULT_JOB.into()),
            priority: i.spec.priority,
            cap_add: i
                .spec
                .cap_add
                .iter()
                .map(|c| capability_to_wire(*c).to_string())
                .collect(),
            userns: i.spec.userns,
        }
    }
}

pub fn capability_to_wire(c: grove_runtime::Capability) -> &'static str {
    match c {
        grove_runtime::Capability::Mknod => "MKNOD",
    }
}

pub fn on_idle_to_wire(a: OnIdle) -> &'static str {
    match a {
        OnIdle::Pause => "pause",
        OnIdle::Destroy => "destroy",
    }
}

/// The idle policy of a create request (or of the node's config); `Err` names what is wrong.
pub fn idle_from_wire(
    timeout_secs: Option<u64>,
    on_idle: Option<&str>,
) -> Result<Option<IdlePolicy>, (&'static str, String)> {
    let on_idle = match on_idle {
        None | Some("pause") => OnIdle::Pause,
        Some("destroy") => OnIdle::Destroy,
        Some(other) => return Err(("on_idle", format!("{other:?}: pause or destroy"))),
    };
    match timeout_secs {
        None => Ok(None),
        Some(0) => Err(("idle_timeout_secs", "must be at least 1".into())),
        Some(t) => Ok(Some(IdlePolicy {
            timeout_secs: t,
            on_idle,
        })),
    }
}

pub fn network_to_wire(n: &NetworkPolicy) -> NetworkRequest {
    match n {
        NetworkPolicy::None => NetworkRequest {
            mode: "none".into(),
            allow: vec![],
        },
        NetworkPolicy::Egress { allow } => NetworkRequest {
            mode: "egress".into(),
            allow: allow
                .iter()
                .map(|r| EgressRuleRequest {
                    cidr: r.cidr.clone(),
                    ports: r.ports.clone(),
                })
                .collect(),
        },
    }
}

pub fn network_from_wire(n: &NetworkRequest) -> Result<NetworkPolicy, (String, String)> {
    match n.mode.as_str() {
        "none" if n.allow.is_empty() => Ok(NetworkPolicy::None),
        "none" => Err((
            "network.allow".into(),
            "mode \"none\" takes no allow rules".into(),
        )),
        "egress" => {
            let mut allow = Vec::new();
            for (i, r) in n.allow.iter().enumerate() {
                check_cidr(&r.cidr).map_err(|why| (format!("network.allow[{i}].cidr"), why))?;
                if r.ports.contains(&0) {
                    return Err((
                        format!("network.allow[{i}].ports"),
                        "port 0 is not a port".into(),
                    ));
                }
                allow.push(EgressRule {
                    cidr: r.cidr.clone(),
                    ports: r.ports.clone(),
                });
            }
            Ok(NetworkPolicy::Egress { allow })
        }
        other => Err((
            "network.mode".into(),
            format!("{other:?} is not \"none\" or \"egress\""),
        )),
    }
}

/// Accepts `ADDR/PREFIX` (IPv4 or IPv6) or a bare address.
pub fn check_cidr(s: &str) -> Result<(), String> {
    let (addr, prefix) = match s.split_once('/') {
        Some((a, p)) => (a, Some(p)),
        None => (s, None),
    };
    let ip: std::net::IpAddr = addr
        .parse()
        .map_err(|_| format!("{s:?} is not an IP network (a.b.c.d/n)"))?;
    if let Some(p) = prefix {
        let max = if ip.is_ipv4() { 32 } else { 128 };
        match p.parse::<u8>() {
            Ok(n) if n <= max => {}
            _ => return Err(format!("{s:?}: prefix must be 0..={max}")),
        }
    }
    Ok(())
}

pub fn ports_from_wire(p: &[PortRequest]) -> Vec<PortMapping> {
    p.iter()
        .map(|p| PortMapping {
            host_port: p.host_port,
            sandbox_port: p.sandbox_port,
        })
        .collect()
}

/// One entry of a batch (create with `count`, fork, batch delete).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchItem {
    pub sandbox: Option<Sandbox>,
    pub error: Option<crate::error::ErrorBody>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchResponse {
    pub results: Vec<BatchItem>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxList {
    pub items: Vec<Sandbox>,
    pub next_page_token: Option<String>,
}

/// POST /v1/sandboxes/delete.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchDeleteRequest {
    #[serde(default)]
    pub ids: Vec<String>,
    /// Also delete every sandbox carrying all of these labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Also delete every sandbox of this job (with `labels`: those of the job carrying them).
    pub job: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeleteResult {
    pub id: String,
    pub deleted: bool,
    pub error: Option<crate::error::ErrorBody>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchDeleteResponse {
    pub results: Vec<DeleteResult>,
    /// How many were deleted.
    pub deleted: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TtlRequest {
    /// Required; `null` clears the expiry.
    #[serde(deserialize_with = "required_nullable")]
    pub ttl_secs: Option<u64>,
}

/// A `ttl_secs` as requested: 1 ..= 10 years (beyond it deadlines would overflow), else 422.
pub fn check_ttl(ttl_secs: Option<u64>) -> crate::error::ApiResult<()> {
    grove_runtime::check_ttl("ttl_secs", ttl_secs).map_err(crate::error::ApiError::from)
}

/// A per-request queue wait: at most an hour, as the node's own.
pub fn check_queue_timeout(ms: Option<u64>) -> crate::error::ApiResult<()> {
    match ms {
        Some(ms) if ms > 3_600_000 => Err(crate::error::ApiError::invalid(
            "queue_timeout_ms",
            format!("at most 3600000 (an hour), got {ms}; 0 fails at once when the node is full"),
        )),
        _ => Ok(()),
    }
}

/// An `Option` field that must be present (as a value or `null`).
fn required_nullable<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Option::<u64>::deserialize(d)
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    #[default]
    Utf8,
    Base64,
}

/// POST /v1/sandboxes/{id}/exec (and /exec/stream, /processes).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequestWire {
    pub argv: Option<Vec<String>>,
    pub shell: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    /// Standard input, base64.
    pub stdin: Option<String>,
    pub timeout_ms: Option<u64>,
    /// How stdout/stderr are returned: "utf8" (lossy, default) or "base64".
    pub encoding: Option<Encoding>,
    /// Most bytes of stdout (and of stderr) the result keeps; default 16 MiB, at most 64 MiB.
    pub max_output_bytes: Option<u64>,
    /// Run as this user of the sandbox: a name from its /etc/passwd or `uid[:gid]`.
    #[serde(default)]
    pub user: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecResultWire {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub stdout: String,
    pub stderr: String,
    pub encoding: Encoding,
    pub duration_ms: u64,
    /// The command wrote more than `max_output_bytes` to stdout: `stdout` is its first part.
    #[serde(default)]
    pub stdout_truncated: bool,
    #[serde(default)]
    pub stderr_truncated: bool,
}

pub fn encode(data: &[u8], enc: Encoding) -> String {
    use base64::Engine as _;
    match enc {
        Encoding::Utf8 => String::from_utf8_lossy(data).into_owned(),
        Encoding::Base64 => base64::engine::general_purpose::STANDARD.encode(data),
    }
}

impl ExecResultWire {
    pub fn from_result(r: &ExecResult, enc: Encoding) -> Self {
        ExecResultWire {
            exit_code: r.exit_code,
            signal: r.signal,
            timed_out: r.timed_out,
            stdout: encode(&r.stdout, enc),
            stderr: encode(&r.stderr, enc),
            encoding: enc,
            duration_ms: r.duration_ms,
            stdout_truncated: r.stdout_truncated,
            stderr_truncated: r.stderr_truncated,
        }
    }
}

/// A background process started by POST /v1/sandboxes/{id}/processes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StartedProcess {
    pub pid: i32,
    pub log_path: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Process {
    pub pid: i32,
    pub argv: Vec<String>,
    pub running: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcessList {
    pub items: Vec<Process>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    pub signal: i32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub kind: String,
    pub size: u64,
    pub mode: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FileList {
    pub path: String,
    pub entries: Vec<FileEntry>,
}

/// POST /v1/sandboxes/{id}/snapshot.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    pub name: Option<String>,
    /// Destroy the sandbox once the snapshot is committed.
    #[serde(default)]
    pub stop: bool,
    /// Answer once the images are in the content store.
    #[serde(default)]
    pub durable: bool,
    /// Delete the snapshot this long after it is taken, once no sandbox forked from it lives and
    /// no snapshot below it is kept. Unset or 0: kept until deleted.
    pub ttl_secs: Option<u64>,
}

/// A snapshot as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Snapshot {
    /// The root hash (64 hex).
    pub id: String,
    /// The given name, or the id when none was given.
    pub name: String,
    pub source_sandbox: Option<String>,
    pub image: Option<String>,
    pub created_at_ms: u64,
    pub size_bytes: Option<u64>,
    /// The images are in the content store (snapshots become durable in the background).
    pub durable: bool,
    pub labels: BTreeMap<String, String>,
    /// Why the background import of the images failed (it is retried); absent while none did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// When its TTL runs out (ms since the epoch); it is deleted then, once nothing needs it.
    #[serde(default)]
    pub expires_at_ms: Option<u64>,
    /// The snapshot its source sandbox was forked from (null: taken from a sandbox made from an image).
    #[serde(default)]
    pub parent: Option<String>,
    /// How its memory was dumped: "full" (every page, while frozen), "soft_dirty" (a
    /// pre-dump, then only the pages dirtied since) or "uffd_wp" (frozen, only the pages written
    /// since the source's last snapshot); absent where the backend has no dumps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_dump: Option<String>,
    /// Why a "full" dump was full where the node can dump incrementally.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_dump_reason: Option<String>,
}

/// POST /v1/snapshots/gc: expired snapshots, and with `labels` those carrying all of them, are
/// deleted when nothing needs them; then the content store's gc frees their bytes.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotGcRequest {
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// What a snapshot delete or gc removed (names), and for gc what the store's gc reported.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotsDeleted {
    pub deleted: Vec<String>,
    pub count: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotList {
    pub items: Vec<Snapshot>,
}

/// POST /v1/snapshots/{name}/fork.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    pub count: u32,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    pub ttl_secs: Option<u64>,
    pub hostname_prefix: Option<String>,
    /// As on create: how long each branch may wait for room (ms); 0 fails at once when full.
    pub queue_timeout_ms: Option<u64>,
}

/// Object ids (64 hex digits each) of content-store objects: what a snapshot reaches
/// (GET /v1/snapshots/{name}/objects), what a node is asked about (POST /v1/snapshots/missing),
/// and what a delta export should carry (POST /v1/snapshots/{name}/export).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectList {
    pub objects: Vec<String>,
}

/// POST /v1/snapshots/{name}/export: the objects the receiver lacks (from its /missing answer).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeltaExportRequest {
    pub missing: Vec<String>,
}

/// POST /v1/snapshots/pull: fetch snapshot `name` from the peer groved at `source` (`http://host:port`),
/// with `source_api_key`, else the key configured for that peer (`[[peers]]`), else no key.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PullRequest {
    pub source: String,
    pub name: String,
    pub source_api_key: Option<String>,
}

/// The pulled snapshot and what moved: `objects_sent` of the snapshot's `objects`, `bytes_received` on the wire.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PullResult {
    pub snapshot: Snapshot,
    pub objects: u64,
    pub objects_sent: u64,
    pub bytes_received: u64,
}

/// POST /v1/images: import from a path on the node.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageImportRequest {
    pub name: String,
    /// "dir" (a root directory) or "oci" (an OCI image layout directory).
    pub source: String,
    pub path: String,
    /// For "oci": the tag or digest inside the layout (default: the only image).
    pub reference: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Image {
    pub name: String,
    pub root: Option<String>,
    pub size_bytes: Option<u64>,
    /// What the image says about running it (absent for a plain directory or tar import).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<crate::image_config::ImageConfig>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageList {
    pub items: Vec<Image>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Node {
    pub version: String,
    pub hostname: String,
    pub labels: BTreeMap<String, String>,
    pub capacity: grove_runtime::Capacity,
    pub sandboxes: u64,
    pub snapshots_enabled: bool,
    pub root_provider: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Health {
    pub status: String,
    pub draining: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ResidueWire {
    pub clean: bool,
    pub items: Vec<grove_runtime::ResidueItem>,
}

/// Store maintenance results (gc, fsck) are the store's own report, passed through.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MaintenanceReport {
    pub ok: bool,
    pub report: serde_json::Value,
}

/// One lifecycle event on /v1/events.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EventWire {
    pub at_ms: u64,
    pub kind: String,
    pub sandbox: Option<String>,
    pub snapshot: Option<String>,
    pub reason: Option<String>,
}

/// One pool in PUT /v1/pools: limits left out take the node defaults (as in a create).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolRequest {
    pub image: String,
    #[serde(default)]
    pub limits: Option<LimitsRequest>,
    #[serde(default)]
    pub mode: PoolMode,
    #[serde(default)]
    pub min: u32,
    pub max: u32,
}

/// PUT /v1/pools: the whole pool configuration (fields left out take their defaults).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolsRequest {
    #[serde(default)]
    pub pools: Vec<PoolRequest>,
    pub auto_sizes: Option<u32>,
    pub auto_max: Option<u32>,
    pub window_ms: Option<u64>,
    pub half_life_ms: Option<u64>,
    pub headroom: Option<f64>,
}

impl PoolsRequest {
    pub fn into_config(self, defaults: &Limits) -> PoolsConfig {
        let d = PoolsConfig::default();
        PoolsConfig {
            pools: self
                .pools
                .into_iter()
                .map(|p| PoolSpec {
                    image: p.image,
                    limits: Some(p.limits.unwrap_or_default().fill(defaults)),
                    mode: p.mode,
                    min: p.min,
                    max: p.max,
                })
                .collect(),
            auto_sizes: self.auto_sizes.unwrap_or(d.auto_sizes),
            auto_max: self.auto_max.unwrap_or(d.auto_max),
            window_ms: self.window_ms.unwrap_or(d.window_ms),
            half_life_ms: self.half_life_ms.unwrap_or(d.half_life_ms),
            headroom: self.headroom.unwrap_or(d.headroom),
        }
    }
}

/// GET/PUT /v1/pools: the configuration and every pool as it stands.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Pools {
    pub config: PoolsConfig,
    pub pools: Vec<PoolStatus>,
}

/// GET/PUT /v1/jobs: the configuration and every job seen or configured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Jobs {
    pub config: JobsConfig,
    pub jobs: Vec<JobStatus>,
}
