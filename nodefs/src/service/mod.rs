//! The store and the FUSE server behind one interface, so callers have one code path whether they
//! run them in-process ([`Local`]: tests, examples, embedded tools) or reach `grove-fsd`, a
//! separate process that outlives the daemon so sandbox roots survive its restart ([`Client`]).

mod client;
mod local;
mod proto;
mod server;

use std::collections::HashSet;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::chunker::ChunkPolicy;
use crate::error::Error;
use crate::fs::{MountOptions, Usage};
use crate::id::{ManifestId, ObjectId};
use crate::layer::LayerCompression;
use crate::store::{FsckReport, GcReport, StoreStats};

pub use client::{Client, Spawn};
pub use local::Local;
pub use proto::VERSION;
pub use server::{serve, serve_with, ServeError};

/// How an imported directory is cut into chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImportPolicy {
    /// Content-defined chunks for every file.
    Cdc,
    /// CRIU image directories: page images cut per page (identical pages dedup one by one),
    /// the other (small, structured) images content-defined.
    CriuImages,
}

impl ImportPolicy {
    /// The chunking of one file (path relative to the imported directory).
    pub fn for_path(&self, path: &Path) -> ChunkPolicy {
        match self {
            ImportPolicy::Cdc => ChunkPolicy::Cdc,
            ImportPolicy::CriuImages => {
                let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
                if name.starts_with("pages-") && name.ends_with(".img") {
                    ChunkPolicy::Fixed(4096)
                } else {
                    ChunkPolicy::Cdc
                }
            }
        }
    }
}

/// A live mount served by the service.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountInfo {
    /// The server's handle for commit, usage and unmount.
    pub id: u64,
    pub base: ManifestId,
    pub mountpoint: PathBuf,
    /// How the mount's FUSE requests reach the server. Absent from an older server: /dev/fuse.
    #[serde(default)]
    pub transport: crate::Transport,
}

/// Everything the daemon and the snapshotter do with the store and the FUSE server. Bulk data
/// never crosses this interface as values: directories are named by path, streams are `Read` /
/// `Write` (a pipe whose end is passed to `grove-fsd`).
pub trait FsService: Send + Sync + std::fmt::Debug {
    /// A ref name or a manifest's hex id.
    fn resolve(&self, name_or_hex: &str) -> Result<ManifestId, Error>;
    fn get_ref(&self, name: &str) -> Result<Option<ManifestId>, Error>;
    fn set_ref(&self, name: &str, id: &ManifestId) -> Result<(), Error>;
    fn delete_ref(&self, name: &str) -> Result<(), Error>;
    fn refs(&self) -> Result<Vec<(String, ManifestId)>, Error>;
    fn stats(&self) -> Result<StoreStats, Error>;
    /// Compressed bytes on disk (cheap: no index walk).
    fn stored_bytes(&self) -> Result<u64, Error>;
    fn manifest_bytes(&self, id: &ManifestId) -> Result<u64, Error>;
    /// `base`: an earlier import of a similar tree (the previous checkpoint of the same
    /// sandbox); its directories serve as delta bases (see `Store::import_dir_based`).
    fn import_dir(
        &self,
        dir: &Path,
        policy: ImportPolicy,
        base: Option<&ManifestId>,
    ) -> Result<ManifestId, Error>;
    fn import_oci(&self, dir: &Path, reference: Option<&str>) -> Result<ManifestId, Error>;
    fn import_tar(&self, input: &mut dyn Read) -> Result<ManifestId, Error>;
    /// One image layer onto `base` (see [`crate::Store::apply_layer`]).
    fn apply_layer(
        &self,
        base: Option<&ManifestId>,
        compression: LayerCompression,
        digest: Option<&str>,
        input: &mut (dyn Read + Send),
    ) -> Result<ManifestId, Error>;
    /// Materializes a manifest as plain files at `dst` (absent).
    fn export_dir(&self, id: &ManifestId, dst: &Path) -> Result<(), Error>;
    /// A stream of `id` (see [`crate::Store::export_stream`]); with `only`, just those objects.
    fn export_stream(
        &self,
        id: &ManifestId,
        only: Option<&HashSet<ObjectId>>,
        out: &mut dyn Write,
    ) -> Result<(), Error>;
    /// Reads `count` streams written back to back (the input is consumed whole: a pipe cannot
    /// give back what was read past a stream's end).
    fn import_streams(&self, input: &mut dyn Read, count: usize) -> Result<Vec<ManifestId>, Error>;
    fn objects_of(&self, id: &ManifestId) -> Result<Vec<ObjectId>, Error>;
    /// The ones among `ids` the store does not hold.
    fn lacking(&self, ids: &[ObjectId]) -> Result<Vec<ObjectId>, Error>;
    /// Keeps `id` through gc until [`FsService::unpin`]; a remote pin also ends with its client.
    fn pin(&self, id: &ObjectId) -> Result<(), Error>;
    fn unpin(&self, id: &ObjectId);
    /// Collects what no ref, pin, live mount or `live` manifest reaches, sparing an import's
    /// manifest that no ref names yet for a grace (10 minutes; see `Store::set_fresh_grace`).
    fn gc(&self, live: &[ManifestId]) -> Result<GcReport, Error>;
    fn fsck(&self) -> Result<FsckReport, Error>;
    /// Mounts a view of `base` at `target` (see [`crate::NodeFs::mount`]).
    fn mount(
        &self,
        base: &ManifestId,
        target: &Path,
        opts: &MountOptions,
    ) -> Result<MountInfo, Error>;
    /// Commits a mount's current state as a manifest (pinned while the mount lives).
    fn commit(&self, mount: u64) -> Result<ManifestId, Error>;
    /// [`FsService::commit`] in two steps: the manifest of the mount now, not yet durable
    /// (what a snapshot takes while the sandbox is frozen), then [`FsService::seal_commit`],
    /// which must come before the id is recorded anywhere (see `Mount::commit_unsealed`).
    fn commit_unsealed(&self, mount: u64) -> Result<ManifestId, Error>;
    fn seal_commit(&self, mount: u64, id: &ManifestId) -> Result<(), Error>;
    fn usage(&self, mount: u64) -> Result<Usage, Error>;
    /// Unmounts and drops the upper layer. Idempotent for this server's own ids: one it no longer
    /// knows (unmounted already, or detached from outside and forgotten) is Ok. An id below the
    /// server's first one (a mount of a server before it; ids are never reused across servers)
    /// is `UnknownMount`, so the caller knows that kernel mount may still be there.
    fn unmount(&self, mount: u64) -> Result<(), Error>;
    /// Live mounts, after forgetting those that someone else unmounted.
    fn mounts(&self) -> Result<Vec<MountInfo>, Error>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn criu_pages_are_cut_per_page() {
        let p = ImportPolicy::CriuImages;
        assert_eq!(
            p.for_path(Path::new("pages-1.img")),
            ChunkPolicy::Fixed(4096)
        );
        assert_eq!(
            p.for_path(Path::new("sub/pages-12.img")),
            ChunkPolicy::Fixed(4096)
        );
        assert_eq!(p.for_path(Path::new("pagemap-1.img")), ChunkPolicy::Cdc);
        assert_eq!(
            ImportPolicy::Cdc.for_path(Path::new("pages-1.img")),
            ChunkPolicy::Cdc
        );
    }
}
