//! A loaded directory's entries, by name for lookups and by cookie for listings.
//!
//! A listing continues from the cookie of the last entry the kernel took, so each entry
//! keeps its cookie while it exists: entries added between two getdents batches come after
//! every older one, entries removed leave the others where they were, and no entry is
//! skipped or repeated. A batch starts with a range lookup, not a copy of the list.

use std::collections::BTreeMap;
use std::sync::Arc;

/// Cookies of "." and ".."; entries start after them.
pub const FIRST_COOKIE: u64 = 3;

#[derive(Debug, Clone, Copy)]
struct Entry {
    ino: u64,
    cookie: u64,
}

#[derive(Debug)]
pub struct Children {
    by_name: BTreeMap<Arc<[u8]>, Entry>,
    by_cookie: BTreeMap<u64, Arc<[u8]>>,
    next_cookie: u64,
}

impl Default for Children {
    fn default() -> Self {
        Children {
            by_name: BTreeMap::new(),
            by_cookie: BTreeMap::new(),
            next_cookie: FIRST_COOKIE,
        }
    }
}

impl Children {
    pub fn get(&self, name: &[u8]) -> Option<u64> {
        self.by_name.get(name).map(|e| e.ino)
    }

    pub fn contains_key(&self, name: &[u8]) -> bool {
        self.by_name.contains_key(name)
    }

    /// Add `name`, or point an existing `name` at `ino` (it keeps its place in listings).
    pub fn insert(&mut self, name: &[u8], ino: u64) {
        if let Some(e) = self.by_name.get_mut(name) {
            e.ino = ino;
            return;
        }
        let name: Arc<[u8]> = Arc::from(name);
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        self.by_cookie.insert(cookie, name.clone());
        self.by_name.insert(name, Entry { ino, cookie });
    }

    pub fn remove(&mut self, name: &[u8]) -> Option<u64> {
        let e = self.by_name.remove(name)?;
        self.by_cookie.remove(&e.cookie);
        Some(e.ino)
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// (name, inode) in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], u64)> {
        self.by_name.iter().map(|(n, e)| (&n[..], e.ino))
    }

    /// (cookie, name, inode) of the entries listed after `cookie`, in listing order.
    pub fn after(&self, cookie: u64) -> impl Iterator<Item = (u64, &[u8], u64)> {
        self.by_cookie
            .range(cookie.saturating_add(1)..)
            .map(|(&c, n)| (c, &n[..], self.by_name[n].ino))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names listed in batches of `batch` while `change` runs between batches.
    fn list(d: &mut Children, batch: usize, mut change: impl FnMut(&mut Children)) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut pos = 0;
        loop {
            let got: Vec<(u64, Vec<u8>)> = d
                .after(pos)
                .take(batch)
                .map(|(c, n, _)| (c, n.to_vec()))
                .collect();
            let Some(last) = got.last() else { break };
            pos = last.0;
            out.extend(got.into_iter().map(|(_, n)| n));
            change(d);
        }
        out
    }

    #[test]
    fn entries_present_throughout_are_listed_exactly_once() {
        let mut d = Children::default();
        for i in 0..100u64 {
            d.insert(format!("f{i:03}").as_bytes(), i);
        }
        let mut k = 0;
        let seen = list(&mut d, 7, |d| {
            // Remove an entry listed already and one not yet listed, add a new one.
            if k < 40 {
                k += 1;
                d.remove(format!("f{:03}", k - 1).as_bytes());
                d.remove(format!("f{:03}", 99 - k).as_bytes());
                d.insert(format!("new{k}").as_bytes(), 1000 + k);
            }
        });
        for i in 0..100u64 {
            let n = format!("f{i:03}").into_bytes();
            let count = seen.iter().filter(|s| **s == n).count();
            assert!(count <= 1, "f{i:03} listed {count} times");
            // Entries that were never removed must be there.
            if i >= k && i < 99 - k {
                assert_eq!(count, 1, "f{i:03} skipped");
            }
        }
        assert!(seen.iter().any(|s| s.starts_with(b"new")));
    }

    #[test]
    fn replacing_keeps_the_place() {
        let mut d = Children::default();
        d.insert(b"a", 1);
        d.insert(b"b", 2);
        d.insert(b"a", 3);
        let v: Vec<_> = d.after(0).map(|(c, n, i)| (c, n.to_vec(), i)).collect();
        assert_eq!(
            v,
            vec![
                (FIRST_COOKIE, b"a".to_vec(), 3),
                (FIRST_COOKIE + 1, b"b".to_vec(), 2)
            ]
        );
        assert_eq!(d.remove(b"a"), Some(3));
        assert_eq!(d.after(FIRST_COOKIE).count(), 1);
        assert_eq!(d.len(), 1);
    }
}
