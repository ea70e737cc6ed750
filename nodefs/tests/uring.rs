//! FUSE over io_uring: real mounts served over the ring, the same work over /dev/fuse for
//! comparison, a server's mounts sharing one set of queues and releasing their entries, a mount
//! the kernel refuses the ring falling back, and a ring that breaks mid-untar failing its own
//! mount only while the other mounts on the same queues go on.

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use nodefs::{MountOptions, ServerOptions, Transport};

/// Whether the kernel offers FUSE over io_uring (the server turned `enable_uring` on if it
/// could); reported through [`capability_missing`] when not.
fn uring_available() -> bool {
    if !fuse_available() {
        return false;
    }
    match fs::read_to_string("/sys/module/fuse/parameters/enable_uring") {
        Ok(s) if s.trim() == "Y" => true,
        Ok(_) => {
            capability_missing("FUSE over io_uring is switched off (enable_uring) and stays off");
            false
        }
        Err(_) => {
            capability_missing("FUSE over io_uring needs a 6.14+ kernel with CONFIG_FUSE_IO_URING");
            false
        }
    }
}

/// How many CPUs the kernel may run: the server has one queue (and thread) for each.
fn possible_cpus() -> usize {
    let s = fs::read_to_string("/sys/devices/system/cpu/possible").unwrap();
    s.trim()
        .split(',')
        .map(|r| match r.split_once('-') {
            Some((a, b)) => b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1,
            None => 1,
        })
        .sum()
}

/// A server with the ring on (the default, `ServerOptions::uring`; stated so that these tests
/// do not depend on it).
fn ring_env() -> Env {
    Env::with_server(ServerOptions {
        uring: true,
        ..Default::default()
    })
}

fn ring_mount(env: &Env, name: &str) -> MountGuard {
    let m = env.mount(&env.empty(), name, MountOptions::default());
    assert_eq!(
        m.transport(),
        Transport::IoUring,
        "the kernel offers the ring"
    );
    m
}

fn dev_fuse_mount(env: &Env, name: &str) -> MountGuard {
    let opts = MountOptions {
        uring: false,
        ..Default::default()
    };
    let m = env.mount(&env.empty(), name, opts);
    assert_eq!(m.transport(), Transport::DevFuse);
    m
}

/// Many small files made, written, read back, renamed, chmod'ed and some removed, as an
/// install or an untar does; plus a directory, a symlink and an xattr.
fn small_file_workload(root: &Path) {
    let d = root.join("pkg/lib");
    fs::create_dir_all(&d).unwrap();
    for i in 0..300u32 {
        let body = format!("file {i}\n").repeat(1 + (i as usize % 40));
        let tmp = d.join(format!(".f{i}.tmp"));
        fs::write(&tmp, &body).unwrap();
        assert_eq!(fs::read_to_string(&tmp).unwrap(), body);
        let f = d.join(format!("f{i}.py"));
        fs::rename(&tmp, &f).unwrap();
        fs::set_permissions(&f, fs::Permissions::from_mode(0o600 + (i % 2) * 0o100)).unwrap();
        if i % 3 == 0 {
            fs::remove_file(&f).unwrap();
        }
    }
    // One write larger than a page and a read spanning the payload buffer's size.
    let big = random_bytes(7, (1 << 20) + 12345);
    fs::write(root.join("pkg/big.bin"), &big).unwrap();
    assert_eq!(fs::read(root.join("pkg/big.bin")).unwrap(), big);
    std::os::unix::fs::symlink("lib/f1.py", root.join("pkg/link")).unwrap();
    xattr(&root.join("pkg/lib/f1.py"), "user.origin", b"ring");
    assert_eq!(fs::read_dir(&d).unwrap().count(), 200);
}

/// Every entry under `root` with its mode, content (files) or target (symlinks): what the two
/// transports must agree on (times differ: the workloads run one after the other).
fn listing(root: &Path) -> std::collections::BTreeMap<std::path::PathBuf, (u32, Vec<u8>)> {
    let mut out = std::collections::BTreeMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let m = fs::symlink_metadata(&p).unwrap();
            let body = if m.is_dir() {
                todo.push(p.clone());
                Vec::new()
            } else if m.file_type().is_symlink() {
                fs::read_link(&p)
                    .unwrap()
                    .into_os_string()
                    .into_encoded_bytes()
            } else {
                fs::read(&p).unwrap()
            };
            out.insert(
                p.strip_prefix(root).unwrap().to_path_buf(),
                (m.mode(), body),
            );
        }
    }
    out
}

