//! POSIX semantics through a real nodefs mount (root + /dev/fuse).

mod common;

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{
    DirEntryExt, FileExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt,
};
use std::path::{Path, PathBuf};

use common::*;
use nodefs::MountOptions;

fn c(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

/// A base image with a large file, a small file and a directory.
fn base_env() -> (Env, nodefs::ManifestId) {
    let env = Env::new();
    let src = env.path("src");
    make_tree(&src, 42);
    let id = env.store.import_dir(&src).unwrap();
    (env, id)
}

#[test]
fn reads_base_and_writes_copy_on_write() {
    if !fuse_available() {
        return;
    }
    let (env, id) = base_env();
    let m = env.mount(&id, "m", MountOptions::default());
    let mp = m.mountpoint().to_path_buf();
    compare_trees(&env.path("src"), &mp);
    assert_eq!(
        m.commit().unwrap(),
        id,
        "an untouched mount commits to its base"
    );
    fs::write(mp.join("small.txt"), b"new").unwrap();
    assert_eq!(fs::read(mp.join("small.txt")).unwrap(), b"new");
    assert_eq!(
        fs::read(env.path("src/small.txt")).unwrap(),
        b"hello nodefs\n"
    );
    // The hard link sees the change too.
    assert_eq!(fs::read(mp.join("a/b/hard.txt")).unwrap(), b"new");
    let c1 = m.commit().unwrap();
    assert_ne!(c1, id);
    let out = env.path("out");
    env.store.export_dir(&c1, &out).unwrap();
    assert_eq!(fs::read(out.join("a/b/hard.txt")).unwrap(), b"new");
    assert_eq!(
        fs::metadata(out.join("small.txt")).unwrap().ino(),
        fs::metadata(out.join("a/b/hard.txt")).unwrap().ino()
    );
}

#[test]
fn small_write_into_large_file_copies_a_block_not_the_file() {
    if !fuse_available() {
        return;
    }
    let (env, id) = base_env();
    let m = env.mount(&id, "m", MountOptions::default());
    let p = m.mountpoint().join("a/big.bin");
    let mut f = OpenOptions::new().write(true).open(&p).unwrap();
    f.seek(SeekFrom::Start(1_000_001)).unwrap();
    f.write_all(b"XYZ").unwrap();
    drop(f);
    assert!(m.usage().bytes <= 8192, "usage {:?}", m.usage());
    let mut want = fs::read(env.path("src/a/big.bin")).unwrap();
    want[1_000_001..1_000_004].copy_from_slice(b"XYZ");
    assert!(fs::read(&p).unwrap() == want);
    // Commit re-chunks only around the write: most chunks are shared with the base.
    let before = env.store.stats().chunks;
    let c1 = m.commit().unwrap();
    let added = env.store.stats().chunks - before;
    assert!(added <= 4, "added {added} chunks");
    let out = env.path("out");
    env.store.export_dir(&c1, &out).unwrap();
    assert!(fs::read(out.join("a/big.bin")).unwrap() == want);
}

#[test]
fn rename_over_existing_and_directories() {
    if !fuse_available() {
        return;
    }
    let (env, id) = base_env();
    let m = env.mount(&id, "m", MountOptions::default());
    let mp = m.mountpoint();
    fs::write(mp.join("x"), b"x").unwrap();
    fs::rename(mp.join("x"), mp.join("small.txt")).unwrap();
    assert_eq!(fs::read(mp.join("small.txt")).unwrap(), b"x");
    assert!(!mp.join("x").exists());
    // The other hard link keeps the old content.
    assert_eq!(
        fs::read(mp.join("a/b/hard.txt")).unwrap(),
        b"hello nodefs\n"
    );
    fs::create_dir(mp.join("d1")).unwrap();
    fs::create_dir(mp.join("d2")).unwrap();
    fs::write(mp.join("d2/f"), b"f").unwrap();
    let e = fs::rename(mp.join("d1"), mp.join("d2")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOTEMPTY));
    fs::remove_file(mp.join("d2/f")).unwrap();
    fs::rename(mp.join("d1"), mp.join("d2")).unwrap();
    assert!(!mp.join("d1").exists());
    let e = fs::rename(mp.join("a"), mp.join("a/b/inside")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
    fs::rename(mp.join("a/b"), mp.join("moved")).unwrap();
    assert_eq!(
        fs::read(mp.join("moved/mid.bin")).unwrap(),
        fs::read(env.path("src/a/b/mid.bin")).unwrap()
    );
    let e = fs::remove_dir(mp.join("moved")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOTEMPTY));
    // std::fs::copy uses copy_file_range; the kernel falls back for FUSE.
    fs::copy(mp.join("moved/mid.bin"), mp.join("copy.bin")).unwrap();
    assert!(
        fs::read(mp.join("copy.bin")).unwrap() == fs::read(env.path("src/a/b/mid.bin")).unwrap()
    );
    // A symlink replaced by another shows the new target (the kernel caches targets per
    // inode), through readlink and through path walks.
    std::os::unix::fs::symlink("small.txt", mp.join("ln")).unwrap();
    assert_eq!(fs::read(mp.join("ln")).unwrap(), b"x");
    std::os::unix::fs::symlink("copy.bin", mp.join("ln2")).unwrap();
    fs::rename(mp.join("ln2"), mp.join("ln")).unwrap();
    assert_eq!(fs::read_link(mp.join("ln")).unwrap(), Path::new("copy.bin"));
    assert_eq!(fs::read(mp.join("ln")).unwrap().len(), 300_000);
    // isatty() on a file is a plain "no" (ENOTTY).
    let f = File::open(mp.join("small.txt")).unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    // SAFETY: fd is open for the duration of the call.
    let tty = unsafe { libc::isatty(fd) };
    assert_eq!(tty, 0);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::ENOTTY)
    );
    // Many entries list completely.
    fs::create_dir(mp.join("many")).unwrap();
    for i in 0..1500 {
        File::create(mp.join(format!("many/file-{i:05}"))).unwrap();
    }
    assert_eq!(fs::read_dir(mp.join("many")).unwrap().count(), 1500);
}

