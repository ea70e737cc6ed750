//! Full-disk soak: groved's state dir on a small tmpfs of its own (`--state-fs-mb`, 256 by default)
//! that fills and empties. Each cycle: create (201, or 507 when the disk is full) → read image
//! files through the passthrough cache and write random files until the quota or the disk runs
//! out (a file PUT then answers 507) → hash them → snapshot (201, or 507 for a durable one that
//! does not fit) → fork a committed snapshot and compare its branch's hashes → destroy → delete the
//! oldest snapshots when too many are kept or the store is full → gc. No answer may be a 5xx other
//! than 507. It ends with: fsck clean; every committed, not deleted snapshot forks byte-exact; a
//! fresh create + snapshot + fork on the same store (no manual repair); zero residue; the
//! filesystem unmounted. `grove-bench --only soak-full-disk [--soak-cycles N] [--state-fs-mb N]`.

use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use groved::client::{Client, ClientError};
use hyper::Method;
use serde_json::{json, Value};

use super::soak::{api_residue, host_residue};
use super::Ctx;
use crate::groved::Daemon;
use crate::progress;
use crate::report::{Better, Key, Measurement, ScenarioResult};

pub const NAME: &str = "soak-full-disk";
/// Each sandbox's disk quota: a few fit next to the image (~106 MiB in the store) and its cache.
const QUOTA_MB: u64 = 32;
/// Committed snapshots kept at most (the oldest are deleted beyond this, or when one 507s).
const KEEP: usize = 5;
/// What the sandboxes write and hash: files of this many MiB until the quota runs out.
const WRITE: &str = "ls / >/dev/null && python3 -c 'import json' || echo READ-FAILED; \
    mkdir -p /root/d; i=0; while head -c 4M /dev/urandom > /root/d/f$i 2>/dev/null; \
    do i=$((i+1)); done; sync; cd /root/d && sha256sum * | sha256sum";
const HASH: &str = "cd /root/d && sha256sum * | sha256sum";

/// An answer: the JSON on success, else the status and the error's text.
type Answer = std::result::Result<Value, (u16, String)>;

/// What the cycles saw.
#[derive(Default)]
struct Tally {
    creates: u64,
    create_507: u64,
    put_507: u64,
    snapshots: u64,
    snapshot_507: u64,
    forks_checked: u64,
    fork_507: u64,
    deleted_snapshots: u64,
    gc_freed: u64,
    /// The last 507's message, to show what ran out.
    last_507: String,
    /// Answers that must not happen: 5xx other than 507, wrong bytes, unreadable image files.
    bad: Vec<String>,
}

