//! envd's HTTP file routes, `GET /files` (one file's bytes) and `POST /files` (one or many files,
//! multipart or raw octet-stream, optionally gzip), onto the runtime's files layer. Also the
//! users and paths both file services share: `root` and `user` (uid 1000, home /home/user) as
//! E2B images have them, read from the sandbox's /etc/passwd when it lists them, and paths
//! relative to the user's home.

use std::collections::HashMap;
use std::io::Read as _;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest as _, Multipart, Request};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use grove_runtime::files::Root;
use grove_runtime::{SandboxId, SandboxInfo};
use serde_json::{json, Value};

use super::error::{E2bError, E2bResult};
use crate::app::{blocking, App};
use crate::pipe::ChanReader;

/// The user an operation runs as when the request names none (E2B's default).
pub const DEFAULT_USER: &str = "user";

/// A user of the sandbox.
#[derive(Debug, Clone)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

/// Users and groups by id, from the sandbox's /etc/passwd and /etc/group.
#[derive(Debug, Default)]
pub struct Names {
    pub users: HashMap<u32, String>,
    pub groups: HashMap<u32, String>,
}

fn colon_file(root: &Root, path: &str) -> Vec<Vec<String>> {
    let Ok((f, size)) = root.open_read(path) else {
        return Vec::new();
    };
    if size > 4 << 20 {
        return Vec::new();
    }
    let mut s = String::new();
    if f.take(4 << 20).read_to_string(&mut s).is_err() {
        return Vec::new();
    }
    s.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split(':').map(str::to_string).collect())
        .collect()
}

impl Names {
    pub fn read(root: &Root) -> Names {
        let mut n = Names::default();
        for f in colon_file(root, "/etc/passwd") {
            if let (Some(name), Some(uid)) = (f.first(), f.get(2).and_then(|u| u.parse().ok())) {
                n.users.entry(uid).or_insert_with(|| name.clone());
            }
        }
        for f in colon_file(root, "/etc/group") {
            if let (Some(name), Some(gid)) = (f.first(), f.get(2).and_then(|u| u.parse().ok())) {
                n.groups.entry(gid).or_insert_with(|| name.clone());
            }
        }
        n
    }
}

/// Resolves a user name inside the sandbox: its /etc/passwd, else E2B's two standard users.
pub fn user(root: &Root, name: Option<&str>) -> E2bResult<User> {
    let name = name.filter(|n| !n.is_empty()).unwrap_or(DEFAULT_USER);
    for f in colon_file(root, "/etc/passwd") {
        if f.first().map(String::as_str) == Some(name) {
            let uid = f.get(2).and_then(|u| u.parse().ok());
            let gid = f.get(3).and_then(|g| g.parse().ok());
            if let (Some(uid), Some(gid)) = (uid, gid) {
                let home = f.get(5).cloned().filter(|h| h.starts_with('/'));
                return Ok(User {
                    name: name.to_string(),
                    uid,
                    gid,
                    home: home.unwrap_or_else(|| "/".into()),
                });
            }
        }
    }
    match name {
        "root" => Ok(User {
            name: "root".into(),
            uid: 0,
            gid: 0,
            home: "/root".into(),
        }),
        "user" => Ok(User {
            name: "user".into(),
            uid: 1000,
            gid: 1000,
            home: "/home/user".into(),
        }),
        other => Err(E2bError::unauthorized(format!(
            "username: user {other:?} does not exist in the sandbox"
        ))),
    }
}

/// The absolute sandbox path of `p` for `u`: relative paths (and `~/...`) are under the home.
/// `..` that would climb above `/` and NUL bytes are refused.
pub fn path_for(u: &User, p: &str) -> E2bResult<String> {
    if p.contains('\0') {
        return Err(E2bError::invalid("path", "contains a NUL byte"));
    }
    let abs = if let Some(rest) = p.strip_prefix("~/") {
        format!("{}/{rest}", u.home)
    } else if p == "~" {
        u.home.clone()
    } else if p.starts_with('/') {
        p.to_string()
    } else {
        format!("{}/{p}", u.home)
    };
    let comps = grove_runtime::files::components(&abs)
        .map_err(|_| E2bError::invalid("path", format!("{p:?} climbs out of the root")))?;
    Ok(format!("/{}", comps.join("/")))
}

fn query(req: &Request) -> E2bResult<Vec<(String, String)>> {
    crate::request_parse::query_pairs(req.uri().query()).map_err(E2bError::from)
}

fn one<'a>(q: &'a [(String, String)], k: &str) -> Option<&'a str> {
    crate::request_parse::query_one(q, k)
}

/// Runtime errors in E2B's terms: a missing file is 404, a full disk 507, bad paths 400.
pub fn from_runtime(e: grove_runtime::Error) -> E2bError {
    E2bError::from(crate::error::ApiError::from(e))
}

async fn root_of(app: &Arc<App>, id: &SandboxId) -> E2bResult<Root> {
    let (rt, id) = (app.runtime.clone(), id.clone());
    blocking(move || Ok(rt.files(&id).map_err(from_runtime))).await?
}

pub async fn handle(app: Arc<App>, info: SandboxInfo, req: Request) -> Response {
    let r = match *req.method() {
        axum::http::Method::GET => read(app, info, req).await,
        axum::http::Method::POST => write(app, info, req).await,
        _ => Err(E2bError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "GET or POST /files",
        )),
    };
    r.unwrap_or_else(IntoResponse::into_response)
}

