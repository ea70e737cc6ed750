//! Warm pools and jobs, for real (root): a claimed sandbox is indistinguishable from a cold one,
//! pools give way to foreground creates, and a full node queues creates fairly, then times out.

mod common;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::*;
use grove_runtime::{
    Error, JobPolicy, JobsConfig, Limits, OverlayRoot, PoolMode, PoolSpec, PoolsConfig, Runtime,
    SandboxId, SandboxSpec,
};

const INSTANCE: &str = "grove-etest";
/// The node of this test binary holds this many sandboxes (pooled ones included).
const NODE_SANDBOXES: u64 = 4;

/// Tests here share one small node: one at a time.
fn node() -> (std::sync::MutexGuard<'static, ()>, Arc<Runtime>) {
    static SERIAL: Mutex<()> = Mutex::new(());
    static RT: OnceLock<Arc<Runtime>> = OnceLock::new();
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rt = RT
        .get_or_init(|| {
            let mut c = config(INSTANCE);
            c.net_pool = "10.212.0.0/16".into();
            c.capacity.sandboxes = Some(NODE_SANDBOXES);
            let rt = Runtime::new(c, Arc::new(OverlayRoot::new(STATE_DIR))).expect("runtime");
            // SAFETY: registering a plain extern "C" fn with no captured state.
            unsafe { libc::atexit(remove_parents) };
            rt
        })
        .clone();
    (guard, rt)
}

extern "C" fn remove_parents() {
    for ctrl in [
        "memory", "pids", "cpu", "cpuacct", "devices", "freezer", "unified",
    ] {
        let _ = std::fs::remove_dir(format!("/sys/fs/cgroup/{ctrl}/{INSTANCE}"));
    }
    let init = format!("/run/{INSTANCE}/init");
    let _ = nix::mount::umount2(init.as_str(), nix::mount::MntFlags::MNT_DETACH);
    let _ = std::fs::remove_dir(&init);
    let _ = std::fs::remove_dir(format!("/run/{INSTANCE}/sandboxes"));
    let _ = std::fs::remove_dir(format!("/run/{INSTANCE}"));
}

fn small() -> Limits {
    Limits {
        memory_mb: 64,
        ..Limits::default()
    }
}

fn small_spec() -> SandboxSpec {
    SandboxSpec {
        limits: Some(small()),
        ..spec()
    }
}

fn fixed_pool(n: u32) -> PoolsConfig {
    PoolsConfig {
        pools: vec![PoolSpec {
            image: IMAGE.into(),
            limits: Some(small()),
            mode: PoolMode::Fixed,
            min: n,
            max: n,
        }],
        ..Default::default()
    }
}