pub fn run(ctx: &Ctx, res: &mut ScenarioResult) -> Result<()> {
    let cycles = ctx.soak_cycles.unwrap_or(ctx.pick(10, 40));
    let fs_mb = ctx.state_fs_mb.unwrap_or(256);
    let mut daemon = Daemon::start_on_fs(
        ctx,
        "soakfull",
        "10.218.0.0/16",
        &format!(
            "import_retry_secs = 2\n[capacity]\nsandboxes = 16\nmemory_reserve_mb = 0\n\
             [defaults]\ncpu_millis = 500\nmemory_mb = 128\npids = 64\nopen_files = 256\n\
             disk_mb = {QUOTA_MB}\n"
        ),
        Some(fs_mb),
    )?;
    let client = Client::new(daemon.socket());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let start = Instant::now();
    let mut t = Tally::default();
    let outcome = rt.block_on(drive(ctx, &client, cycles, &mut t));
    let residue = rt.block_on(api_residue(&client));
    drop(rt);
    let stopped = daemon.stop();
    let unmounted = daemon.unmount_state();
    let wall = start.elapsed().as_secs_f64();
    let host_left = host_residue(&daemon);

    let param = format!("{cycles} cycles, state dir on a {fs_mb} MiB tmpfs");
    res.push(Measurement::value(
        &Key::new("full-disk cycles per second", &param, "1/s", Better::Higher),
        "grove (groved API)",
        true,
        cycles as f64 / wall,
    ));
    res.note(format!(
        "{cycles} cycles in {wall:.0} s on a {fs_mb} MiB tmpfs: creates {} (507 {}), file PUT 507s {}, \
         snapshots committed {} (507 {}), forks checked byte-exact {} (507 {}), snapshots deleted {}, \
         gc freed {:.0} MiB in all",
        t.creates,
        t.create_507,
        t.put_507,
        t.snapshots,
        t.snapshot_507,
        t.forks_checked,
        t.fork_507,
        t.deleted_snapshots,
        t.gc_freed as f64 / 1048576.0,
    ));
    if !t.last_507.is_empty() {
        res.note(format!("the last 507: {}", t.last_507));
    }
    let mut failures = Vec::new();
    match &outcome {
        Ok(()) => res.note("pass: fsck clean, every kept snapshot forks byte-exact, fresh create + snapshot + fork after the last cycle".to_string()),
        Err(e) => failures.push(format!("{e:#}")),
    }
    if t.create_507 + t.snapshot_507 + t.put_507 == 0 {
        failures.push("the disk never filled (no 507): make --state-fs-mb smaller".into());
    }
    if let Some(first) = t.bad.first() {
        failures.push(format!("{} bad answers, first: {first}", t.bad.len()));
    }
    if let Err(e) = stopped {
        failures.push(format!("stopping groved: {e:#}"));
    }
    match unmounted {
        Ok(()) => res.note("pass: the state filesystem is unmounted".to_string()),
        Err(e) => failures.push(format!("unmounting the state dir: {e:#}")),
    }
    match residue {
        Ok(items) if items.is_empty() => res.note("pass: groved reports no residue".to_string()),
        Ok(items) => failures.push(format!("groved reports residue: {}", items.join("; "))),
        Err(e) => failures.push(format!("residue query: {e:#}")),
    }
    if host_left.is_empty() {
        res.note("pass: nothing left on the host".to_string());
    } else {
        failures.push(format!("left on the host: {}", host_left.join("; ")));
    }
    if failures.is_empty() {
        Ok(())
    } else {
        let log = ctx.out.join("soak-full-disk-groved.log");
        if std::fs::copy(daemon.dir.join("groved.log"), &log).is_ok() {
            res.note(format!("groved's log: {}", log.display()));
        }
        bail!(failures.join(" | "))
    }
}

/// A call whose answer is JSON; an API error is `Ok(Err(..))`, a transport error `Err`.
async fn req(c: &Client, method: Method, path: &str, body: Option<Value>) -> Result<Answer> {
    match c.json::<Value>(method.clone(), path, body.as_ref()).await {
        Ok(v) => Ok(Ok(v)),
        Err(ClientError::Api { status, body }) => Ok(Err((
            status.as_u16(),
            format!("{method} {path}: {}: {}", body.code, body.message),
        ))),
        Err(e) => Err(anyhow!(e).context(format!("{method} {path}"))),
    }
}

/// `Some(v)` on success; `None` on a 507 (counted by the caller); a bad answer otherwise.
fn ok_or_507(a: Answer, t: &mut Tally) -> Result<Option<Value>> {
    match a {
        Ok(v) => Ok(Some(v)),
        Err((507, m)) => {
            t.last_507 = m;
            Ok(None)
        }
        Err((s, m)) if s >= 500 => {
            t.bad.push(format!("{s} {m}"));
            Ok(None)
        }
        Err((s, m)) => bail!("{s} {m}"),
    }
}

async fn exec(c: &Client, id: &str, shell: &str) -> Result<Value> {
    let v: Value = c
        .json(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(&json!({"shell": shell, "timeout_ms": 60_000})),
        )
        .await
        .with_context(|| format!("exec in {id}"))?;
    Ok(v)
}

async fn delete_sandbox(c: &Client, id: &str) -> Result<()> {
    c.call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
        .await
        .with_context(|| format!("deleting {id}"))?;
    Ok(())
}

