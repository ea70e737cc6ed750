//! The same tree seen through nodefs, nodefs with FUSE passthrough off (passthrough's before/after),
//! nodefs over /dev/fuse reads instead of FUSE io_uring (the ring's before/after; the other way
//! round when the run's server has the ring off), kernel overlayfs, fuse-overlayfs and the plain disk: cold sequential read, cold 4 KiB random reads,
//! warm find + stat, untar of a source tree, cold python imports (chrooted), `pip install` of a wheel
//! of many small modules (made here, offline). Systems are interleaved
//! within each test so drift on the shared machine hits them alike.

use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};

use super::Ctx;
use crate::cleanup::{self, Guard};
use crate::grove::{NODEFS_DEV_FUSE, NODEFS_PT_OFF};
use crate::plot;
use crate::progress;
use crate::report::{Better, Key, Measurement, ScenarioResult};
use crate::util;

pub const NAME: &str = "filesystem";
pub const OVERLAY: &str = "overlayfs";
pub const SEQ_READ: &str = "sequential read, cold";
pub const RAND_READ: &str = "4 KiB random read latency, cold";
pub const RAND_IOPS: &str = "4 KiB random reads, cold";
pub const FIND_STAT: &str = "find + stat, warm";
pub const UNTAR: &str = "untar of a source tree";
pub const PY_IMPORT: &str = "cold python3 -c 'import email, json, http.client' (chroot)";
pub const PIP_INSTALL: &str = "pip install of a wheel of small modules";

/// Modules in the FS-5 wheel of a full run.
pub const PIP_MODULES: usize = 2_000;

/// One way of seeing the tree.
pub struct View {
    pub name: String,
    pub is_grove: bool,
    /// Where the tree appears.
    pub root: PathBuf,
    /// Where writes (untar) go: inside the view, or a fresh dir on the same disk for the plain view.
    pub write_dir: PathBuf,
    pub _guard: Option<Guard>,
    /// How the view was made, for the report.
    pub note: Option<String>,
}

struct Sizes {
    big: u64,
    files: usize,
    reps_read: usize,
    random_reads: usize,
    reps_find: usize,
    reps_untar: usize,
    reps_py: usize,
    pip_modules: usize,
    reps_pip: usize,
}

