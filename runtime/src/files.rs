//! Files API: every path is resolved inside the sandbox's root (as its processes see it, via
//! /proc/<init>/root) with openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS), so symlinks pointing out
//! resolve inside and `..` can't climb out. A path whose `..` would climb above `/` is refused, as is
//! anything on the sandbox's procfs/sysfs (the runtime holds host privileges the sandbox does not).

use std::ffi::CString;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _};

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;

use crate::error::Error;
use crate::init_handle::{HandleError, InitHandle};
use crate::types::DirEntry;

/// Normalizes a sandbox path into components; `..` above the root is an error.
pub fn components(path: &str) -> Result<Vec<String>, Error> {
    if path.contains('\0') {
        return Err(Error::invalid("path", "NUL byte"));
    }
    let mut out: Vec<String> = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                if out.pop().is_none() {
                    return Err(Error::PathOutsideSandbox {
                        path: path.to_string(),
                    });
                }
            }
            c => out.push(c.to_string()),
        }
    }
    Ok(out)
}

fn join(c: &[String]) -> String {
    if c.is_empty() {
        ".".into()
    } else {
        c.join("/")
    }
}

/// The sandbox's root directory, as seen by its init.
pub struct Root {
    fd: OwnedFd,
}

impl Root {
    /// The root of `init`'s sandbox, proved to be that init's (never a reused pid's).
    pub fn open(init: &InitHandle) -> Result<Root, HandleError> {
        Ok(Root { fd: init.root()? })
    }

