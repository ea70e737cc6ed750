//! The API's error type: every failure leaves groved as JSON `{code, message, field}` with an honest status.
//! The HTTP status of each domain error (runtime, image store, snapshotter) is decided here.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

/// The JSON body of every error response.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ErrorBody {
    pub code: String,
    pub message: String,
    pub field: Option<String>,
}

/// An error on its way to becoming an HTTP response.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub code: String,
    pub message: String,
    pub field: Option<String>,
    /// Seconds, sent as `Retry-After` (429 and 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code: code.into(),
            message: message.into(),
            field: None,
            retry_after: None,
        }
    }
    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }
    pub fn bad_request(code: &str, field: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message).with_field(field)
    }
    pub fn invalid(field: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_spec", message).with_field(field)
    }
    pub fn not_found(code: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message);
        e.retry_after = Some(5);
        e
    }
    /// A JSON body over [`crate::app::MAX_JSON_BODY`] (413, field `body`).
    pub fn body_too_large() -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!(
                "a JSON body may be at most {} bytes",
                crate::app::MAX_JSON_BODY
            ),
        )
        .with_field("body")
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            code: self.code.clone(),
            message: self.message.clone(),
            field: self.field.clone(),
        }
    }
}

/// Renders an error and its chain of causes on one line.
pub use nodefs::chain;

/// A condition of the node found anywhere in an error's chain of causes, whatever layer wraps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// ENOSPC / EDQUOT: 507.
    NoSpace,
    /// A dependency is down (grove-fsd unreachable, a FUSE root whose server is gone): 503.
    Down,
}

fn errno_cause(errno: i32) -> Option<Cause> {
    match errno {
        libc::ENOSPC | libc::EDQUOT => Some(Cause::NoSpace),
        libc::ENOTCONN => Some(Cause::Down),
        _ => None,
    }
}

/// The first cause in `e`'s chain that is a storage or availability condition. grove-fsd's
/// failures cross its socket typed, with their OS error code; only an older grove-fsd's (no
/// code) are read from the message.
pub fn cause(e: &(dyn std::error::Error + 'static)) -> Option<Cause> {
    let mut cur = Some(e);
    while let Some(c) = cur {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            if let Some(k) = io.raw_os_error().and_then(errno_cause) {
                return Some(k);
            }
            if io.kind() == std::io::ErrorKind::StorageFull {
                return Some(Cause::NoSpace);
            }
        }
        if let Some(n) = c.downcast_ref::<nix::errno::Errno>() {
            if let Some(k) = errno_cause(*n as i32) {
                return Some(k);
            }
        }
        match c.downcast_ref::<nodefs::Error>() {
            Some(nodefs::Error::Unreachable(_)) => return Some(Cause::Down),
            Some(nodefs::Error::Fsd { errno: Some(n), .. }) => {
                if let Some(k) = errno_cause(*n) {
                    return Some(k);
                }
            }
            Some(nodefs::Error::Fsd {
                message,
                errno: None,
            }) if text_says_no_space(message) => return Some(Cause::NoSpace),
            _ => {}
        }
        cur = c.source();
    }
    None
}

/// An errno rendered by `std::io::Error` or `nix` inside a message from grove-fsd.
fn text_says_no_space(m: &str) -> bool {
    ["(os error 28)", "(os error 122)", "ENOSPC", "EDQUOT"]
        .iter()
        .any(|s| m.contains(s))
}

