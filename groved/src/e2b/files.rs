//! envd's HTTP file routes (`GET`/`POST /files`).

use std::sync::Arc;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use grove_runtime::SandboxInfo;

use super::error::E2bError;
use crate::app::App;

pub async fn handle(_app: Arc<App>, _info: SandboxInfo, _req: Request) -> Response {
    E2bError::new(StatusCode::NOT_IMPLEMENTED, "not yet").into_response()
}
