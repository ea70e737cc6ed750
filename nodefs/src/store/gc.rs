//! Pins and garbage collection: gc keeps what a ref, a pin, a caller's live manifest or an
//! import's fresh manifest reaches, and drops the rest (pack records, cache objects, markers).

use std::collections::HashSet;
use std::fs;

use serde::{Deserialize, Serialize};

use super::Store;
use crate::error::{io_err, Error};
use crate::id::{ManifestId, ObjectId};

/// What a gc run did.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct GcReport {
    pub kept_objects: u64,
    pub removed_objects: u64,
    /// Disk space the store's files took before the run less what they take after
    /// (allocated blocks of packs, idx files, cache files and markers), measured.
    pub freed_bytes: u64,
    /// Packs deleted whole (nothing in them was live).
    #[serde(default)]
    pub packs_deleted: u64,
    /// Packs whose dead records were punched out in place.
    #[serde(default)]
    pub packs_punched: u64,
    /// Packs rewritten (on a filesystem that cannot punch holes).
    #[serde(default)]
    pub packs_rewritten: u64,
    /// Packs whose dead records stay for now: no hole punching and no room to rewrite them.
    #[serde(default)]
    pub packs_left: u64,
}

impl Store {
    /// Keep `id` (and what it reaches) alive through gc while pinned.
    pub fn pin(&self, id: &ObjectId) {
        *self.pins.lock().entry(*id).or_default() += 1;
    }

    /// Undo one [`Store::pin`].
    pub fn unpin(&self, id: &ObjectId) {
        let mut p = self.pins.lock();
        if let Some(n) = p.get_mut(id) {
            *n -= 1;
            if *n == 0 {
                p.remove(id);
            }
        }
    }

    /// Drop every object not reachable from a ref, a pinned manifest, `live`, or a manifest
    /// an import made less than the fresh grace ago that no ref names yet.
    pub fn gc(&self, live: &[ManifestId]) -> Result<GcReport, Error> {
        let _g = self.gc_lock.write();
        // Fresh manifests before refs: `set_ref` writes the ref before it ends the grace, so
        // one that is named meanwhile is seen in one or the other.
        let mut roots: Vec<ObjectId> = {
            let grace = *self.fresh_grace.lock();
            let now = std::time::Instant::now();
            let mut fresh = self.fresh.lock();
            fresh.retain(|_, t| now.duration_since(*t) < grace);
            fresh.keys().copied().collect()
        };
        roots.extend(self.refs()?.into_iter().map(|(_, id)| id));
        roots.extend_from_slice(live);
        roots.extend(self.pins.lock().keys().copied());
        let mut keep = HashSet::new();
        // Names of the whole-file cache objects of every live file (see `fs::passthrough`).
        let mut cache_names = HashSet::new();
        for r in &roots {
            if self.contains(r) {
                self.reach(r, &mut keep, &mut |chunks| {
                    if !chunks.is_empty() {
                        cache_names.insert(crate::fs::object_name(chunks));
                    }
                })?;
            }
        }
        // A manifest marker stays only for a manifest still reached whole. A root tree kept only
        // as the delta base of a later version keeps its bytes, not its children: its marker
        // goes, or fsck (which walks every marker) would look for children gc dropped.
        let whole = keep.clone();
        self.add_delta_bases(&mut keep);
        let before = self.disk_usage();
        // Derived data first: it frees space and costs nothing to lose.
        self.clean_cache_dir(&cache_names);
        let c = self.packs.compact(&|id| keep.contains(id))?;
        self.cache.lock().retain(|k| keep.contains(k));
        self.trees.lock().retain(|k| keep.contains(k));
        let mdir = self.dir.join("manifests");
        for e in fs::read_dir(&mdir).map_err(io_err(&mdir))?.flatten() {
            let keep_it = e
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<ObjectId>().ok())
                .is_some_and(|id| whole.contains(&id));
            if !keep_it {
                let _ = fs::remove_file(e.path());
            }
        }
        Ok(GcReport {
            kept_objects: keep.len() as u64,
            removed_objects: c.removed,
            freed_bytes: before.saturating_sub(self.disk_usage()),
            packs_deleted: c.packs_deleted,
            packs_punched: c.packs_punched,
            packs_rewritten: c.packs_rewritten,
            packs_left: c.packs_left,
        })
    }

    /// Disk space (allocated blocks) of the files gc can free: packs and their idx files,
    /// whole-file cache objects, manifest markers.
    fn disk_usage(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        ["packs", "cache", "manifests"]
            .iter()
            .filter_map(|d| fs::read_dir(self.dir.join(d)).ok())
            .flat_map(|rd| rd.flatten())
            .filter_map(|e| e.metadata().ok())
            .map(|m| m.blocks() * 512)
            .sum()
    }

    /// Remove the whole-file cache objects no live file uses (`keep`: the names of those
    /// that one does). Objects being written (temp names) are left to their writer.
    fn clean_cache_dir(&self, keep: &HashSet<String>) {
        let d = self.dir.join("cache");
        if let Ok(rd) = fs::read_dir(&d) {
            for e in rd.flatten() {
                let name = e.file_name();
                let name = name.to_string_lossy();
                if name.contains(".tmp") || keep.contains(name.as_ref()) {
                    continue;
                }
                let _ = fs::remove_file(e.path());
            }
        }
    }
}
