//! The host-facing parts the runtime drives, each behind a trait: cgroups (`CgroupBackend`), the
//! per-sandbox network, the start of pid 1, the talk to an init that create and recovery need
//! (ping, hostname) and the tmpfs holding the init copy. `Runtime::new` builds the real ones
//! (`HostParts::detect`); `Runtime::with_parts` takes any, so the lifecycle (create and its undo,
//! destroy, park and resume, recovery after a restart) is tested without root against recording
//! fakes (`crate::testing`). What stays real everywhere: the run dir and its records, the init
//! processes' pidfds and their reaping, the instance lock, admission.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::cgroup::{self, CgroupBackend};
use crate::client::{self, ClientError};
use crate::config::RuntimeConfig;
use crate::error::Error;
use crate::hostname::HostnameError;
use crate::init_handle::InitHandle;
use crate::network::{NetError, NetLease, Network};
use crate::proto::SetupConfig;
use crate::spawner::{self, SpawnError};
use crate::types::{EgressRule, PortMapping, SandboxId};
use crate::userns::IdRange;

/// What `Runtime::with_parts` runs the host with.
pub(crate) struct HostParts {
    pub cgroups: Arc<dyn CgroupBackend>,
    pub net: Arc<dyn SandboxNet>,
    pub spawner: Arc<dyn Spawner>,
    pub inits: Arc<dyn InitControl>,
    pub init_store: Arc<dyn InitStore>,
}

impl HostParts {
    /// The real parts for `config` (nothing is made yet: `with_parts` prepares them).
    pub fn detect(config: &RuntimeConfig) -> Result<HostParts, Error> {
        let table = config.cgroup_root.replace('-', "_");
        let net = Network::new(&table, &config.net_pool)
            .map_err(|e| Error::invalid("net_pool", e.to_string()))?;
        Ok(HostParts {
            cgroups: cgroup::detect(&config.cgroup_root),
            net: Arc::new(net),
            spawner: Arc::new(CloneSpawner),
            inits: Arc::new(InitSocket),
            init_store: Arc::new(InitTmpfs),
        })
    }
}

/// A sandbox's network on the host (see `network`): its link, addresses and rules.
pub(crate) trait SandboxNet: Send + Sync {
    /// The nft table of this instance (links carry it as their alias).
    fn table(&self) -> &str;
    /// Whether `ports` could be published now; nothing is taken.
    fn check_ports(&self, ports: &[PortMapping]) -> Result<(), Error>;
    /// Wires an egress sandboxes whose init has host pid `pid`; undone by `teardown`.
    fn setup(
        &self,
        id: &SandboxId,
        pid: i32,
        allow: &[EgressRule],
        ports: &[PortMapping],
    ) -> Result<NetLease, NetError>;
    fn teardown(&self, lease: &NetLease) -> Result<(), NetError>;
    /// At start-up: exactly the rules of the adopted leases.
    fn restore(&self, adopted: &[(NetLease, Vec<EgressRule>)]) -> Result<(), NetError>;
    /// Chains of our table (None: no table), for residue.
    fn table_chains(&self) -> Option<Vec<String>>;
    fn has_leases(&self) -> bool;
    /// (rx, tx) bytes as the sandbox sees them.
    fn counters(&self, lease: &NetLease) -> (u64, u64);
    /// Whether the host end `host_if` of a sandbox's veth exists.
    fn link_exists(&self, host_if: &str) -> bool;
    /// Deletes the host link `host_if` a previous run left (best effort).
    fn remove_link(&self, host_if: &str);
}

impl SandboxNet for Network {
    fn table(&self) -> &str {
        Network::table(self)
    }
    fn check_ports(&self, ports: &[PortMapping]) -> Result<(), Error> {
        Network::check_ports(self, ports)
    }
    fn setup(
        &self,
        id: &SandboxId,
        pid: i32,
        allow: &[EgressRule],
        ports: &[PortMapping],
    ) -> Result<NetLease, NetError> {
        Network::setup(self, id, pid, allow, ports)
    }
    fn teardown(&self, lease: &NetLease) -> Result<(), NetError> {
        Network::teardown(self, lease)
    }
    fn restore(&self, adopted: &[(NetLease, Vec<EgressRule>)]) -> Result<(), NetError> {
        Network::restore(self, adopted)
    }
    fn table_chains(&self) -> Option<Vec<String>> {
        Network::table_chains(self)
    }
    fn has_leases(&self) -> bool {
        Network::has_leases(self)
    }
    fn counters(&self, lease: &NetLease) -> (u64, u64) {
        crate::network::counters(lease)
    }
    fn link_exists(&self, host_if: &str) -> bool {
        crate::network::link_exists(host_if)
    }
    fn remove_link(&self, host_if: &str) {
        crate::network::remove_link(host_if)
    }
}

/// Starts a sandbox's pid 1 (see `spawner::spawn_init`): its host pid once it is ready, our
/// child; on `SpawnError::Failed` it was killed but not reaped.
pub(crate) trait Spawner: Send + Sync {
    fn spawn_init(
        &self,
        init_binary: &Path,
        cfg: &SetupConfig,
        instance: &str,
        sandbox: &str,
        ids: Option<IdRange>,
    ) -> Result<i32, SpawnError>;
}

/// pid 1 cloned straight into its namespaces.
pub(crate) struct CloneSpawner;

impl Spawner for CloneSpawner {
    fn spawn_init(
        &self,
        init_binary: &Path,
        cfg: &SetupConfig,
        instance: &str,
        sandbox: &str,
        ids: Option<IdRange>,
    ) -> Result<i32, SpawnError> {
        spawner::spawn_init(init_binary, cfg, instance, sandbox, ids)
    }
}

/// What create, a pool's hand-over and recovery ask of an init they hold, beyond its pidfd.
pub(crate) trait InitControl: Send + Sync {
    /// Whether it answers on its control socket within `timeout`.
    fn ping(&self, init: &InitHandle, timeout: Duration) -> Result<(), ClientError>;
    /// Sets the hostname of its UTS namespace (a restored or pooled tree gets the new one).
    fn set_hostname(&self, init: &InitHandle, hostname: &str) -> Result<(), HostnameError>;
}

/// Over init's control socket and its namespaces.
pub(crate) struct InitSocket;

impl InitControl for InitSocket {
    fn ping(&self, init: &InitHandle, timeout: Duration) -> Result<(), ClientError> {
        client::ping_within(init, timeout)
    }
    fn set_hostname(&self, init: &InitHandle, hostname: &str) -> Result<(), HostnameError> {
        crate::hostname::set_hostname(init, hostname)
    }
}

/// Where the runtime keeps its own copy of grove-init (see `init_copy`).
pub(crate) trait InitStore: Send + Sync {
    /// Puts `binary` in place under `run_dir` (kept if the same); returns the copy's path.
    fn install(&self, run_dir: &Path, binary: &Path) -> std::io::Result<PathBuf>;
    /// Removes the copy (at shutdown, once no sandbox is left).
    fn remove(&self, run_dir: &Path);
}

/// On a tmpfs of its own.
pub(crate) struct InitTmpfs;

impl InitStore for InitTmpfs {
    fn install(&self, run_dir: &Path, binary: &Path) -> std::io::Result<PathBuf> {
        crate::init_copy::install(run_dir, binary)
    }
    fn remove(&self, run_dir: &Path) {
        crate::init_copy::remove(run_dir)
    }
}
