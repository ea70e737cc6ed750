//! Images in the nodefs content store (a ref per image, named like the image) and snapshots through the
//! snapshotter. Snapshots are optional: without CRIU the node still serves sandboxes.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;
use grove_nodefs_root::NodefsRoot;
use grove_runtime::{Runtime, SandboxId, SandboxInfo};
use grove_snapshotter::{
    ForkOptions, SnapshotInfo, SnapshotOptions, Snapshotter, SnapshotterConfig,
};
use nodefs::service::{Client, FsService, ImportPolicy, Local, Spawn};
use nodefs::{ManifestId, ObjectId};

use crate::api_shapes::{ForkRequest, Image, Snapshot, SnapshotRequest};
use crate::backend::{check_name, BackendError, BackendResult, Images, Snapshots};
use crate::backend_build::Backend;
use crate::config::Config;
use crate::error::chain;

/// `grove-fsd` next to the running executable or where `grove install` puts it; `GROVE_FSD_BINARY`
/// overrides.
fn fsd_binary() -> anyhow::Result<std::path::PathBuf> {
    if let Some(p) = std::env::var_os("GROVE_FSD_BINARY") {
        return Ok(p.into());
    }
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("the executable has no directory")?;
    [
        dir.join("grove-fsd"),
        dir.join("../grove-fsd"),
        dir.join("../libexec/grove/grove-fsd"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .context("grove-fsd not found (set GROVE_FSD_BINARY or install it next to groved)")
}

/// The store and the FUSE server live in `grove-fsd`, one per state dir, on `<run_dir>/fsd.sock`:
/// found if it runs (a restart: its mounts are the live sandboxes' roots), started otherwise.
pub fn connect_fsd(config: &Config) -> anyhow::Result<Arc<Client>> {
    let socket = config.run_dir.join("fsd.sock");
    let spawn = Spawn {
        binary: fsd_binary()?,
        store: config.state_dir.join("store"),
        log: config.run_dir.join("fsd.log"),
        cgroup_procs: crate::daemon_cgroup::fsd_procs(),
    };
    let client = Client::start(&socket, Some(spawn))
        .map_err(|e| anyhow::anyhow!("reaching grove-fsd: {}", chain(&e)))?;
    Ok(Arc::new(client))
}

/// Stops `fsd` if it serves no mount (a start that failed after starting it).
pub fn stop_fsd_if_idle(fsd: &Client) {
    if fsd.mounts().is_ok_and(|m| m.is_empty()) {
        if let Err(e) = fsd.shutdown() {
            tracing::warn!("stopping grove-fsd: {}", chain(&e));
        }
    }
}

/// The daemon serves roots through `grove-fsd`; `in_process` (a one-shot `grove run`) serves them
/// itself, and they end with it.
pub fn build(config: &Config, in_process: bool) -> anyhow::Result<Backend> {
    let (store, fsd): (Arc<dyn FsService>, _) = if in_process {
        let local = Local::open_with(
            &config.state_dir.join("store"),
            nodefs::ServerOptions::from_env(),
        )
        .map_err(|e| anyhow::anyhow!("opening the content store: {}", chain(&e)))?;
        (Arc::new(local), None)
    } else {
        let fsd = connect_fsd(config)?;
        (fsd.clone(), Some(fsd))
    };
    let roots = Arc::new(NodefsRoot::new(
        store.clone(),
        config.state_dir.join("uppers"),
    ));
    let runtime = match Runtime::new(config.runtime_config(), roots) {
        Ok(r) => r,
        Err(e) => {
            if let Some(fsd) = &fsd {
                stop_fsd_if_idle(fsd);
            }
            return Err(anyhow::Error::new(e).context("starting the runtime"));
        }
    };
    // Recovery detached the roots of sandboxes it could not adopt; fsd forgets them now.
    if let Err(e) = store.mounts() {
        tracing::warn!("listing the nodefs mounts: {}", chain(&e));
    }
    let scfg = SnapshotterConfig {
        state_dir: config.state_dir.clone(),
        run_dir: config.run_dir.clone(),
        criu: config.criu.clone(),
        scratch_dir: None,
        image_cache_bytes: None,
        merge_fork_pages: config.merge_fork_pages,
        lazy_pages: config.lazy_pages,
        track_dirty_pages: config.track_dirty_pages,
    };
    let snapshotter = match Snapshotter::new(scfg, runtime.clone(), store.clone()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!("snapshots disabled: {}", chain(&e));
            None
        }
    };
    let images = Arc::new(NodefsImages {
        store,
        snapshotter: snapshotter.clone(),
    });
    let snapshots = snapshotter.map(|s| {
        Arc::new(NodefsSnapshots {
            s,
            runtime: runtime.clone(),
        }) as Arc<dyn Snapshots>
    });
    Ok(Backend {
        runtime,
        images,
        snapshots,
        fsd,
    })
}

/// How long a `durable` snapshot waits for its images to be stored.
const DURABLE_WAIT: std::time::Duration = std::time::Duration::from_secs(600);

/// A durable snapshot that could not be made: its images not stored is [`BackendError::NotDurable`]
/// (507 when the store is full, told by the error's causes), the rest the snapshotter's own.
fn durable_err(e: grove_snapshotter::Error) -> BackendError {
    match e {
        e @ grove_snapshotter::Error::NotStored { .. } => BackendError::NotDurable(e),
        e => e.into(),
    }
}

/// Images are store refs named like the image (snapshot refs live under `grove/`, which image names cannot use).
pub struct NodefsImages {
    store: Arc<dyn FsService>,
    snapshotter: Option<Arc<Snapshotter>>,
}

impl NodefsImages {
    fn vacant(&self, name: &str) -> BackendResult<()> {
        check_name("name", name)?;
        if self.store.get_ref(name)?.is_some() {
            return Err(BackendError::Exists {
                what: "image",
                name: name.into(),
            });
        }
        Ok(())
    }

    fn commit(&self, name: &str, id: ManifestId) -> BackendResult<Image> {
        self.store.set_ref(name, &id)?;
        let size_bytes = self.store.manifest_bytes(&id).ok();
        Ok(Image {
            name: name.into(),
            root: Some(id.to_hex()),
            size_bytes,
            config: None,
        })
    }
}

impl Images for NodefsImages {
    fn kind(&self) -> &'static str {
        "nodefs"
    }

    fn list(&self) -> BackendResult<Vec<Image>> {
        let refs = self.store.refs()?;
        Ok(refs
            .into_iter()
            .filter(|(n, _)| !n.contains('/'))
            .map(|(name, id)| Image {
                name,
                root: Some(id.to_hex()),
                size_bytes: None,
                config: None,
            })
            .collect())
    }

    fn import_dir(&self, name: &str, path: &Path) -> BackendResult<Image> {
        self.vacant(name)?;
        let id = self.store.import_dir(path, ImportPolicy::Cdc, None)?;
        self.commit(name, id)
    }

    fn import_tar(&self, name: &str, tar: &mut dyn Read) -> BackendResult<Image> {
        self.vacant(name)?;
        let id = self.store.import_tar(tar)?;
        self.commit(name, id)
    }

    fn import_oci(&self, name: &str, dir: &Path, reference: Option<&str>) -> BackendResult<Image> {
        self.vacant(name)?;
        let id = self.store.import_oci(dir, reference)?;
        self.commit(name, id)
    }

    fn delete(&self, name: &str) -> BackendResult<()> {
        check_name("name", name)?;
        if self.store.get_ref(name)?.is_none() {
            return Err(BackendError::NotFound {
                what: "image",
                name: name.into(),
            });
        }
        self.store.delete_ref(name).map_err(BackendError::from)
    }

    fn gc(&self) -> BackendResult<serde_json::Value> {
        let live: Vec<ManifestId> = self
            .snapshotter
            .as_ref()
            .map(|s| s.live_manifests())
            .unwrap_or_default();
        let r = self.store.gc(&live)?;
        Ok(serde_json::to_value(r).unwrap_or_default())
    }

    fn fsck(&self) -> BackendResult<(bool, serde_json::Value)> {
        let r = self.store.fsck()?;
        Ok((r.is_clean(), serde_json::to_value(&r).unwrap_or_default()))
    }

    fn store(&self) -> Option<Arc<dyn FsService>> {
        Some(self.store.clone())
    }
}