#[test]
fn unlink_while_open_and_hard_links() {
    if !fuse_available() {
        return;
    }
    let (env, id) = base_env();
    let m = env.mount(&id, "m", MountOptions::default());
    let mp = m.mountpoint();
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(mp.join("tmp"))
        .unwrap();
    f.write_all(b"still here").unwrap();
    fs::remove_file(mp.join("tmp")).unwrap();
    assert!(!mp.join("tmp").exists());
    f.write_all(b"!").unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    let mut s = String::new();
    f.read_to_string(&mut s).unwrap();
    assert_eq!(s, "still here!");
    assert_eq!(f.metadata().unwrap().nlink(), 0);
    drop(f);
    // RELEASE reaches the server asynchronously after close.
    let t = std::time::Instant::now();
    while m.usage().inodes != 0 && t.elapsed() < std::time::Duration::from_secs(2) {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(m.usage().inodes, 0, "the unlinked inode is freed on close");

    fs::write(mp.join("orig"), b"1").unwrap();
    fs::hard_link(mp.join("orig"), mp.join("a/alias")).unwrap();
    let (a, b) = (
        fs::metadata(mp.join("orig")).unwrap(),
        fs::metadata(mp.join("a/alias")).unwrap(),
    );
    assert_eq!(a.ino(), b.ino());
    assert_eq!(a.nlink(), 2);
    fs::write(mp.join("a/alias"), b"2").unwrap();
    assert_eq!(fs::read(mp.join("orig")).unwrap(), b"2");
    fs::remove_file(mp.join("orig")).unwrap();
    assert_eq!(fs::metadata(mp.join("a/alias")).unwrap().nlink(), 1);
    let c = m.commit().unwrap();
    let out = env.path("out");
    env.store.export_dir(&c, &out).unwrap();
    assert_eq!(fs::read(out.join("a/alias")).unwrap(), b"2");
    let e = fs::hard_link(mp.join("a"), mp.join("dirlink")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM));
}

#[test]
fn append_truncate_sparse_fallocate() {
    if !fuse_available() {
        return;
    }
    let (env, id) = base_env();
    let m = env.mount(&id, "m", MountOptions::default());
    let mp = m.mountpoint();
    // O_APPEND from two handles.
    let mut a = OpenOptions::new()
        .append(true)
        .open(mp.join("small.txt"))
        .unwrap();
    let mut b = OpenOptions::new()
        .append(true)
        .open(mp.join("small.txt"))
        .unwrap();
    a.write_all(b"A").unwrap();
    b.write_all(b"B").unwrap();
    a.write_all(b"C").unwrap();
    drop((a, b));
    assert_eq!(
        fs::read(mp.join("small.txt")).unwrap(),
        b"hello nodefs\nABC"
    );

    // Truncate a base file down, then up: the hidden tail reads as zeros.
    let big = mp.join("a/big.bin");
    let orig = fs::read(env.path("src/a/big.bin")).unwrap();
    let f = OpenOptions::new().write(true).open(&big).unwrap();
    f.set_len(10_000).unwrap();
    f.set_len(20_000).unwrap();
    drop(f);
    let got = fs::read(&big).unwrap();
    assert_eq!(got.len(), 20_000);
    assert!(got[..10_000] == orig[..10_000]);
    assert!(got[10_000..].iter().all(|b| *b == 0));

    // Sparse file: a write far out; the gap reads as zeros and costs nothing.
    let mut s = File::create(mp.join("sparse")).unwrap();
    s.seek(SeekFrom::Start(100 << 20)).unwrap();
    s.write_all(b"end").unwrap();
    drop(s);
    let md = fs::metadata(mp.join("sparse")).unwrap();
    assert_eq!(md.len(), (100 << 20) + 3);
    assert!(m.usage().bytes < (1 << 20), "{:?}", m.usage());
    let mut s = File::open(mp.join("sparse")).unwrap();
    let mut buf = vec![1u8; 4096];
    s.seek(SeekFrom::Start(50 << 20)).unwrap();
    s.read_exact(&mut buf).unwrap();
    assert!(buf.iter().all(|b| *b == 0));

    // fallocate: extend, keep-size, punch hole.
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(mp.join("fa"))
        .unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    // SAFETY: fd is open.
    assert_eq!(unsafe { libc::fallocate(fd, 0, 0, 1 << 20) }, 0);
    assert_eq!(f.metadata().unwrap().len(), 1 << 20);
    // SAFETY: as above.
    let rc = unsafe { libc::fallocate(fd, libc::FALLOC_FL_KEEP_SIZE, 0, 2 << 20) };
    assert_eq!(rc, 0);
    assert_eq!(f.metadata().unwrap().len(), 1 << 20);
    drop(f);
    fs::write(mp.join("fa"), vec![7u8; 65536]).unwrap();
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(mp.join("fa"))
        .unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    // SAFETY: as above.
    let r = unsafe {
        libc::fallocate(
            fd,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            1000,
            10_000,
        )
    };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    drop(f);
    let got = fs::read(mp.join("fa")).unwrap();
    assert_eq!(got.len(), 65536);
    assert!(got[..1000].iter().all(|b| *b == 7));
    assert!(got[1000..11_000].iter().all(|b| *b == 0));
    assert!(got[11_000..].iter().all(|b| *b == 7));
}

