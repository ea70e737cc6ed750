//! Error types of the store and the filesystem.

use std::io;
use std::path::PathBuf;

use crate::id::ObjectId;

/// Errors from the content store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store I/O on {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("object {id} is missing from the store")]
    Missing { id: ObjectId },
    #[error("object {id} is corrupt: {why}")]
    Corrupt { id: ObjectId, why: String },
    #[error("pack {path} is corrupt at offset {offset}: {why}")]
    CorruptPack {
        path: PathBuf,
        offset: u64,
        why: String,
    },
    /// `path` is the store's `FORMAT` file; `version` what it holds.
    #[error(
        "store format file {path} holds {version:?}, not \"nodefs-store 1\\n\": a store of another \
         format version, or a damaged file"
    )]
    Version { path: PathBuf, version: String },
}

/// Errors from nodefs operations (import, export, refs, mounts).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("I/O on {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("malformed tar entry {entry:?}: {why}")]
    BadTar { entry: String, why: String },
    #[error("malformed OCI layout at {path}: {why}")]
    BadOci { path: PathBuf, why: String },
    /// An image layer blob that is not what its digest says, or not a valid layer.
    #[error("layer {digest}: {why}")]
    BadLayer { digest: String, why: String },
    #[error("invalid ref name {0:?}")]
    BadRefName(String),
    #[error("no ref or manifest named {0:?}")]
    UnknownRef(String),
    #[error("manifest {0} is not in the store")]
    UnknownManifest(ObjectId),
    #[error("mount at {path}")]
    Mount {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("mount at {0} is unmounted")]
    Unmounted(PathBuf),
    #[error("malformed stream: {0}")]
    BadStream(String),
    #[error("no live mount {0}")]
    UnknownMount(u64),
    /// From `grove-fsd`: it failed in a way with no variant above. `message` holds its whole
    /// error chain; `errno` the first OS error code in it, so that a full disk or a gone FUSE
    /// server reads the same as from the in-process store.
    #[error("grove-fsd: {message}")]
    Fsd { message: String, errno: Option<i32> },
    /// `grove-fsd` cannot be reached or its answer is broken (it died, or is restarting): a
    /// dependency that is down, not an answer about the request.
    #[error("grove-fsd unreachable: {0}")]
    Unreachable(String),
}

/// Attach a path to an io::Error.
pub(crate) fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { path, source }
}

impl Error {
    /// A grove-fsd failure of its own (the protocol, not the store): no OS error code.
    pub(crate) fn fsd(message: impl Into<String>) -> Error {
        Error::Fsd {
            message: message.into(),
            errno: None,
        }
    }
}

/// Attach a path to an io::Error for the store.
pub(crate) fn store_io(path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> StoreError {
    let path = path.into();
    move |source| StoreError::Io { path, source }
}

/// The first OS error code in `e`'s chain, if any.
pub fn first_errno(e: &(dyn std::error::Error + 'static)) -> Option<i32> {
    let mut cur = Some(e);
    while let Some(c) = cur {
        if let Some(n) = c
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.raw_os_error())
        {
            return Some(n);
        }
        if let Some(n) = c.downcast_ref::<nix::errno::Errno>() {
            return Some(*n as i32);
        }
        cur = c.source();
    }
    None
}

/// Renders an error and its chain of causes on one line (the messages here never repeat their
/// source's, so each cause appears once).
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
