//! A small Connect-RPC server (https://connectrpc.com/docs/protocol): unary, server-streaming and
//! client-streaming methods over HTTP/1.1 or HTTP/2, with the protobuf and JSON codecs and
//! Connect's error codes. Services register typed handlers in a [`Services`] table; the E2B
//! endpoint routes `/<package>.<Service>/<Method>` requests of a sandbox to it.
//!
//! Compression is not negotiated: E2B's SDK sends and accepts none, and a compressed request is
//! refused with `unimplemented` rather than misread.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, Method as HttpMethod, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::future::BoxFuture;
use futures::{Stream, StreamExt as _};
use grove_runtime::SandboxId;
use http_body_util::BodyExt as _;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::app::App;

/// Largest message one request may carry (unary body or one streamed envelope).
pub const MAX_MESSAGE: usize = 16 << 20;

/// A boxed stream, the shape every streaming handler works with.
pub type BoxStream<T> = Pin<Box<dyn Stream<Item = T> + Send>>;

/// Connect's error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code (Connect's table).
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::FailedPrecondition => StatusCode::PRECONDITION_FAILED,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// An RPC's failure: a Connect code and a message for the caller.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}: {message}", code.as_str())]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> ConnectError {
        ConnectError {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> ConnectError {
        ConnectError::new(Code::InvalidArgument, message)
    }

    pub fn not_found(message: impl Into<String>) -> ConnectError {
        ConnectError::new(Code::NotFound, message)
    }

    pub fn internal(message: impl Into<String>) -> ConnectError {
        ConnectError::new(Code::Internal, message)
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.as_str(), "message": self.message})
    }

    /// A unary error response.
    fn unary_response(&self) -> Response {
        (
            self.code.http_status(),
            [(header::CONTENT_TYPE, "application/json")],
            self.json().to_string(),
        )
            .into_response()
    }
}

/// Maps groved's API errors (from the runtime and its files layer) onto Connect codes.
impl From<crate::error::ApiError> for ConnectError {
    fn from(e: crate::error::ApiError) -> ConnectError {
        let code = match e.status.as_u16() {
            400 | 422 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::NotFound,
            409 => Code::FailedPrecondition,
            429 | 507 => Code::ResourceExhausted,
            501 => Code::Unimplemented,
            503 => Code::Unavailable,
            504 => Code::DeadlineExceeded,
            _ => Code::Internal,
        };
        ConnectError::new(code, e.message)
    }
}

/// The message codec a request chose by its content type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    Proto,
    Json,
}

/// A message both codecs can carry (prost for protobuf, pbjson's serde for JSON).
pub trait Msg: prost::Message + Default + Serialize + DeserializeOwned + Send + 'static {}
impl<T: prost::Message + Default + Serialize + DeserializeOwned + Send + 'static> Msg for T {}

impl Codec {
    pub fn decode<T: Msg>(self, b: &[u8]) -> Result<T, ConnectError> {
        match self {
            Codec::Proto => T::decode(b)
                .map_err(|e| ConnectError::invalid(format!("undecodable protobuf message: {e}"))),
            Codec::Json => {
                // An empty unary JSON body is the empty message.
                let b = if b.iter().all(u8::is_ascii_whitespace) {
                    &b"{}"[..]
                } else {
                    b
                };
                serde_json::from_slice(b)
                    .map_err(|e| ConnectError::invalid(format!("undecodable JSON message: {e}")))
            }
        }
    }

    pub fn encode<T: Msg>(self, m: &T) -> Bytes {
        match self {
            Codec::Proto => Bytes::from(m.encode_to_vec()),
            // Serializing a generated message cannot fail.
            Codec::Json => Bytes::from(serde_json::to_vec(m).unwrap_or_else(|_| b"{}".to_vec())),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Codec::Proto => "proto",
            Codec::Json => "json",
        }
    }
}

/// What a handler knows of its request besides the message.
#[derive(Clone)]
pub struct Ctx {
    pub app: Arc<App>,
    pub sandbox: SandboxId,
    pub headers: HeaderMap,
    /// The client's `Connect-Timeout-Ms`, when it gave one.
    pub timeout: Option<Duration>,
}

type UnaryFn =
    Arc<dyn Fn(Ctx, Bytes, Codec) -> BoxFuture<'static, Result<Bytes, ConnectError>> + Send + Sync>;
type StreamOut = BoxStream<Result<Bytes, ConnectError>>;
type ServerStreamFn = Arc<
    dyn Fn(Ctx, Bytes, Codec) -> BoxFuture<'static, Result<StreamOut, ConnectError>> + Send + Sync,
