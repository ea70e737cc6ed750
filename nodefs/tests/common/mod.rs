//! Test helpers: temp stores, random trees, and a guard that always unmounts.
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nodefs::{ManifestId, Mount, MountOptions, NodeFs, Store};
use rand::{Rng, SeedableRng};

/// Unmounts on drop, even when the test panics.
pub struct MountGuard(pub Arc<Mount>);

impl Drop for MountGuard {
    fn drop(&mut self) {
        let _ = self.0.unmount();
    }
}

impl std::ops::Deref for MountGuard {
    type Target = Mount;
    fn deref(&self) -> &Mount {
        &self.0
    }
}

/// A temp dir with a store, a mountpoint area and scratch space.
/// Fields drop in order: the server (unmounting anything left) before the temp dir.
pub struct Env {
    pub fs: Arc<NodeFs>,
    pub store: Arc<Store>,
    pub tmp: tempfile::TempDir,
}

impl Env {
    pub fn new() -> Env {
        Env::with_server(nodefs::ServerOptions::default())
    }

    /// A store and a server with `options` (the FUSE io_uring tests turn the ring on).
    pub fn with_server(options: nodefs::ServerOptions) -> Env {
        let tmp = tempfile::Builder::new()
            .prefix("nodefs-test")
            .tempdir()
            .unwrap();
        let store = Store::open(&tmp.path().join("store")).unwrap();
        let fs = NodeFs::with_options(store.clone(), options);
        Env { fs, store, tmp }
    }

    /// Drop every handle on the store and open it afresh (as after a restart).
    pub fn reopen(&mut self) {
        let dir = self.path("store");
        let scratch = Store::open(&self.path("scratch-store")).unwrap();
        let old_fs = std::mem::replace(&mut self.fs, NodeFs::new(scratch.clone()));
        let old_store = std::mem::replace(&mut self.store, scratch);
        drop(old_fs);
        drop(old_store);
        self.store = Store::open(&dir).unwrap();
        self.fs = NodeFs::new(self.store.clone());
    }

    pub fn path(&self, p: &str) -> PathBuf {
        self.tmp.path().join(p)
    }

    /// Mount `base` at a fresh mountpoint named `name`.
    pub fn mount(&self, base: &ManifestId, name: &str, opts: MountOptions) -> MountGuard {
        let mp = self.path(&format!("mnt-{name}"));
        fs::create_dir_all(&mp).unwrap();
        let opts = MountOptions {
            upper_dir: self.path(&format!("upper-{name}")),
            ..opts
        };
        MountGuard(self.fs.mount(base, &mp, opts).unwrap())
    }

    /// A manifest of an empty directory.
    pub fn empty(&self) -> ManifestId {
        let d = self.path("empty-src");
        fs::create_dir_all(&d).unwrap();
        self.store.import_dir(&d).unwrap()
    }
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Whether FUSE can be used here; if not, [`capability_missing`] says why (or fails the test).
pub fn fuse_available() -> bool {
    if !is_root() {
        capability_missing("FUSE tests need root");
        return false;
    }
    if !Path::new("/dev/fuse").exists() {
        capability_missing("FUSE tests need /dev/fuse");
        return false;
    }
    true
}

#[allow(unused_imports)] // not every test binary skips
pub use grove_testkit::capability_missing;

/// Deterministic pseudo-random bytes.
pub fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let mut v = vec![0u8; n];
    r.fill(&mut v[..]);
    v
}

/// A plain tar of `files` (name, content), mode 0644, owned by root.
pub fn tar_of_files(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_cksum();
        b.append_data(&mut h, name, *data).unwrap();
    }
    b.into_inner().unwrap()
}

/// A small tree with files of several sizes, a symlink, a hard link, a fifo and xattrs.
pub fn make_tree(root: &Path, seed: u64) {
    fs::create_dir_all(root.join("a/b/c")).unwrap();
    fs::write(root.join("small.txt"), b"hello nodefs\n").unwrap();
    fs::write(root.join("a/big.bin"), random_bytes(seed, 3 << 20)).unwrap();
    fs::write(root.join("a/b/mid.bin"), random_bytes(seed + 1, 300_000)).unwrap();
    fs::write(root.join("a/b/c/empty"), b"").unwrap();
    std::os::unix::fs::symlink("../small.txt", root.join("a/link")).unwrap();
    fs::hard_link(root.join("small.txt"), root.join("a/b/hard.txt")).unwrap();
    let c = std::ffi::CString::new(root.join("fifo").to_str().unwrap()).unwrap();
    // SAFETY: valid C path.
    unsafe { libc::mkfifo(c.as_ptr(), 0o644) };
    let p = std::ffi::CString::new(root.join("small.txt").to_str().unwrap()).unwrap();
    // SAFETY: valid C strings and buffer.
    unsafe { libc::setxattr(p.as_ptr(), c"user.k".as_ptr(), b"v".as_ptr().cast(), 1, 0) };
}

/// No nodefs mount left behind by this process.
pub fn assert_no_mounts_under(dir: &Path) {
    let mi = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let d = dir.to_string_lossy();
    assert!(!mi.contains(&*d), "mount left behind under {d}:\n{mi}");
}

/// Assert two trees hold the same names, types, modes, owners, content and link targets.
pub fn compare_trees(a: &Path, b: &Path) {
    use std::os::unix::fs::MetadataExt;
    let ma = fs::symlink_metadata(a).unwrap();
    let mb = fs::symlink_metadata(b).unwrap_or_else(|e| panic!("{}: {e}", b.display()));
    assert_eq!(ma.mode(), mb.mode(), "mode of {}", b.display());
    assert_eq!(
        (ma.uid(), ma.gid()),
        (mb.uid(), mb.gid()),
        "owner of {}",
        b.display()
    );
    let ft = ma.file_type();
    if ft.is_dir() {
        let mut na: Vec<_> = fs::read_dir(a)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        let mut nb: Vec<_> = fs::read_dir(b)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        na.sort();
        nb.sort();
        assert_eq!(na, nb, "entries of {}", b.display());
        for n in na {
            compare_trees(&a.join(&n), &b.join(&n));
        }
    } else if ft.is_file() {
        assert_eq!(ma.len(), mb.len(), "size of {}", b.display());
        assert!(
            fs::read(a).unwrap() == fs::read(b).unwrap(),
            "content of {}",
            b.display()
        );
        assert_eq!(ma.mtime(), mb.mtime(), "mtime of {}", b.display());
    } else if ft.is_symlink() {
        assert_eq!(fs::read_link(a).unwrap(), fs::read_link(b).unwrap());
    }
}
