//! CRIU image directories in the content store: chunking policy on the way in, a per-snapshot
//! materialized copy on the way out (restores read plain files).

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nodefs::service::{FsService, ImportPolicy};
use nodefs::ManifestId;
use parking_lot::Mutex;

use crate::error::Error;

/// Imports a CRIU image directory: page images cut per page, so identical memory pages dedup
/// one by one. `base`: the images of an earlier checkpoint of the same tree, whose directory
/// (the page lists) the new one is stored as a delta of.
pub fn import(
    store: &dyn FsService,
    dir: &Path,
    base: Option<&ManifestId>,
) -> Result<ManifestId, Error> {
    Ok(store.import_dir(dir, ImportPolicy::CriuImages, base)?)
}

/// Materialized image directories, one per snapshot, under `<run>/snapshots/<id>/images`.
#[derive(Debug)]
pub struct ImageCache {
    dir: PathBuf,
    locks: Mutex<HashMap<String, Arc<Mutex<()>>>>,
}

impl ImageCache {
    pub fn new(dir: PathBuf) -> ImageCache {
        ImageCache {
            dir,
            locks: Mutex::new(HashMap::new()),
        }
    }

    fn lock_for(&self, id: &str) -> Arc<Mutex<()>> {
        self.locks.lock().entry(id.to_string()).or_default().clone()
    }

    /// The materialized images of snapshot `id`, exported from the store on first use.
    /// Built in a temp dir and renamed, so a crash never leaves a half directory in use.
    pub fn get(
        &self,
        store: &dyn FsService,
        id: &str,
        images: &ManifestId,
    ) -> Result<PathBuf, Error> {
        let lock = self.lock_for(id);
        let _g = lock.lock();
        let base = self.dir.join(id);
        let done = base.join("images");
        if done.is_dir() {
            return Ok(done);
        }
        fs::create_dir_all(&base).map_err(|e| Error::io(&base, e))?;
        let tmp = base.join("images.tmp");
        let _ = fs::remove_dir_all(&tmp);
        let res = store
            .export_dir(images, &tmp)
            .map_err(Error::from)
            .and_then(|()| fs::rename(&tmp, &done).map_err(|e| Error::io(&done, e)));
        if let Err(e) = res {
            let _ = fs::remove_dir_all(&base);
            return Err(e);
        }
        Ok(done)
    }

    /// The materialized images of `id`, if present.
    pub fn existing(&self, id: &str) -> Option<PathBuf> {
        let done = self.dir.join(id).join("images");
        done.is_dir().then_some(done)
    }

    /// Moves `dir` (freshly dumped images, same filesystem) in as the materialized copy of
    /// `id`: the only copy of a snapshot's images until they are stored, so failure is an error.
    pub fn take(&self, id: &str, dir: &Path) -> Result<PathBuf, Error> {
        let lock = self.lock_for(id);
        let _g = lock.lock();
        let base = self.dir.join(id);
        let done = base.join("images");
        fs::create_dir_all(&base)
            .and_then(|()| fs::rename(dir, &done))
            .map_err(|e| {
                let _ = fs::remove_dir(&base);
                Error::io(&done, e)
            })?;
        Ok(done)
    }

    /// Takes `dir` (freshly dumped images, same filesystem) as the materialized copy of `id`,
    /// unless one exists; on failure the copy is simply made on first use.
    pub fn adopt(&self, id: &str, dir: &Path) {
        let lock = self.lock_for(id);
        let _g = lock.lock();
        let base = self.dir.join(id);
        let done = base.join("images");
        if done.exists() {
            return;
        }
        if let Err(e) = fs::create_dir_all(&base).and_then(|()| fs::rename(dir, &done)) {
            tracing::debug!(snapshot = id, error = %e, "images not adopted; materialized on first fork");
            let _ = fs::remove_dir(&base);
        }
    }

    /// Drops the materialized copy of one snapshot.
    pub fn drop_snapshot(&self, id: &str) {
        let lock = self.lock_for(id);
        let _g = lock.lock();
        let _ = fs::remove_dir_all(self.dir.join(id));
        drop(_g);
        self.locks.lock().remove(id);
    }

    /// Removes copies whose snapshot no longer exists (e.g. after a crash).
    pub fn retain(&self, live: &dyn Fn(&str) -> bool) {
        let Ok(rd) = fs::read_dir(&self.dir) else {
            return;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !live(&name) {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
}
