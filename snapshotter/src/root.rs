//! `NodefsRoot`: the runtime's `RootProvider` backed by nodefs copy-on-write views.

use std::any::Any;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use grove_runtime::{DiskQuota, DiskUsage, RootError, RootMount, RootProvider, SandboxId};
use nodefs::service::{FsService, MountInfo};
use nodefs::{ManifestId, MountOptions};

/// Mounts sandbox roots as nodefs views of a manifest; `image` is a store ref name or a
/// manifest hex (a snapshot's fs root). The views are served by an [`FsService`]: in-process,
/// or `grove-fsd`, whose mounts outlive the daemon and are re-attached after its restart.
#[derive(Debug, Clone)]
pub struct NodefsRoot {
    svc: Arc<dyn FsService>,
}

impl NodefsRoot {
    pub fn new(svc: Arc<dyn FsService>) -> NodefsRoot {
        NodefsRoot { svc }
    }

    pub fn service(&self) -> &Arc<dyn FsService> {
        &self.svc
    }

    /// The upper (scratch) layer lives next to the mountpoint, in the sandbox's run dir.
    fn upper_dir(target: &Path) -> PathBuf {
        let name = target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "root".into());
        target.with_file_name(format!("{name}.nodefs-upper"))
    }
}

impl RootProvider for NodefsRoot {
    fn mount_root(
        &self,
        id: &SandboxId,
        image: &str,
        target: &Path,
        disk: &DiskQuota,
    ) -> Result<Box<dyn RootMount>, RootError> {
        let base = self
            .svc
            .resolve(image)
            .map_err(|e| RootError::with_source(format!("image {image:?} for {id}"), e))?;
        let opts = MountOptions {
            quota_bytes: disk.bytes,
            quota_inodes: disk.inodes,
            upper_dir: Self::upper_dir(target),
            read_only: false,
            passthrough: true,
        };
        let info = self.svc.mount(&base, target, &opts).map_err(|e| {
            RootError::with_source(
                format!("nodefs mount of {image:?} at {} for {id}", target.display()),
                e,
            )
        })?;
        Ok(Box::new(NodefsRootMount {
            svc: self.svc.clone(),
            info,
        }))
    }

    fn image_exists(&self, image: &str) -> bool {
        self.svc.resolve(image).is_ok()
    }

    /// The server still serves a mount at `target` (it outlived the daemon): adopt it.
    fn reattach(&self, id: &SandboxId, _image: &str, target: &Path) -> Option<Box<dyn RootMount>> {
        let mounts = match self.svc.mounts() {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "listing the nodefs mounts");
                return None;
            }
        };
        let info = mounts.into_iter().find(|m| m.mountpoint == target)?;
        Some(Box::new(NodefsRootMount {
            svc: self.svc.clone(),
            info,
        }))
    }
}

/// A mounted nodefs root; `as_any` downcasts to this to reach `commit()` for snapshots.
#[derive(Debug)]
pub struct NodefsRootMount {
    svc: Arc<dyn FsService>,
    info: MountInfo,
}

impl NodefsRootMount {
    /// Commits the view's current state as a manifest.
    pub fn commit(&self) -> Result<ManifestId, nodefs::Error> {
        self.svc.commit(self.info.id)
    }

    pub fn base(&self) -> ManifestId {
        self.info.base
    }
}

impl RootMount for NodefsRootMount {
    fn usage(&self) -> DiskUsage {
        match self.svc.usage(self.info.id) {
            Ok(u) => DiskUsage {
                bytes: u.bytes,
                inodes: u.inodes,
            },
            Err(e) => {
                tracing::debug!(mountpoint = %self.info.mountpoint.display(), error = %e, "usage");
                DiskUsage::default()
            }
        }
    }

    fn unmount(&self) -> Result<(), RootError> {
        self.svc.unmount(self.info.id).map_err(|e| {
            RootError::with_source(
                format!("nodefs unmount of {}", self.info.mountpoint.display()),
                e,
            )
        })
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upper_dir_is_a_sibling_of_the_mountpoint() {
        assert_eq!(
            NodefsRoot::upper_dir(Path::new("/run/grove/sandboxes/sb-1/root")),
            PathBuf::from("/run/grove/sandboxes/sb-1/root.nodefs-upper")
        );
    }
}
