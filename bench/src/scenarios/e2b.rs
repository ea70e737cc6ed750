//! E2B's SDK against Grove's own Python client on the same daemon: `commands.run("true")` one for
//! one (p50/p99 and what the E2B path adds), SDK create → first command, and the SDK's fork of 8
//! when the control plane has it. The Python side is bench/e2b/driver.py, run with the project's
//! venv.

use std::process::Command;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

use super::Ctx;
use crate::groved::Daemon;
use crate::http::Conn;
use crate::report::{Better, Key, Measurement, ScenarioResult};
use crate::{progress, stats, util};

pub const NAME: &str = "e2b";
pub const RUN: &str = "commands.run(\"true\") in a live sandbox";
pub const CREATE: &str = "SDK create → first command";
/// The create → first command figure with a warm pool of the template on the node.
pub const POOLED: &str = "sequential, warm pool of the template";
pub const FORK: &str = "SDK fork of 8";
pub const ADDED: &str = "latency the E2B path adds over Grove's client";
const IMAGE: &str = "debian12-bench";
const VENV_PYTHON: &str = "/var/lib/grove/venv/bin/python";
const DRIVER: &str = include_str!("../../e2b/driver.py");

fn samples(v: &Value, k: &str) -> Vec<f64> {
    v[k].as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}

pub fn run(ctx: &Ctx, res: &mut ScenarioResult) -> Result<()> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let addr = format!("127.0.0.1:{port}");
    progress::step(0.0, "starting groved with its E2B endpoint");
    let mut daemon = Daemon::start(
        ctx,
        "e2b",
        "10.219.0.0/16",
        &format!("e2b_listen = \"{addr}\"\n[capacity]\nsandboxes = 64\nmemory_mb = 65536\n"),
    )?;
    let r = (|| -> Result<Value> {
        let body = json!({"name": IMAGE, "source": "dir", "path": ctx.image.display().to_string()});
        Conn::new(&daemon.socket())
            .request("POST", "/v1/images", Some(&body))?
            .ok_json()
            .context("importing the image")?;
        let driver = ctx.work.join("e2b-driver.py");
        std::fs::write(&driver, DRIVER)?;
        progress::step(0.1, "the SDK and Grove's client, one for one");
        let (n_run, n_create) = (ctx.pick(30, 300), ctx.pick(5, 30));
        let out = Command::new(VENV_PYTHON)
            .arg(&driver)
            .args([&addr, &daemon.socket().display().to_string(), IMAGE])
            .args([n_run.to_string(), n_create.to_string(), "8".into()])
            .output()
            .with_context(|| format!("running {VENV_PYTHON}"))?;
        let _ = std::fs::remove_file(&driver);
        let text = String::from_utf8_lossy(&out.stdout);
        let v: Value =
            serde_json::from_str(text.trim().lines().last().unwrap_or("")).map_err(|e| {
                anyhow!(
                    "driver output ({e}): {text} {}",
                    String::from_utf8_lossy(&out.stderr)
                )
            })?;
        if let Some(e) = v.get("error") {
            bail!("driver: {e}: {}", v["trace"].as_str().unwrap_or(""));
        }
        Ok(v)
    })();
    let stop = daemon.stop();
    let v = r?;
    stop?;
    let left = util::sweep_cgroups(&daemon.cgroup_root);
    if left > 0 {
        bail!("groved left {left} cgroup directories behind");
    }
    res.note(
        "E2B: the unmodified e2b SDK (HTTP/2 to groved's E2B endpoint, Connect-RPC process service); \
         Grove: its Python client on the unix socket; same sandbox, alternating call by call, and \
         the same command: the SDK runs commands.run(\"true\") as `/bin/bash -l -c true`, so Grove's \
         client execs that argv as the same user (`user`). Create → first command: cold, then \
         with a warm pool of one sandbox of the template on the node (`PUT /v1/pools`), each \
         create made once the pool is ready again.",
    );
    let (sdk, native) = (samples(&v, "sdk_run"), samples(&v, "grove_run"));
    let key = Key::new(RUN, "sequential", "ms", Better::Lower);
    res.push(Measurement::samples(&key, "e2b SDK", true, &sdk));
    res.push(Measurement::samples(&key, "grove client", true, &native));
    if let (Some(a), Some(b)) = (stats::summarize(&sdk), stats::summarize(&native)) {
        let k = Key::new(ADDED, "p50", "ms", Better::Lower);
        res.push(Measurement::value(&k, "e2b SDK", true, a.p50 - b.p50));
        let k = Key::new(ADDED, "p99", "ms", Better::Lower);
        res.push(Measurement::value(&k, "e2b SDK", true, a.p99 - b.p99));
    }
    let key = Key::new(CREATE, "sequential", "ms", Better::Lower);
    res.push(Measurement::samples(
        &key,
        "e2b SDK",
        true,
        &samples(&v, "create_first"),
    ));
    let key = Key::new(CREATE, POOLED, "ms", Better::Lower);
    res.push(Measurement::samples(
        &key,
        "e2b SDK",
        true,
        &samples(&v, "create_first_pooled"),
    ));
    let fork = samples(&v, "fork");
    if fork.is_empty() {
        res.note(format!(
            "SDK fork of 8 not measured: {}",
            v["fork_error"]
                .as_str()
                .unwrap_or("the SDK has no fork call")
        ));
    } else {
        let key = Key::new(FORK, "wall", "ms", Better::Lower);
        res.push(Measurement::samples(&key, "e2b SDK", true, &fork));
    }
    Ok(())
}
