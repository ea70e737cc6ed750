//! The sandbox boundary attacked from inside real sandboxes (issue 24): host device nodes, the
//! seccomp allowlist, host paths in mountinfo; and that an agent's ordinary work still runs.

mod common;

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use common::*;
use grove_runtime::ExecRequest;

/// Runs a python3 script in the sandbox; panics unless it exits 0.
fn py(rt: &grove_runtime::Runtime, id: &grove_runtime::SandboxId, script: &str) -> String {
    let r = rt
        .exec(id, ExecRequest::argv(["python3", "-c", script]))
        .unwrap();
    assert_eq!(
        r.exit_code,
        Some(0),
        "{}\n{}",
        out(&r),
        String::from_utf8_lossy(&r.stderr)
    );
    out(&r)
}

/// (name, block?, major, minor) of the host devices the tester opened; numbers of dynamic ones
/// (userfaultfd, vsock) as this host has them.
fn host_devices() -> Vec<(&'static str, bool, u64, u64)> {
    let dynamic = |path: &str, major: u64, minor: u64| {
        std::fs::metadata(path)
            .ok()
            .filter(|m| m.file_type().is_char_device())
            .map_or((major, minor), |m| {
                let rdev = m.rdev();
                (libc::major(rdev) as u64, libc::minor(rdev) as u64)
            })
    };
    let (uffd_major, uffd_minor) = dynamic("/dev/userfaultfd", 10, 126);
    let (vsock_major, vsock_minor) = dynamic("/dev/vsock", 10, 121);
    vec![
        ("loop0", true, 7, 0),
        ("vda", true, 254, 0),
        ("kvm", false, 10, 232),
        ("userfaultfd", false, uffd_major, uffd_minor),
        ("kmsg", false, 1, 11),
        ("loop-control", false, 10, 237),
        ("fuse", false, 10, 229),
        ("vsock", false, vsock_major, vsock_minor),
        ("tty1", false, 4, 1),
        ("console", false, 5, 1),
        ("mem", false, 1, 1),
    ]
}

fn mknod_at(path: &Path, block: bool, major: u64, minor: u64) {
    let kind = if block {
        nix::sys::stat::SFlag::S_IFBLK
    } else {
        nix::sys::stat::SFlag::S_IFCHR
    };
    nix::sys::stat::mknod(
        path,
        kind,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(major, minor),
    )
    .unwrap_or_else(|e| panic!("mknod {}: {e}", path.display()));
}

/// Opens each path read-only and write-only (non-blocking, so a tty cannot hang it) and prints
/// `path errno_read errno_write` (0: it opened).
const OPEN_EACH: &str = r#"
import os, sys
for p in sys.argv[1:]:
    res = []
    for flags in (os.O_RDONLY, os.O_WRONLY):
        try:
            os.close(os.open(p, flags | os.O_NONBLOCK | os.O_NOCTTY))
            res.append(0)
        except OSError as e:
            res.append(e.errno)
    print(p, *res)
"#;

fn open_each(
    rt: &grove_runtime::Runtime,
    id: &grove_runtime::SandboxId,
    paths: &[String],
) -> Vec<(String, i32, i32)> {
    let mut argv = vec!["python3".to_string(), "-c".into(), OPEN_EACH.into()];
    argv.extend(paths.iter().cloned());
    let r = rt.exec(id, ExecRequest::argv(argv)).unwrap();
    assert_eq!(
        r.exit_code,
        Some(0),
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
    out(&r)
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (
                f[0].to_string(),
                f[1].parse().unwrap(),
                f[2].parse().unwrap(),
            )
        })
        .collect()
}

