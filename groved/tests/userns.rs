//! Sandboxes in user namespaces (`userns: true`), for real through groved: sandbox root is an
//! unprivileged host uid from a range of its own, nodefs shows the image's owners through it, and
//! sandbox root's capabilities stop at objects the host owns. Snapshots of such a sandbox fork
//! (and pauses to the store resume) into ranges of their own.

mod common;

use std::os::unix::fs::MetadataExt;
use std::process::{Child, Command};
use std::time::Duration;

use common::{daemon, Daemon, BASE_IMAGE_DIR};
use hyper::Method;
use serde_json::{json, Value};

fn sh(d: &Daemon, id: &str, cmd: &str) -> (i64, String, String) {
    let v = d.exec(id, cmd);
    (
        v["exit_code"].as_i64().unwrap_or(-1),
        v["stdout"].as_str().unwrap_or("").trim().to_string(),
        v["stderr"].as_str().unwrap_or("").to_string(),
    )
}

fn get(d: &Daemon, id: &str) -> Value {
    d.call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .expect(200)
        .json()
}

/// The host id range of sandbox `id`: its init's uid_map, read from the host.
fn host_base(d: &Daemon, id: &str) -> u32 {
    let pid = get(d, id)["init_pid"].as_i64().unwrap();
    let map = std::fs::read_to_string(format!("/proc/{pid}/uid_map")).unwrap();
    let f: Vec<u64> = map.split_whitespace().map(|x| x.parse().unwrap()).collect();
    assert_eq!((f[0], f[2]), (0, 65536), "uid_map {map:?}");
    f[1] as u32
}

fn root_on_host(d: &Daemon, id: &str) -> std::path::PathBuf {
    d.dir.join("run/sandboxes").join(id).join("root")
}

