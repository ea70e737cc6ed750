//! How many FUSE requests fixed workloads send to a nodefs mount, counted by the kernel's
//! `fuse:fuse_request_send` tracepoint in a private trace instance filtered to the mount's
//! connection (root + tracefs). Each bound is what a round trip nodefs removes (or never
//! sends) would break: docs/nodefs-format.md, "Where a mount's requests go".

mod common;

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use common::*;
use nodefs::MountOptions;

const TRACING: &str = "/sys/kernel/tracing";

/// Requests of one connection, by opcode name (`FUSE_LOOKUP`, ...), while it is alive.
struct Census {
    instance: PathBuf,
}

impl Census {
    /// Starts counting the requests of the FUSE mount at `mountpoint`, or None (after
    /// [`capability_missing`]) where tracefs or the fuse tracepoints are missing.
    fn start(mountpoint: &Path) -> Option<Census> {
        if !Path::new(TRACING).join("events/fuse").exists() {
            let _ = std::process::Command::new("mount")
                .args(["-t", "tracefs", "nodev", TRACING])
                .status();
        }
        if !Path::new(TRACING)
            .join("events/fuse/fuse_request_send")
            .exists()
        {
            capability_missing("no fuse:fuse_request_send tracepoint (tracefs, CONFIG_FUSE_FS)");
            return None;
        }
        static N: AtomicUsize = AtomicUsize::new(0);
        let instance = Path::new(TRACING).join(format!(
            "instances/nodefs-requests-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir(&instance).unwrap();
        let census = Census { instance };
        let dev = fs::metadata(mountpoint).unwrap().dev();
        let minor = (dev & 0xff) | ((dev >> 12) & 0xfff00);
        // Room for every request of a test's workload (a full buffer overwrites the oldest).
        fs::write(census.instance.join("buffer_size_kb"), "8192").unwrap();
        let ev = census.instance.join("events/fuse/fuse_request_send");
        fs::write(ev.join("filter"), format!("connection == {minor}")).unwrap();
        fs::write(ev.join("enable"), "1").unwrap();
        Some(census)
    }

    /// The requests sent since [`Census::start`] or the last call, by opcode.
    fn take(&self) -> BTreeMap<String, usize> {
        let trace = fs::read_to_string(self.instance.join("trace")).unwrap();
        fs::write(self.instance.join("trace"), "").unwrap();
        let header = trace
            .lines()
            .find_map(|l| l.strip_prefix("# entries-in-buffer/entries-written: "))
            .and_then(|l| l.split_whitespace().next())
            .unwrap_or_default();
        let (kept, written) = header.split_once('/').unwrap_or_default();
        assert_eq!(kept, written, "the trace buffer overflowed: {header}");
        let mut by_op = BTreeMap::new();
        for line in trace.lines().filter(|l| !l.starts_with('#')) {
            if let Some(op) = line
                .split(['(', ')'])
                .find(|w| w.starts_with("FUSE_") || w.starts_with("CUSE_"))
            {
                *by_op.entry(op.to_string()).or_insert(0) += 1;
            }
        }
        by_op
    }
}

impl Drop for Census {
    fn drop(&mut self) {
        let ev = self.instance.join("events/fuse/fuse_request_send");
        let _ = fs::write(ev.join("enable"), "0");
        let _ = fs::remove_dir(&self.instance);
    }
}

fn count(by_op: &BTreeMap<String, usize>, op: &str) -> usize {
    by_op.get(op).copied().unwrap_or(0)
}

/// Rewriting an existing file with open(O_TRUNC) is one OPEN: the truncation rides on it
/// (FUSE_ATOMIC_O_TRUNC) instead of a SETATTR before it. The file is empty then, whatever the
/// access mode, and its mtime moves.
#[test]
fn an_open_with_o_trunc_truncates_without_a_setattr() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let id = env.empty();
    let m = env.mount(&id, "m", MountOptions::default());
    let p = m.mountpoint().join("f");
    fs::write(&p, b"original contents").unwrap();
    // One rewrite first: a file created write-only was written direct, so the kernel has not yet
    // checked it for security.capability (`S_NOSEC`); the first cached write does, once.
    fs::write(&p, b"original contents").unwrap();
    let Some(census) = Census::start(m.mountpoint()) else {
        return;
    };
    let n = 20;
    for i in 0..n {
        let mut f = OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&p)
            .unwrap();
        f.write_all(i.to_string().as_bytes()).unwrap();
    }
    let by_op = census.take();
    assert_eq!(fs::read_to_string(&p).unwrap(), format!("{}", n - 1));
    assert_eq!(count(&by_op, "FUSE_SETATTR"), 0, "{by_op:?}");
    assert_eq!(count(&by_op, "FUSE_OPEN"), n, "{by_op:?}");
    // Before the cut each rewrite was OPEN, SETATTR, GETXATTR (security.capability: the
    // SETATTR's reply made the kernel forget the inode had none), WRITE, RELEASE.
    assert_eq!(by_op.values().sum::<usize>(), 3 * n, "{by_op:?}");

