//! `grove images` (ls, inspect, pull, rm, import) and an image's default command for `grove run`.

use http_body_util::BodyExt as _;
use hyper::Method;
use serde_json::json;

use super::{CliError, CliResult, ImagesCmd};
use crate::api_shapes::{Image, ImageList};
use crate::client::{check, enc, Client, ClientError};

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
        ImagesCmd::PruneCache {
            all,
            max_entries,
            max_age_secs,
        } => {
            let mut body = json!({ "all": all });
            if let Some(n) = max_entries {
                body["max_entries"] = n.into();
            }
            if let Some(s) = max_age_secs {
                body["max_age_secs"] = s.into();
            }
            let r: serde_json::Value = c
                .json(Method::POST, "/v1/images/build-cache/prune", Some(&body))
                .await?;
            println!(
                "removed {} build cache entries, kept {}",
                r["removed"], r["kept"]
            );
        }
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
