//! Commit, fork and quota behaviour through real mounts.

mod common;

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use nodefs::MountOptions;

#[test]
fn commit_while_writing_is_a_consistent_snapshot() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let base = env.empty();
    let m = env.mount(&base, "m", MountOptions::default());
    let mp = m.mountpoint().to_path_buf();
    // A writer appends fixed-size numbered records; every snapshot must hold a prefix of
    // whole records (each write is one FUSE request, and commit holds writes off).
    let stop = Arc::new(AtomicBool::new(false));
    let w = {
        let stop = stop.clone();
        let mp = mp.clone();
        std::thread::spawn(move || {
            let mut f = OpenOptions::new()
                .create(true)
                .append(true)
                .open(mp.join("log"))
                .unwrap();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                f.write_all(format!("{i:015}\n").as_bytes()).unwrap();
                i += 1;
                if i.is_multiple_of(64) {
                    fs::write(mp.join(format!("f{}", i / 64 % 8)), i.to_string()).unwrap();
                }
            }
            i
        })
    };
    let mut ids = Vec::new();
    for _ in 0..8 {
        std::thread::sleep(Duration::from_millis(20));
        let t = Instant::now();
        ids.push(m.commit().unwrap());
        eprintln!("commit took {:?}", t.elapsed());
    }
    stop.store(true, Ordering::Relaxed);
    let total = w.join().unwrap();
    assert!(total > 100, "writer made progress: {total}");
    let mut last_len = 0;
    for (k, id) in ids.iter().enumerate() {
        let out = env.path(&format!("out{k}"));
        env.store.export_dir(id, &out).unwrap();
        let log = fs::read(out.join("log")).unwrap_or_default();
        assert_eq!(log.len() % 16, 0, "snapshot {k} holds whole records");
        for (j, rec) in log.chunks(16).enumerate() {
            assert_eq!(
                rec,
                format!("{j:015}\n").as_bytes(),
                "snapshot {k} record {j}"
            );
        }
        assert!(log.len() >= last_len, "snapshots grow");
        last_len = log.len();
    }
    // The mount goes on after the commits.
    fs::write(mp.join("after"), b"ok").unwrap();
    assert_eq!(fs::read(mp.join("after")).unwrap(), b"ok");
}

#[test]
fn forks_diverge_independently() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let src = env.path("src");
    make_tree(&src, 3);
    let base = env.store.import_dir(&src).unwrap();
    let m0 = env.mount(&base, "m0", MountOptions::default());
    fs::write(m0.mountpoint().join("shared"), b"from parent").unwrap();
    let snap = m0.commit().unwrap();
    let t = Instant::now();
    let a = env.mount(&snap, "a", MountOptions::default());
    let b = env.mount(&snap, "b", MountOptions::default());
    eprintln!("two fork mounts took {:?}", t.elapsed());
    fs::write(a.mountpoint().join("shared"), b"A").unwrap();
    fs::remove_file(b.mountpoint().join("small.txt")).unwrap();
    fs::write(b.mountpoint().join("only-b"), b"B").unwrap();
    assert_eq!(fs::read(a.mountpoint().join("shared")).unwrap(), b"A");
    assert_eq!(
        fs::read(b.mountpoint().join("shared")).unwrap(),
        b"from parent"
    );
    assert!(a.mountpoint().join("small.txt").exists());
    assert!(!a.mountpoint().join("only-b").exists());
    assert_eq!(
        fs::read(m0.mountpoint().join("shared")).unwrap(),
        b"from parent"
    );
    let (ca, cb) = (a.commit().unwrap(), b.commit().unwrap());
    assert_ne!(ca, cb);
    let oa = env.path("oa");
    env.store.export_dir(&ca, &oa).unwrap();
    assert_eq!(fs::read(oa.join("shared")).unwrap(), b"A");
    assert!(oa.join("small.txt").exists() && !oa.join("only-b").exists());
    assert_eq!(a.base(), snap);
    assert_eq!(env.fs.mounts().len(), 3);
    a.unmount().unwrap();
    a.unmount().unwrap();
    assert_eq!(env.fs.mounts().len(), 2);
    assert!(!env.path("upper-a").exists(), "upper dir removed");
}

