//! Concurrent opens on fresh mounts: the kernel's per-inode I/O mode rules (passthrough vs
//! cached) must never turn a race between opens into EIO, and writers must coexist with
//! readers of ordinary files.

mod common;

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};

use common::*;
use nodefs::{ManifestId, MountOptions};

/// Files of every open-mode class: executables, a shared library, ordinary files, a large one.
const FILES: &[(&str, usize, u32)] = &[
    ("usr/bin/python3.11", 1 << 20, 0o755),
    ("usr/bin/tool", 200_000, 0o755),
    ("usr/lib/libx.so.6", 300_000, 0o644),
    ("etc/data.txt", 50_000, 0o644),
    ("etc/small.conf", 300, 0o644),
    ("var/log/app.log", 10_000, 0o644),
];

fn image(env: &Env) -> (ManifestId, Vec<Vec<u8>>) {
    let src = env.path("src");
    let mut contents = Vec::new();
    for (k, (name, len, mode)) in FILES.iter().enumerate() {
        let p = src.join(name);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        let data = random_bytes(100 + k as u64, *len);
        fs::write(&p, &data).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(*mode)).unwrap();
        contents.push(data);
    }
    (env.store.import_dir(&src).unwrap(), contents)
}

#[test]
fn concurrent_opens_on_fresh_mounts_never_fail() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let (id, contents) = image(&env);
    let contents = Arc::new(contents);
    const THREADS: usize = 16;
    const OPENS: usize = 75;
    for round in 0..4 {
        let m = env.mount(&id, &format!("r{round}"), MountOptions::default());
        let mp = m.mountpoint().to_path_buf();
        let barrier = Arc::new(Barrier::new(THREADS));
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (mp, contents, barrier) = (mp.clone(), contents.clone(), barrier.clone());
                std::thread::spawn(move || -> Result<usize, String> {
                    barrier.wait();
                    let mut n = 0;
                    for i in 0..OPENS {
                        // Every 16th open is O_RDWR on the log; the rest read the others.
                        let k = if (t + i) % 16 == 15 {
                            5
                        } else {
                            (t * 7 + i) % 5
                        };
                        let p = mp.join(FILES[k].0);
                        let err =
                            |e: std::io::Error| format!("thread {t} open {i} {}: {e}", FILES[k].0);
                        if k == 5 {
                            let mut f = OpenOptions::new()
                                .read(true)
                                .write(true)
                                .open(&p)
                                .map_err(err)?;
                            let mut b = [0u8; 16];
                            f.read_exact(&mut b).map_err(err)?;
                            f.write_all(&b).map_err(err)?;
                        } else {
                            let mut f = File::open(&p).map_err(err)?;
                            // Read a prefix most times, the whole file sometimes.
                            let mut buf = Vec::new();
                            if i % 8 == 0 {
                                f.read_to_end(&mut buf).map_err(err)?;
                                if buf != contents[k] {
                                    return Err(format!("{}: wrong content", FILES[k].0));
                                }
                            } else {
                                buf.resize(4096.min(contents[k].len()), 0);
                                f.read_exact(&mut buf).map_err(err)?;
                                if buf[..] != contents[k][..buf.len()] {
                                    return Err(format!("{}: wrong prefix", FILES[k].0));
                                }
                            }
                        }
                        n += 1;
                    }
                    Ok(n)
                })
            })
            .collect();
        let mut errors = Vec::new();
        let mut done = 0;
        for w in workers {
            match w.join().unwrap() {
                Ok(n) => done += n,
                Err(e) => errors.push(e),
            }
        }
        assert!(errors.is_empty(), "round {round}: {errors:#?}");
        assert_eq!(done, THREADS * OPENS);
    }
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

/// Fork `n` children that block on a pipe, then open and read `path` all at once when it
/// closes. Returns each child's errno (0 = success).
fn open_at_once(path: &Path, n: usize) -> Vec<i32> {
    let c = cpath(path);
    let mut fds = [0i32; 2];
    // SAFETY: fds has room for two descriptors.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let mut pids = Vec::new();
    for _ in 0..n {
        // SAFETY: the child only makes async-signal-safe calls (read, open, close, _exit)
        // on memory prepared before the fork.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let mut buf = [0u8; 65536];
            // SAFETY: valid fds, buffer and C string; the child exits without unwinding.
            unsafe {
                libc::close(fds[1]);
                libc::read(fds[0], buf.as_mut_ptr().cast(), 1);
                let fd = libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    libc::_exit(*libc::__errno_location());
                }
                let r = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
                let code = if r < 0 { *libc::__errno_location() } else { 0 };
                libc::close(fd);
                libc::_exit(code);
            }
        }
        pids.push(pid);
    }
    // SAFETY: closing our pipe ends wakes every child at once.
    unsafe {
        libc::close(fds[0]);
        libc::close(fds[1]);
    }
    pids.into_iter()
        .map(|pid| {
            let mut status = 0;
            // SAFETY: pid is our child; status is a valid out pointer.
            assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
            assert!(libc::WIFEXITED(status), "child killed: {status}");
            libc::WEXITSTATUS(status)
        })
        .collect()
}

