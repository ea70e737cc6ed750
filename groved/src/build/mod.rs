//! Images from Dockerfiles: `POST /v1/images/build`, `grove build`.
//!
//! [`dockerfile`] parses, [`engine`] runs the steps (each a nodefs commit, cached), this module
//! unpacks the context the client sent and reads the Dockerfile out of it.

pub mod cache;
pub mod dockerfile;
pub mod engine;
pub mod glob;

use std::io::Read;
use std::path::Path;

use axum::http::StatusCode;
use grove_runtime::ConfinedRoot;

pub use crate::image_config::ImageConfig;

use crate::error::{ApiError, ApiResult};

/// The largest build context accepted (the unpacked tar, bytes read off the wire).
pub const MAX_CONTEXT_BYTES: u64 = 8 << 30;
/// The largest Dockerfile read.
const MAX_DOCKERFILE_BYTES: u64 = 1 << 20;

/// Unpacks the context tar into `dir` (existing, empty): members resolve inside it, never
/// through a link out of it; devices, FIFOs and hard links are refused.
pub fn unpack_context(tar: &mut dyn Read, dir: &Path) -> ApiResult<()> {
    let root = ConfinedRoot::open_dir(dir)
        .map_err(|e| ApiError::internal(format!("opening {}: {e}", dir.display())))?;
    let mut limited = Limited {
        inner: tar,
        left: MAX_CONTEXT_BYTES,
    };
    root.upload_tar("/", &mut limited).map_err(|e| {
        if limited.left == 0 {
            return ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "context_too_large",
                format!("the build context is over {MAX_CONTEXT_BYTES} bytes"),
            )
            .with_field("body");
        }
        let msg = e.to_string();
        if msg.contains("os error 28") {
            return ApiError::new(
                StatusCode::INSUFFICIENT_STORAGE,
                "insufficient_storage",
                format!("no space for the build context: {msg}"),
            );
        }
        ApiError::bad_request("invalid_tar", "body", format!("the build context: {msg}"))
    })
}

struct Limited<'a> {
    inner: &'a mut dyn Read,
    left: u64,
}

impl Read for Limited<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.left == 0 {
            return Err(std::io::Error::other("build context too large"));
        }
        let max = buf.len().min(self.left.min(usize::MAX as u64) as usize);
        let n = self.inner.read(&mut buf[..max])?;
        self.left -= n as u64;
        Ok(n)
    }
}

/// The Dockerfile at `path` inside the context, parsed; a parse error is a 400 naming the line.
pub fn read_dockerfile(ctx: &Path, path: &str) -> ApiResult<dockerfile::Dockerfile> {
    let root = ConfinedRoot::open_dir(ctx)
        .map_err(|e| ApiError::internal(format!("opening the context: {e}")))?;
    let shown = format!("/{}", glob::clean(path));
    let (f, size) = root.open_read(&shown).map_err(|e| {
        ApiError::bad_request(
            "invalid_dockerfile",
            "dockerfile",
            format!("{path:?} in the build context: {e}"),
        )
    })?;
    if size > MAX_DOCKERFILE_BYTES {
        return Err(ApiError::bad_request(
            "invalid_dockerfile",
            "dockerfile",
            format!("{path:?} is over {MAX_DOCKERFILE_BYTES} bytes"),
        ));
    }
    let mut text = String::new();
    f.take(MAX_DOCKERFILE_BYTES)
        .read_to_string(&mut text)
        .map_err(|e| {
            ApiError::bad_request("invalid_dockerfile", "dockerfile", format!("{path:?}: {e}"))
        })?;
    dockerfile::parse(&text)
        .map_err(|e| ApiError::bad_request("invalid_dockerfile", "dockerfile", e.to_string()))
}

/// The context's `.dockerignore` (none: nothing ignored).
pub fn read_ignore(ctx: &Path) -> glob::Ignore {
    ConfinedRoot::open_dir(ctx)
        .ok()
        .and_then(|r| r.read("/.dockerignore").ok())
        .map(|b| glob::Ignore::parse(&String::from_utf8_lossy(&b)))
        .unwrap_or_default()
}