#[test]
fn byte_and_inode_quotas() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let base = env.empty();
    let m = env.mount(
        &base,
        "m",
        MountOptions {
            quota_bytes: Some(4 << 20),
            quota_inodes: Some(50),
            ..Default::default()
        },
    );
    let mp = m.mountpoint();
    let mut f = File::create(mp.join("fill")).unwrap();
    let chunk = vec![1u8; 256 << 10];
    let mut written = 0usize;
    let err = loop {
        match f.write(&chunk) {
            Ok(n) => written += n,
            Err(e) => break e,
        }
        assert!(written <= 5 << 20, "quota not enforced");
    };
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC));
    assert!(written >= 3 << 20, "wrote {written}");
    drop(f);
    let u = m.usage();
    assert!(u.bytes <= 4 << 20 && u.bytes >= 3 << 20, "{u:?}");
    // Deleting frees the space again.
    fs::remove_file(mp.join("fill")).unwrap();
    let t = Instant::now();
    while m.usage().bytes != 0 && t.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(m.usage().bytes, 0);
    fs::write(mp.join("again"), vec![2u8; 1 << 20]).unwrap();
    // Inodes.
    let mut made = 0;
    let err = loop {
        match File::create(mp.join(format!("n{made}"))) {
            Ok(_) => made += 1,
            Err(e) => break e,
        }
        assert!(made <= 60, "inode quota not enforced");
    };
    assert!(
        matches!(err.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)),
        "{err}"
    );
    assert_eq!(m.usage().inodes, 50);
}

#[test]
fn commit_of_a_small_change_is_fast_and_cheap() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let src = env.path("src");
    fs::create_dir_all(&src).unwrap();
    for d in 0..20 {
        fs::create_dir_all(src.join(format!("d{d}"))).unwrap();
        for i in 0..20 {
            fs::write(
                src.join(format!("d{d}/f{i}")),
                random_bytes(d * 100 + i, 50_000),
            )
            .unwrap();
        }
    }
    let base = env.store.import_dir(&src).unwrap();
    let m = env.mount(&base, "m", MountOptions::default());
    fs::write(m.mountpoint().join("d3/f7"), b"changed").unwrap();
    let before = env.store.stats();
    let t = Instant::now();
    let c = m.commit().unwrap();
    let took = t.elapsed();
    let after = env.store.stats();
    eprintln!(
        "commit of one changed file: {took:?}, +{} bytes",
        after.stored_bytes - before.stored_bytes
    );
    assert!(
        after.stored_bytes - before.stored_bytes < 8192,
        "{before:?} {after:?}"
    );
    // Only the root and d3 directory objects are new.
    let out = env.path("out");
    env.store.export_dir(&c, &out).unwrap();
    assert_eq!(fs::read(out.join("d3/f7")).unwrap(), b"changed");
    assert_eq!(
        fs::read(out.join("d4/f7")).unwrap(),
        fs::read(src.join("d4/f7")).unwrap()
    );
}

/// A snapshot commits in two steps: the frozen instant, then the sync after the thaw. The
/// unsealed commit holds that instant, is kept through a gc, and is sealed once, by its id.
#[test]
fn an_unsealed_commit_holds_its_instant_through_gc_until_sealed() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let base = env.empty();
    let m = env.mount(&base, "m", MountOptions::default());
    fs::write(m.mountpoint().join("f"), random_bytes(7, 300_000)).unwrap();
    let id = m.commit_unsealed().unwrap();
    fs::write(m.mountpoint().join("f"), b"after").unwrap();
    env.store.gc(&[]).unwrap();
    let other = nodefs::ObjectId([9; 32]);
    assert!(matches!(
        m.seal_commit(&other),
        Err(nodefs::Error::UnknownManifest(_))
    ));
    m.seal_commit(&id).unwrap();
    assert!(
        matches!(m.seal_commit(&id), Err(nodefs::Error::UnknownManifest(_))),
        "sealed once"
    );
    let out = env.path("out");
    env.store.export_dir(&id, &out).unwrap();
    assert_eq!(fs::read(out.join("f")).unwrap(), random_bytes(7, 300_000));
    let next = m.commit().unwrap();
    let out2 = env.path("out2");
    env.store.export_dir(&next, &out2).unwrap();
    assert_eq!(fs::read(out2.join("f")).unwrap(), b"after");
}

