//! Who may use the E2B endpoint. The control plane takes the node's API key as E2B's SDK sends
//! it (`X-API-Key`, or `Authorization: Bearer`); a node without a key serves only loopback and
//! takes any key. Sandbox traffic carries no API key in E2B's protocol: it is authenticated by
//! the sandbox's envd access token (`X-Access-Token`), which every sandbox made here has, kept
//! in a label (readable only with the node's API key, like the sandbox itself, and handed back
//! by `connect`). A sandbox made through Grove's own API has no token: on a node with a key it
//! is not reachable through this endpoint.

use axum::http::HeaderMap;
use grove_runtime::SandboxInfo;
use sha2::{Digest as _, Sha256};

use super::error::{E2bError, E2bResult};
use crate::app::App;

/// Label holding a sandbox's envd access token.
pub const TOKEN_LABEL: &str = "e2b.access-token";

/// Equal in time independent of where the first difference is.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

/// The control plane's check.
pub fn control(app: &App, h: &HeaderMap) -> E2bResult<()> {
    let given = header(h, "x-api-key")
        .or_else(|| header(h, "authorization").and_then(|v| v.strip_prefix("Bearer ")));
    let Some(key) = app.config.api_key.as_deref() else {
        return Ok(());
    };
    match given {
        Some(g) if same(g.as_bytes(), key.as_bytes()) => Ok(()),
        Some(_) => Err(E2bError::unauthorized("Invalid API key")),
        None => Err(E2bError::unauthorized(
            "Missing API key: send it as X-API-Key",
        )),
    }
}

/// A fresh access token: 192 random bits, hex.
pub fn new_token() -> String {
    let bytes: [u8; 24] = rand::random();
    hex_of(&bytes)
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A sandbox request's check: its `X-Access-Token` must be the sandbox's.
pub fn sandbox(app: &App, info: &SandboxInfo, h: &HeaderMap) -> E2bResult<()> {
    let Some(want) = info.spec.labels.get(TOKEN_LABEL) else {
        if app.config.api_key.is_none() {
            return Ok(());
        }
        return Err(E2bError::unauthorized(format!(
            "sandbox {} was not created through the E2B endpoint and has no access token",
            info.id
        )));
    };
    let Some(given) = header(h, "x-access-token") else {
        return Err(E2bError::unauthorized(
            "missing X-Access-Token for this secure sandbox",
        ));
    };
    // Both sides hashed first: the comparison's time says nothing about the token's length.
    let (a, b) = (
        Sha256::digest(given.as_bytes()),
        Sha256::digest(want.as_bytes()),
    );
    if same(&a, &b) {
        Ok(())
    } else {
        Err(E2bError::unauthorized("invalid X-Access-Token"))
    }
}