#[test]
fn processes_opening_a_base_executable_at_the_same_instant() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let (id, _) = image(&env);
    let mut failures = Vec::new();
    for round in 0..25 {
        let m = env.mount(&id, &format!("x{round}"), MountOptions::default());
        let exe = m.mountpoint().join(FILES[round % 2].0);
        let codes = open_at_once(&exe, 2 + round % 3);
        if codes.iter().any(|&c| c != 0) {
            failures.push((round, codes));
        }
    }
    assert!(
        failures.is_empty(),
        "open errnos per round (5 = EIO): {failures:?}"
    );
}

fn mounted(env: &Env, name: &str) -> (MountGuard, PathBuf) {
    let (id, _) = image(env);
    let m = env.mount(&id, name, MountOptions::default());
    let mp = m.mountpoint().to_path_buf();
    (m, mp)
}

#[test]
fn append_while_another_process_reads() {
    if !fuse_available() {
        return;
    }
    let env = Env::new();
    let (_m, mp) = mounted(&env, "a");
    for name in ["var/log/app.log", "etc/small.conf", "usr/lib/libx.so.6"] {
        let p = mp.join(name);
        let before = fs::read(env.path("src").join(name)).unwrap();
        // This process reads to the end and keeps the file open.
        let mut r = File::open(&p).unwrap();
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        assert!(got == before);
        // Another process appends.
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg("printf 'appended line\\n' >> \"$0\"")
            .arg(&p)
            .output()
            .unwrap();
        if name.ends_with(".so.6") {
            // A shared library read through passthrough refuses writers, as native Linux
            // does for a running executable.
            assert!(!out.status.success(), "{name}: writer refused");
            continue;
        }
        assert!(
            out.status.success(),
            "{name}: append failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut more = Vec::new();
        r.read_to_end(&mut more).unwrap();
        assert_eq!(
            more, b"appended line\n",
            "{name}: reader sees the new bytes"
        );
        // And an O_WRONLY|O_APPEND open from this process while the reader stays open.
        let mut w = OpenOptions::new()
            .append(true)
            .custom_flags(libc::O_WRONLY)
            .open(&p)
            .unwrap();
        w.write_all(b"second\n").unwrap();
        drop(w);
        let mut more = Vec::new();
        r.read_to_end(&mut more).unwrap();
        assert_eq!(more, b"second\n");
        assert_eq!(fs::metadata(&p).unwrap().len() as usize, before.len() + 21);
    }
}

#[test]
fn large_files_pass_through_and_refuse_writers_only_while_read() {
    if !fuse_available() {
        return;
    }
    // The one case where a writer still meets ETXTBSY: a large ordinary file (>= 64 MiB)
    // read through passthrough. The kernel allows one read-only backing file per inode,
    // so the writer waits for the readers' release, briefly, and is refused.
    let env = Env::new();
    let src = env.path("src");
    fs::create_dir_all(&src).unwrap();
    let pattern: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    let mut f = File::create(src.join("big.img")).unwrap();
    for _ in 0..64 {
        f.write_all(&pattern).unwrap();
    }
    drop(f);
    let id = env.store.import_dir(&src).unwrap();
    let m = env.mount(&id, "m", MountOptions::default());
    let p = m.mountpoint().join("big.img");
    // The first open is served while the whole-file object is made in the background.
    drop(File::open(&p).unwrap());
    let cache = env.path("store/cache");
    let t = std::time::Instant::now();
    let made = || {
        fs::read_dir(&cache).is_ok_and(|d| {
            d.flatten()
                .any(|e| !e.file_name().to_string_lossy().contains(".tmp"))
        })
    };
    while !made() {
        assert!(t.elapsed().as_secs() < 20, "whole-file object made");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let mut r = File::open(&p).unwrap();
    let mut b = vec![1u8; 4096];
    r.read_exact(&mut b).unwrap();
    assert!(b[..] == pattern[..4096]);
    let e = OpenOptions::new().append(true).open(&p).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ETXTBSY));
    drop(r);
    // Once the reader is gone the writer gets in, and new readers see what it wrote.
    let mut w = OpenOptions::new().append(true).open(&p).unwrap();
    w.write_all(b"tail").unwrap();
    drop(w);
    let mut r = File::open(&p).unwrap();
    assert_eq!(r.metadata().unwrap().len(), (64 << 20) + 4);
    let mut tail = Vec::new();
    std::io::Seek::seek(&mut r, std::io::SeekFrom::Start(64 << 20)).unwrap();
    r.read_to_end(&mut tail).unwrap();
    assert_eq!(tail, b"tail");
}
