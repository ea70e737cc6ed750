//! `NodefsRoot`: the runtime's `RootProvider` backed by nodefs copy-on-write views.

use std::any::Any;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use grove_runtime::{DiskQuota, DiskUsage, RootError, RootMount, RootProvider, SandboxId};
use nodefs::{Mount, MountOptions, NodeFs, Store};

/// Mounts sandbox roots as nodefs views of a manifest; `image` is a store ref name or a
/// manifest hex (a snapshot's fs root).
#[derive(Debug, Clone)]
pub struct NodefsRoot {
    fs: Arc<NodeFs>,
}

impl NodefsRoot {
    pub fn new(fs: Arc<NodeFs>) -> NodefsRoot {
        NodefsRoot { fs }
    }

    pub fn store(&self) -> &Arc<Store> {
        self.fs.store()
    }

    pub fn nodefs(&self) -> &Arc<NodeFs> {
        &self.fs
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
            .store()
            .resolve(image)
            .map_err(|e| RootError::with_source(format!("image {image:?} for {id}"), e))?;
        let opts = MountOptions {
            quota_bytes: disk.bytes,
            quota_inodes: disk.inodes,
            upper_dir: Self::upper_dir(target),
            read_only: false,
        };
        let mount = self.fs.mount(&base, target, opts).map_err(|e| {
            RootError::with_source(
                format!("nodefs mount of {image:?} at {} for {id}", target.display()),
                e,
            )
        })?;
        Ok(Box::new(NodefsRootMount { mount }))
    }

    fn image_exists(&self, image: &str) -> bool {
        self.store().resolve(image).is_ok()
    }
}

/// A mounted nodefs root; `as_any` downcasts to this to reach `mount()` for commits.
#[derive(Debug)]
pub struct NodefsRootMount {
    mount: Arc<Mount>,
}

impl NodefsRootMount {
    pub fn mount(&self) -> &Arc<Mount> {
        &self.mount
    }
}

impl RootMount for NodefsRootMount {
    fn usage(&self) -> DiskUsage {
        let u = self.mount.usage();
        DiskUsage {
            bytes: u.bytes,
            inodes: u.inodes,
        }
    }

    fn unmount(&self) -> Result<(), RootError> {
        self.mount.unmount().map_err(|e| {
            RootError::with_source(
                format!("nodefs unmount of {}", self.mount.mountpoint().display()),
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
