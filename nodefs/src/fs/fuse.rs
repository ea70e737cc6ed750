//! The FUSE request handlers of one mount, translating to [`State`] operations.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{
    BackingId, Errno, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use parking_lot::Mutex;

use super::file::BLOCK;
use super::idshift;
use super::killpriv;
use super::openmode::{Decision, OpenModes};
use super::passthrough;
use super::state::{errno, from_systime, now, Content, DirData, ErrnoResult, State};
use crate::store::Store;

/// The largest WRITE (and READ) the kernel sends: also the size of a ring entry's payload buffer.
pub(super) const MAX_WRITE: u32 = 1 << 20;

/// The server is the only writer, so the kernel may cache entries and attributes long.
const TTL: Duration = Duration::from_secs(3600);

/// State shared by the FUSE handlers and the [`super::Mount`] handle.
pub struct Shared {
    pub state: Mutex<State>,
    pub store: Arc<Store>,
    pub read_only: bool,
    /// Whether this mount asked for passthrough (its option and the environment).
    want_passthrough: bool,
    /// Whether opens pass through: asked for and granted by the kernel at INIT.
    pub passthrough: std::sync::atomic::AtomicBool,
    /// Whether this mount asked for FUSE over io_uring.
    want_uring: bool,
    /// Whether INIT was answered with `FUSE_OVER_IO_URING` (the kernel offered it): the ring
    /// queues must then register.
    pub uring: std::sync::atomic::AtomicBool,
    next_fh: AtomicU64,
    /// Open files per inode by I/O mode, with the backing file passthrough opens share.
    modes: OpenModes<BackingId>,
    /// Threads of this server waiting, through an fsync, for the kernel to hand over a
    /// mount's mapped writes before a commit (`Mount::commit`): their FSYNC only orders, it
    /// need not reach the disk.
    pub commit_flushers: Mutex<Vec<u32>>,
}

/// How long a writer waits for passthrough readers' RELEASE before ETXTBSY.
const RELEASE_WAIT: Duration = Duration::from_millis(200);

impl Shared {
    pub fn new(
        state: State,
        store: Arc<Store>,
        read_only: bool,
        want_passthrough: bool,
        want_uring: bool,
    ) -> Shared {
        Shared {
            state: Mutex::new(state),
            store,
            read_only,
            want_passthrough,
            passthrough: std::sync::atomic::AtomicBool::new(false),
            want_uring,
            uring: std::sync::atomic::AtomicBool::new(false),
            next_fh: AtomicU64::new(1),
            modes: OpenModes::default(),
            commit_flushers: Mutex::new(Vec::new()),
        }
    }
}

/// The attribute changes of one setattr request.
struct SetAttr {
    mode: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
    size: Option<u64>,
    atime: Option<TimeOrNow>,
    mtime: Option<TimeOrNow>,
    /// The caller, for deciding whether a truncate drops setuid/setgid.
    pid: u32,
}

impl SetAttr {
    /// A truncation to `size` by process `pid`, nothing else.
    fn truncate(size: u64, pid: u32) -> SetAttr {
        SetAttr {
            mode: None,
            uid: None,
            gid: None,
            size: Some(size),
            atime: None,
            mtime: None,
            pid,
        }
    }
}

/// A lookup reply with node id 0: "no such name", cached by the kernel for the TTL.
fn negative_entry() -> fuser::FileAttr {
    fuser::FileAttr {
        ino: INodeNo(0),
        size: 0,
        blocks: 0,
        atime: SystemTime::UNIX_EPOCH,
        mtime: SystemTime::UNIX_EPOCH,
        ctime: SystemTime::UNIX_EPOCH,
        crtime: SystemTime::UNIX_EPOCH,
        kind: FileType::RegularFile,
        perm: 0,
        nlink: 0,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 0,
        flags: 0,
    }
}

/// What an xattr costs against the quota.
fn xattr_cost(name: &[u8], value: &[u8]) -> u64 {
    super::state::XATTR_COST + (name.len() + value.len()) as u64
}

/// The [`fuser::Filesystem`] of one mount.
pub struct Fs(pub Arc<Shared>);

