//! The in-memory inode table of one mount: metadata lives here, directories load lazily
//! from tree objects, file data is a [`FileData`] overlay.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use fuser::{FileAttr, FileType, INodeNo};

use super::dir::Children;
use super::file::{FileData, BLOCK};
use super::upper::Uppers;
use crate::id::ObjectId;
use crate::store::Store;
use crate::tree::{Meta, Node, Tree};

pub type Errno = i32;
/// What a FUSE handler, and the state it works on, returns: a value or the errno to reply.
pub type ErrnoResult<T> = Result<T, Errno>;

/// The errno a FUSE reply carries for an I/O error: the OS's own code, or EIO for an error that
/// has none (one made in-process, such as a store read that failed and was logged). The one
/// mapping of the FUSE layer.
pub fn errno(e: std::io::Error) -> Errno {
    e.raw_os_error().unwrap_or(libc::EIO)
}

/// Directory contents, loaded on first use.
#[derive(Debug)]
pub struct DirData {
    pub children: Option<Children>,
    pub tree: Option<ObjectId>,
    pub parent: u64,
}

#[derive(Debug)]
pub enum Content {
    Dir(DirData),
    File(FileData),
    Symlink(Vec<u8>),
    Special { kind: FileType, rdev: u64 },
}

#[derive(Debug)]
pub struct Inode {
    pub meta: Meta,
    pub atime: (i64, u32),
    pub ctime: (i64, u32),
    pub nlink: u32,
    /// Hard-link group id in the manifest (0 = none yet).
    pub link: u64,
    pub content: Content,
    pub open: u32,
    /// Of `open`, the opens with read and write access: only such a descriptor can map the
    /// file shared and writable, so only such a file can have dirty pages in the kernel that
    /// the server has not seen (every other write is write-through). A commit waits for them.
    pub open_rdwr: u32,
    /// Counted against the inode quota.
    pub charged: bool,
    /// Upper blocks currently charged against the byte quota.
    pub charged_blocks: u64,
    /// Metadata bytes (the inode, names, symlink target, xattrs) charged against the byte
    /// quota for this inode; given back when it is freed.
    pub charged_meta: u64,
    /// Changed in this mount (content, metadata or links).
    pub touched: bool,
}

impl Inode {
    pub fn kind(&self) -> FileType {
        match &self.content {
            Content::Dir(_) => FileType::Directory,
            Content::File(_) => FileType::RegularFile,
            Content::Symlink(_) => FileType::Symlink,
            Content::Special { kind, .. } => *kind,
        }
    }
}

pub fn now() -> (i64, u32) {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_secs() as i64, d.subsec_nanos())
}

pub fn to_systime(t: (i64, u32)) -> SystemTime {
    if t.0 >= 0 {
        UNIX_EPOCH + std::time::Duration::new(t.0 as u64, t.1)
    } else {
        UNIX_EPOCH - std::time::Duration::from_secs((-t.0) as u64)
    }
}

pub fn from_systime(t: SystemTime) -> (i64, u32) {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs() as i64, d.subsec_nanos()),
        Err(e) => (-(e.duration().as_secs() as i64), 0),
    }
}

/// Quota limits and usage.
#[derive(Debug, Default, Clone, Copy)]
pub struct Quota {
    pub bytes: Option<u64>,
    pub inodes: Option<u64>,
    pub used_blocks: u64,
    pub used_inodes: u64,
    /// Metadata bytes charged (see [`INODE_COST`]): counted against `bytes` with the blocks.
    pub used_meta: u64,
}

impl Quota {
    /// Bytes counted against the byte quota: upper blocks and metadata.
    pub fn used_bytes(&self) -> u64 {
        self.used_blocks * BLOCK + self.used_meta
    }
}

/// What an inode made in a mount costs against its byte quota, besides its data: the
/// server holds every such inode in memory (about 1 KiB with its name, measured), so a
/// sandbox making millions of empty files must run out of quota, not take the server's
/// memory.
pub const INODE_COST: u64 = 1024;
/// What each name (directory entry) costs on top of its length.
pub const NAME_COST: u64 = 64;
/// What each extended attribute costs on top of its name and value.
pub const XATTR_COST: u64 = 64;

