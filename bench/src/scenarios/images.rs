//! Images from where users keep them. Pull half: a local `docker-registry` serves an image made
//! from the base image (split in layers the way a Dockerfile would), and Grove (`POST
//! /v1/images/pull` into its store), `skopeo copy` (to an OCI directory) and `podman pull` (into
//! a private storage root) each pull it, then a second image that shares all but a small top
//! layer: time, and what the second one adds on disk. The build half (Dockerfile builds) adds its
//! own steps to `run`.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::Ctx;
use crate::groved::Daemon;
use crate::http::Conn;
use crate::promises::Stat;
use crate::report::{Better, Key, Measurement, ScenarioResult};
use crate::{progress, util};

pub const NAME: &str = "images";
pub const PULL: &str = "pull an image from a local registry";
pub const PULL_RELATED: &str = "pull a second image sharing all but its top layer";
pub const ADDED: &str = "disk the second image adds";
/// The second image's added bytes ÷ the first image's bytes on disk (the second is the first plus
/// one 64 KiB layer, so this slightly overstates the share of its own size).
pub const ADDED_RATIO: &str = "disk the second image adds ÷ the first image's";
pub const RATIO_PARAM: &str = "bytes on disk";
/// The faster of skopeo and podman on each pull figure (what IM-1 compares with).
pub const FASTER_PEER: &str = "faster peer (skopeo, podman)";
pub const GROVE: &str = "grove";
pub const SKOPEO: &str = "skopeo copy to an OCI dir";
pub const PODMAN: &str = "podman pull";