#[test]
fn mmap_shared_writes_and_fsync() {
    if !fuse_available() {
        return;
    }
    let (env, id) = base_env();
    let m = env.mount(&id, "m", MountOptions::default());
    let p = m.mountpoint().join("a/b/mid.bin");
    let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    // SAFETY: mapping 8192 bytes of an open file, unmapped below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            8192,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            4096,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED);
    // SAFETY: ptr maps 8192 writable bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(b"MMAP!".as_ptr(), (ptr as *mut u8).add(10), 5);
        assert_eq!(libc::msync(ptr, 8192, libc::MS_SYNC), 0);
        libc::munmap(ptr, 8192);
    }
    f.sync_all().unwrap();
    drop(f);
    let got = fs::read(&p).unwrap();
    assert_eq!(&got[4106..4111], b"MMAP!");
    let c = m.commit().unwrap();
    let out = env.path("out");
    env.store.export_dir(&c, &out).unwrap();
    assert_eq!(
        &fs::read(out.join("a/b/mid.bin")).unwrap()[4106..4111],
        b"MMAP!"
    );

    // fsync and fdatasync alone (no msync) push a shared mapping's dirty pages into the mount's
    // upper storage: the bytes are then in the upper file itself (a file of 1 MiB or more has
    // its own, `<upper_dir>/<ino>`, at the same offsets).
    let big = m.mountpoint().join("a/big.bin");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&big)
        .unwrap();
    let upper = env
        .path("upper-m")
        .join(f.metadata().unwrap().ino().to_string());
    let at = 2u64 << 20;
    // SAFETY: mapping 8192 bytes of an open file, unmapped below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            8192,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&f),
            at as libc::off_t,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED);
    let upper_bytes = |off: u64| {
        let mut b = [0u8; 5];
        File::open(&upper)
            .unwrap()
            .read_exact_at(&mut b, off)
            .unwrap();
        b
    };
    // SAFETY: ptr maps 8192 writable bytes.
    unsafe { std::ptr::copy_nonoverlapping(b"FSYNC".as_ptr(), (ptr as *mut u8).add(10), 5) };
    f.sync_all().unwrap();
    assert_eq!(&upper_bytes(at + 10), b"FSYNC");
    // SAFETY: as above.
    unsafe { std::ptr::copy_nonoverlapping(b"FDATA".as_ptr(), (ptr as *mut u8).add(5000), 5) };
    f.sync_data().unwrap();
    assert_eq!(&upper_bytes(at + 5000), b"FDATA");
    // SAFETY: unmapping what was mapped above.
    unsafe { libc::munmap(ptr, 8192) };
}

/// Programs fsync what they only read and the directories they renamed into (git, dpkg, ...):
/// fsync and fdatasync succeed on read-only descriptors of base and upper files, and on
/// directories (base, new, the root).
#[test]
fn fsync_succeeds_on_read_only_files_and_directories() {
    if !fuse_available() {
        return;
    }
    let (env, id) = base_env();
    let m = env.mount(&id, "m", MountOptions::default());
    let mp = m.mountpoint();
    fs::create_dir(mp.join("newdir")).unwrap();
    fs::write(mp.join("newdir/f.tmp"), b"written").unwrap();
    fs::rename(mp.join("newdir/f.tmp"), mp.join("newdir/f")).unwrap();
    for p in [
        "small.txt",
        "a/big.bin",
        "newdir/f",
        "a",
        "a/b",
        "newdir",
        "",
    ] {
        let f = File::open(mp.join(p)).unwrap();
        f.sync_all().unwrap_or_else(|e| panic!("fsync {p:?}: {e}"));
        f.sync_data()
            .unwrap_or_else(|e| panic!("fdatasync {p:?}: {e}"));
    }
    let c = m.commit().unwrap();
    let out = env.path("out");
    env.store.export_dir(&c, &out).unwrap();
    assert_eq!(fs::read(out.join("newdir/f")).unwrap(), b"written");
    assert!(!out.join("newdir/f.tmp").exists());
}

#[test]
fn metadata_xattrs_statfs_special_files() {
    if !fuse_available() {
        return;
    }
    let (env, id) = base_env();
    let m = env.mount(
        &id,
        "m",
        MountOptions {
            quota_bytes: Some(64 << 20),
            quota_inodes: Some(1000),
            ..Default::default()
        },
    );
    let mp = m.mountpoint();
    let p = mp.join("small.txt");
    fs::set_permissions(&p, fs::Permissions::from_mode(0o4711)).unwrap();
    assert_eq!(fs::metadata(&p).unwrap().mode() & 0o7777, 0o4711);
    // chown clears setuid (the kernel asks for it), so set the mode again after.
    std::os::unix::fs::chown(&p, Some(1234), Some(5678)).unwrap();
    let md = fs::metadata(&p).unwrap();
    assert_eq!((md.uid(), md.gid()), (1234, 5678));
    assert_eq!(md.mode() & 0o7777, 0o711);
    fs::set_permissions(&p, fs::Permissions::from_mode(0o4711)).unwrap();
    let ts = [
        libc::timespec {
            tv_sec: 1_000_000,
            tv_nsec: 5,
        },
        libc::timespec {
            tv_sec: 2_000_000,
            tv_nsec: 7,
        },
    ];
    // SAFETY: valid path and timespec array.
    let rc = unsafe { libc::utimensat(libc::AT_FDCWD, c(&p).as_ptr(), ts.as_ptr(), 0) };
    assert_eq!(rc, 0);
    let md = fs::metadata(&p).unwrap();
    assert_eq!(
        (md.atime(), md.mtime(), md.mtime_nsec()),
        (1_000_000, 2_000_000, 7)
    );

    // xattrs: base value, set, list, remove, create/replace flags.
    let mut buf = [0u8; 64];
    // SAFETY: valid strings and buffer.
    let n = unsafe {
        libc::getxattr(
            c(&p).as_ptr(),
            c"user.k".as_ptr(),
            buf.as_mut_ptr().cast(),
            64,
        )
    };
    assert_eq!(&buf[..n as usize], b"v");
    // SAFETY: as above.
    unsafe {
        assert_eq!(
            libc::setxattr(
                c(&p).as_ptr(),
                c"user.new".as_ptr(),
                b"xyz".as_ptr().cast(),
                3,
                0
            ),
            0
        );
        assert_eq!(
            libc::setxattr(
                c(&p).as_ptr(),
                c"user.new".as_ptr(),
                b"xyz".as_ptr().cast(),
                3,
                libc::XATTR_CREATE
            ),
            -1
        );
        let n = libc::listxattr(c(&p).as_ptr(), buf.as_mut_ptr().cast(), 64);
        assert_eq!(&buf[..n as usize], b"user.k\0user.new\0");
        assert_eq!(libc::removexattr(c(&p).as_ptr(), c"user.k".as_ptr()), 0);
        assert_eq!(
            libc::getxattr(
                c(&p).as_ptr(),
                c"user.k".as_ptr(),
                buf.as_mut_ptr().cast(),
                64
            ),
            -1
        );
    }

    // statfs reflects the quota.
    // SAFETY: zeroed statvfs is a valid out-parameter.
    let mut sv: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out pointer.
    assert_eq!(unsafe { libc::statvfs(c(mp).as_ptr(), &mut sv) }, 0);
    assert_eq!(sv.f_blocks * sv.f_frsize, 64 << 20);
    assert_eq!(sv.f_files, 1000);

    // fifo, device node, unix socket bound on the mount.
    // SAFETY: valid path.
    let rc = unsafe { libc::mkfifo(c(&mp.join("pipe")).as_ptr(), 0o600) };
    assert_eq!(rc, 0);
    assert!(fs::metadata(mp.join("pipe")).unwrap().file_type().is_fifo());
    // SAFETY: valid path.
    let rc = unsafe {
        libc::mknod(
            c(&mp.join("null")).as_ptr(),
            libc::S_IFCHR | 0o666,
            libc::makedev(1, 3),
        )
    };
    assert_eq!(rc, 0);
    // Made and listed, but the mount is nodev: it does not open (issue 24).
    let err = fs::write(mp.join("null"), b"discarded").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EACCES), "{err}");
    assert_eq!(
        fs::metadata(mp.join("null")).unwrap().rdev(),
        libc::makedev(1, 3)
    );
    let sock = mp.join("ctl.sock");
    let l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.write_all(b"pong").unwrap();
    });
    let mut cl = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    let mut got = String::new();
    cl.read_to_string(&mut got).unwrap();
    t.join().unwrap();
    assert_eq!(got, "pong");
    assert!(fs::metadata(&sock).unwrap().file_type().is_socket());

    // Metadata survives a commit.
    let cm = m.commit().unwrap();
    let out = env.path("out");
    env.store.export_dir(&cm, &out).unwrap();
    let md = fs::metadata(out.join("small.txt")).unwrap();
    assert_eq!(
        (md.mode() & 0o7777, md.uid(), md.gid(), md.mtime()),
        (0o4711, 1234, 5678, 2_000_000)
    );
    assert!(fs::symlink_metadata(out.join("ctl.sock"))
        .unwrap()
        .file_type()
        .is_socket());
}

