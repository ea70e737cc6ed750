//! User namespaces: a sandbox created with `userns` runs in its own user namespace whose root is
//! an unprivileged host uid. Each such sandbox draws a range of `RANGE_SIZE` host ids from its
//! instance's pool (`RuntimeConfig::userns_pool`); the range is recorded with the sandbox (a
//! restart keeps it) and freed when the sandbox is reclaimed.

use std::collections::BTreeSet;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// Ids per sandbox: 0..65535 inside, enough for every user an image names (nobody included).
pub const RANGE_SIZE: u32 = 65536;

/// Host ids `base..base + size` are ids `0..size` inside the sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdRange {
    pub base: u32,
    pub size: u32,
}

impl IdRange {
    /// The `uid_map`/`gid_map` line.
    pub fn map_line(&self) -> String {
        format!("0 {} {}\n", self.base, self.size)
    }
}

/// An instance's pool: `ranges` ranges of `RANGE_SIZE` ids from host id `first`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdPool {
    pub first: u32,
    pub ranges: u32,
}

/// Ranges in a default pool (2^26 ids).
const DEFAULT_RANGES: u32 = 1024;
/// Where default pools start: far above any uid a distribution hands out.
const POOLS_START: u64 = 1 << 28;

impl IdPool {
    /// The default pool of an instance: `grove` takes the first 2^26 ids from 2^28, any other
    /// instance one of the next 58 pools by its name (two may still draw the same: set
    /// `userns_pool` on hosts that run several).
    pub fn for_instance(instance: &str, name_hash: u32) -> IdPool {
        let slot = if instance == crate::config::DEFAULT_INSTANCE {
            0
        } else {
            1 + u64::from(name_hash % 58)
        };
        let first = POOLS_START + slot * u64::from(DEFAULT_RANGES) * u64::from(RANGE_SIZE);
        IdPool {
            first: first as u32,
            ranges: DEFAULT_RANGES,
        }
    }

    /// Whether the pool is usable: not host root's ids, and inside the 32-bit id space (the last
    /// id, u32::MAX, is invalid).
    pub fn check(&self) -> Result<(), PoolError> {
        let end = u64::from(self.first) + u64::from(self.ranges) * u64::from(RANGE_SIZE);
        if self.first == 0 || self.ranges == 0 || end > u64::from(u32::MAX) {
            return Err(PoolError::OutOfRange {
                first: self.first,
                ranges: self.ranges,
            });
        }
        Ok(())
    }
}

/// A configured id pool that cannot be used (the runtime refuses to start with it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// It would hand out host root's ids or run past the 32-bit id space.
    #[error("pool of {ranges} ranges from {first} must start above 0 and end below 2^32-1")]
    OutOfRange { first: u32, ranges: u32 },
}

/// The pool's ranges in use, by index.
#[derive(Debug)]
pub struct IdAllocator {
    pool: IdPool,
    used: Mutex<BTreeSet<u32>>,
}

impl IdAllocator {
    pub fn new(pool: IdPool) -> IdAllocator {
        IdAllocator {
            pool,
            used: Mutex::new(BTreeSet::new()),
        }
    }

    fn range(&self, index: u32) -> IdRange {
        IdRange {
            base: self.pool.first + index * RANGE_SIZE,
            size: RANGE_SIZE,
        }
    }

    fn index_of(&self, r: IdRange) -> Option<u32> {
        let off = r.base.checked_sub(self.pool.first)?;
        (off % RANGE_SIZE == 0 && off / RANGE_SIZE < self.pool.ranges).then_some(off / RANGE_SIZE)
    }

    /// The lowest free range; None when all are in use.
    pub fn alloc(&self) -> Option<IdRange> {
        let mut used = self.used.lock();
        let index = (0..self.pool.ranges).find(|i| !used.contains(i))?;
        used.insert(index);
        Some(self.range(index))
    }

    /// Marks a recorded range in use again (a restart adopting its sandbox); false if it is not
    /// one of this pool's or already taken.
    pub fn claim(&self, r: IdRange) -> bool {
        match self.index_of(r) {
            Some(i) => self.used.lock().insert(i),
            None => false,
        }
    }

    pub fn free(&self, r: IdRange) {
        if let Some(i) = self.index_of(r) {
            self.used.lock().remove(&i);
        }
    }

    pub fn in_use(&self) -> usize {
        self.used.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_disjoint_reused_after_free_and_bounded() {
        let a = IdAllocator::new(IdPool {
            first: 1 << 20,
            ranges: 2,
        });
        let r0 = a.alloc().unwrap();
        let r1 = a.alloc().unwrap();
        assert_eq!(r0.base, 1 << 20);
        assert_eq!(r1.base, (1 << 20) + RANGE_SIZE);
        assert!(a.alloc().is_none());
        a.free(r0);
        assert_eq!(a.in_use(), 1);
        assert!(!a.claim(r1), "taken already");
        assert!(a.claim(r0));
        assert!(!a.claim(IdRange {
            base: 5,
            size: RANGE_SIZE
        }));
        assert_eq!(r0.map_line(), format!("0 {} 65536\n", 1 << 20));
    }

    #[test]
    fn default_pools_fit_and_differ_by_instance() {
        let g = IdPool::for_instance("grove", 7);
        assert_eq!(g.first, 1 << 28);
        g.check().unwrap();
        for h in [0, 57, 58, 59, u32::MAX] {
            let p = IdPool::for_instance("grove-x", h);
            p.check().unwrap();
            assert!(p.first >= g.first + g.ranges * RANGE_SIZE);
        }
        assert_eq!(
            IdPool {
                first: u32::MAX - 10,
                ranges: 1
            }
            .check()
            .unwrap_err()
            .to_string(),
            format!(
                "pool of 1 ranges from {} must start above 0 and end below 2^32-1",
                u32::MAX - 10
            )
        );
        assert!(IdPool {
            first: 0,
            ranges: 1
        }
        .check()
        .is_err());
    }
}
