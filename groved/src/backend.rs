//! What groved serves besides the runtime: images and snapshots, behind traits so the HTTP layer does not care
//! whether roots come from nodefs or from plain overlayfs directories.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use axum::http::StatusCode;
use grove_runtime::{SandboxId, SandboxInfo};
use nodefs::ObjectId;

use crate::api_shapes::{ForkRequest, Image, Snapshot, SnapshotRequest};
use crate::error::{ApiError, ApiResult};

/// Image storage: import, list, delete, and store maintenance.
pub trait Images: Send + Sync {
    /// "nodefs" or "overlay".
    fn kind(&self) -> &'static str;
    fn list(&self) -> ApiResult<Vec<Image>>;
    fn import_dir(&self, name: &str, path: &Path) -> ApiResult<Image>;
    fn import_tar(&self, name: &str, tar: &mut dyn Read) -> ApiResult<Image>;
    fn import_oci(&self, name: &str, dir: &Path, reference: Option<&str>) -> ApiResult<Image>;
    fn delete(&self, name: &str) -> ApiResult<()>;
    /// Frees unreferenced content; returns the store's report.
    fn gc(&self) -> ApiResult<serde_json::Value>;
    /// Checks the store; returns (clean, report).
    fn fsck(&self) -> ApiResult<(bool, serde_json::Value)>;
    /// The content store behind the images, for work that builds trees in it layer by layer
    /// (registry pulls); None when images are plain directories.
    fn store(&self) -> Option<std::sync::Arc<dyn nodefs::service::FsService>> {
        None
    }
}

/// Snapshots of running sandboxes and forks of them.
pub trait Snapshots: Send + Sync {
    fn snapshot(&self, id: &SandboxId, req: &SnapshotRequest) -> ApiResult<Snapshot>;
    /// One result per branch.
    fn fork(&self, name: &str, req: &ForkRequest) -> ApiResult<Vec<ApiResult<SandboxInfo>>>;
    fn list(&self) -> ApiResult<Vec<Snapshot>>;
    fn get(&self, name: &str) -> ApiResult<Snapshot>;
    fn delete(&self, name: &str) -> ApiResult<()>;
    /// The whole snapshot, or with `only` just those of its objects (a delta for a receiver that
    /// holds the rest).
    fn export(
        &self,
        name: &str,
        only: Option<&HashSet<ObjectId>>,
        out: &mut dyn Write,
    ) -> ApiResult<()>;
    /// Every object the snapshot reaches.
    fn objects(&self, name: &str) -> ApiResult<Vec<ObjectId>>;
    /// The ones among `ids` this node lacks.
    fn missing(&self, ids: &[ObjectId]) -> ApiResult<Vec<ObjectId>>;
    fn import(&self, input: &mut dyn Read) -> ApiResult<Snapshot>;
    /// Pause to the store: the sandbox's processes stop and its memory is freed.
    /// 501 `unsupported` for sandboxes that cannot be checkpointed.
    fn pause(&self, id: &SandboxId) -> ApiResult<SandboxInfo>;
    /// Restore a sandbox paused to the store, under its id.
    fn resume(&self, id: &SandboxId) -> ApiResult<SandboxInfo>;
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
pub fn check_name(field: &str, name: &str) -> ApiResult<()> {
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
        Err(ApiError::invalid(
            field,
            format!("{name:?}: 1-128 chars of [A-Za-z0-9._-], not starting with . or -"),
        )
        .with_field(field))
    }
}

/// Names the API's own routes take beside `/v1/images/{name}` (`/v1/images/pull`, `.../build`):
/// an image so named could not be inspected or deleted by name.
const ROUTE_IMAGE_NAMES: &[&str] = &["pull", "build"];
/// The same beside `/v1/snapshots/{name}` (`/v1/snapshots/gc`, `.../missing`, `.../pull`).
const ROUTE_SNAPSHOT_NAMES: &[&str] = &["gc", "missing", "pull"];

