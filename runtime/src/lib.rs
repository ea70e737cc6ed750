//! Grove sandboxes: namespaces, cgroups, seccomp, init, lifecycle, reclaim.
//!
//! Everything crossing the public API is re-exported here; groved's HTTP API over it is in
//! groved/openapi.yaml and docs/api.md.

mod admission;
pub mod cgroup;
mod client;
pub mod config;
pub mod criu_leftovers;
pub mod error;
pub mod files;
mod host;
pub mod host_mem;
mod hostname;
mod idle;
pub mod init;
mod init_copy;
mod init_handle;
mod init_watch;
pub mod jobs;
pub mod live;
pub mod mounts;
mod network;
mod park;
pub mod pool;
pub mod proto;
mod record;
mod recover;
pub mod registry;
mod residue;
pub mod root;
pub mod runtime;
mod sandbox;
pub mod spawner;
mod sys;
#[cfg(test)]
mod testing;
pub mod types;
pub mod userns;
mod validate;

pub use client::ExecCancel;
pub use config::{PortRange, PortRangeError, RuntimeConfig};
pub use error::Error;
/// Paths resolved inside a root directory (a sandbox's, or a build's tree).
pub use files::Root as ConfinedRoot;
pub use jobs::{JobPolicy, JobStatus, JobsConfig};
pub use pool::{PoolMode, PoolSpec, PoolStatus, PoolsConfig};
pub use registry::{SlotState, Transition, TransitionError};
pub use root::{CommitRoot, DiskQuota, DiskUsage, OverlayRoot, RootError, RootMount, RootProvider};
pub use runtime::sessions::{SessionCreate, SessionInfo, SessionRun, SessionRunResult};
pub use runtime::{CheckpointView, ExternalMount, RestoreFn, RestoreTarget, Runtime};
/// Wall-clock milliseconds since the epoch (0 before it), as records and events carry them.
pub use sandbox::now_ms;
pub use types::*;
pub use validate::{ttl as check_ttl, MAX_TTL_SECS, MIN_CPU_MILLIS};