pub struct NodefsSnapshots {
    s: Arc<Snapshotter>,
    runtime: Arc<Runtime>,
}

fn to_wire(i: &SnapshotInfo) -> Snapshot {
    to_wire_with(i, None)
}

fn to_wire_with(i: &SnapshotInfo, error: Option<String>) -> Snapshot {
    Snapshot {
        error,
        id: i.id.clone(),
        name: i.name.clone().unwrap_or_else(|| i.id.clone()),
        source_sandbox: Some(i.source.clone()),
        image: Some(i.spec.image.clone()),
        created_at_ms: i.created_at_ms,
        size_bytes: Some(i.bytes_added),
        durable: i.durable,
        labels: i.spec.labels.clone(),
        expires_at_ms: None,
        parent: None,
        memory_dump: Some(i.memory_dump.as_str().into()),
        full_dump_reason: i.full_dump_reason.clone(),
    }
}

impl Snapshots for NodefsSnapshots {
    /// `durable` waits here rather than in the snapshotter: a snapshot whose images cannot be
    /// stored is deleted again (a failed request leaves nothing), and the source is stopped only
    /// once its snapshot is durable.
    fn snapshot(&self, id: &SandboxId, req: &SnapshotRequest) -> BackendResult<Snapshot> {
        let opts = SnapshotOptions {
            name: req.name.clone(),
            stop: req.stop && !req.durable,
            durable: false,
        };
        let info = self.s.snapshot(id, opts)?;
        if !req.durable {
            return Ok(to_wire(&info));
        }
        let info = match self.s.wait_durable(&info.id, DURABLE_WAIT) {
            Ok(i) => i,
            Err(e) => {
                if let Err(d) = self.s.delete(&info.id) {
                    tracing::warn!(snapshot = %info.id, "deleting a snapshot that is not durable: {}", chain(&d));
                }
                return Err(durable_err(e));
            }
        };
        if req.stop {
            self.runtime.destroy(id)?;
        }
        Ok(to_wire(&info))
    }