/// Issue 24 break 1. Inside: mknod of any device fails (no CAP_MKNOD). Nodes the sandbox did not
/// make, placed from the host into its /dev or its root, stay shut (device allowlist: EPERM).
/// /dev's own nodes still work.
#[test]
fn host_devices_stay_shut() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;

    // The tester's attack, verbatim: a loop device node read and written (dd then only makes a
    // plain file).
    let r = sh(
        &rt,
        &id,
        "mknod /dev/hd b 7 0; echo mknod=$?; head -c 21 /dev/hd; echo head=$?; \
         printf X | dd of=/dev/hd conv=notrunc 2>/dev/null; test -b /dev/hd; echo block=$?; rm -f /dev/hd",
    );
    let text = out(&r);
    assert!(
        text.contains("mknod=1") && text.contains("head=1") && text.contains("block=1"),
        "{text}\n{}",
        String::from_utf8_lossy(&r.stderr)
    );
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("Operation not permitted"),
        "{r:?}"
    );
    // mknod(2) of each device the tester made, anywhere: EPERM. A FIFO needs no CAP_MKNOD.
    let mut script = String::from("import os, stat\n");
    for (name, block, major, minor) in host_devices() {
        let kind = if block {
            "stat.S_IFBLK"
        } else {
            "stat.S_IFCHR"
        };
        for dir in ["/dev", "/dev/shm", "/tmp", "/root"] {
            script += &format!(
                "try:\n  os.mknod('{dir}/{name}', {kind} | 0o666, os.makedev({major}, {minor})); print('made {dir}/{name}')\nexcept OSError as e:\n  assert e.errno == 1, e\n"
            );
        }
    }
    script += "os.mkfifo('/tmp/fifo'); print('fifo ok')\n";
    assert_eq!(py(&rt, &id, &script), "fifo ok");

    // Nodes placed by other means, where the sandbox can see them.
    let init = rt.checkpoint_view(&id).unwrap().init_pid;
    let sandbox_dev = PathBuf::from(format!("/proc/{init}/root/dev"));
    let root_dir = rt.checkpoint_view(&id).unwrap().root_dir;
    let mut paths = Vec::new();
    for (name, block, major, minor) in host_devices() {
        mknod_at(&sandbox_dev.join(format!("h-{name}")), block, major, minor);
        // /dev/shm is a directory of /dev's tmpfs (no `nodev`): the allowlist alone holds there.
        mknod_at(
            &sandbox_dev.join(format!("shm/h-{name}")),
            block,
            major,
            minor,
        );
        mknod_at(&root_dir.join(format!("h-{name}")), block, major, minor);
        paths.push(format!("/dev/h-{name}"));
        paths.push(format!("/dev/shm/h-{name}"));
        paths.push(format!("/h-{name}"));
    }
    for (path, rd, wr) in open_each(&rt, &id, &paths) {
        // In /dev the allowlist refuses (EPERM); on the nosuid,nodev root nodev does first (EACCES).
        let want = if path.starts_with("/dev/") {
            libc::EPERM
        } else {
            libc::EACCES
        };
        assert_eq!((rd, wr), (want, want), "open {path}");
    }

    // /dev's own nodes, a pty and a shell's redirections still work.
    let devs: Vec<String> = ["null", "zero", "full", "random", "urandom", "pts/ptmx"]
        .iter()
        .map(|d| format!("/dev/{d}"))
        .collect();
    for (path, rd, wr) in open_each(&rt, &id, &devs) {
        assert_eq!((rd, wr), (0, 0), "open {path}");
    }
    let checks = [
        ("echo x > /dev/null && head -c 3 /dev/zero | wc -c", "3"),
        ("head -c 8 /dev/urandom | wc -c", "8"),
        (
            "echo x > /dev/full 2>/dev/null && echo wrote || echo ENOSPC",
            "ENOSPC",
        ),
        (
            "script -qec 'tty; echo in-a-pty' /dev/null | tr -d '\\r' | sed 's/[0-9]*$//'",
            "/dev/pts/\nin-a-pty",
        ),
    ];
    for (cmd, want) in checks {
        assert_eq!(out(&sh(&rt, &id, cmd)), want, "{cmd}");
    }
    let pty = "import os, pty\nm, s = pty.openpty()\nos.write(s, b'hi\\n')\nprint(os.read(m, 10).strip().decode(), os.ttyname(s).rstrip('0123456789'))";
    assert_eq!(py(&rt, &id, pty), "hi /dev/pts/");

    // The v1 allowlist as the kernel holds it.
    let list = PathBuf::from(format!(
        "/sys/fs/cgroup/devices/{}/{id}/devices.list",
        rt.config().cgroup_root
    ));
    if list.exists() {
        let got = std::fs::read_to_string(&list).unwrap();
        let got: Vec<&str> = got.lines().collect();
        assert_eq!(
            got,
            grove_runtime::cgroup::device_rules(),
            "{}",
            list.display()
        );
    }
    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
}

