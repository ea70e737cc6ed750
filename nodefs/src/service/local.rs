//! The service in this process: a [`NodeFs`] over a [`Store`].

use std::collections::HashSet;
use std::io::{Read, Write};
use std::path::Path;
use std::sync::Arc;

use super::{FsService, ImportPolicy, MountInfo};
use crate::error::Error;
use crate::fs::{Mount, MountOptions, NodeFs, Usage};
use crate::id::{ManifestId, ObjectId};
use crate::store::{FsckReport, GcReport, Store, StoreStats};

/// The store and FUSE server in-process; what `grove-fsd` serves, too.
#[derive(Debug, Clone)]
pub struct Local {
    fs: Arc<NodeFs>,
}

impl Local {
    pub fn new(fs: Arc<NodeFs>) -> Local {
        Local { fs }
    }

    /// Opens the store in `dir` (exclusively) with a fresh FUSE server.
    pub fn open(dir: &Path) -> Result<Local, Error> {
        Local::open_with(dir, crate::ServerOptions::default())
    }

    /// The same, the server mounting with `options`.
    pub fn open_with(dir: &Path, options: crate::ServerOptions) -> Result<Local, Error> {
        Ok(Local::new(NodeFs::with_options(Store::open(dir)?, options)))
    }

    pub fn store(&self) -> &Arc<Store> {
        self.fs.store()
    }

    pub fn nodefs(&self) -> &Arc<NodeFs> {
        &self.fs
    }

    fn mount_of(&self, id: u64) -> Result<Arc<Mount>, Error> {
        self.fs.find(id).ok_or(Error::UnknownMount(id))
    }

    /// Unmounts every mount (an orderly stop of the server).
    pub fn unmount_all(&self) {
        for m in self.fs.mounts() {
            if let Err(e) = m.unmount() {
                tracing::warn!(mountpoint = %m.mountpoint().display(), error = %e, "unmount");
            }
        }
    }
}

fn info(m: &Mount) -> MountInfo {
    MountInfo {
        id: m.id(),
        base: m.base(),
        mountpoint: m.mountpoint().to_path_buf(),
        transport: m.transport(),
    }
}

impl FsService for Local {
    fn resolve(&self, name_or_hex: &str) -> Result<ManifestId, Error> {
        self.store().resolve(name_or_hex)
    }

    fn get_ref(&self, name: &str) -> Result<Option<ManifestId>, Error> {
        self.store().get_ref(name)
    }

    fn set_ref(&self, name: &str, id: &ManifestId) -> Result<(), Error> {
        self.store().set_ref(name, id)
    }

    fn delete_ref(&self, name: &str) -> Result<(), Error> {
        self.store().delete_ref(name)
    }

    fn refs(&self) -> Result<Vec<(String, ManifestId)>, Error> {
        self.store().refs()
    }

    fn stats(&self) -> Result<StoreStats, Error> {
        Ok(self.store().stats())
    }

    fn stored_bytes(&self) -> Result<u64, Error> {
        Ok(self.store().stored_bytes())
    }

    fn manifest_bytes(&self, id: &ManifestId) -> Result<u64, Error> {
        self.store().manifest_bytes(id)
    }

    fn import_dir(
        &self,
        dir: &Path,
        policy: ImportPolicy,
        base: Option<&ManifestId>,
    ) -> Result<ManifestId, Error> {
        self.store()
            .import_dir_based(dir, &|p: &Path| policy.for_path(p), base)
    }

    fn import_oci(&self, dir: &Path, reference: Option<&str>) -> Result<ManifestId, Error> {
        self.store().import_oci(dir, reference)
    }

    fn import_tar(&self, input: &mut dyn Read) -> Result<ManifestId, Error> {
        self.store().import_tar(input)
    }

    fn apply_layer(
        &self,
        base: Option<&ManifestId>,
        compression: crate::LayerCompression,
        digest: Option<&str>,
        input: &mut (dyn Read + Send),
    ) -> Result<ManifestId, Error> {
        self.store().apply_layer(base, compression, digest, input)
    }

    fn export_dir(&self, id: &ManifestId, dst: &Path) -> Result<(), Error> {
        self.store().export_dir(id, dst)
    }

    fn export_stream(
        &self,
        id: &ManifestId,
        only: Option<&HashSet<ObjectId>>,
        out: &mut dyn Write,
    ) -> Result<(), Error> {
        let have = |o: &ObjectId| only.is_some_and(|s| !s.contains(o));
        self.store().export_stream(id, &have, out).map(|_| ())
    }

    fn import_streams(&self, input: &mut dyn Read, count: usize) -> Result<Vec<ManifestId>, Error> {
        let mut out = Vec::with_capacity(count);
        // Each imported manifest is pinned while the next is read, so a gc between them
        // cannot take it.
        let res = (0..count).try_for_each(|i| {
            let id = self
                .store()
                .import_stream(input)
                .map_err(|e| Error::BadStream(format!("part {} of {count}: {e}", i + 1)))?;
            self.store().pin(&id);
            out.push(id);
            Ok(())
        });
        out.iter().for_each(|id| self.store().unpin(id));
        res.map(|()| out)
    }

    fn objects_of(&self, id: &ManifestId) -> Result<Vec<ObjectId>, Error> {
        self.store().objects_of(id)
    }

    fn lacking(&self, ids: &[ObjectId]) -> Result<Vec<ObjectId>, Error> {
        Ok(ids
            .iter()
            .filter(|id| !self.store().has_object(id))
            .copied()
            .collect())
    }

    fn pin(&self, id: &ObjectId) -> Result<(), Error> {
        self.store().pin(id);
        Ok(())
    }

    fn unpin(&self, id: &ObjectId) {
        self.store().unpin(id)
    }

    fn gc(&self, live: &[ManifestId]) -> Result<GcReport, Error> {
        let mut all: Vec<ManifestId> = self.fs.mounts().iter().map(|m| m.base()).collect();
        all.extend_from_slice(live);
        self.store().gc(&all)
    }

    fn fsck(&self) -> Result<FsckReport, Error> {
        self.store().fsck()
    }

    fn mount(
        &self,
        base: &ManifestId,
        target: &Path,
        opts: &MountOptions,
    ) -> Result<MountInfo, Error> {
        self.fs.mount(base, target, opts.clone()).map(|m| info(&m))
    }

    fn commit(&self, mount: u64) -> Result<ManifestId, Error> {
        self.mount_of(mount)?.commit()
    }

    fn commit_unsealed(&self, mount: u64) -> Result<ManifestId, Error> {
        self.mount_of(mount)?.commit_unsealed()
    }

    fn seal_commit(&self, mount: u64, id: &ManifestId) -> Result<(), Error> {
        self.mount_of(mount)?.seal_commit(id)
    }

    fn usage(&self, mount: u64) -> Result<Usage, Error> {
        Ok(self.mount_of(mount)?.usage())
    }

    /// Idempotent for this server's own mounts. A mount of a server before it is not this
    /// one's to have unmounted: UnknownMount, so the caller knows its kernel mount may be there.
    fn unmount(&self, mount: u64) -> Result<(), Error> {
        match self.fs.find(mount) {
            Some(m) => m.unmount(),
            None if self.fs.is_own_id(mount) => Ok(()),
            None => Err(Error::UnknownMount(mount)),
        }
    }

    fn mounts(&self) -> Result<Vec<MountInfo>, Error> {
        for gone in self.fs.forget_gone() {
            tracing::info!(mountpoint = %gone.display(), "forgot a mount removed from outside");
        }
        Ok(self.fs.mounts().iter().map(|m| info(m)).collect())
    }
}
