//! Store bytes and dedup: the base image imported twice; a chain of 10 commits each changing 1 % of a
//! 100 MiB tree (nodefs commits vs overlayfs layers, docker-commit style: one upper layer per commit);
//! a fork tree of writable branches; process snapshots of forked sandboxes (memory pages dedup); and
//! how long a store of many chunks takes to open, from its packs' idx files and by walking the packs.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use nodefs::{MountOptions, NodeFs, Store};
use rand::{Rng, RngCore, SeedableRng};

use super::Ctx;
use crate::cleanup::{self, Guard};
use crate::plot::{self, Series};
use crate::progress;
use crate::report::{Better, Key, Measurement, ScenarioResult};
use crate::util;
use crate::workload::dir_bytes;

pub const NAME: &str = "storage";
pub const IMPORT: &str = "base image import: store bytes added";
pub const REIMPORT: &str = "second import of the base image: bytes added ÷ first import's bytes";
pub const CHAIN: &str = "commit after changing 1 % of the tree: bytes added";
pub const CHAIN_RATIO: &str = "store bytes after 10 commits ÷ first commit's bytes";
pub const DEDUP: &str = "dedup ratio: logical bytes of all versions ÷ bytes stored";
pub const FORK_TREE: &str = "fork tree: bytes added per branch commit (each branch changes 1 %)";
pub const OPEN: &str = "store open, cold page cache";
pub const SNAP_BRANCH: &str =
    "snapshot of a forked sandbox after touching 1 % of its heap: bytes added";

const FILE_SIZE: usize = 256 << 10;
const OVERLAY: &str = "overlayfs layers";

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