/// fuser 0.18 has no FUSE_TMPFILE (opcode 51): it answers ENOSYS, which the kernel turns into
/// EOPNOTSUPP for open(O_TMPFILE), the error on which callers (glibc's tmpfile(), ...) fall back
/// to create + unlink while open. Both halves are checked: the refusal is exactly EOPNOTSUPP
/// and leaves nothing behind, and the fallback works.
#[test]
fn o_tmpfile_is_refused_with_eopnotsupp_and_the_unlinked_file_fallback_works() {
    if !fuse_available() {
        return;
    }
    let (env, id) = base_env();
    let m = env.mount(&id, "m", MountOptions::default());
    let dir = m.mountpoint().join("a");
    let listing = || {
        let mut v: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        v.sort();
        v
    };
    let before = listing();
    // The second try is answered by the kernel alone (it remembers the server lacks it).
    for attempt in 0..2 {
        let e = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_TMPFILE)
            .mode(0o600)
            .open(&dir)
            .expect_err("O_TMPFILE needs FUSE_TMPFILE, which fuser 0.18 lacks");
        assert_eq!(
            e.raw_os_error(),
            Some(libc::EOPNOTSUPP),
            "attempt {attempt}: {e}"
        );
    }
    assert_eq!(listing(), before, "a refused O_TMPFILE leaves nothing");
    // The fallback: a fresh name, unlinked at once, used through the descriptor.
    let p = dir.join("tmp.Xq3v9z");
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&p)
        .unwrap();
    fs::remove_file(&p).unwrap();
    assert!(!p.exists());
    assert_eq!(listing(), before);
    let data = random_bytes(3, 300_000);
    f.write_all(&data).unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    let mut back = Vec::new();
    f.read_to_end(&mut back).unwrap();
    assert!(back == data, "an unlinked file reads back what was written");
    let st = f.metadata().unwrap();
    assert_eq!((st.nlink(), st.len()), (0, data.len() as u64));
    // A commit while it is still open does not see it, nor does the tree after close.
    let c = m.commit().unwrap();
    let out = env.path("out");
    env.store.export_dir(&c, &out).unwrap();
    assert!(!out.join("a/tmp.Xq3v9z").exists());
    drop(f);
    assert_eq!(listing(), before);
}

#[test]
fn read_only_mount_refuses_writes() {
    if !fuse_available() {
        return;
    }
    let (env, id) = base_env();
    let m = env.mount(
        &id,
        "m",
        MountOptions {
            read_only: true,
            ..Default::default()
        },
    );
    let e = fs::write(m.mountpoint().join("new"), b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS));
    assert_eq!(
        fs::read(m.mountpoint().join("small.txt")).unwrap(),
        b"hello nodefs\n"
    );
}

#[test]
fn passthrough_reads_then_writes() {
    if !fuse_available() {
        return;
    }
    // Passthrough is for executables, shared libraries and large files.
    let env = Env::new();
    let src = env.path("src");
    make_tree(&src, 42);
    fs::set_permissions(src.join("a/b/mid.bin"), fs::Permissions::from_mode(0o755)).unwrap();
    fs::rename(src.join("a/big.bin"), src.join("a/libbig.so.1")).unwrap();
    let id = env.store.import_dir(&src).unwrap();
    let m = env.mount(&id, "m", MountOptions::default());
    let p = m.mountpoint().join("a/b/mid.bin");
    let want = fs::read(env.path("src/a/b/mid.bin")).unwrap();
    // Two readers share one backing file.
    let mut r1 = File::open(&p).unwrap();
    let mut r2 = File::open(&p).unwrap();
    let (mut b1, mut b2) = (Vec::new(), Vec::new());
    r1.read_to_end(&mut b1).unwrap();
    r2.read_to_end(&mut b2).unwrap();
    assert!(b1 == want && b2 == want);
    // An ordinary file is served by the server: no whole-file object for it.
    assert_eq!(
        fs::read(m.mountpoint().join("small.txt")).unwrap(),
        b"hello nodefs\n"
    );
    let cache: Vec<_> = fs::read_dir(env.path("store/cache"))
        .unwrap()
        .flatten()
        .collect();
    assert_eq!(
        cache.len(),
        1,
        "one whole-file object materialized for passthrough"
    );
    assert!(fs::read(cache[0].path()).unwrap() == want);
    assert!(env.store.fsck().unwrap().cache_removed.is_empty());
    drop((r1, r2));
    // Writing right after the readers closed works and is seen by new readers.
    let mut w = OpenOptions::new().write(true).open(&p).unwrap();
    w.write_all(b"W").unwrap();
    drop(w);
    let got = fs::read(&p).unwrap();
    assert_eq!(got[0], b'W');
    assert!(got[1..] == want[1..]);
    // A damaged cache object is found by fsck and dropped, never served later.
    let obj = cache[0].path();
    let mut bytes = fs::read(&obj).unwrap();
    bytes[10] ^= 1;
    fs::write(&obj, &bytes).unwrap();
    assert_eq!(env.store.fsck().unwrap().cache_removed, vec![obj.clone()]);
    assert!(!obj.exists());
    // mmap of a passthrough file reads the same bytes.
    let f = File::open(m.mountpoint().join("a/libbig.so.1")).unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    // SAFETY: read-only private mapping of 4096 bytes of an open file, unmapped below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED);
    // SAFETY: ptr maps 4096 readable bytes.
    let first = unsafe { std::slice::from_raw_parts(ptr as *const u8, 4096).to_vec() };
    // SAFETY: unmapping what was mapped above.
    unsafe { libc::munmap(ptr, 4096) };
    assert!(first[..] == fs::read(env.path("src/a/libbig.so.1")).unwrap()[..4096]);
}