/// The cgroup2 device program on its own (as pure-v2 hosts have only it): a host process moved
/// into a cgroup2 dir carrying it, root with every capability, opens /dev/null but none of the
/// host's devices, even through a node it just made.
#[test]
fn cgroup2_device_program_holds_alone() {
    if !can_run() {
        return;
    }
    let base = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        .iter()
        .map(PathBuf::from)
        .find(|b| b.join("cgroup.procs").exists() && !b.join("tasks").exists());
    let Some(base) = base else {
        capability_missing("no cgroup2 mount at /sys/fs/cgroup or /sys/fs/cgroup/unified");
        return;
    };
    let dir = base.join(format!("grove-devtest-{}", std::process::id()));
    std::fs::create_dir(&dir).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        grove_runtime::cgroup::attach_device_filter(&dir).expect("attach");
        let made = tmp.path().join("loop0");
        let script = format!(
            "import os, stat\nos.mknod('{}', stat.S_IFBLK | 0o600, os.makedev(7, 0))\n{OPEN_EACH}",
            made.display()
        );
        let procs = dir.join("cgroup.procs");
        let r = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "echo $$ > {} && exec python3 -c \"$0\" /dev/null /dev/zero {} /dev/kvm /dev/kmsg /dev/loop-control /dev/loop0 /dev/tty1",
                procs.display(),
                made.display()
            ))
            .arg(&script)
            .output()
            .unwrap();
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let text = String::from_utf8_lossy(&r.stdout).to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[..2], ["/dev/null 0 0", "/dev/zero 0 0"], "{text}");
        for l in &lines[2..] {
            let p = l.split(' ').next().unwrap();
            if Path::new(p).exists() {
                assert!(l.ends_with(" 1 1"), "{l}: EPERM wanted");
            }
        }
        assert_eq!(lines.len(), 8, "{text}");
    }));
    for _ in 0..100 {
        if std::fs::remove_dir(&dir).is_ok() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(!dir.exists(), "{} left", dir.display());
    res.unwrap();
}

/// Syscalls tried from inside, with the errno wanted (0: the call is let through; its own result
/// is then whatever the kernel says, so the check is only that the filter did not answer).
const SYSCALLS: &[(&str, &str, i32)] = &[
    // Socket families and raw sockets (socket: 41).
    ("vsock", "41, 40, 1, 0", libc::EPERM),
    ("packet_raw", "41, 17, 3, 0x300", libc::EPERM),
    ("packet_dgram", "41, 17, 2, 0x300", libc::EPERM),
    ("inet_raw", "41, 2, 3, 1", libc::EPERM),
    (
        "inet_raw_cloexec",
        "41, 2, 3 | 0x80000 | 0x800, 6",
        libc::EPERM,
    ),
    ("inet6_raw", "41, 10, 3, 58", libc::EPERM),
    ("inet_packet", "41, 2, 10, 0", libc::EPERM),
    ("inet_stream", "41, 2, 1 | 0x80000, 0", 0),
    ("inet6_dgram", "41, 10, 2, 0", 0),
    ("unix_stream", "41, 1, 1, 0", 0),
    ("netlink_raw", "41, 16, 3, 0", 0),
    // personality (135): only Docker's values.
    ("personality_query", "135, 0xffffffff", 0),
    (
        "personality_read_implies_exec",
        "135, 0x0400000",
        libc::EPERM,
    ),
    ("personality_addr_compat", "135, 0x0200000", libc::EPERM),
    // Off the allowlist: refused whatever the arguments (kcmp of a process with itself would
    // answer 0, pidfd_getfd of a bad fd EBADF, an unassigned number ENOSYS).
    (
        "kcmp",
        "312, os.getpid(), os.getpid(), 0, 0, 0",
        libc::EPERM,
    ),
    ("pidfd_getfd", "438, -1, 0, 0", libc::EPERM),
    ("process_madvise", "440, -1, 0, 0, 0, 0", libc::EPERM),
    ("name_to_handle_at", "303, -100, b'/', 0, 0, 0", libc::EPERM),
    ("fanotify_init", "300, 0, 0", libc::EPERM),
    ("add_key", "248, 0, 0, 0, 0, 0", libc::EPERM),
    ("keyctl", "250, 0, 0, 0, 0, 0", libc::EPERM),
    ("set_mempolicy", "238, 0, 0, 0", libc::EPERM),
    ("statmount", "457, 0, 0, 0, 0", libc::EPERM),
    ("listmount", "458, 0, 0, 0, 0", libc::EPERM),
    ("io_uring_setup", "425, 1, 0", libc::EPERM),
    ("userfaultfd", "323, 0", libc::EPERM),
    ("unassigned_400", "400", libc::EPERM),
    // Past the list's last number: ENOSYS, so a libc probing a newer call falls back.
    ("beyond_last_470", "470", libc::ENOSYS),
    ("beyond_last_1000", "1000", libc::ENOSYS),
    ("clone3", "435, 0, 0", libc::ENOSYS),
    // ptrace stays allowed as Docker allows it: a missing pid answers ESRCH, not EPERM.
    ("ptrace", "101, 12, 999999, 0, 0", 0),
    ("kill0", "62, os.getpid(), 0", 0),
];