#[test]
fn mounting_is_fast_and_leaves_nothing() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let base = env.empty();
    let mut times = Vec::new();
    for i in 0..10 {
        let t = Instant::now();
        let m = env.mount(&base, &format!("x{i}"), MountOptions::default());
        times.push(t.elapsed());
        fs::write(m.mountpoint().join("f"), b"x").unwrap();
        drop(m);
    }
    times.sort();
    eprintln!("mount median {:?}", times[5]);
    assert_no_mounts_under(env.tmp.path());
    for i in 0..10 {
        assert!(!env.path(&format!("upper-x{i}")).exists());
    }
    // A bad base or a busy upper dir is refused without leaving anything behind.
    let mp = env.path("bad");
    fs::create_dir_all(&mp).unwrap();
    let r = env.fs.mount(
        &nodefs::ObjectId([9; 32]),
        &mp,
        MountOptions {
            upper_dir: env.path("u1"),
            ..Default::default()
        },
    );
    assert!(r.is_err());
    let u2 = env.path("u2");
    fs::create_dir_all(&u2).unwrap();
    fs::write(u2.join("junk"), b"").unwrap();
    assert!(env
        .fs
        .mount(
            &base,
            &mp,
            MountOptions {
                upper_dir: u2.clone(),
                ..Default::default()
            }
        )
        .is_err());
    assert!(u2.join("junk").exists(), "a user's dir is never removed");
    assert_no_mounts_under(env.tmp.path());
}

#[test]
fn in_place_rewrite_is_stored_as_a_delta() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let src = env.path("src");
    fs::create_dir_all(&src).unwrap();
    fs::write(src.join("db"), random_bytes(77, 2 << 20)).unwrap();
    let base = env.store.import_dir(&src).unwrap();
    let m = env.mount(&base, "m", MountOptions::default());
    // Rewrite a few bytes in place in several places (like a database page update).
    let mut f = OpenOptions::new()
        .write(true)
        .open(m.mountpoint().join("db"))
        .unwrap();
    for off in [100_000u64, 700_000, 1_500_000] {
        std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(off)).unwrap();
        f.write_all(b"rewritten").unwrap();
    }
    drop(f);
    let before = env.store.stats();
    let c = m.commit().unwrap();
    let after = env.store.stats();
    let added = after.stored_bytes - before.stored_bytes;
    eprintln!("3 rewritten chunks stored in {added} bytes");
    // Without deltas this is 3 incompressible chunks of ~64 KiB.
    assert!(added < 16 << 10, "added {added}");
    assert!(after.chunks > before.chunks);
    let out = env.path("out");
    env.store.export_dir(&c, &out).unwrap();
    let mut want = fs::read(src.join("db")).unwrap();
    for off in [100_000usize, 700_000, 1_500_000] {
        want[off..off + 9].copy_from_slice(b"rewritten");
    }
    assert!(fs::read(out.join("db")).unwrap() == want);
    assert!(env.store.fsck().unwrap().is_clean());
    // gc keeps delta bases alive when only the new manifest is referenced.
    env.store.set_ref("new", &c).unwrap();
    drop(m);
    env.store.gc(&[]).unwrap();
    assert!(env.store.fsck().unwrap().is_clean());
    fs::remove_dir_all(&out).unwrap();
    env.store.export_dir(&c, &out).unwrap();
    assert!(fs::read(out.join("db")).unwrap() == want);
}

