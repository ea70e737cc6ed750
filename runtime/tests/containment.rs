//! Containment from inside a sandbox: pids and memory limits, the seccomp filter, capabilities,
//! masked /proc and /sys (root).

mod common;

use common::*;
use grove_runtime::{ExecRequest, Limits};

fn limits(memory_mb: u64, pids: u32) -> Limits {
    Limits {
        memory_mb,
        pids,
        ..Limits::default()
    }
}

#[test]
fn fork_bomb_stops_at_pids_limit() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let mut s = spec();
    s.limits = Some(Limits {
        open_files: 200,
        ..limits(256, 64)
    });
    let id = rt.create(s).expect("create").id;
    assert_eq!(out(&sh(&rt, &id, "ulimit -n; ulimit -Hn")), "200\n200");
    let py = "import os,time,errno\nn=0\ntry:\n  while True:\n    p=os.fork()\n    if p==0:\n      time.sleep(60); os._exit(0)\n    n+=1\nexcept OSError as e:\n  print(n, e.errno)\n";
    let r = rt
        .exec(&id, ExecRequest::argv(["python3", "-c", py]))
        .unwrap();
    let text = out(&r);
    let (n, errno) = text.split_once(' ').expect(&text);
    let n: u32 = n.parse().unwrap();
    assert!((50..64).contains(&n), "forked {n} before hitting the limit");
    assert_eq!(errno, "11", "EAGAIN");
    assert!(rt.usage(&id).unwrap().pids <= 64);
    // A real shell fork bomb, left running: destroy must still reclaim everything.
    let mut bomb = ExecRequest::shell("b() { b | b & }; b");
    bomb.background = true;
    rt.exec(&id, bomb).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
}

#[test]
fn memory_hog_is_oom_killed_in_its_own_cgroup_only() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let neighbour = rt.create(spec()).expect("create").id;
    let mut bg = ExecRequest::argv(["sleep", "1000"]);
    bg.background = true;
    let npid = rt.exec(&neighbour, bg).unwrap().pid.unwrap();

    let mut s = spec();
    s.limits = Some(limits(64, 128));
    let id = rt.create(s).expect("create").id;
    let r = rt
        .exec(
            &id,
            ExecRequest::argv([
                "python3",
                "-c",
                "a=[]\nwhile True: a.append(bytearray(8<<20))",
            ]),
        )
        .unwrap();
    assert_eq!(r.signal, Some(9), "{r:?}");
    let oom = std::fs::read_to_string(format!(
        "/sys/fs/cgroup/memory/grove-rtest/{id}/memory.oom_control"
    ));
    if let Ok(oom) = oom {
        assert!(
            oom.lines()
                .any(|l| l.starts_with("oom_kill ") && l != "oom_kill 0"),
            "{oom}"
        );
    }
    // The sandbox itself and its neighbour live on.
    assert_eq!(out(&sh(&rt, &id, "echo alive")), "alive");
    assert!(rt
        .processes(&neighbour)
        .unwrap()
        .iter()
        .any(|p| p.pid == npid && p.running));
    for id in [&id, &neighbour] {
        rt.destroy(id).unwrap();
        assert_gone(&rt, id);
    }
}

/// x86_64 syscall numbers of every refused family.
const DENIED: &[(&str, u32)] = &[
    ("mount", 165),
    ("umount2", 166),
    ("pivot_root", 155),
    ("kexec_load", 246),
    ("kexec_file_load", 320),
    ("init_module", 175),
    ("finit_module", 313),
    ("delete_module", 176),
    ("bpf", 321),
    ("perf_event_open", 298),
    ("keyctl", 250),
    ("add_key", 248),
    ("request_key", 249),
    ("open_by_handle_at", 304),
    ("userfaultfd", 323),
    ("io_uring_setup", 425),
    ("io_uring_enter", 426),
    ("io_uring_register", 427),
    ("unshare", 272),
    ("setns", 308),
    ("swapon", 167),
    ("swapoff", 168),
    ("reboot", 169),
    ("acct", 163),
    ("quotactl", 179),
    ("iopl", 172),
    ("ioperm", 173),
    ("clock_settime", 227),
    ("settimeofday", 164),
    ("clock_adjtime", 305),
    ("adjtimex", 159),
];

#[test]
fn refused_syscalls_caps_and_masks() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;
    let mut py = String::from("import ctypes\nlibc=ctypes.CDLL(None, use_errno=True)\n");
    py += "def t(nr, *a):\n  ctypes.set_errno(0)\n  r=libc.syscall(nr, *a)\n  return (r, ctypes.get_errno())\n";
    for (name, nr) in DENIED {
        py += &format!("print('{name}', *t({nr}, 0, 0, 0, 0, 0))\n");
    }
    // clone with a namespace flag (CLONE_NEWUSER | SIGCHLD) and clone3.
    py += "print('clone_newuser', *t(56, 0x10000000 | 17, 0, 0, 0, 0))\n";
    py += "print('clone3', *t(435, 0, 0))\n";
    // An x32 call (here getpid's x32 number): EPERM from the filter, where a kernel without the
    // x32 ABI would answer ENOSYS and one with it would run it.
    py += "print('x32_getpid', *t(0x40000000 | 39))\n";
    let r = rt
        .exec(&id, ExecRequest::argv(["python3", "-c", &py]))
        .unwrap();
    assert_eq!(
        r.exit_code,
        Some(0),
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
    let text = out(&r);
    for line in text.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        let want = if f[0] == "clone3" { "38" } else { "1" }; // ENOSYS / EPERM
        assert_eq!((f[1], f[2]), ("-1", want), "{line}");
    }
    assert_eq!(text.lines().count(), DENIED.len() + 3);

    let status = out(&sh(
        &rt,
        &id,
        "grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status",
    ));
    assert!(status.contains("CapEff:\t00000000a00425fb"), "{status}");
    assert!(status.contains("CapBnd:\t00000000a00425fb"), "{status}");
    assert!(status.contains("NoNewPrivs:\t1"), "{status}");
    assert!(status.contains("Seccomp:\t2"), "{status}");

    // Masked and read-only paths, private tmpfs, sandbox identity.
    let checks = [
        ("cat /proc/keys /proc/timer_list | wc -c", "0"),
        ("stat -c %t,%T /proc/keys", "1,3"),
        (
            "echo 1 > /proc/sys/kernel/domainname 2>/dev/null && echo writable || echo ro",
            "ro",
        ),
        (
            "echo 1 > /proc/sysrq-trigger 2>/dev/null && echo writable || echo ro",
            "ro",
        ),
        ("touch /sys/x 2>/dev/null && echo writable || echo ro", "ro"),
        ("ls /sys/firmware | wc -l", "0"),
        ("ls /proc/acpi 2>/dev/null | wc -l", "0"),
        (
            "touch /sys/firmware/x 2>/dev/null && echo writable || echo ro",
            "ro",
        ),
        (
            "stat -f -c %T /tmp /dev/shm /dev | tr '\\n' ' '",
            "tmpfs tmpfs tmpfs",
        ),
        ("echo $(ps -o pid= -p 1)", "1"),
        ("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '", "lo"),
        (
            "ls /dev | tr '\\n' ' '",
            "core fd full null ptmx pts random shm stderr stdin stdout tty urandom zero",
        ),
        ("head -c 4 /dev/urandom | wc -c", "4"),
        ("ps -o sid= -p 1 | tr -d ' '", "1"),
    ];
    for (cmd, want) in checks {
        assert_eq!(out(&sh(&rt, &id, cmd)), want, "{cmd}");
    }
    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
}
