//! Twenty rounds of mutate → snapshot → fork on one sandbox: in every round, every branch's
//! memory is byte-identical to the source's at the snapshot instant. The workload keeps a large
//! heap it rewrites in part each round, a child it forked at start (pages shared copy-on-write
//! with its parent until either writes them) and one it forks later, a shared and a private file
//! mapping it writes through, and an anonymous region it punches with MADV_DONTNEED and moves and
//! resizes with mremap between snapshots. Once every process has written its share of a round,
//! each publishes a hash of what it sees (the shared mapping holds every process's writes); in
//! each branch each process recomputes its own, which must equal the source's at that snapshot.
//! Where the kernel has userfaultfd write-protect but no soft-dirty, the snapshots after the
//! first must be incremental (`uffd_wp`, against the sandbox's last snapshot, which the test
//! has deleted by then: its images became the base once whole), except where the pages written
//! outgrew the base (a re-base), so the test covers that path; elsewhere the path is printed.

mod common;

use std::time::{Duration, Instant};

use common::grove::{self, Env};
use grove_runtime::{ExecRequest, Limits, SandboxId};
use grove_snapshotter::{ForkOptions, MemoryDump, SnapshotOptions};
use serde_json::Value;

const ROUNDS: u64 = 20;
const BRANCHES: u32 = 2;

/// One process per role: `p` (started by the test), `c1` (forked by `p` at start) and `c2`
/// (forked by `p` in round `FORK_C2`). Each answers requests in /root/<role>/.
const WORKLOAD: &str = r#"
import ctypes, hashlib, mmap, os, random, time, json
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mremap.restype = ctypes.c_void_p
libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PAGE, MB = 4096, 1 << 20
PROT_RW, MAP_ANON_PRIVATE, MADV_DONTNEED, MREMAP_MAYMOVE = 3, 0x22, 4, 1
FORK_C2 = 7

heap = bytearray(random.Random(1).randbytes(48 * MB))
for name in ('shared', 'private'):
    with open(f'/root/{name}.bin', 'wb') as f:
        f.write(random.Random(name).randbytes(2 * MB))
shared = mmap.mmap(os.open('/root/shared.bin', os.O_RDWR), 2 * MB, mmap.MAP_SHARED)
private = mmap.mmap(os.open('/root/private.bin', os.O_RDWR), 2 * MB, mmap.MAP_PRIVATE)
anon_len = 8 * MB
anon = libc.mmap(None, anon_len, PROT_RW, MAP_ANON_PRIVATE, -1, 0)
ctypes.memmove(anon, random.Random(2).randbytes(anon_len), anon_len)

def digest():
    # Per part, so that a difference names what differs.
    parts = {'heap': heap, 'anon': ctypes.string_at(anon, anon_len), 'shared': shared[:],
             'private': private[:], 'shared_file': open('/root/shared.bin', 'rb').read()}
    return ' '.join(f'{k}={hashlib.sha256(v).hexdigest()[:16]}' for k, v in parts.items())

