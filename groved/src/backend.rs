//! What groved serves besides the runtime: images and snapshots, behind traits so the HTTP layer does not care
//! whether roots come from nodefs or from plain overlayfs directories.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use grove_runtime::{SandboxId, SandboxInfo};
use nodefs::ObjectId;

use crate::api_shapes::{ForkRequest, Image, Snapshot, SnapshotRequest};

/// What the image and snapshot backends fail with: the domain's conditions, with what and which
/// name or field, and the stores' own typed errors. The HTTP status and body of each is decided in
/// one place, `impl From<BackendError> for ApiError` in `error.rs`.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// No such image (the snapshotter reports missing snapshots itself).
    #[error("{what} {name:?} not found")]
    NotFound { what: &'static str, name: String },
    /// The name is taken: a new image may not replace one.
    #[error("{what} {name:?} exists")]
    Exists { what: &'static str, name: String },
    /// A value of the request the backend refuses, named by its field.
    #[error("{reason}")]
    InvalidInput { field: String, reason: String },
    /// An uploaded tar that does not unpack: the request's fault, not the node's.
    #[error("unpacking: {error}")]
    BadTar { error: std::io::Error },
    /// What only the nodefs image store can do, asked of plain overlay directories.
    #[error("{what} needs the nodefs image store")]
    Unsupported { what: &'static str },
    /// A durable snapshot whose images could not be stored (it is deleted again): a full store
    /// is told apart from other failures by the error's chain of causes, not its text.
    #[error(transparent)]
    NotDurable(grove_snapshotter::Error),
    /// A file operation of the overlay backend on the node's own directories.
    #[error("{what}: {error}")]
    Io {
        what: &'static str,
        error: std::io::Error,
    },
    /// A store operation the request cannot have got wrong (naming a checked ref, reading
    /// refs): the node's failure, whatever the store's variant.
    #[error("the store")]
    Store(#[source] nodefs::Error),
    /// The content store's own errors, mapped by their variant.
    #[error(transparent)]
    Images(#[from] nodefs::Error),
    /// The snapshotter's own errors (and the runtime's and store's it wraps).
    #[error(transparent)]
    Snapshots(#[from] grove_snapshotter::Error),
    /// The runtime's errors (a durable snapshot's source stopped).
    #[error(transparent)]
    Runtime(#[from] grove_runtime::Error),
}

/// A backend's answer.
pub type BackendResult<T> = Result<T, BackendError>;

/// Image storage: import, list, delete, and store maintenance.
pub trait Images: Send + Sync {
    /// "nodefs" or "overlay".
    fn kind(&self) -> &'static str;
    fn list(&self) -> BackendResult<Vec<Image>>;
    fn import_dir(&self, name: &str, path: &Path) -> BackendResult<Image>;
    fn import_tar(&self, name: &str, tar: &mut dyn Read) -> BackendResult<Image>;
    fn import_oci(&self, name: &str, dir: &Path, reference: Option<&str>) -> BackendResult<Image>;
    fn delete(&self, name: &str) -> BackendResult<()>;
    /// Frees unreferenced content; returns the store's report.
    fn gc(&self) -> BackendResult<serde_json::Value>;
    /// Checks the store; returns (clean, report).
    fn fsck(&self) -> BackendResult<(bool, serde_json::Value)>;
    /// The content store behind the images, for work that builds trees in it layer by layer
    /// (registry pulls); None when images are plain directories.
    fn store(&self) -> Option<std::sync::Arc<dyn nodefs::service::FsService>> {
        None
    }
}

/// Snapshots of running sandboxes and forks of them.
pub trait Snapshots: Send + Sync {
    fn snapshot(&self, id: &SandboxId, req: &SnapshotRequest) -> BackendResult<Snapshot>;
    /// One result per branch.
    fn fork(&self, name: &str, req: &ForkRequest)
        -> BackendResult<Vec<BackendResult<SandboxInfo>>>;
    fn list(&self) -> BackendResult<Vec<Snapshot>>;
    fn get(&self, name: &str) -> BackendResult<Snapshot>;
    fn delete(&self, name: &str) -> BackendResult<()>;
    /// The whole snapshot, or with `only` just those of its objects (a delta for a receiver that
    /// holds the rest).
    fn export(
        &self,
        name: &str,
        only: Option<&HashSet<ObjectId>>,
        out: &mut dyn Write,
    ) -> BackendResult<()>;
    /// Every object the snapshot reaches.
    fn objects(&self, name: &str) -> BackendResult<Vec<ObjectId>>;
    /// The ones among `ids` this node lacks.
    fn missing(&self, ids: &[ObjectId]) -> BackendResult<Vec<ObjectId>>;
    fn import(&self, input: &mut dyn Read) -> BackendResult<Snapshot>;
    /// Pause to the store: the sandbox's processes stop and its memory is freed.
    /// 501 `unsupported` for sandboxes that cannot be checkpointed.
    fn pause(&self, id: &SandboxId) -> BackendResult<SandboxInfo>;
    /// Restore a sandbox paused to the store, under its id.
    fn resume(&self, id: &SandboxId) -> BackendResult<SandboxInfo>;
    /// At an orderly stop with no sandbox left: removes the snapshotter's scratch it can.
    fn close(&self);
    /// Snapshots (by name) whose background import failed, with the reason.
    fn import_failures(&self) -> Vec<(String, String)> {
        Vec::new()
    }
    /// Queues the failed imports again; returns how many.
    fn retry_imports(&self) -> usize {
        0
    }
}

/// Names of images and snapshots: what a ref may be called.
pub fn check_name(field: &str, name: &str) -> BackendResult<()> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with(['.', '-'])
        && !name.contains("..")
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(BackendError::InvalidInput {
            field: field.into(),
            reason: format!("{name:?}: 1-128 chars of [A-Za-z0-9._-], not starting with . or -"),
        })
    }
}

/// Names the API's own routes take beside `/v1/images/{name}` (`/v1/images/pull`, `.../build`):
/// an image so named could not be inspected or deleted by name.
const ROUTE_IMAGE_NAMES: &[&str] = &["pull", "build"];
/// The same beside `/v1/snapshots/{name}` (`/v1/snapshots/gc`, `.../missing`, `.../pull`).
const ROUTE_SNAPSHOT_NAMES: &[&str] = &["gc", "missing", "pull"];

/// [`check_name`] for a new image, which may not take a name the routes use.
pub fn check_new_image_name(field: &str, name: &str) -> BackendResult<()> {
    check_name(field, name)?;
    reserved(field, name, ROUTE_IMAGE_NAMES, "/v1/images")
}

/// [`check_name`] for a new snapshot, which may not take a name the routes use.
pub fn check_new_snapshot_name(field: &str, name: &str) -> BackendResult<()> {
    check_name(field, name)?;
    reserved(field, name, ROUTE_SNAPSHOT_NAMES, "/v1/snapshots")
}

fn reserved(field: &str, name: &str, taken: &[&str], under: &str) -> BackendResult<()> {
    if taken.contains(&name) {
        return Err(BackendError::InvalidInput {
            field: field.into(),
            reason: format!("{name:?} is reserved: {under}/{name} is a route of the API"),
        });
    }
    Ok(())
}

/// Images as directories under `<state>/images/<name>`, mounted with the runtime's kernel-overlayfs root
/// provider. Used when nodefs is not configured. A directory import is a symlink to the source (no copy).
pub struct OverlayImages {
    dir: PathBuf,
}

impl OverlayImages {
    pub fn new(state_dir: &Path) -> std::io::Result<Self> {
        let dir = state_dir.join("images");
        std::fs::create_dir_all(&dir)?;
        Ok(OverlayImages { dir })
    }

    fn image(&self, name: &str) -> Image {
        let root = std::fs::canonicalize(self.dir.join(name))
            .ok()
            .map(|p| p.display().to_string());
        Image {
            name: name.to_string(),
            root,
            size_bytes: None,
            config: None,
        }
    }

    fn vacant(&self, name: &str) -> BackendResult<PathBuf> {
        check_name("name", name)?;
        let p = self.dir.join(name);
        if p.symlink_metadata().is_ok() {
            return Err(BackendError::Exists {
                what: "image",
                name: name.into(),
            });
        }
        Ok(p)
    }
}

fn io_err(what: &'static str) -> impl FnOnce(std::io::Error) -> BackendError {
    move |error| BackendError::Io { what, error }
}

impl Images for OverlayImages {
    fn kind(&self) -> &'static str {
        "overlay"
    }

    fn list(&self) -> BackendResult<Vec<Image>> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.dir).map_err(io_err("listing images"))? {
            let e = e.map_err(io_err("listing images"))?;
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with('.') {
                out.push(self.image(&name));
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    fn import_dir(&self, name: &str, path: &Path) -> BackendResult<Image> {
        let target = self.vacant(name)?;
        let src = std::fs::canonicalize(path).map_err(io_err("resolving the source"))?;
        std::os::unix::fs::symlink(&src, &target).map_err(io_err("linking the image"))?;
        Ok(self.image(name))
    }

    fn import_tar(&self, name: &str, tar: &mut dyn Read) -> BackendResult<Image> {
        let target = self.vacant(name)?;
        let tmp = self
            .dir
            .join(format!(".import-{name}-{}", std::process::id()));
        let res = (|| {
            std::fs::create_dir_all(&tmp)?;
            let mut ar = tar::Archive::new(tar);
            ar.set_preserve_permissions(true);
            ar.set_preserve_ownerships(true);
            ar.unpack(&tmp)?;
            std::fs::rename(&tmp, &target)
        })();
        if let Err(e) = res {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(BackendError::BadTar { error: e });
        }
        Ok(self.image(name))
    }

    fn import_oci(
        &self,
        _name: &str,
        _dir: &Path,
        _reference: Option<&str>,
    ) -> BackendResult<Image> {
        Err(BackendError::Unsupported { what: "OCI import" })
    }

    fn delete(&self, name: &str) -> BackendResult<()> {
        check_name("name", name)?;
        let p = self.dir.join(name);
        let meta = p.symlink_metadata().map_err(|_| BackendError::NotFound {
            what: "image",
            name: name.into(),
        })?;
        let res = if meta.file_type().is_symlink() {
            std::fs::remove_file(&p)
        } else {
            std::fs::remove_dir_all(&p)
        };
        res.map_err(io_err("removing the image"))
    }

    fn gc(&self) -> BackendResult<serde_json::Value> {
        Err(BackendError::Unsupported { what: "gc" })
    }

    fn fsck(&self) -> BackendResult<(bool, serde_json::Value)> {
        Err(BackendError::Unsupported { what: "fsck" })
    }
}