/// What a name costs.
pub fn name_cost(name: &[u8]) -> u64 {
    NAME_COST + name.len() as u64
}

/// The inode table.
pub struct State {
    pub inodes: HashMap<u64, Inode>,
    pub next_ino: u64,
    /// Hard-link group → inode, for groups seen while loading directories.
    pub links: HashMap<u64, u64>,
    pub quota: Quota,
    pub uppers: Arc<Uppers>,
    pub store: Arc<Store>,
    /// Seed for link group ids created in this mount.
    pub nonce: u64,
    /// Owners as the kernel sees them, for a mount of a sandbox in a user namespace.
    pub id_shift: Option<super::IdShift>,
}

impl State {
    pub fn new(
        store: Arc<Store>,
        root_tree: ObjectId,
        root_meta: Meta,
        upper_dir: PathBuf,
        quota: Quota,
    ) -> State {
        let mut inodes = HashMap::new();
        let t = now();
        inodes.insert(
            1,
            Inode {
                meta: root_meta,
                atime: t,
                ctime: t,
                nlink: 2,
                link: 0,
                content: Content::Dir(DirData {
                    children: None,
                    tree: Some(root_tree),
                    parent: 1,
                }),
                open: 0,
                open_rdwr: 0,
                charged: false,
                charged_blocks: 0,
                charged_meta: 0,
                touched: false,
            },
        );
        let nonce = u64::from_le_bytes(
            blake3::hash(format!("{:?}{}", now(), upper_dir.display()).as_bytes()).as_bytes()[..8]
                .try_into()
                .unwrap_or_default(),
        );
        State {
            inodes,
            next_ino: 2,
            links: HashMap::new(),
            quota,
            uppers: Arc::new(Uppers::new(&upper_dir)),
            store,
            nonce,
            id_shift: None,
        }
    }

    /// Files open with read and write access (see `Inode::open_rdwr`).
    pub fn open_rdwr_files(&self) -> Vec<u64> {
        self.inodes
            .iter()
            .filter(|(_, i)| i.open_rdwr > 0)
            .map(|(ino, _)| *ino)
            .collect()
    }

    pub fn get(&self, ino: u64) -> ErrnoResult<&Inode> {
        self.inodes.get(&ino).ok_or(libc::ENOENT)
    }

    pub fn get_mut(&mut self, ino: u64) -> ErrnoResult<&mut Inode> {
        self.inodes.get_mut(&ino).ok_or(libc::ENOENT)
    }

