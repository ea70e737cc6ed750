//! One-off measurement (not a test; bench/ formalizes it): snapshot a tree running python3 with
//! 256 MiB of random heap + a loopback HTTP server on a nodefs root, twice (touching 5 % of the
//! heap in between), then fork it 1/4/8 ways. Uses nodefs + CRIU directly, without the runtime.
//!
//! Run as root: `cargo run --release -p grove-snapshotter --example measure`
//! (`GROVE_MEASURE_ROOT=overlay` uses kernel overlayfs roots instead of nodefs, the fs state of
//! the dump instant then being a copy of the upper dir; for comparing the CRIU part alone;
//! `GROVE_MEASURE_LAZY=1` restores with `criu lazy-pages`).

#[path = "../tests/common/tree.rs"]
#[allow(dead_code)]
mod tree;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use grove_snapshotter::criu::{Criu, DumpOptions, RestoreOptions};
use nodefs::service::ImportPolicy;
use nodefs::{MountOptions, NodeFs, Store};

const WORK: &str = r#"
import os, time, random
N = 256 << 20
heap = bytearray(os.urandom(N))
f = open('/tmp/data.txt', 'w+')
f.write('x' * 1000)
f.flush()
f.seek(123)
open('/tmp/ready', 'w').write('1')
beat = 0
while True:
    if os.path.exists('/tmp/touch'):
        os.unlink('/tmp/touch')
        npages = N // 4096
        for p in random.sample(range(npages), npages // 20):
            heap[p * 4096] ^= 0xff
        open('/tmp/touched', 'w').write('1')
    beat += 1
    with open('/tmp/beat', 'w') as b:
        b.write(str(beat))
    time.sleep(0.05)
"#;

const SCRIPT: &str =
    "python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 & python3 /grove-work.py";

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

fn main() {
    tree::become_subreaper();
    let criu = Criu::locate(None).expect("criu");
    println!(
        "criu {} (socket shim: {})",
        criu.binary().display(),
        criu.has_socket_shim()
    );
    let base = PathBuf::from(format!("/run/grove-measure-{}", std::process::id()));
    std::fs::create_dir_all(&base).unwrap();
    let store = Store::open(&base.join("store")).expect("store");
    let t = Instant::now();
    let image = store
        .import_dir(Path::new(tree::IMAGE))
        .expect("import image");
    println!(
        "import debian12 image into store: {:.0} ms",
        ms(t.elapsed())
    );
    let nfs = NodeFs::new(store.clone());
    let mount_at = |name: &str, manifest| {
        let root = base.join(name);
        std::fs::create_dir_all(&root).unwrap();
        let opts = MountOptions {
            quota_bytes: None,
            quota_inodes: None,
            upper_dir: base.join(format!("{name}.upper")),
            read_only: false,
            passthrough: true,
            uring: true,
            id_shift: None,
        };
        (
            root.clone(),
            nfs.mount(&manifest, &root, opts).expect("nodefs mount"),
        )
    };
    let overlay = std::env::var("GROVE_MEASURE_ROOT").as_deref() == Ok("overlay");
    let lazy = std::env::var("GROVE_MEASURE_LAZY").as_deref() == Ok("1");
    println!("lazy pages on restore: {lazy}");
    let mut overlays = Vec::new();
    let (root, mount) = if overlay {
        let o = tree::OverlayRoot::new(&tree::unique("measure-src"), None);
        let r = o.root();
        overlays.push(o);
        (r, None)
    } else {
        let (r, m) = mount_at("src", image);
        (r, Some(m))
    };
    std::fs::write(root.join("grove-work.py"), WORK).unwrap();
    let name = tree::unique("measure");
    let (unified, freezer, init_pid) = tree::spawn_tree(&name, &root, SCRIPT, "tmp/ready");
    println!("python ready (256 MiB heap)");

    let mut last = None;
    for round in 1..=2 {
        if round == 2 {
            std::fs::write(root.join("tmp/touch"), "1").unwrap();
            tree::wait_for(30, "touched", || root.join("tmp/touched").exists());
        }
        let images_dir = base.join(format!("images-{round}"));
        std::fs::create_dir_all(&images_dir).unwrap();
        let before = store.stats().stored_bytes;
        let t0 = Instant::now();
        unified.freeze(true);
        let t_freeze = t0.elapsed();
        criu.dump(&DumpOptions {
            pid: init_pid,
            images_dir: images_dir.clone(),
            work_dir: base.join(format!("dump-work-{round}")),
            leave_running: true,
            freeze_cgroup: Some(unified.path()),
            tcp_established: true,
            ..Default::default()
        })
        .expect("dump");
        let t_dump = t0.elapsed();
        let fs_root = match &mount {
            Some(m) => m.commit().expect("commit"),
            None => {
                let copy = base.join(format!("upper-copy-{round}"));
                tree::run(
                    "cp",
                    &[
                        "-a",
                        &overlays[0].upper().display().to_string(),
                        &copy.display().to_string(),
                    ],
                );
                image
            }
        };
        let t_commit = t0.elapsed();
        unified.freeze(false);
        let t_thaw = t0.elapsed();
        let images_root = store
            .import_dir_with(&images_dir, &|p| ImportPolicy::CriuImages.for_path(p))
            .expect("import images");
        let t_import = t0.elapsed();
        let added = store.stats().stored_bytes - before;
        let img_bytes: u64 = std::fs::read_dir(&images_dir)
            .unwrap()
            .flatten()
            .map(|e| e.metadata().unwrap().len())
            .sum();
        println!(
            "snapshot {round}: freeze {:.1} ms, dump done {:.0} ms, commit done {:.0} ms, thawed {:.0} ms \
             (frozen window), images in store {:.0} ms total; images {:.1} MiB, store +{:.2} MiB",
            ms(t_freeze), ms(t_dump), ms(t_commit), ms(t_thaw), ms(t_import), mib(img_bytes), mib(added)
        );
        std::fs::remove_dir_all(&images_dir).unwrap();
        last = Some((fs_root, images_root));
    }
    let (fs_root, images_root) = last.unwrap();
    let t = Instant::now();
    let imgs = base.join("materialized");
    store.export_dir(&images_root, &imgs).expect("materialize");
    println!("materialize images once: {:.0} ms", ms(t.elapsed()));

    for n in [1usize, 4, 8] {
        let t0 = Instant::now();
        let branches: Vec<_> = (0..n)
            .map(|i| {
                let bname = format!("b{n}-{i}");
                let cgname = tree::unique(&bname);
                let (r, m) = if overlay {
                    let o = tree::OverlayRoot::new(&cgname, Some(&base.join("upper-copy-2")));
                    (o.root(), Err(o))
                } else {
                    let (r, m) = mount_at(&bname, fs_root);
                    (r, Ok(m))
                };
                (
                    r,
                    m,
                    tree::Freezer::new(&cgname),
                    tree::Unified::new(&cgname),
                )
            })
            .collect();
        let t_mounts = t0.elapsed();
        let pids: Vec<i32> = std::thread::scope(|s| {
            let hs: Vec<_> = branches
                .iter()
                .enumerate()
                .map(|(i, (r, _, fz, un))| {
                    let (criu, imgs, base) = (&criu, &imgs, &base);
                    s.spawn(move || {
                        let w = base.join(format!("restore-{n}-{i}"));
                        let lazy =
                            lazy.then(|| criu.lazy_pages(imgs, &w).expect("lazy-pages daemon"));
                        let (pid, _) = criu
                            .restore(&RestoreOptions {
                                images_dir: imgs.clone(),
                                work_dir: w.clone(),
                                root: r.clone(),
                                pidfile: w.join("pid"),
                                cgroup_roots: vec![
                                    ("freezer".into(), fz.rel.clone().into()),
                                    ("unified".into(), un.rel.clone().into()),
                                ],
                                external_mounts: vec![],
                                tcp_established: true,
                                lazy_pages: lazy.is_some(),
                                inherit_netns: false,
                                cgroup_yard: None,
                                merge_pages: false,
                            })
                            .expect("restore");
                        match lazy {
                            Some(l) => l.reap_later(move |_| {
                                let _ = std::fs::remove_dir_all(&w);
                            }),
                            None => {
                                let _ = std::fs::remove_dir_all(&w);
                            }
                        }
                        pid
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let t_restored = t0.elapsed();
        // Running = each branch's python writes a new heartbeat.
        let beats: Vec<String> = branches
            .iter()
            .map(|(r, ..)| std::fs::read_to_string(r.join("tmp/beat")).unwrap_or_default())
            .collect();
        for ((r, ..), b) in branches.iter().zip(&beats) {
            tree::wait_for(10, "branch heartbeat", || {
                std::fs::read_to_string(r.join("tmp/beat")).unwrap_or_default() != *b
            });
        }
        let t_running = t0.elapsed();
        println!(
            "fork {n}: {} nodefs mounts {:.0} ms, all restored {:.0} ms, all running {:.0} ms (pids {pids:?})",
            n, ms(t_mounts), ms(t_restored), ms(t_running)
        );
        for (_, m, fz, un) in branches {
            drop(un);
            fz.kill_all();
            drop(fz);
            match m {
                Ok(m) => m.unmount().unwrap(),
                Err(o) => drop(o),
            }
        }
    }
    drop(unified);
    freezer.kill_all();
    drop(freezer);
    if let Some(m) = mount {
        m.unmount().unwrap();
    }
    drop(overlays);
    drop(store);
    std::fs::remove_dir_all(&base).unwrap();
    println!("residue: {:?}", tree::host_residue("grove-"));
}
