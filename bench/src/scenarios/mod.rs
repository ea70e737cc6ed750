//! The bench scenarios. Each takes the run context and returns its figures; a scenario that stops early
//! still returns what it measured, with the error set.

pub mod api;
pub mod checkpoint;
pub mod density;
pub mod e2b;
pub mod elastic;
pub mod filesystem;
pub mod fork_memory;
pub mod images;
pub mod images_build;
pub mod lifecycle;
pub mod rounds;
pub mod soak;
pub mod soak_full_disk;
pub mod storage;
mod userns_checkpoint;

use std::path::PathBuf;

use anyhow::Result;

use crate::report::ScenarioResult;

/// What every scenario gets.
pub struct Ctx {
    pub quick: bool,
    /// Report directory (plots go here).
    pub out: PathBuf,
    /// This run's scratch directory (fresh, removed at the end).
    pub work: PathBuf,
    /// Base image root.
    pub image: PathBuf,
    /// CRIU >= 4.1 (the private wrapper by default).
    pub criu: PathBuf,
    pub grove: crate::grove::GroveEnv,
    /// `--soak-cycles`: overrides the soak's cycle count.
    pub soak_cycles: Option<u64>,
    /// `--state-fs-mb`: the size of the full-disk soak's state filesystem.
    pub state_fs_mb: Option<u64>,
}

impl Ctx {
    /// `quick` or `full` by mode.
    pub fn pick<T>(&self, quick: T, full: T) -> T {
        if self.quick {
            quick
        } else {
            full
        }
    }
    /// A fresh directory under the scratch directory.
    pub fn fresh_dir(&self, name: &str) -> Result<PathBuf> {
        let d = tempfile::Builder::new()
            .prefix(&format!("{name}-"))
            .tempdir_in(&self.work)?;
        Ok(d.keep())
    }
}

/// A scenario: name, title, estimated seconds (quick, full), entry point.
pub struct Scenario {
    pub name: &'static str,
    pub title: &'static str,
    pub est_quick: f64,
    pub est_full: f64,
    /// Runs only when named with `--only` (long soaks).
    pub opt_in: bool,
    pub run: fn(&Ctx, &mut ScenarioResult) -> Result<()>,
}

pub fn all() -> Vec<Scenario> {
    vec![
        Scenario {
            name: lifecycle::NAME,
            title: "Lifecycle: create → exec `true` → destroy",
            est_quick: 30.0,
            opt_in: false,
            est_full: 200.0,
            run: lifecycle::run,
        },
        Scenario {
            name: checkpoint::NAME,
            title: "Checkpoint, restore and fork: python3 with a 256 MiB heap and a loopback HTTP server",
            est_quick: 25.0,
            opt_in: false,
            est_full: 300.0,
            run: checkpoint::run,
        },
        Scenario {
            name: rounds::NAME,
            title: "Rounds: snapshot → fork 4 → destroy, repeated on one sandbox",
            est_quick: 15.0,
            opt_in: false,
            est_full: 300.0,
            run: rounds::run,
        },
        Scenario {
            name: filesystem::NAME,
            title: "Filesystem: nodefs vs kernel overlayfs vs fuse-overlayfs vs the plain disk",
            est_quick: 20.0,
            opt_in: false,
            est_full: 420.0,
            run: filesystem::run,
        },
        Scenario {
            name: density::NAME,
            title: "Density: memory per idle sandbox",
            est_quick: 10.0,
            opt_in: false,
            est_full: 300.0,
            run: density::run,
        },
        Scenario {
            name: elastic::NAME,
            title: "Elasticity: warm-pool claims, a bursty trace under three pool policies, two jobs 3:1",
            est_quick: 45.0,
            est_full: 240.0,
            run: elastic::run,
            opt_in: false,
        },
        Scenario {
            name: storage::NAME,
            title: "Storage: dedup across imports, snapshot chains and fork trees",
            est_quick: 15.0,
            opt_in: false,
            est_full: 90.0,
            run: storage::run,
        },
        Scenario {
            name: api::NAME,
            title: "API: what groved's HTTP API adds over the runtime library",
            est_quick: 15.0,
            opt_in: false,
            est_full: 60.0,
            run: api::run,
        },
        // The build half of `images` (h8).
        Scenario {
            name: images_build::NAME,
            title: "Images, build: a 6-step Dockerfile cold and fully cached, grove build vs podman build",
            est_quick: 40.0,
            opt_in: false,
            est_full: 150.0,
            run: images_build::run,
        },
        Scenario {
            name: e2b::NAME,
            title: "E2B: the e2b SDK against Grove's own client on the same daemon",
            est_quick: 30.0,
            // Until the E2B control plane (create) is in every build, only when named.
            opt_in: true,
            est_full: 120.0,
            run: e2b::run,
        },
        Scenario {
            name: images::NAME,
            title: "Images: pull from a local registry, Grove vs skopeo vs podman",
            est_quick: 20.0,
            opt_in: false,
            est_full: 120.0,
            run: images::run,
        },
        Scenario {
            name: soak::NAME,
            title: "Soak: create → adversarial workload → destroy through groved's API; residue, RSS and fds",
            est_quick: 60.0,
            opt_in: true,
            est_full: 900.0,
            run: soak::run,
        },
        Scenario {
            name: soak_full_disk::NAME,
            title: "Full-disk soak: groved's state dir on a small filesystem that fills and empties",
            est_quick: 60.0,
            opt_in: true,
            est_full: 300.0,
            run: soak_full_disk::run,
        },
    ]
}