/// Forks `name` and compares its branch's hash with `hash`: Ok(true) if checked, Ok(false) on 507.
async fn fork_and_check(c: &Client, name: &str, hash: &str, t: &mut Tally) -> Result<bool> {
    let a = req(
        c,
        Method::POST,
        &format!("/v1/snapshots/{name}/fork"),
        Some(json!({"count": 1})),
    )
    .await?;
    let Some(v) = ok_or_507(a, t)? else {
        t.fork_507 += 1;
        return Ok(false);
    };
    let branch = &v["results"][0];
    let Some(id) = branch["sandbox"]["id"].as_str() else {
        // A branch that failed for want of space is honest; anything else is not.
        let m = branch.to_string();
        if m.contains("insufficient_storage") {
            t.fork_507 += 1;
            return Ok(false);
        }
        bail!("committed snapshot {name} does not fork: {m}");
    };
    let out = exec(c, id, HASH).await;
    delete_sandbox(c, id).await?;
    let got = out?["stdout"].as_str().unwrap_or("").trim().to_string();
    if got != hash {
        t.bad.push(format!(
            "branch of {name}: files hash {got:?}, before the snapshot {hash:?}"
        ));
    }
    t.forks_checked += 1;
    Ok(true)
}

async fn drive(ctx: &Ctx, c: &Client, cycles: u64, t: &mut Tally) -> Result<()> {
    progress::step(0.0, "soak-full-disk: importing the base image");
    let image = ctx.image.to_string_lossy().into_owned();
    c.call(
        Method::POST,
        "/v1/images",
        Some(&json!({"name": "base", "source": "dir", "path": image})),
    )
    .await
    .context("importing the base image (does it fit in --state-fs-mb?)")?;
    // Committed and not deleted: (name, hash of its files).
    let mut kept: Vec<(String, String)> = Vec::new();
    for i in 0..cycles {
        if crate::cleanup::cancelled() {
            bail!("cancelled");
        }
        cycle(c, i, &mut kept, t).await?;
        progress::step(
            (i + 1) as f64 / cycles as f64,
            &format!("soak-full-disk: {}/{cycles} cycles", i + 1),
        );
    }
    // The end: fsck, every kept snapshot byte-exact, a fresh round on the same store.
    fsck(c, "after the last cycle").await?;
    for (name, hash) in &kept {
        if !fork_and_check(c, name, hash, t).await? {
            bail!("committed snapshot {name} could not fork (507) with no sandbox left");
        }
    }
    for (name, _) in kept.drain(..) {
        delete_snapshot(c, &name, t).await?;
    }
    gc(c, t).await?;
    let sb: Value = c
        .json(
            Method::POST,
            "/v1/sandboxes",
            Some(&json!({"image": "base"})),
        )
        .await
        .context("a fresh create after the soak")?;
    let id = sb["id"].as_str().ok_or_else(|| anyhow!("no id in {sb}"))?;
    let hash = exec(c, id, WRITE).await?["stdout"]
        .as_str()
        .unwrap_or("")
        .trim()
        .to_string();
    let snap: Value = c
        .json(
            Method::POST,
            &format!("/v1/sandboxes/{id}/snapshot"),
            Some(&json!({"durable": true})),
        )
        .await
        .context("a fresh durable snapshot after the soak")?;
    delete_sandbox(c, id).await?;
    let name = snap["name"].as_str().unwrap_or_default().to_string();
    if !fork_and_check(c, &name, &hash, t).await? {
        bail!("the fresh snapshot after the soak could not fork (507)");
    }
    delete_snapshot(c, &name, t).await?;
    gc(c, t).await?;
    fsck(c, "at the end").await
}

