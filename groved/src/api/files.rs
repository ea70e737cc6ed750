//! Files in a sandbox: raw read/write by path, directory listings, tar upload/download.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::io::Read as _;

use super::pause::awake;
use super::{sandbox_id, sandbox_path};
use crate::api_shapes::{FileEntry, FileList};
use crate::app::{blocking, App};
use crate::error::{ApiError, ApiResult};
use crate::pipe::{ChanReader, ChanWriter};
use crate::request_parse::{query_one, query_pairs};

fn path_of(q: &Option<String>) -> ApiResult<(String, Vec<(String, String)>)> {
    let pairs = query_pairs(q.as_deref())?;
    Ok((sandbox_path(query_one(&pairs, "path"))?, pairs))
}

/// GET ?path=/x: the file streamed (chunked) a bounded buffer at a time, whatever its size. Only a regular
/// file is read: a FIFO, socket or device is refused before anything could block on it.
pub async fn read(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let id = sandbox_id(&id)?;
    let (path, _) = path_of(&q)?;
    let rt = awake(&app, &id).await?;
    let shown = path.clone();
    let (file, _size) = blocking(move || rt.open_file(&id, &path).map_err(ApiError::from)).await?;
    let body = Body::from_stream(file_chunks(file, shown));
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response())
}

/// Bytes read per step of a streamed file: what one file read may hold in memory.
const READ_CHUNK: usize = 256 << 10;

/// The file as a stream of chunks, each read on the blocking pool only when the client has taken the
/// one before (so a slow client holds one chunk and no worker thread).
pub(crate) fn file_chunks(
    file: std::fs::File,
    shown: String,
) -> impl futures::Stream<Item = std::io::Result<Bytes>> + Send {
    futures::stream::try_unfold(Some(file), move |file| {
        let shown = shown.clone();
        async move {
            let Some(mut file) = file else {
                return Ok(None);
            };
            let (file, chunk) = tokio::task::spawn_blocking(move || {
                let mut buf = vec![0u8; READ_CHUNK];
                let n = loop {
                    match file.read(&mut buf) {
                        Ok(n) => break n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                };
                buf.truncate(n);
                Ok((file, buf))
            })
            .await
            .map_err(std::io::Error::other)?
            .inspect_err(|e| tracing::warn!(path = %shown, "file read failed mid-stream: {e}"))?;
            if chunk.is_empty() {
                return Ok(None);
            }
            Ok(Some((Bytes::from(chunk), Some(file))))
        }
    })
}

/// The most of a failed upload's remaining body read (and dropped) before the answer goes out.
const DRAIN_MAX: u64 = 64 << 20;

/// PUT ?path=/x[&mode=644] with the raw bytes as body, streamed into the file (bounded memory; the
/// sandbox's disk quota ends it with 507). A file the upload created is gone again if it fails.
pub async fn write(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
    body: Body,
) -> ApiResult<StatusCode> {
    let id = sandbox_id(&id)?;
    let (path, pairs) = path_of(&q)?;
    let mode = match query_one(&pairs, "mode") {
        None => None,
        Some(m) => match u32::from_str_radix(m, 8) {
            Ok(v) if v <= 0o7777 => Some(v),
            _ => {
                return Err(ApiError::bad_request(
                    "invalid_query",
                    "mode",
                    format!("{m:?} is not an octal mode"),
                ))
            }
        },
    };
    let rt = awake(&app, &id).await?;
    let mut reader = ChanReader::spawn(body);
    blocking(move || {
        let written = rt.write_file_from(&id, &path, &mut reader, mode);
        if written.is_err() {
            // The client is still sending: take (and drop) what is left, up to a bound, so that
            // it reads the answer (a 507 on a full quota) rather than a broken pipe.
            let _ = std::io::copy(&mut (&mut reader).take(DRAIN_MAX), &mut std::io::sink());
        }
        written.map_err(ApiError::from)
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn list(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Json<FileList>> {
    let id = sandbox_id(&id)?;
    let (path, _) = path_of(&q)?;
    let rt = awake(&app, &id).await?;
    let p = path.clone();
    let entries = blocking(move || rt.list_dir(&id, &p).map_err(ApiError::from)).await?;
    let entries = entries
        .into_iter()
        .map(|e| FileEntry {
            name: e.name,
            kind: e.kind,
            size: e.size,
            mode: e.mode,
        })
        .collect();
    Ok(Json(FileList { path, entries }))
}

/// GET ?path=/dir: the directory as a tar stream.
pub async fn download(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let id = sandbox_id(&id)?;
    let (path, _) = path_of(&q)?;
    let rt = awake(&app, &id).await?;
    {
        // Fail with a proper status before the body starts.
        let (rt, id, path) = (rt.clone(), id.clone(), path.clone());
        blocking(move || rt.list_dir(&id, &path).map_err(ApiError::from)).await?;
    }
    let (mut w, body) = ChanWriter::new();
    tokio::task::spawn_blocking(move || {
        let r = rt.download_tar(&id, &path, &mut w);
        match r
            .map_err(|e| crate::error::chain(&e))
            .and_then(|()| std::io::Write::flush(&mut w).map_err(|e| e.to_string()))
        {
            Ok(()) => {}
            Err(e) => {
                tracing::warn!(sandbox = %id, path = %path, "tar download failed mid-stream: {e}");
                w.fail(e)
            }
        }
    });
    Ok(([(header::CONTENT_TYPE, "application/x-tar")], body).into_response())
}

/// PUT ?path=/dir with a tar body: unpacked under the directory.
pub async fn upload(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
    body: Body,
) -> ApiResult<StatusCode> {
    let id = sandbox_id(&id)?;
    let (path, _) = path_of(&q)?;
    let rt = awake(&app, &id).await?;
    let mut reader = ChanReader::spawn(body);
    blocking(move || {
        rt.upload_tar(&id, &path, &mut reader)
            .map_err(ApiError::from)
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}
