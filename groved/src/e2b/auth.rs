//! Who may use the E2B endpoint. The control plane takes the node's API key as E2B's SDK sends
//! it (`X-API-Key`, or `Authorization: Bearer`); a node without a key serves only loopback and
//! takes any key. Sandbox traffic carries no API key in E2B's protocol: it is authenticated by
//! the sandbox's envd access token (`X-Access-Token`). Every sandbox made here is marked secure
//! (a label), and its token is a keyed hash of its id under a key of the node's own
//! ([`TokenKey`], kept in the state dir): stored nowhere, handed out by create and `connect`,
//! and different for every branch of a fork, so one branch's token opens no sibling. A sandbox
//! made through Grove's own API is not marked: on a node with a key it is not reachable through
//! this endpoint.

use std::path::Path;

use axum::http::HeaderMap;
use grove_runtime::{SandboxId, SandboxInfo};
use sha2::{Digest as _, Sha256};

use super::error::{E2bError, E2bResult};
use crate::app::App;

/// Label marking a sandbox as reachable through the endpoint with its access token.
pub const SECURE_LABEL: &str = "e2b.secure";

/// The node's key for access tokens: 32 random bytes in `<state_dir>/e2b-token.key` (0600),
/// made on first start, so tokens handed out survive a restart of groved.
pub struct TokenKey([u8; 32]);

impl TokenKey {
    pub fn open(state_dir: &Path) -> TokenKey {
        let path = state_dir.join("e2b-token.key");
        if let Ok(b) = std::fs::read(&path) {
            if let Ok(k) = <[u8; 32]>::try_from(b.as_slice()) {
                return TokenKey(k);
            }
            tracing::warn!(path = %path.display(), "e2b token key is damaged: making a new one");
        }
        let key: [u8; 32] = rand::random();
        if let Err(e) = write_key(&path, &key) {
            tracing::warn!(
                path = %path.display(),
                "e2b token key not saved ({e}): access tokens last until groved restarts"
            );
        }
        TokenKey(key)
    }

    /// The access token of sandbox `id`.
    pub fn token(&self, id: &SandboxId) -> String {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(b"grove e2b access token\0");
        h.update(id.to_string().as_bytes());
        h.finalize().to_hex().to_string()
    }
}

fn write_key(path: &Path, key: &[u8; 32]) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let tmp = path.with_extension("key.tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(key)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// The access token a sandbox made here has (None: not made through the endpoint).
pub fn token_of(app: &App, info: &SandboxInfo) -> Option<String> {
    info.spec
        .labels
        .contains_key(SECURE_LABEL)
        .then(|| app.e2b_tokens.token(&info.id))
}

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

/// A sandbox request's check: its `X-Access-Token` must be the sandbox's.
pub fn sandbox(app: &App, info: &SandboxInfo, h: &HeaderMap) -> E2bResult<()> {
    let Some(want) = token_of(app, info) else {
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
