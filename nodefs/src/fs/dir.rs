//! A loaded directory's entries, by name for lookups and by cookie for listings.
//!
//! A listing continues from the cookie of the last entry the kernel took, so each entry
//! keeps its cookie while it exists: entries added between two getdents batches come after
//! every older one, entries removed leave the others where they were, and no entry is
//! skipped or repeated. A batch starts with a range lookup, not a copy of the list.
//!
//! Entries of the directory's tree become inodes only when a name is looked up, changed or
//! the directory listed: exec'ing one program in a fresh sandbox looks up a handful of names
//! in directories of hundreds, and those stay in the shared decoded tree ([`Base`]). A tree
//! entry's cookie is its place in the tree, so a listing is in name order, as before.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::tree::{Entry as TreeEntry, Tree};

/// Cookies of "." and ".."; entries start after them.
pub const FIRST_COOKIE: u64 = 3;

#[derive(Debug, Clone, Copy)]
struct Entry {
    ino: u64,
    cookie: u64,
}

/// The directory's tree entries that are not inodes yet.
#[derive(Debug)]
struct Base {
    tree: Arc<Tree>,
    /// Per tree entry: made an inode, replaced or removed.
    taken: Vec<bool>,
    pending: usize,
}

#[derive(Debug)]
pub struct Children {
    by_name: BTreeMap<Arc<[u8]>, Entry>,
    by_cookie: BTreeMap<u64, Arc<[u8]>>,
    next_cookie: u64,
    base: Option<Base>,
}

impl Default for Children {
    fn default() -> Self {
        Children {
            by_name: BTreeMap::new(),
            by_cookie: BTreeMap::new(),
            next_cookie: FIRST_COOKIE,
            base: None,
        }
    }
}

impl Children {
    /// The entries of `tree`, none of them an inode yet.
    pub fn from_tree(tree: Arc<Tree>) -> Self {
        let n = tree.entries.len();
        Children {
            next_cookie: FIRST_COOKIE + n as u64,
            base: (n > 0).then(|| Base {
                tree,
                taken: vec![false; n],
                pending: n,
            }),
            ..Default::default()
        }
    }

    /// The inode of `name`, if it is one already; [`Children::pending`] has the others.
    pub fn get(&self, name: &[u8]) -> Option<u64> {
        self.by_name.get(name).map(|e| e.ino)
    }

    /// The tree entry named `name` that is not an inode yet, with its index.
    pub fn pending(&self, name: &[u8]) -> Option<(usize, &TreeEntry)> {
        let b = self.base.as_ref()?;
        let i = b
            .tree
            .entries
            .binary_search_by(|e| e.name.as_slice().cmp(name))
            .ok()?;
        (!b.taken[i]).then(|| (i, &b.tree.entries[i]))
    }

    /// Indexes of the tree entries that are not inodes yet.
    pub fn pending_indexes(&self) -> Vec<usize> {
        match &self.base {
            Some(b) => (0..b.taken.len()).filter(|&i| !b.taken[i]).collect(),
            None => Vec::new(),
        }
    }

    /// The directory's tree, while some of its entries are not inodes.
    pub fn base_tree(&self) -> Option<&Arc<Tree>> {
        self.base.as_ref().map(|b| &b.tree)
    }

    /// Tree entry `i` is now inode `ino`, keeping its cookie.
    pub fn take(&mut self, i: usize, ino: u64) {
        let Some(b) = &mut self.base else { return };
        if std::mem::replace(&mut b.taken[i], true) {
            return;
        }
        b.pending -= 1;
        let name: Arc<[u8]> = Arc::from(b.tree.entries[i].name.as_slice());
        if b.pending == 0 {
            self.base = None;
        }
        let cookie = FIRST_COOKIE + i as u64;
        self.by_cookie.insert(cookie, name.clone());
        self.by_name.insert(name, Entry { ino, cookie });
    }

    /// Marks tree entry `name` gone (replaced or removed); true if there was one.
    fn drop_pending(&mut self, name: &[u8]) -> bool {
        let Some((i, _)) = self.pending(name) else {
            return false;
        };
        let b = self.base.as_mut().expect("pending");
        b.taken[i] = true;
        b.pending -= 1;
        if b.pending == 0 {
            self.base = None;
        }
        true
    }

