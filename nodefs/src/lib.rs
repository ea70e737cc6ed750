//! nodefs: a content-addressed copy-on-write filesystem over FUSE.
//!
//! [`Store`] holds file content as blake3-addressed, zstd-compressed chunks in append-only
//! packs, and directory trees as Merkle objects; a manifest is the id of a root tree.
//! [`NodeFs`] serves writable copy-on-write views of manifests over FUSE; [`Mount::commit`]
//! turns a view back into a manifest.

mod cache;
mod chunk_writer;
mod chunker;
mod error;
mod export;
mod fs;
mod id;
mod import;
mod layer;
mod oci;
mod pack;
mod pages;
mod readahead;
pub mod service;
mod store;
mod stream;
mod sys;
mod tarimport;
mod tree;

/// CPUs to use for parallel work, looked up once (the std call reads cgroup files).
pub(crate) fn cpus() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
    })
}

pub use chunker::ChunkPolicy;
pub use error::{chain, first_errno, Error, StoreError};
pub use fs::{IdShift, Mount, MountOptions, NodeFs, RingError, ServerOptions, Transport, Usage};
pub use id::{ManifestId, ObjectId, ParseIdError};
pub use layer::LayerCompression;
pub use store::{FsckReport, GcReport, Store, StoreStats};
pub use stream::StreamStats;
pub use tree::{ChunkRef, Entry, Meta, Node, Tree};
