//! Grove snapshotter: CRIU checkpoint/restore of whole sandboxes into the content-addressed
//! store, forks of snapshots into independent branches, and snapshot transfer between nodes.

mod cgroups;
pub mod criu;
mod dirty;
mod durable;
mod eager;
mod error;
pub mod images;
pub mod ksm;
mod lazy;
mod netns;
mod pagemap;
mod pause;
mod plan;
mod record;
mod snapshotter;
mod sys;
mod transfer;
mod userns_images;

pub use error::Error;
pub use pause::PauseTiming;
pub use record::{MemoryDump, SnapshotInfo};
pub use snapshotter::{ForkOptions, SnapshotOptions, Snapshotter, SnapshotterConfig, MAX_FORK};