pub fn run(ctx: &Ctx, res: &mut ScenarioResult) -> Result<()> {
    let sz = Sizes {
        big: ctx.pick(64u64 << 20, 1u64 << 30),
        files: ctx.pick(5_000, 50_000),
        reps_read: ctx.pick(2, 3),
        random_reads: ctx.pick(1_000, 4_000),
        reps_find: ctx.pick(2, 5),
        reps_untar: ctx.pick(1, 3),
        reps_py: ctx.pick(2, 5),
        pip_modules: ctx.pick(400, PIP_MODULES),
        reps_pip: ctx.pick(1, 3),
    };
    progress::step(
        0.0,
        "building the tree (base image + big file + small files) and the source tar",
    );
    let tree = ctx.fresh_dir("fs-tree")?;
    // Hard links: the base image part costs no copy (nothing writes into the plain view's files in place).
    util::run(
        Command::new("cp")
            .arg("-al")
            .arg(format!("{}/.", ctx.image.display()))
            .arg(&tree),
    )?;
    let bench = tree.join("bench");
    write_big_file(&bench.join("big.bin"), sz.big)?;
    write_small_files(&bench.join("many"), sz.files)?;
    let tar = ctx.work.join("source.tar");
    let (tar_files, tar_bytes) = make_source_tar(&ctx.image, &tar, ctx.quick)?;
    // The wheel: a failure here fails only the pip rows.
    let pip = Pip::make(&ctx.work, sz.pip_modules);
    match &pip {
        Ok(p) => res.note(format!(
            "pip install: {} (pip of {}), a wheel of {} modules made here offline \
             (bench/tools/make-wheel.py; {} KiB), installed with --no-index --no-deps \
             --prefix DIR into a fresh directory of each view per repetition; pip byte-compiles \
             each module, so a run writes ~2 files per module",
            p.python.display(),
            p.version,
            sz.pip_modules,
            std::fs::metadata(&p.wheel)
                .map(|m| m.len() >> 10)
                .unwrap_or(0),
        )),
        Err(e) => res.note(format!("no pip install rows: {e:#}")),
    }
    res.note(format!(
        "tree: the base image ({}) + a {} MiB random file + {} small files; untar source: {} entries, {} MiB (from the base image's {})",
        ctx.image.display(),
        sz.big >> 20,
        sz.files,
        tar_files,
        tar_bytes >> 20,
        if ctx.quick { "/usr/lib/python3.11" } else { "/usr/lib/python3.11 and /usr/share" }
    ));

    let mut views = Vec::new();
    let plain_w = ctx.fresh_dir("fs-plain-writes")?;
    views.push(View {
        name: "plain disk".into(),
        is_grove: false,
        root: tree.clone(),
        write_dir: plain_w,
        _guard: None,
        note: None,
    });
    match overlay_view(ctx, &tree) {
        Ok(v) => views.push(v),
        Err(e) => res.push(Measurement::failed(
            &key(SEQ_READ, &file_param(sz.big), "MiB/s", Better::Higher),
            OVERLAY,
            false,
            format!("{e:#}"),
        )),
    }
    match fuse_overlay_view(ctx, &tree) {
        Ok(v) => views.push(v),
        Err(e) => res.push(Measurement::failed(
            &key(SEQ_READ, &file_param(sz.big), "MiB/s", Better::Higher),
            "fuse-overlayfs",
            false,
            format!("{e:#}"),
        )),
    }
    let mut grove_reason = None;
    // Grove first, then the same mount with passthrough off and over /dev/fuse (the before/after
    // peers).
    match ctx.grove.nodefs_views(&tree, &ctx.work) {
        Ok(vs) => {
            for (k, v) in vs.into_iter().enumerate() {
                if let Some(n) = &v.note {
                    res.note(n.clone());
                }
                views.insert(k, v);
            }
        }
        Err(reason) => grove_reason = Some(reason),
    }
    for v in &views {
        if !v.root.join("bench/big.bin").is_file() {
            bail!(
                "{}: the tree is not visible at {}",
                v.name,
                v.root.display()
            );
        }
    }

    let file_p = file_param(sz.big);
    let files_p = files_param(sz.files);
    let tar_p = tar_param(ctx.quick).to_string();
    let pip_p = pip_param(sz.pip_modules);
    let tests: [(&str, &str, Better, &str); 7] = [
        (SEQ_READ, "MiB/s", Better::Higher, &file_p),
        (RAND_READ, "µs", Better::Lower, &file_p),
        (RAND_IOPS, "reads/s", Better::Higher, &file_p),
        (FIND_STAT, "ms", Better::Lower, &files_p),
        (UNTAR, "ms", Better::Lower, &tar_p),
        (PY_IMPORT, "ms", Better::Lower, ""),
        (PIP_INSTALL, "ms", Better::Lower, &pip_p),
    ];
    if let Some(r) = &grove_reason {
        for (m, u, b, param) in tests {
            res.push(Measurement::not_available(
                &key(m, param, u, b),
                "nodefs",
                r,
            ));
        }
        res.note(format!(
            "no \"{NODEFS_PT_OFF}\" or \"{NODEFS_DEV_FUSE}\" row either: they are the same \
             nodefs mount ({r})"
        ));
    }
    let n = views.len();
    let mut samples: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); n]; tests.len()];
    let mut errors: Vec<Vec<Option<String>>> = vec![vec![None; n]; tests.len()];
    let mut record = |t: usize, v: usize, r: Result<Vec<f64>>| match r {
        Ok(s) => samples[t][v].extend(s),
        Err(e) => {
            errors[t][v].get_or_insert(format!("{e:#}"));
        }
    };

    let big_rel = Path::new("bench/big.bin");
    // One unrecorded read per view first. The views but nodefs read the same disk blocks
    // (nodefs reads its own copy in the store), and this VM's virtual disk is cached by the
    // host: without it, whichever view first touches a file warms it for the others.
    progress::step(0.03, "sequential read: one unrecorded read per view");
    for v in &views {
        cleanup::check()?;
        let _ = seq_read(&v.root.join(big_rel));
    }
    for rep in 0..sz.reps_read {
        progress::step(
            0.05 + 0.2 * rep as f64 / sz.reps_read as f64,
            &format!("sequential read, cold (rep {})", rep + 1),
        );
        for (i, v) in rotated(&views, rep) {
            cleanup::check()?;
            record(0, i, seq_read(&v.root.join(big_rel)).map(|x| vec![x]));
        }
    }
    progress::step(0.25, "4 KiB random reads, cold");
    for (i, v) in views.iter().enumerate() {
        cleanup::check()?;
        match random_reads(&v.root.join(big_rel), sz.random_reads) {
            Ok((lat, iops)) => {
                record(1, i, Ok(lat));
                record(2, i, Ok(vec![iops]));
            }
            Err(e) => record(1, i, Err(e)),
        }
    }
    progress::step(0.35, "find + stat, warm");
    for v in &views {
        let _ = find_stat(&v.root.join("bench/many")); // warm-up
    }
    for rep in 0..sz.reps_find {
        for (i, v) in rotated(&views, rep) {
            cleanup::check()?;
            record(3, i, find_stat(&v.root.join("bench/many")).map(|x| vec![x]));
        }
    }
    for rep in 0..sz.reps_untar {
        progress::step(
            0.45 + 0.35 * rep as f64 / sz.reps_untar as f64,
            &format!("untar (rep {})", rep + 1),
        );
        for (i, v) in rotated(&views, rep) {
            cleanup::check()?;
            let dest = v.write_dir.join(format!("untar-{rep}"));
            let r = std::fs::create_dir(&dest)
                .with_context(|| format!("mkdir {}", dest.display()))
                .and_then(|_| {
                    util::run(
                        Command::new("tar")
                            .arg("-xf")
                            .arg(&tar)
                            .arg("-C")
                            .arg(&dest),
                    )
                });
            record(4, i, r.map(|x| vec![x]));
        }
    }
    for rep in 0..sz.reps_pip {
        progress::step(
            0.8 + 0.05 * rep as f64 / sz.reps_pip as f64,
            &format!("pip install (rep {})", rep + 1),
        );
        for (i, v) in rotated(&views, rep) {
            cleanup::check()?;
            let r = match &pip {
                Ok(p) => p.install(&v.write_dir.join(format!("pip-{rep}"))),
                Err(e) => Err(anyhow::anyhow!("{e:#}")),
            };
            record(6, i, r.map(|x| vec![x]));
        }
    }
    progress::step(0.85, "cold python3 imports, chrooted");
    for rep in 0..sz.reps_py {
        for (i, v) in rotated(&views, rep) {
            cleanup::check()?;
            let r = util::drop_caches().and_then(|_| {
                util::run(Command::new("chroot").arg(&v.root).args([
                    "/usr/bin/python3",
                    "-c",
                    "import email, json, http.client",
                ]))
            });
            record(5, i, r.map(|x| vec![x]));
        }
    }

    // Figures, and speed relative to overlayfs for the plot.
    let overlay_idx = views.iter().position(|v| v.name == OVERLAY);
    let mut rel = vec![vec![f64::NAN; n]; tests.len()];
    for (t, (m, u, b, param)) in tests.iter().enumerate() {
        let k = key(m, param, u, *b);
        for (i, v) in views.iter().enumerate() {
            let meas = match &errors[t][i] {
                Some(e) => Measurement::failed(&k, &v.name, v.is_grove, e.clone()),
                None => Measurement::samples(&k, &v.name, v.is_grove, &samples[t][i]),
            };
            res.push(meas);
        }
        if let Some(o) = overlay_idx {
            let base = crate::stats::median(&samples[t][o]);
            for i in 0..n {
                let me = crate::stats::median(&samples[t][i]);
                let r = match b {
                    Better::Higher => crate::stats::ratio(me, base),
                    Better::Lower => crate::stats::ratio(base, me),
                };
                rel[t][i] = r.unwrap_or(f64::NAN);
            }
        }
    }
    let groups: Vec<String> = [
        "seq read",
        "rand 4K lat",
        "rand 4K IOPS",
        "find+stat",
        "untar",
        "py import",
        "pip install",
    ]
    .map(String::from)
    .to_vec();
    let systems: Vec<String> = views.iter().map(|v| v.name.clone()).collect();
    let p = ctx.out.join("filesystem-relative.svg");
    if plot::bar_chart(
        &p,
        "speed relative to kernel overlayfs (higher is better)",
        "× overlayfs",
        &groups,
        &systems,
        &rel,
    )
    .is_ok()
    {
        res.plots.push("filesystem-relative.svg".into());
    }
    // Unmount views before their directories go.
    drop(views);
    Ok(())
}

