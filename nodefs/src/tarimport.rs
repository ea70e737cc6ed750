//! Applying tar streams (plain tars and OCI layers) onto an in-memory tree.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Read;
use std::path::Path;

use crate::chunk_writer::ChunkWriter;
use crate::chunker::{ChunkError, ChunkPolicy};
use crate::error::Error;
use crate::id::ManifestId;
use crate::import::{clean_path, dir_at, new_group, node_at, node_at_mut, path_display, MemNode};
use crate::store::Store;
use crate::tree::{Meta, Node};

impl Store {
    /// Import a tar stream. Malformed entries are refused, naming the entry.
    pub fn import_tar(&self, r: &mut dyn Read) -> Result<ManifestId, Error> {
        let _g = self.write_guard();
        let mut root = MemNode::empty_dir();
        let mut groups = 0u64;
        self.apply_tar(&mut root, r, false, &mut groups)?;
        let id = self.store_mem(&root)?;
        self.seal_import(&id)?;
        Ok(id)
    }

    /// Apply one tar onto `root`; with `whiteouts`, OCI `.wh.` entries delete. The file
    /// contents are compressed and stored on other cores while this thread reads on.
    pub(crate) fn apply_tar(
        &self,
        root: &mut MemNode,
        r: &mut dyn Read,
        whiteouts: bool,
        groups: &mut u64,
    ) -> Result<(), Error> {
        std::thread::scope(|s| {
            let writer = ChunkWriter::start(s, self);
            let applied = self.apply_tar_with(root, r, whiteouts, groups, &writer);
            // A store failure (no space, say) stops the tar early: report it, not the stop.
            writer.finish().and(applied)
        })
    }