    pub fn attr(&self, ino: u64) -> ErrnoResult<FileAttr> {
        let i = self.get(ino)?;
        let (size, blocks, rdev) = match &i.content {
            Content::Dir(d) => (
                d.children.as_ref().map(|c| c.len() as u64).unwrap_or(0) * 32 + 4096,
                8,
                0,
            ),
            Content::File(f) => (f.size, f.size.div_ceil(512), 0),
            Content::Symlink(t) => (t.len() as u64, 0, 0),
            Content::Special { rdev, .. } => (0, 0, *rdev as u32),
        };
        let mtime = to_systime((i.meta.mtime_sec, i.meta.mtime_nsec));
        Ok(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks,
            atime: to_systime(i.atime),
            mtime,
            ctime: to_systime(i.ctime),
            crtime: mtime,
            kind: i.kind(),
            perm: (i.meta.mode & 0o7777) as u16,
            nlink: i.nlink,
            uid: super::idshift::out(self.id_shift, i.meta.uid),
            gid: super::idshift::out(self.id_shift, i.meta.gid),
            rdev,
            blksize: BLOCK as u32,
            flags: 0,
        })
    }

    fn alloc_ino(&mut self) -> u64 {
        let n = self.next_ino;
        self.next_ino += 1;
        n
    }

    pub fn new_file(&self, size: u64, chunks: Vec<crate::tree::ChunkRef>, ino: u64) -> FileData {
        FileData::new(size, chunks, self.uppers.clone(), ino)
    }

    /// Load a directory's entries from its (shared, decoded) tree object on first use. No
    /// entry becomes an inode here: [`State::entry`] makes one when its name is looked up,
    /// [`State::load_all`] all of them.
    pub fn load_dir(&mut self, ino: u64) -> ErrnoResult<()> {
        let tree = match &self.get(ino)?.content {
            Content::Dir(d) if d.children.is_some() => return Ok(()),
            Content::Dir(d) => d.tree,
            _ => return Err(libc::ENOTDIR),
        };
        let (children, subdirs) = match tree {
            Some(tid) => {
                let t = self.store.get_tree_shared(&tid).map_err(|e| {
                    tracing::error!(error = %e, "loading directory failed");
                    libc::EIO
                })?;
                let subdirs = t
                    .entries
                    .iter()
                    .filter(|e| matches!(e.node, Node::Dir(_)))
                    .count() as u32;
                (Children::from_tree(t), subdirs)
            }
            None => (Children::default(), 0),
        };
        let i = self.get_mut(ino)?;
        i.nlink = 2 + subdirs;
        if let Content::Dir(d) = &mut i.content {
            d.children = Some(children);
        }
        Ok(())
    }

    /// Load directory `ino` with every entry an inode: for listings and commits.
    pub fn load_all(&mut self, ino: u64) -> ErrnoResult<()> {
        self.load_dir(ino)?;
        let pending = self.children(ino)?.pending_indexes();
        if let Some(tree) = self.children(ino)?.base_tree().cloned() {
            for i in pending {
                self.materialize(ino, &tree, i)?;
            }
        }
        Ok(())
    }

    /// The inode `name` in directory `parent` names, made from the tree entry if it is not
    /// one yet.
    pub fn entry(&mut self, parent: u64, name: &[u8]) -> ErrnoResult<Option<u64>> {
        let kids = self.children(parent)?;
        if let Some(ino) = kids.get(name) {
            return Ok(Some(ino));
        }
        let Some((i, _)) = kids.pending(name) else {
            return Ok(None);
        };
        let tree = kids.base_tree().cloned().ok_or(libc::EIO)?;
        self.materialize(parent, &tree, i).map(Some)
    }

    /// Makes entry `i` of directory `dir`'s tree an inode (or the inode of its hard-link
    /// group, where another name made that already).
    fn materialize(&mut self, dir: u64, tree: &Tree, i: usize) -> ErrnoResult<u64> {
        let e = &tree.entries[i];
        if e.link != 0 {
            if let Some(&existing) = self.links.get(&e.link) {
                self.children(dir)?.take(i, existing);
                return Ok(existing);
            }
        }
        let cino = self.alloc_ino();
        let content = match &e.node {
            Node::Dir(c) => Content::Dir(DirData {
                children: None,
                tree: Some(*c),
                parent: dir,
            }),
            Node::File { size, chunks } => {
                let mut f = self.new_file(*size, chunks.clone(), cino);
                f.lib_name = super::passthrough::is_lib_name(&e.name);
                Content::File(f)
            }
            Node::Symlink(t) => Content::Symlink(t.clone()),
            Node::Fifo => Content::Special {
                kind: FileType::NamedPipe,
                rdev: 0,
            },
            Node::Socket => Content::Special {
                kind: FileType::Socket,
                rdev: 0,
            },
            Node::CharDev(r) => Content::Special {
                kind: FileType::CharDevice,
                rdev: *r,
            },
            Node::BlockDev(r) => Content::Special {
                kind: FileType::BlockDevice,
                rdev: *r,
            },
        };
        let is_dir = matches!(content, Content::Dir(_));
        let mtime = (e.meta.mtime_sec, e.meta.mtime_nsec);
        self.inodes.insert(
            cino,
            Inode {
                meta: e.meta.clone(),
                atime: mtime,
                ctime: mtime,
                nlink: if is_dir { 2 } else { e.nlink.max(1) },
                link: e.link,
                content,
                open: 0,
                open_rdwr: 0,
                charged: false,
                charged_blocks: 0,
                charged_meta: 0,
                touched: false,
            },
        );
        if e.link != 0 {
            self.links.insert(e.link, cino);
        }
        self.children(dir)?.take(i, cino);
        Ok(cino)
    }

    pub fn children(&mut self, ino: u64) -> ErrnoResult<&mut Children> {
        self.load_dir(ino)?;
        match &mut self.get_mut(ino)?.content {
            Content::Dir(d) => Ok(d.children.as_mut().expect("loaded")),
            _ => Err(libc::ENOTDIR),
        }
    }

    pub fn lookup(&mut self, parent: u64, name: &[u8]) -> ErrnoResult<u64> {
        if name.len() > 255 {
            return Err(libc::ENAMETOOLONG);
        }
        self.entry(parent, name)?.ok_or(libc::ENOENT)
    }

    fn touch_dir(&mut self, ino: u64) {
        let t = now();
        if let Some(i) = self.inodes.get_mut(&ino) {
            i.meta.mtime_sec = t.0;
            i.meta.mtime_nsec = t.1;
            i.ctime = t;
        }
    }

    /// Create a new inode named `name` in `parent`.
    pub fn create(
        &mut self,
        parent: u64,
        name: &[u8],
        mode: u32,
        uid: u32,
        gid: u32,
        content: Content,
    ) -> ErrnoResult<u64> {
        if name.len() > 255 {
            return Err(libc::ENAMETOOLONG);
        }
        if self.children(parent)?.contains_key(name) {
            return Err(libc::EEXIST);
        }
        if let Some(max) = self.quota.inodes {
            if self.quota.used_inodes >= max {
                return Err(libc::ENOSPC);
            }
        }
        let meta_cost = INODE_COST
            + name_cost(name)
            + match &content {
                Content::Symlink(t) => t.len() as u64,
                _ => 0,
            };
        self.check_meta(meta_cost)?;
        let pmeta = self.get(parent)?.meta.clone();
        let is_dir = matches!(content, Content::Dir(_));
        let mut mode = mode & 0o7777;
        let mut gid = gid;
        if pmeta.mode & libc::S_ISGID != 0 {
            gid = pmeta.gid;
            if is_dir {
                mode |= libc::S_ISGID;
            }
        }
        let ino = self.alloc_ino();
        let content = match content {
            Content::File(_) => Content::File(self.new_file(0, Vec::new(), ino)),
            c => c,
        };
        let t = now();
        self.inodes.insert(
            ino,
            Inode {
                meta: Meta {
                    mode,
                    uid,
                    gid,
                    mtime_sec: t.0,
                    mtime_nsec: t.1,
                    xattrs: Default::default(),
                },
                atime: t,
                ctime: t,
                nlink: if is_dir { 2 } else { 1 },
                link: 0,
                content,
                open: 0,
                open_rdwr: 0,
                charged: true,
                charged_blocks: 0,
                charged_meta: meta_cost,
                touched: true,
            },
        );
        self.quota.used_inodes += 1;
        self.quota.used_meta += meta_cost;
        self.children(parent)?.insert(name, ino);
        if is_dir {
            self.get_mut(parent)?.nlink += 1;
        }
        self.touch_dir(parent);
        Ok(ino)
    }

    /// Drop the link `name` to `ino`; frees it when nothing references it any more.
    fn drop_link(&mut self, ino: u64, name: &[u8]) {
        let mut refund = 0;
        let free = match self.inodes.get_mut(&ino) {
            Some(i) => {
                // A name made by `link` is given back when one goes; the inode's own
                // charge (and its first name's) when it is freed.
                let floor = if i.charged { INODE_COST + NAME_COST } else { 0 };
                refund = name_cost(name).min(i.charged_meta.saturating_sub(floor));
                i.charged_meta -= refund;
                i.nlink = i.nlink.saturating_sub(1);
                if matches!(i.content, Content::Dir(_)) {
                    i.nlink = 0;
                }
                i.ctime = now();
                i.touched = true;
                i.nlink == 0 && i.open == 0
            }
            None => false,
        };
        self.quota.used_meta = self.quota.used_meta.saturating_sub(refund);
        if free {
            self.free(ino);
        }
    }

    /// Forget an inode that has no links and no open handles.
    pub fn free(&mut self, ino: u64) {
        if let Some(i) = self.inodes.remove(&ino) {
            if i.charged {
                self.quota.used_inodes = self.quota.used_inodes.saturating_sub(1);
            }
            self.quota.used_blocks = self.quota.used_blocks.saturating_sub(i.charged_blocks);
            self.quota.used_meta = self.quota.used_meta.saturating_sub(i.charged_meta);
            if i.link != 0 && self.links.get(&i.link) == Some(&ino) {
                self.links.remove(&i.link);
            }
            if let Content::File(mut f) = i.content {
                f.free_upper();
            }
        }
    }

    pub fn unlink(&mut self, parent: u64, name: &[u8]) -> ErrnoResult<()> {
        let ino = self.lookup(parent, name)?;
        if matches!(self.get(ino)?.content, Content::Dir(_)) {
            return Err(libc::EISDIR);
        }
        self.children(parent)?.remove(name);
        self.touch_dir(parent);
        self.drop_link(ino, name);
        Ok(())
    }

    pub fn rmdir(&mut self, parent: u64, name: &[u8]) -> ErrnoResult<()> {
        let ino = self.lookup(parent, name)?;
        if !matches!(self.get(ino)?.content, Content::Dir(_)) {
            return Err(libc::ENOTDIR);
        }
        if !self.children(ino)?.is_empty() {
            return Err(libc::ENOTEMPTY);
        }
        self.children(parent)?.remove(name);
        let p = self.get_mut(parent)?;
        p.nlink = p.nlink.saturating_sub(1);
        self.touch_dir(parent);
        self.drop_link(ino, name);
        Ok(())
    }

    fn is_ancestor(&self, anc: u64, mut ino: u64) -> bool {
        loop {
            if ino == anc {
                return true;
            }
            match self.inodes.get(&ino).map(|i| &i.content) {
                Some(Content::Dir(d)) if d.parent != ino => ino = d.parent,
                _ => return false,
            }
        }
    }

    pub fn rename(
        &mut self,
        parent: u64,
        name: &[u8],
        np: u64,
        nn: &[u8],
        flags: u32,
    ) -> ErrnoResult<()> {
        const NOREPLACE: u32 = 1;
        const EXCHANGE: u32 = 2;
        if flags & !(NOREPLACE | EXCHANGE) != 0 || flags == NOREPLACE | EXCHANGE {
            return Err(libc::EINVAL);
        }
        if nn.len() > 255 {
            return Err(libc::ENAMETOOLONG);
        }
        let src = self.lookup(parent, name)?;
        let src_dir = matches!(self.get(src)?.content, Content::Dir(_));
        self.load_dir(np)?;
        if src_dir && self.is_ancestor(src, np) {
            return Err(libc::EINVAL);
        }
        let dst = self.entry(np, nn)?;
        if flags & EXCHANGE != 0 {
            let dst = dst.ok_or(libc::ENOENT)?;
            let dst_dir = matches!(self.get(dst)?.content, Content::Dir(_));
            if dst_dir && self.is_ancestor(dst, parent) {
                return Err(libc::EINVAL);
            }
            self.children(parent)?.insert(name, dst);
            self.children(np)?.insert(nn, src);
            self.reparent(src, parent, np, src_dir);
            self.reparent(dst, np, parent, dst_dir);
            self.touch_dir(parent);
            self.touch_dir(np);
            return Ok(());
        }
        if let Some(dst) = dst {
            if dst == src {
                return Ok(());
            }
            if flags & NOREPLACE != 0 {
                return Err(libc::EEXIST);
            }
            let dst_dir = matches!(self.get(dst)?.content, Content::Dir(_));
            match (src_dir, dst_dir) {
                (true, false) => return Err(libc::ENOTDIR),
                (false, true) => return Err(libc::EISDIR),
                (true, true) => {
                    if !self.children(dst)?.is_empty() {
                        return Err(libc::ENOTEMPTY);
                    }
                    let p = self.get_mut(np)?;
                    p.nlink = p.nlink.saturating_sub(1);
                }
                _ => {}
            }
            self.children(np)?.remove(nn);
            self.drop_link(dst, nn);
        }
        self.children(parent)?.remove(name);
        self.children(np)?.insert(nn, src);
        self.reparent(src, parent, np, src_dir);
        if let Ok(i) = self.get_mut(src) {
            i.ctime = now();
        }
        self.touch_dir(parent);
        self.touch_dir(np);
        Ok(())
    }

    fn reparent(&mut self, ino: u64, from: u64, to: u64, is_dir: bool) {
        if !is_dir || from == to {
            return;
        }
        if let Some(Inode {
            content: Content::Dir(d),
            ..
        }) = self.inodes.get_mut(&ino)
        {
            d.parent = to;
        }
        if let Some(i) = self.inodes.get_mut(&from) {
            i.nlink = i.nlink.saturating_sub(1);
        }
        if let Some(i) = self.inodes.get_mut(&to) {
            i.nlink += 1;
        }
    }

    pub fn link(&mut self, ino: u64, np: u64, nn: &[u8]) -> ErrnoResult<()> {
        if matches!(self.get(ino)?.content, Content::Dir(_)) {
            return Err(libc::EPERM);
        }
        if self.children(np)?.contains_key(nn) {
            return Err(libc::EEXIST);
        }
        let cost = name_cost(nn);
        self.check_meta(cost)?;
        self.quota.used_meta += cost;
        let nonce = self.nonce;
        let i = self.get_mut(ino)?;
        i.charged_meta += cost;
        if i.link == 0 {
            let h = blake3::hash(format!("{nonce}/{ino}").as_bytes());
            i.link = u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap_or_default()) | 1;
        }
        i.nlink += 1;
        i.ctime = now();
        i.touched = true;
        let link = i.link;
        self.links.insert(link, ino);
        self.children(np)?.insert(nn, ino);
        self.touch_dir(np);
        Ok(())
    }

    /// Re-charge a file's upper blocks after a change; errors with ENOSPC if the change
    /// would exceed the quota (callers check before writing with [`State::check_space`]).
    pub fn recharge(&mut self, ino: u64) {
        let Some(i) = self.inodes.get_mut(&ino) else {
            return;
        };
        let Content::File(f) = &i.content else { return };
        let blocks = f.upper_blocks();
        let old = i.charged_blocks;
        i.charged_blocks = blocks;
        self.quota.used_blocks = self.quota.used_blocks.saturating_sub(old) + blocks;
    }

    /// ENOSPC if `extra` more blocks would exceed the byte quota.
    pub fn check_space(&self, extra: u64) -> ErrnoResult<()> {
        self.check_meta(extra * BLOCK)
    }

    /// ENOSPC if `extra` more bytes (of metadata, or of blocks) would exceed the byte quota.
    pub fn check_meta(&self, extra: u64) -> ErrnoResult<()> {
        if let Some(q) = self.quota.bytes {
            if self.quota.used_bytes().saturating_add(extra) > q {
                return Err(libc::ENOSPC);
            }
        }
        Ok(())
    }

    /// Charge (or with a negative `delta`, give back) metadata bytes of inode `ino`, e.g. an
    /// xattr set or removed. ENOSPC, charging nothing, if growth would exceed the quota.
    pub fn charge_meta(&mut self, ino: u64, delta: i64) -> ErrnoResult<()> {
        if delta > 0 {
            self.check_meta(delta as u64)?;
        }
        let i = self.get_mut(ino)?;
        let d = if delta >= 0 {
            i.charged_meta += delta as u64;
            delta
        } else {
            let back = delta.unsigned_abs().min(i.charged_meta);
            i.charged_meta -= back;
            -(back as i64)
        };
        self.quota.used_meta = self.quota.used_meta.saturating_add_signed(d);
        Ok(())
    }

    pub fn file_mut(&mut self, ino: u64) -> ErrnoResult<&mut FileData> {
        match &mut self.get_mut(ino)?.content {
            Content::File(f) => Ok(f),
            Content::Dir(_) => Err(libc::EISDIR),
            _ => Err(libc::EINVAL),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::errno;
    use std::io;

    #[test]
    fn errno_is_the_os_code_or_eio() {
        for code in [libc::ENOSPC, libc::EDQUOT, libc::ENOENT, libc::EFBIG] {
            assert_eq!(errno(io::Error::from_raw_os_error(code)), code);
        }
        // No OS code, whatever its kind says: EIO.
        assert_eq!(errno(io::Error::other("store read failed")), libc::EIO);
        assert_eq!(
            errno(io::Error::new(io::ErrorKind::NotFound, "gone")),
            libc::EIO
        );
    }
}