fn xattr(p: &Path, name: &str, value: &[u8]) {
    let p = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    let n = std::ffi::CString::new(name).unwrap();
    // SAFETY: valid C strings and a buffer of value.len() bytes.
    let r = unsafe {
        libc::setxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(r, 0, "setxattr: {}", std::io::Error::last_os_error());
}

#[test]
fn small_files_over_the_ring_match_the_dev_fuse_transport() {
    let env = ring_env();
    if !uring_available() {
        return;
    }
    let ring = ring_mount(&env, "ring");
    let dev = dev_fuse_mount(&env, "dev");
    small_file_workload(ring.mountpoint());
    small_file_workload(dev.mountpoint());
    assert_eq!(listing(dev.mountpoint()), listing(ring.mountpoint()));
    let served = ring.ring_requests();
    assert!(served > 1000, "the ring served {served} requests");
    assert_eq!(dev.ring_requests(), 0);
    assert_eq!(ring.ring_error(), None);
    // What the ring mount committed reads back the same over /dev/fuse.
    let committed = ring.commit().unwrap();
    let view = env.mount(
        &committed,
        "view",
        MountOptions {
            uring: false,
            ..Default::default()
        },
    );
    assert_eq!(listing(dev.mountpoint()), listing(view.mountpoint()));
    drop(view);
    drop(ring);
    drop(dev);
    assert_no_mounts_under(env.tmp.path());
}

#[test]
fn the_mount_info_names_the_transport() {
    let env = ring_env();
    if !uring_available() {
        return;
    }
    let svc = nodefs::service::Local::new(env.fs.clone());
    let base = env.empty();
    let mk = |name: &str, uring| {
        let mp = env.path(name);
        fs::create_dir_all(&mp).unwrap();
        let opts = MountOptions {
            upper_dir: env.path(&format!("upper-{name}")),
            uring,
            ..Default::default()
        };
        nodefs::service::FsService::mount(&svc, &base, &mp, &opts).unwrap()
    };
    let ring = mk("a", true);
    let dev = mk("b", false);
    assert_eq!(ring.transport, Transport::IoUring);
    assert_eq!(dev.transport, Transport::DevFuse);
    let listed = nodefs::service::FsService::mounts(&svc).unwrap();
    assert!(
        listed.contains(&ring) && listed.contains(&dev),
        "{listed:?}"
    );
    for m in [ring, dev] {
        nodefs::service::FsService::unmount(&svc, m.id).unwrap();
    }
}

/// A tar of `n` small files under `top/`.
fn make_tar(path: &Path, n: usize) {
    let mut b = tar::Builder::new(fs::File::create(path).unwrap());
    for i in 0..n {
        let body = format!("{i}\n").repeat(20);
        let mut h = tar::Header::new_gnu();
        h.set_size(body.len() as u64);
        h.set_mode(0o644);
        h.set_mtime(1_700_000_000);
        h.set_cksum();
        b.append_data(&mut h, format!("top/d{}/f{i}.txt", i % 50), body.as_bytes())
            .unwrap();
    }
    b.finish().unwrap();
}

fn count_files(dir: &Path) -> usize {
    fs::read_dir(dir).map_or(0, |rd| {
        rd.flatten()
            .map(|e| {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    count_files(&e.path())
                } else {
                    1
                }
            })
            .sum()
    })
}