def mutate(role, rnd):
    global anon, anon_len
    r = random.Random(f'{role}/{rnd}')
    for _ in range(len(heap) // PAGE // 20):           # ~5 % of the heap's pages
        i = r.randrange(len(heap) // PAGE) * PAGE + r.randrange(PAGE - 8)
        heap[i:i + 8] = r.randbytes(8)
    o = r.randrange(2 * MB - 64)
    shared[o:o + 64] = r.randbytes(64)
    o = r.randrange(2 * MB - 64)
    private[o:o + 64] = r.randbytes(64)
    if rnd % 2:
        # Drop a range: it reads back as zeros.
        off = r.randrange(anon_len // PAGE - 16) * PAGE
        assert libc.madvise(anon + off, 16 * PAGE, MADV_DONTNEED) == 0
    else:
        # Grow or shrink, letting the kernel move it; fill what is new.
        new_len = anon_len + r.choice([-1, 1, 2]) * 64 * PAGE
        p = libc.mremap(anon, anon_len, new_len, MREMAP_MAYMOVE, None)
        assert p != ctypes.c_void_p(-1).value, ctypes.get_errno()
        if new_len > anon_len:
            ctypes.memmove(p + anon_len, r.randbytes(new_len - anon_len), new_len - anon_len)
        anon, anon_len = p, new_len
    n = r.randrange(anon_len - 4096)
    ctypes.memmove(anon + n, r.randbytes(4096), 4096)

def serve(role):
    d = f'/root/{role}'
    os.makedirs(d, exist_ok=True)
    done = set()
    while True:
        reqs = [n for n in os.listdir(d) if n.startswith('req.') and n not in done]
        if not reqs:
            time.sleep(0.005)
            continue
        name = min(reqs, key=lambda n: int(n.split('.')[1]))
        with open(f'{d}/{name}') as f:
            req = f.read()
        if not req.endswith('\n'):
            time.sleep(0.005)
            continue
        done.add(name)
        cmd, seq, rnd = req.split()
        if cmd == 'mutate':
            if role == 'p' and int(rnd) == FORK_C2 and os.fork() == 0:
                return serve('c2')
            mutate(role, int(rnd))
        st = {'seq': int(seq), 'pid': os.getpid(), 'hash': digest()}
        with open(f'{d}/state.tmp', 'w') as o:
            json.dump(st, o)
        os.rename(f'{d}/state.tmp', f'{d}/state.json')

if os.fork() == 0:
    serve('c1')
else:
    serve('p')
"#;

/// Writes request `cmd seq round` for `role` and waits for its answer; the process's hash.
fn ask(env: &Env, id: &SandboxId, role: &str, cmd: &str, seq: u64, round: u64) -> String {
    let dir = format!("/root/{role}");
    // A new file per request: the app never reads a file being written (see common::app).
    env.rt
        .write_file(
            id,
            &format!("{dir}/req.{seq}"),
            format!("{cmd} {seq} {round}\n").as_bytes(),
            None,
        )
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(body) = env.rt.read_file(id, &format!("{dir}/state.json")) {
            if let Ok(v) = serde_json::from_slice::<Value>(&body) {
                if v["seq"] == seq {
                    return v["hash"].as_str().unwrap().to_string();
                }
            }
        }
        if Instant::now() > deadline {
            let ps = env
                .rt
                .exec(id, ExecRequest::shell("ps -ef; ls -l /root/*/"));
            let ps = ps
                .map(|r| String::from_utf8_lossy(&r.stdout).to_string())
                .unwrap_or_default();
            panic!("{role} in {id} did not answer {cmd} {seq} (round {round}):\n{ps}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn roles(round: u64) -> &'static [&'static str] {
    // c2 exists from the mutate of round 7 on (see FORK_C2 in the workload).
    if round >= 7 {
        &["p", "c1", "c2"]
    } else {
        &["p", "c1"]
    }
}

#[test]
fn twenty_rounds_of_mutate_snapshot_fork_keep_every_branch_byte_identical() {
    let Some(_serial) = grove::serial_with_prereqs() else {
        return;
    };
    common::tree::become_subreaper();
    let env = Env::new("grove-stest-rounds");
    let mut spec = env.spec();
    spec.limits = Some(Limits {
        memory_mb: 1024,
        ..Default::default()
    });
    let src = env.rt.create(spec).unwrap();
    env.rt
        .write_file(&src.id, "/root/workload.py", WORKLOAD.as_bytes(), None)
        .unwrap();
    let mut req = ExecRequest::shell("python3 /root/workload.py");
    req.background = true;
    env.rt.exec(&src.id, req).unwrap();

    let mut seq = 0;
    let mut paths = Vec::new();
    let mut reasons = Vec::new();
    for round in 1..=ROUNDS {
        for role in roles(round) {
            seq += 1;
            ask(&env, &src.id, role, "mutate", seq, round);
        }
        // After every process's writes: the shared mapping holds all of them.
        let mut want = Vec::new();
        for role in roles(round) {
            seq += 1;
            want.push((*role, ask(&env, &src.id, role, "hash", seq, round)));
        }
        let snap = env
            .snap
            .snapshot(
                &src.id,
                SnapshotOptions {
                    durable: false,
                    ..Default::default()
                },
            )
            .unwrap();
        paths.push(snap.memory_dump);
        reasons.push(snap.full_dump_reason.clone());
        let branches: Vec<_> = env
            .snap
            .fork(&snap.id, BRANCHES, ForkOptions::default())
            .unwrap()
            .into_iter()
            .map(|r| r.expect("branch"))
            .collect();
        for (i, b) in branches.iter().enumerate() {
            for (role, hash) in &want {
                seq += 1;
                let got = ask(&env, &b.id, role, "hash", seq, round);
                assert_eq!(
                    &got, hash,
                    "round {round}, branch {i}: {role}'s memory differs from the source's at the snapshot"
                );
            }
        }
        for b in branches {
            env.rt.destroy(&b.id).unwrap();
        }
        env.snap.delete(&snap.id).unwrap();
        // The source is unchanged by the snapshot too.
        for (role, hash) in &want {
            seq += 1;
            assert_eq!(&ask(&env, &src.id, role, "hash", seq, round), hash);
        }
    }
    eprintln!("memory paths taken: {paths:?}");
    let f = env.snap.criu().features();
    if env.snap.tracks_dirty_pages() {
        assert_eq!(
            paths[0],
            MemoryDump::Full,
            "nothing to be incremental against"
        );
        let incremental = paths.iter().filter(|p| **p == MemoryDump::UffdWp).count();
        let rebased = |r: &Option<String>| r.as_deref().is_some_and(|r| r.starts_with("re-based"));
        assert!(
            paths[1..]
                .iter()
                .zip(&reasons[1..])
                .all(|(p, r)| *p == MemoryDump::UffdWp || rebased(r)),
            "later snapshots are incremental or re-based: {paths:?}, full because {reasons:?}"
        );
        assert!(
            incremental * 4 >= paths.len() * 3,
            "at least three quarters incremental: {paths:?}, full because {reasons:?}"
        );
    } else {
        eprintln!("NOTE: no userfaultfd write-protect tracking here ({f:?}): the incremental path is not covered");
    }
    env.rt.destroy(&src.id).unwrap();
    env.finish();
}
