//! Warm pools and jobs: view and replace their configuration, see how they stand.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use grove_runtime::JobsConfig;

use crate::api_shapes::{Jobs, Pools, PoolsRequest};
use crate::app::{blocking, App};
use crate::error::{ApiError, ApiResult};
use crate::request_parse::ApiJson;

pub async fn get_pools(State(app): State<Arc<App>>) -> ApiResult<Json<Pools>> {
    let rt = app.runtime.clone();
    blocking(move || {
        Ok(Json(Pools {
            config: rt.pools_config(),
            pools: rt.pools(),
        }))
    })
    .await
}

/// PUT /v1/pools: replaces every pool; idle sandboxes of pools that shrink are destroyed first.
pub async fn put_pools(
    State(app): State<Arc<App>>,
    ApiJson(req): ApiJson<PoolsRequest>,
) -> ApiResult<Json<Pools>> {
    let config = req.into_config(&app.config.defaults);
    let rt = app.runtime.clone();
    blocking(move || {
        rt.set_pools(config).map_err(ApiError::from)?;
        Ok(Json(Pools {
            config: rt.pools_config(),
            pools: rt.pools(),
        }))
    })
    .await
}

pub async fn get_jobs(State(app): State<Arc<App>>) -> ApiResult<Json<Jobs>> {
    let rt = app.runtime.clone();
    Ok(Json(Jobs {
        config: rt.jobs_config(),
        jobs: rt.jobs(),
    }))
}

/// PUT /v1/jobs: replaces the queue timeout and every job's share and quotas. Sandboxes already
/// running are not touched; a lowered quota holds back the job's next creates.
pub async fn put_jobs(
    State(app): State<Arc<App>>,
    ApiJson(config): ApiJson<JobsConfig>,
) -> ApiResult<Json<Jobs>> {
    let rt = app.runtime.clone();
    rt.set_jobs(config).map_err(ApiError::from)?;
    Ok(Json(Jobs {
        config: rt.jobs_config(),
        jobs: rt.jobs(),
    }))
}