pub fn run(ctx: &Ctx, res: &mut ScenarioResult) -> Result<()> {
    for t in ["docker-registry", "skopeo"] {
        if util::which(t).is_none() {
            bail!("{t} is not installed (scripts/setup installs it)");
        }
    }
    progress::step(0.0, "making the image and starting the registry");
    let work = ctx.fresh_dir("images")?;
    // Quick: a few MB of the base image; full: all of it (~300 MB).
    let parts: &[&str] = if ctx.quick {
        &["etc", "usr/bin"]
    } else {
        &[
            "usr", "var", "etc", "bin", "lib", "lib64", "sbin", "root", "opt", "srv",
        ]
    };
    let layout = work.join("layout");
    let size = make_layout(&ctx.image, parts, &layout)?;
    let reg = Registry::start(&work.join("registry"))?;
    let host = format!("127.0.0.1:{}", reg.port);
    for (tag, repo) in [("base", "bench/base:1"), ("related", "bench/related:1")] {
        util::run(
            Command::new("skopeo")
                .args(["copy", "--quiet", "--dest-tls-verify=false"])
                .arg(format!("oci:{}:{tag}", layout.display()))
                .arg(format!("docker://{host}/{repo}")),
        )
        .context("pushing the bench image")?;
    }
    res.note(format!(
        "image: {} of the base image in {} gzip layers ({:.1} MB compressed); the related image adds \
         one 64 KiB layer; registry: docker-registry on loopback, plain HTTP; one run each \
         (a loaded 2-core machine: figures are indicative)",
        parts.join(", "),
        parts.len(),
        size as f64 / 1e6
    ));

    progress::step(0.2, "grove");
    let mut daemon = Daemon::start(
        ctx,
        "images",
        "10.219.0.0/16",
        &format!("[registries]\ninsecure = [\"{host}\"]\n"),
    )?;
    let r = grove_pulls(&daemon, &host, res);
    let stop = daemon.stop();
    r?;
    stop?;

    progress::step(0.5, "skopeo");
    let oci = work.join("skopeo-oci");
    let key = Key::new(PULL, "cold", "ms", Better::Lower);
    let key2 = Key::new(PULL_RELATED, "after the first", "ms", Better::Lower);
    let added = Key::new(ADDED, "bytes on disk", "MB", Better::Lower);
    let ratio = Key::new(ADDED_RATIO, RATIO_PARAM, "×", Better::Lower);
    let copy = |repo: &str, tag: &str| {
        util::run(
            Command::new("skopeo")
                .args(["copy", "--quiet", "--src-tls-verify=false"])
                .arg(format!("docker://{host}/{repo}"))
                .arg(format!("oci:{}:{tag}", oci.display())),
        )
    };
    res.push(Measurement::samples(
        &key,
        SKOPEO,
        false,
        &[copy("bench/base:1", "base")?],
    ));
    let before = du(&oci)?;
    res.push(Measurement::samples(
        &key2,
        SKOPEO,
        false,
        &[copy("bench/related:1", "related")?],
    ));
    let after = du(&oci)?;
    res.push(Measurement::value(
        &added,
        SKOPEO,
        false,
        (after - before) / 1e6,
    ));
    res.push(Measurement::value(
        &ratio,
        SKOPEO,
        false,
        (after - before) / before,
    ));

    progress::step(0.75, "podman");
    if util::which("podman").is_none() {
        res.push(Measurement::not_available(
            &key,
            PODMAN,
            "podman is not installed",
        ));
    } else {
        let root = work.join("podman");
        // podman refuses a runroot path longer than 50 bytes, so it gets a short one of its own.
        let runroot =
            std::path::PathBuf::from(format!("/run/grove-bench-podman-{}", std::process::id()));
        let pull = |repo: &str| {
            util::run(
                Command::new("podman")
                    .arg("--root")
                    .arg(root.join("root"))
                    .arg("--runroot")
                    .arg(&runroot)
                    .args(["pull", "--quiet", "--tls-verify=false"])
                    .arg(format!("{host}/{repo}")),
            )
        };
        // No `?` until podman's storage is reset below: its overlay mounts must not outlive a
        // failed pull.
        match pull("bench/base:1") {
            Ok(ms) => {
                res.push(Measurement::samples(&key, PODMAN, false, &[ms]));
                let before = du(&root).unwrap_or(0.0);
                match pull("bench/related:1") {
                    Ok(ms) => {
                        res.push(Measurement::samples(&key2, PODMAN, false, &[ms]));
                        let grew = du(&root).unwrap_or(before) - before;
                        res.push(Measurement::value(&added, PODMAN, false, grew / 1e6));
                        if before > 0.0 {
                            res.push(Measurement::value(&ratio, PODMAN, false, grew / before));
                        }
                    }
                    Err(e) => res.push(Measurement::failed(&key2, PODMAN, false, format!("{e:#}"))),
                }
            }
            Err(e) => res.push(Measurement::failed(&key, PODMAN, false, format!("{e:#}"))),
        }
        // Its storage holds overlay mounts and layers owned by podman: let it remove them.
        let _ = Command::new("podman")
            .arg("--root")
            .arg(root.join("root"))
            .arg("--runroot")
            .arg(&runroot)
            .args(["system", "reset", "--force"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&runroot);
    }
    drop(reg);
    let _ = std::fs::remove_dir_all(&work);
    // IM-1 and IM-2 are about the ~300 MB image: a quick run's few MB do not measure them.
    if ctx.quick {
        res.measurements.retain(|m| m.metric != ADDED_RATIO);
    } else {
        for k in [&key, &key2] {
            faster_peer(res, k);
        }
    }
    Ok(())
}

/// Adds the faster of the peers' medians on `key` as its own row, when either measured it.
fn faster_peer(res: &mut ScenarioResult, key: &Key) {
    let fastest = [SKOPEO, PODMAN]
        .iter()
        .filter_map(|p| res.find(&key.metric, &key.param, p))
        .filter_map(|m| m.stat(Stat::P50))
        .min_by(f64::total_cmp);
    if let Some(v) = fastest {
        res.push(Measurement::value(key, FASTER_PEER, false, v));
    }
}

fn grove_pulls(daemon: &Daemon, host: &str, res: &mut ScenarioResult) -> Result<()> {
    let mut c = Conn::new(&daemon.socket());
    let store = daemon.dir.join("state/store");
    let mut pull = |repo: &str, name: &str| -> Result<(f64, Value)> {
        let t = Instant::now();
        let v = c
            .request(
                "POST",
                "/v1/images/pull",
                Some(&json!({"reference": format!("{host}/{repo}"), "name": name})),
            )?
            .ok_json()
            .with_context(|| format!("grove pull of {repo}"))?;
        Ok((util::ms_since(t), v))
    };
    let empty = du(&store).unwrap_or(0.0);
    let (ms, _) = pull("bench/base:1", "bench-base")?;
    res.push(Measurement::samples(
        &Key::new(PULL, "cold", "ms", Better::Lower),
        GROVE,
        true,
        &[ms],
    ));
    let before = du(&store)?;
    let (ms, _) = pull("bench/related:1", "bench-related")?;
    res.push(Measurement::samples(
        &Key::new(PULL_RELATED, "after the first", "ms", Better::Lower),
        GROVE,
        true,
        &[ms],
    ));
    let grew = du(&store)? - before;
    res.push(Measurement::value(
        &Key::new(ADDED, "bytes on disk", "MB", Better::Lower),
        GROVE,
        true,
        grew / 1e6,
    ));
    res.push(Measurement::value(
        &Key::new(ADDED_RATIO, RATIO_PARAM, "×", Better::Lower),
        GROVE,
        true,
        grew / (before - empty),
    ));
    Ok(())
}

/// Bytes under `dir` (`du -sb`).
fn du(dir: &Path) -> Result<f64> {
    let out = util::output(Command::new("du").arg("-sb").arg(dir))?;
    out.split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .context("du printed no size")
}

/// An OCI layout with `base` (one gzip layer per part of the image) and `related` (the same plus
/// a small layer); returns the compressed size of `base`'s layers.
fn make_layout(image: &Path, parts: &[&str], layout: &Path) -> Result<u64> {
    let blobs = layout.join("blobs/sha256");
    std::fs::create_dir_all(&blobs)?;
    std::fs::write(
        layout.join("oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )?;
    let tmp = layout.join("blob.tmp");
    // Moves `tmp` to its digest's name; its descriptor.
    let put = |media: &str| -> Result<Value> {
        let out = util::output(Command::new("sha256sum").arg(&tmp))?;
        let hex = out
            .split_whitespace()
            .next()
            .context("sha256sum printed nothing")?
            .to_string();
        let size = std::fs::metadata(&tmp)?.len();
        std::fs::rename(&tmp, blobs.join(&hex))?;
        Ok(json!({"mediaType": media, "digest": format!("sha256:{hex}"), "size": size}))
    };
    const LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
    let mut layers = Vec::new();
    let mut total = 0u64;
    for p in parts {
        if !image.join(p).exists() {
            continue;
        }
        util::sh(&format!(
            "tar -C {} --numeric-owner -cf - {p} | gzip -1 > {}",
            image.display(),
            tmp.display()
        ))?;
        let d = put(LAYER)?;
        total += d["size"].as_u64().unwrap_or(0);
        layers.push(d);
    }
    util::sh(&format!(
        "d=$(mktemp -d) && mkdir $d/srv && head -c 65536 /dev/urandom > $d/srv/data && \
         tar -C $d -cf - srv | gzip -1 > {}; rm -rf $d",
        tmp.display()
    ))?;
    let small = put(LAYER)?;
    let mut related = layers.clone();
    related.push(small);
    // A config names its layers by the digests of their uncompressed tars: two images with
    // different layers have different configs (podman keys images by the config's digest).
    let diff_id = |d: &Value| -> Result<String> {
        let hex = d["digest"]
            .as_str()
            .unwrap_or("")
            .trim_start_matches("sha256:");
        let out = util::output(Command::new("sh").arg("-c").arg(format!(
            "gzip -dc {} | sha256sum",
            blobs.join(hex).display()
        )))?;
        let sum = out
            .split_whitespace()
            .next()
            .context("sha256sum printed nothing")?;
        Ok(format!("sha256:{sum}"))
    };
    let mut index = Vec::new();
    for (tag, ls) in [("base", layers), ("related", related)] {
        let diff_ids = ls.iter().map(&diff_id).collect::<Result<Vec<_>>>()?;
        let cfg = json!({"architecture": "amd64", "os": "linux",
            "config": {"Env": ["PATH=/usr/bin:/bin"], "Cmd": ["/bin/sh"]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids}});
        std::fs::write(&tmp, cfg.to_string())?;
        let c = put("application/vnd.oci.image.config.v1+json")?;
        let m = json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": c, "layers": ls});
        std::fs::write(&tmp, m.to_string())?;
        let mut d = put("application/vnd.oci.image.manifest.v1+json")?;
        d["annotations"] = json!({"org.opencontainers.image.ref.name": tag});
        index.push(d);
    }
    let idx = json!({"schemaVersion": 2, "manifests": index});
    std::fs::write(layout.join("index.json"), idx.to_string())?;
    Ok(total)
}

/// A `docker-registry serve` on a free loopback port, killed on drop.
struct Registry {
    port: u16,
    child: Child,
}

impl Registry {
    fn start(dir: &Path) -> Result<Registry> {
        std::fs::create_dir_all(dir.join("data"))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        std::fs::write(
            dir.join("config.yml"),
            format!(
                "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n\
                 http:\n  addr: 127.0.0.1:{port}\n",
                dir.join("data").display()
            ),
        )?;
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(dir.join("config.yml"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting docker-registry")?;
        let reg = Registry { port, child };
        if !util::wait_until(Duration::from_secs(20), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        }) {
            bail!("docker-registry did not listen on {port}");
        }
        Ok(reg)
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