/// The views with their indices, starting at a different one each repetition (no system always goes first).
fn rotated(views: &[View], rep: usize) -> impl Iterator<Item = (usize, &View)> {
    let n = views.len().max(1);
    (0..views.len()).map(move |k| {
        let i = (k + rep) % n;
        (i, &views[i])
    })
}

fn key(m: &str, param: &str, unit: &str, b: Better) -> Key {
    Key::new(m, param, unit, b)
}

/// Parameters name the sizes, so quick runs never match the full run's promises.
pub fn file_param(bytes: u64) -> String {
    format!("{} MiB file", bytes >> 20)
}

pub fn files_param(n: usize) -> String {
    format!("{n} files")
}

pub fn tar_param(quick: bool) -> &'static str {
    if quick {
        "python3.11 stdlib"
    } else {
        "python3.11 stdlib + /usr/share"
    }
}

pub fn pip_param(modules: usize) -> String {
    format!("{modules}-module wheel")
}

/// The FS-5 workload: a python with pip, and a wheel of small modules made for the run.
struct Pip {
    python: PathBuf,
    version: String,
    wheel: PathBuf,
}

/// Where scripts/setup puts its python environment (it has pip).
const VENV_PYTHON: &str = "/var/lib/grove/venv/bin/python";

impl Pip {
    /// Finds a python with pip (scripts/setup's environment, else `python3`) and makes the wheel
    /// with it: no network, no package index.
    fn make(work: &Path, modules: usize) -> Result<Pip> {
        let candidates = [PathBuf::from(VENV_PYTHON), PathBuf::from("python3")];
        let (python, version) = candidates
            .iter()
            .find_map(|py| {
                let v = util::output(Command::new(py).args(["-m", "pip", "--version"])).ok()?;
                Some((py.clone(), v.split_whitespace().nth(1)?.to_string()))
            })
            .context("no python with pip (scripts/setup makes one in /var/lib/grove/venv)")?;
        let script = work.join("make-wheel.py");
        std::fs::write(&script, include_str!("../../tools/make-wheel.py"))?;
        let out = util::output(
            Command::new(&python)
                .arg(&script)
                .arg(work.join("wheel"))
                .arg(modules.to_string()),
        )?;
        let wheel = PathBuf::from(out.trim());
        if !wheel.is_file() {
            bail!("make-wheel.py made no wheel ({})", out.trim());
        }
        Ok(Pip {
            python,
            version,
            wheel,
        })
    }

