//! The node's commands: `grove events`, store maintenance (`gc`, `fsck`) and `grove residue`.

use http_body_util::BodyExt as _;
use hyper::Method;

use super::{CliError, CliResult};
use crate::api_shapes::{MaintenanceReport, ResidueWire};
use crate::client::{enc, Client, ClientError, SseParser};

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