fn wait_idle(rt: &Runtime, n: u32) {
    let t0 = Instant::now();
    loop {
        let idle: u32 = rt.pools().iter().map(|p| p.idle).sum();
        if idle == n {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "pool at {idle}, want {n}: {:?}",
            rt.pools()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What a user could look at inside a fresh sandbox, with its own id replaced by "ID" (the
/// processes with their nice values: a pooled init was built at the refill's low priority).
fn probe(rt: &Runtime, id: &SandboxId) -> String {
    let r = sh(
        rt,
        id,
        "hostname; echo \"env=$(env | sort | tr '\\n' ' ')\"; ls -A / /tmp /root /dev/shm; \
         ps -e -o pid,ppid,ni,comm --no-headers; cat /proc/self/cgroup | grep -c memory; \
         ulimit -n; df -m /tmp | tail -1 | awk '{print $2}'",
    );
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    out(&r).replace(id.as_str(), "ID")
}

#[test]
fn a_claimed_sandbox_is_a_cold_one() {
    if !can_run() {
        return;
    }
    let (_g, rt) = node();
    rt.set_pools(fixed_pool(2)).expect("pools");
    wait_idle(&rt, 2);

    let cold_spec = SandboxSpec {
        env: [("A".to_string(), "1".to_string())].into(),
        ..small_spec()
    };
    // Build the cold one with the pool out of the way, so it is really built.
    rt.set_pools(PoolsConfig::default()).unwrap();
    let cold = rt.create(cold_spec.clone()).expect("cold create");
    rt.set_pools(fixed_pool(2)).unwrap();
    wait_idle(&rt, 2);
    let hits = |rt: &Runtime| rt.pools().iter().map(|p| p.hits).sum::<u64>();
    let before = hits(&rt);
    let t0 = Instant::now();
    let warm = rt.create(cold_spec.clone()).expect("claim");
    let claim = t0.elapsed();
    assert_eq!(hits(&rt), before + 1, "served from the pool");
    eprintln!("claim took {claim:?}");

    assert_ne!(warm.id, cold.id);
    assert_eq!(warm.hostname, warm.id.to_string());
    assert_eq!(rt.usage(&warm.id).unwrap().disk_bytes, 0, "upper is empty");
    assert_eq!(rt.usage(&warm.id).unwrap().disk_inodes, 0, "upper is empty");
    assert!(warm.created_at_ms >= cold.created_at_ms);
    assert_eq!(probe(&rt, &warm.id), probe(&rt, &cold.id));
    assert!(rt.list().iter().any(|i| i.id == warm.id));

    // The request's hostname, labels and job are applied at the hand-over.
    let named = SandboxSpec {
        hostname: Some("box7".into()),
        job: Some("train-a".into()),
        labels: [("k".to_string(), "v".to_string())].into(),
        ..small_spec()
    };
    let info = rt.create(named).expect("claim named");
    assert_eq!(hits(&rt), before + 2);
    assert_eq!(out(&sh(&rt, &info.id, "hostname")), "box7");
    assert_eq!(info.spec.job.as_deref(), Some("train-a"));
    let job = rt.jobs().into_iter().find(|j| j.job == "train-a").unwrap();
    assert_eq!(job.usage.sandboxes, 1);

    for id in [&cold.id, &warm.id, &info.id] {
        rt.destroy(id).expect("destroy");
    }
    // The pool refills, then a shrink to nothing destroys what it held, refills in flight included.
    wait_idle(&rt, 2);
    let again = rt.create(small_spec()).expect("claim");
    rt.set_pools(PoolsConfig::default()).unwrap();
    assert!(rt.pools().is_empty(), "{:?}", rt.pools());
    rt.destroy(&again.id).unwrap();
    for id in [&cold.id, &warm.id, &info.id, &again.id] {
        assert_gone(&rt, id);
    }
    let job = rt.jobs().into_iter().find(|j| j.job == "train-a").unwrap();
    assert_eq!(job.usage.sandboxes, 0);
}

#[test]
fn pools_give_way_and_full_nodes_queue() {
    if !can_run() {
        return;
    }
    let (_g, rt) = node();
    rt.set_jobs(JobsConfig {
        queue_timeout_ms: 400,
        jobs: [(
            "capped".to_string(),
            JobPolicy {
                max_sandboxes: Some(1),
                ..Default::default()
            },
        )]
        .into(),
        ..Default::default()
    })
    .unwrap();
    rt.set_pools(fixed_pool(3)).expect("pools");
    wait_idle(&rt, 3);
    // Another size does not fit next to a pool of 3 on a node of 4: the pool gives way.
    let other = || SandboxSpec {
        limits: Some(Limits {
            memory_mb: 96,
            ..Limits::default()
        }),
        ..spec()
    };
    let a = rt.create(other()).expect("create 1");
    let b = rt.create(other()).expect("create 2 evicts a pooled one");
    let idle: u32 = rt.pools().iter().map(|p| p.idle).sum();
    assert!(idle <= 2, "{idle}");

    // A job at its quota waits, then fails with a retry hint; other jobs are not held back.
    let capped = SandboxSpec {
        job: Some("capped".into()),
        ..other()
    };
    let c = rt.create(capped.clone()).expect("capped 1");
    let t0 = Instant::now();
    let err = rt.create(capped.clone()).unwrap_err();
    assert!(
        t0.elapsed() >= Duration::from_millis(350),
        "{:?}",
        t0.elapsed()
    );
    match &err {
        Error::QueueTimeout {
            job,
            retry_after_secs,
            reason,
            ..
        } => {
            assert_eq!(job, "capped");
            assert!(reason.contains("max_sandboxes"), "{reason}");
            assert!(*retry_after_secs >= 1);
        }
        e => panic!("expected QueueTimeout, got {e}"),
    }
    assert_eq!(err.code(), "capacity_exceeded");

    // The node is full now (a, b, c + one pooled evicted on demand): a create queues until a
    // destroy makes room.
    let d = rt.create(other()).expect("evicts the last pooled one");
    assert_eq!(rt.pools().iter().map(|p| p.idle).sum::<u32>(), 0);
    let rt2 = rt.clone();
    let waiter = std::thread::spawn(move || {
        let t0 = Instant::now();
        (rt2.create(other()), t0.elapsed())
    });
    std::thread::sleep(Duration::from_millis(150));
    rt.destroy(&a.id).unwrap();
    let (e, waited) = waiter.join().unwrap();
    let e = e.expect("admitted after the destroy");
    assert!(waited >= Duration::from_millis(100), "{waited:?}");
    let st = rt.jobs().into_iter().find(|j| j.job == "default").unwrap();
    assert!(st.waited >= 1 && st.wait_ms_max >= 100, "{st:?}");

    rt.set_pools(PoolsConfig::default()).unwrap();
    rt.set_jobs(JobsConfig::default()).unwrap();
    for id in [&b.id, &c.id, &d.id, &e.id] {
        rt.destroy(id).unwrap();
    }
    for id in [&a.id, &b.id, &c.id, &d.id, &e.id] {
        assert_gone(&rt, id);
    }
}