/// [`check_name`] for a new image, which may not take a name the routes use.
pub fn check_new_image_name(field: &str, name: &str) -> ApiResult<()> {
    check_name(field, name)?;
    reserved(field, name, ROUTE_IMAGE_NAMES, "/v1/images")
}

/// [`check_name`] for a new snapshot, which may not take a name the routes use.
pub fn check_new_snapshot_name(field: &str, name: &str) -> ApiResult<()> {
    check_name(field, name)?;
    reserved(field, name, ROUTE_SNAPSHOT_NAMES, "/v1/snapshots")
}

fn reserved(field: &str, name: &str, taken: &[&str], under: &str) -> ApiResult<()> {
    if taken.contains(&name) {
        return Err(ApiError::invalid(
            field,
            format!("{name:?} is reserved: {under}/{name} is a route of the API"),
        )
        .with_field(field));
    }
    Ok(())
}

/// A host path given in a request: absolute and existing.
pub fn check_host_dir(field: &str, path: &str) -> ApiResult<PathBuf> {
    let p = PathBuf::from(path);
    if !p.is_absolute() {
        return Err(ApiError::invalid(
            field,
            format!("{path:?} is not an absolute path"),
        ));
    }
    if !p.is_dir() {
        return Err(ApiError::not_found(
            "path_not_found",
            format!("{path:?} is not a directory on the node"),
        )
        .with_field(field));
    }
    Ok(p)
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

    fn vacant(&self, name: &str) -> ApiResult<PathBuf> {
        check_name("name", name)?;
        let p = self.dir.join(name);
        if p.symlink_metadata().is_ok() {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "image_exists",
                format!("image {name:?} exists"),
            )
            .with_field("name"));
        }
        Ok(p)
    }
}

fn io_err(what: &str, e: std::io::Error) -> ApiError {
    ApiError::internal(format!("{what}: {e}"))
}

impl Images for OverlayImages {
    fn kind(&self) -> &'static str {
        "overlay"
    }

    fn list(&self) -> ApiResult<Vec<Image>> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.dir).map_err(|e| io_err("listing images", e))? {
            let e = e.map_err(|e| io_err("listing images", e))?;
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with('.') {
                out.push(self.image(&name));
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    fn import_dir(&self, name: &str, path: &Path) -> ApiResult<Image> {
        let target = self.vacant(name)?;
        let src = std::fs::canonicalize(path).map_err(|e| io_err("resolving the source", e))?;
        std::os::unix::fs::symlink(&src, &target).map_err(|e| io_err("linking the image", e))?;
        Ok(self.image(name))
    }

    fn import_tar(&self, name: &str, tar: &mut dyn Read) -> ApiResult<Image> {
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
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_tar",
                format!("unpacking: {e}"),
            )
            .with_field("body"));
        }
        Ok(self.image(name))
    }

    fn import_oci(&self, _name: &str, _dir: &Path, _reference: Option<&str>) -> ApiResult<Image> {
        Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "unsupported",
            "OCI import needs the nodefs image store",
        ))
    }

    fn delete(&self, name: &str) -> ApiResult<()> {
        check_name("name", name)?;
        let p = self.dir.join(name);
        let meta = p.symlink_metadata().map_err(|_| {
            ApiError::not_found("image_not_found", format!("image {name:?} not found"))
        })?;
        let res = if meta.file_type().is_symlink() {
            std::fs::remove_file(&p)
        } else {
            std::fs::remove_dir_all(&p)
        };
        res.map_err(|e| io_err("removing the image", e))
    }

    fn gc(&self) -> ApiResult<serde_json::Value> {
        Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "unsupported",
            "gc needs the nodefs image store",
        ))
    }

    fn fsck(&self) -> ApiResult<(bool, serde_json::Value)> {
        Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "unsupported",
            "fsck needs the nodefs image store",
        ))
    }
}
