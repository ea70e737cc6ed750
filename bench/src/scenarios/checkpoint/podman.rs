//! Podman's rounds of the checkpoint scenario: `podman container checkpoint --export` of a
//! runc container (CRIU found on PATH) and N concurrent `container restore --import`s.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::{all_answer, mib, Figures, Params, TOUCH};
use crate::cleanup::{self, Guard};
use crate::peers::{self, PeerEnv};
use crate::scenarios::Ctx;
use crate::util;
use crate::workload;

pub(super) fn podman_rounds(ctx: &Ctx, p: &Params) -> Figures {
    let mut f = Figures::default();
    if let Err(e) = podman_inner(ctx, p, &mut f) {
        f.error = Some(format!("{e:#}"));
    }
    f
}

struct Podman<'a> {
    env: &'a PeerEnv,
    path: String,
}

impl Podman<'_> {
    fn cmd(&self) -> Command {
        let mut c = self.env.podman();
        c.env("PATH", &self.path);
        c
    }
    fn pid(&self, name: &str) -> Result<i32> {
        let s = util::output(self.cmd().args(["inspect", "-f", "{{.State.Pid}}", name]))?;
        s.trim()
            .parse()
            .with_context(|| format!("podman pid of {name}: {s:?}"))
    }
    fn rm(&self, names: &[String]) {
        for n in names {
            let _ = self.cmd().args(["rm", "-f", "-t", "0", n]).output();
        }
    }
}

fn podman_inner(ctx: &Ctx, p: &Params, f: &mut Figures) -> Result<()> {
    util::which("runc").context(
        "runc not installed (podman checkpoint needs it: Debian's crun is built without CRIU)",
    )?;
    let env = PeerEnv::prepare(&ctx.image, &ctx.work, true)?;
    if let Some(why) = env.unavailable(peers::Kind::Podman) {
        bail!(why);
    }
    let _hugetlb = peers::hugetlb_workaround().unwrap_or(None);
    // runc finds CRIU on PATH: put the CRIU >= 4.1 wrapper first.
    let bin = ctx.fresh_dir("criu-bin")?;
    std::os::unix::fs::symlink(&ctx.criu, bin.join("criu"))?;
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let pm = Podman { env: &env, path };
    let _sweep = Guard::new("podman checkpoint containers", {
        let conf = env.containers_conf.clone();
        move || {
            let f = format!("label={}", peers::PODMAN_LABEL);
            let mut c = Command::new("podman");
            c.env("CONTAINERS_CONF", &conf);
            let ids = util::output(c.args(["ps", "-aq", "--filter", &f])).unwrap_or_default();
            for id in ids.split_whitespace() {
                let mut c = Command::new("podman");
                let _ = c
                    .env("CONTAINERS_CONF", &conf)
                    .args(["rm", "-f", "-t", "0", id])
                    .output();
            }
            Ok(())
        }
    });
    let dir = ctx.fresh_dir("podman-ckpt")?;
    let mut last: Option<PathBuf> = None;
    for round in 0..p.rounds {
        cleanup::check()?;
        let name = peers::unique_name("ckpt");
        let mut c = pm.cmd();
        c.args([
            "run",
            "-d",
            "--runtime",
            "runc",
            "--network",
            "none",
            "--label",
            peers::PODMAN_LABEL,
            "--name",
            &name,
        ]);
        c.arg(peers::PODMAN_IMAGE)
            .arg("python3")
            .args(workload::args(p.heap, "/tmp/grove-bench-state"));
        let r = util::run(&mut c).and_then(|_| {
            let pid = pm.pid(&name)?;
            workload::wait_ready(pid, p.heap, Duration::from_secs(120))?;
            let a = dir.join(format!("r{round}-a.tar"));
            let ms1 = checkpoint(&pm, &name, &a)?;
            let pages = workload::touch(pid, TOUCH)?;
            let b = dir.join(format!("r{round}-b.tar"));
            let ms2 = checkpoint(&pm, &name, &b)?;
            let (b1, b2) = (std::fs::metadata(&a)?.len(), std::fs::metadata(&b)?.len());
            f.first_ms.push(ms1);
            f.second_ms.push(ms2);
            f.first_mib.push(mib(b1));
            f.second_mib.push(mib(b2));
            f.ratio.push(b2 as f64 / (pages * 4096) as f64);
            let _ = std::fs::remove_file(&a);
            if let Some(old) = last.replace(b) {
                let _ = std::fs::remove_file(old);
            }
            Ok(())
        });
        pm.rm(std::slice::from_ref(&name));
        r?;
    }
    let tar = last.ok_or_else(|| anyhow!("no checkpoint"))?;
    for &n in &p.branches {
        let mut v = Vec::new();
        for _ in 0..p.fork_reps {
            cleanup::check()?;
            let names: Vec<String> = (0..n).map(|_| peers::unique_name("restore")).collect();
            let t = Instant::now();
            let r = restore_n(&pm, &tar, &names).and_then(|pids| all_answer(&pids, p.heap));
            let ms = util::ms_since(t);
            pm.rm(&names);
            r?;
            v.push(ms);
        }
        f.fork_ms.push((n, v));
    }
    Ok(())
}

fn checkpoint(pm: &Podman<'_>, name: &str, tar: &Path) -> Result<f64> {
    let mut c = pm.cmd();
    c.args([
        "container",
        "checkpoint",
        "--leave-running",
        "--compress",
        "none",
        "--export",
    ])
    .arg(tar)
    .arg(name);
    util::run(&mut c)
}

fn restore_n(pm: &Podman<'_>, tar: &Path, names: &[String]) -> Result<Vec<i32>> {
    let rs: Vec<Result<i32>> = std::thread::scope(|s| {
        let hs: Vec<_> = names
            .iter()
            .map(|n| {
                s.spawn(move || -> Result<i32> {
                    let mut c = pm.cmd();
                    c.args(["container", "restore", "--import"])
                        .arg(tar)
                        .args(["--name", n]);
                    util::run(&mut c)?;
                    pm.pid(n)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("panicked"))))
            .collect()
    });
    rs.into_iter().collect()
}
