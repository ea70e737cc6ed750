//! Runtime configuration.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::types::{CapacityOverrides, IdlePolicy, Limits};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RuntimeConfig {
    /// Default /var/lib/grove.
    pub state_dir: PathBuf,
    /// Default /run/grove (mountpoints, sockets).
    pub run_dir: PathBuf,
    /// Path of grove-init on the host.
    pub init_binary: PathBuf,
    /// Cgroup dirs are /sys/fs/cgroup/<ctrl>/<cgroup_root>/<id>.
    pub cgroup_root: String,
    pub capacity: CapacityOverrides,
    pub defaults: Limits,
    /// Address pool for egress sandboxes (a /30 each).
    #[serde(default = "default_pool")]
    pub net_pool: String,
    /// Idle reclaim for sandboxes whose spec sets none; None: sandboxes never idle out.
    #[serde(default)]
    pub idle: Option<IdlePolicy>,
}

fn default_pool() -> String {
    "10.200.0.0/16".into()
}

impl RuntimeConfig {
    pub fn default_paths() -> Self {
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
            state_dir: PathBuf::from("/var/lib/grove"),
            run_dir: PathBuf::from("/run/grove"),
            init_binary,
            cgroup_root: "grove".into(),
            capacity: CapacityOverrides::default(),
            defaults: Limits::default(),
            net_pool: default_pool(),
            idle: None,
        }
    }
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self::default_paths()
    }
}
