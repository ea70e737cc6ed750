//! Turning a mount's state into a manifest. Unloaded directories are reused by id,
//! pristine files by their chunk list; only changed byte ranges are re-chunked.

use std::collections::{HashMap, HashSet};
use std::io::Read;

use super::file::{Base, FileData, BLOCK};
use super::state::{Content, State};
use crate::chunker::{chunk_reader, ChunkError, ChunkPolicy};
use crate::error::Error;
use crate::id::ObjectId;
use crate::store::{Store, MAX_DELTA_DEPTH};
use crate::tree::{ChunkRef, Entry, Node, Tree};

fn eio(e: std::io::Error) -> Error {
    Error::Io {
        path: "<mount upper layer>".into(),
        source: e,
    }
}

/// Build the manifest of the whole mount. Caller holds the state lock.
pub fn commit(st: &mut State, store: &Store) -> Result<ObjectId, Error> {
    // Hard-linked inodes changed in this mount: directories holding another link to them
    // must be re-serialized even if never loaded.
    let dirty_links: HashSet<u64> = st
        .inodes
        .values()
        .filter(|i| i.link != 0 && i.touched)
        .map(|i| i.link)
        .collect();
    if !dirty_links.is_empty() {
        let mut memo = HashMap::new();
        load_linked(st, store, 1, &dirty_links, &mut memo)?;
    }
    dir_tree(st, store, 1)
}

fn tree_has_links(
    store: &Store,
    id: &ObjectId,
    links: &HashSet<u64>,
    memo: &mut HashMap<ObjectId, bool>,
) -> Result<bool, Error> {
    if let Some(v) = memo.get(id) {
        return Ok(*v);
    }
    let t = store.get_tree(id)?;
    let mut found = false;
    for e in &t.entries {
        found = match &e.node {
            Node::Dir(c) => tree_has_links(store, c, links, memo)?,
            _ => e.link != 0 && links.contains(&e.link),
        };
        if found {
            break;
        }
    }
    memo.insert(*id, found);
    Ok(found)
}

fn load_linked(
    st: &mut State,
    store: &Store,
    ino: u64,
    links: &HashSet<u64>,
    memo: &mut HashMap<ObjectId, bool>,
) -> Result<(), Error> {
    let unloaded = match st.inodes.get(&ino).map(|i| &i.content) {
        Some(Content::Dir(d)) if d.children.is_none() => d.tree,
        Some(Content::Dir(_)) => None,
        _ => return Ok(()),
    };
    if let Some(t) = unloaded {
        if !tree_has_links(store, &t, links, memo)? {
            return Ok(());
        }
    }
    st.load_all(ino)
        .map_err(|e| eio(std::io::Error::from_raw_os_error(e)))?;
    let kids: Vec<u64> = match &st.inodes[&ino].content {
        Content::Dir(d) => d
            .children
            .as_ref()
            .map(|c| c.iter().map(|(_, k)| k).collect())
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    for k in kids {
        load_linked(st, store, k, links, memo)?;
    }
    Ok(())
}

fn dir_tree(st: &mut State, store: &Store, ino: u64) -> Result<ObjectId, Error> {
    if matches!(&st.inodes[&ino].content, Content::Dir(d) if d.children.is_some()) {
        st.load_all(ino)
            .map_err(|e| eio(std::io::Error::from_raw_os_error(e)))?;
    }
    let (children, tree) = match &st.inodes[&ino].content {
        Content::Dir(d) => (
            d.children
                .as_ref()
                .map(|c| c.iter().map(|(n, i)| (n.to_vec(), i)).collect::<Vec<_>>()),
            d.tree,
        ),
        _ => unreachable!("dir_tree on a non-directory"),
    };
    let Some(children) = children else {
        return Ok(tree.expect("an unloaded directory has a tree"));
    };
    let mut entries = Vec::with_capacity(children.len());
    for (name, cino) in children {
        let node = match &st.inodes[&cino].content {
            Content::Dir(_) => Node::Dir(dir_tree(st, store, cino)?),
            Content::File(_) => {
                let chunks = file_chunks(st, store, cino)?;
                let size = chunks.iter().map(|c| c.len as u64).sum();
                Node::File { size, chunks }
            }
            Content::Symlink(t) => Node::Symlink(t.clone()),
            Content::Special { kind, rdev } => match kind {
                fuser::FileType::NamedPipe => Node::Fifo,
                fuser::FileType::Socket => Node::Socket,
                fuser::FileType::CharDevice => Node::CharDev(*rdev),
                _ => Node::BlockDev(*rdev),
            },
        };
        let i = &st.inodes[&cino];
        let is_dir = matches!(node, Node::Dir(_));
        let (link, nlink) = if !is_dir && i.nlink > 1 {
            (i.link, i.nlink)
        } else {
            (0, 1)
        };
        entries.push(Entry {
            name,
            meta: i.meta.clone(),
            link,
            nlink,
            node,
        });
    }
    let meta = st.inodes[&ino].meta.clone();
    Ok(store.put_tree(&Tree { meta, entries })?)
}

fn file_chunks(st: &mut State, store: &Store, ino: u64) -> Result<Vec<ChunkRef>, Error> {
    let Some(Content::File(f)) = st.inodes.get_mut(&ino).map(|i| &mut i.content) else {
        unreachable!("file_chunks on a non-file")
    };
    if f.is_pristine() {
        return Ok(f.base.chunks.clone());
    }
    if let Some((v, c)) = &f.memo {
        if *v == f.version {
            return Ok(c.as_ref().clone());
        }
    }
    let out = rechunk(f, store)?;
    f.memo = Some((f.version, std::sync::Arc::new(out.clone())));
    Ok(out)
}

/// Keep the chunks of the reference no change touched; re-chunk the rest, each new chunk
/// with the reference chunk it replaces as delta parent. The reference is this file's last
/// commit in this mount (changes since then are re-chunked), else its base (changes since
/// the mount are).
pub(super) fn rechunk(f: &mut FileData, store: &Store) -> Result<Vec<ChunkRef>, Error> {
    let (reference, visible) = match &f.committed {
        Some(c) => (c.clone(), c.len()),
        None => (f.base.clone(), f.base_len),
    };
    let since_commit = f.committed.is_some();
    let clean: Vec<bool> = reference
        .chunks
        .iter()
        .zip(&reference.offsets)
        .map(|(c, &start)| {
            let end = start + c.len as u64;
            end <= visible
                && end <= f.size
                && (start / BLOCK..=(end - 1) / BLOCK).all(|b| {
                    if since_commit {
                        !f.is_changed(b)
                    } else {
                        !f.is_present(b)
                    }
                })
        })
        .collect();
    let mut out = Vec::new();
    let mut dirty_start: Option<u64> = None;
    let mut pos = 0u64;
    for (i, c) in reference.chunks.iter().enumerate() {
        let start = reference.offsets[i];
        let end = start + c.len as u64;
        if clean[i] {
            if let Some(ds) = dirty_start.take() {
                emit(f, store, ds, start, &reference, &mut out)?;
            }
            out.push(*c);
        } else if dirty_start.is_none() {
            dirty_start = Some(start);
        }
        pos = end;
        if pos >= f.size {
            break;
        }
    }
    let ds = dirty_start.unwrap_or(pos.min(f.size));
    if ds < f.size {
        emit(f, store, ds, f.size, &reference, &mut out)?;
    }
    Ok(out)
}

/// After a commit is sealed: files whose content is what it committed start their next
/// commit from it.
pub(super) fn start_from_commit(st: &mut State) {
    for i in st.inodes.values_mut() {
        let Content::File(f) = &mut i.content else {
            continue;
        };
        let Some((v, chunks)) = &f.memo else { continue };
        if *v == f.version && (f.committed.is_none() || !f.changed.is_empty()) {
            let chunks = chunks.clone();
            f.committed_as(&chunks);
        }
    }
}

/// The id of the chunk of `b` holding byte `off`.
fn chunk_at(b: &Base, off: u64) -> Option<ObjectId> {
    match b.offsets.binary_search(&off) {
        Ok(i) => b.chunks.get(i).map(|c| c.id),
        Err(0) => None,
        Err(i) => b.chunks.get(i - 1).map(|c| c.id),
    }
}

struct ViewReader<'a> {
    f: &'a mut FileData,
    store: &'a Store,
    pos: u64,
    end: u64,
}

