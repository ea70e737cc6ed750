//! The `Runtime`: sandbox lifecycle, exec, files, admission, reclaim.

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::config::RuntimeConfig;
use crate::error::Error;
use crate::root::{RootMount, RootProvider};
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
}

/// Callback that restores a process tree into a `RestoreTarget` and returns the host pid of its init.
pub type RestoreFn<'a> =
    dyn FnMut(&RestoreTarget) -> Result<i32, Box<dyn std::error::Error + Send + Sync>> + 'a;

pub struct Runtime {
    config: RuntimeConfig,
    roots: Arc<dyn RootProvider>,
}

fn unsupported<T>(what: &str) -> Result<T, Error> {
    Err(Error::Unsupported { what: what.into() })
}

impl Runtime {
    /// Cleans residue of a previous run it does not own.
    pub fn new(config: RuntimeConfig, roots: Arc<dyn RootProvider>) -> Result<Arc<Runtime>, Error> {
        Ok(Arc::new(Runtime { config, roots }))
    }
    pub fn config(&self) -> &RuntimeConfig {
        &self.config
    }
    pub fn create(&self, spec: SandboxSpec) -> Result<SandboxInfo, Error> {
        let _ = (&spec, &self.roots);
        unsupported("create")
    }
    pub fn get(&self, id: &SandboxId) -> Result<SandboxInfo, Error> {
        Err(Error::NotFound { id: id.to_string() })
    }
    pub fn list(&self) -> Vec<SandboxInfo> {
        Vec::new()
    }
    pub fn destroy(&self, id: &SandboxId) -> Result<(), Error> {
        Err(Error::NotFound { id: id.to_string() })
    }
    pub fn set_ttl(&self, id: &SandboxId, _ttl_secs: Option<u64>) -> Result<SandboxInfo, Error> {
        Err(Error::NotFound { id: id.to_string() })
    }
    pub fn exec(&self, id: &SandboxId, req: ExecRequest) -> Result<ExecResult, Error> {
        self.exec_stream(id, req, &mut |_| {})
    }
    pub fn exec_stream(
        &self,
        _id: &SandboxId,
        _req: ExecRequest,
        _on_output: &mut dyn FnMut(OutputChunk),
    ) -> Result<ExecResult, Error> {
        unsupported("exec")
    }
    pub fn processes(&self, _id: &SandboxId) -> Result<Vec<ProcessInfo>, Error> {
        unsupported("processes")
    }
    pub fn signal(&self, _id: &SandboxId, _pid: i32, _signal: i32) -> Result<(), Error> {
        unsupported("signal")
    }
    pub fn read_file(&self, _id: &SandboxId, _path: &str) -> Result<Vec<u8>, Error> {
        unsupported("read_file")
    }
    pub fn write_file(
        &self,
        _id: &SandboxId,
        _path: &str,
        _data: &[u8],
        _mode: Option<u32>,
    ) -> Result<(), Error> {
        unsupported("write_file")
    }
    pub fn list_dir(&self, _id: &SandboxId, _path: &str) -> Result<Vec<DirEntry>, Error> {
        unsupported("list_dir")
    }
    pub fn upload_tar(
        &self,
        _id: &SandboxId,
        _dir: &str,
        _tar: &mut dyn std::io::Read,
    ) -> Result<(), Error> {
        unsupported("upload_tar")
    }
    pub fn download_tar(
        &self,
        _id: &SandboxId,
        _dir: &str,
        _out: &mut dyn std::io::Write,
    ) -> Result<(), Error> {
        unsupported("download_tar")
    }
    pub fn pause(&self, _id: &SandboxId) -> Result<SandboxInfo, Error> {
        unsupported("pause")
    }
    pub fn resume(&self, _id: &SandboxId) -> Result<SandboxInfo, Error> {
        unsupported("resume")
    }
    pub fn usage(&self, _id: &SandboxId) -> Result<Usage, Error> {
        unsupported("usage")
    }
    pub fn capacity(&self) -> Capacity {
        Capacity::default()
    }
    pub fn residue(&self) -> ResidueReport {
        ResidueReport::default()
    }
    pub fn subscribe(&self) -> std::sync::mpsc::Receiver<Event> {
        std::sync::mpsc::channel().1
    }
    pub fn reap_expired(&self) -> Vec<SandboxId> {
        Vec::new()
    }
    pub fn shutdown(&self) {}
    pub fn checkpoint_view(&self, _id: &SandboxId) -> Result<CheckpointView, Error> {
        unsupported("checkpoint_view")
    }
    pub fn freeze(&self, _id: &SandboxId) -> Result<(), Error> {
        unsupported("freeze")
    }
    pub fn thaw(&self, _id: &SandboxId) -> Result<(), Error> {
        unsupported("thaw")
    }
    /// Create a sandbox whose process tree is brought by `restore` (CRIU) instead of a fresh init.
    pub fn create_restored(
        &self,
        _spec: SandboxSpec,
        _restore: &mut RestoreFn<'_>,
    ) -> Result<SandboxInfo, Error> {
        unsupported("create_restored")
    }
}