/// Harden the defaults: the seccomp allowlist refuses what is not on it, with EPERM, and ENOSYS
/// past the last syscall it knows.
#[test]
fn seccomp_allowlist_refuses_off_list_calls() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;
    let mut script = String::from(
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n\
         def t(nr, *a):\n  ctypes.set_errno(0)\n  r = libc.syscall(nr, *[ctypes.c_long(x) if isinstance(x, int) else x for x in a])\n  return ctypes.get_errno() if r == -1 else 0\n",
    );
    for (name, args, _) in SYSCALLS {
        script += &format!("print('{name}', t({args}))\n");
    }
    let text = py(&rt, &id, &script);
    let got: Vec<(&str, i32)> = text
        .lines()
        .map(|l| {
            let (n, e) = l.split_once(' ').unwrap();
            (n, e.parse().unwrap())
        })
        .collect();
    assert_eq!(got.len(), SYSCALLS.len(), "{text}");
    for ((name, _, want), (got_name, errno)) in SYSCALLS.iter().zip(&got) {
        assert_eq!(name, got_name);
        if *want == 0 {
            assert!(
                ![libc::EPERM, libc::ENOSYS].contains(errno),
                "{name}: refused with {errno}"
            );
        } else {
            assert_eq!(errno, want, "{name}");
        }
    }
    let status = out(&sh(
        &rt,
        &id,
        "grep -E '^Seccomp(_filters)?:' /proc/self/status",
    ));
    assert!(status.contains("Seccomp:\t2"), "{status}");
    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
}

/// `cap_add: ["MKNOD"]` (opt-in) gives the sandbox back mknod(2), and nothing more: a host device
/// node it makes still cannot be opened (the allowlist in /dev, `nodev` on the root), while an
/// allowed one it makes can. Without the opt-in the same mknod is refused (host_devices_stay_shut).
#[test]
fn cap_add_mknod_makes_nodes_that_stay_shut() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let mut s = spec();
    s.cap_add = vec![grove_runtime::Capability::Mknod];
    let id = rt.create(s).expect("create").id;
    let made = py(
        &rt,
        &id,
        "import os, stat\n\
         for p, dev in [('/dev/my-loop', (7, 0)), ('/root/my-loop', (7, 0)), ('/dev/my-null', (1, 3)), ('/root/my-null', (1, 3))]:\n\
         \x20 kind = stat.S_IFBLK if dev[0] == 7 else stat.S_IFCHR\n\
         \x20 os.mknod(p, kind | 0o666, os.makedev(*dev))\n\
         print('made')",
    );
    assert_eq!(made, "made");
    let paths: Vec<String> = [
        "/dev/my-loop",
        "/root/my-loop",
        "/dev/my-null",
        "/root/my-null",
    ]
    .iter()
    .map(|p| p.to_string())
    .collect();
    let opened: std::collections::BTreeMap<String, (i32, i32)> = open_each(&rt, &id, &paths)
        .into_iter()
        .map(|(p, r, w)| (p, (r, w)))
        .collect();
    assert_eq!(
        opened["/dev/my-loop"],
        (libc::EPERM, libc::EPERM),
        "device allowlist"
    );
    // On the root (nosuid,nodev) both refuse: the allowlist answers first for the loop device,
    // nodev for the null one. Which errno a layer gives is the kernel's; that it refuses is ours.
    for p in ["/root/my-loop", "/root/my-null"] {
        let (rd, wr) = opened[p];
        assert!(
            [libc::EPERM, libc::EACCES].contains(&rd) && [libc::EPERM, libc::EACCES].contains(&wr),
            "{p} opened on the nodev root: {:?}",
            opened[p]
        );
    }
    assert_eq!(
        opened["/dev/my-null"],
        (0, 0),
        "an allowed device stays usable"
    );
    rt.destroy(&id).unwrap();
}

