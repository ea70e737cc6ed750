//! Building manifests from a directory, a tar stream or an OCI image layout.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::chunk_writer::ChunkWriter;
use crate::chunker::{chunk_reader, chunk_slice, ChunkError, ChunkPolicy};
use crate::error::{io_err, Error};
use crate::fs::ObjectWriter;
use crate::id::{ManifestId, ObjectId};
use crate::store::Store;
use crate::sys;
use crate::tree::{ChunkRef, Entry, Meta, Node, Tree};

/// Chunks are hashed, compressed and appended in batches of about this many bytes.
const BATCH_BYTES: usize = 8 << 20;
/// Files up to this size are read whole and cut in memory (see [`chunk_slice`]).
const SLURP_BYTES: usize = 4 << 20;

/// An in-memory tree being assembled before it is written as objects.
#[derive(Clone, Debug)]
pub(crate) enum MemNode {
    Dir {
        meta: Meta,
        children: BTreeMap<Vec<u8>, MemNode>,
    },
    Leaf {
        meta: Meta,
        node: Node,
        /// Provisional hard-link group (0 = none).
        group: u64,
    },
}

impl MemNode {
    pub(crate) fn empty_dir() -> MemNode {
        MemNode::Dir {
            meta: Meta {
                mode: 0o755,
                ..Default::default()
            },
            children: BTreeMap::new(),
        }
    }
}

impl Store {
    /// Import a directory tree with content-defined chunking.
    pub fn import_dir(&self, src: &Path) -> Result<ManifestId, Error> {
        self.import_dir_with(src, &|_| ChunkPolicy::Cdc)
    }

    /// Import a directory tree; `policy` picks the chunking per file (path relative to `src`).
    pub fn import_dir_with(
        &self,
        src: &Path,
        policy: &dyn Fn(&Path) -> ChunkPolicy,
    ) -> Result<ManifestId, Error> {
        self.import_dir_based(src, policy, None)
    }

    /// `import_dir_with`, storing each directory as a delta against the same directory of
    /// `base` (an earlier import of a similar tree, e.g. the previous checkpoint of the same
    /// sandbox) where that is much smaller. The manifest is the same either way.
    pub fn import_dir_based(
        &self,
        src: &Path,
        policy: &dyn Fn(&Path) -> ChunkPolicy,
        base: Option<&ManifestId>,
    ) -> Result<ManifestId, Error> {
        let _g = self.write_guard();
        let md = fs::symlink_metadata(src).map_err(io_err(src))?;
        if !md.is_dir() {
            return Err(Error::Io {
                path: src.to_path_buf(),
                source: std::io::Error::from_raw_os_error(libc::ENOTDIR),
            });
        }
        // Chunk every regular file first, on all cores; the walk below then only assembles.
        let mut files = Vec::new();
        let mut seen = std::collections::HashSet::new();
        collect_files(src, Path::new(""), &mut files, &mut seen)?;
        let pre = Mutex::new(self.chunk_files(&files, policy)?);
        let mut groups = HashMap::new();
        let root = self.read_dir_node(src, Path::new(""), policy, &mut groups, &pre)?;
        let id = self.store_mem_based(&root, base.filter(|b| self.contains(b)))?;
        self.seal_import(&id)?;
        Ok(id)
    }

