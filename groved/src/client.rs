//! A small HTTP/1.1 client for the API over the unix socket (one connection per request), used by `grove`.

use std::path::{Path, PathBuf};

use axum::body::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;

use crate::error::ErrorBody;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach groved at {path} (is it running?)")]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {}{}", .body.code, .body.message, .body.field.as_ref().map(|f| format!(" (field {f})")).unwrap_or_default())]
    Api { status: StatusCode, body: ErrorBody },
    #[error("HTTP")]
    Http(#[from] hyper::Error),
    #[error("building the request")]
    Request(#[from] hyper::http::Error),
    #[error("unexpected response ({status}): {text}")]
    Decode { status: StatusCode, text: String },
}

#[derive(Debug, Clone)]
pub struct Client {
    socket: PathBuf,
}

pub type Body = Full<Bytes>;

impl Client {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Client {
            socket: socket.into(),
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Whether a daemon answers on the socket.
    pub fn reachable(&self) -> bool {
        std::os::unix::net::UnixStream::connect(&self.socket).is_ok()
    }

    /// Sends a request; the response is returned whatever its status.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        content_type: Option<&str>,
        body: Bytes,
    ) -> Result<Response<Incoming>, ClientError> {
        let stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .map_err(|source| ClientError::Connect {
                path: self.socket.clone(),
                source,
            })?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "groved");
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        Ok(sender.send_request(req.body(Full::new(body))?).await?)
    }

    /// Sends a request and fails on a non-2xx status with the API's error body.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        json: Option<&serde_json::Value>,
    ) -> Result<Response<Incoming>, ClientError> {
        let (ct, body) = match json {
            Some(v) => (
                Some("application/json"),
                Bytes::from(serde_json::to_vec(v).unwrap_or_default()),
            ),
            None => (None, Bytes::new()),
        };
        check(self.send(method, path, ct, body).await?).await
    }

    /// A JSON call with a JSON answer.
    pub async fn json<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        json: Option<&serde_json::Value>,
    ) -> Result<T, ClientError> {
        let resp = self.call(method, path, json).await?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        serde_json::from_slice(&bytes).map_err(|_| ClientError::Decode {
            status,
            text: String::from_utf8_lossy(&bytes).into_owned(),
        })
    }
}

/// Passes 2xx responses through; turns others into `ClientError::Api`.
pub async fn check(resp: Response<Incoming>) -> Result<Response<Incoming>, ClientError> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let bytes = resp.into_body().collect().await?.to_bytes();
    match serde_json::from_slice::<ErrorBody>(&bytes) {
        Ok(body) => Err(ClientError::Api { status, body }),
        Err(_) => Err(ClientError::Decode {
            status,
            text: String::from_utf8_lossy(&bytes).into_owned(),
        }),
    }
}

/// Percent-encodes a query value.
pub fn enc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Incremental parser of a Server-Sent Events stream into (event, data) pairs.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: String,
}

impl SseParser {
    pub fn push(&mut self, chunk: &[u8]) -> Vec<(String, String)> {
        self.buf.push_str(&String::from_utf8_lossy(chunk));
        let mut out = Vec::new();
        while let Some(end) = self.buf.find("\n\n") {
            let block: String = self.buf.drain(..end + 2).collect();
            let (mut event, mut data) = ("message".to_string(), Vec::new());
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    event = v.trim_start().to_string();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push(v.strip_prefix(' ').unwrap_or(v).to_string());
                }
            }
            if !data.is_empty() {
                out.push((event, data.join("\n")));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sse_across_chunks() {
        let mut p = SseParser::default();
        assert!(p.push(b"event: stdout\ndata: {\"a\"").is_empty());
        let got = p.push(b":1}\n\n:keepalive\n\nevent: exit\ndata: {}\n\n");
        assert_eq!(
            got,
            vec![
                ("stdout".into(), "{\"a\":1}".into()),
                ("exit".into(), "{}".into())
            ]
        );
        assert_eq!(enc("/a b=c"), "/a%20b%3Dc");
    }
}
