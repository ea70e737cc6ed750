//! Materializing a manifest as a real directory tree (parallel file writes).

use std::collections::HashMap;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use nix::fcntl::AtFlags;
use nix::sys::stat::{utimensat, Mode, SFlag, UtimensatFlags};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid};
use parking_lot::Mutex;

use crate::error::{io_err, Error};
use crate::id::ManifestId;
use crate::store::Store;
use crate::sys;
use crate::tree::{ChunkRef, Meta, Node};

struct FileJob {
    path: PathBuf,
    chunks: Vec<ChunkRef>,
    size: u64,
    meta: Meta,
}

impl Store {
    /// Write the tree `id` under `dst` (created if missing; must be empty).
    pub fn export_dir(&self, id: &ManifestId, dst: &Path) -> Result<(), Error> {
        if !self.contains(id) {
            return Err(Error::UnknownManifest(*id));
        }
        fs::create_dir_all(dst).map_err(io_err(dst))?;
        let mut files = Vec::new();
        let mut links: Vec<(PathBuf, PathBuf)> = Vec::new();
        let mut others: Vec<(PathBuf, Meta)> = Vec::new();
        let mut dirs: Vec<(PathBuf, Meta)> = Vec::new();
        let mut first_of_link: HashMap<u64, PathBuf> = HashMap::new();
        let mut stack = vec![(*id, dst.to_path_buf(), None::<Meta>)];
        let root_tree = self.get_tree(id)?;
        dirs.push((dst.to_path_buf(), root_tree.meta.clone()));
        while let Some((tid, dir, _)) = stack.pop() {
            let t = self.get_tree(&tid)?;
            for e in t.entries {
                let p = dir.join(std::ffi::OsStr::from_bytes(&e.name));
                if e.link != 0 {
                    if let Some(first) = first_of_link.get(&e.link) {
                        links.push((first.clone(), p));
                        continue;
                    }
                    first_of_link.insert(e.link, p.clone());
                }
                match e.node {
                    Node::Dir(c) => {
                        fs::create_dir(&p).map_err(io_err(&p))?;
                        dirs.push((p.clone(), e.meta.clone()));
                        stack.push((c, p, None));
                    }
                    Node::File { size, chunks } => files.push(FileJob {
                        path: p,
                        chunks,
                        size,
                        meta: e.meta,
                    }),
                    Node::Symlink(t) => {
                        std::os::unix::fs::symlink(std::ffi::OsStr::from_bytes(&t), &p)
                            .map_err(io_err(&p))?;
                        others.push((p, e.meta));
                    }
                    Node::Fifo => {
                        mknod(&p, SFlag::S_IFIFO, 0).map_err(io_err(&p))?;
                        others.push((p, e.meta));
                    }
                    Node::Socket => {
                        mknod(&p, SFlag::S_IFSOCK, 0).map_err(io_err(&p))?;
                        others.push((p, e.meta));
                    }
                    Node::CharDev(r) => {
                        mknod(&p, SFlag::S_IFCHR, r).map_err(io_err(&p))?;
                        others.push((p, e.meta));
                    }
                    Node::BlockDev(r) => {
                        mknod(&p, SFlag::S_IFBLK, r).map_err(io_err(&p))?;
                        others.push((p, e.meta));
                    }
                }
            }
        }
        // Biggest first so the threads finish together.
        files.sort_by_key(|f| std::cmp::Reverse(f.size));
        let next = AtomicUsize::new(0);
        let first_err: Mutex<Option<Error>> = Mutex::new(None);
        let threads = crate::cpus().clamp(2, 8);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = files.get(i) else { break };
                    if first_err.lock().is_some() {
                        break;
                    }
                    if let Err(e) = self.write_file(job) {
                        first_err.lock().get_or_insert(e);
                        break;
                    }
                });
            }
        });
        if let Some(e) = first_err.into_inner() {
            return Err(e);
        }
        for (from, to) in links {
            fs::hard_link(&from, &to).map_err(io_err(&to))?;
        }
        for (p, m) in &others {
            apply_meta(p, m)?;
        }
        // Deepest first so setting a directory's mtime is not undone by its children.
        dirs.sort_by_key(|(p, _)| std::cmp::Reverse(p.components().count()));
        for (p, m) in &dirs {
            apply_meta(p, m)?;
        }
        Ok(())
    }

    fn write_file(&self, job: &FileJob) -> Result<(), Error> {
        use std::os::unix::fs::FileExt;
        let f = fs::File::create(&job.path).map_err(io_err(&job.path))?;
        let mut off = 0u64;
        for c in &job.chunks {
            let data = self.get_chunk(&c.id)?;
            // Zero pages stay holes (CRIU page images are full of them).
            if !(data.len() >= 4096 && data.iter().all(|b| *b == 0)) {
                f.write_all_at(&data, off).map_err(io_err(&job.path))?;
            }
            off += data.len() as u64;
        }
        if job.size > 0 {
            // Extends over a trailing hole; a no-op otherwise.
            f.set_len(job.size).map_err(io_err(&job.path))?;
        }
        drop(f);
        apply_meta(&job.path, &job.meta)
    }
}

fn apply_meta(p: &Path, m: &Meta) -> Result<(), Error> {
    let is_symlink = fs::symlink_metadata(p)
        .map(|md| md.file_type().is_symlink())
        .unwrap_or(false);
    nix::unistd::fchownat(
        None,
        p,
        Some(Uid::from_raw(m.uid)),
        Some(Gid::from_raw(m.gid)),
        AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .map_err(|e| io_err(p)(e.into()))?;
    if !is_symlink {
        fs::set_permissions(p, fs::Permissions::from_mode(m.mode)).map_err(io_err(p))?;
    }
    for (k, v) in &m.xattrs {
        // Best effort: the target filesystem may refuse some namespaces.
        if let Err(e) = sys::lsetxattr(p, k, v) {
            tracing::debug!(path = %p.display(), error = %e, "xattr not restored");
        }
    }
    let t = TimeSpec::new(m.mtime_sec, i64::from(m.mtime_nsec));
    utimensat(None, p, &t, &t, UtimensatFlags::NoFollowSymlink).map_err(|e| io_err(p)(e.into()))?;
    Ok(())
}

/// A special file of `kind`; mode 0600 until [`apply_meta`] gives it its own.
fn mknod(p: &Path, kind: SFlag, rdev: u64) -> std::io::Result<()> {
    nix::sys::stat::mknod(p, kind, Mode::from_bits_truncate(0o600), rdev).map_err(Into::into)
}