/// A host-root process placed in the sandbox's pid namespace (as a host tool entering it would
/// be); its pid as the sandbox sees it, and the child to reap.
fn host_process_in(d: &Daemon, id: &str) -> (Child, String) {
    let pid = get(d, id)["init_pid"].as_i64().unwrap();
    let mut child = Command::new("nsenter")
        .args(["-t", &pid.to_string(), "-p", "--", "sleep", "300"])
        .spawn()
        .expect("nsenter");
    // nsenter forks the sleep into the namespace: find it by its parent, from inside.
    for _ in 0..100 {
        let (_, out, _) = sh(
            d,
            id,
            "for p in /proc/[0-9]*; do [ \"$(cat $p/comm 2>/dev/null)\" = sleep ] && basename $p; done",
        );
        if let Some(p) = out.lines().next() {
            return (child, p.to_string());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("the host's sleep never showed in {id}");
}

#[test]
fn userns_sandbox_root_is_unprivileged_on_the_host() {
    let d = daemon();
    // The node's id ranges to itself: it checks which range a new sandbox gets.
    let _alone = common::EXCLUSIVE.write().unwrap();
    let a = d.create(json!({"userns": true}));
    assert_eq!(get(d, &a)["userns"], true);
    let base = host_base(d, &a);
    assert!(base >= 65536, "a range above the host's own ids: {base}");

    // Inside: root, the range in uid_map, the image's owners.
    let (rc, out, err) = sh(
        d,
        &a,
        "id -u; id -g; cat /proc/self/uid_map; stat -c %u:%g /etc/shadow /var/mail /; \
         touch /root/made; mkdir /tmp/x; stat -c %u:%g /root/made; chown 1000:1000 /root/made",
    );
    assert_eq!(rc, 0, "{out} {err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(&lines[..2], ["0", "0"]);
    let map: Vec<&str> = lines[2].split_whitespace().collect();
    assert_eq!(map, ["0", &base.to_string(), "65536"]);
    for (i, path) in ["etc/shadow", "var/mail", ""].iter().enumerate() {
        let m = std::fs::metadata(std::path::Path::new(BASE_IMAGE_DIR).join(path)).unwrap();
        assert_eq!(lines[3 + i], format!("{}:{}", m.uid(), m.gid()), "/{path}");
    }
    assert_eq!(lines[6], "0:0");

    // Seen from the host, through the mount: the same owners moved into the range.
    let host_root = root_on_host(d, &a);
    let made = std::fs::metadata(host_root.join("root/made")).unwrap();
    assert_eq!((made.uid(), made.gid()), (base + 1000, base + 1000));
    let shadow = std::fs::metadata(host_root.join("etc/shadow")).unwrap();
    let image_shadow = std::fs::metadata(format!("{BASE_IMAGE_DIR}/etc/shadow")).unwrap();
    assert_eq!(shadow.gid(), base + image_shadow.gid());
    let tmp_owner = std::fs::metadata(host_root.join("root")).unwrap().uid();
    assert_eq!(tmp_owner, base, "the image's root-owned /root");
    // Sandbox pid 1 is the range's first id on the host, not host root.
    let pid = get(d, &a)["init_pid"].as_i64().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    assert!(
        uid_line
            .split_whitespace()
            .skip(1)
            .all(|u| u == base.to_string()),
        "{uid_line}"
    );

    // A file the host writes through the files API belongs to sandbox root.
    let w = d.send(
        Method::PUT,
        &format!("/v1/sandboxes/{a}/files?path=/root/uploaded"),
        Some(("application/octet-stream", b"hi".to_vec().into())),
        &[],
    );
    assert_eq!(w.status, 204, "{}", w.text());
    assert_eq!(sh(d, &a, "stat -c %u:%g /root/uploaded").1, "0:0");

    // Attacks. Device nodes still cannot be made (the loop-device attack).
    let (rc, _, err) = sh(d, &a, "mknod /tmp/hd b 7 0");
    assert_ne!(rc, 0, "mknod in a userns sandbox: {err}");
    // A host-root process reachable by pid: sandbox root can neither read its memory-adjacent
    // files nor signal it, although it keeps CAP_KILL and CAP_DAC_OVERRIDE in its own userns.
    let (mut host, p) = host_process_in(d, &a);
    let (rc, out, err) = sh(
        d,
        &a,
        &format!("stat -c %u /proc/{p}; cat /proc/{p}/environ >/dev/null; echo rc=$?; kill -9 {p}; echo rc=$?"),
    );
    assert_eq!(rc, 0, "{out} {err}");
    assert!(
        out.starts_with("65534"),
        "host root shows as the overflow id: {out}"
    );
    assert!(
        out.contains("rc=1\n") && out.ends_with("rc=1"),
        "{out} {err}"
    );
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        host.try_wait().unwrap().is_none(),
        "the host's process was killed"
    );

    // The same attack from a sandbox without a user namespace succeeds: what the layer adds.
    let plain = d.create(json!({}));
    let (mut host2, p2) = host_process_in(d, &plain);
    let (_, out, _) = sh(d, &plain, &format!("kill -9 {p2}; echo rc=$?"));
    assert_eq!(out, "rc=0");
    assert!(!host2.wait().unwrap().success(), "killed from the sandbox");
    d.delete(&plain);
    let _ = host.kill();
    let _ = host.wait();

    // Two sandboxes get disjoint ranges; a destroyed one's range is free again.
    let b = d.create(json!({"userns": true}));
    let base_b = host_base(d, &b);
    assert!(base_b.abs_diff(base) >= 65536, "{base} {base_b}");
    let b_made = sh(d, &b, "touch /root/b; echo ok").1;
    assert_eq!(b_made, "ok");
    assert_eq!(
        std::fs::metadata(root_on_host(d, &b).join("root/b"))
            .unwrap()
            .uid(),
        base_b
    );

    // A plain pause freezes it; the next exec thaws it.
    let p = d
        .call(Method::POST, &format!("/v1/sandboxes/{a}/pause"), None)
        .expect(200)
        .json();
    assert_eq!(p["state"], "paused", "{p}");
    assert!(!p["init_pid"].is_null(), "frozen, not parked: {p}");
    assert_eq!(sh(d, &a, "echo thawed").1, "thawed");

    d.delete(&a);
    let c = d.create(json!({"userns": true}));
    assert_eq!(
        host_base(d, &c),
        base.min(base_b),
        "the lowest free range again"
    );
    d.delete(&b);
    d.delete(&c);
    assert_eq!(d.residue()["items"], json!([]));
}

/// The real uid, as the host sees it, of the process named `comm` in sandbox `id`.
fn host_uid_of(d: &Daemon, id: &str, comm: &str) -> Option<u32> {
    let init = get(d, id)["init_pid"].as_i64().unwrap();
    let ns = std::fs::read_link(format!("/proc/{init}/ns/pid")).unwrap();
    std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
        let p = e.path();
        let same_ns = std::fs::read_link(p.join("ns/pid")).ok()? == ns;
        let named = std::fs::read_to_string(p.join("comm")).ok()?.trim() == comm;
        let status = std::fs::read_to_string(p.join("status")).ok()?;
        let uid = status.lines().find(|l| l.starts_with("Uid:"))?;
        (same_ns && named).then(|| uid.split_whitespace().nth(1)?.parse().ok())?
    })
}