/// Pages of `path` in the page cache: mincore over a read-only mapping (mapping faults nothing in).
fn resident_pages(path: &Path) -> usize {
    let f = File::open(path).unwrap();
    let len = f.metadata().unwrap().len() as usize;
    assert!(len > 0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    // SAFETY: a read-only shared mapping of the whole open file, never dereferenced, unmapped below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED);
    let mut vec = vec![0u8; len.div_ceil(page)];
    // SAFETY: ptr maps len bytes; vec holds one byte per page of them.
    let r = unsafe { libc::mincore(ptr, len, vec.as_mut_ptr()) };
    let err = std::io::Error::last_os_error();
    // SAFETY: unmapping what was mapped above.
    unsafe { libc::munmap(ptr, len) };
    assert_eq!(r, 0, "mincore {}: {err}", path.display());
    vec.iter().filter(|b| **b & 1 == 1).count()
}

/// Drop `path`'s pages from the page cache (synced first, so they are clean and go).
fn evict(path: &Path) {
    let f = File::open(path).unwrap();
    f.sync_all().unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    // SAFETY: an advice call on an open descriptor; no memory is passed.
    let r = unsafe { libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(r, 0, "posix_fadvise");
    assert_eq!(resident_pages(path), 0, "{} evicted", path.display());
}

#[test]
fn passthrough_off_mount_serves_reads_without_a_backing_file() {
    if !fuse_available() {
        return;
    }
    // A large file (64 MiB or more) passes through on a default mount whatever its mode.
    let env = Env::new();
    let src = env.path("src");
    fs::create_dir_all(&src).unwrap();
    let want = random_bytes(11, (64 << 20) + 12_345);
    fs::write(src.join("big.img"), &want).unwrap();
    let id = env.store.import_dir(&src).unwrap();
    let on = env.mount(&id, "on", MountOptions::default());
    let off = env.mount(
        &id,
        "off",
        MountOptions {
            passthrough: false,
            ..Default::default()
        },
    );
    // Its whole-file object is made at import, or in the background by a first open.
    drop(File::open(on.mountpoint().join("big.img")).unwrap());
    let cache = env.path("store/cache");
    let t = std::time::Instant::now();
    let obj = loop {
        let done = fs::read_dir(&cache).ok().and_then(|d| {
            d.flatten()
                .find(|e| !e.file_name().to_string_lossy().contains(".tmp"))
        });
        if let Some(e) = done {
            break e.path();
        }
        assert!(t.elapsed().as_secs() < 20, "whole-file object made");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(fs::read(&obj).unwrap() == want);
    // A passthrough read goes through the backing file, so the object's pages come into the
    // page cache; a read the server serves comes from the store's chunks and leaves them out.
    // A reader holding a backing file also keeps writers out (ETXTBSY); a served one does not.
    let check = |mp: &Path, passthrough: bool| {
        let p = mp.join("big.img");
        evict(&obj);
        let mut r = File::open(&p).unwrap();
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        assert!(got == want, "{}: the file's bytes", p.display());
        let resident = resident_pages(&obj);
        let w = OpenOptions::new().append(true).open(&p);
        if passthrough {
            assert!(
                resident > 0,
                "{}: read through the backing file",
                p.display()
            );
            assert_eq!(
                w.unwrap_err().raw_os_error(),
                Some(libc::ETXTBSY),
                "{}: a passthrough reader keeps writers out",
                p.display()
            );
        } else {
            assert_eq!(resident, 0, "{}: no backing file read", p.display());
            drop(w.expect("a served reader lets a writer in"));
        }
        drop(r);
    };
    check(off.mountpoint(), false);
    check(on.mountpoint(), true);
    // The option is the mount's own: the other mount of the same store still serves.
    check(off.mountpoint(), false);
}

#[test]
fn changing_one_hard_link_updates_unvisited_directories_on_commit() {
    if !fuse_available() {
        return;
    }
    let (env, id) = base_env();
    let m = env.mount(&id, "m", MountOptions::default());
    // a/b (holding the other link) is never looked up in this mount.
    fs::write(m.mountpoint().join("small.txt"), b"changed via one link").unwrap();
    let c = m.commit().unwrap();
    let out = env.path("out");
    env.store.export_dir(&c, &out).unwrap();
    assert_eq!(
        fs::read(out.join("a/b/hard.txt")).unwrap(),
        b"changed via one link"
    );
    assert_eq!(
        fs::metadata(out.join("small.txt")).unwrap().ino(),
        fs::metadata(out.join("a/b/hard.txt")).unwrap().ino()
    );
}

#[test]
fn missing_names_appear_once_created() {
    if !fuse_available() {
        return;
    }
    // The kernel caches "no such name" replies; every way of making the name must show.
    let (env, id) = base_env();
    let m = env.mount(&id, "m", MountOptions::default());
    let mp = m.mountpoint();
    for n in ["f", "d", "l", "s", "r", "t"] {
        assert_eq!(
            fs::metadata(mp.join(n)).unwrap_err().raw_os_error(),
            Some(libc::ENOENT)
        );
    }
    fs::write(mp.join("f"), b"x").unwrap();
    fs::create_dir(mp.join("d")).unwrap();
    fs::hard_link(mp.join("small.txt"), mp.join("l")).unwrap();
    std::os::unix::fs::symlink("small.txt", mp.join("s")).unwrap();
    fs::write(mp.join("tmp"), b"y").unwrap();
    fs::rename(mp.join("tmp"), mp.join("r")).unwrap();
    File::create(mp.join("t")).unwrap();
    for n in ["f", "d", "l", "s", "r", "t"] {
        assert!(fs::symlink_metadata(mp.join(n)).is_ok(), "{n} is found");
    }
    assert_eq!(fs::read(mp.join("r")).unwrap(), b"y");
    assert_eq!(fs::read(mp.join("s")).unwrap(), b"hello nodefs\n");
    fs::remove_file(mp.join("f")).unwrap();
    assert!(fs::metadata(mp.join("f")).is_err());
    fs::write(mp.join("f"), b"again").unwrap();
    assert_eq!(fs::read(mp.join("f")).unwrap(), b"again");
}

/// A directory's tree entries become inodes one at a time (on lookup), so a mount that only
/// looked up, changed, removed and added a few names of a large directory must still list
/// and commit all of them, each once, in name order.
#[test]
fn a_partly_looked_up_directory_lists_and_commits_whole() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let src = env.path("src");
    fs::create_dir_all(src.join("big")).unwrap();
    for i in 0..300 {
        fs::write(src.join(format!("big/f{i:03}")), format!("{i}")).unwrap();
    }
    let id = env.store.import_dir(&src).unwrap();
    let m = env.mount(&id, "m", MountOptions::default());
    let big = m.mountpoint().join("big");
    assert_eq!(fs::read(big.join("f007")).unwrap(), b"7");
    fs::write(big.join("f150"), b"changed").unwrap();
    fs::remove_file(big.join("f299")).unwrap();
    fs::write(big.join("g000"), b"new").unwrap();
    let mut want: Vec<String> = (0..299).map(|i| format!("f{i:03}")).collect();
    want.push("g000".into());
    // readdir order, not sorted by the test: tree entries in name order, new names after.
    let listed: Vec<String> = fs::read_dir(&big)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(listed, want);
    assert_eq!(
        fs::metadata(big.join("f007")).unwrap().ino(),
        fs::read_dir(&big)
            .unwrap()
            .map(|e| e.unwrap())
            .find(|e| e.file_name() == "f007")
            .unwrap()
            .ino(),
        "a name looked up before the listing keeps its inode number"
    );
    let out = env.path("out");
    env.store.export_dir(&m.commit().unwrap(), &out).unwrap();
    let mut committed: Vec<String> = fs::read_dir(out.join("big"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    committed.sort();
    assert_eq!(committed, want);
    assert_eq!(fs::read(out.join("big/f150")).unwrap(), b"changed");
    assert_eq!(fs::read(out.join("big/f298")).unwrap(), b"298");
}

/// Set a valid file capability (v2: cap_net_bind_service permitted).
fn set_file_caps(p: &Path) {
    let mut v = Vec::new();
    for w in [0x0200_0000u32, 1 << 10, 0, 0, 0] {
        v.extend_from_slice(&w.to_le_bytes());
    }
    let name = CString::new("security.capability").unwrap();
    // SAFETY: valid path, name and value buffer.
    let rc = unsafe { libc::setxattr(c(p).as_ptr(), name.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
    assert_eq!(rc, 0, "setxattr: {}", std::io::Error::last_os_error());
}

/// Permission bits and whether file capabilities are present.
fn privs(p: &Path) -> (u32, bool) {
    let name = CString::new("security.capability").unwrap();
    // SAFETY: valid path and name; a null buffer of size 0 asks for the size.
    let n = unsafe { libc::getxattr(c(p).as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0) };
    (fs::metadata(p).unwrap().mode() & 0o7777, n > 0)
}

/// Run `sh -c script` on `p` as root without CAP_FSETID.
fn without_fsetid(script: &str, p: &Path) {
    let st = std::process::Command::new("setpriv")
        .args(["--bounding-set=-fsetid", "--", "sh", "-c", script, "sh"])
        .arg(p)
        .status()
        .unwrap();
    assert!(st.success(), "{script}");
}

/// What the privilege tests compare: a writable mount of the base image and a directory on
/// the host's own filesystem; None (said loudly) without setpriv, which they run steps under.
fn privilege_env() -> Option<(Env, MountGuard, PathBuf)> {
    if std::process::Command::new("setpriv")
        .arg("--version")
        .output()
        .is_err()
    {
        capability_missing("setpriv (util-linux) is not installed");
        return None;
    }
    let (env, id) = base_env();
    let m = env.mount(&id, "m", MountOptions::default());
    let native = env.path("native");
    fs::create_dir(&native).unwrap();
    Some((env, m, native))
}

/// Writes, truncates and chowns drop setuid/setgid and file capabilities exactly as on the
/// host's own filesystem (the server does it: FUSE_HANDLE_KILLPRIV_V2).
#[test]
fn writes_truncates_and_chowns_drop_privileges_like_linux() {
    if !fuse_available() {
        return;
    }
    let Some((_env, m, native)) = privilege_env() else {
        return;
    };
    type Step = fn(&Path);
    let steps: [(&str, Step); 9] = [
        ("root write", |p| {
            OpenOptions::new()
                .append(true)
                .open(p)
                .unwrap()
                .write_all(b"a")
                .unwrap()
        }),
        ("write without CAP_FSETID", |p| {
            without_fsetid("printf b >> \"$1\"", p)
        }),
        ("root truncate", |p| {
            OpenOptions::new()
                .write(true)
                .open(p)
                .unwrap()
                .set_len(1)
                .unwrap()
        }),
        ("truncate without CAP_FSETID", |p| {
            without_fsetid("truncate -s 3 \"$1\"", p)
        }),
        ("root open(O_TRUNC)", |p| {
            OpenOptions::new()
                .write(true)
                .truncate(true)
                .open(p)
                .unwrap();
        }),
        ("open(O_TRUNC) without CAP_FSETID", |p| {
            without_fsetid(": > \"$1\"", p)
        }),
        ("chown", |p| {
            std::os::unix::fs::chown(p, Some(7), Some(8)).unwrap()
        }),
        ("chown to the same owner", |p| {
            std::os::unix::fs::chown(p, Some(7), Some(8)).unwrap()
        }),
        ("read", |p| drop(fs::read(p).unwrap())),
    ];
    for mode in [0o6755, 0o6745, 0o4700, 0o2644] {
        for (what, step) in &steps {
            let mut seen = Vec::new();
            for dir in [native.as_path(), m.mountpoint()] {
                let p = dir.join(format!("f{mode:o}"));
                fs::write(&p, b"data").unwrap();
                fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
                set_file_caps(&p);
                assert_eq!(privs(&p), (mode, true));
                step(&p);
                seen.push(privs(&p));
                fs::remove_file(&p).unwrap();
            }
            assert_eq!(
                seen[1], seen[0],
                "mode {mode:o}, {what}: nodefs (mode, caps) differ from the host's"
            );
        }
    }
}

/// A file created write-only is written direct (FOPEN_DIRECT_IO), where the kernel leaves every
/// privilege drop to the server: its writes drop setuid/setgid (without CAP_FSETID) and file
/// capabilities exactly as the host's own filesystem does.
#[test]
fn writes_to_a_file_created_write_only_drop_privileges_like_linux() {
    if !fuse_available() {
        return;
    }
    let Some((env, m, native)) = privilege_env() else {
        return;
    };
    // Create write-only, set the mode and a file capability, write through the same descriptor.
    let script = env.path("create-write.py");
    fs::write(
        &script,
        "import os, struct, sys\n\
         p, mode = sys.argv[1], int(sys.argv[2], 8)\n\
         fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)\n\
         os.fchmod(fd, mode)\n\
         os.setxattr(p, 'security.capability', struct.pack('<5I', 0x02000000, 1 << 10, 0, 0, 0))\n\
         os.write(fd, b'x')\n\
         os.close(fd)\n",
    )
    .unwrap();
    for mode in [0o6755, 0o6745, 0o4700, 0o2644] {
        for fsetid in [true, false] {
            let mut seen = Vec::new();
            for dir in [native.as_path(), m.mountpoint()] {
                let p = dir.join(format!("c{mode:o}"));
                let mut cmd = std::process::Command::new("setpriv");
                if !fsetid {
                    cmd.arg("--bounding-set=-fsetid");
                }
                let st = cmd
                    .args(["--", "python3"])
                    .arg(&script)
                    .arg(&p)
                    .arg(format!("{mode:o}"))
                    .status()
                    .unwrap();
                assert!(st.success());
                seen.push(privs(&p));
                fs::remove_file(&p).unwrap();
            }
            assert_eq!(
                seen[1], seen[0],
                "mode {mode:o}, CAP_FSETID {fsetid}: nodefs (mode, caps) differ from the host's"
            );
        }
    }
}

/// A directory changed between getdents batches: every entry present throughout is listed
/// exactly once, and no entry twice (listing cookies stay fixed while entries exist).
#[test]
fn listing_a_directory_while_it_changes() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let id = env.empty();
    let m = env.mount(&id, "m", MountOptions::default());
    let d = m.mountpoint().join("d");
    fs::create_dir(&d).unwrap();
    // Long names: one getdents buffer holds a few hundred, so the listing takes many.
    let pad = "x".repeat(100);
    let keep: Vec<String> = (0..1500).map(|i| format!("keep-{i:04}-{pad}")).collect();
    let doomed: Vec<String> = (0..1500).map(|i| format!("doomed-{i:04}-{pad}")).collect();
    for n in keep.iter().chain(&doomed) {
        File::create(d.join(n)).unwrap();
    }
    for round in 0..2 {
        let mut seen = std::collections::HashMap::<String, usize>::new();
        let mut changes = 0;
        for (k, e) in fs::read_dir(&d).unwrap().enumerate() {
            *seen
                .entry(e.unwrap().file_name().into_string().unwrap())
                .or_default() += 1;
            if k % 50 == 49 {
                for _ in 0..3 {
                    let _ = fs::remove_file(d.join(&doomed[changes % doomed.len()]));
                    File::create(d.join(format!("new-{round}-{changes}"))).unwrap();
                    changes += 1;
                }
            }
        }
        assert!(
            changes > 100,
            "the listing took too few batches to test anything"
        );
        for n in &keep {
            assert_eq!(seen.get(n), Some(&1), "round {round}: {n} listed wrongly");
        }
        for (n, c) in &seen {
            assert_eq!(*c, 1, "round {round}: {n} listed {c} times");
        }
    }
}

/// A large file gets its whole-file object at import, so even its first open passes through
/// (seen from outside: a writer meets ETXTBSY while that first reader is open).
#[test]
fn large_files_pass_through_from_the_first_open() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let src = env.path("src");
    fs::create_dir_all(&src).unwrap();
    let want = random_bytes(7, 64 << 20);
    fs::write(src.join("large.bin"), &want).unwrap();
    fs::write(src.join("small.bin"), &want[..1 << 20]).unwrap();
    let id = env.store.import_dir(&src).unwrap();
    let cache: Vec<_> = fs::read_dir(env.path("store/cache"))
        .unwrap()
        .flatten()
        .collect();
    assert_eq!(cache.len(), 1, "one whole-file object, for the large file");
    assert!(fs::read(cache[0].path()).unwrap() == want);
    assert!(env.store.fsck().unwrap().cache_removed.is_empty());
    let m = env.mount(&id, "m", MountOptions::default());
    let p = m.mountpoint().join("large.bin");
    let mut r = File::open(&p).unwrap();
    let err = OpenOptions::new().write(true).open(&p).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ETXTBSY));
    let mut got = Vec::new();
    r.read_to_end(&mut got).unwrap();
    assert!(got == want);
}

/// A chain of commits in one mount stores about what changed since the previous commit,
/// not everything that differs from the base (deltas against the last commit's chunks).
#[test]
fn each_commit_in_a_chain_stores_what_changed_since_the_last() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let src = env.path("src");
    fs::create_dir_all(&src).unwrap();
    fs::write(src.join("data.bin"), random_bytes(3, 4 << 20)).unwrap();
    let id = env.store.import_dir(&src).unwrap();
    let m = env.mount(&id, "m", MountOptions::default());
    let f = OpenOptions::new()
        .write(true)
        .open(m.mountpoint().join("data.bin"))
        .unwrap();
    let mut offsets = random_bytes(9, 6 * 16).into_iter();
    for round in 0..6 {
        // 16 writes of 4 KiB at random block offsets: 64 KiB changed.
        for _ in 0..16 {
            let block = offsets.next().unwrap() as u64 * 4;
            f.write_all_at(&random_bytes(round * 100 + block, 4096), block * 4096)
                .unwrap();
        }
        let before = env.store.stats().stored_bytes;
        m.commit().unwrap();
        let added = env.store.stats().stored_bytes - before;
        assert!(
            added < 3 * 64 * 1024,
            "commit {round} stored {added} bytes for 64 KiB of changes"
        );
    }
}

/// Issue 25, item 2: one byte flipped in `store/cache/<id>` (the whole-file copy of
/// /usr/bin/ls) made `ls --help` print `Usagf:` in new sandboxes. The byte is flipped the way
/// a bad disk or a careless hand would, keeping the size and putting the mtime back, and
/// new opens (in a new mount and in the mount that made the copy) still run the right bytes:
/// the copy is checked against the chunks' ids before the kernel gets it, and rebuilt.
#[test]
fn a_damaged_passthrough_cache_file_is_never_served() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let src = env.path("src");
    fs::create_dir_all(&src).unwrap();
    fs::copy("/usr/bin/ls", src.join("ls")).unwrap();
    fs::set_permissions(src.join("ls"), fs::Permissions::from_mode(0o755)).unwrap();
    let want = fs::read(src.join("ls")).unwrap();
    let id = env.store.import_dir(&src).unwrap();
    let run_help = |mp: &Path| {
        let out = std::process::Command::new(mp.join("ls"))
            .arg("--help")
            .env("LC_ALL", "C")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let m1 = env.mount(&id, "m1", MountOptions::default());
    assert!(run_help(m1.mountpoint()).starts_with("Usage:"));
    let cache: Vec<_> = fs::read_dir(env.path("store/cache"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(cache.len(), 1, "the exec went through a whole-file object");
    let obj = &cache[0];
    assert!(fs::read(obj).unwrap() == want);
    // Flip the 'e' of "Usage:" in place and put the times back.
    let at = want.windows(6).position(|w| w == b"Usage:").unwrap() + 4;
    let meta = fs::metadata(obj).unwrap();
    let f = OpenOptions::new().write(true).open(obj).unwrap();
    f.write_all_at(b"f", at as u64).unwrap();
    f.sync_all().unwrap();
    let times = [
        libc::timespec {
            tv_sec: meta.atime(),
            tv_nsec: meta.atime_nsec(),
        },
        libc::timespec {
            tv_sec: meta.mtime(),
            tv_nsec: meta.mtime_nsec(),
        },
    ];
    // SAFETY: valid fd and a two-element timespec array.
    let rc = unsafe { libc::futimens(std::os::fd::AsRawFd::as_raw_fd(&f), times.as_ptr()) };
    assert_eq!(rc, 0);
    drop(f);
    let flipped = fs::metadata(obj).unwrap();
    assert_eq!(
        (flipped.len(), flipped.mtime(), flipped.mtime_nsec()),
        (meta.len(), meta.mtime(), meta.mtime_nsec()),
        "size and mtime as before"
    );
    // A new sandbox on the same image.
    let m2 = env.mount(&id, "m2", MountOptions::default());
    let help = run_help(m2.mountpoint());
    assert!(
        help.starts_with("Usage:"),
        "{}",
        &help[..40.min(help.len())]
    );
    assert!(fs::read(m2.mountpoint().join("ls")).unwrap() == want);
    // The copy was rebuilt (or dropped), never left damaged.
    assert!(
        fs::read(obj).map(|b| b == want).unwrap_or(true),
        "cache object still damaged"
    );
    // The mount that made the copy, on its next open, too.
    let f = OpenOptions::new().write(true).open(obj);
    if let Ok(f) = f {
        f.write_all_at(b"f", at as u64).unwrap();
    }
    assert!(run_help(m1.mountpoint()).starts_with("Usage:"));
    assert!(fs::read(m1.mountpoint().join("ls")).unwrap() == want);
    assert!(env.store.fsck().unwrap().cache_removed.is_empty());
}

/// The same for a file big enough to be checked and rebuilt in the background (over 16 MiB):
/// while the copy is not known good, opens are served by the server, never from the copy.
#[test]
fn a_damaged_large_passthrough_cache_file_is_never_served() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let src = env.path("src");
    fs::create_dir_all(&src).unwrap();
    let want = random_bytes(77, 20 << 20);
    fs::write(src.join("libbig.so.1"), &want).unwrap();
    let id = env.store.import_dir(&src).unwrap();
    let cache_dir = env.path("store/cache");
    let object = || -> Option<std::path::PathBuf> {
        fs::read_dir(&cache_dir)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| !p.to_string_lossy().contains(".tmp"))
    };
    let wait_for = |what: &str, ok: &dyn Fn() -> bool| {
        let t = std::time::Instant::now();
        while !ok() {
            assert!(t.elapsed() < std::time::Duration::from_secs(20), "{what}");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    let m1 = env.mount(&id, "m1", MountOptions::default());
    let p1 = m1.mountpoint().join("libbig.so.1");
    assert!(fs::read(&p1).unwrap() == want);
    wait_for("object built in the background", &|| {
        object().is_some_and(|o| fs::read(o).is_ok_and(|b| b == want))
    });
    let obj = object().unwrap();
    let meta = fs::metadata(&obj).unwrap();
    let f = OpenOptions::new().write(true).open(&obj).unwrap();
    f.write_all_at(&[want[12345] ^ 0xff], 12345).unwrap();
    let times = [
        libc::timespec {
            tv_sec: meta.atime(),
            tv_nsec: meta.atime_nsec(),
        },
        libc::timespec {
            tv_sec: meta.mtime(),
            tv_nsec: meta.mtime_nsec(),
        },
    ];
    // SAFETY: valid fd and a two-element timespec array.
    let rc = unsafe { libc::futimens(std::os::fd::AsRawFd::as_raw_fd(&f), times.as_ptr()) };
    assert_eq!(rc, 0);
    drop(f);
    let m2 = env.mount(&id, "m2", MountOptions::default());
    let p2 = m2.mountpoint().join("libbig.so.1");
    assert!(fs::read(&p2).unwrap() == want, "damaged copy served");
    wait_for("object rebuilt", &|| {
        object().is_some_and(|o| fs::read(o).is_ok_and(|b| b == want))
    });
    assert!(fs::read(&p2).unwrap() == want);
    assert!(fs::read(&p1).unwrap() == want);
}
