//! `NodefsRoot`: the runtime's `RootProvider` backed by nodefs copy-on-write views. Its own
//! crate, beside the runtime (which links neither nodefs nor FUSE, so grove-init stays libc/nix
//! only) and the snapshotter (which only commits roots, through `RootMount::committer`): groved's
//! backend, the bench and the snapshotter's tests make one.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use grove_runtime::{
    CommitRoot, DiskQuota, DiskUsage, RootError, RootMount, RootProvider, SandboxId,
};
use nodefs::service::{FsService, MountInfo};
use nodefs::{ManifestId, MountOptions};

/// Mounts sandbox roots as nodefs views of a manifest; `image` is a store ref name or a
/// manifest hex (a snapshot's fs root). The views are served by an [`FsService`]: in-process,
/// or `grove-fsd`, whose mounts outlive the daemon and are re-attached after its restart.
#[derive(Debug, Clone)]
pub struct NodefsRoot {
    svc: Arc<dyn FsService>,
    upper_root: PathBuf,
}

impl NodefsRoot {
    /// Sandbox `id` writes to `<upper_root>/<id>`, made at its first write. The upper root belongs
    /// on disk (`<state_dir>/uppers`): what a sandbox writes is bounded by its disk quota, not by
    /// memory, and the run dir, a tmpfs on a systemd node, keeps only records and mountpoints.
    pub fn new(svc: Arc<dyn FsService>, upper_root: impl Into<PathBuf>) -> NodefsRoot {
        NodefsRoot {
            svc,
            upper_root: upper_root.into(),
        }
    }

    pub fn service(&self) -> &Arc<dyn FsService> {
        &self.svc
    }

    fn upper_dir(&self, id: &SandboxId) -> PathBuf {
        self.upper_root.join(id.as_str())
    }
}

impl RootProvider for NodefsRoot {
    fn mount_root(
        &self,
        id: &SandboxId,
        image: &str,
        target: &Path,
        disk: &DiskQuota,
        ids: Option<grove_runtime::userns::IdRange>,
    ) -> Result<Box<dyn RootMount>, RootError> {
        let base = self
            .svc
            .resolve(image)
            .map_err(|e| RootError::with_source(format!("image {image:?} for {id}"), e))?;
        let opts = MountOptions {
            quota_bytes: disk.bytes,
            quota_inodes: disk.inodes,
            upper_dir: self.upper_dir(id),
            read_only: false,
            passthrough: true,
            uring: true,
            id_shift: ids.map(|r| nodefs::IdShift {
                base: r.base,
                size: r.size,
            }),
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
            upper_dir: self.upper_dir(id),
        }))
    }

    fn shifts_ids(&self) -> bool {
        true
    }

    /// Only the store's own answer says an image is absent: a store that cannot be asked (grove-fsd
    /// down) is not "not found", and the mount that follows reports the real failure.
    fn image_exists(&self, image: &str) -> bool {
        use nodefs::Error as E;
        !matches!(
            self.svc.resolve(image),
            Err(E::UnknownRef(_) | E::UnknownManifest(_) | E::BadRefName(_))
        )
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
            upper_dir: self.upper_dir(id),
        }))
    }

    /// The roots whose mount the server does not serve: it died, and the one answering now (the
    /// call starts one if none does) never heard of them. Mount ids are never reused across
    /// servers, so an id alone tells. When no server can be reached, nothing is reported; the
    /// next call asks again.
    fn lost(&self, roots: &[(SandboxId, Arc<dyn RootMount>)]) -> Vec<SandboxId> {
        let served: std::collections::HashSet<u64> = match self.svc.mounts() {
            Ok(m) => m.into_iter().map(|m| m.id).collect(),
            Err(e) => {
                tracing::warn!(error = %e, "listing the nodefs mounts");
                return Vec::new();
            }
        };
        roots
            .iter()
            .filter_map(|(id, root)| {
                let mount_id = root.served_mount_id()?;
                (!served.contains(&mount_id)).then(|| id.clone())
            })
            .collect()
    }

    fn upper_dirs(&self) -> Vec<(String, PathBuf)> {
        let Ok(rd) = std::fs::read_dir(&self.upper_root) else {
            return Vec::new();
        };
        rd.flatten()
            .filter_map(|e| Some((e.file_name().into_string().ok()?, e.path())))
            .collect()
    }
}