    /// A host directory used as a root the same way: an image build's view of its tree, or its
    /// context, where every path must stay inside just as in a sandbox.
    pub fn open_dir(dir: &std::path::Path) -> std::io::Result<Root> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(dir)?;
        Ok(Root { fd: f.into() })
    }

    /// `mkdir -p` inside the root (directories made 0755).
    pub fn mkdir_all(&self, path: &str) -> Result<(), Error> {
        self.mkdir_p(path, &components(path)?)
    }

    /// The entry itself (a final symlink is not followed): its kind ("file", "dir", "symlink",
    /// "other") and mode; None when absent.
    pub fn lstat(&self, path: &str) -> Result<Option<(&'static str, u32)>, Error> {
        let rel = join(&components(path)?);
        match self.open_at(path, &rel, libc::O_PATH | libc::O_NOFOLLOW, 0) {
            Ok(fd) => {
                let st = nix::sys::stat::fstat(fd.as_raw_fd())
                    .map_err(|e| Error::io(format!("stat {path:?}"), e.into()))?;
                Ok(Some((kind_of(st.st_mode), st.st_mode & 0o7777)))
            }
            Err(Error::FileNotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Sets owner (and, unless a symlink, the mode) of the entry itself, never of what a final
    /// symlink points to.
    pub fn set_owner_mode(
        &self,
        path: &str,
        owner: Option<(u32, u32)>,
        mode: Option<u32>,
    ) -> Result<(), Error> {
        let rel = join(&components(path)?);
        let fd = self.open_at(path, &rel, libc::O_PATH | libc::O_NOFOLLOW, 0)?;
        if let Some((uid, gid)) = owner {
            nix::unistd::fchownat(
                Some(fd.as_raw_fd()),
                "",
                Some(nix::unistd::Uid::from_raw(uid)),
                Some(nix::unistd::Gid::from_raw(gid)),
                nix::fcntl::AtFlags::AT_EMPTY_PATH,
            )
            .map_err(|e| Error::io(format!("chown {path:?}"), e.into()))?;
        }
        let st = nix::sys::stat::fstat(fd.as_raw_fd())
            .map_err(|e| Error::io(format!("stat {path:?}"), e.into()))?;
        if let Some(m) = mode.filter(|_| st.st_mode & libc::S_IFMT != libc::S_IFLNK) {
            // Through our own fd: the inode opened above, whatever the path names by now.
            std::fs::set_permissions(
                format!("/proc/self/fd/{}", fd.as_raw_fd()),
                std::fs::Permissions::from_mode(m & 0o7777),
            )
            .map_err(|e| Error::io(format!("chmod {path:?}"), e))?;
        }
        Ok(())
    }

    /// The target of the symlink at `path`.
    pub fn read_link(&self, path: &str) -> Result<String, Error> {
        let comps = components(path)?;
        let (last, parent) = comps
            .split_last()
            .ok_or_else(|| Error::invalid("path", "is the root directory"))?;
        self.readlink(parent, last)
    }

    /// Makes (or replaces) a symlink at `path`.
    pub fn make_symlink(&self, path: &str, target: &str) -> Result<(), Error> {
        self.symlink(path, &components(path)?, target)
    }

    /// openat2 below the root; maps resolution errors to the API's errors.
    fn open_at(&self, shown: &str, rel: &str, flags: i32, mode: u32) -> Result<OwnedFd, Error> {
        let c = CString::new(rel).map_err(|_| Error::invalid("path", "NUL byte"))?;
        let mode = if flags & libc::O_CREAT != 0 { mode } else { 0 };
        let how = OpenHow::new()
            .flags(OFlag::from_bits_retain(flags | libc::O_CLOEXEC))
            .mode(Mode::from_bits_retain(mode as libc::mode_t))
            .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
        let fd = match nix::fcntl::openat2(self.fd.as_raw_fd(), c.as_c_str(), how) {
            Ok(fd) => fd,
            Err(errno) => return Err(Self::open_error(shown, errno)),
        };
        // SAFETY: fd is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        refuse_pseudo_fs(&fd, shown)?;
        Ok(fd)
    }

    /// What a failed openat2 means to the API.
    fn open_error(shown: &str, errno: Errno) -> Error {
        match errno {
            Errno::ENOENT => Error::FileNotFound {
                path: shown.to_string(),
            },
            Errno::EXDEV | Errno::ELOOP => Error::PathOutsideSandbox {
                path: shown.to_string(),
            },
            // The caller's path names a file where a directory must be, or the reverse.
            Errno::ENOTDIR => Error::invalid(
                "path",
                format!("{shown:?}: a part of it is a file where a directory is needed"),
            ),
            Errno::EISDIR => Error::invalid(
                "path",
                format!("{shown:?} is a directory (use files/list or archive)"),
            ),
            _ => Error::io(format!("open {shown:?} in the sandbox"), errno.into()),
        }
    }

    /// Opens a regular file for reading without ever opening anything else: the path is opened
    /// `O_PATH` (no open on a FIFO, socket or device, so nothing can block or wake a driver), its
    /// type checked with fstat, and only a regular file reopened (the same inode, via our own fd).
    /// Returns the file and its size when opened.
    pub fn open_read(&self, path: &str) -> Result<(File, u64), Error> {
        let rel = join(&components(path)?);
        let fd = self.open_at(path, &rel, libc::O_PATH, 0)?;
        let meta = nix::sys::stat::fstat(fd.as_raw_fd())
            .map_err(|e| Error::io(format!("stat {path:?}"), e.into()))?;
        not_regular(path, meta.st_mode)?;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
            .open(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .map_err(|e| Error::io(format!("open {path:?}"), e))?;
        let meta = f
            .metadata()
            .map_err(|e| Error::io(format!("stat {path:?}"), e))?;
        not_regular(path, meta.mode())?;
        Ok((f, meta.len()))
    }

    /// The whole file in memory: for the runtime's own small reads. The API streams with
    /// [`Root::open_read`] instead.
    pub fn read(&self, path: &str) -> Result<Vec<u8>, Error> {
        let (mut f, _) = self.open_read(path)?;
        let mut out = Vec::new();
        f.read_to_end(&mut out)
            .map_err(|e| Error::io(format!("read {path:?}"), e))?;
        Ok(out)
    }

    /// Makes every directory of `comps` (like mkdir -p), one component at a time.
    fn mkdir_p(&self, shown: &str, comps: &[String]) -> Result<(), Error> {
        for i in 0..comps.len() {
            let rel = join(&comps[..=i]);
            match self.open_at(shown, &rel, libc::O_PATH | libc::O_DIRECTORY, 0) {
                Ok(_) => continue,
                Err(Error::FileNotFound { .. }) => {}
                Err(e) => return Err(e),
            }
            let parent = self.open_at(
                shown,
                &join(&comps[..i]),
                libc::O_PATH | libc::O_DIRECTORY,
                0,
            )?;
            let name =
                CString::new(comps[i].as_str()).map_err(|_| Error::invalid("path", "NUL byte"))?;
            // mkdirat does not follow a final symlink.
            match nix::sys::stat::mkdirat(
                Some(parent.as_raw_fd()),
                name.as_c_str(),
                Mode::from_bits_retain(0o755),
            ) {
                Ok(()) | Err(Errno::EEXIST) => {}
                Err(e) => return Err(Error::io(format!("mkdir {rel:?} in the sandbox"), e.into())),
            }
        }
        Ok(())
    }

    pub fn write(&self, path: &str, data: &[u8], mode: Option<u32>) -> Result<(), Error> {
        self.write_from(path, &mut &data[..], mode).map(|_| ())
    }

    /// Streams `data` into the file (a bounded buffer at a time; the sandbox's disk quota stops it
    /// with ENOSPC as it goes). A file this call created is removed again when the copy fails, so a
    /// failed upload leaves no half file behind. Returns the bytes written.
    pub fn write_from(
        &self,
        path: &str,
        data: &mut dyn Read,
        mode: Option<u32>,
    ) -> Result<u64, Error> {
        let comps = components(path)?;
        let Some((last, parent)) = comps.split_last() else {
            return Err(Error::invalid("path", "is the root directory"));
        };
        self.mkdir_p(path, parent)?;
        let mode = mode.unwrap_or(0o644) & 0o7777;
        let rel = join(&comps);
        // Never open a FIFO or device for writing: look first, then open non-blocking (a FIFO
        // swapped in meanwhile fails or is refused below instead of blocking).
        match self.open_at(path, &rel, libc::O_PATH, 0) {
            Ok(fd) => {
                let st = nix::sys::stat::fstat(fd.as_raw_fd())
                    .map_err(|e| Error::io(format!("stat {path:?}"), e.into()))?;
                not_regular(path, st.st_mode)?;
            }
            Err(Error::FileNotFound { .. }) => {}
            Err(e) => return Err(e),
        }
        let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_NONBLOCK | libc::O_NOCTTY;
        let (fd, created) = match self.open_at(path, &rel, flags | libc::O_EXCL, mode) {
            Ok(fd) => (fd, true),
            Err(Error::Io { source, .. }) if source.raw_os_error() == Some(libc::EEXIST) => (
                self.open_at(path, &rel, flags | libc::O_TRUNC, mode)?,
                false,
            ),
            Err(e) => return Err(e),
        };
        let mut f = File::from(fd);
        not_regular(path, f.metadata().map(|m| m.mode()).unwrap_or(0))?;
        let res = copy_bounded(data, &mut f)
            .map_err(|e| Error::io(format!("write {path:?}"), e))
            .and_then(|n| {
                f.set_permissions(std::fs::Permissions::from_mode(mode))
                    .map_err(|e| Error::io(format!("chmod {path:?}"), e))?;
                Ok(n)
            })
            .and_then(|n| {
                // A cached write the filesystem refuses later (quota) is reported at close.
                nix::unistd::close(std::os::fd::IntoRawFd::into_raw_fd(f))
                    .map_err(|e| Error::io(format!("close {path:?}"), e.into()))?;
                Ok(n)
            });
        if res.is_err() && created {
            if let Ok(pfd) = self.open_at(path, &join(parent), libc::O_PATH | libc::O_DIRECTORY, 0)
            {
                let _ = nix::unistd::unlinkat(
                    Some(pfd.as_raw_fd()),
                    last.as_str(),
                    nix::unistd::UnlinkatFlags::NoRemoveDir,
                );
            }
        }
        res
    }

    pub fn list(&self, path: &str) -> Result<Vec<DirEntry>, Error> {
        let rel = join(&components(path)?);
        let fd = self.open_at(path, &rel, libc::O_PATH, 0)?;
        let st = nix::sys::stat::fstat(fd.as_raw_fd())
            .map_err(|e| Error::io(format!("stat {path:?}"), e.into()))?;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            return Err(Error::invalid(
                "path",
                format!("{path:?} is a file, not a directory (read it with GET files)"),
            ));
        }
        let fd = self.open_at(path, &rel, libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
        let mut out = Vec::new();
        let mut dir = nix::dir::Dir::from_fd(std::os::fd::IntoRawFd::into_raw_fd(fd))
            .map_err(|e| Error::io(format!("list {path:?}"), e.into()))?;
        let dfd = dir.as_raw_fd();
        for ent in dir.iter().flatten() {
            let name = ent.file_name().to_string_lossy().into_owned();
            if name == "." || name == ".." {
                continue;
            }
            let Ok(st) = nix::sys::stat::fstatat(
                Some(dfd),
                ent.file_name(),
                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
            ) else {
                continue;
            };
            out.push(DirEntry {
                name,
                kind: kind_of(st.st_mode).into(),
                size: st.st_size as u64,
                mode: st.st_mode & 0o7777,
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Unpacks a tar stream under `dir` (each member resolved inside the root like any other path).
    pub fn upload_tar(&self, dir: &str, tar: &mut dyn Read) -> Result<(), Error> {
        let base = components(dir)?;
        self.mkdir_p(dir, &base)?;
        let mut ar = tar::Archive::new(tar);
        let entries = ar.entries().map_err(|e| Error::io("read tar", e))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| Error::io("read tar entry", e))?;
            let name = entry
                .path()
                .map_err(|e| Error::io("tar entry path", e))?
                .to_string_lossy()
                .into_owned();
            let mut comps = base.clone();
            let rel =
                components(&name).map_err(|_| Error::PathOutsideSandbox { path: name.clone() })?;
            comps.extend(rel);
            let shown = format!("/{}", comps.join("/"));
            let mode = entry.header().mode().unwrap_or(0o644) & 0o7777;
            match entry.header().entry_type() {
                tar::EntryType::Directory => self.mkdir_p(&shown, &comps)?,
                tar::EntryType::Regular | tar::EntryType::Continuous => {
                    self.write_from(&shown, &mut entry, Some(mode))?;
                }
                tar::EntryType::Symlink => {
                    let target = entry
                        .link_name()
                        .ok()
                        .flatten()
                        .map(|p| p.to_string_lossy().into_owned())
                        .ok_or_else(|| {
                            Error::invalid("tar", format!("symlink {name:?} without target"))
                        })?;
                    self.symlink(&shown, &comps, &target)?;
                }
                other => {
                    return Err(Error::invalid(
                        "tar",
                        format!("{name:?}: unsupported entry type {other:?}"),
                    ))
                }
            }
        }
        Ok(())
    }

    fn symlink(&self, shown: &str, comps: &[String], target: &str) -> Result<(), Error> {
        let (last, parent) = comps
            .split_last()
            .ok_or_else(|| Error::invalid("path", "is the root directory"))?;
        self.mkdir_p(shown, parent)?;
        let pfd = self.open_at(shown, &join(parent), libc::O_PATH | libc::O_DIRECTORY, 0)?;
        let name = CString::new(last.as_str()).map_err(|_| Error::invalid("path", "NUL byte"))?;
        let t = CString::new(target).map_err(|_| Error::invalid("tar", "NUL byte"))?;
        // unlinkat/symlinkat act on the entry itself, never following it.
        let _ = nix::unistd::unlinkat(
            Some(pfd.as_raw_fd()),
            name.as_c_str(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        );
        nix::unistd::symlinkat(t.as_c_str(), Some(pfd.as_raw_fd()), name.as_c_str())
            .map_err(|e| Error::io(format!("symlink {shown:?}"), e.into()))?;
        Ok(())
    }

    /// Writes `dir` (recursively) as a tar stream; symlinks are stored as links, never followed.
    pub fn download_tar(&self, dir: &str, out: &mut dyn Write) -> Result<(), Error> {
        let base = components(dir)?;
        let mut b = tar::Builder::new(out);
        let mut stack: Vec<Vec<String>> = vec![Vec::new()];
        while let Some(sub) = stack.pop() {
            let mut comps = base.clone();
            comps.extend(sub.iter().cloned());
            let shown = format!("/{}", comps.join("/"));
            let entries = match self.list(&shown) {
                // A /proc or /sys below the requested directory: keep the (empty) directory, skip its contents.
                Err(Error::InvalidSpec { ref field, .. }) if field == "path" && !sub.is_empty() => {
                    continue
                }
                r => r?,
            };
            for e in entries {
                let mut rel = sub.clone();
                rel.push(e.name.clone());
                let name = rel.join("/");
                let mut h = tar::Header::new_gnu();
                h.set_mode(e.mode);
                h.set_mtime(0);
                let path = format!("{shown}/{}", e.name);
                let io = |e: std::io::Error| Error::io("write tar", e);
                match e.kind.as_str() {
                    "dir" => {
                        h.set_entry_type(tar::EntryType::Directory);
                        h.set_size(0);
                        b.append_data(&mut h, format!("{name}/"), std::io::empty())
                            .map_err(io)?;
                        stack.push(rel);
                    }
                    "file" => {
                        let (f, size) = self.open_read(&path)?;
                        h.set_entry_type(tar::EntryType::Regular);
                        h.set_size(size);
                        b.append_data(&mut h, &name, Exactly::new(f, size))
                            .map_err(io)?;
                    }
                    "symlink" => {
                        let target = self.readlink(&comps, &e.name)?;
                        h.set_entry_type(tar::EntryType::Symlink);
                        h.set_size(0);
                        b.append_link(&mut h, &name, target).map_err(io)?;
                    }
                    _ => {}
                }
            }
        }
        b.finish().map_err(|e| Error::io("finish tar", e))
    }

    fn readlink(&self, parent: &[String], name: &str) -> Result<String, Error> {
        let pfd = self.open_at(name, &join(parent), libc::O_PATH | libc::O_DIRECTORY, 0)?;
        let target = nix::fcntl::readlinkat(Some(pfd.as_raw_fd()), name)
            .map_err(|e| Error::io(format!("readlink {name:?}"), e.into()))?;
        Ok(target.to_string_lossy().into_owned())
    }
}

/// What `stat` tells of one entry (the entry itself: a symlink is not followed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileStat {
    /// The last component of the path ("/" for the root).
    pub name: String,
    /// "file" | "dir" | "symlink" | "other"
    pub kind: &'static str,
    pub size: u64,
    /// Permission bits and file type (`st_mode`).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime_secs: i64,
    pub mtime_nanos: i64,
    pub symlink_target: Option<String>,
}

/// File operations the E2B-compatible filesystem service needs: stat, mkdir, rename, remove and
/// chown, each resolved inside the root like the rest. Final components are acted on through
/// their parent's descriptor, never followed.
impl Root {
    /// The parent directory of `path`, opened inside the root, and the last component.
    fn parent_of(&self, path: &str) -> Result<(OwnedFd, String), Error> {
        let comps = components(path)?;
        let Some((last, parent)) = comps.split_last() else {
            return Err(Error::invalid("path", "is the root directory"));
        };
        let pfd = self.open_at(path, &join(parent), libc::O_PATH | libc::O_DIRECTORY, 0)?;
        Ok((pfd, last.clone()))
    }

    pub fn stat(&self, path: &str) -> Result<FileStat, Error> {
        let comps = components(path)?;
        let (st, target, name) = match comps.split_last() {
            None => {
                let fd = self.open_at(path, ".", libc::O_PATH | libc::O_DIRECTORY, 0)?;
                let st = nix::sys::stat::fstat(fd.as_raw_fd())
                    .map_err(|e| Error::io(format!("stat {path:?}"), e.into()))?;
                (st, None, "/".to_string())
            }
            Some((last, _)) => {
                let (pfd, _) = self.parent_of(path)?;
                let st = nix::sys::stat::fstatat(
                    Some(pfd.as_raw_fd()),
                    last.as_str(),
                    nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .map_err(|e| match e {
                    nix::errno::Errno::ENOENT | nix::errno::Errno::ENOTDIR => Error::FileNotFound {
                        path: path.to_string(),
                    },
                    e => Error::io(format!("stat {path:?}"), e.into()),
                })?;
                let target = if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
                    nix::fcntl::readlinkat(Some(pfd.as_raw_fd()), last.as_str())
                        .ok()
                        .map(|t| t.to_string_lossy().into_owned())
                } else {
                    None
                };
                (st, target, last.clone())
            }
        };
        Ok(FileStat {
            name,
            kind: kind_of(st.st_mode),
            size: st.st_size as u64,
            mode: st.st_mode,
            uid: st.st_uid,
            gid: st.st_gid,
            mtime_secs: st.st_mtime,
            mtime_nanos: st.st_mtime_nsec,
            symlink_target: target,
        })
    }

    /// Makes the directory and its missing parents; false when it was there already.
    /// Directories made are owned by `owner` (uid, gid) when given.
    pub fn make_dir(&self, path: &str, owner: Option<(u32, u32)>) -> Result<bool, Error> {
        let comps = components(path)?;
        match self.stat(path) {
            Ok(st) if st.kind == "dir" => return Ok(false),
            Ok(_) => {
                return Err(Error::invalid(
                    "path",
                    format!("{path:?} exists and is not a directory"),
                ))
            }
            Err(Error::FileNotFound { .. }) => {}
            Err(e) => return Err(e),
        }
        // Which of the parents are missing, to own just those.
        let mut first_missing = comps.len();
        for i in (0..comps.len()).rev() {
            let shown = format!("/{}", comps[..=i].join("/"));
            match self.stat(&shown) {
                Err(Error::FileNotFound { .. }) => first_missing = i,
                _ => break,
            }
        }
        self.mkdir_p(path, &comps)?;
        if let Some((uid, gid)) = owner {
            for i in first_missing..comps.len() {
                self.chown(&format!("/{}", comps[..=i].join("/")), uid, gid)?;
            }
        }
        Ok(true)
    }

    /// Renames within the sandbox (`rename(2)` semantics: an existing file at `to` is replaced).
    pub fn rename(&self, from: &str, to: &str) -> Result<(), Error> {
        let (sfd, sname) = self.parent_of(from)?;
        let (dfd, dname) = self.parent_of(to)?;
        nix::fcntl::renameat(
            Some(sfd.as_raw_fd()),
            sname.as_str(),
            Some(dfd.as_raw_fd()),
            dname.as_str(),
        )
        .map_err(|e| match e {
            nix::errno::Errno::ENOENT => Error::FileNotFound {
                path: from.to_string(),
            },
            e => Error::io(format!("rename {from:?} to {to:?}"), e.into()),
        })
    }

    /// Removes a file, a symlink (not what it points to) or a directory with all it holds.
    pub fn remove(&self, path: &str) -> Result<(), Error> {
        let (pfd, name) = self.parent_of(path)?;
        let st = self.stat(path)?;
        if st.kind == "dir" {
            let dfd = self.open_at(
                path,
                &join(&components(path)?),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
                0,
            )?;
            remove_tree(dfd, path)?;
            nix::unistd::unlinkat(
                Some(pfd.as_raw_fd()),
                name.as_str(),
                nix::unistd::UnlinkatFlags::RemoveDir,
            )
        } else {
            nix::unistd::unlinkat(
                Some(pfd.as_raw_fd()),
                name.as_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            )
        }
        .map_err(|e| Error::io(format!("remove {path:?}"), e.into()))
    }

    /// Sets the owner of the entry itself (a symlink's own owner, never its target's).
    pub fn chown(&self, path: &str, uid: u32, gid: u32) -> Result<(), Error> {
        let (pfd, name) = self.parent_of(path)?;
        nix::unistd::fchownat(
            Some(pfd.as_raw_fd()),
            name.as_str(),
            Some(nix::unistd::Uid::from_raw(uid)),
            Some(nix::unistd::Gid::from_raw(gid)),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| Error::io(format!("chown {path:?}"), e.into()))
    }
}

/// Empties a directory given by descriptor, depth first. Each child is opened by name relative
/// to its parent with O_NOFOLLOW, so a symlink swapped in is unlinked, never descended into.
fn remove_tree(dfd: OwnedFd, shown: &str) -> Result<(), Error> {
    let io = |e: nix::errno::Errno| Error::io(format!("remove {shown:?}"), e.into());
    let mut dir = nix::dir::Dir::from_fd(std::os::fd::IntoRawFd::into_raw_fd(dfd)).map_err(io)?;
    let raw = dir.as_raw_fd();
    let names: Vec<std::ffi::CString> = dir
        .iter()
        .flatten()
        .map(|e| e.file_name().to_owned())
        .filter(|n| n.as_bytes() != b"." && n.as_bytes() != b"..")
        .collect();
    for n in names {
        let st = nix::sys::stat::fstatat(
            Some(raw),
            n.as_c_str(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(io)?;
        if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
            let child = nix::fcntl::openat(
                Some(raw),
                n.as_c_str(),
                nix::fcntl::OFlag::O_RDONLY
                    | nix::fcntl::OFlag::O_DIRECTORY
                    | nix::fcntl::OFlag::O_NOFOLLOW
                    | nix::fcntl::OFlag::O_CLOEXEC,
                nix::sys::stat::Mode::empty(),
            )
            .map_err(io)?;
            // SAFETY: openat returned a fresh descriptor that nothing else owns.
            remove_tree(unsafe { OwnedFd::from_raw_fd(child) }, shown)?;
            nix::unistd::unlinkat(
                Some(raw),
                n.as_c_str(),
                nix::unistd::UnlinkatFlags::RemoveDir,
            )
            .map_err(io)?;
        } else {
            nix::unistd::unlinkat(
                Some(raw),
                n.as_c_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            )
            .map_err(io)?;
        }
    }
    Ok(())
}

/// Copies with one fixed buffer: memory stays bounded however large the stream.
fn copy_bounded(from: &mut dyn Read, to: &mut File) -> std::io::Result<u64> {
    let mut buf = vec![0u8; 256 << 10];
    let mut n = 0u64;
    loop {
        let got = match from.read(&mut buf) {
            Ok(0) => return Ok(n),
            Ok(got) => got,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        to.write_all(&buf[..got])?;
        n += got as u64;
    }
}

/// Refuses anything but a regular file: a directory is listed, and a FIFO, socket or device would
/// block a worker or reach a driver with the daemon's privileges.
fn not_regular(path: &str, mode: u32) -> Result<(), Error> {
    match mode & libc::S_IFMT {
        libc::S_IFREG => Ok(()),
        libc::S_IFDIR => Err(Error::invalid(
            "path",
            format!("{path:?} is a directory (use files/list or archive)"),
        )),
        _ => Err(Error::invalid(
            "path",
            format!("{path:?} is not a regular file"),
        )),
    }
}

/// Exactly `size` bytes of a file the sandbox may change meanwhile: a tar member must match its
/// header, so a file that shrank is padded with zeros and one that grew is cut.
struct Exactly {
    inner: std::io::Take<File>,
    left: u64,
}

impl Exactly {
    fn new(f: File, size: u64) -> Exactly {
        Exactly {
            inner: f.take(size),
            left: size,
        }
    }
}

impl Read for Exactly {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.left == 0 {
            return Ok(0);
        }
        let n = match self.inner.read(buf)? {
            0 => {
                let n = buf.len().min(self.left.min(usize::MAX as u64) as usize);
                buf[..n].fill(0);
                n
            }
            n => n,
        };
        self.left -= n as u64;
        Ok(n)
    }
}

fn kind_of(mode: u32) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFREG => "file",
        libc::S_IFDIR => "dir",
        libc::S_IFLNK => "symlink",
        _ => "other",
    }
}

/// The runtime must not act on the sandbox's /proc or /sys with host privileges.
fn refuse_pseudo_fs(fd: &OwnedFd, shown: &str) -> Result<(), Error> {
    const PROC: i64 = 0x9fa0;
    const SYSFS: i64 = 0x6265_6572;
    let st = nix::sys::statfs::fstatfs(fd)
        .map_err(|e| Error::io(format!("statfs {shown:?}"), e.into()))?;
    let t = st.filesystem_type().0 as i64;
    if t == PROC || t == SYSFS {
        return Err(Error::invalid(
            "path",
            format!("{shown:?} is on /proc or /sys"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizes_and_refuses_climbing_out() {
        assert_eq!(components("/a/./b/../c").unwrap(), vec!["a", "c"]);
        assert_eq!(components("a//b/").unwrap(), vec!["a", "b"]);
        assert_eq!(
            components("../../etc/passwd").unwrap_err().code(),
            "path_outside_sandbox"
        );
        assert_eq!(
            components("/tmp/../../x").unwrap_err().code(),
            "path_outside_sandbox"
        );
    }
}