>;
type ClientStreamFn = Arc<
    dyn Fn(
            Ctx,
            BoxStream<Result<Bytes, ConnectError>>,
            Codec,
        ) -> BoxFuture<'static, Result<Bytes, ConnectError>>
        + Send
        + Sync,
>;

#[derive(Clone)]
enum Handler {
    Unary(UnaryFn),
    ServerStream(ServerStreamFn),
    ClientStream(ClientStreamFn),
}

/// The methods served, by path (`/filesystem.Filesystem/Stat`).
#[derive(Clone, Default)]
pub struct Services {
    methods: HashMap<String, Handler>,
}

impl Services {
    /// Registers a unary method.
    pub fn unary<Req, Resp, F, Fut>(&mut self, path: &str, f: F)
    where
        Req: Msg,
        Resp: Msg,
        F: Fn(Ctx, Req) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<Resp, ConnectError>> + Send + 'static,
    {
        let f = Arc::new(f);
        let h: UnaryFn = Arc::new(move |ctx, body, codec| {
            let f = f.clone();
            Box::pin(async move {
                let req: Req = codec.decode(&body)?;
                let resp = f(ctx, req).await?;
                Ok(codec.encode(&resp))
            })
        });
        self.methods.insert(path.to_string(), Handler::Unary(h));
    }

    /// Registers a server-streaming method: one request, a stream of responses. The stream is
    /// dropped when the client goes away; handlers tie cleanup to that drop.
    pub fn server_stream<Req, Resp, F, Fut, S>(&mut self, path: &str, f: F)
    where
        Req: Msg,
        Resp: Msg,
        F: Fn(Ctx, Req) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<S, ConnectError>> + Send + 'static,
        S: Stream<Item = Result<Resp, ConnectError>> + Send + 'static,
    {
        let f = Arc::new(f);
        let h: ServerStreamFn = Arc::new(move |ctx, body, codec| {
            let f = f.clone();
            Box::pin(async move {
                let req: Req = codec.decode(&body)?;
                let s = f(ctx, req).await?;
                let out: StreamOut = Box::pin(s.map(move |r| r.map(|m| codec.encode(&m))));
                Ok(out)
            })
        });
        self.methods
            .insert(path.to_string(), Handler::ServerStream(h));
    }

    /// Registers a client-streaming method: a stream of requests, one response.
    pub fn client_stream<Req, Resp, F, Fut>(&mut self, path: &str, f: F)
    where
        Req: Msg,
        Resp: Msg,
        F: Fn(Ctx, BoxStream<Result<Req, ConnectError>>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<Resp, ConnectError>> + Send + 'static,
    {
        let f = Arc::new(f);
        let h: ClientStreamFn = Arc::new(move |ctx, input, codec| {
            let f = f.clone();
            Box::pin(async move {
                let reqs: BoxStream<Result<Req, ConnectError>> =
                    Box::pin(input.map(move |r| r.and_then(|b| codec.decode::<Req>(&b))));
                let resp = f(ctx, reqs).await?;
                Ok(codec.encode(&resp))
            })
        });
        self.methods
            .insert(path.to_string(), Handler::ClientStream(h));
    }

    pub fn has(&self, path: &str) -> bool {
        self.methods.contains_key(path)
    }

    /// Serves one RPC.
    pub async fn handle(&self, ctx: Ctx, req: Request) -> Response {
        let path = req.uri().path().to_string();
        let Some(handler) = self.methods.get(&path).cloned() else {
            return ConnectError::new(Code::Unimplemented, format!("no method {path}"))
                .unary_response();
        };
        if req.method() != HttpMethod::POST {
            let mut r =
                ConnectError::new(Code::Unimplemented, "RPCs are POST requests").unary_response();
            *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
            r.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("POST"));
            return r;
        }
        let ctype = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        let streaming = !matches!(handler, Handler::Unary(_));
        let codec = match (streaming, ctype.as_str()) {
            (false, "application/proto") | (true, "application/connect+proto") => Codec::Proto,
            (false, "application/json") | (true, "application/connect+json") => Codec::Json,
            _ => {
                let want = if streaming {
                    "application/connect+proto or application/connect+json"
                } else {
                    "application/proto or application/json"
                };
                return (
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    [(header::HeaderName::from_static("accept-post"), want)],
                    format!("content type {ctype:?} is not {want}"),
                )
                    .into_response();
            }
        };
        let enc_header = if streaming {
            "connect-content-encoding"
        } else {
            "content-encoding"
        };
        if let Some(enc) = req.headers().get(enc_header) {
            if enc.as_bytes() != b"identity" {
                let e = ConnectError::new(
                    Code::Unimplemented,
                    format!("compression {enc:?} is not supported; send identity"),
                );
                return if streaming {
                    stream_response(codec, Box::pin(futures::stream::iter([Err(e)])))
                } else {
                    e.unary_response()
                };
            }
        }
        let body = req.into_body();
        match handler {
            Handler::Unary(h) => {
                let bytes = match read_limited(body).await {
                    Ok(b) => b,
                    Err(e) => return e.unary_response(),
                };
                match run_with_deadline(ctx.timeout, h(ctx, bytes, codec)).await {
                    Ok(out) => (
                        StatusCode::OK,
                        [(
                            header::CONTENT_TYPE,
                            format!("application/{}", codec.name()),
                        )],
                        out,
                    )
                        .into_response(),
                    Err(e) => e.unary_response(),
                }
            }
            Handler::ServerStream(h) => {
                let mut frames = Box::pin(envelopes(body));
                let first = match frames.next().await {
                    Some(Ok(b)) => b,
                    Some(Err(e)) => return stream_error(codec, e),
                    None => {
                        return stream_error(codec, ConnectError::invalid("no request message"))
                    }
                };
                let timeout = ctx.timeout;
                let started = match run_with_deadline(timeout, h(ctx, first, codec)).await {
                    Ok(s) => s,
                    Err(e) => return stream_error(codec, e),
                };
                let s: StreamOut = match timeout {
                    Some(t) => Box::pin(with_deadline(started, t)),
                    None => started,
                };
                stream_response(codec, s)
            }
            Handler::ClientStream(h) => {
                let timeout = ctx.timeout;
                let frames: BoxStream<Result<Bytes, ConnectError>> = Box::pin(envelopes(body));
                let r = run_with_deadline(timeout, h(ctx, frames, codec)).await;
                let s: StreamOut = Box::pin(futures::stream::iter([r]));
                stream_response(codec, s)
            }
        }
    }
}

