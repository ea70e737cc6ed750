//! Sandbox verbs: create, run, exec, ls, inspect, rm, pause, resume.

use std::io::Write as _;

use base64::Engine as _;
use http_body_util::BodyExt as _;
use hyper::Method;
use serde_json::{json, Value};

use super::{pairs, CliError, CliResult, CreateArgs, ExecArgs, LsArgs, RmArgs, RunArgs, SpecArgs};
use crate::api_shapes::{BatchDeleteResponse, BatchResponse, ExecResultWire, Sandbox, SandboxList};
use crate::client::{check, enc, Client, SseParser};

/// The create request body for these flags.
pub fn spec_json(image: Option<&str>, s: &SpecArgs) -> CliResult<Value> {
    let mut body = json!({});
    if let Some(i) = image {
        body["image"] = i.into();
    }
    let mut limits = serde_json::Map::new();
    let mut put = |k: &str, v: Option<Value>| {
        if let Some(v) = v {
            limits.insert(k.into(), v);
        }
    };
    put("cpu_millis", s.cpu.map(Into::into));
    put("memory_mb", s.memory.map(Into::into));
    put("pids", s.pids.map(Into::into));
    put("disk_mb", s.disk.map(Into::into));
    if !limits.is_empty() {
        body["limits"] = Value::Object(limits);
    }
    if !s.env.is_empty() {
        body["env"] = Value::Object(pairs("--env", &s.env)?);
    }
    if !s.label.is_empty() {
        body["labels"] = Value::Object(pairs("--label", &s.label)?);
    }
    if let Some(t) = s.ttl {
        body["ttl_secs"] = t.into();
    }
    if let Some(h) = &s.hostname {
        body["hostname"] = h.clone().into();
    }
    if let Some(w) = &s.workdir {
        body["workdir"] = w.clone().into();
    }
    if !s.allow.is_empty() {
        let mut allow = Vec::new();
        for a in &s.allow {
            let (cidr, ports) = match a.rsplit_once(':') {
                Some((c, p)) if !c.contains(':') || c.contains('/') => (c, Some(p)),
                _ => (a.as_str(), None),
            };
            let ports: Vec<u16> = match ports {
                Some(p) => p
                    .split(',')
                    .map(|x| {
                        x.parse()
                            .map_err(|_| CliError::Usage(format!("--allow {a:?}: bad port {x:?}")))
                    })
                    .collect::<CliResult<_>>()?,
                None => vec![],
            };
            allow.push(json!({"cidr": cidr, "ports": ports}));
        }
        body["network"] = json!({"mode": "egress", "allow": allow});
    }
    Ok(body)
}

pub async fn create(c: &Client, a: CreateArgs) -> CliResult {
    let mut body = spec_json(a.image.as_deref(), &a.spec)?;
    if let Some(s) = &a.snapshot {
        body["snapshot"] = s.clone().into();
    }
    if a.userns {
        body["userns"] = true.into();
    }
    match a.count {
        None => {
            let s: Sandbox = c.json(Method::POST, "/v1/sandboxes", Some(&body)).await?;
            println!("{}", s.id);
            Ok(())
        }
        Some(n) => {
            body["count"] = n.into();
            let r: BatchResponse = c.json(Method::POST, "/v1/sandboxes", Some(&body)).await?;
            print_batch(&r)
        }
    }
}

/// Prints the ids made; failures on stderr; an error if any failed.
pub fn print_batch(r: &BatchResponse) -> CliResult {
    let mut failed = 0;
    for item in &r.results {
        match (&item.sandbox, &item.error) {
            (Some(s), _) => println!("{}", s.id),
            (None, Some(e)) => {
                failed += 1;
                eprintln!("grove: {}: {}", e.code, e.message);
            }
            _ => {}
        }
    }
    if failed > 0 {
        return Err(CliError::Other(format!(
            "{failed} of {} failed",
            r.results.len()
        )));
    }
    Ok(())
}

fn exec_body(
    cmd: &[String],
    timeout: Option<f64>,
    env: &[String],
    cwd: Option<&str>,
) -> CliResult<Value> {
    let mut body = json!({ "argv": cmd, "encoding": "base64" });
    if let Some(t) = timeout {
        if !(t > 0.0 && t.is_finite()) {
            return Err(CliError::Usage(format!("--timeout {t}: must be positive")));
        }
        body["timeout_ms"] = ((t * 1000.0).ceil() as u64).into();
    }
    if !env.is_empty() {
        body["env"] = Value::Object(pairs("--env", env)?);
    }
    if let Some(c) = cwd {
        body["cwd"] = c.into();
    }
    Ok(body)
}

/// Streams a command's output to our stdout/stderr; returns its exit code (128+signal when killed).
async fn stream_exec(c: &Client, id: &str, body: &Value) -> CliResult<i32> {
    let resp = c
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{}/exec/stream", enc(id)),
            Some(body),
        )
        .await?;
    let mut b = resp.into_body();
    let mut sse = SseParser::default();
    let b64 = base64::engine::general_purpose::STANDARD;
    while let Some(frame) = b.frame().await {
        let frame = frame.map_err(crate::client::ClientError::from)?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        for (event, data) in sse.push(data) {
            let v: Value = serde_json::from_str(&data)
                .map_err(|e| CliError::Other(format!("bad event: {e}")))?;
            match event.as_str() {
                "stdout" | "stderr" => {
                    let bytes = b64
                        .decode(v["data"].as_str().unwrap_or(""))
                        .unwrap_or_default();
                    if event == "stdout" {
                        std::io::stdout().write_all(&bytes)?;
                        std::io::stdout().flush()?;
                    } else {
                        std::io::stderr().write_all(&bytes)?;
                    }
                }
                "exit" => {
                    let r: ExecResultWire = serde_json::from_value(v)
                        .map_err(|e| CliError::Other(format!("bad exit event: {e}")))?;
                    return Ok(exit_code(r.exit_code, r.signal, r.timed_out));
                }
                "error" => {
                    return Err(CliError::Other(format!(
                        "{}: {}",
                        v["code"].as_str().unwrap_or("error"),
                        v["message"].as_str().unwrap_or("")
                    )))
                }
                _ => {}
            }
        }
    }
    Err(CliError::Other(
        "the output stream ended without an exit status".into(),
    ))
}

