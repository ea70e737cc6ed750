//! E2B's error shape, `{"code": <HTTP status>, "message": "..."}`, which the SDK turns into its own
//! typed exceptions by status: 400 InvalidArgument, 401 Authentication, 404 NotFound, 409 (a
//! paused sandbox's pause), 429 RateLimit, 502 SandboxUnavailable, 503 ServiceBusy, 507 NotEnoughSpace.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// An E2B API failure.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{status}: {message}")]
pub struct E2bError {
    pub status: StatusCode,
    pub message: String,
    pub retry_after: Option<u64>,
}

pub type E2bResult<T> = Result<T, E2bError>;

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> E2bError {
        E2bError {
            status,
            message: message.into(),
            retry_after: None,
        }
    }

    /// Bad input, naming the field.
    pub fn invalid(field: &str, why: impl std::fmt::Display) -> E2bError {
        E2bError::new(StatusCode::BAD_REQUEST, format!("{field}: {why}"))
    }

    pub fn not_found(message: impl Into<String>) -> E2bError {
        E2bError::new(StatusCode::NOT_FOUND, message)
    }

    pub fn unauthorized(message: impl Into<String>) -> E2bError {
        E2bError::new(StatusCode::UNAUTHORIZED, message)
    }
}

/// groved's own errors keep their status, except those E2B's SDK has no use for: 422 (bad
/// input in Grove's API) is E2B's 400, and a field named by Grove is named in the message.
impl From<ApiError> for E2bError {
    fn from(e: ApiError) -> E2bError {
        let status = match e.status {
            StatusCode::UNPROCESSABLE_ENTITY => StatusCode::BAD_REQUEST,
            s => s,
        };
        let message = match &e.field {
            Some(f) if !e.message.contains(f.as_str()) => format!("{f}: {}", e.message),
            _ => e.message.clone(),
        };
        E2bError {
            status,
            message,
            retry_after: e.retry_after,
        }
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({"code": self.status.as_u16(), "message": self.message});
        let mut r = (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        r
    }
}
