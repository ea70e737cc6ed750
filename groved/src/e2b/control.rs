//! E2B's REST control plane (the shapes the SDK's generated client expects), onto groved's own
//! lifecycle.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;

use super::error::E2bError;
use crate::app::App;

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .fallback(|| async { E2bError::not_found("no such endpoint") })
        .layer(middleware::from_fn_with_state(app.clone(), authenticate))
        .with_state(app)
}

async fn authenticate(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    match super::auth::control(&app, req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}