/// Sandbox root attacks its pid 1: ptrace attach, then its memory. Both must fail, also in a
/// restored branch (whose pid 1 is dumpable, see grove-init's `guard_from_ptrace`).
const PTRACE_PID1: &str = r#"python3 - <<'EOF'
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
if libc.ptrace(16, 1, None, None) == 0:
    os.waitpid(1, 0x40000000)
    libc.ptrace(17, 1, None, None)
    print("attached")
else:
    print(errno.errorcode[ctypes.get_errno()])
for f in ("/proc/1/mem", "/proc/1/environ"):
    try:
        open(f, "rb").read(1)
        print("read " + f)
    except OSError as e:
        print(errno.errorcode[e.errno])
EOF"#;

fn counter(d: &Daemon, id: &str) -> u64 {
    let (rc, out, err) = sh(d, id, "cat /tmp/counter");
    assert_eq!(rc, 0, "{err}");
    out.parse()
        .unwrap_or_else(|_| panic!("counter in {id}: {out:?}"))
}

/// A snapshot of a userns sandbox forks into branches that each run in a host id range of their
/// own, not the source's (which CRIU's images name): otherwise one branch's root would own every
/// other branch's files and processes. Each branch continues the source's processes, its tmpfs
/// files keep their owners, and a pause to the store resumes into a range too.
#[test]
fn userns_snapshots_fork_into_ranges_of_their_own() {
    let d = daemon();
    let _shared = common::EXCLUSIVE.read().unwrap();
    let a = d.create(json!({"userns": true}));
    let base = host_base(d, &a);
    let (rc, _, err) = sh(
        d,
        &a,
        "echo base > /root/state && echo t > /tmp/t && chown 1000:1000 /tmp/t",
    );
    assert_eq!(rc, 0, "{err}");
    for shell in [
        "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.05; done",
        "exec setpriv --reuid=1000 --regid=1000 --clear-groups sleep 600",
    ] {
        d.call(
            Method::POST,
            &format!("/v1/sandboxes/{a}/processes"),
            Some(json!({ "shell": shell })),
        )
        .expect(201);
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(host_uid_of(d, &a, "sleep"), Some(base + 1000));
    assert_eq!(sh(d, &a, PTRACE_PID1).1, "EPERM\nEACCES\nEACCES");
    let before = counter(d, &a);
    let name = format!("userns-{}", common::rand_suffix());
    d.call(
        Method::POST,
        &format!("/v1/sandboxes/{a}/snapshot"),
        Some(json!({ "name": name })),
    )
    .expect(201);
    let branches = d.fork(&name, json!({"count": 2}));
    let mut bases = vec![base];
    for b in &branches {
        let bb = host_base(d, b);
        assert!(
            !bases.contains(&bb),
            "{b} shares a range: {bb} in {bases:?}"
        );
        bases.push(bb);
        let (rc, out, err) = sh(
            d,
            b,
            "cat /root/state; stat -c %u:%g /tmp/t; id -u; touch /root/mine",
        );
        assert_eq!(rc, 0, "{out} {err}");
        assert_eq!(out, "base\n1000:1000\n0", "{b}");
        // From the host: the branch's processes and new files are in its own range.
        let init = get(d, b)["init_pid"].as_i64().unwrap();
        let status = std::fs::read_to_string(format!("/proc/{init}/status")).unwrap();
        let uid = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
        assert_eq!(uid.split_whitespace().nth(1), Some(bb.to_string().as_str()));
        assert_eq!(host_uid_of(d, b, "sleep"), Some(bb + 1000), "{b}");
        let mine = std::fs::metadata(root_on_host(d, b).join("root/mine")).unwrap();
        assert_eq!((mine.uid(), mine.gid()), (bb, bb));
        // The restored loop runs on from where the snapshot caught it.
        let c1 = counter(d, b);
        assert!(c1 >= before, "{b}: {c1} < {before}");
        std::thread::sleep(Duration::from_millis(300));
        assert!(counter(d, b) > c1, "the restored loop runs on in {b}");
        assert_eq!(sh(d, b, PTRACE_PID1).1, "EPERM\nEACCES\nEACCES", "{b}");
    }
    assert_eq!(sh(d, &a, "cat /root/state").1, "base");
    assert_eq!(host_uid_of(d, &a, "sleep"), Some(base + 1000));

    // A pause to the store parks the branch (its range freed); the resume maps a range again.
    let b = &branches[0];
    let p = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{b}/pause?to=store"),
            None,
        )
        .expect(200)
        .json();
    assert!(p["init_pid"].is_null(), "parked, nothing runs: {p}");
    let r = d
        .call(Method::POST, &format!("/v1/sandboxes/{b}/resume"), None)
        .expect(200)
        .json();
    assert_eq!(r["state"], "running", "{r}");
    let rb = host_base(d, b);
    assert!(
        !bases[..1].contains(&rb) && rb != bases[2],
        "resumed into a range in use: {rb} {bases:?}"
    );
    assert_eq!(host_uid_of(d, b, "sleep"), Some(rb + 1000));
    assert_eq!(
        sh(d, b, "cat /root/state; stat -c %u /tmp/t").1,
        "base\n1000"
    );

    for id in branches.iter().chain([&a]) {
        d.delete(id);
    }
    d.call(Method::DELETE, &format!("/v1/snapshots/{name}"), None)
        .expect(204);
    assert_eq!(d.residue()["items"], json!([]));
}

