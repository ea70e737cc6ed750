//! Images: import (host directory, OCI layout, tar upload), list, delete.

use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;

use crate::api_shapes::{Image, ImageImportRequest, ImageList};
use crate::app::{blocking, App};
use crate::backend::check_name;
use crate::error::{ApiError, ApiResult};
use crate::pipe::ChanReader;
use crate::request_parse::ApiJson;

pub async fn list(State(app): State<Arc<App>>) -> ApiResult<Json<ImageList>> {
    let images = app.images.clone();
    Ok(Json(ImageList {
        items: blocking(move || Ok(images.list()?)).await?,
    }))
}

/// POST /v1/images: import from a path on the node (`source`: "dir" or "oci").
pub async fn import(
    State(app): State<Arc<App>>,
    ApiJson(req): ApiJson<ImageImportRequest>,
) -> ApiResult<(StatusCode, Json<Image>)> {
    crate::backend::check_new_image_name("name", &req.name)?;
    if !matches!(req.source.as_str(), "dir" | "oci") {
        return Err(ApiError::invalid(
            "source",
            format!("{:?} is not \"dir\" or \"oci\"", req.source),
        ));
    }
    if req.reference.is_some() && req.source != "oci" {
        return Err(ApiError::invalid("reference", "only for source \"oci\""));
    }
    let dir = check_host_dir("path", &req.path)?;
    let (images, configs) = (app.images.clone(), app.image_configs.clone());
    let img = blocking(move || match req.source.as_str() {
        "oci" => {
            // A layout whose config cannot be read still imports (nodefs judges the layers).
            let cfg = crate::image_config::from_layout(&dir, req.reference.as_deref()).ok();
            crate::image_config::with_config(&configs, &req.name, cfg.as_ref(), || {
                Ok(images.import_oci(&req.name, &dir, req.reference.as_deref())?)
            })
        }
        _ => Ok(images.import_dir(&req.name, &dir)?),
    })
    .await?;
    Ok((StatusCode::CREATED, Json(img)))
}

/// PUT /v1/images/{name}/tar: the body is a tar of the root filesystem.
pub async fn import_tar(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    body: Body,
) -> ApiResult<(StatusCode, Json<Image>)> {
    crate::backend::check_new_image_name("name", &name)?;
    let images = app.images.clone();
    let mut reader = ChanReader::spawn(body);
    let img = blocking(move || Ok(images.import_tar(&name, &mut reader)?)).await?;
    Ok((StatusCode::CREATED, Json(img)))
}

/// GET /v1/images/{name}: the image with its config.
pub async fn inspect(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
) -> ApiResult<Json<Image>> {
    check_name("name", &name)?;
    let (images, configs) = (app.images.clone(), app.image_configs.clone());
    blocking(move || {
        let mut img = images
            .list()?
            .into_iter()
            .find(|i| i.name == name)
            .ok_or_else(|| {
                ApiError::not_found("image_not_found", format!("image {name:?} not found"))
                    .with_field("name")
            })?;
        img.config = configs.get(&name)?;
        Ok(Json(img))
    })
    .await
}

pub async fn delete(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    check_name("name", &name)?;
    let (images, configs) = (app.images.clone(), app.image_configs.clone());
    blocking(move || {
        let gone = configs.get(&name).ok().flatten().map(|c| c.layers);
        images.delete(&name)?;
        configs.remove(&name)?;
        // Pulled layers only this image used go too, so gc frees them.
        if let (Some(store), Some(gone)) = (images.store(), gone) {
            let keep = configs.all_layers();
            if let Err(e) = crate::registry::pull::sweep_layers(&*store, &gone, &keep) {
                tracing::warn!("dropping unused layer refs: {}", nodefs::chain(&e));
            }
        }
        Ok(())
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A host path given in a request: absolute and existing.
fn check_host_dir(field: &str, path: &str) -> ApiResult<PathBuf> {
    let p = PathBuf::from(path);
    if !p.is_absolute() {
        return Err(ApiError::invalid(
            field,
            format!("{path:?} is not an absolute path"),
        ));
    }
    if !p.is_dir() {
        return Err(ApiError::not_found(
            "path_not_found",
            format!("{path:?} is not a directory on the node"),
        )
        .with_field(field));
    }
    Ok(p)
}