impl Read for ViewReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = ((self.end - self.pos) as usize).min(buf.len());
        if n == 0 {
            return Ok(0);
        }
        self.f.read_into(self.store, self.pos, &mut buf[..n])?;
        self.pos += n as u64;
        Ok(n)
    }
}

fn emit(
    f: &mut FileData,
    store: &Store,
    start: u64,
    end: u64,
    base: &Base,
    out: &mut Vec<ChunkRef>,
) -> Result<(), Error> {
    let orig = f.base.clone();
    let mut r = ViewReader {
        f,
        store,
        pos: start,
        end,
    };
    let mut off = start;
    // New content (past the base) is stored in parallel batches; rewritten ranges go one
    // by one, each tried as a delta against the base chunk it replaces.
    let mut batch: Vec<Vec<u8>> = Vec::new();
    let mut batch_bytes = 0usize;
    let flush = |batch: &mut Vec<Vec<u8>>, out: &mut Vec<ChunkRef>| -> Result<(), Error> {
        if batch.is_empty() {
            return Ok(());
        }
        let ids = store.put_chunks(batch)?;
        out.extend(ids.into_iter().zip(batch.iter()).map(|(id, c)| ChunkRef {
            id,
            len: c.len() as u32,
        }));
        batch.clear();
        Ok(())
    };
    chunk_reader(&mut r, ChunkPolicy::Cdc, &mut |c| {
        // The chunk this one replaces; if that is a delta chain at its longest already (a
        // block rewritten in many commits), the mount's base chunk there instead.
        let parent = chunk_at(base, off)
            .filter(|p| store.delta_depth(p).is_some_and(|d| d < MAX_DELTA_DEPTH))
            .or_else(|| chunk_at(&orig, off));
        off += c.len() as u64;
        match parent {
            Some(p) => {
                flush(&mut batch, out)?;
                batch_bytes = 0;
                let id = store.put_chunk(c, Some(&p))?;
                out.push(ChunkRef {
                    id,
                    len: c.len() as u32,
                });
            }
            None => {
                batch.push(c.to_vec());
                batch_bytes += c.len();
                if batch_bytes >= 8 << 20 {
                    batch_bytes = 0;
                    flush(&mut batch, out)?;
                }
            }
        }
        Ok(())
    })
    .map_err(|e| match e {
        ChunkError::Io(e) => eio(e),
        ChunkError::Sink(e) => e,
    })?;
    flush(&mut batch, out)
}
