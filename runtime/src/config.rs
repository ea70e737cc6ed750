//! Runtime configuration.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::types::{CapacityOverrides, IdlePolicy, Limits};
use crate::userns::IdPool;

/// The instance name of the default state dir; its names are the historical ones (`/run/grove`,
/// cgroup root `grove`, nft table `grove`, pool 10.200.0.0/16).
pub const DEFAULT_INSTANCE: &str = "grove";
pub const DEFAULT_STATE_DIR: &str = "/var/lib/grove";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RuntimeConfig {
    /// Default /var/lib/grove.
    pub state_dir: PathBuf,
    /// Default /run/<instance> (mountpoints, sockets).
    pub run_dir: PathBuf,
    /// Path of grove-init on the host.
    pub init_binary: PathBuf,
    /// Cgroup dirs are /sys/fs/cgroup/<ctrl>/<cgroup_root>/<id>. It is the instance's identity:
    /// it names the nft table, marks the setup processes and veths, and bounds every sweep, so
    /// two runtimes on one host must never share it (see `instance_for`).
    pub cgroup_root: String,
    pub capacity: CapacityOverrides,
    pub defaults: Limits,
    /// Address pool for egress sandboxes (a /30 each).
    #[serde(default = "default_pool")]
    pub net_pool: String,
    /// Idle reclaim for sandboxes whose spec sets none; None: sandboxes never idle out.
    #[serde(default)]
    pub idle: Option<IdlePolicy>,
    /// Host ports a sandbox may publish; others are refused (the host's services live below).
    #[serde(default)]
    pub host_port_range: PortRange,
    /// Host ports never published whatever the range: the daemon's own listeners.
    #[serde(default)]
    pub reserved_ports: Vec<u16>,
    /// Host id ranges for sandboxes in a user namespace; None derives one from the instance
    /// (`RuntimeConfig::id_pool`).
    #[serde(default)]
    pub userns_pool: Option<IdPool>,
}

/// An inclusive range of TCP ports, written `"30000-32767"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

/// Kubernetes' NodePort range: below the kernel's ephemeral ports (32768-60999), so a published
/// port never collides with the source port of the host's own connections.
impl Default for PortRange {
    fn default() -> Self {
        PortRange {
            first: 30000,
            last: 32767,
        }
    }
}

impl PortRange {
    pub fn contains(&self, port: u16) -> bool {
        (self.first..=self.last).contains(&port)
    }
}

/// A port range that does not parse: the text as given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not FIRST-LAST (ports 1-65535, FIRST <= LAST)")]
pub struct PortRangeError(pub String);

impl std::str::FromStr for PortRange {
    type Err = PortRangeError;
    fn from_str(s: &str) -> Result<Self, PortRangeError> {
        let bad = || PortRangeError(s.to_string());
        let (a, b) = s.split_once('-').ok_or_else(bad)?;
        let first: u16 = a.trim().parse().map_err(|_| bad())?;
        let last: u16 = b.trim().parse().map_err(|_| bad())?;
        if first == 0 || first > last {
            return Err(bad());
        }
        Ok(PortRange { first, last })
    }
}

impl TryFrom<String> for PortRange {
    type Error = PortRangeError;
    fn try_from(s: String) -> Result<Self, PortRangeError> {
        s.parse()
    }
}

impl From<PortRange> for String {
    fn from(r: PortRange) -> String {
        r.to_string()
    }
}

impl std::fmt::Display for PortRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

fn default_pool() -> String {
    pool_for(DEFAULT_INSTANCE)
}