    fn read_dir_node(
        &self,
        path: &Path,
        rel: &Path,
        policy: &dyn Fn(&Path) -> ChunkPolicy,
        groups: &mut HashMap<(u64, u64), (u64, Node)>,
        pre: &Mutex<HashMap<PathBuf, Node>>,
    ) -> Result<MemNode, Error> {
        let md = fs::symlink_metadata(path).map_err(io_err(path))?;
        let meta = meta_of(path, &md)?;
        let mut children = BTreeMap::new();
        let mut names: Vec<_> = fs::read_dir(path)
            .map_err(io_err(path))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<Result<_, _>>()
            .map_err(io_err(path))?;
        names.sort();
        for name in names {
            let p = path.join(&name);
            let r = rel.join(&name);
            let cmd = fs::symlink_metadata(&p).map_err(io_err(&p))?;
            let ft = cmd.file_type();
            let child = if ft.is_dir() {
                self.read_dir_node(&p, &r, policy, groups, pre)?
            } else {
                let cmeta = meta_of(&p, &cmd)?;
                let key = (cmd.dev(), cmd.ino());
                if ft.is_file() && cmd.nlink() > 1 {
                    if let Some((g, node)) = groups.get(&key) {
                        children.insert(
                            name.as_bytes().to_vec(),
                            MemNode::Leaf {
                                meta: cmeta,
                                node: node.clone(),
                                group: *g,
                            },
                        );
                        continue;
                    }
                }
                let node = if ft.is_file() {
                    let done = pre.lock().remove(&p);
                    match done {
                        Some(n) => n,
                        None => {
                            let mut f = fs::File::open(&p).map_err(io_err(&p))?;
                            self.chunk_stream(&mut f, policy(&r), cmd.len())
                                .map_err(|e| chunk_err(e, &p))?
                        }
                    }
                } else if ft.is_symlink() {
                    Node::Symlink(
                        fs::read_link(&p)
                            .map_err(io_err(&p))?
                            .as_os_str()
                            .as_bytes()
                            .to_vec(),
                    )
                } else if ft.is_fifo() {
                    Node::Fifo
                } else if ft.is_socket() {
                    Node::Socket
                } else if ft.is_char_device() {
                    Node::CharDev(cmd.rdev())
                } else if ft.is_block_device() {
                    Node::BlockDev(cmd.rdev())
                } else {
                    continue;
                };
                let mut group = 0;
                if ft.is_file() && cmd.nlink() > 1 {
                    group = groups.len() as u64 + 1;
                    groups.insert(key, (group, node.clone()));
                }
                MemNode::Leaf {
                    meta: cmeta,
                    node,
                    group,
                }
            };
            children.insert(name.as_bytes().to_vec(), child);
        }
        Ok(MemNode::Dir { meta, children })
    }

