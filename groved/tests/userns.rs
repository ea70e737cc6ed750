//! Sandboxes in user namespaces (`userns: true`), for real through groved: sandbox root is an
//! unprivileged host uid from a range of its own, nodefs shows the image's owners through it, and
//! sandbox root's capabilities stop at objects the host owns. Snapshots of such a sandbox are
//! refused (409) until CRIU restores them into ranges of their own.

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
    let _shared = common::EXCLUSIVE.read().unwrap();
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

    // Checkpoint of a userns sandbox is refused, naming why; the sandbox keeps running.
    let e = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{a}/snapshot"),
            Some(json!({})),
        )
        .expect_error(409, None);
    assert!(
        e.to_string().contains("user namespace"),
        "the 409 says why: {e}"
    );
    assert_eq!(sh(d, &a, "echo alive").1, "alive");
    // A pause (an idle reclaim's too) freezes it instead of parking it in the store; the next
    // exec thaws it.
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