    fn fork(
        &self,
        name: &str,
        req: &ForkRequest,
    ) -> BackendResult<Vec<BackendResult<SandboxInfo>>> {
        let opts = ForkOptions {
            labels: req.labels.clone(),
            ttl_secs: req.ttl_secs,
            hostname_prefix: req.hostname_prefix.clone(),
            queue_timeout_ms: req.queue_timeout_ms,
        };
        let results = self.s.fork(name, req.count, opts)?;
        Ok(results
            .into_iter()
            .map(|r| r.map_err(BackendError::from))
            .collect())
    }

    fn list(&self) -> BackendResult<Vec<Snapshot>> {
        let mut failed = self.s.import_failures();
        Ok(self
            .s
            .list()
            .iter()
            .map(|i| to_wire_with(i, failed.remove(&i.id)))
            .collect())
    }

    fn get(&self, name: &str) -> BackendResult<Snapshot> {
        let i = self.s.get(name)?;
        let error = self.s.import_failures().remove(&i.id);
        Ok(to_wire_with(&i, error))
    }

    fn import_failures(&self) -> Vec<(String, String)> {
        let failed = self.s.import_failures();
        self.s
            .list()
            .iter()
            .filter_map(|i| Some((to_wire(i).name, failed.get(&i.id)?.clone())))
            .collect()
    }

    fn retry_imports(&self) -> usize {
        self.s.retry_imports()
    }

    fn delete(&self, name: &str) -> BackendResult<()> {
        self.s.delete(name).map_err(BackendError::from)
    }

    fn export(
        &self,
        name: &str,
        only: Option<&HashSet<ObjectId>>,
        out: &mut dyn Write,
    ) -> BackendResult<()> {
        match only {
            None => self.s.export(name, out),
            Some(only) => self.s.export_delta(name, Some(only), out),
        }
        .map(|_| ())
        .map_err(BackendError::from)
    }

    fn objects(&self, name: &str) -> BackendResult<Vec<ObjectId>> {
        self.s.objects(name).map_err(BackendError::from)
    }

    fn missing(&self, ids: &[ObjectId]) -> BackendResult<Vec<ObjectId>> {
        self.s.lacking(ids).map_err(BackendError::from)
    }

    fn import(&self, input: &mut dyn Read) -> BackendResult<Snapshot> {
        self.s
            .import(input)
            .map(|i| to_wire(&i))
            .map_err(BackendError::from)
    }

    fn pause(&self, id: &SandboxId) -> BackendResult<SandboxInfo> {
        self.s.pause(id).map(|(i, _)| i).map_err(BackendError::from)
    }

    fn resume(&self, id: &SandboxId) -> BackendResult<SandboxInfo> {
        self.s
            .resume(id)
            .map(|(i, _)| i)
            .map_err(BackendError::from)
    }

    fn close(&self) {
        self.s.close();
    }
}
