//! Applying OCI image layers one at a time onto a stored tree: the step shared by registry
//! pulls and image builds. Each call yields an ordinary manifest (the image as of that layer),
//! so a caller can keep it under a ref and start the next pull or build from it.

use std::io::Read;

use crate::error::Error;
use crate::id::ManifestId;
use crate::import::MemNode;
use crate::oci::{check_digest, HashingReader};
use crate::readahead;
use crate::store::Store;
use crate::tree::Node;

/// How a layer blob is compressed (from its media type).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerCompression {
    None,
    Gzip,
    Zstd,
}

impl LayerCompression {
    /// From an OCI or Docker layer media type; None for media types that are not layers.
    pub fn from_media_type(media: &str) -> Option<LayerCompression> {
        match media {
            "application/vnd.oci.image.layer.v1.tar"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar" => {
                Some(LayerCompression::None)
            }
            "application/vnd.oci.image.layer.v1.tar+gzip"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
            | "application/vnd.docker.image.rootfs.diff.tar.gzip"
            | "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip" => {
                Some(LayerCompression::Gzip)
            }
            "application/vnd.oci.image.layer.v1.tar+zstd"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd" => {
                Some(LayerCompression::Zstd)
            }
            _ => None,
        }
    }
}

impl Store {
    /// Applies one layer (a tar, compressed as `compression`, OCI whiteouts honoured) onto the
    /// tree of `base` (None: an empty root) and stores the result. With `digest`
    /// (`sha256:<hex>` of the blob as given), the blob is hashed as it streams and a mismatch
    /// fails before anything is sealed: what was written is garbage for the next gc. The blob
    /// is read to its end (the digest covers it all), never spooled to disk.
    pub fn apply_layer(
        &self,
        base: Option<&ManifestId>,
        compression: LayerCompression,
        digest: Option<&str>,
        input: &mut (dyn Read + Send),
    ) -> Result<ManifestId, Error> {
        let name = digest.unwrap_or("<layer>").to_string();
        let bad = |why: String| Error::BadLayer {
            digest: name.clone(),
            why,
        };
        if let Some(d) = digest {
            if !d.starts_with("sha256:") {
                return Err(bad(format!("unsupported digest algorithm in {d:?}")));
            }
        }
        let _g = self.write_guard();
        let mut root = match base {
            Some(b) => self.load_mem(b)?,
            None => MemNode::empty_dir(),
        };
        let hashed = HashingReader::new(input);
        let hash = hashed.hasher.clone();
        let decoded: Box<dyn Read + Send + '_> = match compression {
            LayerCompression::None => Box::new(hashed),
            LayerCompression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(hashed)),
            LayerCompression::Zstd => {
                Box::new(zstd::stream::Decoder::new(hashed).map_err(|e| bad(format!("zstd: {e}")))?)
            }
        };
        // This layer's new hard-link groups count up from 1; the base's are hashes (odd, 64-bit).
        let mut groups = 0u64;
        // The blob is read, hashed and decompressed on a thread of its own, to its end (the
        // digest covers padding and the rest of a bad blob too) whatever the tar reader took.
        let (applied, drained) = std::thread::scope(|s| {
            let (mut ahead, reader) = readahead::spawn(s, decoded);
            let applied = self.apply_tar(&mut root, &mut ahead, true, &mut groups);
            drop(ahead);
            let drained = reader
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p));
            (applied, drained)
        });
        if let Some(d) = digest {
            // A blob that is not what it claims explains any tar error it caused: say that.
            if drained.is_ok() {
                let got = hash.lock().clone();
                check_digest(d, &sha2::Digest::finalize(got)).map_err(|e| bad(e.to_string()))?;
            }
        }
        applied.map_err(|e| match e {
            Error::BadTar { entry, why } => bad(format!("entry {entry:?}: {why}")),
            other => other,
        })?;
        drained.map_err(|e| bad(format!("reading: {e}")))?;
        let id = self.store_mem(&root)?;
        self.seal_import(&id)?;
        Ok(id)
    }

    /// The whole tree of a manifest, in memory, to apply a layer onto.
    fn load_mem(&self, id: &ManifestId) -> Result<MemNode, Error> {
        let t = self.get_tree(id)?;
        let mut children = std::collections::BTreeMap::new();
        for e in t.entries {
            let n = match e.node {
                Node::Dir(sub) => {
                    let mut d = self.load_mem(&sub)?;
                    if let MemNode::Dir { meta, .. } = &mut d {
                        *meta = e.meta;
                    }
                    d
                }
                node => MemNode::Leaf {
                    meta: e.meta,
                    node,
                    group: e.link,
                },
            };
            children.insert(e.name, n);
        }
        Ok(MemNode::Dir {
            meta: t.meta,
            children,
        })
    }
}
