//! `grove cp`: host ↔ sandbox, raw for files, tar for directories.

use std::path::{Path, PathBuf};

use axum::body::Bytes;
use http_body_util::BodyExt as _;
use hyper::Method;

use super::{CliError, CliResult};
use crate::client::{check, enc, Client};

/// `sb-<12 hex>:/path` → (id, path).
fn remote(s: &str) -> Option<(&str, &str)> {
    let (id, path) = s.split_once(':')?;
    (id.len() == 15 && id.starts_with("sb-")).then_some((id, path))
}

fn base_name(p: &str) -> CliResult<String> {
    Path::new(p.trim_end_matches('/'))
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| CliError::Usage(format!("{p:?} has no file name")))
}

pub async fn cp(c: &Client, src: &str, dst: &str) -> CliResult {
    match (remote(src), remote(dst)) {
        (None, Some((id, path))) => upload(c, Path::new(src), id, path).await,
        (Some((id, path)), None) => download(c, id, path, Path::new(dst)).await,
        _ => Err(CliError::Usage(
            "exactly one of SRC and DST must be SANDBOX:PATH".into(),
        )),
    }
}

async fn upload(c: &Client, src: &Path, id: &str, dst: &str) -> CliResult {
    let meta =
        std::fs::metadata(src).map_err(|e| CliError::Other(format!("{}: {e}", src.display())))?;
    if meta.is_dir() {
        let name = base_name(&src.to_string_lossy())?;
        let mut b = tar::Builder::new(Vec::new());
        b.follow_symlinks(false);
        b.append_dir_all(&name, src)?;
        let data = b.into_inner()?;
        let url = format!("/v1/sandboxes/{}/archive?path={}", enc(id), enc(dst));
        check(
            c.send(
                Method::PUT,
                &url,
                Some("application/x-tar"),
                Bytes::from(data),
            )
            .await?,
        )
        .await?;
    } else {
        let target = if dst.ends_with('/') {
            format!("{dst}{}", base_name(&src.to_string_lossy())?)
        } else {
            dst.to_string()
        };
        let data = std::fs::read(src)?;
        use std::os::unix::fs::PermissionsExt as _;
        let mode = meta.permissions().mode() & 0o7777;
        let url = format!(
            "/v1/sandboxes/{}/files?path={}&mode={mode:o}",
            enc(id),
            enc(&target)
        );
        check(
            c.send(
                Method::PUT,
                &url,
                Some("application/octet-stream"),
                Bytes::from(data),
            )
            .await?,
        )
        .await?;
    }
    Ok(())
}

async fn download(c: &Client, id: &str, src: &str, dst: &Path) -> CliResult {
    let read = c
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{}/files?path={}", enc(id), enc(src)),
            None,
        )
        .await;
    match read {
        Ok(resp) => {
            let data = resp
                .into_body()
                .collect()
                .await
                .map_err(crate::client::ClientError::from)?
                .to_bytes();
            let target: PathBuf = if dst.is_dir() {
                dst.join(base_name(src)?)
            } else {
                dst.to_path_buf()
            };
            std::fs::write(&target, &data)
                .map_err(|e| CliError::Other(format!("{}: {e}", target.display())))?;
            Ok(())
        }
        Err(read_err) => {
            let list = c
                .call(
                    Method::GET,
                    &format!("/v1/sandboxes/{}/files/list?path={}", enc(id), enc(src)),
                    None,
                )
                .await;
            if list.is_err() {
                return Err(read_err.into());
            }
            let resp = c
                .call(
                    Method::GET,
                    &format!("/v1/sandboxes/{}/archive?path={}", enc(id), enc(src)),
                    None,
                )
                .await?;
            let data = resp
                .into_body()
                .collect()
                .await
                .map_err(crate::client::ClientError::from)?
                .to_bytes();
            let target = if dst.is_dir() {
                dst.join(base_name(src)?)
            } else {
                dst.to_path_buf()
            };
            std::fs::create_dir_all(&target)?;
            tar::Archive::new(&data[..]).unpack(&target)?;
            Ok(())
        }
    }
}