fn e(errno: i32) -> Errno {
    Errno::from_i32(errno)
}

/// Directory `ino`'s entries after cookie `offset`: ".", "..", then the children (the
/// tree's in name order, then those made in this mount in the order they were added), each
/// with its cookie (what the kernel hands back to continue).
/// Nothing is copied: the caller stops taking entries when the kernel's buffer is full.
/// Every entry of the directory must be an inode ([`State::load_all`]).
fn listing(
    st: &State,
    ino: u64,
    offset: u64,
) -> ErrnoResult<impl Iterator<Item = (u64, u64, &[u8])>> {
    let Content::Dir(d) = &st.get(ino)?.content else {
        return Err(libc::ENOTDIR);
    };
    let kids = d.children.as_ref().ok_or(libc::EIO)?;
    let dots = [(ino, 1, &b"."[..]), (d.parent, 2, &b".."[..])];
    let dots = dots.into_iter().skip(offset.min(2) as usize);
    Ok(dots.chain(kids.after(offset).map(|(c, n, i)| (i, c, n))))
}

impl Fs {
    fn s(&self) -> &Shared {
        &self.0
    }

    fn rw(&self) -> ErrnoResult<()> {
        if self.s().read_only {
            Err(libc::EROFS)
        } else {
            Ok(())
        }
    }

    fn new_node(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        content: Content,
    ) -> ErrnoResult<fuser::FileAttr> {
        self.rw()?;
        let mut st = self.s().state.lock();
        let shift = st.id_shift;
        let ino = st.create(
            parent.0,
            name.as_bytes(),
            mode,
            idshift::into_store(shift, req.uid()),
            idshift::into_store(shift, req.gid()),
            content,
        )?;
        st.attr(ino)
    }

    /// A new file handle; its low bit says whether it passes through, the next whether its
    /// writes come straight from write(2) (`FOPEN_DIRECT_IO`, see `create`).
    fn new_fh(&self, passthrough: bool, direct: bool) -> FileHandle {
        let n = self.s().next_fh.fetch_add(1, Ordering::Relaxed);
        FileHandle(n << 2 | (direct as u64) << 1 | passthrough as u64)
    }

    /// Uncount one open of `ino` in the inode table; forget the inode if that was its
    /// last open and last link.
    fn close_inode(&self, ino: u64, rdwr: bool) {
        let mut st = self.s().state.lock();
        let free = match st.get_mut(ino) {
            Ok(i) => {
                i.open = i.open.saturating_sub(1);
                if rdwr {
                    i.open_rdwr = i.open_rdwr.saturating_sub(1);
                }
                if i.open == 0 {
                    if let Content::File(f) = &mut i.content {
                        f.upper.close();
                    }
                }
                i.open == 0 && i.nlink == 0
            }
            Err(_) => false,
        };
        if free {
            st.free(ino);
        }
    }

    /// Count an open of `ino` in the inode table. For a file: return the base content if it
    /// is pristine and the policy wants it passed through (upper storage comes with the
    /// first write).
    fn open_inode(
        &self,
        ino: u64,
        write: bool,
        rdwr: bool,
    ) -> ErrnoResult<Option<Arc<super::file::Base>>> {
        let mut st = self.s().state.lock();
        let i = st.get_mut(ino)?;
        let mode = i.meta.mode;
        let base = match &i.content {
            Content::File(f) => {
                if !write
                    && f.is_pristine()
                    && f.version == 0
                    && passthrough::wanted(mode, f.size, f.lib_name)
                {
                    Some(f.base.clone())
                } else {
                    None
                }
            }
            Content::Dir(_) => return Err(libc::EISDIR),
            _ => None,
        };
        i.open += 1;
        i.open_rdwr += u32::from(rdwr);
        Ok(base)
    }

