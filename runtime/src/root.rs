//! How a sandbox root is provided: the `RootProvider` seam, plus `OverlayRoot` (kernel overlayfs over
//! `<state_dir>/images/<name>`). Disk quotas are NOT enforced by `OverlayRoot` (nodefs enforces them).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::types::SandboxId;
use crate::userns::IdRange;

/// Mounts sandbox roots.
pub trait RootProvider: Send + Sync {
    /// Mounts a writable view of `image` at `target` (an existing empty directory). `ids`: the
    /// host id range of a sandbox in a user namespace, which must see the image's owners
    /// through it (image id N as host id `base + N`); a provider that cannot shift refuses.
    fn mount_root(
        &self,
        id: &SandboxId,
        image: &str,
        target: &Path,
        disk: &DiskQuota,
        ids: Option<IdRange>,
    ) -> Result<Box<dyn RootMount>, RootError>;
    fn image_exists(&self, image: &str) -> bool;
    /// Whether `mount_root` can show owners through a user namespace's id range.
    fn shifts_ids(&self) -> bool {
        false
    }
    /// The root a previous process of this provider mounted at `target` for `id`, if it still
    /// works (a restarted runtime adopting a live sandbox). None: it is gone, or it cannot outlive
    /// the process that served it; the sandbox is then reclaimed.
    fn reattach(&self, id: &SandboxId, image: &str, target: &Path) -> Option<Box<dyn RootMount>> {
        let _ = (id, image, target);
        None
    }
    /// The per-sandbox dirs this provider keeps outside the sandbox's run dir (nodefs upper layers
    /// on disk), by sandbox id. An unmount removes a sandbox's; one whose sandbox is not owned is
    /// residue, and recovery removes those of sandboxes it does not adopt.
    fn upper_dirs(&self) -> Vec<(String, PathBuf)> {
        Vec::new()
    }
    /// Which of these mounted roots no longer work because what served them is gone (a FUSE
    /// server that died): their sandboxes' files are lost. One call for them all, since the
    /// reaper asks on every tick. Kernel mounts do not get lost.
    fn lost(&self, roots: &[(SandboxId, Arc<dyn RootMount>)]) -> Vec<SandboxId> {
        let _ = roots;
        Vec::new()
    }
}

/// A mounted sandbox root.
pub trait RootMount: Send + Sync {
    fn usage(&self) -> DiskUsage;
    /// Idempotent; also drops the upper (writable) layer.
    fn unmount(&self) -> Result<(), RootError>;
    /// What saves this root's files as an immutable tree, if this kind of root can (a nodefs view
    /// commits a manifest; a kernel overlay cannot): the snapshotter commits a sandbox's root with
    /// its memory, groved's build engine the root of each RUN step.
    fn committer(&self) -> Option<&dyn CommitRoot> {
        None
    }
    /// The id the process serving this root (a FUSE server) gives its mount, for a root such a
    /// process serves; `RootProvider::lost` asks that server which ids it still serves. Kernel
    /// mounts have none.
    fn served_mount_id(&self) -> Option<u64> {
        None
    }
}