    /// Chunk and store files in parallel; returns their nodes by path.
    fn chunk_files(
        &self,
        files: &[(PathBuf, PathBuf)],
        policy: &dyn Fn(&Path) -> ChunkPolicy,
    ) -> Result<HashMap<PathBuf, Node>, Error> {
        let policies: Vec<ChunkPolicy> = files.iter().map(|(_, r)| policy(r)).collect();
        let next = AtomicUsize::new(0);
        let out = Mutex::new(HashMap::with_capacity(files.len()));
        // Fixed-size files (page images) go first, one at a time, each on every core.
        for ((p, _), pol) in files.iter().zip(&policies) {
            if let ChunkPolicy::Fixed(n) = pol {
                out.lock()
                    .insert(p.clone(), self.chunk_fixed(p, *n as usize)?);
            }
        }
        let err: Mutex<Option<Error>> = Mutex::new(None);
        std::thread::scope(|s| {
            for _ in 0..crate::cpus() {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((p, _)) = files.get(i) else { break };
                    if err.lock().is_some() {
                        break;
                    }
                    if matches!(policies[i], ChunkPolicy::Fixed(_)) {
                        continue;
                    }
                    let r = fs::File::open(p).map_err(io_err(p)).and_then(|mut f| {
                        let size = f.metadata().map(|m| m.len()).unwrap_or(0);
                        self.chunk_stream(&mut f, policies[i], size)
                            .map_err(|e| chunk_err(e, p))
                    });
                    match r {
                        Ok(n) => {
                            out.lock().insert(p.clone(), n);
                        }
                        Err(e) => {
                            err.lock().get_or_insert(e);
                            break;
                        }
                    }
                });
            }
        });
        match err.into_inner() {
            Some(e) => Err(e),
            None => Ok(out.into_inner()),
        }
    }

    /// Chunk and store a stream of (about) `size_hint` bytes, returning the file node. A large
    /// file also gets its whole-file object for passthrough reads on the way.
    pub(crate) fn chunk_stream(
        &self,
        r: &mut dyn Read,
        policy: ChunkPolicy,
        size_hint: u64,
    ) -> Result<Node, ChunkError> {
        self.chunk_stream_to(r, policy, size_hint, None)
    }

    /// [`Store::chunk_stream`], the chunks stored by `writer`'s threads where one is given.
    pub(crate) fn chunk_stream_to(
        &self,
        r: &mut dyn Read,
        policy: ChunkPolicy,
        size_hint: u64,
        writer: Option<&ChunkWriter<'_>>,
    ) -> Result<Node, ChunkError> {
        let mut object = ObjectWriter::wanted(size_hint)
            .then(|| ObjectWriter::new(self))
            .and_then(|w| {
                w.map_err(|e| tracing::warn!(error = %e, "no whole-file object at import"))
                    .ok()
            });
        let mut chunks = Vec::new();
        let mut size = 0u64;
        let mut batch: Vec<Vec<u8>> = Vec::new();
        let mut batch_bytes = 0usize;
        let flush = |batch: &mut Vec<Vec<u8>>, chunks: &mut Vec<ChunkRef>| -> Result<(), Error> {
            let ids = self.put_chunks(batch)?;
            chunks.extend(ids.into_iter().zip(batch.iter()).map(|(id, c)| ChunkRef {
                id,
                len: c.len() as u32,
            }));
            batch.clear();
            Ok(())
        };
        let mut each = |c: &[u8]| -> Result<(), Error> {
            size += c.len() as u64;
            if let Some(Err(e)) = object.as_mut().map(|o| o.write(c)) {
                tracing::warn!(error = %e, "no whole-file object at import");
                object = None;
            }
            if let Some(w) = writer {
                let id = w.put(c)?;
                chunks.push(ChunkRef {
                    id,
                    len: c.len() as u32,
                });
                return Ok(());
            }
            batch.push(c.to_vec());
            batch_bytes += c.len();
            if batch_bytes >= BATCH_BYTES {
                batch_bytes = 0;
                flush(&mut batch, &mut chunks)?;
            }
            Ok(())
        };
        if size_hint <= SLURP_BYTES as u64 {
            // Small, as most files are: read whole and cut in memory. One byte past the limit
            // tells a hint that lied; the stream path takes over from what was read.
            let mut head = Vec::with_capacity(size_hint as usize);
            r.take(SLURP_BYTES as u64 + 1)
                .read_to_end(&mut head)
                .map_err(ChunkError::Io)?;
            if head.len() <= SLURP_BYTES {
                chunk_slice(&head, policy, &mut each).map_err(ChunkError::Sink)?;
            } else {
                chunk_reader(&mut std::io::Cursor::new(head).chain(r), policy, &mut each)?;
            }
        } else {
            chunk_reader(r, policy, &mut each)?;
        }
        if !batch.is_empty() {
            flush(&mut batch, &mut chunks).map_err(ChunkError::Sink)?;
        }
        if let Some(Err(e)) = object.map(|o| o.finish(&chunks)) {
            tracing::warn!(error = %e, "no whole-file object at import");
        }
        Ok(Node::File { size, chunks })
    }

    /// Write a MemNode tree as objects. Hard-link groups get ids derived from the path of
    /// their first member in sorted order, so the same tree always hashes the same.
    pub(crate) fn store_mem(&self, root: &MemNode) -> Result<ObjectId, Error> {
        self.store_mem_based(root, None)
    }

    fn store_mem_based(&self, root: &MemNode, base: Option<&ObjectId>) -> Result<ObjectId, Error> {
        let mut first: HashMap<u64, (u64, u32)> = HashMap::new();
        assign_links(root, &mut Vec::new(), &mut first);
        self.store_mem_rec(root, &first, base)
    }

    /// `base`: the same directory in an earlier manifest, if any (see `put_tree_based`).
    fn store_mem_rec(
        &self,
        n: &MemNode,
        links: &HashMap<u64, (u64, u32)>,
        base: Option<&ObjectId>,
    ) -> Result<ObjectId, Error> {
        let MemNode::Dir { meta, children } = n else {
            unreachable!("store_mem_rec is called on directories")
        };
        let base_tree = base.and_then(|b| self.get_tree(b).ok());
        let base_dir = |name: &[u8]| {
            base_tree.as_ref().and_then(|t| {
                t.entries.iter().find_map(|e| match &e.node {
                    Node::Dir(id) if e.name == name => Some(*id),
                    _ => None,
                })
            })
        };
        let mut entries = Vec::with_capacity(children.len());
        for (name, c) in children {
            let e = match c {
                MemNode::Dir { meta, .. } => Entry {
                    name: name.clone(),
                    meta: meta.clone(),
                    link: 0,
                    nlink: 1,
                    node: Node::Dir(self.store_mem_rec(c, links, base_dir(name).as_ref())?),
                },
                MemNode::Leaf { meta, node, group } => {
                    let (link, nlink) = match links.get(group) {
                        Some((id, n)) if *group != 0 && *n > 1 => (*id, *n),
                        _ => (0, 1),
                    };
                    Entry {
                        name: name.clone(),
                        meta: meta.clone(),
                        link,
                        nlink,
                        node: node.clone(),
                    }
                }
            };
            entries.push(e);
        }
        let tree = Tree {
            meta: meta.clone(),
            entries,
        };
        Ok(self.put_tree_based(&tree, base)?)
    }
}