pub fn run(ctx: &Ctx, res: &mut ScenarioResult) -> Result<()> {
    let tree_mib: usize = ctx.pick(20, 100);
    let commits = 10;
    let branches = ctx.pick(2, 4);
    let nodefs_ok = ctx.grove.nodefs_error().is_none();
    let why = ctx.grove.nodefs_error().unwrap_or_default();

    // 1. The base image, twice.
    progress::step(0.0, "importing the base image twice into a fresh store");
    let k1 = Key::new(IMPORT, "first", "MiB", Better::Lower);
    let k2 = Key::new(IMPORT, "second", "MiB", Better::Lower);
    let kr = Key::new(REIMPORT, "", "×", Better::Lower);
    if nodefs_ok {
        match import_twice(ctx) {
            Ok((b1, b2, t1, t2)) => {
                res.push(Measurement::value(&k1, "nodefs", true, mib(b1)));
                res.push(Measurement::value(&k2, "nodefs", true, mib(b2)));
                res.push(Measurement::value(
                    &kr,
                    "nodefs",
                    true,
                    b2 as f64 / b1.max(1) as f64,
                ));
                res.note(format!(
                    "base image ({} MiB on disk): first import {:.1} s, second {:.1} s",
                    dir_bytes(&ctx.image) >> 20,
                    t1 / 1e3,
                    t2 / 1e3
                ));
            }
            Err(e) => res.push(Measurement::failed(&kr, "nodefs", true, format!("{e:#}"))),
        }
    } else {
        res.push(Measurement::not_available(&kr, "nodefs", &why));
    }

    // 2. The chain.
    progress::step(0.3, &format!("building a {tree_mib} MiB tree"));
    let tree = ctx.fresh_dir("storage-tree")?;
    let files = tree_mib * (1 << 20) / FILE_SIZE;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut buf = vec![0u8; FILE_SIZE];
    for i in 0..files {
        rng.fill_bytes(&mut buf);
        std::fs::write(tree.join(format!("f{i:04}.bin")), &buf)?;
    }
    let tree_bytes = (files * FILE_SIZE) as u64;
    let writes = (tree_bytes / 100 / 4096) as usize;
    res.note(format!(
        "chain and fork tree: {files} files × {} KiB of random bytes; each change = {writes} writes of 4 KiB at random places (1 % of the bytes)",
        FILE_SIZE >> 10
    ));
    let ck = |p: &str| Key::new(CHAIN, p, "MiB", Better::Lower);
    let kc = Key::new(CHAIN_RATIO, tree_param(tree_mib), "×", Better::Lower);
    let kd = |p: &str| Key::new(DEDUP, p, "×", Better::Higher);
    let kf = Key::new(FORK_TREE, "", "MiB", Better::Lower);
    let mut series = Vec::new();

    progress::step(0.4, "nodefs: 10 commits + fork tree");
    if nodefs_ok {
        match nodefs_chain(ctx, &tree, files, writes, commits, branches) {
            Ok(c) => {
                res.push(Measurement::value(
                    &ck("first (the whole tree)"),
                    "nodefs",
                    true,
                    mib(c.first),
                ));
                res.push(Measurement::samples(
                    &ck("each of the next 10"),
                    "nodefs",
                    true,
                    &c.each.iter().map(|b| mib(*b)).collect::<Vec<_>>(),
                ));
                res.push(Measurement::value(
                    &kc,
                    "nodefs",
                    true,
                    c.total as f64 / c.first as f64,
                ));
                res.push(Measurement::value(
                    &kd("chain"),
                    "nodefs",
                    true,
                    ((commits + 1) as u64 * tree_bytes) as f64 / c.total as f64,
                ));
                res.push(Measurement::samples(
                    &kf,
                    "nodefs",
                    true,
                    &c.branch.iter().map(|b| mib(*b)).collect::<Vec<_>>(),
                ));
                res.note(format!(
                    "nodefs commit time: median {:.0} ms per commit of 1 % changes",
                    crate::stats::median(&c.commit_ms).unwrap_or(f64::NAN)
                ));
                series.push(Series {
                    name: "nodefs".into(),
                    points: cumulative(c.first, &c.each),
                });
            }
            Err(e) => res.push(Measurement::failed(&kc, "nodefs", true, format!("{e:#}"))),
        }
    } else {
        res.push(Measurement::not_available(&kc, "nodefs", &why));
    }

    progress::step(0.6, "overlayfs layers: 10 commits + fork tree");
    match overlay_chain(ctx, &tree, files, writes, commits, branches) {
        Ok(c) => {
            res.push(Measurement::value(
                &ck("first (the whole tree)"),
                OVERLAY,
                false,
                mib(c.first),
            ));
            res.push(Measurement::samples(
                &ck("each of the next 10"),
                OVERLAY,
                false,
                &c.each.iter().map(|b| mib(*b)).collect::<Vec<_>>(),
            ));
            res.push(Measurement::value(
                &kc,
                OVERLAY,
                false,
                c.total as f64 / c.first as f64,
            ));
            res.push(Measurement::value(
                &kd("chain"),
                OVERLAY,
                false,
                ((commits + 1) as u64 * tree_bytes) as f64 / c.total as f64,
            ));
            res.push(Measurement::samples(
                &kf,
                OVERLAY,
                false,
                &c.branch.iter().map(|b| mib(*b)).collect::<Vec<_>>(),
            ));
            series.push(Series {
                name: OVERLAY.into(),
                points: cumulative(c.first, &c.each),
            });
        }
        Err(e) => res.push(Measurement::failed(&kc, OVERLAY, false, format!("{e:#}"))),
    }
    let p = ctx.out.join("storage-chain.svg");
    if plot::line_chart(
        &p,
        "store bytes over a chain of commits (1 % changed each)",
        "commit",
        "MiB stored (cumulative)",
        &series,
        false,
    )
    .is_ok()
    {
        res.plots.push("storage-chain.svg".into());
    }

    // 3. Process snapshots of forked sandboxes.
    progress::step(0.8, "snapshots of forked sandboxes");
    let ks = Key::new(SNAP_BRANCH, "", "MiB", Better::Lower);
    match ctx.grove.snapshotter() {
        Ok(s) => match snapshot_branches(ctx, &s, branches) {
            Ok((full, per)) => {
                res.note(format!("fork-tree snapshots: the parent snapshot added {:.1} MiB; each branch then touched 1 % of a {} MiB heap", mib(full), ctx.pick(32, 256)));
                res.push(Measurement::samples(
                    &ks,
                    &s.label(),
                    true,
                    &per.iter().map(|b| mib(*b)).collect::<Vec<_>>(),
                ));
            }
            Err(e) => res.push(Measurement::failed(&ks, &s.label(), true, format!("{e:#}"))),
        },
        Err(r) => res.push(Measurement::not_available(&ks, "grove", &r)),
    }

    // 4. Opening a store of many chunks.
    progress::step(0.95, "opening a store of many chunks");
    let chunks = ctx.pick(8192, 65_536);
    match store_open(ctx, chunks) {
        Ok((idx, walk)) => {
            let k = |how: &str| {
                Key::new(
                    OPEN,
                    format!("{chunks} chunks of 4 KiB, {how}"),
                    "ms",
                    Better::Lower,
                )
            };
            res.push(Measurement::samples(
                &k("from the idx files"),
                "nodefs",
                true,
                &idx,
            ));
            res.push(Measurement::samples(
                &k("walking every pack (idx files removed)"),
                "nodefs",
                true,
                &walk,
            ));
        }
        Err(e) => {
            let k = Key::new(
                OPEN,
                format!("{chunks} chunks of 4 KiB"),
                "ms",
                Better::Lower,
            );
            res.push(Measurement::failed(&k, "nodefs", true, format!("{e:#}")));
        }
    }
    Ok(())
}

