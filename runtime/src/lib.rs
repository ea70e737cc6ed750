//! Grove sandboxes: namespaces, cgroups, seccomp, init, lifecycle, reclaim.
//!
//! The public API is described in RUNTIME-API.md; everything crossing it is re-exported here.

pub mod config;
pub mod error;
pub mod mounts;
pub mod root;
pub mod runtime;
pub mod types;

pub use config::RuntimeConfig;
pub use error::Error;
pub use root::{DiskQuota, DiskUsage, OverlayRoot, RootError, RootMount, RootProvider};
pub use runtime::{CheckpointView, ExternalMount, RestoreFn, RestoreTarget, Runtime};
pub use types::*;
