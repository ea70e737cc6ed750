//! The snapshotter's error type; `code` gives groved a stable machine-readable code.

use std::path::PathBuf;

use crate::criu;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("snapshot {snapshot:?} not found")]
    NotFound { snapshot: String },
    /// The sandbox is in a state that cannot be snapshotted right now.
    #[error("sandbox {sandbox}: {reason}")]
    Conflict { sandbox: String, reason: String },
    #[error("snapshot name {name:?} is already used by {id}")]
    NameTaken { name: String, id: String },
    #[error("invalid {field}: {reason}")]
    InvalidInput { field: &'static str, reason: String },
    #[error("not supported: {what}")]
    Unsupported { what: String },
    /// A snapshot's images could not be stored (its background import failed). The import's
    /// error is kept whole, so a caller tells a full store from the rest by type, not by text.
    /// (Worded as when it was reported as `Unsupported`.)
    #[error("not supported: snapshot {snapshot}: its images could not be stored")]
    NotStored {
        snapshot: String,
        #[source]
        source: std::sync::Arc<Error>,
    },
    /// No worker runs to store snapshots' images (it could not be started).
    #[error("no import worker")]
    NoImportWorker,
    #[error("checkpoint/restore")]
    Criu(#[from] criu::Error),
    #[error("content store")]
    Store(#[from] nodefs::Error),
    /// The store could not commit the sandbox's root (`RootMount::committer`).
    #[error("content store")]
    Commit(#[source] grove_runtime::RootError),
    #[error("runtime")]
    Runtime(#[from] grove_runtime::Error),
    #[error("snapshot stream: {reason}")]
    BadStream { reason: String },
    #[error("snapshot record {path}: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// A stable code; HTTP mapping: not_found 404, conflict 409, invalid_input 400, others 500
    /// (runtime errors keep the runtime's own code).
    pub fn code(&self) -> &'static str {
        match self {
            Error::NotFound { .. } => "not_found",
            Error::Conflict { .. } | Error::NameTaken { .. } => "conflict",
            Error::InvalidInput { .. } => "invalid_input",
            Error::Unsupported { .. } | Error::NotStored { .. } | Error::NoImportWorker => {
                "unsupported"
            }
            Error::Criu(_) => "criu",
            Error::Store(_) | Error::Commit(_) => "store",
            Error::Runtime(e) => e.code(),
            Error::BadStream { .. } => "bad_stream",
            Error::Corrupt { .. } => "corrupt",
            Error::Io { .. } => "io",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes() {
        assert_eq!(
            Error::NotFound {
                snapshot: "x".into()
            }
            .code(),
            "not_found"
        );
        let c = Error::Conflict {
            sandbox: "sb-1".into(),
            reason: "exec in flight".into(),
        };
        assert_eq!(c.code(), "conflict");
        assert_eq!(c.to_string(), "sandbox sb-1: exec in flight");
        let r = Error::Runtime(grove_runtime::Error::NotFound { id: "sb-1".into() });
        assert_eq!(r.code(), "not_found");
    }
}