/// What an agent does all day still works under the allowlist and without CAP_MKNOD: bash job
/// control, python threads, subprocess, asyncio and loopback sockets, mmap, git, ps, a pty.
#[test]
fn ordinary_agent_work_still_runs() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;
    let script = r#"
import asyncio, mmap, os, socket, subprocess, threading, tempfile
res = []
t = [threading.Thread(target=res.append, args=(i,)) for i in range(8)]
[x.start() for x in t]; [x.join() for x in t]
assert sorted(res) == list(range(8))
assert subprocess.run(["sh", "-c", "echo sub"], capture_output=True).stdout == b"sub\n"
srv = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
srv.bind(("::1", 0)); srv.listen()
c = socket.create_connection(srv.getsockname()[:2]); a, _ = srv.accept()
c.sendall(b"ping"); assert a.recv(4) == b"ping"
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("127.0.0.1", 0))
u.sendto(b"dgram", u.getsockname()); assert u.recv(5) == b"dgram"
async def echo():
    async def handle(r, w):
        w.write(await r.read(3)); await w.drain(); w.close()
    s = await asyncio.start_server(handle, "127.0.0.1", 0)
    r, w = await asyncio.open_connection(*s.sockets[0].getsockname())
    w.write(b"abc"); await w.drain()
    got = await r.read(3); s.close(); return got
assert asyncio.run(echo()) == b"abc"
with tempfile.TemporaryFile() as f:
    f.write(b"x" * 8192); f.flush()
    m = mmap.mmap(f.fileno(), 8192); m[0:1] = b"y"; assert m[:2] == b"yx"; m.close()
anon = mmap.mmap(-1, 1 << 20); anon[-1] = 7; assert anon[-1] == 7
print("python ok")
"#;
    assert_eq!(py(&rt, &id, script), "python ok");
    let checks = [
        (
            "cd /tmp && git init -q r && cd r && echo hi > f && git add f && \
             git -c user.email=a@b -c user.name=a commit -qm one && git log --oneline | wc -l",
            "1",
        ),
        // Until the forked shell has exec'd sleep (a loaded machine may show it as `sh` first).
        (
            "sleep 5 & p=$!; for i in $(seq 100); do [ \"$(ps -o comm= -p $p)\" = sleep ] && break; \
             sleep 0.02; done; ps -o comm= -p $p; kill $p",
            "sleep",
        ),
        ("echo $(( $(getconf _NPROCESSORS_ONLN) > 0 ))", "1"),
        ("script -qec 'echo $((6*7))' /dev/null | tr -d '\\r'", "42"),
        (
            "chmod 600 /tmp && stat -c %a /tmp && chmod 1777 /tmp",
            "600",
        ),
    ];
    for (cmd, want) in checks {
        let r = sh(&rt, &id, cmd);
        assert_eq!(
            out(&r),
            want,
            "{cmd}: {}",
            String::from_utf8_lossy(&r.stderr)
        );
    }
    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
}

/// Issue 24 break 9 (part): no mountinfo line a sandbox can read names the host's run dir or
/// state dir (the overlay's layer paths did).
#[test]
fn mountinfo_shows_no_host_paths() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;
    let text = out(&sh(
        &rt,
        &id,
        "cat /proc/self/mountinfo /proc/1/mountinfo /proc/self/mounts",
    ));
    assert!(text.lines().count() > 10, "{text}");
    let run_dir = rt.config().run_dir.display().to_string();
    let state_dir = rt.config().state_dir.display().to_string();
    // The installed init binary (what the runtime was given) must not show through its bind.
    let installed: Vec<String> = std::env::var("GROVE_INIT_BINARY")
        .into_iter()
        .chain([env!("CARGO_BIN_EXE_grove-init").to_string()])
        .collect();
    let init_line = text
        .lines()
        .find(|l| l.split(' ').nth(4) == Some(grove_runtime::proto::INIT_PATH))
        .unwrap_or_else(|| panic!("no init bind in {text}"));
    assert_eq!(
        init_line.split(' ').nth(3),
        Some("/grove-init"),
        "{init_line}"
    );
    for line in text.lines() {
        for host in [&run_dir, &state_dir].into_iter().chain(&installed) {
            assert!(!line.contains(host.as_str()), "{host} in: {line}");
        }
    }
    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
}
