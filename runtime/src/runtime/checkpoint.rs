//! What the snapshotter sees of a sandbox: the view it dumps (`CheckpointView`), where a restored
//! process tree lands (`RestoreTarget`, `RestoreFn`), and the host paths bind-mounted into every
//! sandbox that CRIU must be told about.

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::Runtime;
use crate::error::Error;
use crate::init_handle::HandleError;
use crate::proto;
use crate::root::RootMount;
use crate::types::*;

/// A host path bind-mounted into the sandbox, which CRIU must be told about
/// (dump `--external mnt[<sandbox_path>]:<key>`, restore `--external mnt[<key>]:<host_path>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExternalMount {
    pub key: String,
    pub sandbox_path: String,
    pub host_path: PathBuf,
}

/// What the snapshotter needs to dump a sandbox.
#[derive(Clone)]
pub struct CheckpointView {
    pub id: SandboxId,
    pub init_pid: i32,
    pub spec: SandboxSpec,
    pub root_dir: PathBuf,
    /// (controller or "unified", cgroup path relative to the hierarchy root).
    pub cgroups: Vec<(String, PathBuf)>,
    pub externals: Vec<ExternalMount>,
    pub root: Arc<dyn RootMount>,
    /// Host end of the sandbox's veth (egress only): dump with `--external veth[eth0]:<it>`.
    pub veth_host: Option<String>,
}

impl std::fmt::Debug for CheckpointView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointView")
            .field("id", &self.id)
            .field("init_pid", &self.init_pid)
            .field("root_dir", &self.root_dir)
            .field("cgroups", &self.cgroups)
            .field("externals", &self.externals)
            .finish_non_exhaustive()
    }
}

/// Where a restored process tree must land.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RestoreTarget {
    pub id: SandboxId,
    pub root_dir: PathBuf,
    pub cgroups: Vec<(String, PathBuf)>,
    pub externals: Vec<ExternalMount>,
    pub hostname: String,
    /// Egress only: the host-end name the restored veth must get (`--external veth[eth0]:<it>`);
    /// the runtime then re-addresses both ends. Without a restored veth a fresh one is made.
    pub veth_host: Option<String>,
    /// A user-namespace sandbox's own host id range: the restored user namespace must map onto
    /// it, not onto the range of the sandbox that was dumped.
    pub ids: Option<crate::userns::IdRange>,
}

/// Callback that restores a process tree into a `RestoreTarget` and returns the host pid of its init.
pub type RestoreFn<'a> =
    dyn FnMut(&RestoreTarget) -> Result<i32, Box<dyn std::error::Error + Send + Sync>> + 'a;

impl Runtime {
    /// Host paths bind-mounted into a sandbox (declare them to CRIU): the init binary, and in a
    /// user namespace the host's device nodes in /dev (see `proto::DEV_NODES`).
    pub fn externals(&self, userns: bool) -> Vec<ExternalMount> {
        let init = ExternalMount {
            key: "grove-init".into(),
            sandbox_path: proto::INIT_PATH.into(),
            host_path: self.config.init_binary.clone(),
        };
        let devices = proto::DEV_NODES
            .iter()
            .filter(|_| userns)
            .map(|(name, _, _)| ExternalMount {
                key: format!("grove-dev-{name}"),
                sandbox_path: format!("/dev/{name}"),
                host_path: PathBuf::from(format!("/dev/{name}")),
            });
        std::iter::once(init).chain(devices).collect()
    }

    pub fn checkpoint_view(&self, id: &SandboxId) -> Result<CheckpointView, Error> {
        let sb = self.sandbox(id)?;
        if !sb.init.alive() {
            let pid = sb.init.pid();
            return Err(self.unreachable(&sb, HandleError::Gone { pid }));
        }
        Ok(CheckpointView {
            id: id.clone(),
            init_pid: sb.init.pid(),
            spec: sb.spec.clone(),
            root_dir: sb.root_dir(),
            cgroups: self.cgroups.criu_paths(id.as_str()),
            externals: self.externals(sb.spec.userns),
            root: sb.root.clone(),
            veth_host: sb.net.as_ref().map(|n| n.host_if.clone()),
        })
    }
}