    fn do_setattr(&self, ino: u64, a: SetAttr) -> ErrnoResult<fuser::FileAttr> {
        let SetAttr {
            mode,
            uid,
            gid,
            size,
            atime,
            mtime,
            pid,
        } = a;
        if mode.is_some() || uid.is_some() || gid.is_some() || size.is_some() || mtime.is_some() {
            self.rw()?;
        }
        let store = self.s().store.clone();
        let mut st = self.s().state.lock();
        if let Some(size) = size {
            let extra = {
                let f = st.file_mut(ino)?;
                // Shrinking inside a base block copies up at most one block.
                if size < f.size && !size.is_multiple_of(BLOCK) && !f.is_present(size / BLOCK) {
                    1
                } else {
                    0
                }
            };
            st.check_space(extra)?;
            st.file_mut(ino)?.truncate(&store, size).map_err(errno)?;
            st.recharge(ino);
            let t = now();
            let i = st.get_mut(ino)?;
            i.meta.mtime_sec = t.0;
            i.meta.mtime_nsec = t.1;
            killpriv::drop_caps(&mut i.meta);
            if killpriv::has_suidgid(i.meta.mode) && !killpriv::has_fsetid(pid) {
                killpriv::drop_suidgid(&mut i.meta);
            }
        }
        let i = st.get_mut(ino)?;
        let chown = uid.is_some() || gid.is_some();
        if chown && mode.is_none() && !matches!(i.content, Content::Dir(_)) {
            killpriv::drop_caps(&mut i.meta);
            killpriv::drop_suidgid(&mut i.meta);
        }
        let t = now();
        if let Some(m) = mode {
            i.meta.mode = m & 0o7777;
        }
        let shift = st.id_shift;
        let i = st.get_mut(ino)?;
        if let Some(u) = uid {
            i.meta.uid = idshift::into_store(shift, u);
        }
        if let Some(g) = gid {
            i.meta.gid = idshift::into_store(shift, g);
        }
        let conv = |x: TimeOrNow| match x {
            TimeOrNow::Now => t,
            TimeOrNow::SpecificTime(s) => from_systime(s),
        };
        if let Some(a) = atime {
            i.atime = conv(a);
        }
        if let Some(m) = mtime {
            let m = conv(m);
            i.meta.mtime_sec = m.0;
            i.meta.mtime_nsec = m.1;
        }
        i.ctime = t;
        i.touched = true;
        st.attr(ino)
    }
}

macro_rules! tryr {
    ($reply:ident, $e:expr) => {
        match $e {
            Ok(v) => v,
            Err(errno) => {
                $reply.error(e(errno));
                return;
            }
        }
    };
}

