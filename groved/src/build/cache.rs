//! The build step cache's bound. Each cached step is a store ref `grove-build/<key>` that keeps
//! its tree alive through gc, so without pruning the cache (and the store) only grows. A small
//! index beside the state (`build-cache.json`: key → last use, ms since the epoch) records when each
//! entry was last written or hit; a prune keeps the `max_entries` most recently used entries that
//! were used within `max_age_secs` and deletes the other refs (the store's gc then frees what they
//! alone held). Prunes run only while no build is under way (see [`super::engine::ACTIVE`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use nodefs::service::FsService;

use super::engine::CACHE_PREFIX;
use crate::error::chain;

/// Entries kept by default.
pub const DEFAULT_MAX_ENTRIES: usize = 1000;
/// Entries unused for longer than this go by default (7 days).
pub const DEFAULT_MAX_AGE_SECS: u64 = 7 * 24 * 3600;

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("a build is under way: the cache is pruned when none is")]
    BuildRunning,
    #[error("the build cache index {path}: {error}")]
    Index { path: PathBuf, error: String },
    #[error("the store's refs: {0}")]
    Store(String),
}

/// What a prune keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    pub max_entries: usize,
    pub max_age_secs: u64,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            max_entries: DEFAULT_MAX_ENTRIES,
            max_age_secs: DEFAULT_MAX_AGE_SECS,
        }
    }
}

/// What a prune did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Pruned {
    pub removed: usize,
    pub kept: usize,
}

/// The last-use index. Loads are cheap (one small file); writes go through a rename.
pub struct Index {
    path: PathBuf,
}

/// Writers of the index in this process take turns.
static WRITE: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

impl Index {
    pub fn new(state_dir: &Path) -> Self {
        Index {
            path: state_dir.join("build-cache.json"),
        }
    }

    fn load(&self) -> Result<BTreeMap<String, u64>, CacheError> {
        match std::fs::read(&self.path) {
            Ok(b) => Ok(serde_json::from_slice(&b).unwrap_or_else(|e| {
                // A damaged index only loses recency: its entries count as used now.
                tracing::warn!(path = %self.path.display(), "build cache index unreadable: {e}");
                BTreeMap::new()
            })),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BTreeMap::new()),
            Err(e) => Err(self.err(e)),
        }
    }

    fn save(&self, m: &BTreeMap<String, u64>) -> Result<(), CacheError> {
        let tmp = self.path.with_extension("json.tmp");
        let body = serde_json::to_vec(m).map_err(|e| self.err(e))?;
        std::fs::write(&tmp, body).map_err(|e| self.err(e))?;
        std::fs::rename(&tmp, &self.path).map_err(|e| self.err(e))
    }

    fn err(&self, e: impl std::fmt::Display) -> CacheError {
        CacheError::Index {
            path: self.path.clone(),
            error: e.to_string(),
        }
    }

    /// Records a use of `key` (a hit or a fresh entry) at `now_ms`.
    pub fn touch(&self, key: &str, now_ms: u64) -> Result<(), CacheError> {
        let _g = WRITE.lock();
        let mut m = self.load()?;
        m.insert(key.to_string(), now_ms);
        self.save(&m)
    }

    /// Deletes the cache refs `policy` does not keep, the least recently used first. Entries the
    /// index has never seen (made before it existed) count as used now. The caller makes sure no
    /// build runs.
    pub fn prune(
        &self,
        store: &dyn FsService,
        policy: Policy,
        now_ms: u64,
    ) -> Result<Pruned, CacheError> {
        let _g = WRITE.lock();
        let mut used = self.load()?;
        let refs = store
            .refs()
            .map_err(|e| CacheError::Store(chain(&e).to_string()))?;
        let mut entries: Vec<(u64, String)> = refs
            .into_iter()
            .filter_map(|(name, _)| name.strip_prefix(CACHE_PREFIX).map(str::to_string))
            .map(|key| (*used.entry(key.clone()).or_insert(now_ms), key))
            .collect();
        // Newest first; the name breaks ties so that a prune is deterministic.
        entries.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        let max_age_ms = policy.max_age_secs.saturating_mul(1000);
        let mut kept = BTreeMap::new();
        let mut removed = 0;
        for (i, (at, key)) in entries.into_iter().enumerate() {
            if i < policy.max_entries && now_ms.saturating_sub(at) <= max_age_ms {
                kept.insert(key, at);
                continue;
            }
            store
                .delete_ref(&format!("{CACHE_PREFIX}{key}"))
                .map_err(|e| CacheError::Store(chain(&e).to_string()))?;
            removed += 1;
        }
        let n = kept.len();
        // Records of refs gone by other means go too.
        self.save(&kept)?;
        Ok(Pruned { removed, kept: n })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_round_trips_and_a_damaged_one_is_empty() {
        let d = tempfile::tempdir().unwrap();
        let ix = Index::new(d.path());
        assert!(ix.load().unwrap().is_empty());
        ix.touch("a", 5).unwrap();
        ix.touch("b", 7).unwrap();
        ix.touch("a", 9).unwrap();
        let m = ix.load().unwrap();
        assert_eq!(m.get("a"), Some(&9));
        assert_eq!(m.get("b"), Some(&7));
        std::fs::write(d.path().join("build-cache.json"), b"{not json").unwrap();
        assert!(ix.load().unwrap().is_empty());
    }
}
