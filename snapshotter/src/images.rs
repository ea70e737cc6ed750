//! CRIU image directories in the content store: chunking policy on the way in, a per-snapshot
//! materialized copy on the way out (restores read plain files).

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
/// They live in scratch space (a tmpfs, i.e. memory, on a systemd host), so their total is
/// capped: past `cap` bytes, the least recently used copies of stored snapshots go (a later
/// fork materializes them again from the store). Copies used within `min_idle` stay, so a
/// restore or a lazy-pages daemon never loses the files it reads.
#[derive(Debug)]
pub struct ImageCache {
    dir: PathBuf,
    locks: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    used: Mutex<HashMap<String, Instant>>,
    cap: u64,
    min_idle: Duration,
}

/// A copy used this recently is never evicted.
pub const MIN_IDLE: Duration = Duration::from_secs(300);

impl ImageCache {
    pub fn new(dir: PathBuf, cap: u64, min_idle: Duration) -> ImageCache {
        ImageCache {
            dir,
            locks: Mutex::new(HashMap::new()),
            used: Mutex::new(HashMap::new()),
            cap,
            min_idle,
        }
    }

    /// The directory holding the materialized images.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn touch(&self, id: &str) {
        self.used.lock().insert(id.to_string(), Instant::now());
    }

    /// Evicts least recently used copies for which `evictable` holds (their snapshot is in
    /// the store) until the total is at most the cap; returns the ids evicted.
    pub fn trim(&self, evictable: &dyn Fn(&str) -> bool) -> Vec<String> {
        let Ok(rd) = fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut entries: Vec<(String, u64)> = rd
            .flatten()
            .map(|e| {
                let id = e.file_name().to_string_lossy().into_owned();
                (id, dir_bytes(&e.path()))
            })
            .collect();
        let mut total: u64 = entries.iter().map(|(_, b)| b).sum();
        if total <= self.cap {
            return Vec::new();
        }
        let used = self.used.lock().clone();
        // Never used since start: oldest of all.
        entries.sort_by_key(|(id, _)| used.get(id).copied());
        let mut evicted = Vec::new();
        for (id, bytes) in entries {
            if total <= self.cap {
                break;
            }
            let recent = used.get(&id).is_some_and(|t| t.elapsed() < self.min_idle);
            if recent || !evictable(&id) {
                continue;
            }
            self.drop_snapshot(&id);
            total = total.saturating_sub(bytes);
            evicted.push(id);
        }
        evicted
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
        self.touch(id);
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
        let there = done.is_dir();
        if there {
            self.touch(id);
        }
        there.then_some(done)
    }

    /// Moves `dir` (freshly dumped images, same filesystem) in as the materialized copy of
    /// `id`: the only copy of a snapshot's images until they are stored, so failure is an error.
    pub fn take(&self, id: &str, dir: &Path) -> Result<PathBuf, Error> {
        let lock = self.lock_for(id);
        let _g = lock.lock();
        let base = self.dir.join(id);
        let done = base.join("images");
        self.touch(id);
        fs::create_dir_all(&base)
            .and_then(|()| fs::rename(dir, &done))
            .map_err(|e| {
                let _ = fs::remove_dir(&base);
                Error::io(&done, e)
            })?;
        Ok(done)
    }

    /// [`ImageCache::take`] where the images are stored already: on failure the copy is
    /// simply materialized again on first use.
    pub fn take_best_effort(&self, id: &str, dir: &Path) {
        if let Err(e) = self.take(id, dir) {
            tracing::debug!(snapshot = id, error = %e, "images not adopted; materialized on first use");
        }
    }

    /// Drops the materialized copy of one snapshot.
    pub fn drop_snapshot(&self, id: &str) {
        let lock = self.lock_for(id);
        let _g = lock.lock();
        let _ = fs::remove_dir_all(self.dir.join(id));
        drop(_g);
        self.locks.lock().remove(id);
        self.used.lock().remove(id);
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

/// Bytes of the regular files under `dir` (image dirs are two levels deep at most).
fn dir_bytes(dir: &Path) -> u64 {
    let mut n = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                Ok(t) if t.is_file() => n += e.metadata().map_or(0, |m| m.len()),
                _ => {}
            }
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(cache: &ImageCache, scratch: &Path, id: &str, bytes: usize) {
        let d = scratch.join(format!("dump-{id}"));
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("pages-1.img"), vec![7u8; bytes]).unwrap();
        cache.take(id, &d).unwrap();
    }

    #[test]
    fn trim_evicts_least_recently_used_stored_copies_down_to_the_cap() {
        let t = tempfile::tempdir().unwrap();
        let cache = ImageCache::new(t.path().join("snapshots"), 250, Duration::ZERO);
        for id in ["a", "b", "c", "d"] {
            put(&cache, t.path(), id, 100);
        }
        // "a" is used again: "b" is now the least recently used; "c" is not stored yet.
        assert!(cache.existing("a").is_some());
        let evicted = cache.trim(&|id| id != "c");
        assert_eq!(evicted, vec!["b".to_string(), "d".to_string()]);
        for (id, kept) in [("a", true), ("b", false), ("c", true), ("d", false)] {
            assert_eq!(cache.existing(id).is_some(), kept, "{id}");
        }
        assert!(cache.trim(&|_| true).is_empty(), "under the cap now");
    }

    #[test]
    fn recently_used_copies_are_never_evicted() {
        let t = tempfile::tempdir().unwrap();
        let cache = ImageCache::new(t.path().join("snapshots"), 10, Duration::from_secs(60));
        put(&cache, t.path(), "a", 100);
        assert!(cache.trim(&|_| true).is_empty());
        assert!(cache.existing("a").is_some());
    }
}