#[test]
fn unmount_while_busy_leaves_no_mount() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let base = env.empty();
    let m = env.mount(&base, "busy", MountOptions::default());
    let mut f = File::create(m.mountpoint().join("open")).unwrap();
    f.write_all(b"x").unwrap();
    let cwd_holder = std::process::Command::new("sleep")
        .arg("30")
        .current_dir(m.mountpoint())
        .spawn()
        .unwrap();
    let t = Instant::now();
    m.unmount().unwrap();
    eprintln!("busy unmount took {:?}", t.elapsed());
    assert_no_mounts_under(env.tmp.path());
    assert!(!env.path("upper-busy").exists());
    assert!(
        f.write_all(b"y").is_err(),
        "the aborted connection refuses I/O"
    );
    let mut c = cwd_holder;
    c.kill().unwrap();
    c.wait().unwrap();
    assert!(m.commit().is_err(), "commit after unmount is an error");
}

#[test]
fn stale_mounts_from_a_dead_server_are_removed() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let base = env.empty();
    // Whatever happens below, no stale mount outlives the test.
    struct Sweep(std::sync::Arc<nodefs::NodeFs>, std::path::PathBuf);
    impl Drop for Sweep {
        fn drop(&mut self) {
            let _ = self.0.unmount_stale(&self.1);
        }
    }
    let _sweep = Sweep(
        nodefs::NodeFs::new(env.store.clone()),
        env.tmp.path().to_path_buf(),
    );
    // A server that "crashed": its mount is forgotten by everyone.
    let old_fs = nodefs::NodeFs::new(env.store.clone());
    let mp = env.path("stale mnt");
    fs::create_dir_all(&mp).unwrap();
    let m = old_fs
        .mount(
            &base,
            &mp,
            MountOptions {
                upper_dir: env.path("stale-upper"),
                ..Default::default()
            },
        )
        .unwrap();
    let keep = env.mount(&base, "live", MountOptions::default());
    std::mem::forget(m);
    std::mem::forget(old_fs);
    let removed = env.fs.unmount_stale(env.tmp.path()).unwrap();
    assert_eq!(removed, vec![mp.clone()]);
    let mi = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let esc = mp.to_string_lossy().replace(' ', "\\040");
    assert!(!mi.contains(&esc), "{mi}");
    // The live mount of this server is untouched.
    fs::write(keep.mountpoint().join("ok"), b"ok").unwrap();
    let _ = fs::remove_dir_all(env.path("stale-upper"));
}

#[test]
fn small_files_share_one_slot_file_and_give_space_back() {
    if !fuse_available() {
        return;
    }
    use std::os::unix::fs::MetadataExt;
    let env = Env::new();
    let base = env.empty();
    let m = env.mount(&base, "m", MountOptions::default());
    let mp = m.mountpoint();
    let upper = env.path("upper-m");
    for i in 0..200u64 {
        fs::write(mp.join(format!("f{i}")), random_bytes(i, 5000)).unwrap();
    }
    // One slot file, not one upper file per file.
    let entries: Vec<_> = fs::read_dir(&upper).unwrap().collect();
    assert_eq!(entries.len(), 1, "{entries:?}");
    let slots = upper.join("slots");
    assert!(fs::metadata(&slots).unwrap().blocks() > 0);
    // A file that outgrows its slot moves to its own file with its content.
    let mut f = OpenOptions::new().append(true).open(mp.join("f7")).unwrap();
    let tail = random_bytes(1000, 2 << 20);
    f.write_all(&tail).unwrap();
    drop(f);
    let mut want = random_bytes(7, 5000);
    want.extend_from_slice(&tail);
    assert!(fs::read(mp.join("f7")).unwrap() == want);
    // A shrunk file reads zeros where it grows again; a reused slot starts out zeroed.
    let f = OpenOptions::new().write(true).open(mp.join("f8")).unwrap();
    f.set_len(100).unwrap();
    f.set_len(5000).unwrap();
    drop(f);
    let got = fs::read(mp.join("f8")).unwrap();
    assert_eq!(got[..100], random_bytes(8, 5000)[..100]);
    assert!(got[100..].iter().all(|&b| b == 0));
    fs::remove_file(mp.join("f9")).unwrap();
    let mut f = File::create(mp.join("new")).unwrap();
    f.write_all(b"x").unwrap();
    f.set_len(4096).unwrap();
    drop(f);
    let got = fs::read(mp.join("new")).unwrap();
    assert!(got[0] == b'x' && got[1..].iter().all(|&b| b == 0));
    // Deleting everything gives the blocks back (once the last RELEASE has arrived).
    for e in fs::read_dir(mp).unwrap() {
        fs::remove_file(e.unwrap().path()).unwrap();
    }
    let t = Instant::now();
    while fs::metadata(&slots).unwrap().blocks() != 0 && t.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(fs::metadata(&slots).unwrap().blocks(), 0);
    assert_eq!(fs::read_dir(&upper).unwrap().count(), 1);
    assert_eq!(m.usage().bytes, 0);
}