    fn apply_tar_with(
        &self,
        root: &mut MemNode,
        r: &mut dyn Read,
        whiteouts: bool,
        groups: &mut u64,
        writer: &ChunkWriter<'_>,
    ) -> Result<(), Error> {
        let mut ar = tar::Archive::new(r);
        let entries = ar.entries().map_err(|e| Error::BadTar {
            entry: "<archive>".into(),
            why: e.to_string(),
        })?;
        let mut link_groups: HashMap<Vec<Vec<u8>>, u64> = HashMap::new();
        // Paths this tar has put in the tree; with `whiteouts`, what a whiteout must keep.
        let mut added: HashSet<Vec<Vec<u8>>> = HashSet::new();
        for (i, ent) in entries.enumerate() {
            let mut ent = ent.map_err(|e| Error::BadTar {
                entry: format!("#{i}"),
                why: e.to_string(),
            })?;
            let path = ent.path().map_err(|e| Error::BadTar {
                entry: format!("#{i}"),
                why: e.to_string(),
            })?;
            let name = path_display(&path);
            let bad = |why: &str| Error::BadTar {
                entry: name.clone(),
                why: why.to_string(),
            };
            let comps =
                clean_path(&path).ok_or_else(|| bad("path escapes the archive root (..)"))?;
            let h = ent.header().clone();
            let meta = tar_meta(&mut ent, &h).map_err(|e| bad(&e.to_string()))?;
            let et = h.entry_type();
            if comps.is_empty() {
                if et.is_dir() {
                    if let MemNode::Dir { meta: m, .. } = root {
                        *m = meta;
                    }
                    continue;
                }
                return Err(bad("entry has an empty path"));
            }
            let (last, parent) = comps.split_last().expect("non-empty");
            if whiteouts {
                // Whiteouts hide what the layers below put there, never this layer's own
                // entries, wherever the marker falls in the tar (OCI image spec, "Whiteouts").
                if last == b".wh..wh..opq" {
                    // The marker says its directory exists in this layer.
                    dir_at(root, parent).ok_or_else(|| bad("parent is not a directory"))?;
                    added.insert(parent.to_vec());
                    if let Some(MemNode::Dir { children, .. }) = node_at_mut(root, parent) {
                        let mut path = parent.to_vec();
                        prune_children(children, &mut path, &added);
                    }
                    continue;
                }
                if last.starts_with(b".wh..wh.") {
                    // Other reserved names (e.g. `.wh..wh..plnk`) carry nothing to apply.
                    continue;
                }
                if let Some(target) = last.strip_prefix(b".wh.") {
                    if let Some(MemNode::Dir { children, .. }) = node_at_mut(root, parent) {
                        if let Some(child) = children.get_mut(target) {
                            let mut path = parent.to_vec();
                            path.push(target.to_vec());
                            if !prune_lower(child, &mut path, &added) {
                                children.remove(target);
                            }
                        }
                    }
                    continue;
                }
            }
            let pseudo = et.is_pax_global_extensions()
                || et.is_pax_local_extensions()
                || et.is_gnu_longname()
                || et.is_gnu_longlink();
            if whiteouts && !pseudo {
                added.insert(comps.clone());
            }
            let node = if et.is_dir() {
                dir_at(root, &comps).ok_or_else(|| bad("parent is not a directory"))?;
                // Update the directory's own metadata, keeping its children.
                let parent_ch =
                    dir_at(root, parent).ok_or_else(|| bad("parent is not a directory"))?;
                if let Some(MemNode::Dir { meta: m, .. }) = parent_ch.get_mut(last) {
                    *m = meta;
                }
                continue;
            } else if et.is_file() || et == tar::EntryType::Continuous {
                let size = h.size().unwrap_or(0);
                let node =
                    match self.chunk_stream_to(&mut ent, ChunkPolicy::Cdc, size, Some(writer)) {
                        Ok(n) => n,
                        Err(ChunkError::Io(e)) => {
                            return Err(bad(&format!("reading content: {e}")))
                        }
                        Err(ChunkError::Sink(e)) => return Err(e),
                    };
                if let Node::File { size, .. } = &node {
                    if *size != h.size().unwrap_or(0) {
                        return Err(bad("content shorter than its header says"));
                    }
                }
                (node, 0)
            } else if et.is_symlink() {
                let t = ent
                    .link_name_bytes()
                    .ok_or_else(|| bad("symlink without target"))?;
                (Node::Symlink(t.to_vec()), 0)
            } else if et.is_hard_link() {
                let t = ent
                    .link_name()
                    .map_err(|e| bad(&e.to_string()))?
                    .ok_or_else(|| bad("hard link without target"))?;
                let tcomps = clean_path(&t).ok_or_else(|| bad("hard link target escapes root"))?;
                let target = node_at(root, &tcomps)
                    .ok_or_else(|| bad(&format!("hard link target {} not found", t.display())))?;
                let MemNode::Leaf {
                    node,
                    group,
                    meta: tmeta,
                } = target.clone()
                else {
                    return Err(bad("hard link to a directory"));
                };
                let g = if group != 0 {
                    group
                } else {
                    let g = *link_groups
                        .entry(tcomps.clone())
                        .or_insert_with(|| new_group(groups));
                    if let Some(MemNode::Leaf { group, .. }) =
                        dir_at(root, &tcomps[..tcomps.len() - 1])
                            .and_then(|c| c.get_mut(&tcomps[tcomps.len() - 1]))
                    {
                        *group = g;
                    }
                    g
                };
                let ch = dir_at(root, parent).ok_or_else(|| bad("parent is not a directory"))?;
                ch.insert(
                    last.clone(),
                    MemNode::Leaf {
                        meta: tmeta,
                        node,
                        group: g,
                    },
                );
                continue;
            } else if et.is_fifo() {
                (Node::Fifo, 0)
            } else if et.is_character_special() || et.is_block_special() {
                let maj = h.device_major().ok().flatten().unwrap_or(0) as u64;
                let min = h.device_minor().ok().flatten().unwrap_or(0) as u64;
                let rdev = libc::makedev(maj as u32, min as u32);
                if et.is_character_special() {
                    (Node::CharDev(rdev), 0)
                } else {
                    (Node::BlockDev(rdev), 0)
                }
            } else if et.is_pax_global_extensions()
                || et.is_pax_local_extensions()
                || et.is_gnu_longname()
                || et.is_gnu_longlink()
            {
                continue;
            } else {
                return Err(bad(&format!("unsupported entry type {:?}", et)));
            };
            let ch = dir_at(root, parent).ok_or_else(|| bad("parent is not a directory"))?;
            ch.insert(
                last.clone(),
                MemNode::Leaf {
                    meta,
                    node: node.0,
                    group: node.1,
                },
            );
        }
        Ok(())
    }
}

