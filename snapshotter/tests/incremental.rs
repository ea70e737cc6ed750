//! Incremental snapshots by userfaultfd write-protect (docs/incremental-snapshots.md): a second
//! snapshot of a sandbox with a 64 MiB heap, after 2 % of the heap's pages were rewritten, is
//! incremental and stands alone once taken (the base's pages copied in); a fork of it (a lazy
//! restore) answers with the source's heap hash at that snapshot; a lost base and a pause each
//! make the next dump full and say why. (Twenty rounds of byte-identity under fork, mmap, MADV_DONTNEED and mremap are in
//! rounds.rs.)

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::grove::{self, Env};
use grove_runtime::{ExecRequest, Limits, SandboxId};
use grove_snapshotter::{ForkOptions, MemoryDump, SnapshotInfo, SnapshotOptions};

const HEAP_MB: usize = 64;

/// Keeps a heap and, for each request file /root/req.<n> ("touch <frac>" or "hash", one line),
/// rewrites that fraction of its pages or hashes it, answering in /root/ans.<n>.
const WORKLOAD: &str = r#"
import hashlib, os, random, time
PAGE = 4096
heap = bytearray(random.Random(7).randbytes(HEAP_MB << 20))
n = 0
while True:
    p = f'/root/req.{n}'
    if not os.path.exists(p):
        time.sleep(0.005)
        continue
    req = open(p).read()
    if not req.endswith('\n'):
        # Seen mid-write: the file exists before its line does.
        time.sleep(0.005)
        continue
    req = req.split()
    if req[0] == 'touch':
        r = random.Random(n)
        pages = len(heap) // PAGE
        for i in r.sample(range(pages), int(pages * float(req[1]))):
            heap[i * PAGE] = (heap[i * PAGE] + 1) % 256
    out = hashlib.sha256(heap).hexdigest()
    with open(f'/root/ans.{n}.tmp', 'w') as f:
        f.write(out)
    os.rename(f'/root/ans.{n}.tmp', f'/root/ans.{n}')
    n += 1
"#;

struct Workload<'a> {
    env: &'a Env,
    id: SandboxId,
    next: u64,
}

impl Workload<'_> {
    /// Sends one request to the workload in `id` (the source, or a branch at the same count).
    fn ask(&mut self, id: &SandboxId, req: &str) -> String {
        let n = self.next;
        self.next += 1;
        self.env
            .rt
            .write_file(
                id,
                &format!("/root/req.{n}"),
                format!("{req}\n").as_bytes(),
                None,
            )
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(b) = self.env.rt.read_file(id, &format!("/root/ans.{n}")) {
                return String::from_utf8(b).unwrap();
            }
            assert!(Instant::now() < deadline, "no answer to {req} in {id}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn snapshot(&self) -> SnapshotInfo {
        self.env
            .snap
            .snapshot(&self.id, SnapshotOptions::default())
            .unwrap()
    }
}

/// Bytes of the page images directly in `dir` (not in a nested `parent`).
fn pages_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("pages-"))
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

fn images(env: &Env, snap: &SnapshotInfo) -> PathBuf {
    env.run_dir.join("snapshots").join(&snap.id).join("images")
}

#[test]
fn a_second_snapshot_is_incremental_and_whole_and_a_lost_base_or_a_pause_makes_a_full_one() {
    let Some(_serial) = grove::serial_with_prereqs() else {
        return;
    };
    common::tree::become_subreaper();
    let env = Env::new("grove-stest-incr");
    if !env.snap.tracks_dirty_pages() {
        grove_testkit::capability_missing(&format!(
            "no userfaultfd write-protect tracking here ({:?}): incremental dumps are not built",
            env.snap.criu().features()
        ));
        return;
    }
    let mut spec = env.spec();
    spec.limits = Some(Limits {
        memory_mb: 512,
        ..Default::default()
    });
    let src = env.rt.create(spec).unwrap();
    let program = WORKLOAD.replace("HEAP_MB", &HEAP_MB.to_string());
    env.rt
        .write_file(&src.id, "/root/workload.py", program.as_bytes(), None)
        .unwrap();
    let mut req = ExecRequest::shell("python3 /root/workload.py");
    req.background = true;
    env.rt.exec(&src.id, req).unwrap();
    let mut w = Workload {
        env: &env,
        id: src.id.clone(),
        next: 0,
    };
    w.ask(&src.id, "hash");

    let first = w.snapshot();
    assert_eq!(first.memory_dump, MemoryDump::Full);
    assert!(
        first
            .full_dump_reason
            .as_deref()
            .is_some_and(|r| r.contains("first snapshot")),
        "{:?}",
        first.full_dump_reason
    );

    let hash = w.ask(&src.id, "touch 0.02");
    let second = w.snapshot();
    assert_eq!(
        second.memory_dump,
        MemoryDump::UffdWp,
        "{:?}",
        second.full_dump_reason
    );
    assert_eq!(second.full_dump_reason, None);
    // A branch of the incremental snapshot has the source's heap as of that snapshot.
    let branch = env
        .snap
        .fork(&second.id, 1, ForkOptions::default())
        .unwrap()
        .pop()
        .unwrap()
        .unwrap();
    let mut bw = Workload {
        env: &env,
        id: branch.id.clone(),
        next: w.next,
    };
    assert_eq!(bw.ask(&branch.id, "hash"), hash);
    env.rt.destroy(&branch.id).unwrap();

    // The fork waited for the base's pages to be copied in: the images stand alone, as large
    // as a full dump's.
    let dir = images(&env, &second);
    assert!(!dir.join("parent").exists(), "no parent left");
    let (own, first_own) = (pages_bytes(&dir), pages_bytes(&images(&env, &first)));
    eprintln!("second snapshot: {own} bytes of pages, the first {first_own}");
    assert!(
        own >= (HEAP_MB << 20) as u64,
        "the heap is all there: {own}"
    );

    // The base lost (as a restart loses it): the next dump is full and says why.
    let work = env.run_dir.join("snapshot-work");
    let bases: Vec<_> = std::fs::read_dir(&work)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("base-"))
        .map(|e| e.path())
        .collect();
    assert_eq!(
        bases.len(),
        1,
        "one base for the one tracked sandbox: {bases:?}"
    );
    std::fs::remove_dir_all(&bases[0]).unwrap();
    w.ask(&src.id, "touch 0.01");
    let third = w.snapshot();
    assert_eq!(third.memory_dump, MemoryDump::Full);
    assert!(
        third
            .full_dump_reason
            .as_deref()
            .is_some_and(|r| r.contains("gone")),
        "{:?}",
        third.full_dump_reason
    );
    // ... and the one after it is incremental again.
    w.ask(&src.id, "touch 0.01");
    let fourth = w.snapshot();
    assert_eq!(fourth.memory_dump, MemoryDump::UffdWp);

    // A pause ends the processes tracked: after the resume, a full dump, saying why.
    env.snap.pause(&src.id).unwrap();
    env.snap.resume(&src.id).unwrap();
    let after = w.snapshot();
    assert_eq!(after.memory_dump, MemoryDump::Full);
    assert!(after.full_dump_reason.is_some());

    for s in [&first, &second, &third, &fourth, &after] {
        let _ = env.snap.delete(&s.id);
    }
    env.rt.destroy(&src.id).unwrap();
    env.finish();
}
