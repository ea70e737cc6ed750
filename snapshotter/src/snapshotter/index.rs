//! The snapshot index: records and the store refs behind them, written in the order that keeps
//! a crash from losing a committed snapshot (refs, then the record, then the in-memory index).

use super::*;

impl Snapshotter {
    pub(super) fn check_name_free(&self, name: &str, except: Option<&str>) -> Result<(), Error> {
        if let Some(other) = self
            .index
            .read()
            .values()
            .find(|s| s.name.as_deref() == Some(name))
        {
            if Some(other.id.as_str()) != except {
                return Err(Error::NameTaken {
                    name: name.into(),
                    id: other.id.clone(),
                });
            }
        }
        Ok(())
    }

    /// A snapshot whose images are not stored yet: the fs ref, then the record, then the index.
    pub(super) fn commit_pending(&self, info: &SnapshotInfo, fs: &ManifestId) -> Result<(), Error> {
        let [fs_ref, _] = ref_names(&info.id);
        self.store.set_ref(&fs_ref, fs)?;
        if let Err(e) = self.records.write(info) {
            let _ = self.store.delete_ref(&fs_ref);
            return Err(e);
        }
        self.index.write().insert(info.id.clone(), info.clone());
        Ok(())
    }

    /// The images of a pending snapshot are stored: their ref, then the durable record.
    pub(crate) fn commit_images(
        &self,
        info: &SnapshotInfo,
        imgs: &ManifestId,
    ) -> Result<(), Error> {
        let [_, img_ref] = ref_names(&info.id);
        self.store.set_ref(&img_ref, imgs)?;
        self.records.write(info)?;
        self.index.write().insert(info.id.clone(), info.clone());
        Ok(())
    }

    /// Refs first (so gc keeps the data), then the record (the commit point), then the index.
    pub(crate) fn commit_record(
        &self,
        info: &SnapshotInfo,
        fs: &ManifestId,
        imgs: &ManifestId,
    ) -> Result<(), Error> {
        let [fs_ref, img_ref] = ref_names(&info.id);
        self.store.set_ref(&fs_ref, fs)?;
        self.store.set_ref(&img_ref, imgs)?;
        if let Err(e) = self.records.write(info) {
            let _ = self.store.delete_ref(&fs_ref);
            let _ = self.store.delete_ref(&img_ref);
            return Err(e);
        }
        self.index.write().insert(info.id.clone(), info.clone());
        Ok(())
    }

    /// All snapshots, oldest first.
    pub fn list(&self) -> Vec<SnapshotInfo> {
        let mut v: Vec<_> = self
            .index
            .read()
            .values()
            .filter(|s| s.paused.is_none())
            .cloned()
            .collect();
        v.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        v
    }

    /// A snapshot by id (hex) or name; pause records are not snapshots.
    pub fn get(&self, snapshot: &str) -> Result<SnapshotInfo, Error> {
        let index = self.index.read();
        if let Some(s) = index.get(snapshot).filter(|s| s.paused.is_none()) {
            return Ok(s.clone());
        }
        index
            .values()
            .find(|s| s.name.as_deref() == Some(snapshot))
            .cloned()
            .ok_or_else(|| Error::NotFound {
                snapshot: snapshot.into(),
            })
    }

    /// Deletes the record, the refs and the materialized images. Chunks are freed by the next gc
    /// unless something else (a branch's root, another snapshot) still reaches them.
    pub fn delete(&self, snapshot: &str) -> Result<(), Error> {
        let info = self.get(snapshot)?;
        self.delete_by_id(&info.id)
    }

    /// Record, refs, materialized images, then the index entry: whoever sees it gone from the
    /// index sees nothing else of it either.
    pub(crate) fn delete_by_id(&self, id: &str) -> Result<(), Error> {
        // Its images may still be being made whole (`whole.rs`): not removed under that.
        let _ = self.whole.wait(id);
        self.whole.forget(id);
        let _commit = self.imports.commit.lock();
        self.records.remove(id)?;
        let refs = ref_names(id)
            .iter()
            .try_for_each(|r| self.store.delete_ref(r));
        self.cache.drop_snapshot(id);
        self.index.write().remove(id);
        Ok(refs?)
    }

    /// Manifests every snapshot needs: roots for the store's gc.
    pub fn live_manifests(&self) -> Vec<ManifestId> {
        self.index
            .read()
            .values()
            .flat_map(|s| [s.fs_root.parse().ok(), s.images_root.parse().ok()])
            .flatten()
            .collect()
    }

    /// Records an imported snapshot (the transfer module verified it).
    pub(crate) fn record_imported(
        &self,
        info: SnapshotInfo,
        fs: &ManifestId,
        imgs: &ManifestId,
    ) -> Result<SnapshotInfo, Error> {
        if let Some(existing) = self.index.read().get(&info.id) {
            return Ok(existing.clone());
        }
        if let Some(n) = &info.name {
            self.check_name_free(n, None)?;
        }
        self.commit_record(&info, fs, imgs)?;
        Ok(info)
    }
}

/// Pins a manifest in the store (gc keeps it) while alive.
pub(crate) struct Pin<'a> {
    store: &'a dyn FsService,
    id: ManifestId,
}

impl<'a> Pin<'a> {
    pub(crate) fn new(store: &'a dyn FsService, id: ManifestId) -> Result<Pin<'a>, Error> {
        store.pin(&id)?;
        Ok(Pin { store, id })
    }
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        self.store.unpin(&self.id);
    }
}
