//! Verifying the store: every object every ref and stored manifest reaches, and the
//! whole-file cache (derived data, deleted where it fails its check).

use std::collections::HashSet;
use std::fs;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::Store;
use crate::error::{io_err, Error};
use crate::id::ObjectId;
use crate::tree::Node;

/// What fsck found.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FsckReport {
    pub manifests: u64,
    pub objects_checked: u64,
    /// Objects that are missing or fail their hash, with why.
    pub bad: Vec<(ObjectId, String)>,
    /// Whole-file cache entries that failed their check and were deleted (derived data).
    pub cache_removed: Vec<PathBuf>,
}

impl FsckReport {
    pub fn is_clean(&self) -> bool {
        self.bad.is_empty()
    }
}

impl Store {
    /// Verify every object reachable from every ref and stored manifest.
    pub fn fsck(&self) -> Result<FsckReport, Error> {
        // No gc meanwhile: one that drops a manifest fsck has listed but not yet walked would
        // read as damage. Imports may go on (they only add).
        let _g = self.gc_lock.read();
        let mut rep = FsckReport::default();
        let mut roots: HashSet<ObjectId> = self.refs()?.into_iter().map(|(_, id)| id).collect();
        let mdir = self.dir.join("manifests");
        for e in fs::read_dir(&mdir).map_err(io_err(&mdir))?.flatten() {
            if let Some(id) = e.file_name().to_str().and_then(|s| s.parse().ok()) {
                roots.insert(id);
            }
        }
        let mut checked = HashSet::new();
        for root in roots {
            rep.manifests += 1;
            let mut stack = vec![root];
            while let Some(id) = stack.pop() {
                if !checked.insert(id) {
                    continue;
                }
                rep.objects_checked += 1;
                self.cache.lock().remove(&id);
                self.trees.lock().remove(&id);
                match self.get_tree(&id) {
                    Ok(t) => {
                        for e in &t.entries {
                            match &e.node {
                                Node::Dir(c) => stack.push(*c),
                                Node::File { chunks, .. } => {
                                    for c in chunks {
                                        if !checked.insert(c.id) {
                                            continue;
                                        }
                                        rep.objects_checked += 1;
                                        self.cache.lock().remove(&c.id);
                                        match self.get_chunk(&c.id) {
                                            Ok(d) if d.len() == c.len as usize => {}
                                            Ok(_) => rep.bad.push((c.id, "length mismatch".into())),
                                            Err(e) => rep.bad.push((c.id, e.to_string())),
                                        }
                                    }
                                }
                                _ => {}
                            }
                        }
                    }
                    Err(e) => rep.bad.push((id, e.to_string())),
                }
            }
        }
        rep.cache_removed = self.check_cache_dir();
        Ok(rep)
    }

    /// Re-hash whole-file cache entries; delete those that do not match their xattr.
    fn check_cache_dir(&self) -> Vec<PathBuf> {
        let mut removed = Vec::new();
        let d = self.dir.join("cache");
        let Ok(rd) = fs::read_dir(&d) else {
            return removed;
        };
        for e in rd.flatten() {
            let p = e.path();
            let want = crate::sys::lxattrs(&p).ok().and_then(|x| {
                x.into_iter()
                    .find(|(k, _)| k == crate::fs::CONTENT_XATTR)
                    .map(|(_, v)| v)
            });
            let ok = match (want, fs::File::open(&p)) {
                (Some(want), Ok(mut f)) => {
                    let mut h = blake3::Hasher::new();
                    std::io::copy(&mut f, &mut h).is_ok()
                        && h.finalize().to_hex().as_bytes() == want.as_slice()
                }
                _ => false,
            };
            if !ok {
                let _ = fs::remove_file(&p);
                removed.push(p);
            }
        }
        removed
    }
}
