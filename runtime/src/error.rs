//! The runtime's public error type. Each variant maps to an HTTP status in groved (see `code`).

use std::path::PathBuf;

use crate::root::RootError;
use crate::types::SandboxId;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("sandbox {id} not found")]
    NotFound { id: String },
    #[error("invalid {field}: {reason}")]
    InvalidSpec { field: String, reason: String },
    #[error("sandbox {id}: {reason}")]
    Conflict { id: SandboxId, reason: String },
    #[error("not enough {resource}: requested {requested}, available {available}")]
    CapacityExceeded {
        resource: String,
        requested: u64,
        available: u64,
    },
    #[error("image {image:?} not found")]
    ImageNotFound { image: String },
    #[error("path {path:?} resolves outside the sandbox")]
    PathOutsideSandbox { path: String },
    #[error("path {path:?} not found in the sandbox")]
    FileNotFound { path: String },
    #[error("not supported: {what}")]
    Unsupported { what: String },
    #[error("root filesystem")]
    Root(#[from] RootError),
    #[error("cgroup {path}")]
    Cgroup {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("network setup for {id}: {reason}")]
    Network { id: SandboxId, reason: String },
    #[error("sandbox init for {id}: {reason}")]
    Init { id: SandboxId, reason: String },
    #[error("restore of {id}")]
    Restore {
        id: SandboxId,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cleanup of {id} incomplete: {reason}")]
    Cleanup { id: SandboxId, reason: String },
    /// Something the request needs is down (the file server of a sandbox's root, grove-fsd): a
    /// retry may work once it is back.
    #[error("{what} is unavailable: {reason}")]
    Unavailable { what: String, reason: String },
    /// The node's disk lacks the free space a request needs (admission of a disk quota).
    #[error("not enough free disk for {field}: requested {requested_mb} MB, {available_mb} MB free for new sandboxes")]
    InsufficientStorage {
        field: String,
        requested_mb: u64,
        available_mb: u64,
    },
    /// Shell sessions (see runtime/src/runtime/sessions.rs).
    #[error("sandbox {id} has no session {name:?}")]
    SessionNotFound { id: SandboxId, name: String },
    #[error("sandbox {id}: {reason}")]
    SessionDead {
        id: SandboxId,
        name: String,
        reason: String,
    },
    #[error("sandbox {id}: {reason}")]
    SessionConflict {
        id: SandboxId,
        name: String,
        reason: String,
    },
    #[error("job {job} waited {waited_ms} ms in the create queue: {reason}")]
    QueueTimeout {
        job: String,
        waited_ms: u64,
        reason: String,
        /// When a retry might get in, estimated from the queue and the recent admission rate.
        retry_after_secs: u64,
    },
}

impl Error {
    /// The spec field at fault, for InvalidSpec.
    pub fn field(&self) -> Option<&str> {
        match self {
            Error::InvalidSpec { field, .. } | Error::InsufficientStorage { field, .. } => {
                Some(field)
            }
            _ => None,
        }
    }

    /// A stable machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            Error::NotFound { .. } => "not_found",
            Error::InvalidSpec { .. } => "invalid_spec",
            Error::Conflict { .. } => "conflict",
            Error::CapacityExceeded { .. } => "capacity_exceeded",
            Error::ImageNotFound { .. } => "image_not_found",
            Error::PathOutsideSandbox { .. } => "path_outside_sandbox",
            Error::FileNotFound { .. } => "file_not_found",
            Error::Unsupported { .. } => "unsupported",
            Error::Root(_) => "root",
            Error::Cgroup { .. } => "cgroup",
            Error::Network { .. } => "network",
            Error::Init { .. } => "init",
            Error::Restore { .. } => "restore",
            Error::Io { .. } => "io",
            Error::Cleanup { .. } => "cleanup",
            Error::Unavailable { .. } => "unavailable",
            Error::InsufficientStorage { .. } => "insufficient_storage",
            Error::SessionNotFound { .. } => "session_not_found",
            Error::SessionDead { .. } => "session_dead",
            Error::SessionConflict { .. } => "session_conflict",
            // The same condition as CapacityExceeded to a client, after waiting.
            Error::QueueTimeout { .. } => "capacity_exceeded",
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn invalid(field: &str, reason: impl Into<String>) -> Self {
        Error::InvalidSpec {
            field: field.into(),
            reason: reason.into(),
        }
    }
}
