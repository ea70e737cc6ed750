//! `grove snapshot` and `grove fork`.

use hyper::Method;
use serde_json::json;

use super::sandbox::print_batch;
use super::{pairs, CliResult, ForkArgs, SnapshotArgs};
use crate::api_shapes::{BatchResponse, Snapshot};
use crate::client::{enc, Client};

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