#[test]
fn userns_must_be_a_bool() {
    let d = daemon();
    let r = d.call_invalid(
        Method::POST,
        "/v1/sandboxes",
        r#"{"image":"debian12","userns":"yes"}"#,
    );
    r.expect_error(422, Some("userns"));
}

/// An egress sandbox in a user namespace dumps, but CRIU cannot restore its veth into a branch's
/// own user namespace: its snapshot is refused (501, naming why) before anything is recorded, and
/// a pause freezes it instead.
#[test]
fn userns_egress_snapshots_are_refused_before_anything_is_kept() {
    let d = daemon();
    let _shared = common::EXCLUSIVE.read().unwrap();
    let net = json!({"mode": "egress", "allow": [{"cidr": "192.0.2.0/24"}]});
    let a = d.create(json!({"userns": true, "network": net}));
    let name = format!("userns-egress-{}", common::rand_suffix());
    let e = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{a}/snapshot"),
            Some(json!({ "name": name })),
        )
        .expect_error(501, None);
    assert!(e.to_string().contains("user namespace"), "{e}");
    d.call(Method::GET, &format!("/v1/snapshots/{name}"), None)
        .expect_error(404, None);
    let p = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{a}/pause?to=store"),
            None,
        )
        .expect(200)
        .json();
    assert!(!p["init_pid"].is_null(), "frozen, not parked: {p}");
    assert_eq!(sh(d, &a, "echo alive").1, "alive");
    d.delete(&a);
    assert_eq!(d.residue()["items"], json!([]));
}