/// A mounted nodefs root; it commits (`RootMount::committer`) for snapshots and build steps.
#[derive(Debug)]
pub struct NodefsRootMount {
    svc: Arc<dyn FsService>,
    info: MountInfo,
    upper_dir: PathBuf,
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
        let mp = &self.info.mountpoint;
        let e = match self.svc.unmount(self.info.id) {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        // UnknownMount: the server that served the mount died (killed, crashed) and the one
        // answering now never served it. Any other failure: ask whether a server still serves
        // it; one that does failed the call itself (a pooled connection to it had dropped), so
        // ask once more. Otherwise the kernel mount is dead and, with the upper layer, ours to
        // take down.
        if !matches!(e, nodefs::Error::UnknownMount(_))
            && self
                .svc
                .mounts()
                .is_ok_and(|m| m.iter().any(|m| m.id == self.info.id))
        {
            return self.svc.unmount(self.info.id).map_err(|e| {
                RootError::with_source(format!("nodefs unmount of {}", mp.display()), e)
            });
        }
        tracing::warn!(mountpoint = %mp.display(), error = %e, "no nodefs server serves this root any more; unmounting it here");
        grove_runtime::mounts::unmount_if_mounted(mp)
            .map_err(|e| RootError::with_source(format!("unmount {}", mp.display()), e))?;
        match std::fs::remove_dir_all(&self.upper_dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(RootError::with_source(
                format!("remove {}", self.upper_dir.display()),
                e,
            )),
            _ => Ok(()),
        }
    }

    fn committer(&self) -> Option<&dyn CommitRoot> {
        Some(self)
    }

    fn served_mount_id(&self) -> Option<u64> {
        Some(self.info.id)
    }
}

impl CommitRoot for NodefsRootMount {
    fn commit(&self) -> Result<[u8; 32], RootError> {
        self.svc
            .commit(self.info.id)
            .map(|m| m.0)
            .map_err(|e| self.failed("commit", e))
    }

    fn commit_unsealed(&self) -> Result<[u8; 32], RootError> {
        self.svc
            .commit_unsealed(self.info.id)
            .map(|m| m.0)
            .map_err(|e| self.failed("commit", e))
    }

    fn seal(&self, id: &[u8; 32]) -> Result<(), RootError> {
        self.svc
            .seal_commit(self.info.id, &nodefs::ObjectId(*id))
            .map_err(|e| self.failed("sealing the commit", e))
    }
}

impl NodefsRootMount {
    fn failed(&self, what: &str, e: nodefs::Error) -> RootError {
        let mp = self.info.mountpoint.display();
        RootError::with_source(format!("nodefs {what} of {mp}"), e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upper_dirs_are_named_by_sandbox_in_the_upper_root() {
        let tmp = tempfile::tempdir().unwrap();
        let svc = Arc::new(nodefs::service::Local::open(&tmp.path().join("store")).unwrap());
        let roots = NodefsRoot::new(svc, tmp.path().join("uppers"));
        let id: SandboxId = "sb-0123456789ab".parse().unwrap();
        assert_eq!(
            roots.upper_dir(&id),
            tmp.path().join("uppers/sb-0123456789ab")
        );
        assert!(
            roots.upper_dirs().is_empty(),
            "no upper root yet: nothing listed"
        );
        std::fs::create_dir_all(roots.upper_dir(&id)).unwrap();
        assert_eq!(
            roots.upper_dirs(),
            vec![("sb-0123456789ab".to_string(), roots.upper_dir(&id))]
        );
    }
}