/// FNV-1a: a hash that stays the same across builds and Rust versions (names derive from it).
fn fnv(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5, |h, &b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// The default instance name of a state dir: `grove` for /var/lib/grove, else `grove-<8 hex of
/// the path>`, so two daemons on two state dirs never share a cgroup root, nft table, run dir or
/// address pool unless told to.
pub fn instance_for(state_dir: &Path) -> String {
    if state_dir == Path::new(DEFAULT_STATE_DIR) {
        return DEFAULT_INSTANCE.into();
    }
    format!(
        "{DEFAULT_INSTANCE}-{:08x}",
        fnv(state_dir.as_os_str().as_encoded_bytes())
    )
}

/// The default address pool of an instance: 10.200.0.0/16 for `grove`, else one of
/// 10.201-10.250.0.0/16 by its name. Two instances may still draw the same one; a block whose
/// host address is already on the host is skipped (`Network::setup`).
pub fn pool_for(instance: &str) -> String {
    let second = if instance == DEFAULT_INSTANCE {
        200
    } else {
        201 + fnv(instance.as_bytes()) % 50
    };
    format!("10.{second}.0.0/16")
}

/// The default run dir of an instance.
pub fn run_dir_for(instance: &str) -> PathBuf {
    Path::new("/run").join(instance)
}

impl RuntimeConfig {
    pub fn default_paths() -> Self {
        Self::for_instance(DEFAULT_INSTANCE, Path::new(DEFAULT_STATE_DIR))
    }

    /// The defaults of instance `instance` on `state_dir`: run dir, cgroup root (hence nft
    /// table) and address pool derived from the name.
    pub fn for_instance(instance: &str, state_dir: &Path) -> Self {
        // Next to the running binary, or one directory up: cargo puts examples and test binaries
        // in target/<profile>/{examples,deps}, beside the directory that holds grove-init.
        let init_binary = std::env::current_exe()
            .ok()
            .and_then(|exe| {
                exe.ancestors()
                    .skip(1)
                    .take(2)
                    .map(|d| d.join("grove-init"))
                    .find(|p| p.exists())
            })
            .unwrap_or_else(|| PathBuf::from("/usr/local/bin/grove-init"));
        RuntimeConfig {
            state_dir: state_dir.to_path_buf(),
            run_dir: run_dir_for(instance),
            init_binary,
            cgroup_root: instance.into(),
            capacity: CapacityOverrides::default(),
            defaults: Limits::default(),
            net_pool: pool_for(instance),
            idle: None,
            host_port_range: PortRange::default(),
            reserved_ports: Vec::new(),
            userns_pool: None,
        }
    }

    /// The pool user-namespace sandboxes draw their host ids from: the configured one, else the
    /// instance's default (derived from the cgroup root, the instance's name).
    pub fn id_pool(&self) -> IdPool {
        self.userns_pool.unwrap_or_else(|| {
            IdPool::for_instance(&self.cgroup_root, fnv(self.cgroup_root.as_bytes()))
        })
    }
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self::default_paths()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instances_of_other_state_dirs_get_names_of_their_own() {
        assert_eq!(instance_for(Path::new("/var/lib/grove")), "grove");
        let a = instance_for(Path::new("/srv/a"));
        let b = instance_for(Path::new("/srv/b"));
        assert!(a.starts_with("grove-") && a.len() == 14, "{a}");
        assert_ne!(a, b);
        assert_eq!(a, instance_for(Path::new("/srv/a")), "stable");
        assert_eq!(pool_for("grove"), "10.200.0.0/16");
        let c = RuntimeConfig::for_instance(&a, Path::new("/srv/a"));
        assert_eq!(c.run_dir, Path::new("/run").join(&a));
        assert_eq!(c.cgroup_root, a);
        assert_ne!(c.net_pool, "10.200.0.0/16");
        assert_eq!(RuntimeConfig::default().run_dir, Path::new("/run/grove"));
    }

    #[test]
    fn port_ranges() {
        assert_eq!(
            "30000-32767".parse::<PortRange>().unwrap(),
            PortRange::default()
        );
        for bad in ["", "1", "0-10", "10-1", "1-70000", "a-b"] {
            assert!(bad.parse::<PortRange>().is_err(), "{bad}");
        }
        assert!(PortRange::default().contains(30000) && !PortRange::default().contains(22));
    }
}
