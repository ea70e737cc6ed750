//! The API's error type: every failure leaves groved as JSON `{code, message, field}` with an honest status.

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

impl From<grove_runtime::Error> for ApiError {
    fn from(e: grove_runtime::Error) -> Self {
        use grove_runtime::Error as E;
        let status = match &e {
            E::NotFound { .. } | E::ImageNotFound { .. } | E::FileNotFound { .. } => {
                StatusCode::NOT_FOUND
            }
            E::InvalidSpec { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            E::Conflict { .. } => StatusCode::CONFLICT,
            E::CapacityExceeded { .. } | E::QueueTimeout { .. } => StatusCode::TOO_MANY_REQUESTS,
            E::PathOutsideSandbox { .. } => StatusCode::BAD_REQUEST,
            E::Unsupported { .. } => StatusCode::NOT_IMPLEMENTED,
            E::Io { source, .. }
                if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) =>
            {
                StatusCode::INSUFFICIENT_STORAGE
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let code = match status {
            StatusCode::INSUFFICIENT_STORAGE => "no_space",
            _ => e.code(),
        };
        let mut out = ApiError::new(status, code, chain(&e));
        out.field = e.field().map(str::to_string);
        if matches!(e, E::PathOutsideSandbox { .. } | E::FileNotFound { .. }) {
            out.field = Some("path".into());
        }
        if matches!(e, E::ImageNotFound { .. }) {
            out.field = Some("image".into());
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