    pub fn contains_key(&self, name: &[u8]) -> bool {
        self.by_name.contains_key(name) || self.pending(name).is_some()
    }

    /// Add `name`, or point an existing `name` at `ino` (it keeps its place in listings).
    pub fn insert(&mut self, name: &[u8], ino: u64) {
        if let Some(e) = self.by_name.get_mut(name) {
            e.ino = ino;
            return;
        }
        if let Some((i, _)) = self.pending(name) {
            self.take(i, ino);
            return;
        }
        let name: Arc<[u8]> = Arc::from(name);
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        self.by_cookie.insert(cookie, name.clone());
        self.by_name.insert(name, Entry { ino, cookie });
    }

    /// Removes `name`; its inode if it was one.
    pub fn remove(&mut self, name: &[u8]) -> Option<u64> {
        let Some(e) = self.by_name.remove(name) else {
            self.drop_pending(name);
            return None;
        };
        self.by_cookie.remove(&e.cookie);
        Some(e.ino)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn len(&self) -> usize {
        self.by_name.len() + self.base.as_ref().map_or(0, |b| b.pending)
    }

    /// Whether every entry is an inode (what [`Children::iter`] and [`Children::after`] need).
    pub fn is_complete(&self) -> bool {
        self.base.is_none()
    }

    /// (name, inode) in name order. The directory must be complete.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], u64)> {
        debug_assert!(self.is_complete(), "iterating a partly loaded directory");
        self.by_name.iter().map(|(n, e)| (&n[..], e.ino))
    }

    /// (cookie, name, inode) of the entries listed after `cookie`, in listing order. The
    /// directory must be complete.
    pub fn after(&self, cookie: u64) -> impl Iterator<Item = (u64, &[u8], u64)> {
        debug_assert!(self.is_complete(), "listing a partly loaded directory");
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

    fn tree(names: &[&str]) -> Arc<Tree> {
        let entries = names
            .iter()
            .map(|n| TreeEntry {
                name: n.as_bytes().to_vec(),
                meta: Default::default(),
                link: 0,
                nlink: 1,
                node: crate::tree::Node::Fifo,
            })
            .collect();
        Arc::new(Tree {
            meta: Default::default(),
            entries,
        })
    }

    #[test]
    fn tree_entries_become_inodes_one_by_one_and_list_in_tree_order() {
        let mut d = Children::from_tree(tree(&["a", "b", "c", "d"]));
        assert_eq!(d.len(), 4);
        assert!(d.contains_key(b"c") && !d.is_complete());
        assert_eq!(d.get(b"b"), None, "not an inode until taken");
        let (i, e) = d.pending(b"b").expect("b pending");
        assert_eq!((i, e.name.as_slice()), (1, &b"b"[..]));
        d.take(i, 20);
        assert_eq!(d.get(b"b"), Some(20));
        assert!(d.pending(b"b").is_none());
        // Replacing a pending name takes its place; removing one drops it.
        d.insert(b"d", 40);
        assert_eq!(d.remove(b"c"), None);
        assert!(!d.contains_key(b"c"));
        d.insert(b"e", 50);
        assert_eq!(d.len(), 4, "a, b, d, e");
        assert_eq!(d.pending_indexes(), vec![0]);
        d.take(0, 10);
        assert!(d.is_complete());
        let listed: Vec<_> = d.after(0).map(|(c, n, i)| (c, n.to_vec(), i)).collect();
        assert_eq!(
            listed,
            vec![
                (FIRST_COOKIE, b"a".to_vec(), 10),
                (FIRST_COOKIE + 1, b"b".to_vec(), 20),
                (FIRST_COOKIE + 3, b"d".to_vec(), 40),
                (FIRST_COOKIE + 4, b"e".to_vec(), 50),
            ]
        );
        // A removed tree name can come back as a new entry, after the others.
        d.insert(b"c", 30);
        assert_eq!(
            d.after(FIRST_COOKIE + 4).next().map(|(_, n, _)| n),
            Some(&b"c"[..])
        );
    }
}
