//! Fork branches share their clean pages through ksmd, and stay independent when they write.

mod common;

use std::time::{Duration, Instant};

use common::grove::{self, Env};
use grove_runtime::{ExecRequest, SandboxId};
use grove_snapshotter::{ksm, ForkOptions, SnapshotOptions};

/// A 48 MiB random heap; its sha256 in /root/h0 once ready. SIGUSR1 rewrites a byte of every
/// page; SIGUSR2 writes the heap's hash again to /root/h (tmp + rename: the test reads it whole).
const HEAP_APP: &str = r#"
import hashlib, os, signal
heap = bytearray(os.urandom(48 << 20))
def put(name):
    with open('/root/h.tmp', 'w') as f:
        f.write(hashlib.sha256(heap).hexdigest())
    os.rename('/root/h.tmp', '/root/' + name)
def mutate(*_):
    for off in range(0, len(heap), 4096):
        heap[off] ^= 0xff
signal.signal(signal.SIGUSR1, mutate)
signal.signal(signal.SIGUSR2, lambda *_: put('h'))
put('h0')
while True:
    signal.pause()
"#;

const HEAP_PAGES: u64 = (48 << 20) / 4096;

/// Host pid of the sandbox's python3, found among init's descendants.
fn python_pid(init: i32) -> i32 {
    let mut todo = vec![init];
    while let Some(p) = todo.pop() {
        if std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "python3") {
            return p;
        }
        todo.extend(grove_sys::proc::children(p));
    }
    panic!("no python3 under init {init}");
}

/// `ksm_merging_pages` of process `pid`: its pages that are one shared page with others'.
fn merging_pages(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/ksm_stat"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("ksm_merging_pages "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn wait_file(env: &Env, id: &SandboxId, path: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = env
            .rt
            .exec(id, ExecRequest::shell(format!("cat {path} 2>/dev/null")))
            .unwrap();
        let out = String::from_utf8_lossy(&r.stdout).trim().to_string();
        if out.len() == 64 {
            return out;
        }
        assert!(Instant::now() < deadline, "{id}: no {path}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The hash the sandbox's heap has now (SIGUSR2, then /root/h).
fn heap_hash(env: &Env, id: &SandboxId) -> String {
    env.sh(id, "rm -f /root/h; pkill -USR2 -x python3");
    wait_file(env, id, "/root/h")
}

fn knobs() -> Vec<String> {
    ["run", "pages_to_scan", "sleep_millisecs"]
        .map(|k| {
            std::fs::read_to_string(format!("/sys/kernel/mm/ksm/{k}"))
                .unwrap()
                .trim()
                .to_string()
        })
        .to_vec()
}

#[test]
fn branches_share_clean_pages_and_diverge_on_write() {
    let Some(_serial) = grove::serial_with_prereqs() else {
        return;
    };
    if !ksm::available() {
        grove_testkit::capability_missing("this kernel has no KSM or no PR_SET_MEMORY_MERGE");
        return;
    }
    common::tree::become_subreaper();
    let env = Env::new("grove-stest-merge");
    assert!(env.snap.merges_fork_pages(), "merging is on by default");
    let src = env.rt.create(env.spec()).unwrap();
    env.rt
        .write_file(&src.id, "/root/heap.py", HEAP_APP.as_bytes(), None)
        .unwrap();
    let mut req = ExecRequest::shell("exec python3 /root/heap.py");
    req.background = true;
    env.rt.exec(&src.id, req).unwrap();
    let original = wait_file(&env, &src.id, "/root/h0");
    let before = knobs();

    let snap = env
        .snap
        .snapshot(&src.id, SnapshotOptions::default())
        .unwrap();
    let branches: Vec<_> = env
        .snap
        .fork(&snap.id, 4, ForkOptions::default())
        .unwrap()
        .into_iter()
        .map(|r| r.expect("branch"))
        .collect();
    let pids: Vec<i32> = branches
        .iter()
        .map(|b| python_pid(b.init_pid.expect("init pid")))
        .collect();
    for (b, pid) in branches.iter().zip(&pids) {
        assert!(ksm::merges_any(*pid), "{}: python3 is not mergeable", b.id);
    }

    // ksmd folds the four heaps into one: most of each branch's heap pages become shared.
    let deadline = Instant::now() + Duration::from_secs(60);
    let want = HEAP_PAGES * 3 / 4;
    loop {
        let merged: Vec<u64> = pids.iter().map(|p| merging_pages(*p)).collect();
        if merged.iter().all(|m| *m >= want) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "branches' merged pages {merged:?}, want each >= {want} of {HEAP_PAGES}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // A write to a shared page is the writer's own: branch 0 changes every page of its heap,
    // the others keep the snapshot's heap byte for byte.
    env.sh(&branches[0].id, "pkill -USR1 -x python3");
    let changed = heap_hash(&env, &branches[0].id);
    assert_ne!(changed, original, "branch 0's heap changed");
    for b in &branches[1..] {
        assert_eq!(
            heap_hash(&env, &b.id),
            original,
            "{}: heap as at the snapshot",
            b.id
        );
    }
    assert_eq!(
        heap_hash(&env, &src.id),
        original,
        "the source is untouched"
    );

    // Once the branches settle, ksmd's knobs are back as the fork found them.
    let deadline = Instant::now() + Duration::from_secs(150);
    while std::path::Path::new(ksm::KSM_DIR).join("saved").exists() {
        assert!(
            Instant::now() < deadline,
            "ksmd still boosted: {:?}",
            knobs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        knobs(),
        before,
        "ksmd's run, pages_to_scan, sleep_millisecs"
    );

    // Off: branches are restored as before, nothing mergeable.
    env.snap.set_merge_fork_pages(false);
    let plain = env
        .snap
        .fork(&snap.id, 1, ForkOptions::default())
        .unwrap()
        .remove(0)
        .expect("branch");
    let pid = python_pid(plain.init_pid.expect("init pid"));
    assert!(
        !ksm::merges_any(pid),
        "merging off: python3 is not mergeable"
    );
    env.finish();
}