    // O_RDONLY | O_TRUNC truncates too (Linux does, given write permission).
    let before = fs::metadata(&p).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    // SAFETY: a valid NUL-terminated path; the descriptor is closed right after.
    let fd = unsafe {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_TRUNC)
    };
    assert!(fd >= 0, "{}", std::io::Error::last_os_error());
    // SAFETY: fd was opened above.
    unsafe { libc::close(fd) };
    let after = fs::metadata(&p).unwrap();
    assert_eq!(after.len(), 0);
    assert!(
        (after.mtime(), after.mtime_nsec()) > (before.mtime(), before.mtime_nsec()),
        "O_TRUNC moves the mtime"
    );
    assert!((after.ctime(), after.ctime_nsec()) > (before.ctime(), before.ctime_nsec()));
    // The server's view agrees (a fresh mount of a commit).
    let c = m.commit().unwrap();
    let m2 = env.mount(&c, "m2", MountOptions::default());
    assert_eq!(fs::read(m2.mountpoint().join("f")).unwrap(), b"");
    drop(census);

    // A read-only mount refuses it.
    let ro = env.mount(
        &c,
        "ro",
        MountOptions {
            read_only: true,
            ..Default::default()
        },
    );
    let e = OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(ro.mountpoint().join("f"))
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS));
}

/// What the kernel may keep, it keeps: attributes and entries (positive and negative) are
/// cached for the mount's whole life (the server is the only writer), so stat of a file nothing
/// changed and lookups of a name that does not exist are answered without the server.
#[test]
fn unchanged_attributes_and_missing_names_are_answered_from_the_kernels_cache() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let src = env.path("src");
    make_tree(&src, 7);
    let id = env.store.import_dir(&src).unwrap();
    let m = env.mount(&id, "m", MountOptions::default());
    let file = m.mountpoint().join("small.txt");
    let missing = m.mountpoint().join("no-such-name");
    fs::metadata(&file).unwrap();
    assert!(fs::metadata(&missing).is_err());
    let Some(census) = Census::start(m.mountpoint()) else {
        return;
    };
    for _ in 0..200 {
        fs::metadata(&file).unwrap();
        assert!(fs::symlink_metadata(&missing).is_err());
    }
    let by_op = census.take();
    assert_eq!(by_op.values().sum::<usize>(), 0, "{by_op:?}");
}

