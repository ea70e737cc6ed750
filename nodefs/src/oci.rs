//! Importing an OCI image layout (index.json → manifest → layers with whiteouts).

use std::fs;
use std::io::Read;
use std::path::Path;

use parking_lot::Mutex;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::sync::Arc;

use crate::error::Error;
use crate::id::ManifestId;
use crate::import::MemNode;
use crate::store::Store;
use crate::tarimport::blob_path;

impl Store {
    /// Import the image named `reference` (its `org.opencontainers.image.ref.name`), or the
    /// only image, from an OCI layout directory. Layers are applied in order with whiteouts.
    pub fn import_oci(
        &self,
        layout_dir: &Path,
        reference: Option<&str>,
    ) -> Result<ManifestId, Error> {
        let bad = |why: String| Error::BadOci {
            path: layout_dir.to_path_buf(),
            why,
        };
        let layout = read_json(layout_dir, &layout_dir.join("oci-layout"))?;
        if layout
            .get("imageLayoutVersion")
            .and_then(Value::as_str)
            .is_none()
        {
            return Err(bad("oci-layout has no imageLayoutVersion".into()));
        }
        let index = read_json(layout_dir, &layout_dir.join("index.json"))?;
        let manifests = index
            .get("manifests")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("index.json has no manifests".into()))?;
        let chosen = match reference {
            Some(r) => manifests
                .iter()
                .find(|m| {
                    m.pointer("/annotations/org.opencontainers.image.ref.name")
                        .and_then(Value::as_str)
                        == Some(r)
                })
                .ok_or_else(|| bad(format!("no image named {r:?} in index.json")))?,
            None if manifests.len() == 1 => &manifests[0],
            None => {
                return Err(bad(format!(
                    "index.json holds {} images; name one",
                    manifests.len()
                )))
            }
        };
        let mut desc = chosen.clone();
        // Follow nested indexes to a linux/amd64 (or the first) image manifest.
        let manifest = loop {
            let digest = desc
                .get("digest")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("descriptor without digest".into()))?;
            let p = blob_path(layout_dir, digest)
                .ok_or_else(|| bad(format!("bad digest {digest:?}")))?;
            let m = read_json(layout_dir, &p)?;
            if let Some(ms) = m.get("manifests").and_then(Value::as_array) {
                let pick = ms
                    .iter()
                    .find(|d| {
                        d.pointer("/platform/architecture").and_then(Value::as_str) == Some("amd64")
                            && d.pointer("/platform/os").and_then(Value::as_str) == Some("linux")
                    })
                    .or_else(|| ms.first())
                    .ok_or_else(|| bad(format!("index {digest} is empty")))?;
                desc = pick.clone();
                continue;
            }
            break m;
        };
        let layers = manifest
            .get("layers")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("image manifest has no layers".into()))?;
        let _g = self.write_guard();
        let mut root = MemNode::empty_dir();
        let mut groups = 0u64;
        for l in layers {
            let digest = l
                .get("digest")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("layer without digest".into()))?;
            let media = l.get("mediaType").and_then(Value::as_str).unwrap_or("");
            let p = blob_path(layout_dir, digest)
                .ok_or_else(|| bad(format!("bad layer digest {digest:?}")))?;
            let f = fs::File::open(&p).map_err(|e| bad(format!("layer {digest}: {e}")))?;
            let hashed = HashingReader::new(f);
            let hash = hashed.hasher.clone();
            let mut r: Box<dyn Read> = if media.ends_with("+zstd") {
                Box::new(
                    zstd::stream::Decoder::new(hashed)
                        .map_err(|e| bad(format!("layer {digest}: {e}")))?,
                )
            } else if media.ends_with("+gzip") || media.ends_with(".gzip") {
                Box::new(flate2::read::MultiGzDecoder::new(hashed))
            } else {
                Box::new(hashed)
            };
            self.apply_tar(&mut root, &mut r, true, &mut groups)
                .map_err(|e| match e {
                    Error::BadTar { entry, why } => {
                        bad(format!("layer {digest}: entry {entry:?}: {why}"))
                    }
                    other => other,
                })?;
            // Hash what the tar reader left unread (padding), then check the digest.
            std::io::copy(&mut r, &mut std::io::sink())
                .map_err(|e| bad(format!("layer {digest}: {e}")))?;
            drop(r);
            let got = hash.lock().clone().finalize();
            check_digest(digest, &got).map_err(|e| bad(e.to_string()))?;
        }
        let id = self.store_mem(&root)?;
        self.seal_import(&id)?;
        Ok(id)
    }
}

/// Reads through, feeding a sha256 shared with the caller.
pub(crate) struct HashingReader<R> {
    inner: R,
    pub(crate) hasher: Arc<Mutex<Sha256>>,
}

impl<R: Read> HashingReader<R> {
    pub(crate) fn new(inner: R) -> Self {
        HashingReader {
            inner,
            hasher: Arc::new(Mutex::new(Sha256::new())),
        }
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.lock().update(&buf[..n]);
        Ok(n)
    }
}

/// A blob that is not what its digest names; the import refuses it as a bad layout or layer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DigestError {
    /// Its content hashes to something else.
    #[error("blob {digest} does not match its digest")]
    Mismatch { digest: String },
    /// Named by a digest other than sha256.
    #[error("unsupported digest algorithm in {digest:?}")]
    Algorithm { digest: String },
}

pub(crate) fn check_digest(digest: &str, got: &[u8]) -> Result<(), DigestError> {
    match digest.split_once(':') {
        Some(("sha256", hex)) if hex.eq_ignore_ascii_case(&hex::encode(got)) => Ok(()),
        Some(("sha256", _)) => Err(DigestError::Mismatch {
            digest: digest.into(),
        }),
        _ => Err(DigestError::Algorithm {
            digest: digest.into(),
        }),
    }
}

fn read_json(layout: &Path, p: &Path) -> Result<Value, Error> {
    let s = fs::read(p).map_err(|e| Error::BadOci {
        path: layout.to_path_buf(),
        why: format!("{}: {e}", p.display()),
    })?;
    // Blobs are named by their digest: check it.
    if let (Some(hex), Some(alg)) = (
        p.file_name().and_then(|n| n.to_str()),
        p.parent()
            .and_then(|d| d.file_name())
            .and_then(|n| n.to_str()),
    ) {
        if p.parent()
            .and_then(|d| d.parent())
            .is_some_and(|b| b.ends_with("blobs"))
        {
            check_digest(&format!("{alg}:{hex}"), &Sha256::digest(&s)).map_err(|e| {
                Error::BadOci {
                    path: layout.to_path_buf(),
                    why: e.to_string(),
                }
            })?;
        }
    }
    serde_json::from_slice(&s).map_err(|e| Error::BadOci {
        path: layout.to_path_buf(),
        why: format!("{}: {e}", p.display()),
    })
}