/// The client's deadline from `Connect-Timeout-Ms` (at most 10 digits, per the protocol).
pub fn timeout_of(headers: &HeaderMap) -> Result<Option<Duration>, ConnectError> {
    let Some(v) = headers.get("connect-timeout-ms") else {
        return Ok(None);
    };
    let s = v.to_str().unwrap_or("");
    match s.parse::<u64>() {
        Ok(ms) if !s.is_empty() && s.len() <= 10 => Ok(Some(Duration::from_millis(ms))),
        _ => Err(ConnectError::invalid(format!(
            "connect-timeout-ms {s:?} is not 1-10 digits"
        ))),
    }
}

async fn run_with_deadline<T>(
    timeout: Option<Duration>,
    f: impl std::future::Future<Output = Result<T, ConnectError>>,
) -> Result<T, ConnectError> {
    match timeout {
        None => f.await,
        Some(t) => tokio::time::timeout(t, f).await.unwrap_or_else(|_| {
            Err(ConnectError::new(
                Code::DeadlineExceeded,
                "the RPC ran past its deadline",
            ))
        }),
    }
}

/// Ends the stream with `deadline_exceeded` once `t` has passed (dropping the handler's stream,
/// which stops what it was doing).
fn with_deadline(s: StreamOut, t: Duration) -> impl Stream<Item = Result<Bytes, ConnectError>> {
    let deadline = tokio::time::Instant::now() + t;
    futures::stream::unfold(Some(s), move |s| async move {
        let mut s = s?;
        match tokio::time::timeout_at(deadline, s.next()).await {
            Ok(Some(item)) => Some((item, Some(s))),
            Ok(None) => None,
            Err(_) => Some((
                Err(ConnectError::new(
                    Code::DeadlineExceeded,
                    "the RPC ran past its deadline",
                )),
                None,
            )),
        }
    })
}

async fn read_limited(body: Body) -> Result<Bytes, ConnectError> {
    let limited = http_body_util::Limited::new(body, MAX_MESSAGE);
    match limited.collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) => {
            if e.is::<http_body_util::LengthLimitError>() {
                Err(ConnectError::new(
                    Code::ResourceExhausted,
                    format!("message larger than {MAX_MESSAGE} bytes"),
                ))
            } else {
                Err(ConnectError::new(
                    Code::Canceled,
                    format!("reading the request: {e}"),
                ))
            }
        }
    }
}

const FLAG_COMPRESSED: u8 = 0x01;
const FLAG_END: u8 = 0x02;