async fn cycle(c: &Client, i: u64, kept: &mut Vec<(String, String)>, t: &mut Tally) -> Result<()> {
    let full_before = t.create_507 + t.snapshot_507 + t.fork_507;
    let a = req(
        c,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"image": "base", "labels": {"soak": "full-disk"}})),
    )
    .await?;
    let made = ok_or_507(a, t)?;
    if let Some(sb) = made {
        t.creates += 1;
        let id = sb["id"]
            .as_str()
            .ok_or_else(|| anyhow!("no id in {sb}"))?
            .to_string();
        let r = fill_and_snapshot(c, &id, i, kept, t).await;
        delete_sandbox(c, &id).await?;
        r?;
    } else {
        t.create_507 += 1;
    }
    // Fork a kept snapshot (not only the newest) now and then.
    if !i.is_multiple_of(2) && !kept.is_empty() {
        let (name, hash) = kept[(i as usize / 2) % kept.len()].clone();
        fork_and_check(c, &name, &hash, t).await?;
    }
    // Empty the disk again: the oldest snapshots go when too many are kept or anything 507'd.
    let full = t.create_507 + t.snapshot_507 + t.fork_507 > full_before;
    while kept.len() > KEEP || (full && kept.len() > 1) {
        let (name, _) = kept.remove(0);
        delete_snapshot(c, &name, t).await?;
        if !full {
            break;
        }
    }
    gc(c, t).await
}

async fn fill_and_snapshot(
    c: &Client,
    id: &str,
    i: u64,
    kept: &mut Vec<(String, String)>,
    t: &mut Tally,
) -> Result<()> {
    let v = exec(c, id, WRITE).await?;
    let out = v["stdout"].as_str().unwrap_or("");
    if out.contains("READ-FAILED") {
        t.bad.push(format!("{id}: image files unreadable: {v}"));
    }
    let hash = out.lines().last().unwrap_or("").trim().to_string();
    if hash.len() < 64 {
        bail!("no hash of the written files in {id}: {v}");
    }
    // The quota (or the disk) is full now: a file PUT must be a 507.
    let resp = c
        .send(
            Method::PUT,
            &format!("/v1/sandboxes/{id}/files?path=/root/more.bin"),
            Some("application/octet-stream"),
            // Small enough to sit in the socket buffer: groved answers before it reads a body.
            hyper::body::Bytes::from(vec![1u8; 64 << 10]),
        )
        .await?;
    match resp.status().as_u16() {
        507 => t.put_507 += 1,
        s if s < 300 => {
            // Room was left: take it out again so the snapshot holds only what was hashed.
            exec(c, id, "rm -f /root/more.bin").await?;
        }
        s => t.bad.push(format!("file PUT on a full quota answered {s}")),
    }
    let a = req(
        c,
        Method::POST,
        &format!("/v1/sandboxes/{id}/snapshot"),
        Some(json!({"durable": i.is_multiple_of(2)})),
    )
    .await?;
    match ok_or_507(a, t)? {
        Some(s) => {
            t.snapshots += 1;
            let name = s["name"]
                .as_str()
                .ok_or_else(|| anyhow!("no name in {s}"))?;
            kept.push((name.to_string(), hash));
        }
        None => t.snapshot_507 += 1,
    }
    Ok(())
}

async fn delete_snapshot(c: &Client, name: &str, t: &mut Tally) -> Result<()> {
    c.call(Method::DELETE, &format!("/v1/snapshots/{name}"), None)
        .await
        .with_context(|| format!("deleting snapshot {name}"))?;
    t.deleted_snapshots += 1;
    Ok(())
}

async fn gc(c: &Client, t: &mut Tally) -> Result<()> {
    let a = req(c, Method::POST, "/v1/node/gc", None).await?;
    match a {
        Ok(v) => t.gc_freed += v["report"]["freed_bytes"].as_u64().unwrap_or(0),
        Err((s, m)) => bail!("gc answered {s}: {m}"),
    }
    Ok(())
}

async fn fsck(c: &Client, when: &str) -> Result<()> {
    let v: Value = c
        .json(Method::POST, "/v1/node/fsck", None)
        .await
        .with_context(|| format!("fsck {when}"))?;
    if v["ok"] != true {
        bail!("fsck {when} is not clean: {v}");
    }
    Ok(())
}