impl ApiError {
    /// 507 or 503 when `e`'s chain shows a full disk or a dependency that is down; else `fallback`.
    pub fn from_cause(e: &(dyn std::error::Error + 'static), fallback: ApiError) -> ApiError {
        match cause(e) {
            Some(Cause::NoSpace) => ApiError::new(
                StatusCode::INSUFFICIENT_STORAGE,
                "insufficient_storage",
                format!(
                    "out of disk space (a sandbox quota or the node's disk): {}",
                    fallback.message
                ),
            ),
            Some(Cause::Down) => {
                let mut a = ApiError::unavailable(fallback.message);
                a.retry_after = Some(1);
                a
            }
            None => fallback,
        }
    }
}

/// The idempotency journal could not be written: the request is refused before it does anything.
pub fn journal_error(e: &crate::idempotency::JournalError) -> ApiError {
    ApiError::from_cause(e, ApiError::internal(chain(e)))
}

impl From<grove_runtime::Error> for ApiError {
    fn from(e: grove_runtime::Error) -> Self {
        use grove_runtime::Error as E;
        let status = match &e {
            E::NotFound { .. }
            | E::ImageNotFound { .. }
            | E::FileNotFound { .. }
            | E::SessionNotFound { .. } => StatusCode::NOT_FOUND,
            E::SessionDead { .. } | E::SessionConflict { .. } => StatusCode::CONFLICT,
            E::InvalidSpec { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            E::Conflict { .. } => StatusCode::CONFLICT,
            E::CapacityExceeded { .. } | E::QueueTimeout { .. } => StatusCode::TOO_MANY_REQUESTS,
            E::PathOutsideSandbox { .. } => StatusCode::BAD_REQUEST,
            E::Unsupported { .. } => StatusCode::NOT_IMPLEMENTED,
            E::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            E::InsufficientStorage { .. } => StatusCode::INSUFFICIENT_STORAGE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let mut out = ApiError::new(status, e.code(), chain(&e));
        out.field = e.field().map(str::to_string);
        if matches!(e, E::PathOutsideSandbox { .. } | E::FileNotFound { .. }) {
            out.field = Some("path".into());
        }
        if matches!(
            e,
            E::SessionNotFound { .. } | E::SessionDead { .. } | E::SessionConflict { .. }
        ) {
            out.field = Some("name".into());
        }
        if matches!(e, E::ImageNotFound { .. }) {
            out.field = Some("image".into());
        }
        if status == StatusCode::SERVICE_UNAVAILABLE {
            out.retry_after = Some(1);
        }
        // Whatever layer failed, a full disk is a 507 and a server that is gone a 503.
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            let msg = out.message.clone();
            out = ApiError::from_cause(&e, ApiError::internal(msg));
        }
        if status == StatusCode::TOO_MANY_REQUESTS {
            out.retry_after = Some(match &e {
                E::QueueTimeout {
                    retry_after_secs, ..
                } => *retry_after_secs,
                _ => 1,
            });
        }
        out
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        resp
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

/// The image store's errors: what the request got wrong (4xx) by variant, the rest 500 unless
/// the chain shows a full disk or a dependency that is down.
impl From<nodefs::Error> for ApiError {
    fn from(e: nodefs::Error) -> Self {
        use nodefs::Error as E;
        let (status, code) = match &e {
            E::BadTar { .. } => (StatusCode::BAD_REQUEST, "invalid_tar"),
            E::BadOci { .. } => (StatusCode::BAD_REQUEST, "invalid_oci"),
            E::BadStream(_) => (StatusCode::BAD_REQUEST, "invalid_stream"),
            E::BadRefName(_) => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_spec"),
            E::UnknownRef(_) | E::UnknownManifest(_) => (StatusCode::NOT_FOUND, "image_not_found"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "store"),
        };
        let a = ApiError::new(status, code, chain(&e));
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            return ApiError::from_cause(&e, a);
        }
        a
    }
}

/// The snapshotter's errors; those of the runtime and the store it wraps map as their own.
impl From<grove_snapshotter::Error> for ApiError {
    fn from(e: grove_snapshotter::Error) -> Self {
        use grove_snapshotter::Error as E;
        let (status, field) = match e {
            E::Runtime(r) => return ApiError::from(r),
            E::Store(s) => return ApiError::from(s),
            E::NotFound { .. } => (StatusCode::NOT_FOUND, None),
            E::Conflict { .. } | E::NameTaken { .. } => (StatusCode::CONFLICT, None),
            E::InvalidInput { ref field, .. } => {
                (StatusCode::UNPROCESSABLE_ENTITY, Some(field.to_string()))
            }
            E::Unsupported { .. } => (StatusCode::NOT_IMPLEMENTED, None),
            E::BadStream { .. } => (StatusCode::BAD_REQUEST, Some("body".to_string())),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, None),
        };
        let mut a = ApiError::new(status, e.code(), chain(&e));
        a.field = field;
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            return ApiError::from_cause(&e, a);
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full disk or a gone FUSE server reads the same from grove-fsd (typed, with its code; or
    /// an older one's text) as from the in-process store.
    #[test]
    fn store_failures_map_alike_in_process_and_from_grove_fsd() {
        let in_process = nodefs::Error::Io {
            path: "/store/packs/1".into(),
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
        };
        let remote = nodefs::Error::Fsd {
            message: "commit: No space left on device (os error 28)".into(),
            errno: Some(libc::ENOSPC),
        };
        let old_remote = nodefs::Error::Fsd {
            message: "commit: No space left on device (os error 28)".into(),
            errno: None,
        };
        for e in [&in_process, &remote, &old_remote] {
            assert_eq!(cause(e), Some(Cause::NoSpace), "{e}");
        }
        let gone = nodefs::Error::Fsd {
            message: "mount: Transport endpoint is not connected".into(),
            errno: Some(libc::ENOTCONN),
        };
        assert_eq!(cause(&gone), Some(Cause::Down));
        let other = nodefs::Error::Fsd {
            message: "unexpected request".into(),
            errno: None,
        };
        assert_eq!(cause(&other), None);
    }
}
