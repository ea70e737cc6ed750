//! The `grove` command line against a real groved (the one in common/mod.rs).

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{daemon, grove_bin, EXCLUSIVE};

fn grove(args: &[&str]) -> Output {
    let d = daemon();
    Command::new(grove_bin())
        .arg("--socket")
        .arg(&d.socket)
        .args(args)
        .output()
        .expect("run grove")
}

fn ok(args: &[&str]) -> String {
    let o = grove(args);
    assert!(
        o.status.success(),
        "grove {args:?}: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// Fails with exactly one line on stderr.
fn fails(args: &[&str], code: i32) -> String {
    let o = grove(args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(code), "grove {args:?}: {err}");
    assert_eq!(err.lines().count(), 1, "one line on stderr, got: {err:?}");
    err
}

#[test]
fn sandbox_verbs() {
    let _g = EXCLUSIVE.read().unwrap();
    let id = ok(&[
        "create", "debian12", "-l", "cli=1", "-e", "V=42", "--memory", "128",
    ])
    .trim()
    .to_string();
    assert!(id.starts_with("sb-"), "{id}");
    assert!(ok(&["ls"]).contains(&id));
    assert_eq!(ok(&["ls", "-q", "-l", "cli=1"]).trim(), id);
    let v: serde_json::Value = serde_json::from_str(&ok(&["inspect", &id])).unwrap();
    assert_eq!(v["labels"]["cli"], "1");

    let o = grove(&[
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "echo out $V; echo err >&2; exit 3",
    ]);
    assert_eq!(o.status.code(), Some(3));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "out 42\n");
    assert_eq!(String::from_utf8_lossy(&o.stderr), "err\n");
    let o = grove(&["exec", "--timeout", "0.3", &id, "--", "sleep", "10"]);
    assert_eq!(o.status.code(), Some(124));
    let pid = ok(&["exec", "-d", &id, "--", "sleep", "100"]);
    assert!(pid.trim().parse::<i32>().unwrap() > 0);

    // cp: file and directory, both ways
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("f.txt"), "file body").unwrap();
    std::fs::create_dir_all(tmp.path().join("tree/sub")).unwrap();
    std::fs::write(tmp.path().join("tree/sub/g.txt"), "deep").unwrap();
    ok(&[
        "cp",
        tmp.path().join("f.txt").to_str().unwrap(),
        &format!("{id}:/tmp/f.txt"),
    ]);
    ok(&[
        "cp",
        tmp.path().join("tree").to_str().unwrap(),
        &format!("{id}:/work"),
    ]);
    assert_eq!(
        ok(&[
            "exec",
            &id,
            "--",
            "cat",
            "/tmp/f.txt",
            "/work/tree/sub/g.txt"
        ]),
        "file bodydeep"
    );
    let back = tmp.path().join("back");
    std::fs::create_dir(&back).unwrap();
    ok(&["cp", &format!("{id}:/tmp/f.txt"), back.to_str().unwrap()]);
    assert_eq!(
        std::fs::read_to_string(back.join("f.txt")).unwrap(),
        "file body"
    );
    ok(&["cp", &format!("{id}:/work/tree"), back.to_str().unwrap()]);
    let found = walk(&back.join("tree"));
    assert!(found.iter().any(|p| p.ends_with("g.txt")), "{found:?}");
    fails(&["cp", "a", "b"], 2);

    ok(&["pause", &id]);
    assert!(ok(&["ls", "--state", "paused"]).contains(&id));
    ok(&["resume", &id]);

    let snap = format!("cli-snap-{}", common::rand_suffix());
    assert_eq!(ok(&["snapshot", &id, "--name", &snap]).trim(), snap);
    let forks: Vec<String> = ok(&["fork", &snap, "-n", "2"])
        .lines()
        .map(String::from)
        .collect();
    assert_eq!(forks.len(), 2);
    assert_eq!(
        ok(&["exec", &forks[0], "--", "cat", "/tmp/f.txt"]),
        "file body"
    );

    let mut rm = vec!["rm", id.as_str()];
    rm.extend(forks.iter().map(String::as_str));
    assert_eq!(ok(&rm).lines().count(), 3);
    fails(&["rm", &id], 1);
    let err = fails(&["exec", &id, "--", "true"], 1);
    assert!(err.contains("not_found"), "{err}");
    let d = daemon();
    d.call(
        hyper::Method::DELETE,
        &format!("/v1/snapshots/{snap}"),
        None,
    )
    .expect(204);
}

fn walk(p: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            out.push(e.path().display().to_string());
            out.extend(walk(&e.path()));
        }
    }
    out
}

#[test]
fn run_images_and_maintenance() {
    let _g = EXCLUSIVE.read().unwrap();
    let o = grove(&["run", "debian12", "--", "sh", "-c", "echo ran; exit 5"]);
    assert_eq!(
        o.status.code(),
        Some(5),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&o.stdout), "ran\n");
    assert!(ok(&["images", "ls"]).contains("debian12"));
    let err = fails(&["images", "import", "x", "/no/such/dir"], 1);
    assert!(err.contains("path"), "{err}");
    ok(&["gc"]);
    ok(&["fsck"]);
    fails(&["create", "no-such-image"], 1);
    fails(&["create", "debian12", "--memory", "-3"], 2);
    fails(&["exec"], 2);
    fails(&["frobnicate"], 2);
    assert!(ok(&["--help"]).contains("snapshot"));
}

#[test]
fn events_stream() {
    let _g = EXCLUSIVE.read().unwrap();
    let d = daemon();
    let mut child = Command::new(grove_bin())
        .arg("--socket")
        .arg(&d.socket)
        .arg("events")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let id = ok(&["create", "debian12"]).trim().to_string();
    ok(&["rm", &id]);
    std::thread::sleep(Duration::from_millis(500));
    child.kill().unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let kinds: Vec<String> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["sandbox"] == id.as_str())
        .map(|v| v["kind"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(kinds, ["created", "destroyed"], "{text}");
}

/// What sandboxes made and destroyed through the CLI leave behind: nothing. The other tests of
/// this binary are held off meanwhile (any order of tests gives the same answer).
#[test]
fn residue_through_the_daemon_is_clean() {
    // A test that failed (and so poisoned the lock) is reported by itself.
    let _g = EXCLUSIVE.write().unwrap_or_else(|e| e.into_inner());
    let d = daemon();
    let sandboxes = || {
        d.call(hyper::Method::GET, "/v1/sandboxes", None)
            .expect(200)
            .json()["items"]
            .as_array()
            .unwrap()
            .len()
    };
    // Every other test of the binary ended (or has not begun), and each removes its sandboxes.
    let before = sandboxes();
    assert_eq!(before, 0, "sandboxes left by the other tests");
    let id = ok(&["create", "debian12", "-l", "residue=1"])
        .trim()
        .to_string();
    assert_eq!(
        ok(&[
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "mkdir -p /tmp/x && echo hi > /dev/shm/y; echo ok"
        ])
        .trim(),
        "ok"
    );
    assert_eq!(sandboxes(), before + 1);
    ok(&["rm", &id]);
    assert_eq!(sandboxes(), before, "the sandbox is gone from the list");
    ok(&["residue"]);
}
