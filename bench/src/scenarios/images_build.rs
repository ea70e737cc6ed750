//! The build half of the `images` scenario: a 6-step Dockerfile (COPY, COPY, RUN, WORKDIR, ENV,
//! RUN) built cold and then fully cached, `grove build` through a real groved vs `podman build`
//! (buildah) on the same base image, alternating. Goal: a cached rebuild in ≤ 0.5 s.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::json;

use super::Ctx;
use crate::groved::Daemon;
use crate::http::Conn;
use crate::report::{Better, Key, Measurement, ScenarioResult};
use crate::{cleanup, progress, util};

pub const NAME: &str = "images-build";
pub const COLD: &str = "build a 6-step Dockerfile, cold";
pub const CACHED: &str = "rebuild it, fully cached";
const BASE: &str = "debian12-build-bench";
const PODMAN_BASE: &str = "localhost/grove-bench-build-base:latest";

const DOCKERFILE: &str = "FROM BASE\n\
COPY nonce /nonce\n\
COPY src/ /app/src/\n\
RUN ls -R /app/src > /app/manifest.txt && cat /nonce >> /app/manifest.txt\n\
WORKDIR /app\n\
ENV MODE=bench\n\
RUN wc -l manifest.txt > lines.txt\n\
CMD [\"cat\", \"/app/manifest.txt\"]\n";

pub fn run(ctx: &Ctx, res: &mut ScenarioResult) -> Result<()> {
    let rounds = ctx.pick(1, 5);
    let exe = std::env::current_exe()?;
    let grove = std::env::var_os("GROVE_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| exe.with_file_name("grove"));
    if !grove.is_file() {
        bail!(
            "{} not found (build it next to grove-bench or set GROVE_BIN)",
            grove.display()
        );
    }
    progress::step(0.0, "starting groved and importing the base image");
    let mut daemon = Daemon::start(ctx, "images-build", "10.219.0.0/16", "")?;
    let r = (|| -> Result<()> {
        let mut conn = Conn::new(&daemon.socket());
        conn.request(
            "POST",
            "/v1/images",
            Some(&json!({"name": BASE, "source": "dir", "path": ctx.image.display().to_string()})),
        )?
        .ok_json()
        .context("importing the base image into groved")?;
        let podman = podman_base(ctx);
        if let Err(e) = &podman {
            res.note(format!("podman build not measured: {e:#}"));
        }
        let (mut g_cold, mut g_cached, mut p_cold, mut p_cached) = (vec![], vec![], vec![], vec![]);
        for i in 0..rounds {
            cleanup::check()?;
            progress::step(
                i as f64 / rounds as f64,
                &format!("round {}/{rounds}", i + 1),
            );
            let dir = ctx.fresh_dir("build-ctx")?;
            write_context(&dir, BASE, &format!("{}-{i}", util::utc_now()))?;
            let sock = daemon.socket();
            let grove_build = || -> Result<f64> {
                let t = Instant::now();
                let out = Command::new(&grove)
                    .arg("--socket")
                    .arg(&sock)
                    .args(["build", "-q", "-t", "bench-built"])
                    .arg(&dir)
                    .stdout(Stdio::null())
                    .output()?;
                if !out.status.success() {
                    bail!("grove build: {}", String::from_utf8_lossy(&out.stderr));
                }
                Ok(util::ms_since(t))
            };
            g_cold.push(grove_build()?);
            g_cached.push(grove_build()?);
            if podman.is_ok() {
                let pdir = ctx.fresh_dir("podman-ctx")?;
                write_context(&pdir, PODMAN_BASE, &format!("{}-{i}", util::utc_now()))?;
                let podman_build = || -> Result<f64> {
                    let t = Instant::now();
                    let out = Command::new("podman")
                        .args([
                            "build",
                            "-q",
                            "--layers",
                            "--network=none",
                            "-t",
                            "grove-bench-built",
                        ])
                        .arg(&pdir)
                        .stdout(Stdio::null())
                        .output()?;
                    if !out.status.success() {
                        bail!("podman build: {}", String::from_utf8_lossy(&out.stderr));
                    }
                    Ok(util::ms_since(t))
                };
                p_cold.push(podman_build()?);
                p_cached.push(podman_build()?);
            }
        }
        for (metric, g, p) in [(COLD, &g_cold, &p_cold), (CACHED, &g_cached, &p_cached)] {
            let key = Key::new(metric, "sequential", "ms", Better::Lower);
            res.push(Measurement::samples(&key, "grove build", true, g));
            if podman.is_ok() {
                res.push(Measurement::samples(&key, "podman build", false, p));
            } else {
                res.push(Measurement::not_available(
                    &key,
                    "podman build",
                    "podman missing",
                ));
            }
        }
        res.note(
            "the same Dockerfile and context for both; each round's first build has a fresh \
             file in its first COPY (cold), the second build changes nothing (cached); RUN \
             without network for both",
        );
        Ok(())
    })();
    let _ = Command::new("podman")
        .args(["rmi", "-f", "grove-bench-built", PODMAN_BASE])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    let _ = Command::new("podman")
        .args(["image", "prune", "-f"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    let stop = daemon.stop();
    r?;
    stop?;
    let left = util::sweep_cgroups(&daemon.cgroup_root);
    if left > 0 {
        bail!("groved left {left} cgroup directories behind");
    }
    Ok(())
}

fn write_context(dir: &Path, base: &str, nonce: &str) -> Result<()> {
    std::fs::write(dir.join("Dockerfile"), DOCKERFILE.replace("BASE", base))?;
    std::fs::write(dir.join("nonce"), nonce)?;
    for d in 0..4 {
        let sub = dir.join(format!("src/pkg{d}"));
        std::fs::create_dir_all(&sub)?;
        for f in 0..25 {
            std::fs::write(
                sub.join(format!("m{f}.py")),
                format!("X = {d}{f}\n").repeat(40),
            )?;
        }
    }
    Ok(())
}

/// The base image root as a podman image (a tar import).
fn podman_base(ctx: &Ctx) -> Result<()> {
    if Command::new("podman").arg("--version").output().is_err() {
        bail!("podman is not installed");
    }
    let tar = Command::new("tar")
        .arg("-C")
        .arg(&ctx.image)
        .args(["-c", "."])
        .stdout(Stdio::piped())
        .spawn()?;
    let st = Command::new("podman")
        .args(["import", "-", PODMAN_BASE])
        .stdin(tar.stdout.context("tar stdout")?)
        .stdout(Stdio::null())
        .status()?;
    if !st.success() {
        bail!("podman import failed");
    }
    Ok(())
}