impl Filesystem for Fs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_write(MAX_WRITE);
        let _ = config.set_max_readahead(1 << 20);
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        // Listing a directory also fills the kernel's dentry and attribute caches.
        let _ = config.add_capabilities(InitFlags::FUSE_DO_READDIRPLUS);
        // The server drops setuid/setgid/capabilities itself (see killpriv.rs): saves a
        // GETXATTR per write and a GETATTR per chown.
        let _ = config.add_capabilities(InitFlags::FUSE_HANDLE_KILLPRIV_V2);
        // A symlink's target never changes (replacing it makes a new inode): the kernel may
        // keep it instead of asking on every path walk through it (/lib, /bin, python3).
        let _ = config.add_capabilities(InitFlags::FUSE_CACHE_SYMLINKS);
        // open(O_TRUNC) of an existing file: the OPEN carries O_TRUNC and the server truncates,
        // one request instead of a SETATTR and an OPEN (see `open`).
        let _ = config.add_capabilities(InitFlags::FUSE_ATOMIC_O_TRUNC);
        if self.0.want_passthrough
            && config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
            && config.set_max_stack_depth(2).is_ok()
        {
            self.0.passthrough.store(true, Ordering::Relaxed);
        }
        // Offered only where the kernel has CONFIG_FUSE_IO_URING and `enable_uring` is on.
        if self.0.want_uring
            && config
                .add_capabilities(InitFlags::FUSE_OVER_IO_URING)
                .is_ok()
        {
            self.0.uring.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let mut st = self.s().state.lock();
        let ino = match st.lookup(parent.0, name.as_bytes()) {
            // A negative entry the kernel may cache: names only appear through this mount.
            Err(libc::ENOENT) => {
                reply.entry(&TTL, &negative_entry(), Generation(0));
                return;
            }
            r => tryr!(reply, r),
        };
        let attr = tryr!(reply, st.attr(ino));
        reply.entry(&TTL, &attr, Generation(0));
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let st = self.s().state.lock();
        let attr = tryr!(reply, st.attr(ino.0));
        reply.attr(&TTL, &attr);
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let a = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime,
            mtime,
            pid: req.pid(),
        };
        let r = if a.size.is_some() {
            // Passthrough readers read the pristine backing file: no truncation under them.
            self.s().modes.with(ino.0, |g| {
                g.wait_passthrough_closed(RELEASE_WAIT);
                if g.passthrough > 0 {
                    Err(libc::ETXTBSY)
                } else {
                    self.do_setattr(ino.0, a)
                }
            })
        } else {
            self.do_setattr(ino.0, a)
        };
        let attr = tryr!(reply, r);
        reply.attr(&TTL, &attr);
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let st = self.s().state.lock();
        match &tryr!(reply, st.get(ino.0)).content {
            Content::Symlink(t) => reply.data(t),
            _ => reply.error(Errno::EINVAL),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let kind = match mode & libc::S_IFMT {
            libc::S_IFREG | 0 => None,
            libc::S_IFIFO => Some(FileType::NamedPipe),
            libc::S_IFSOCK => Some(FileType::Socket),
            libc::S_IFCHR => Some(FileType::CharDevice),
            libc::S_IFBLK => Some(FileType::BlockDevice),
            _ => {
                reply.error(Errno::EINVAL);
                return;
            }
        };
        let content = match kind {
            None => Content::File(super::file::FileData::placeholder()),
            Some(kind) => Content::Special {
                kind,
                rdev: rdev as u64,
            },
        };
        let attr = tryr!(reply, self.new_node(req, parent, name, mode, content));
        reply.entry(&TTL, &attr, Generation(0));
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let content = Content::Dir(DirData {
            children: Some(Default::default()),
            tree: None,
            parent: parent.0,
        });
        let attr = tryr!(reply, self.new_node(req, parent, name, mode, content));
        reply.entry(&TTL, &attr, Generation(0));
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        tryr!(reply, self.rw());
        tryr!(
            reply,
            self.s().state.lock().unlink(parent.0, name.as_bytes())
        );
        reply.ok();
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        tryr!(reply, self.rw());
        tryr!(
            reply,
            self.s().state.lock().rmdir(parent.0, name.as_bytes())
        );
        reply.ok();
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let content = Content::Symlink(target.as_os_str().as_bytes().to_vec());
        let attr = tryr!(reply, self.new_node(req, parent, link_name, 0o777, content));
        reply.entry(&TTL, &attr, Generation(0));
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        tryr!(reply, self.rw());
        let r = self.s().state.lock().rename(
            parent.0,
            name.as_bytes(),
            newparent.0,
            newname.as_bytes(),
            flags.bits(),
        );
        tryr!(reply, r);
        reply.ok();
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        tryr!(reply, self.rw());
        let mut st = self.s().state.lock();
        tryr!(reply, st.link(ino.0, newparent.0, newname.as_bytes()));
        let attr = tryr!(reply, st.attr(ino.0));
        reply.entry(&TTL, &attr, Generation(0));
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        // O_TRUNC arrives here (FUSE_ATOMIC_O_TRUNC) instead of as a SETATTR before the
        // OPEN; it truncates whatever the access mode, as open(2) does.
        let trunc = flags.0 & libc::O_TRUNC != 0;
        let write = trunc || !matches!(flags.acc_mode(), OpenAccMode::O_RDONLY);
        if write {
            tryr!(reply, self.rw());
        }
        let pt_on = self.s().passthrough.load(Ordering::Relaxed);
        // Decide, count and reply under the inode's mode lock (see openmode.rs).
        self.s().modes.with(ino.0, |g| {
            if write {
                g.wait_passthrough_closed(RELEASE_WAIT);
            }
            if g.decide(write, false) == Decision::Busy {
                reply.error(Errno::ETXTBSY);
                return;
            }
            if trunc {
                // What the SETATTR of an open(O_TRUNC) did: size 0, new mtime and ctime, file
                // capabilities gone, setuid/setgid gone unless the opener has CAP_FSETID.
                tryr!(
                    reply,
                    self.do_setattr(ino.0, SetAttr::truncate(0, req.pid()))
                );
            }
            let rdwr = matches!(flags.acc_mode(), OpenAccMode::O_RDWR);
            let base = tryr!(reply, self.open_inode(ino.0, write, rdwr));
            if g.decide(write, pt_on && base.is_some()) == Decision::Passthrough {
                if g.backing.is_none() {
                    let store = &self.s().store;
                    let opened = base
                        .map(|b| passthrough::open_object(store, &b))
                        .transpose()
                        .map(Option::flatten)
                        .and_then(|f| f.map(|f| reply.open_backing(&f)).transpose());
                    match opened {
                        Ok(b) => g.backing = b,
                        Err(err) => {
                            tracing::debug!(error = %err, "passthrough unavailable; serving reads")
                        }
                    }
                }
                let m = &mut **g;
                if let Some(b) = &m.backing {
                    m.passthrough += 1;
                    reply.opened_passthrough(self.new_fh(true, false), FopenFlags::empty(), b);
                    return;
                }
                // No backing file yet (a large one is being materialized): serve this open,
                // and later ones too while it stays open.
                debug_assert_eq!(g.passthrough, 0);
            }
            g.cached += 1;
            reply.opened(self.new_fh(false, false), FopenFlags::FOPEN_KEEP_CACHE);
        });
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let store = self.s().store.clone();
        let mut st = self.s().state.lock();
        let f = tryr!(reply, st.file_mut(ino.0));
        if offset >= f.size {
            reply.data(&[]);
            return;
        }
        let n = (f.size - offset).min(size as u64) as usize;
        let mut buf = vec![0u8; n];
        let end = offset + n as u64;
        let base_only = n > 0
            && end <= f.base_len
            && (offset / BLOCK..=(end - 1) / BLOCK).all(|b| !f.is_present(b));
        if base_only {
            // Decompressing base chunks needs no inode state: let other requests run.
            let base = f.base.clone();
            drop(st);
            tryr!(reply, base.read(&store, offset, &mut buf).map_err(errno));
        } else {
            tryr!(reply, f.read_into(&store, offset, &mut buf).map_err(errno));
            drop(st);
        }
        reply.data(&buf);
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        tryr!(reply, self.rw());
        let store = self.s().store.clone();
        let mut st = self.s().state.lock();
        let extra = tryr!(reply, st.file_mut(ino.0)).new_blocks_for(offset, data.len() as u64);
        tryr!(reply, st.check_space(extra));
        let f = tryr!(reply, st.file_mut(ino.0));
        tryr!(reply, f.write(&store, offset, data).map_err(errno));
        st.recharge(ino.0);
        let t = now();
        if let Ok(i) = st.get_mut(ino.0) {
            i.meta.mtime_sec = t.0;
            i.meta.mtime_nsec = t.1;
            i.ctime = t;
            i.touched = true;
            killpriv::drop_caps(&mut i.meta);
            // The kernel flags a page-cache write whose writer lacks CAP_FSETID; a direct write
            // (a created file's, see `create`) may come unflagged, so /proc says, asked only for
            // a file that has those bits.
            let direct = fh.0 & 2 != 0;
            if write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID)
                || (direct
                    && killpriv::has_suidgid(i.meta.mode)
                    && !killpriv::has_fsetid(req.pid()))
            {
                killpriv::drop_suidgid(&mut i.meta);
            }
        }
        reply.written(data.len() as u32);
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lo: LockOwner,
        reply: ReplyEmpty,
    ) {
        // Nothing to flush (writes are synchronous, locks are the kernel's): ENOSYS makes
        // the kernel stop sending FLUSH, one request less per close.
        reply.error(Errno::ENOSYS);
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let passthrough = fh.0 & 1 == 1;
        self.s().modes.with(ino.0, |g| g.release(passthrough));
        // The access mode is the open's (fcntl cannot change it).
        self.close_inode(ino.0, matches!(flags.acc_mode(), OpenAccMode::O_RDWR));
        reply.ok();
    }

    fn fsync(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        // A commit's own fsync: the kernel has handed over the file's writes by now (it sends
        // FSYNC after they are answered), which is all the commit needs.
        if self.s().commit_flushers.lock().contains(&req.pid()) {
            reply.ok();
            return;
        }
        let f = {
            let mut st = self.s().state.lock();
            match &mut tryr!(reply, st.get_mut(ino.0)).content {
                Content::File(f) => tryr!(reply, f.sync_handle().map_err(errno)),
                _ => None,
            }
        };
        if let Some(f) = f {
            let r = if datasync {
                f.sync_data()
            } else {
                f.sync_all()
            };
            tryr!(reply, r.map_err(errno));
        }
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let mut st = self.s().state.lock();
        tryr!(reply, st.load_dir(ino.0));
        // The kernel may keep listings in its page cache across opens: every change to a
        // directory goes through this mount's kernel, which drops the cached listing then.
        reply.opened(
            FileHandle(0),
            FopenFlags::FOPEN_CACHE_DIR | FopenFlags::FOPEN_KEEP_CACHE,
        );
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let mut st = self.s().state.lock();
        tryr!(reply, st.load_all(ino.0));
        let st: &State = &st;
        for (cino, pos, name) in tryr!(reply, listing(st, ino.0, offset)) {
            let kind = st
                .inodes
                .get(&cino)
                .map(|i| i.kind())
                .unwrap_or(FileType::RegularFile);
            if reply.add(INodeNo(cino), pos, kind, OsStr::from_bytes(name)) {
                break;
            }
        }
        reply.ok();
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let mut st = self.s().state.lock();
        tryr!(reply, st.load_all(ino.0));
        let st: &State = &st;
        for (cino, pos, name) in tryr!(reply, listing(st, ino.0, offset)) {
            let Ok(a) = st.attr(cino) else { continue };
            let name = OsStr::from_bytes(name);
            if reply.add(INodeNo(cino), pos, name, &TTL, &a, Generation(0)) {
                break;
            }
        }
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let st = self.s().state.lock();
        let q = st.quota;
        let blocks = q.bytes.map(|b| b / BLOCK).unwrap_or(1 << 32);
        let bfree = blocks.saturating_sub(q.used_bytes().div_ceil(BLOCK));
        let files = q.inodes.unwrap_or(1 << 32);
        let ffree = files.saturating_sub(q.used_inodes);
        reply.statfs(
            blocks,
            bfree,
            bfree,
            files,
            ffree,
            BLOCK as u32,
            255,
            BLOCK as u32,
        );
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        tryr!(reply, self.rw());
        let mut st = self.s().state.lock();
        let i = tryr!(reply, st.get_mut(ino.0));
        let old = i.meta.xattrs.get(name.as_bytes()).map(|v| v.len());
        if flags & libc::XATTR_CREATE != 0 && old.is_some() {
            reply.error(Errno::EEXIST);
            return;
        }
        if flags & libc::XATTR_REPLACE != 0 && old.is_none() {
            reply.error(Errno::NO_XATTR);
            return;
        }
        // The server holds xattrs in memory: they count against the quota like data.
        let delta = match old {
            Some(o) => value.len() as i64 - o as i64,
            None => xattr_cost(name.as_bytes(), value) as i64,
        };
        tryr!(reply, st.charge_meta(ino.0, delta));
        let i = tryr!(reply, st.get_mut(ino.0));
        i.meta
            .xattrs
            .insert(name.as_bytes().to_vec(), value.to_vec());
        i.ctime = now();
        i.touched = true;
        reply.ok();
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let st = self.s().state.lock();
        let i = tryr!(reply, st.get(ino.0));
        match i.meta.xattrs.get(name.as_bytes()) {
            None => reply.error(Errno::NO_XATTR),
            Some(v) if size == 0 => reply.size(v.len() as u32),
            Some(v) if v.len() > size as usize => reply.error(Errno::ERANGE),
            Some(v) => reply.data(v),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let st = self.s().state.lock();
        let i = tryr!(reply, st.get(ino.0));
        let mut buf = Vec::new();
        for k in i.meta.xattrs.keys() {
            buf.extend_from_slice(k);
            buf.push(0);
        }
        if size == 0 {
            reply.size(buf.len() as u32);
        } else if buf.len() > size as usize {
            reply.error(Errno::ERANGE);
        } else {
            reply.data(&buf);
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        tryr!(reply, self.rw());
        let mut st = self.s().state.lock();
        let i = tryr!(reply, st.get_mut(ino.0));
        let Some(v) = i.meta.xattrs.remove(name.as_bytes()) else {
            reply.error(Errno::NO_XATTR);
            return;
        };
        i.ctime = now();
        i.touched = true;
        let _ = st.charge_meta(ino.0, -(xattr_cost(name.as_bytes(), &v) as i64));
        reply.ok();
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        // A file created write-only is written with FOPEN_DIRECT_IO: a direct write goes to
        // the server without the kernel's file_remove_privs, so the first write of a new file
        // costs no GETXATTR of security.capability (the server drops privileges itself, see
        // `write`). Such a descriptor can neither read nor be mapped, so the page cache loses
        // nothing: the kernel invalidates any cached page of the range before a direct write.
        let direct = flags & libc::O_ACCMODE == libc::O_WRONLY;
        let content = Content::File(super::file::FileData::placeholder());
        let attr = tryr!(reply, self.new_node(req, parent, name, mode, content));
        self.s().modes.with(attr.ino.0, |g| {
            {
                let mut st = self.s().state.lock();
                if let Ok(i) = st.get_mut(attr.ino.0) {
                    i.open += 1;
                    i.open_rdwr += u32::from(flags & libc::O_ACCMODE == libc::O_RDWR);
                }
            }
            g.cached += 1;
            reply.created(
                &TTL,
                &attr,
                Generation(0),
                self.new_fh(false, direct),
                if direct {
                    FopenFlags::FOPEN_DIRECT_IO
                } else {
                    FopenFlags::empty()
                },
            );
        });
    }

    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: fuser::IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        // What a regular file says to isatty() (one per buffered open in Python); fuser's
        // default would log a warning for each.
        reply.error(Errno::ENOTTY);
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        tryr!(reply, self.rw());
        let store = self.s().store.clone();
        let mut st = self.s().state.lock();
        let keep = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        let r = if mode & libc::FALLOC_FL_PUNCH_HOLE != 0 {
            if !keep {
                reply.error(Errno::EINVAL);
                return;
            }
            let extra = tryr!(reply, st.file_mut(ino.0)).new_blocks_for(offset, length);
            tryr!(reply, st.check_space(extra));
            tryr!(reply, st.file_mut(ino.0)).zero_range(&store, offset, length)
        } else if mode & libc::FALLOC_FL_ZERO_RANGE != 0 {
            let extra = tryr!(reply, st.file_mut(ino.0)).new_blocks_for(offset, length);
            tryr!(reply, st.check_space(extra));
            let f = tryr!(reply, st.file_mut(ino.0));
            let end = offset + length;
            let r = if !keep && end > f.size {
                f.truncate(&store, end)
            } else {
                Ok(())
            };
            r.and_then(|_| f.zero_range(&store, offset, length))
        } else if mode & !libc::FALLOC_FL_KEEP_SIZE == 0 {
            let extra = tryr!(reply, st.file_mut(ino.0)).new_blocks_for(offset, length);
            tryr!(reply, st.check_space(extra));
            tryr!(reply, st.file_mut(ino.0)).allocate(&store, offset, length, keep)
        } else {
            reply.error(Errno::EOPNOTSUPP);
            return;
        };
        tryr!(reply, r.map_err(errno));
        st.recharge(ino.0);
        let t = now();
        if let Ok(i) = st.get_mut(ino.0) {
            i.meta.mtime_sec = t.0;
            i.meta.mtime_nsec = t.1;
            i.ctime = t;
            i.touched = true;
        }
        reply.ok();
    }
}