/// The upper dir is made by the first write, not by the mount (issue 4: a sandbox that writes
/// nothing to its root costs no mkdir/rmdir on the run dir's disk), and goes at unmount.
#[test]
fn upper_dir_appears_with_the_first_write() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let src = env.path("src");
    make_tree(&src, 2);
    let base = env.store.import_dir(&src).unwrap();
    let m = env.mount(&base, "lazy", MountOptions::default());
    let upper = env.path("upper-lazy");
    assert!(fs::read(m.mountpoint().join("small.txt")).is_ok());
    assert!(!upper.exists(), "a read-only use makes no upper dir");
    fs::write(m.mountpoint().join("new"), b"data").unwrap();
    assert!(upper.is_dir(), "the first write makes it");
    assert_eq!(fs::read(m.mountpoint().join("new")).unwrap(), b"data");
    let id = m.commit().unwrap();
    m.unmount().unwrap();
    assert!(!upper.exists(), "unmount removes it");
    let again = env.mount(&id, "again", MountOptions::default());
    assert_eq!(fs::read(again.mountpoint().join("new")).unwrap(), b"data");
}

/// The skip helper every FUSE test starts with: a missing capability is reported on stderr even
/// when the run passes, and fails the test when `GROVE_REQUIRE_CAPABILITIES=1` (as in CI).
#[test]
fn a_missing_capability_skips_loudly_or_fails_when_required() {
    const NAME: &str = "a_missing_capability_skips_loudly_or_fails_when_required";
    const WHY: &str = "a capability this check pretends is absent";
    if std::env::var_os("NODEFS_TEST_PRETEND_MISSING").is_some() {
        // The child run below.
        capability_missing(WHY);
        return;
    }
    let run = |require: Option<&str>| {
        let mut c = std::process::Command::new(std::env::current_exe().unwrap());
        c.args(["--exact", NAME])
            .env("NODEFS_TEST_PRETEND_MISSING", "1")
            .env_remove("GROVE_REQUIRE_CAPABILITIES");
        if let Some(v) = require {
            c.env("GROVE_REQUIRE_CAPABILITIES", v);
        }
        let o = c.output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        (o.status.success(), text)
    };
    let (ok, text) = run(None);
    assert!(ok, "{text}");
    assert!(text.contains(&format!("SKIPPED {NAME}: {WHY}")), "{text}");
    let (ok, text) = run(Some("1"));
    assert!(!ok, "{text}");
    assert!(
        text.contains(&format!(
            "{NAME}: {WHY}; GROVE_REQUIRE_CAPABILITIES=1 forbids skipping"
        )),
        "{text}"
    );
}