    /// ms for `pip install` of the wheel with `--prefix prefix` (a directory that does not exist yet).
    fn install(&self, prefix: &Path) -> Result<f64> {
        util::run(
            Command::new(&self.python)
                .args([
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "--no-index",
                    "--no-deps",
                    "--no-cache-dir",
                    "--disable-pip-version-check",
                    "--root-user-action=ignore",
                    "--prefix",
                ])
                .arg(prefix)
                .arg(&self.wheel),
        )
    }
}

fn overlay_view(ctx: &Ctx, tree: &Path) -> Result<View> {
    let d = ctx.fresh_dir("fs-overlay")?;
    let (upper, work, mnt) = (d.join("upper"), d.join("work"), d.join("mnt"));
    for x in [&upper, &work, &mnt] {
        std::fs::create_dir(x)?;
    }
    let data = format!(
        "lowerdir={},upperdir={},workdir={}",
        tree.display(),
        upper.display(),
        work.display()
    );
    util::run(
        Command::new("mount")
            .args(["-t", "overlay", "grove-bench-overlay", "-o", &data])
            .arg(&mnt),
    )?;
    let guard = crate::cleanup::unmount_guard(mnt.clone());
    Ok(View {
        name: OVERLAY.into(),
        is_grove: false,
        root: mnt.clone(),
        write_dir: mnt,
        _guard: Some(guard),
        note: None,
    })
}

