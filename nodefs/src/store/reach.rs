//! What a manifest reaches: its trees, their files' chunks, and the delta bases they are
//! stored against.

use std::collections::HashSet;

use super::Store;
use crate::error::Error;
use crate::id::{ManifestId, ObjectId};
use crate::pack::Codec;
use crate::tree::{Node, Tree};

impl Store {
    /// Logical size (sum of regular file sizes, hard links once) of a tree.
    pub fn manifest_bytes(&self, id: &ManifestId) -> Result<u64, Error> {
        let mut total = 0u64;
        let mut links = HashSet::new();
        self.walk(id, &mut |_, t| {
            for e in &t.entries {
                if let Node::File { size, .. } = e.node {
                    if e.link == 0 || links.insert(e.link) {
                        total += size;
                    }
                }
            }
            Ok(())
        })?;
        Ok(total)
    }

    /// Visit every tree object reachable from `root` (each distinct tree once).
    pub fn walk(
        &self,
        root: &ObjectId,
        f: &mut dyn FnMut(&ObjectId, &Tree) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let mut seen = HashSet::new();
        let mut stack = vec![*root];
        while let Some(id) = stack.pop() {
            if !seen.insert(id) {
                continue;
            }
            let t = self.get_tree(&id)?;
            for e in &t.entries {
                if let Node::Dir(c) = e.node {
                    stack.push(c);
                }
            }
            f(&id, &t)?;
        }
        Ok(())
    }

    /// Every object id (trees and chunks, plus delta bases) a manifest reaches.
    pub fn reachable(&self, root: &ManifestId) -> Result<HashSet<ObjectId>, Error> {
        let mut out = HashSet::new();
        self.reach(root, &mut out, &mut |_| {})?;
        self.add_delta_bases(&mut out);
        Ok(out)
    }

    /// Adds the trees and chunks `root` reaches to `out` (not their delta bases), calling
    /// `on_file` with each file's chunk list.
    pub(super) fn reach(
        &self,
        root: &ManifestId,
        out: &mut HashSet<ObjectId>,
        on_file: &mut dyn FnMut(&[crate::ChunkRef]),
    ) -> Result<(), Error> {
        self.walk(root, &mut |id, t| {
            out.insert(*id);
            for e in &t.entries {
                if let Node::File { chunks, .. } = &e.node {
                    out.extend(chunks.iter().map(|c| c.id));
                    on_file(chunks);
                }
            }
            Ok(())
        })
    }

    pub(super) fn add_delta_bases(&self, set: &mut HashSet<ObjectId>) {
        let mut todo: Vec<ObjectId> = set.iter().copied().collect();
        while let Some(id) = todo.pop() {
            if let Some(l) = self.packs.get(&id) {
                if l.codec == Codec::Delta && set.insert(l.base) {
                    todo.push(l.base);
                }
            }
        }
    }
}