/// GNU tar extracting small files: the requests per file, by opcode, stay at what the kernel
/// (6.18) sends for tar's syscalls and no more (docs/nodefs-format.md has the census and why
/// each is sent).
#[test]
fn an_untar_sends_the_census_requests_per_file_and_no_more() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let id = env.empty();
    let m = env.mount(&id, "m", MountOptions::default());
    let n = 200;
    let names: Vec<String> = (0..n).map(|i| format!("d{}/f{i:03}.py", i % 4)).collect();
    let bodies: Vec<Vec<u8>> = (0..n)
        .map(|i| random_bytes(i as u64, 3000 + i * 97))
        .collect();
    let files: Vec<(&str, &[u8])> = names
        .iter()
        .zip(&bodies)
        .map(|(n, b)| (n.as_str(), b.as_slice()))
        .collect();
    let tar = env.path("t.tar");
    fs::write(&tar, tar_of_files(&files)).unwrap();
    let dest = m.mountpoint().join("x");
    fs::create_dir(&dest).unwrap();
    let Some(census) = Census::start(m.mountpoint()) else {
        return;
    };
    let st = std::process::Command::new("tar")
        .arg("-xf")
        .arg(&tar)
        .arg("-C")
        .arg(&dest)
        .status()
        .unwrap();
    assert!(st.success());
    let by_op = census.take();
    for (name, body) in &files {
        assert_eq!(&fs::read(dest.join(name)).unwrap()[..], *body, "{name}");
    }
    let per_file = |op: &str| count(&by_op, op) as f64 / n as f64;
    let total = by_op.values().sum::<usize>() as f64 / n as f64;
    eprintln!("untar of {n} files: {total:.2} requests per file: {by_op:?}");
    // One CREATE, RELEASE, negative LOOKUP and parent GETATTR each; the security.capability
    // GETXATTR of chown (the first write asks none: the file is written direct); tar's three
    // SETATTRs (times, owner, mode).
    assert!(per_file("FUSE_CREATE") <= 1.0, "{by_op:?}");
    assert!(per_file("FUSE_LOOKUP") <= 1.05, "{by_op:?}");
    assert!(per_file("FUSE_GETATTR") <= 1.05, "{by_op:?}");
    assert!(per_file("FUSE_GETXATTR") <= 1.0, "{by_op:?}");
    assert!(per_file("FUSE_SETATTR") <= 3.0, "{by_op:?}");
    assert!(
        count(&by_op, "FUSE_FLUSH") <= 1,
        "FLUSH is answered ENOSYS once, at most"
    );
    // A WRITE per write(2) (no writeback cache: see "Where a mount's requests go"), and tar
    // writes a file in pieces of its records: never more than one per page.
    let pages: usize = bodies.iter().map(|b| b.len().div_ceil(4096)).sum();
    let writes = count(&by_op, "FUSE_WRITE");
    assert!(writes <= pages, "{writes} WRITEs for {pages} pages");
    let others = (by_op.values().sum::<usize>() - writes) as f64 / n as f64;
    assert!(
        others <= 8.2,
        "{others:.2} requests per file besides WRITE ({total:.2} in all): {by_op:?}"
    );
}

/// A file created write-only is written direct (FOPEN_DIRECT_IO): its first write sends no
/// GETXATTR of security.capability, and a reader that cached the file's pages sees every
/// write (the kernel drops cached pages before a direct write).
#[test]
fn a_file_created_write_only_is_written_without_a_getxattr_and_stays_coherent() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let id = env.empty();
    let m = env.mount(&id, "m", MountOptions::default());
    let Some(census) = Census::start(m.mountpoint()) else {
        return;
    };
    let n = 50;
    for i in 0..n {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(m.mountpoint().join(format!("f{i}")))
            .unwrap();
        f.write_all(format!("file {i}").as_bytes()).unwrap();
    }
    let by_op = census.take();
    assert_eq!(count(&by_op, "FUSE_GETXATTR"), 0, "{by_op:?}");
    assert_eq!(count(&by_op, "FUSE_CREATE"), n, "{by_op:?}");
    assert_eq!(count(&by_op, "FUSE_WRITE"), n, "{by_op:?}");
    for i in 0..n {
        let p = m.mountpoint().join(format!("f{i}"));
        assert_eq!(fs::read_to_string(p).unwrap(), format!("file {i}"));
    }

    // A reader holding cached pages of the file while the creator writes on.
    use std::io::{Read, Seek, SeekFrom};
    let p = m.mountpoint().join("log");
    let mut w = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&p)
        .unwrap();
    w.write_all(b"first line\n").unwrap();
    let mut r = fs::File::open(&p).unwrap();
    let mut got = String::new();
    r.read_to_string(&mut got).unwrap();
    assert_eq!(got, "first line\n");
    w.write_all(b"second line\n").unwrap();
    w.seek(SeekFrom::Start(0)).unwrap();
    w.write_all(b"FIRST").unwrap();
    got.clear();
    r.seek(SeekFrom::Start(0)).unwrap();
    r.read_to_string(&mut got).unwrap();
    assert_eq!(got, "FIRST line\nsecond line\n");
    // And a later open (FOPEN_KEEP_CACHE) too.
    assert_eq!(fs::read_to_string(&p).unwrap(), "FIRST line\nsecond line\n");
    drop(census);
}
