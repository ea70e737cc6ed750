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

/// Each of a batch's backend results (a fork's branches) as the API answers it.
pub fn api_each<T>(results: Vec<crate::backend::BackendResult<T>>) -> Vec<ApiResult<T>> {
    results
        .into_iter()
        .map(|r| r.map_err(ApiError::from))
        .collect()
}

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

/// The image and snapshot backends' errors: the one place their HTTP status and body are decided.
/// The stores' own errors map as above; a failure of the node rather than the request is a 500
/// (507 or 503 by its cause where the stores' mapping says so).
impl From<crate::backend::BackendError> for ApiError {
    fn from(e: crate::backend::BackendError) -> Self {
        use crate::backend::BackendError as B;
        match e {
            B::NotFound { what, .. } => {
                ApiError::not_found(&format!("{what}_not_found"), e.to_string()).with_field("name")
            }
            B::Exists { what, .. } => ApiError::new(
                StatusCode::CONFLICT,
                &format!("{what}_exists"),
                e.to_string(),
            )
            .with_field("name"),
            B::InvalidInput { field, reason } => ApiError::invalid(&field, reason),
            B::BadTar { .. } => {
                ApiError::new(StatusCode::BAD_REQUEST, "invalid_tar", e.to_string())
                    .with_field("body")
            }
            B::Unsupported { .. } => {
                ApiError::new(StatusCode::NOT_IMPLEMENTED, "unsupported", e.to_string())
            }
            B::NotDurable(s) => match cause(&s) {
                Some(Cause::NoSpace) => ApiError::new(
                    StatusCode::INSUFFICIENT_STORAGE,
                    "insufficient_storage",
                    format!(
                        "the store is out of space, no snapshot was made: {}",
                        chain(&s)
                    ),
                )
                .with_field("durable"),
                _ => ApiError::internal(chain(&s)),
            },
            B::Io { .. } => ApiError::internal(e.to_string()),
            B::Store(ref s) => ApiError::from_cause(s, ApiError::internal(chain(&e))),
            B::Images(s) => s.into(),
            B::Snapshots(s) => s.into(),
            B::Runtime(r) => r.into(),
        }
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

    /// One backend error's status and body.
    fn answer(e: crate::backend::BackendError) -> (u16, ErrorBody) {
        let a = ApiError::from(e);
        (a.status.as_u16(), a.body())
    }

    fn body(code: &str, message: &str, field: Option<&str>) -> ErrorBody {
        ErrorBody {
            code: code.into(),
            message: message.into(),
            field: field.map(str::to_string),
        }
    }

    /// The backend's own conditions: each its status, its code, the field it names and why.
    #[test]
    fn backend_errors_map_to_status_and_body() {
        use crate::backend::BackendError as B;
        let cases = [
            (
                B::NotFound {
                    what: "image",
                    name: "app".into(),
                },
                404,
                body("image_not_found", "image \"app\" not found", Some("name")),
            ),
            (
                B::Exists {
                    what: "image",
                    name: "app".into(),
                },
                409,
                body("image_exists", "image \"app\" exists", Some("name")),
            ),
            (
                B::InvalidInput {
                    field: "from".into(),
                    reason: "\"..\": not a name".into(),
                },
                422,
                body("invalid_spec", "\"..\": not a name", Some("from")),
            ),
            (
                B::BadTar {
                    error: std::io::Error::other("truncated archive"),
                },
                400,
                body("invalid_tar", "unpacking: truncated archive", Some("body")),
            ),
            (
                B::Unsupported { what: "gc" },
                501,
                body("unsupported", "gc needs the nodefs image store", None),
            ),
            (
                B::Io {
                    what: "listing images",
                    error: std::io::Error::from_raw_os_error(libc::EACCES),
                },
                500,
                body(
                    "internal",
                    "listing images: Permission denied (os error 13)",
                    None,
                ),
            ),
            (
                B::Store(nodefs::Error::BadRefName("x".into())),
                500,
                body("internal", "the store: invalid ref name \"x\"", None),
            ),
        ];
        for (e, status, want) in cases {
            let what = format!("{e:?}");
            let (got_status, got) = answer(e);
            assert_eq!((got_status, &got), (status, &want), "{what}");
        }
    }

    /// A name the backend refuses names its field, whichever request it came in.
    #[test]
    fn a_bad_name_is_422_naming_its_field() {
        let e = crate::backend::check_name("commit", "-x").unwrap_err();
        let (status, b) = answer(e);
        assert_eq!(status, 422);
        assert_eq!(b.code, "invalid_spec");
        assert_eq!(b.field.as_deref(), Some("commit"));
        assert!(
            b.message.starts_with("\"-x\": 1-128 chars"),
            "{}",
            b.message
        );
        let e = crate::backend::check_new_image_name("name", "pull").unwrap_err();
        let (status, b) = answer(e);
        assert_eq!((status, b.field.as_deref()), (422, Some("name")));
        assert!(b.message.contains("is reserved"), "{}", b.message);
    }

    /// A store failure the request cannot have caused is the node's (500), unless the disk is
    /// full (507) or grove-fsd is gone (503); the stores' own errors keep their mapping.
    #[test]
    fn store_errors_map_by_cause_and_by_variant() {
        use crate::backend::BackendError as B;
        let full = || nodefs::Error::Io {
            path: "/store/packs/1".into(),
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
        };
        let (status, b) = answer(B::Store(full()));
        assert_eq!((status, b.code.as_str()), (507, "insufficient_storage"));
        assert!(b.message.contains("the store: "), "{}", b.message);
        let a = ApiError::from(B::Store(nodefs::Error::Unreachable("gone".into())));
        assert_eq!((a.status.as_u16(), a.retry_after), (503, Some(1)));
        assert_eq!(a.code, "unavailable");
        let (status, b) = answer(B::Images(nodefs::Error::UnknownRef("app".into())));
        assert_eq!((status, b.code.as_str()), (404, "image_not_found"));
        let (status, b) = answer(B::Images(nodefs::Error::BadRefName("a b".into())));
        assert_eq!((status, b.code.as_str()), (422, "invalid_spec"));
        let (status, b) = answer(B::Images(full()));
        assert_eq!((status, b.code.as_str()), (507, "insufficient_storage"));
        let (status, b) = answer(B::Snapshots(grove_snapshotter::Error::NotFound {
            snapshot: "s".into(),
        }));
        assert_eq!((status, b.code.as_str()), (404, "not_found"));
        let (status, b) = answer(B::Runtime(grove_runtime::Error::NotFound {
            id: "sb-1".into(),
        }));
        assert_eq!((status, b.code.as_str()), (404, "not_found"));
    }

    /// A durable snapshot whose images could not be stored: 507 naming `durable` when the
    /// import failed for a full store (in process or through grove-fsd), else 500; told by the
    /// import error's type, not its text.
    #[test]
    fn a_durable_snapshot_not_stored_is_507_only_for_a_full_store() {
        use crate::backend::BackendError as B;
        let not_stored = |e: grove_snapshotter::Error| {
            B::NotDurable(grove_snapshotter::Error::NotStored {
                snapshot: "s1".into(),
                source: std::sync::Arc::new(e),
            })
        };
        let local = grove_snapshotter::Error::Store(nodefs::Error::Io {
            path: "/store/packs/1".into(),
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
        });
        let remote = grove_snapshotter::Error::Store(nodefs::Error::Fsd {
            message: "import: quota".into(),
            errno: Some(libc::EDQUOT),
        });
        for e in [local, remote] {
            let (status, b) = answer(not_stored(e));
            assert_eq!(status, 507, "{b:?}");
            assert_eq!(b.code, "insufficient_storage");
            assert_eq!(b.field.as_deref(), Some("durable"));
            assert!(
                b.message.starts_with(
                    "the store is out of space, no snapshot was made: not supported: snapshot s1: its images could not be stored: "
                ),
                "{}",
                b.message
            );
        }
        // Says "No space left" in its text, but is not a full store.
        let other = grove_snapshotter::Error::Unsupported {
            what: "images left scratch space (No space left on device?)".into(),
        };
        let (status, b) = answer(not_stored(other));
        assert_eq!((status, b.code.as_str(), b.field), (500, "internal", None));
        assert_eq!(
            b.message,
            "not supported: snapshot s1: its images could not be stored: not supported: images left scratch space (No space left on device?)"
        );
    }
}
