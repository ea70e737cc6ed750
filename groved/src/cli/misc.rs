//! Snapshots, forks, events, images, store maintenance, residue.

use http_body_util::BodyExt as _;
use hyper::Method;
use serde_json::json;

use super::sandbox::print_batch;
use super::{pairs, CliError, CliResult, ForkArgs, ImagesCmd, SnapshotArgs};
use crate::client::{check, enc, Client, ClientError, SseParser};
use crate::wire::{BatchResponse, Image, ImageList, MaintenanceReport, ResidueWire, Snapshot};

pub async fn snapshot(c: &Client, a: SnapshotArgs) -> CliResult {
    let mut body = json!({ "stop": a.stop });
    if let Some(n) = &a.name {
        body["name"] = n.clone().into();
    }
    let s: Snapshot = c
        .json(
            Method::POST,
            &format!("/v1/sandboxes/{}/snapshot", enc(&a.id)),
            Some(&body),
        )
        .await?;
    println!("{}", s.name);
    Ok(())
}

pub async fn fork(c: &Client, a: ForkArgs) -> CliResult {
    let mut body = json!({ "count": a.count, "labels": pairs("--label", &a.label)? });
    if let Some(t) = a.ttl {
        body["ttl_secs"] = t.into();
    }
    let r: BatchResponse = c
        .json(
            Method::POST,
            &format!("/v1/snapshots/{}/fork", enc(&a.snapshot)),
            Some(&body),
        )
        .await?;
    print_batch(&r)
}

pub async fn events(c: &Client, sandbox: Option<String>) -> CliResult {
    let path = match &sandbox {
        Some(s) => format!("/v1/events?sandbox={}", enc(s)),
        None => "/v1/events".into(),
    };
    let resp = c.call(Method::GET, &path, None).await?;
    let mut body = resp.into_body();
    let mut sse = SseParser::default();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(ClientError::from)?;
        if let Some(d) = frame.data_ref() {
            for (_, data) in sse.push(d) {
                println!("{data}");
            }
        }
    }
    Ok(())
}

pub async fn images(c: &Client, cmd: ImagesCmd) -> CliResult {
    match cmd {
        ImagesCmd::Ls => {
            let l: ImageList = c.json(Method::GET, "/v1/images", None).await?;
            println!("{:<32} ROOT", "NAME");
            for i in l.items {
                println!("{:<32} {}", i.name, i.root.unwrap_or_default());
            }
        }
        ImagesCmd::Inspect { name } => {
            let img: Image = c
                .json(Method::GET, &format!("/v1/images/{}", enc(&name)), None)
                .await?;
            println!("{}", serde_json::to_string_pretty(&img).unwrap_or_default());
        }
        ImagesCmd::Pull(a) => super::pull::pull(c, a).await?,
        ImagesCmd::Rm { name } => {
            check(
                c.send(
                    Method::DELETE,
                    &format!("/v1/images/{}", enc(&name)),
                    None,
                    Default::default(),
                )
                .await?,
            )
            .await?;
            println!("{name}");
        }
        ImagesCmd::Import {
            name,
            path,
            oci,
            tar,
            reference,
        } => {
            let img: Image = if tar {
                let data = if path.as_os_str() == "-" {
                    let mut v = Vec::new();
                    std::io::Read::read_to_end(&mut std::io::stdin(), &mut v)?;
                    v
                } else {
                    std::fs::read(&path)
                        .map_err(|e| CliError::Other(format!("{}: {e}", path.display())))?
                };
                let resp = c
                    .send(
                        Method::PUT,
                        &format!("/v1/images/{}/tar", enc(&name)),
                        Some("application/x-tar"),
                        data.into(),
                    )
                    .await?;
                let b = check(resp)
                    .await?
                    .into_body()
                    .collect()
                    .await
                    .map_err(ClientError::from)?
                    .to_bytes();
                serde_json::from_slice(&b).map_err(|e| CliError::Other(e.to_string()))?
            } else {
                let abs = std::path::absolute(&path)?;
                let mut body =
                    json!({ "name": name, "source": if oci { "oci" } else { "dir" }, "path": abs });
                if let Some(r) = reference {
                    body["reference"] = r.into();
                }
                c.json(Method::POST, "/v1/images", Some(&body)).await?
            };
            println!("{}", img.name);
        }
    }
    Ok(())
}

/// The image's Entrypoint + Cmd, for `grove run IMAGE` without a command.
pub async fn default_command(c: &Client, image: &str) -> CliResult<Vec<String>> {
    let img: Image = c
        .json(Method::GET, &format!("/v1/images/{}", enc(image)), None)
        .await?;
    let cmd = img
        .config
        .map(|cfg| cfg.default_command())
        .unwrap_or_default();
    if cmd.is_empty() {
        return Err(CliError::Usage(format!(
            "image {image:?} has no default command (Entrypoint/Cmd): give one after --"
        )));
    }
    Ok(cmd)
}

pub async fn maintenance(c: &Client, what: &str) -> CliResult {
    let r: MaintenanceReport = c
        .json(Method::POST, &format!("/v1/node/{what}"), None)
        .await?;
    println!(
        "{}",
        serde_json::to_string_pretty(&r.report).unwrap_or_default()
    );
    if r.ok {
        Ok(())
    } else {
        Err(CliError::Exit(1))
    }
}

pub async fn residue(c: &Client) -> CliResult {
    let r: ResidueWire = c.json(Method::GET, "/v1/node/residue", None).await?;
    print_residue(&r.items)
}

pub fn print_residue(items: &[grove_runtime::ResidueItem]) -> CliResult {
    for i in items {
        println!("{:<8} {}", i.kind, i.what);
    }
    if items.is_empty() {
        Ok(())
    } else {
        eprintln!("grove: {} residue item(s)", items.len());
        Err(CliError::Exit(1))
    }
}
