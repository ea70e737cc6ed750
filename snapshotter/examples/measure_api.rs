//! One-off measurement through the public API (runtime + nodefs + snapshotter): a sandbox with
//! python3 holding 256 MiB of random bytes, an open file and a loopback HTTP server; snapshot it
//! twice (touching 5 % of the heap in between) and fork it 1/4/8 ways, timing until every branch
//! answers. Not a test; bench/ formalizes it.
//!
//! Run as root: `cargo run --release -p grove-snapshotter --example measure_api`

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::grove::Env;
use grove_runtime::{ExecRequest, Limits};
use grove_snapshotter::{ForkOptions, SnapshotOptions};

const APP: &str = r#"
import os, time, random, json
N = 256 << 20
heap = bytearray(os.urandom(N))
f = open('/root/data.txt')
f.seek(5)
done = set()
while True:
    reqs = [n for n in os.listdir('/root') if n.startswith('req.') and n not in done]
    if not reqs:
        time.sleep(0.002)
        continue
    name = min(reqs, key=lambda n: int(n.split('.')[1]))
    done.add(name)
    cmd, seq = open('/root/' + name).read().split()
    if cmd == 'touch':
        npages = N // 4096
        for p in random.sample(range(npages), npages // 20):
            heap[p * 4096] ^= 0xff
    with open('/root/state.tmp', 'w') as o:
        json.dump({'seq': int(seq), 'offset': f.tell()}, o)
    os.rename('/root/state.tmp', '/root/state.json')
"#;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() {
    common::tree::become_subreaper();
    let env = Env::new("grove-stest-measure");
    let mut spec = env.spec();
    spec.limits = Some(Limits {
        memory_mb: 2048,
        ..Limits::default()
    });
    let src = env.rt.create(spec).unwrap();
    env.rt
        .write_file(&src.id, "/root/data.txt", b"0123456789", None)
        .unwrap();
    env.rt
        .write_file(&src.id, "/root/app.py", APP.as_bytes(), None)
        .unwrap();
    for cmd in [
        "python3 /root/app.py",
        "cd /root && exec python3 -m http.server 8000 --bind 127.0.0.1",
    ] {
        let mut req = ExecRequest::shell(cmd);
        req.background = true;
        env.rt.exec(&src.id, req).unwrap();
    }
    common::app::ask(&env, &src.id, "state", 1);
    common::app::wait_http(&env, &src.id);
    println!("sandbox ready: python with 256 MiB random heap + http.server");
    let mut seq = 10;
    for round in 1..=2 {
        if round == 2 {
            seq += 1;
            common::app::ask(&env, &src.id, "touch", seq);
        }
        let t = Instant::now();
        let s = env
            .snap
            .snapshot(&src.id, SnapshotOptions::default())
            .unwrap();
        println!(
            "snapshot {round}: {:.0} ms total, sandbox frozen {} ms, store +{:.2} MiB",
            ms(t.elapsed()),
            s.dump_ms,
            s.bytes_added as f64 / (1 << 20) as f64
        );
    }
    let snap = env.snap.list().pop().unwrap();
    for n in [1u32, 4, 8] {
        let t = Instant::now();
        let branches: Vec<_> = env
            .snap
            .fork(&snap.id, n, ForkOptions::default())
            .unwrap()
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        let t_created = t.elapsed();
        for b in &branches {
            seq += 1;
            common::app::ask(&env, &b.id, "state", seq);
        }
        println!(
            "fork {n}: all created {:.0} ms, all answering {:.0} ms",
            ms(t_created),
            ms(t.elapsed())
        );
        for b in branches {
            env.rt.destroy(&b.id).unwrap();
        }
    }
    env.finish();
    println!("clean: runtime residue empty, no mounts/criu/scratch left");
}