#[test]
fn a_ring_broken_mid_untar_fails_its_mount_and_spares_the_others() {
    let env = ring_env();
    if !uring_available() {
        return;
    }
    let tarball = env.path("many.tar");
    make_tar(&tarball, 20_000);
    // Both on the server's one set of queues: the same threads serve their requests.
    let victim = ring_mount(&env, "victim");
    let other = ring_mount(&env, "other");
    let threads = env.fs.ring_threads();
    let one_mount = env.fs.ring_entries() / 2;
    let mut tar = Command::new("tar")
        .arg("-xf")
        .arg(&tarball)
        .arg("-C")
        .arg(victim.mountpoint())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while count_files(&victim.mountpoint().join("top")) < 500 {
        assert!(
            tar.try_wait().unwrap().is_none(),
            "tar ended before the ring broke"
        );
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "untar made no progress"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // The other mount is busy on the same queues while the victim's ring breaks.
    let busy = {
        let root = other.mountpoint().join("busy");
        std::thread::spawn(move || small_file_workload(&root))
    };
    victim.break_ring();
    // Never a hang: tar fails within the deadline.
    let status = loop {
        if let Some(s) = tar.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(60) {
            let _ = tar.kill();
            let _ = tar.wait();
            panic!("untar on a broken ring hung");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        !status.success(),
        "untar onto a broken ring reported success"
    );
    let why = victim.ring_error().expect("the failure is recorded");
    assert!(why.contains("kernel failed a command"), "{why}");
    // The mount's connection is aborted: requests fail instead of waiting.
    let e = fs::metadata(victim.mountpoint().join("top")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOTCONN), "{e}");

    // The server and its other mounts go on: the other ring still serves, a new mount works.
    busy.join().expect("the other mount's workload");
    let served = other.ring_requests();
    small_file_workload(other.mountpoint());
    assert!(
        other.ring_requests() > served,
        "the other mount is still on the ring"
    );
    assert_eq!(other.ring_error(), None);
    assert_eq!(env.fs.ring_threads(), threads, "the queues stay");
    let third = ring_mount(&env, "third");
    fs::write(third.mountpoint().join("x"), b"after").unwrap();
    assert_eq!(fs::read(third.mountpoint().join("x")).unwrap(), b"after");
    assert_eq!(
        fs::metadata(third.mountpoint().join("x")).unwrap().size(),
        5
    );

    // The broken mount unmounts and leaves nothing behind: its entries are released, the
    // other two mounts' stay.
    let mp = victim.mountpoint().to_path_buf();
    victim.unmount().unwrap();
    assert_no_mounts_under(&mp);
    assert_eq!(env.fs.ring_entries(), 2 * one_mount);
    drop(third);
    drop(other);
    assert_eq!(env.fs.ring_entries(), 0);
}

#[test]
fn a_servers_mounts_share_its_queues_and_release_their_entries() {
    let env = ring_env();
    if !uring_available() {
        return;
    }
    let cpus = possible_cpus();
    assert_eq!(
        env.fs.ring_threads(),
        0,
        "no queues before the first ring mount"
    );
    let a = ring_mount(&env, "a");
    assert_eq!(
        env.fs.ring_threads(),
        cpus,
        "one queue thread per possible CPU"
    );
    let per_mount = env.fs.ring_entries();
    assert!(per_mount >= cpus, "{per_mount} entries for {cpus} queues");
    let b = ring_mount(&env, "b");
    assert_eq!(
        env.fs.ring_threads(),
        cpus,
        "a second mount starts no thread"
    );
    assert_eq!(env.fs.ring_entries(), 2 * per_mount);
    fs::write(a.mountpoint().join("x"), b"a").unwrap();
    fs::write(b.mountpoint().join("x"), b"b").unwrap();
    assert_eq!(fs::read(a.mountpoint().join("x")).unwrap(), b"a");
    assert_eq!(fs::read(b.mountpoint().join("x")).unwrap(), b"b");
    // Mounts come and go (a sandbox's root): each takes its entries and gives them back.
    for i in 0..100 {
        let m = ring_mount(&env, &format!("c{i}"));
        assert_eq!(env.fs.ring_entries(), 3 * per_mount);
        let body = format!("cycle {i}").repeat(1 + i * 500);
        fs::write(m.mountpoint().join("f"), &body).unwrap();
        assert_eq!(fs::read_to_string(m.mountpoint().join("f")).unwrap(), body);
        assert!(m.ring_requests() > 0);
        m.unmount().unwrap();
        assert_eq!(
            env.fs.ring_entries(),
            2 * per_mount,
            "entries left after mount/unmount cycle {i}"
        );
        assert_eq!(env.fs.ring_threads(), cpus);
    }
    // The first two served throughout.
    assert_eq!(fs::read(a.mountpoint().join("x")).unwrap(), b"a");
    assert_eq!(fs::read(b.mountpoint().join("x")).unwrap(), b"b");
    drop(a);
    drop(b);
    assert_eq!(env.fs.ring_entries(), 0, "every entry released");
    assert_eq!(
        env.fs.ring_threads(),
        cpus,
        "the queues stay for the next mount"
    );
    assert_no_mounts_under(env.tmp.path());
}

#[test]
fn a_mount_the_kernel_refuses_the_ring_falls_back_and_releases_its_entries() {
    let env = ring_env();
    if !uring_available() {
        return;
    }
    let ring = ring_mount(&env, "ring");
    let one_mount = env.fs.ring_entries();
    env.fs.refuse_next_ring_register();
    let refused = env.mount(&env.empty(), "refused", MountOptions::default());
    assert_eq!(
        refused.transport(),
        Transport::DevFuse,
        "a refused REGISTER means /dev/fuse"
    );
    small_file_workload(refused.mountpoint());
    assert_eq!(refused.ring_requests(), 0);
    assert_eq!(refused.ring_error(), None);
    // The queues go on serving the other mount, and the next mount takes the ring again.
    small_file_workload(ring.mountpoint());
    let next = ring_mount(&env, "next");
    fs::write(next.mountpoint().join("x"), b"ring").unwrap();
    assert!(next.ring_requests() > 0);
    // The refused mount's entries that did register (other queues) go with its connection.
    drop(refused);
    drop(next);
    assert_eq!(env.fs.ring_entries(), one_mount);
    drop(ring);
    assert_eq!(env.fs.ring_entries(), 0);
    assert_no_mounts_under(env.tmp.path());
}