fn fuse_overlay_view(ctx: &Ctx, tree: &Path) -> Result<View> {
    util::which("fuse-overlayfs").context("fuse-overlayfs not installed")?;
    let d = ctx.fresh_dir("fs-fuse-overlay")?;
    let (upper, work, mnt) = (d.join("upper"), d.join("work"), d.join("mnt"));
    for x in [&upper, &work, &mnt] {
        std::fs::create_dir(x)?;
    }
    let data = format!(
        "lowerdir={},upperdir={},workdir={}",
        tree.display(),
        upper.display(),
        work.display()
    );
    util::run(Command::new("fuse-overlayfs").args(["-o", &data]).arg(&mnt))?;
    let guard = crate::cleanup::unmount_guard(mnt.clone());
    Ok(View {
        name: "fuse-overlayfs".into(),
        is_grove: false,
        root: mnt.clone(),
        write_dir: mnt,
        _guard: Some(guard),
        note: None,
    })
}

fn write_big_file(path: &Path, size: u64) -> Result<()> {
    std::fs::create_dir_all(path.parent().context("no parent")?)?;
    let f = std::fs::File::create(path)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x6772_6f76);
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < size {
        cleanup::check()?;
        rng.fill(&mut buf[..]);
        f.write_all_at(&buf, off)?;
        off += buf.len() as u64;
    }
    f.sync_all()?;
    Ok(())
}

fn write_small_files(dir: &Path, n: usize) -> Result<()> {
    let per_dir = 500;
    for i in 0..n {
        if i % per_dir == 0 {
            cleanup::check()?;
            std::fs::create_dir_all(dir.join(format!("d{:03}", i / per_dir)))?;
        }
        let p = dir.join(format!("d{:03}/f{i:06}.txt", i / per_dir));
        std::fs::write(p, format!("file {i}\n").repeat(1 + i % 40))?;
    }
    Ok(())
}

/// A tar of source-like trees from the base image; returns (entries, bytes).
fn make_source_tar(image: &Path, tar: &Path, quick: bool) -> Result<(usize, u64)> {
    let mut c = Command::new("tar");
    c.arg("-cf")
        .arg(tar)
        .arg("-C")
        .arg(image)
        .arg("usr/lib/python3.11");
    if !quick {
        c.arg("usr/share");
    }
    util::run(&mut c)?;
    let list = util::output(Command::new("tar").arg("-tf").arg(tar))?;
    Ok((list.lines().count(), std::fs::metadata(tar)?.len()))
}

/// MiB/s reading the whole file in 1 MiB blocks after dropping caches.
fn seq_read(path: &Path) -> Result<f64> {
    util::drop_caches()?;
    let mut f = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    let t = Instant::now();
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    Ok(total as f64 / (1 << 20) as f64 / t.elapsed().as_secs_f64())
}

/// Per-read latencies (µs) and reads/s for `n` 4 KiB reads at random aligned offsets, cold.
fn random_reads(path: &Path, n: usize) -> Result<(Vec<f64>, f64)> {
    util::drop_caches()?;
    let f = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let blocks = f.metadata()?.len() / 4096;
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let mut buf = [0u8; 4096];
    let mut lat = Vec::with_capacity(n);
    let t = Instant::now();
    for _ in 0..n {
        let off = rng.gen_range(0..blocks) * 4096;
        let t1 = Instant::now();
        f.read_exact_at(&mut buf, off)?;
        lat.push(t1.elapsed().as_secs_f64() * 1e6);
    }
    Ok((lat, n as f64 / t.elapsed().as_secs_f64()))
}

/// ms for `find DIR -exec stat -c %s {} +`.
fn find_stat(dir: &Path) -> Result<f64> {
    util::run(
        Command::new("find")
            .arg(dir)
            .args(["-exec", "stat", "-c", "%s", "{}", "+"]),
    )
}
