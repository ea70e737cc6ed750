//! Public data types of the runtime API (re-exported from the crate root).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// Sandbox identity: "sb-" + 12 lowercase hex chars.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SandboxId(String);

impl SandboxId {
    /// A fresh random id.
    pub fn generate() -> Self {
        let n: u64 = rand::random::<u64>() & 0xffff_ffff_ffff;
        SandboxId(format!("sb-{n:012x}"))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
    /// The 12 hex chars (used for link names and cgroup dirs).
    pub fn short(&self) -> &str {
        &self.0[3..]
    }
}

impl fmt::Display for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for SandboxId {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let ok = s.len() == 15
            && s.starts_with("sb-")
            && s[3..]
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if ok {
            Ok(SandboxId(s.to_string()))
        } else {
            Err(Error::InvalidSpec {
                field: "id".into(),
                reason: format!("{s:?} is not sb- followed by 12 lowercase hex chars"),
            })
        }
    }
}

impl Serialize for SandboxId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for SandboxId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Resource limits of one sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Limits {
    pub cpu_millis: u32,
    pub memory_mb: u64,
    pub pids: u32,
    pub open_files: u32,
    pub disk_mb: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            cpu_millis: 1000,
            memory_mb: 512,
            pids: 256,
            open_files: 1024,
            disk_mb: 1024,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "lowercase")]