/// Open times (ms) of a store holding `chunks` random 4 KiB chunks: loading the packs' idx files,
/// then with them removed (the walk a store without them does, and that writes them again).
fn store_open(ctx: &Ctx, chunks: usize) -> Result<(Vec<f64>, Vec<f64>)> {
    let dir = ctx.work.join("store-open");
    let _ = std::fs::remove_dir_all(&dir);
    let result = (|| {
        let store = Store::open(&dir)?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..chunks / 1024 {
            let batch: Vec<Vec<u8>> = (0..1024)
                .map(|_| {
                    let mut c = vec![0u8; 4096];
                    rng.fill_bytes(&mut c);
                    c
                })
                .collect();
            store.put_chunks(&batch)?;
        }
        drop(store);
        let timed_open = |remove_idx: bool| -> Result<f64> {
            if remove_idx {
                for e in std::fs::read_dir(dir.join("packs"))?.flatten() {
                    if e.file_name().to_string_lossy().ends_with(".idx") {
                        std::fs::remove_file(e.path())?;
                    }
                }
            }
            util::drop_caches()?;
            let t = Instant::now();
            let store = Store::open(&dir)?;
            let ms = t.elapsed().as_secs_f64() * 1000.0;
            let held = store.stats().chunks;
            if held < chunks as u64 {
                return Err(anyhow!("the store opened with {held} of {chunks} chunks"));
            }
            Ok(ms)
        };
        let (mut idx, mut walk) = (Vec::new(), Vec::new());
        for _ in 0..ctx.pick(3, 5) {
            walk.push(timed_open(true)?);
            idx.push(timed_open(false)?);
        }
        Ok((idx, walk))
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// "100 MiB tree": quick runs never match the full run's promise.
pub fn tree_param(mib: usize) -> String {
    format!("{mib} MiB tree")
}

fn cumulative(first: u64, each: &[u64]) -> Vec<(f64, f64)> {
    let mut acc = first;
    let mut v = vec![(0.0, mib(acc))];
    for (i, b) in each.iter().enumerate() {
        acc += b;
        v.push(((i + 1) as f64, mib(acc)));
    }
    v
}

fn import_twice(ctx: &Ctx) -> Result<(u64, u64, f64, f64)> {
    let dir = ctx.fresh_dir("storage-import")?;
    let store = Store::open(&dir.join("store")).map_err(|e| anyhow!("Store::open: {e}"))?;
    let s0 = store.stats().stored_bytes;
    let t = Instant::now();
    store
        .import_dir(&ctx.image)
        .map_err(|e| anyhow!("import: {e}"))?;
    let t1 = util::ms_since(t);
    let s1 = store.stats().stored_bytes;
    let t = Instant::now();
    store
        .import_dir(&ctx.image)
        .map_err(|e| anyhow!("second import: {e}"))?;
    let t2 = util::ms_since(t);
    let s2 = store.stats().stored_bytes;
    Ok((s1 - s0, s2 - s1, t1, t2))
}

struct Chain {
    first: u64,
    each: Vec<u64>,
    total: u64,
    branch: Vec<u64>,
    commit_ms: Vec<f64>,
}

/// `writes` random 4 KiB writes into the files under `root`.
fn change(root: &Path, files: usize, writes: usize, seed: u64) -> Result<()> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut block = [0u8; 4096];
    for _ in 0..writes {
        let f = rng.gen_range(0..files);
        let off = rng.gen_range(0..FILE_SIZE / 4096) as u64 * 4096;
        rng.fill_bytes(&mut block);
        let p = root.join(format!("f{f:04}.bin"));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .with_context(|| format!("open {}", p.display()))?;
        file.write_all_at(&block, off)?;
    }
    Ok(())
}

fn nodefs_chain(
    ctx: &Ctx,
    tree: &Path,
    files: usize,
    writes: usize,
    commits: usize,
    branches: usize,
) -> Result<Chain> {
    let dir = ctx.fresh_dir("storage-nodefs")?;
    let store = Store::open(&dir.join("store")).map_err(|e| anyhow!("Store::open: {e}"))?;
    let base = store.import_dir(tree).map_err(|e| anyhow!("import: {e}"))?;
    let first = store.stats().stored_bytes;
    let fs = NodeFs::new(store.clone());
    let mnt = dir.join("mnt");
    std::fs::create_dir(&mnt)?;
    let m = fs
        .mount(
            &base,
            &mnt,
            MountOptions {
                upper_dir: dir.join("upper"),
                ..Default::default()
            },
        )
        .map_err(|e| anyhow!("mount: {e}"))?;
    let mm = m.clone();
    let guard = Guard::new("nodefs chain mount", move || {
        mm.unmount().map_err(|e| e.to_string())
    });
    let mut each = Vec::new();
    let mut commit_ms = Vec::new();
    let mut last = base;
    for c in 0..commits {
        cleanup::check()?;
        change(&mnt, files, writes, 100 + c as u64)?;
        let before = store.stats().stored_bytes;
        let t = Instant::now();
        last = m.commit().map_err(|e| anyhow!("commit {c}: {e}"))?;
        commit_ms.push(util::ms_since(t));
        each.push(store.stats().stored_bytes - before);
    }
    guard.run().map_err(|e| anyhow!(e))?;
    let total = store.stats().stored_bytes;
    // Fork tree: branches of the last commit, each changing its own 1 %.
    let mut branch = Vec::new();
    for b in 0..branches {
        cleanup::check()?;
        let bm = dir.join(format!("branch-{b}"));
        std::fs::create_dir(&bm)?;
        let m = fs
            .mount(
                &last,
                &bm,
                MountOptions {
                    upper_dir: dir.join(format!("branch-{b}-upper")),
                    ..Default::default()
                },
            )
            .map_err(|e| anyhow!("mount branch: {e}"))?;
        let mm = m.clone();
        let g = Guard::new("nodefs branch mount", move || {
            mm.unmount().map_err(|e| e.to_string())
        });
        change(&bm, files, writes, 1000 + b as u64)?;
        let before = store.stats().stored_bytes;
        m.commit().map_err(|e| anyhow!("branch commit: {e}"))?;
        branch.push(store.stats().stored_bytes - before);
        g.run().map_err(|e| anyhow!(e))?;
    }
    Ok(Chain {
        first,
        each,
        total,
        branch,
        commit_ms,
    })
}

/// docker-commit-style layering: each commit is a new overlayfs upper over the previous layers.
fn overlay_chain(
    ctx: &Ctx,
    tree: &Path,
    files: usize,
    writes: usize,
    commits: usize,
    branches: usize,
) -> Result<Chain> {
    let dir = ctx.fresh_dir("storage-overlay")?;
    let first = dir_bytes(tree);
    let mut lowers: Vec<PathBuf> = vec![tree.to_path_buf()];
    let mut each = Vec::new();
    let layer = |name: String, lowers: &[PathBuf], seed: u64| -> Result<(PathBuf, u64)> {
        let upper = dir.join(format!("{name}-upper"));
        let work = dir.join(format!("{name}-work"));
        let mnt = dir.join(format!("{name}-mnt"));
        for d in [&upper, &work, &mnt] {
            std::fs::create_dir(d)?;
        }
        // overlayfs lists the top layer first.
        let lower: Vec<String> = lowers
            .iter()
            .rev()
            .map(|p| p.display().to_string())
            .collect();
        let data = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.join(":"),
            upper.display(),
            work.display()
        );
        util::run(
            Command::new("mount")
                .args(["-t", "overlay", "grove-bench-overlay", "-o", &data])
                .arg(&mnt),
        )?;
        let g = crate::cleanup::unmount_guard(mnt.clone());
        let r = change(&mnt, files, writes, seed);
        g.run().map_err(|e| anyhow!(e))?;
        r?;
        Ok((upper.clone(), dir_bytes(&upper)))
    };
    for c in 0..commits {
        cleanup::check()?;
        let (upper, b) = layer(format!("c{c}"), &lowers, 100 + c as u64)?;
        each.push(b);
        lowers.push(upper);
    }
    let total = first + each.iter().sum::<u64>();
    let mut branch = Vec::new();
    for b in 0..branches {
        let (_, bytes) = layer(format!("b{b}"), &lowers, 1000 + b as u64)?;
        branch.push(bytes);
    }
    Ok(Chain {
        first,
        each,
        total,
        branch,
        commit_ms: Vec::new(),
    })
}

/// Snapshot a workload, fork it, touch 1 % of each branch's heap, snapshot each branch: bytes each adds.
fn snapshot_branches(
    ctx: &Ctx,
    s: &crate::grove::GroveSnapshots,
    branches: usize,
) -> Result<(u64, Vec<u64>)> {
    let heap = ctx.pick(32u64 << 20, 256u64 << 20);
    let sb = s.start_workload(heap)?;
    crate::workload::wait_ready(sb.init_pid, heap, std::time::Duration::from_secs(120))?;
    let tag = std::process::id();
    let parent = s.snapshot(&sb, &format!("grove-bench-{tag}-tree"))?;
    drop(sb);
    let kids = s.fork_keep(&parent.id, branches)?;
    let mut per = Vec::new();
    for (i, k) in kids.iter().enumerate() {
        cleanup::check()?;
        crate::workload::wait_ready(k.init_pid, heap, std::time::Duration::from_secs(60))?;
        crate::workload::touch(k.init_pid, 0.01)?;
        let f = s.snapshot(k, &format!("grove-bench-{tag}-branch-{i}"))?;
        per.push(f.bytes_added);
    }
    Ok((parent.bytes_added, per))
}