/// A root that can save its files as they are now as an immutable, content-addressed tree.
pub trait CommitRoot: Send + Sync {
    /// Saves the tree; its content address (for a nodefs root, the manifest id's 32 bytes).
    fn commit(&self) -> Result<[u8; 32], RootError>;
    /// The half of [`CommitRoot::commit`] that must see the tree at one instant (a snapshot
    /// runs it with the sandbox frozen): saved, not yet durable. [`CommitRoot::seal`] must
    /// follow before the address is recorded anywhere. By default, the whole commit.
    fn commit_unsealed(&self) -> Result<[u8; 32], RootError> {
        self.commit()
    }
    /// Makes a [`CommitRoot::commit_unsealed`] durable. By default there is nothing left to do.
    fn seal(&self, _id: &[u8; 32]) -> Result<(), RootError> {
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskQuota {
    pub bytes: Option<u64>,
    pub inodes: Option<u64>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskUsage {
    pub bytes: u64,
    pub inodes: u64,
}

/// A root provider failure: a message and an optional cause.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct RootError {
    pub message: String,
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl RootError {
    pub fn new(message: impl Into<String>) -> Self {
        RootError {
            message: message.into(),
            source: None,
        }
    }
    pub fn with_source(
        message: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        RootError {
            message: message.into(),
            source: Some(source.into()),
        }
    }
}

/// Kernel overlayfs over `<state_dir>/images/<name>`; upper/work dirs live next to the mountpoint
/// (`<target>/../upper`, `<target>/../work`) and are removed on unmount.
#[derive(Debug, Clone)]
pub struct OverlayRoot {
    images_dir: PathBuf,
}

impl OverlayRoot {
    /// `state_dir` holds `images/<name>`.
    pub fn new(state_dir: impl Into<PathBuf>) -> Self {
        OverlayRoot {
            images_dir: state_dir.into().join("images"),
        }
    }

    pub fn image_dir(&self, image: &str) -> Option<PathBuf> {
        let ok = !image.is_empty()
            && image != "."
            && image != ".."
            && image
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        ok.then(|| self.images_dir.join(image))
    }
}

/// Mounts the overlay with its layers named by fd, not by path: overlayfs shows its options as
/// given in every mountinfo, the sandbox's own included, and the paths are the host's.
fn mount_overlay(lower: &Path, upper: &Path, work: &Path, target: &Path) -> Result<(), RootError> {
    use std::os::fd::AsRawFd;
    let open = |d: &Path| {
        std::fs::File::open(d)
            .map_err(|e| RootError::with_source(format!("open {}", d.display()), e))
    };
    let (l, u, w) = (open(lower)?, open(upper)?, open(work)?);
    let data = format!(
        "lowerdir=/proc/self/fd/{},upperdir=/proc/self/fd/{},workdir=/proc/self/fd/{}",
        l.as_raw_fd(),
        u.as_raw_fd(),
        w.as_raw_fd()
    );
    nix::mount::mount(
        Some("grove-overlay"),
        target,
        Some("overlay"),
        // As nodefs mounts its roots: a setuid binary or a device node in a sandbox's root is inert,
        // on the host and (the bind inherits both) inside the sandbox.
        nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
        Some(data.as_str()),
    )
    .map_err(|e| RootError::with_source(format!("mount overlay at {}", target.display()), e))
}

impl RootProvider for OverlayRoot {
    fn mount_root(
        &self,
        _id: &SandboxId,
        image: &str,
        target: &Path,
        _disk: &DiskQuota,
        ids: Option<IdRange>,
    ) -> Result<Box<dyn RootMount>, RootError> {
        if ids.is_some() {
            return Err(RootError::new(
                "the overlay root provider cannot show image owners through a user namespace",
            ));
        }
        let lower = self
            .image_dir(image)
            .filter(|d| d.is_dir())
            .ok_or_else(|| RootError::new(format!("image {image:?} not found")))?;
        let base = target
            .parent()
            .ok_or_else(|| RootError::new(format!("{} has no parent", target.display())))?;
        let upper = base.join("upper");
        let work = base.join("work");
        for d in [&upper, &work] {
            std::fs::create_dir(d)
                .map_err(|e| RootError::with_source(format!("mkdir {}", d.display()), e))?;
        }
        let mount = OverlayMount {
            target: target.to_path_buf(),
            upper,
            work,
        };
        if let Err(e) = mount_overlay(&lower, &mount.upper, &mount.work, target) {
            let _ = mount.remove_layers();
            return Err(e);
        }
        Ok(Box::new(mount))
    }

    fn image_exists(&self, image: &str) -> bool {
        self.image_dir(image).is_some_and(|d| d.is_dir())
    }

    /// A kernel overlay mount outlives its mounter: still an overlayfs at `target`, it is adopted.
    fn reattach(&self, _id: &SandboxId, _image: &str, target: &Path) -> Option<Box<dyn RootMount>> {
        let fs = nix::sys::statfs::statfs(target).ok()?;
        if fs.filesystem_type() != nix::sys::statfs::OVERLAYFS_SUPER_MAGIC {
            return None;
        }
        let base = target.parent()?;
        Some(Box::new(OverlayMount {
            target: target.to_path_buf(),
            upper: base.join("upper"),
            work: base.join("work"),
        }))
    }
}

/// A mounted overlayfs root.
#[derive(Debug)]
pub struct OverlayMount {
    target: PathBuf,
    upper: PathBuf,
    work: PathBuf,
}

impl OverlayMount {
    fn remove_layers(&self) -> Result<(), RootError> {
        for d in [&self.upper, &self.work] {
            match std::fs::remove_dir_all(d) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(RootError::with_source(format!("remove {}", d.display()), e)),
            }
        }
        Ok(())
    }
}

impl RootMount for OverlayMount {
    fn usage(&self) -> DiskUsage {
        let mut u = DiskUsage::default();
        let mut stack = vec![self.upper.clone()];
        while let Some(dir) = stack.pop() {
            let Ok(rd) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in rd.flatten() {
                let Ok(md) = e.metadata() else { continue };
                u.inodes += 1;
                if md.is_dir() {
                    stack.push(e.path());
                } else {
                    u.bytes += md.len();
                }
            }
        }
        u
    }

    fn unmount(&self) -> Result<(), RootError> {
        crate::mounts::unmount_if_mounted(&self.target)
            .map_err(|e| RootError::with_source(format!("unmount {}", self.target.display()), e))?;
        self.remove_layers()
    }
}