async fn read(app: Arc<App>, info: SandboxInfo, req: Request) -> E2bResult<Response> {
    let q = query(&req)?;
    let root = root_of(&app, &info.id).await?;
    let username = one(&q, "username").map(str::to_string);
    let path = one(&q, "path")
        .ok_or_else(|| E2bError::invalid("path", "query parameter path is required"))?
        .to_string();
    let (file, size) = blocking(move || {
        Ok(user(&root, username.as_deref()).and_then(|u| {
            let abs = path_for(&u, &path)?;
            root.open_read(&abs).map_err(from_runtime)
        }))
    })
    .await??;
    let shown = info.id.to_string();
    let body = Body::from_stream(crate::api::files::file_chunks(file, shown));
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, size.to_string()),
        ],
        body,
    )
        .into_response())
}

/// Writes one stream into `path` as `u`: parents made, the file owned by the user.
fn write_one(root: &Root, u: &User, path: &str, data: &mut dyn std::io::Read) -> E2bResult<Value> {
    let abs = path_for(u, path)?;
    let comps = grove_runtime::files::components(&abs).map_err(from_runtime)?;
    if let Some((_, parent)) = comps.split_last() {
        let dir = format!("/{}", parent.join("/"));
        root.make_dir(&dir, Some((u.uid, u.gid)))
            .map_err(from_runtime)?;
    }
    root.write_from(&abs, data, None).map_err(from_runtime)?;
    root.chown(&abs, u.uid, u.gid).map_err(from_runtime)?;
    let name = comps.last().cloned().unwrap_or_default();
    Ok(json!({"path": abs, "name": name, "type": "file"}))
}

/// The most of a failed upload's remaining body read (and dropped) before the answer goes out.
const DRAIN_MAX: u64 = 64 << 20;

async fn write(app: Arc<App>, info: SandboxInfo, req: Request) -> E2bResult<Response> {
    let q = query(&req)?;
    let root = Arc::new(root_of(&app, &info.id).await?);
    let username = one(&q, "username").map(str::to_string);
    let path = one(&q, "path").map(str::to_string);
    let u = {
        let root = root.clone();
        blocking(move || Ok(user(&root, username.as_deref()))).await??
    };
    let ctype = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let gzip = match req
        .headers()
        .get(header::CONTENT_ENCODING)
        .map(|v| v.to_str().unwrap_or("?"))
    {
        None | Some("identity") => false,
        Some("gzip") => true,
        Some(other) => {
            return Err(E2bError::invalid(
                "Content-Encoding",
                format!("{other:?} is not supported (identity or gzip)"),
            ))
        }
    };
    let mut written = Vec::new();
    if ctype.starts_with("multipart/form-data") {
        if gzip {
            return Err(E2bError::invalid(
                "Content-Encoding",
                "gzip goes with application/octet-stream uploads",
            ));
        }
        let mut mp = Multipart::from_request(req, &())
            .await
            .map_err(|e| E2bError::invalid("body", e.body_text()))?;
        let mut count = 0usize;
        loop {
            let field = match mp.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return Err(E2bError::invalid("body", e.body_text())),
            };
            count += 1;
            // One file per part: the part's file name is its path, or the query's for one file.
            let target = match (field.file_name().map(str::to_string), &path) {
                (_, Some(p)) if count == 1 => p.clone(),
                (Some(f), _) if !f.is_empty() => f,
                _ => {
                    return Err(E2bError::invalid(
                        "path",
                        "give the path as the part's filename or the path query parameter",
                    ))
                }
            };
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(8);
            let (root, u) = (root.clone(), u.clone());
            let writer = tokio::task::spawn_blocking(move || {
                let mut reader = RxReader {
                    rx,
                    cur: Bytes::new(),
                };
                write_one(&root, &u, &target, &mut reader)
            });
            let mut field = field;
            let mut pump_err = None;
            loop {
                match field.chunk().await {
                    Ok(Some(c)) => {
                        if tx.send(Ok(c)).await.is_err() {
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        pump_err = Some(e.body_text());
                        let _ = tx
                            .send(Err(std::io::Error::other("upload broke off")))
                            .await;
                        break;
                    }
                }
            }
            drop(tx);
            let res = writer
                .await
                .map_err(|e| E2bError::from(crate::error::ApiError::internal(e.to_string())))?;
            if let Some(e) = pump_err {
                return Err(E2bError::invalid("body", e));
            }
            written.push(res?);
        }
        if written.is_empty() {
            return Err(E2bError::invalid("body", "no file in the multipart upload"));
        }
    } else {
        let Some(path) = path else {
            return Err(E2bError::invalid(
                "path",
                "an octet-stream upload needs the path query parameter",
            ));
        };
        let mut reader = ChanReader::spawn(req.into_body());
        let res = blocking(move || {
            let r = if gzip {
                let mut gz = flate2::read::GzDecoder::new(&mut reader);
                write_one(&root, &u, &path, &mut gz)
            } else {
                write_one(&root, &u, &path, &mut reader)
            };
            if r.is_err() {
                // Let the client finish sending so it reads the answer (507 on a full disk).
                let _ = std::io::copy(&mut (&mut reader).take(DRAIN_MAX), &mut std::io::sink());
            }
            Ok(r)
        })
        .await?;
        written.push(res?);
    }
    Ok((StatusCode::OK, Json(written)).into_response())
}

/// A blocking reader over the chunks an async task sends (one multipart part).
struct RxReader {
    rx: tokio::sync::mpsc::Receiver<Result<Bytes, std::io::Error>>,
    cur: Bytes,
}

impl std::io::Read for RxReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(b)) => self.cur = b,
                Some(Err(e)) => return Err(e),
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.cur.len());
        buf[..n].copy_from_slice(&self.cur[..n]);
        self.cur = self.cur.slice(n..);
        Ok(n)
    }
}
