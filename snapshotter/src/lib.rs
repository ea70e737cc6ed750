//! Grove snapshotter: CRIU checkpoint/restore of whole sandboxes into the content-addressed store.

pub mod criu;