fn assign_links(n: &MemNode, path: &mut Vec<u8>, first: &mut HashMap<u64, (u64, u32)>) {
    if let MemNode::Dir { children, .. } = n {
        for (name, c) in children {
            let len = path.len();
            path.push(b'/');
            path.extend_from_slice(name);
            match c {
                MemNode::Dir { .. } => assign_links(c, path, first),
                MemNode::Leaf { group, .. } if *group != 0 => {
                    let e = first.entry(*group).or_insert_with(|| {
                        let h = blake3::hash(path);
                        let id =
                            u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap_or_default());
                        (id | 1, 0)
                    });
                    e.1 += 1;
                }
                _ => {}
            }
            path.truncate(len);
        }
    }
}

/// Regular files under `dir` (absolute, relative), each inode once.
fn collect_files(
    dir: &Path,
    rel: &Path,
    out: &mut Vec<(PathBuf, PathBuf)>,
    seen: &mut std::collections::HashSet<(u64, u64)>,
) -> Result<(), Error> {
    for e in fs::read_dir(dir).map_err(io_err(dir))? {
        let e = e.map_err(io_err(dir))?;
        let p = e.path();
        let r = rel.join(e.file_name());
        let md = fs::symlink_metadata(&p).map_err(io_err(&p))?;
        if md.is_dir() {
            collect_files(&p, &r, out, seen)?;
        } else if md.is_file() && (md.nlink() == 1 || seen.insert((md.dev(), md.ino()))) {
            out.push((p, r));
        }
    }
    Ok(())
}

fn meta_of(p: &Path, md: &fs::Metadata) -> Result<Meta, Error> {
    let xattrs = sys::lxattrs(p).map_err(io_err(p))?.into_iter().collect();
    Ok(Meta {
        mode: md.mode() & 0o7777,
        uid: md.uid(),
        gid: md.gid(),
        mtime_sec: md.mtime(),
        mtime_nsec: md.mtime_nsec() as u32,
        xattrs,
    })
}

fn chunk_err(e: ChunkError, p: &Path) -> Error {
    match e {
        ChunkError::Io(source) => Error::Io {
            path: p.to_path_buf(),
            source,
        },
        ChunkError::Sink(e) => e,
    }
}

/// Split a tar/OCI path into normal components, refusing `..` and empty names.
pub(crate) fn clean_path(p: &Path) -> Option<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    for c in p.components() {
        match c {
            Component::Normal(s) => out.push(s.as_bytes().to_vec()),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// The directory at `comps` inside `root`, creating missing parents.
pub(crate) fn dir_at<'a>(
    root: &'a mut MemNode,
    comps: &[Vec<u8>],
) -> Option<&'a mut BTreeMap<Vec<u8>, MemNode>> {
    let mut cur = root;
    for c in comps {
        let MemNode::Dir { children, .. } = cur else {
            return None;
        };
        let next = children.entry(c.clone()).or_insert_with(MemNode::empty_dir);
        if !matches!(next, MemNode::Dir { .. }) {
            *next = MemNode::empty_dir();
        }
        cur = next;
    }
    match cur {
        MemNode::Dir { children, .. } => Some(children),
        _ => None,
    }
}

/// Look up a node by path.
pub(crate) fn node_at<'a>(root: &'a MemNode, comps: &[Vec<u8>]) -> Option<&'a MemNode> {
    let mut cur = root;
    for c in comps {
        match cur {
            MemNode::Dir { children, .. } => cur = children.get(c)?,
            _ => return None,
        }
    }
    Some(cur)
}

/// Look up a node by path for changing it, creating nothing.
pub(crate) fn node_at_mut<'a>(root: &'a mut MemNode, comps: &[Vec<u8>]) -> Option<&'a mut MemNode> {
    let mut cur = root;
    for c in comps {
        match cur {
            MemNode::Dir { children, .. } => cur = children.get_mut(c)?,
            _ => return None,
        }
    }
    Some(cur)
}

pub(crate) fn path_display(p: &Path) -> String {
    p.display().to_string()
}

pub(crate) fn new_group(groups: &mut u64) -> u64 {
    *groups += 1;
    *groups
}