pub fn exit_code(code: Option<i32>, signal: Option<i32>, timed_out: bool) -> i32 {
    if timed_out {
        eprintln!("grove: command timed out");
        return 124;
    }
    code.or(signal.map(|s| 128 + s)).unwrap_or(1)
}

pub async fn exec(c: &Client, a: ExecArgs) -> CliResult {
    let body = exec_body(&a.cmd, a.timeout, &a.env, a.cwd.as_deref())?;
    if a.detach {
        let mut body = body;
        if let Some(o) = body.as_object_mut() {
            o.remove("encoding");
        }
        let r: Value = c
            .json(
                Method::POST,
                &format!("/v1/sandboxes/{}/processes", enc(&a.id)),
                Some(&body),
            )
            .await?;
        println!("{}", r["pid"]);
        return Ok(());
    }
    match stream_exec(c, &a.id, &body).await? {
        0 => Ok(()),
        code => Err(CliError::Exit(code)),
    }
}

pub async fn run(c: &Client, a: RunArgs) -> CliResult {
    let body = spec_json(Some(&a.image), &a.spec)?;
    let cmd = if a.cmd.is_empty() {
        super::images::default_command(c, &a.image).await?
    } else {
        a.cmd.clone()
    };
    let s: Sandbox = c.json(Method::POST, "/v1/sandboxes", Some(&body)).await?;
    let exec = exec_body(&cmd, a.timeout, &[], None);
    let code = match exec {
        Ok(b) => stream_exec(c, &s.id, &b).await,
        Err(e) => Err(e),
    };
    let rm = c
        .call(Method::DELETE, &format!("/v1/sandboxes/{}", s.id), None)
        .await;
    let code = code?;
    rm?;
    match code {
        0 => Ok(()),
        n => Err(CliError::Exit(n)),
    }
}

pub async fn ls(c: &Client, a: LsArgs) -> CliResult {
    let mut q = vec!["limit=1000".to_string()];
    for l in &a.label {
        q.push(format!("label={}", enc(l)));
    }
    if let Some(s) = &a.state {
        q.push(format!("state={}", enc(s)));
    }
    let mut items = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let mut qq = q.clone();
        if let Some(t) = &token {
            qq.push(format!("page_token={}", enc(t)));
        }
        let page: SandboxList = c
            .json(
                Method::GET,
                &format!("/v1/sandboxes?{}", qq.join("&")),
                None,
            )
            .await?;
        items.extend(page.items);
        match page.next_page_token {
            Some(t) => token = Some(t),
            None => break,
        }
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&items).unwrap_or_default()
        );
    } else if a.quiet {
        items.iter().for_each(|s| println!("{}", s.id));
    } else {
        println!(
            "{:<16} {:<10} {:<20} {:>8} LABELS",
            "ID", "STATE", "IMAGE", "AGE"
        );
        let now = crate::events::now_ms();
        for s in &items {
            let labels: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let state = serde_json::to_value(s.state)
                .ok()
                .and_then(|v| v.as_str().map(String::from))
                .unwrap_or_default();
            let age = now.saturating_sub(s.created_at_ms) / 1000;
            println!(
                "{:<16} {:<10} {:<20} {:>7}s {}",
                s.id,
                state,
                s.image,
                age,
                labels.join(",")
            );
        }
    }
    Ok(())
}

pub async fn inspect(c: &Client, id: &str) -> CliResult {
    let v: Value = c
        .json(Method::GET, &format!("/v1/sandboxes/{}", enc(id)), None)
        .await?;
    println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    Ok(())
}

pub async fn rm(c: &Client, a: RmArgs) -> CliResult {
    let mut ids = a.ids.clone();
    if a.all {
        let page: SandboxList = c
            .json(Method::GET, "/v1/sandboxes?limit=1000", None)
            .await?;
        ids.extend(page.items.into_iter().map(|s| s.id));
    }
    if ids.is_empty() && a.label.is_empty() {
        return if a.all {
            Ok(())
        } else {
            Err(CliError::Usage("give sandbox ids, --label or --all".into()))
        };
    }
    let body = json!({ "ids": ids, "labels": pairs("--label", &a.label)? });
    let r: BatchDeleteResponse = c
        .json(Method::POST, "/v1/sandboxes/delete", Some(&body))
        .await?;
    let mut failed = 0;
    for d in &r.results {
        match &d.error {
            None => println!("{}", d.id),
            Some(e) => {
                failed += 1;
                eprintln!("grove: {}: {}: {}", d.id, e.code, e.message);
            }
        }
    }
    if failed > 0 {
        return Err(CliError::Exit(1));
    }
    Ok(())
}

pub async fn pause_resume(c: &Client, id: &str, verb: &str) -> CliResult {
    let resp = c
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{}/{verb}", enc(id)),
            None,
        )
        .await;
    let resp = check(resp?).await?;
    let _ = resp.into_body().collect().await;
    println!("{id}");
    Ok(())
}