/// The request body as a stream of enveloped messages (5-byte prefix: flags, big-endian length).
fn envelopes(body: Body) -> impl Stream<Item = Result<Bytes, ConnectError>> + Send {
    let frames = body.into_data_stream();
    futures::stream::unfold(
        (frames, bytes::BytesMut::new(), false),
        |(mut frames, mut buf, done)| async move {
            if done {
                return None;
            }
            loop {
                if buf.len() >= 5 {
                    let flags = buf[0];
                    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
                    if len > MAX_MESSAGE {
                        let e = ConnectError::new(
                            Code::ResourceExhausted,
                            format!("message larger than {MAX_MESSAGE} bytes"),
                        );
                        return Some((Err(e), (frames, buf, true)));
                    }
                    if buf.len() >= 5 + len {
                        let _ = buf.split_to(5);
                        let msg = buf.split_to(len).freeze();
                        if flags & FLAG_COMPRESSED != 0 {
                            let e = ConnectError::new(
                                Code::Unimplemented,
                                "compressed messages are not supported",
                            );
                            return Some((Err(e), (frames, buf, true)));
                        }
                        if flags & FLAG_END != 0 {
                            // The client's end-of-stream message: nothing more comes.
                            return None;
                        }
                        return Some((Ok(msg), (frames, buf, false)));
                    }
                }
                match frames.next().await {
                    Some(Ok(chunk)) => buf.extend_from_slice(&chunk),
                    Some(Err(e)) => {
                        let e =
                            ConnectError::new(Code::Canceled, format!("reading the request: {e}"));
                        return Some((Err(e), (frames, buf, true)));
                    }
                    None if buf.is_empty() => return None,
                    None => {
                        let e = ConnectError::invalid("the request ended inside a message");
                        return Some((Err(e), (frames, buf, true)));
                    }
                }
            }
        },
    )
}

fn envelope(flags: u8, msg: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + msg.len());
    out.push(flags);
    out.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    out.extend_from_slice(msg);
    Bytes::from(out)
}

fn stream_error(codec: Codec, e: ConnectError) -> Response {
    stream_response(codec, Box::pin(futures::stream::iter([Err(e)])))
}

/// A streaming response: each message enveloped, then the end-of-stream message carrying the
/// error, if the stream ended with one (no message follows an error).
fn stream_response(codec: Codec, s: StreamOut) -> Response {
    let body = futures::stream::unfold(Some(s), |s| async move {
        let mut s = s?;
        match s.next().await {
            Some(Ok(m)) => Some((Ok::<_, std::convert::Infallible>(envelope(0, &m)), Some(s))),
            Some(Err(e)) => {
                let end = serde_json::json!({"error": e.json()});
                Some((Ok(envelope(FLAG_END, end.to_string().as_bytes())), None))
            }
            None => Some((Ok(envelope(FLAG_END, b"{}")), None)),
        }
    });
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            format!("application/connect+{}", codec.name()),
        )],
        Body::from_stream(body),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn envelopes_split_across_chunks_and_stop_at_end_of_stream() {
        let mut raw = envelope(0, b"hello").to_vec();
        raw.extend_from_slice(&envelope(0, b""));
        raw.extend_from_slice(&envelope(FLAG_END, b"{}"));
        raw.extend_from_slice(&envelope(0, b"after"));
        let chunks: Vec<Result<Bytes, std::io::Error>> = raw
            .chunks(3)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let body = Body::from_stream(futures::stream::iter(chunks));
        let got: Vec<_> = envelopes(body).collect().await;
        let got: Vec<Bytes> = got.into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(got, vec![Bytes::from_static(b"hello"), Bytes::new()]);
    }

    #[tokio::test]
    async fn a_truncated_or_oversized_envelope_is_an_error() {
        let body = Body::from(vec![0u8, 0, 0, 0, 9, 1, 2]);
        let got: Vec<_> = envelopes(body).collect().await;
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].as_ref().unwrap_err().code, Code::InvalidArgument);
        let body = Body::from(vec![0u8, 0xff, 0xff, 0xff, 0xff]);
        let got: Vec<_> = envelopes(body).collect().await;
        assert_eq!(got[0].as_ref().unwrap_err().code, Code::ResourceExhausted);
    }

    #[test]
    fn json_codec_speaks_proto3_json() {
        use crate::e2b::proto::filesystem::{EntryInfo, FileType, StatResponse};
        let m = StatResponse {
            entry: Some(EntryInfo {
                name: "a".into(),
                r#type: FileType::Directory as i32,
                size: 5,
                ..Default::default()
            }),
        };
        let j: serde_json::Value = serde_json::from_slice(&Codec::Json.encode(&m)).unwrap();
        assert_eq!(j["entry"]["type"], "FILE_TYPE_DIRECTORY");
        assert_eq!(j["entry"]["size"], "5");
        let back: StatResponse = Codec::Json.decode(j.to_string().as_bytes()).unwrap();
        assert_eq!(back, m);
        let back: StatResponse = Codec::Proto.decode(&Codec::Proto.encode(&m)).unwrap();
        assert_eq!(back, m);
    }
}