/// Strip from `node` (at `path`) what lower layers put there, keeping what the current
/// layer `added`. Returns whether anything of `node` is left: a leaf the layer wrote, a
/// directory the layer named, or a directory still holding some of the layer's entries.
fn prune_lower(node: &mut MemNode, path: &mut Vec<Vec<u8>>, added: &HashSet<Vec<Vec<u8>>>) -> bool {
    match node {
        MemNode::Leaf { .. } => added.contains(path),
        MemNode::Dir { children, .. } => {
            prune_children(children, path, added);
            added.contains(path) || !children.is_empty()
        }
    }
}

/// [`prune_lower`] over each child of the directory at `path`.
fn prune_children(
    children: &mut BTreeMap<Vec<u8>, MemNode>,
    path: &mut Vec<Vec<u8>>,
    added: &HashSet<Vec<Vec<u8>>>,
) {
    children.retain(|name, child| {
        path.push(name.clone());
        let keep = prune_lower(child, path, added);
        path.pop();
        keep
    });
}

/// A tar header whose fields do not parse; the import refuses the entry as a bad tar.
#[derive(Debug, thiserror::Error)]
enum HeaderError {
    /// `field` (mode, uid, gid, mtime) is not a number the tar crate reads.
    #[error("bad {field}: {error}")]
    Field {
        field: &'static str,
        error: std::io::Error,
    },
}

fn tar_meta<R: Read>(ent: &mut tar::Entry<'_, R>, h: &tar::Header) -> Result<Meta, HeaderError> {
    let bad =
        |field: &'static str| move |error: std::io::Error| HeaderError::Field { field, error };
    let mode = h.mode().map_err(bad("mode"))? & 0o7777;
    let uid = h.uid().map_err(bad("uid"))? as u32;
    let gid = h.gid().map_err(bad("gid"))? as u32;
    let mtime = h.mtime().map_err(bad("mtime"))? as i64;
    let mut meta = Meta {
        mode,
        uid,
        gid,
        mtime_sec: mtime,
        mtime_nsec: 0,
        xattrs: Default::default(),
    };
    if let Ok(Some(exts)) = ent.pax_extensions() {
        for ext in exts.flatten() {
            let Ok(k) = ext.key() else { continue };
            if let Some(x) = k.strip_prefix("SCHILY.xattr.") {
                meta.xattrs
                    .insert(x.as_bytes().to_vec(), ext.value_bytes().to_vec());
            } else if k == "mtime" {
                if let Ok(v) = ext.value() {
                    let mut it = v.splitn(2, '.');
                    if let Some(s) = it.next().and_then(|s| s.parse::<i64>().ok()) {
                        meta.mtime_sec = s;
                    }
                    if let Some(frac) = it.next() {
                        let digits: String = frac.chars().take(9).collect();
                        let n = format!("{digits:0<9}");
                        meta.mtime_nsec = n.parse().unwrap_or(0);
                    }
                }
            }
        }
    }
    Ok(meta)
}

/// Path of a blob in an OCI layout.
pub(crate) fn blob_path(layout: &Path, digest: &str) -> Option<std::path::PathBuf> {
    let (alg, hex) = digest.split_once(':')?;
    if alg.is_empty() || hex.is_empty() || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    Some(layout.join("blobs").join(alg).join(hex))
}
