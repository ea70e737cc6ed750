//! `grove images pull REF`: follows the pull's event stream, one line per layer.

use http_body_util::BodyExt as _;
use hyper::Method;
use serde_json::{json, Value};

use super::{CliError, CliResult, PullArgs};
use crate::client::{check, Client, ClientError, SseParser};

pub async fn pull(c: &Client, a: PullArgs) -> CliResult {
    let mut body = json!({ "reference": a.reference });
    if let Some(n) = &a.name {
        body["name"] = n.clone().into();
    }
    if let Some(p) = &a.platform {
        body["platform"] = p.clone().into();
    }
    let resp = check(
        c.call(Method::POST, "/v1/images/pull?stream=true", Some(&body))
            .await?,
    )
    .await?;
    let mut stream = resp.into_body();
    let mut sse = SseParser::default();
    while let Some(frame) = stream.frame().await {
        let frame = frame.map_err(ClientError::from)?;
        let Some(d) = frame.data_ref() else { continue };
        for (kind, data) in sse.push(d) {
            if a.json {
                println!("{data}");
            }
            let v: Value = serde_json::from_str(&data).unwrap_or_default();
            match kind.as_str() {
                "error" => {
                    return Err(CliError::Other(format!(
                        "{}: {}",
                        v["code"].as_str().unwrap_or("error"),
                        v["message"].as_str().unwrap_or(&data)
                    )))
                }
                "done" => {
                    if !a.json {
                        println!("{}", v["image"]["name"].as_str().unwrap_or_default());
                    }
                    return Ok(());
                }
                _ if a.json => {}
                _ => match v["status"].as_str() {
                    Some("resolved") => eprintln!(
                        "{} {} ({} layers)",
                        v["reference"].as_str().unwrap_or_default(),
                        v["digest"].as_str().unwrap_or_default(),
                        v["layers"]
                    ),
                    Some("layer") => eprintln!(
                        "  {} {}",
                        v["digest"].as_str().unwrap_or_default(),
                        if v["cached"] == true {
                            "exists"
                        } else {
                            "fetching"
                        }
                    ),
                    _ => {}
                },
            }
        }
    }
    Err(CliError::Other(
        "the pull's stream ended without a result".into(),
    ))
}