/// The effective uid `prog` runs with when an unprivileged host user (nobody) starts it.
fn euid_as_nobody(prog: &std::path::Path) -> String {
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(prog)
        .arg("-u")
        .output()
        .expect("setpriv");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Issue 24, break 7: what a sandbox writes into its root must not give anyone on the host
/// more rights. A setuid-root binary and a device node written into a mounted view (as a
/// sandbox's root would get them) are inert for the host: the binary runs with its caller's
/// uid, the device does not open. The same files on a plain host directory are live, which
/// shows the test would see the attack work.
#[test]
fn setuid_binaries_and_device_nodes_are_inert_on_the_host() {
    use std::os::unix::fs::PermissionsExt;
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    // nobody must be able to reach the mountpoint and the control copy.
    fs::set_permissions(env.tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let base = env.empty();
    let m = env.mount(&base, "m", MountOptions::default());
    let plant = |dir: &std::path::Path| {
        let bin = dir.join("rootshell");
        fs::copy("/usr/bin/id", &bin).unwrap();
        std::os::unix::fs::chown(&bin, Some(0), Some(0)).unwrap();
        fs::set_permissions(&bin, fs::Permissions::from_mode(0o4755)).unwrap();
        assert_eq!(
            fs::metadata(&bin).unwrap().permissions().mode() & 0o7777,
            0o4755
        );
        let dev = dir.join("null");
        let c = std::ffi::CString::new(dev.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: c is a valid path; makes a character device node (1, 3) = /dev/null.
        let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        (bin, dev)
    };
    // Control: on the host's own filesystem the plant works.
    let control = env.path("control");
    fs::create_dir(&control).unwrap();
    fs::set_permissions(&control, fs::Permissions::from_mode(0o755)).unwrap();
    let (cbin, cdev) = plant(&control);
    let control_live = euid_as_nobody(&cbin) == "0";
    if !control_live {
        capability_missing("the temp dir's filesystem does not honour setuid (nosuid mount)");
    }
    if control_live {
        OpenOptions::new()
            .write(true)
            .open(&cdev)
            .expect("control device opens");
    }
    // In the nodefs view it does not.
    let (bin, dev) = plant(m.mountpoint());
    assert_eq!(euid_as_nobody(&bin), "65534", "setuid honoured on the host");
    let err = OpenOptions::new().write(true).open(&dev).unwrap_err();
    assert_eq!(
        err.raw_os_error(),
        Some(libc::EACCES),
        "device opened: {err}"
    );
    // The bits are kept (the sandbox sees what it made); only the host ignores them.
    assert_eq!(
        fs::metadata(&bin).unwrap().permissions().mode() & 0o7777,
        0o4755
    );
    let mi = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mp = m.mountpoint().to_str().unwrap();
    let line = mi
        .lines()
        .find(|l| l.split(' ').nth(4) == Some(mp))
        .expect("mount listed");
    let opts = line.split(' ').nth(5).unwrap();
    assert!(
        opts.split(',').any(|o| o == "nosuid") && opts.split(',').any(|o| o == "nodev"),
        "{line}"
    );
}

/// Resident memory of this process (the server runs in it), in bytes.
fn rss() -> u64 {
    let s = fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb << 10
}

/// Issue 24, break 6: 200k empty files grew grove-fsd by 192 MB while counting nothing
/// against the sandbox's quota. Inodes, names and xattrs count against the byte quota now:
/// making empty files (or xattrs) until failure fails with ENOSPC after a number bounded by
/// the quota, the server's memory grows by about the quota at most, and deleting gives the
/// quota back.
#[test]
fn empty_files_and_xattrs_count_against_the_quota() {
    if !fuse_available() {
        return;
    }
    const QUOTA: u64 = 8 << 20;
    let env = Env::new();
    let base = env.empty();
    let m = env.mount(
        &base,
        "m",
        MountOptions {
            quota_bytes: Some(QUOTA),
            ..Default::default()
        },
    );
    let mp = m.mountpoint().to_path_buf();
    fs::create_dir(mp.join("d")).unwrap();
    let before = rss();
    let mut made = 0u64;
    let err = loop {
        match File::create(mp.join(format!("d/empty-file-number-{made:07}"))) {
            Ok(_) => made += 1,
            Err(e) => break e,
        }
        assert!(made < 20_000, "{made} empty files in an 8 MiB quota");
    };
    let grown = rss().saturating_sub(before);
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    let u = m.usage();
    eprintln!(
        "{made} empty files until ENOSPC; usage {u:?}; server RSS grew {} KiB ({} B per file)",
        grown >> 10,
        grown / made.max(1)
    );
    assert!(made >= 1000, "only {made} files");
    assert!(u.bytes <= QUOTA && u.meta_bytes > QUOTA / 2, "{u:?}");
    assert!(
        grown < 2 * QUOTA,
        "server grew by {grown} bytes for {made} files"
    );
    // statfs agrees: no blocks left.
    let sv = nix::sys::statvfs::statvfs(&mp).unwrap();
    assert!(sv.blocks_available() <= 1, "{sv:?}");
    // Deleting them gives the quota back.
    for i in 0..made {
        fs::remove_file(mp.join(format!("d/empty-file-number-{i:07}"))).unwrap();
    }
    let t = Instant::now();
    while m.usage().inodes > 1 && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let u = m.usage();
    assert_eq!(u.inodes, 1, "{u:?}");
    assert!(u.meta_bytes < 4096, "{u:?}");
    // Xattrs: held in memory too.
    let f = mp.join("x");
    File::create(&f).unwrap();
    let value = vec![7u8; 60 << 10];
    let mut set = 0u64;
    let err = loop {
        match xattr_set(&f, &format!("user.k{set}"), &value) {
            Ok(()) => set += 1,
            Err(e) => break e,
        }
        assert!(set < 1000, "{set} xattrs of 60 KiB in an 8 MiB quota");
    };
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    assert!(m.usage().bytes <= QUOTA);
    fs::remove_file(&f).unwrap();
    let t = Instant::now();
    while m.usage().meta_bytes > 4096 && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(m.usage().meta_bytes < 4096, "{:?}", m.usage());
}

fn xattr_set(p: &std::path::Path, name: &str, value: &[u8]) -> std::io::Result<()> {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    let n = std::ffi::CString::new(name).unwrap();
    // SAFETY: valid C strings and a value buffer of the given length.
    let rc = unsafe {
        libc::setxattr(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A mount for a sandbox in a user namespace shows owners moved into its host range, and moves
/// ids coming in back, so the store (and every commit) keeps the image's own ids.
#[test]
fn an_id_shift_shows_owners_in_the_range_and_stores_image_ids() {
    use std::os::unix::fs::{chown, MetadataExt};
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let src = env.path("src-ids");
    fs::create_dir_all(src.join("d")).unwrap();
    fs::write(src.join("f"), b"x").unwrap();
    chown(src.join("f"), Some(1000), Some(42)).unwrap();
    chown(&src, Some(0), Some(0)).unwrap();
    let base = env.store.import_dir(&src).unwrap();
    let shift = nodefs::IdShift {
        base: 300_000,
        size: 65536,
    };
    let m = env.mount(
        &base,
        "ids",
        MountOptions {
            id_shift: Some(shift),
            ..Default::default()
        },
    );
    let mp = m.mountpoint().to_path_buf();
    let owner = |p: &str| {
        let md = fs::metadata(mp.join(p)).unwrap();
        (md.uid(), md.gid())
    };
    assert_eq!(owner("f"), (301_000, 300_042));
    assert_eq!(owner(""), (300_000, 300_000));
    // Host root writing (the runtime's files API) acts as the image's root.
    fs::write(mp.join("new"), b"y").unwrap();
    assert_eq!(owner("new"), (300_000, 300_000));
    chown(mp.join("new"), Some(300_007), Some(300_008)).unwrap();
    assert_eq!(owner("new"), (300_007, 300_008));
    // A host id outside the range is never stored: it becomes the overflow id.
    chown(mp.join("d"), Some(1234), Some(1234)).unwrap();
    assert_eq!(owner("d"), (300_000 + 65534, 300_000 + 65534));
    let c = m.commit().unwrap();
    drop(m);
    let plain = env.mount(&c, "plain", MountOptions::default());
    let pmp = plain.mountpoint().to_path_buf();
    let stored = |p: &str| {
        let md = fs::metadata(pmp.join(p)).unwrap();
        (md.uid(), md.gid())
    };
    assert_eq!(stored("f"), (1000, 42));
    assert_eq!(stored("new"), (7, 8));
    assert_eq!(stored("d"), (65534, 65534));
    drop(plain);
    assert_no_mounts_under(env.tmp.path());
}

/// Writes through a shared mapping that is still mapped (the process has not unmapped, synced
/// or exited: a frozen sandbox at a snapshot) are in the commit: the kernel holds them as dirty
/// pages until something writes them back, and a commit must have the server hold them first.
/// syncfs alone starts that write-back without waiting for it: a commit right after it missed
/// some pages in about one run in five, so the test commits eight times, each after new writes
/// to scattered pages, the descriptor closed (the mapping keeps the file open), and once more
/// after a last write, the unmap and the writer's exit.
#[test]
fn a_commit_holds_writes_made_through_a_live_shared_mapping() {
    if !fuse_available() {
        return;
    }
    const SIZE: usize = 1 << 20;
    const ROUNDS: usize = 8;
    let env = Env::new();
    // As a sandbox root is mounted: with a quota.
    let opts = MountOptions {
        quota_bytes: Some(64 << 20),
        ..Default::default()
    };
    let m = env.mount(&env.empty(), "m", opts);
    let file = m.mountpoint().join("mapped.bin");
    fs::write(&file, vec![b'a'; SIZE]).unwrap();
    // Where round `r` writes (the same rule on both sides): its own page, and the end.
    let page_of = |r: usize| (r * 37 + 1) % (SIZE / 4096 - 1);
    // A process maps the file shared and closes the descriptor; for each line on stdin it
    // writes the round's marks through the mapping and says so, staying mapped.
    let script = format!(
        "import mmap, os, sys\n\
         f = os.open({:?}, os.O_RDWR)\n\
         m = mmap.mmap(f, {SIZE}, mmap.MAP_SHARED)\n\
         os.close(f)\n\
         for line in sys.stdin:\n\
         \x20   r = int(line)\n\
         \x20   p = (r * 37 + 1) % ({SIZE} // 4096 - 1)\n\
         \x20   m[p * 4096:p * 4096 + 8] = b'round %02d' % r\n\
         \x20   m[{SIZE} - 3:] = b'%03d' % r\n\
         \x20   print('written', flush=True)\n\
         m[0:4] = b'last'\n\
         m.close()\n",
        file.to_str().unwrap()
    );
    let mut child = std::process::Command::new("python3")
        .args(["-c", &script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut want = vec![b'a'; SIZE];
    for r in 0..ROUNDS {
        writeln!(stdin, "{r}").unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
        assert_eq!(line.trim(), "written", "round {r}");
        let p = page_of(r) * 4096;
        want[p..p + 8].copy_from_slice(format!("round {r:02}").as_bytes());
        want[SIZE - 3..].copy_from_slice(format!("{r:03}").as_bytes());
        let id = m.commit().unwrap();
        let out = env.path(&format!("out{r}"));
        env.store.export_dir(&id, &out).unwrap();
        let got = fs::read(out.join("mapped.bin")).unwrap();
        let differ: Vec<usize> = (0..SIZE)
            .filter(|&i| got.get(i) != Some(&want[i]))
            .collect();
        assert!(
            got == want,
            "round {r}: the writes through the mapping are committed: {} of {SIZE} bytes \
             differ, the first at {:?}",
            differ.len(),
            differ.first()
        );
    }
    // Last, it writes, unmaps and exits: the kernel writes such pages back as the mapping
    // goes, before the file's last RELEASE, so the next commit (no file open any more) has them.
    drop(stdin);
    assert!(child.wait().unwrap().success());
    want[0..4].copy_from_slice(b"last");
    let id = m.commit().unwrap();
    let out = env.path("out-unmapped");
    env.store.export_dir(&id, &out).unwrap();
    assert!(
        fs::read(out.join("mapped.bin")).unwrap() == want,
        "writes through a mapping since unmapped are committed"
    );
}