pub enum NetworkPolicy {
    /// Loopback only.
    #[default]
    None,
    /// Outbound traffic to the listed CIDRs/ports only.
    Egress { allow: Vec<EgressRule> },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressRule {
    pub cidr: String,
    /// Empty = all ports.
    #[serde(default)]
    pub ports: Vec<u16>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortMapping {
    pub host_port: u16,
    pub sandbox_port: u16,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SandboxSpec {
    pub image: String,
    pub limits: Option<Limits>,
    pub env: BTreeMap<String, String>,
    pub workdir: Option<String>,
    pub hostname: Option<String>,
    pub network: NetworkPolicy,
    pub ports: Vec<PortMapping>,
    pub ttl_secs: Option<u64>,
    pub labels: BTreeMap<String, String>,
    /// What happens after this long without exec, file access or CPU use; None takes the
    /// node's default (`RuntimeConfig::idle`). Separate from the time-to-live.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle: Option<IdlePolicy>,
    /// The job (tenant) the sandbox belongs to: quotas and fair queueing; None = "default".
    pub job: Option<String>,
    /// Order among the job's own queued creates (higher first); jobs are ordered by share.
    pub priority: i32,
    /// How long this create may wait in the queue for room (ms), instead of the node's
    /// `queue_timeout_ms`; 0 fails at once (CapacityExceeded) when the node is full. Only the
    /// create reads it: it is not kept with the sandbox.
    #[serde(default, skip_serializing)]
    pub queue_timeout_ms: Option<u64>,
    /// Capabilities kept beyond the default set, on request only.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cap_add: Vec<Capability>,
    /// Run in a user namespace of its own: sandbox root is an unprivileged host uid (a range
    /// drawn from the instance's pool, see `userns`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub userns: bool,
}

/// A capability a sandbox may ask to keep beyond the default set.
///
/// Only CAP_MKNOD today: an image whose tooling makes device nodes (debootstrap, some package
/// post-install scripts) needs it. Keeping it is safe because making a node does not let the
/// sandbox open it: the device allowlist (cgroup `devices`) still refuses every device outside
/// the OCI defaults, and the root is mounted `nodev`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Capability {
    #[serde(rename = "MKNOD")]
    Mknod,
}

impl Capability {
    /// The CAP_* number.
    pub fn number(self) -> u32 {
        match self {
            Capability::Mknod => 27,
        }
    }

    /// From the name the API takes (`MKNOD` or `CAP_MKNOD`, any case).
    pub fn parse(name: &str) -> Option<Capability> {
        let upper = name.to_ascii_uppercase();
        match upper.strip_prefix("CAP_").unwrap_or(&upper) {
            "MKNOD" => Some(Capability::Mknod),
            _ => None,
        }
    }
}

/// Idle reclaim of one sandbox: after `timeout_secs` with no exec, no file access and no CPU
/// use, it is paused to the store or destroyed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdlePolicy {
    pub timeout_secs: u64,
    pub on_idle: OnIdle,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnIdle {
    /// Snapshot to the store and stop (memory freed; the next request resumes it).
    Pause,
    Destroy,
}

impl SandboxSpec {
    /// A spec with defaults for everything but the image.
    pub fn from_image(image: impl Into<String>) -> Self {
        SandboxSpec {
            image: image.into(),
            ..Default::default()
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    Creating,
    Running,
    Paused,
    Destroying,
    Destroyed,
    Failed,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxInfo {
    pub id: SandboxId,
    pub state: SandboxState,
    pub spec: SandboxSpec,
    pub created_at_ms: u64,
    pub expires_at_ms: Option<u64>,
    pub init_pid: Option<i32>,
    pub hostname: String,
    /// Sandbox address on the egress network, if any.
    #[serde(default)]
    pub address: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ExecRequest {
    /// Exactly one of `argv` / `shell`.
    pub argv: Vec<String>,
    /// Run as `/bin/sh -c <shell>`.
    pub shell: Option<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub stdin: Option<Vec<u8>>,
    /// On expiry the whole command tree is killed and `timed_out` is set.
    pub timeout_ms: Option<u64>,
    /// Return at once with the pid; output goes to a log file in the sandbox.
    pub background: bool,
    /// Most bytes of stdout (and, separately, of stderr) kept in the result; the rest is read and
    /// dropped while the command runs on (`*_truncated` says so). None: [`DEFAULT_MAX_OUTPUT`].
    pub max_output_bytes: Option<u64>,
    /// Run as this user of the sandbox (a name from its /etc/passwd, or `uid[:gid]`); None: root.
    pub user: Option<String>,
}

/// Output kept per stream when a request does not say.
pub const DEFAULT_MAX_OUTPUT: u64 = 16 << 20;
/// The most a request may ask to keep per stream.
pub const MAX_OUTPUT: u64 = 64 << 20;

impl ExecRequest {
    pub fn argv<S: Into<String>>(argv: impl IntoIterator<Item = S>) -> Self {
        ExecRequest {
            argv: argv.into_iter().map(Into::into).collect(),
            ..Default::default()
        }
    }
    pub fn shell(cmd: impl Into<String>) -> Self {
        ExecRequest {
            shell: Some(cmd.into()),
            ..Default::default()
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecResult {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub duration_ms: u64,
    pub pid: Option<i32>,
    /// For background execs: the log file inside the sandbox.
    #[serde(default)]
    pub log_path: Option<String>,
    /// More stdout came than `max_output_bytes`: `stdout` holds only the first part.
    #[serde(default)]
    pub stdout_truncated: bool,
    #[serde(default)]
    pub stderr_truncated: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum OutputChunk {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessInfo {
    pub pid: i32,
    pub argv: Vec<String>,
    pub running: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    pub name: String,
    /// "file" | "dir" | "symlink" | "other"
    pub kind: String,
    pub size: u64,
    pub mode: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub cpu_usec: u64,
    pub memory_bytes: u64,
    pub pids: u64,
    pub disk_bytes: u64,
    pub disk_inodes: u64,
    pub net_rx_bytes: u64,
    pub net_tx_bytes: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    pub cpu_millis: u64,
    pub memory_mb: u64,
    pub pids: u64,
    pub open_files: u64,
    pub disk_mb: u64,
    pub sandboxes: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    pub total: Resources,
    pub allocated: Resources,
    pub allocatable: Resources,
}

/// Optional overrides of the detected node capacity.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CapacityOverrides {
    pub cpu_millis: Option<u64>,
    pub memory_mb: Option<u64>,
    pub pids: Option<u64>,
    pub open_files: Option<u64>,
    pub disk_mb: Option<u64>,
    pub sandboxes: Option<u64>,
    /// Memory kept back for the host (MiB); default 1024.
    pub memory_reserve_mb: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResidueReport {
    pub items: Vec<ResidueItem>,
}

impl ResidueReport {
    pub fn is_clean(&self) -> bool {
        self.items.is_empty()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResidueItem {
    /// mount | cgroup | netns | link | nft | process | file
    pub kind: String,
    pub what: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EventKind {
    Created,
    Destroyed,
    Failed,
    Paused,
    Resumed,
    Expired,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    pub at_ms: u64,
    pub sandbox: SandboxId,
    pub kind: EventKind,
    pub reason: Option<String>,
}
