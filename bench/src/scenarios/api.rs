//! What the HTTP API adds over calling the runtime library directly: the same operations on the same
//! image and limits, through a real `groved` (unix socket, one kept-alive connection, JSON bodies) and
//! through `grove_runtime::Runtime` in-process, interleaved one for one in the same run.

use std::path::Path;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use grove_runtime::{Limits, SandboxId};
use serde_json::json;

use super::Ctx;
use crate::grove::GroveRuntime;
use crate::groved::Daemon;
use crate::http::Conn;
use crate::report::{Better, Key, Measurement, ScenarioResult};
use crate::{cleanup, progress, stats, util};

pub const NAME: &str = "api";
pub const GET: &str = "get a sandbox";
pub const EXEC: &str = "exec true in a live sandbox";
pub const CYCLE: &str = "create → exec true → destroy";
pub const ADDED: &str = "latency the API adds over the library";
/// The added-latency parameter promise API-1 reads.
pub const EXEC_ADDED_P50: &str = "exec true in a live sandbox, p50";
pub const API: &str = "grove API";
pub const LIBRARY: &str = "grove library";
const IMAGE: &str = "debian12-bench";

pub fn run(ctx: &Ctx, res: &mut ScenarioResult) -> Result<()> {
    let lib = ctx
        .grove
        .runtime()
        .map_err(|e| anyhow!("the runtime library: {e}"))?;
    progress::step(0.0, "starting groved and importing the image");
    let mut daemon = Daemon::start(
        ctx,
        "api",
        "10.218.0.0/16",
        "[capacity]\nsandboxes = 256\nmemory_mb = 65536\n",
    )?;
    let mut api = Api {
        conn: Conn::new(&daemon.socket()),
    };
    api.import(&ctx.image)?;
    res.note(format!(
        "API: a groved of this build (pid {}) on a unix socket, one kept-alive HTTP/1.1 connection; \
         library: the same runtime in the bench's process ({}); same image, same limits; \
         the two alternate call by call",
        daemon.pid(),
        lib.describe()
    ));

    let n_op = ctx.pick(30, 300);
    let n_cycle = ctx.pick(10, 100);
    let lib_sb = lib.create(lib.spec(Some(Limits::default())))?;
    let api_sb = api.create();
    let r = (|| -> Result<()> {
        let api_sb = api_sb.as_ref().map_err(|e| anyhow!("{e:#}"))?;
        progress::step(0.1, &format!("get and exec, {n_op} each"));
        let (a, l) = interleave(n_op, || api.get(api_sb), || lib_get(&lib, &lib_sb))?;
        record(res, GET, &a, &l);
        let (a, l) = interleave(
            n_op,
            || api.exec_true(api_sb),
            || lib.exec_ok(&lib_sb, &["true"]).map(drop),
        )?;
        record(res, EXEC, &a, &l);
        progress::step(0.5, &format!("create → exec → destroy, {n_cycle} each"));
        let (a, l) = interleave(
            n_cycle,
            || api.cycle(),
            || {
                let id = lib.create(lib.spec(Some(Limits::default())))?;
                let r = lib.exec_ok(&id, &["true"]);
                lib.destroy(&id)?;
                r.map(drop)
            },
        )?;
        record(res, CYCLE, &a, &l);
        Ok(())
    })();
    if let Ok(id) = &api_sb {
        let _ = api.delete(id);
    }
    let _ = lib.destroy(&lib_sb);
    let stop = daemon.stop();
    r?;
    stop?;
    let left = util::sweep_cgroups(&daemon.cgroup_root);
    if left > 0 {
        bail!("groved left {left} cgroup directories behind");
    }
    Ok(())
}

/// Runs `a` and `b` alternately `n` times after two warm-up rounds; returns their latencies (ms).
fn interleave(
    n: usize,
    mut a: impl FnMut() -> Result<()>,
    mut b: impl FnMut() -> Result<()>,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (mut sa, mut sb) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n + 2 {
        cleanup::check()?;
        let t = Instant::now();
        a().context("through the API")?;
        let ta = util::ms_since(t);
        let t = Instant::now();
        b().context("through the library")?;
        let tb = util::ms_since(t);
        if i >= 2 {
            sa.push(ta);
            sb.push(tb);
        }
    }
    Ok((sa, sb))
}

/// Both systems' samples, and the added latency at p50 and p99.
fn record(res: &mut ScenarioResult, metric: &str, api: &[f64], lib: &[f64]) {
    let key = Key::new(metric, "sequential", "ms", Better::Lower);
    res.push(Measurement::samples(&key, API, true, api));
    res.push(Measurement::samples(&key, LIBRARY, false, lib));
    let (a, l) = (stats::summarize(api), stats::summarize(lib));
    if let (Some(a), Some(l)) = (a, l) {
        let k50 = Key::new(ADDED, format!("{metric}, p50"), "ms", Better::Lower);
        res.push(Measurement::value(&k50, API, true, a.p50 - l.p50));
        let k99 = Key::new(ADDED, format!("{metric}, p99"), "ms", Better::Lower);
        res.push(Measurement::value(&k99, API, true, a.p99 - l.p99));
    }
}

fn lib_get(lib: &GroveRuntime, id: &SandboxId) -> Result<()> {
    lib.rt.get(id).map_err(|e| anyhow!("get: {e}"))?;
    Ok(())
}

/// The API calls the scenario makes.
struct Api {
    conn: Conn,
}

impl Api {
    fn import(&mut self, image: &Path) -> Result<()> {
        let body = json!({"name": IMAGE, "source": "dir", "path": image.display().to_string()});
        self.conn
            .request("POST", "/v1/images", Some(&body))?
            .ok_json()
            .context("importing the image into groved's store")?;
        Ok(())
    }

    fn create(&mut self) -> Result<String> {
        let l = Limits::default();
        let body = json!({"image": IMAGE, "limits": {
            "cpu_millis": l.cpu_millis, "memory_mb": l.memory_mb, "pids": l.pids,
            "open_files": l.open_files, "disk_mb": l.disk_mb}});
        let v = self
            .conn
            .request("POST", "/v1/sandboxes", Some(&body))?
            .ok_json()?;
        v["id"]
            .as_str()
            .map(String::from)
            .context("create response has no id")
    }

    fn get(&mut self, id: &str) -> Result<()> {
        self.conn
            .request("GET", &format!("/v1/sandboxes/{id}"), None)?
            .ok_json()?;
        Ok(())
    }

    fn exec_true(&mut self, id: &str) -> Result<()> {
        let v = self
            .conn
            .request(
                "POST",
                &format!("/v1/sandboxes/{id}/exec"),
                Some(&json!({"argv": ["true"]})),
            )?
            .ok_json()?;
        if v["exit_code"] != json!(0) {
            bail!("exec true: {v}");
        }
        Ok(())
    }

    fn delete(&mut self, id: &str) -> Result<()> {
        let r = self
            .conn
            .request("DELETE", &format!("/v1/sandboxes/{id}"), None)?;
        if !(200..300).contains(&r.status) {
            bail!(
                "delete {id}: HTTP {}: {}",
                r.status,
                String::from_utf8_lossy(&r.body)
            );
        }
        Ok(())
    }

    fn cycle(&mut self) -> Result<()> {
        let id = self.create()?;
        let r = self.exec_true(&id);
        self.delete(&id)?;
        r
    }
}
