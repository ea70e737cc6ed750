//! groved's configuration: `/etc/grove/groved.toml` overlaid with command-line flags.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use grove_runtime::{CapacityOverrides, JobPolicy, JobsConfig, Limits, PoolsConfig, RuntimeConfig};
use serde::Deserialize;

use crate::api_shapes::{LimitsRequest, PoolRequest, PoolsRequest};

pub const DEFAULT_CONFIG: &str = "/etc/grove/groved.toml";
pub const DEFAULT_STATE_DIR: &str = "/var/lib/grove";
pub const DEFAULT_RUN_DIR: &str = "/run/grove";
pub const DEFAULT_CRIU: &str = "/var/lib/grove/criu/criu";
/// How long a create waits for room on a full node (or in a full job) before 429.
pub const DEFAULT_QUEUE_TIMEOUT_MS: u64 = 10_000;
/// groved's own memory limit: its work is streamed and capped, so this bounds a leak or an
/// allocation a sandbox manages to drive, far below what the node holds.
pub const DEFAULT_DAEMON_MEMORY_MAX_MB: u64 = 2048;
/// grove-fsd's: the store's indexes and every FUSE session's tables (page cache is reclaimed
/// within the limit).
pub const DEFAULT_FSD_MEMORY_MAX_MB: u64 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing {path}")]
    Parse {
        path: PathBuf,
        #[source]
        source: toml::de::Error,
    },
    #[error("listen address {addr:?} is not host:port")]
    Listen { addr: String },
    #[error("TCP listeners need an API key: set api_key_file")]
    NoApiKey,
    #[error("api key file {path} is empty")]
    EmptyKey { path: PathBuf },
    #[error("root_provider {0:?} is not \"nodefs\" or \"overlay\"")]
    RootProvider(String),
    #[error(
        "grove-init not found (set GROVE_INIT_BINARY, init_binary, or install it next to groved)"
    )]
    NoInit,
    #[error("{field}: {why}")]
    Idle { field: &'static str, why: String },
    #[error("host_port_range: {0}")]
    PortRange(grove_runtime::PortRangeError),
    #[error("instance {0:?} must start with \"grove\" and be [A-Za-z0-9_-]")]
    Instance(String),
    #[error("default_ttl_secs: {0} is more than 10 years")]
    DefaultTtl(u64),
    #[error("peers[{index}].url {url:?}: {why}")]
    PeerUrl {
        index: usize,
        url: String,
        why: &'static str,
    },
}

/// `[[peers]]`: another groved this node pulls snapshots from, and the key it takes. Pulls from
/// anywhere else carry no key unless the request gives one.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerFile {
    /// `http://<ip>:<port>`, the peer's API.
    pub url: String,
    /// File holding the peer's bearer key.
    pub api_key_file: Option<PathBuf>,
}

/// A configured peer: where it is, and the key to send it.
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    pub api_key: Option<String>,
}

/// A peer's address from `http://<ip>:<port>` (a trailing `/` allowed, port 80 by default). An IP,
/// not a name: peers are known by address, and a name would make every pull wait on DNS.
pub fn peer_addr(url: &str) -> Result<SocketAddr, &'static str> {
    let uri: axum::http::Uri = url.parse().map_err(|_| "not a URL")?;
    if uri.scheme_str() != Some("http") {
        return Err("only http:// peers are supported");
    }
    let authority = uri.authority().ok_or("no host")?;
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let ip: std::net::IpAddr = host.parse().map_err(|_| "the host must be an IP address")?;
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err("give the peer's base URL, without a path");
    }
    Ok(SocketAddr::new(ip, authority.port_u16().unwrap_or(80)))
}

/// The file's shape; every key optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FileConfig {
    pub state_dir: Option<PathBuf>,
    pub run_dir: Option<PathBuf>,
    /// The API's unix socket (default `<run_dir>/groved.sock`).
    pub socket: Option<PathBuf>,
    /// TCP addresses (`host:port`) to serve on as well; needs `api_key_file`.
    pub listen: Vec<String>,
    pub api_key_file: Option<PathBuf>,
    /// TCP address (`host:port`) of the E2B-compatible endpoint; a non-loopback one needs
    /// `api_key_file`.
    pub e2b_listen: Option<String>,
    pub init_binary: Option<PathBuf>,
    pub criu: Option<PathBuf>,
    /// "nodefs" (default) or "overlay".
    pub root_provider: Option<String>,
    pub capacity: CapacityOverrides,
    pub defaults: LimitsRequest,
    /// Node labels reported by GET /v1/node.
    pub labels: BTreeMap<String, String>,
    pub reap_interval_ms: Option<u64>,
    /// Idle reclaim for sandboxes whose create request sets none (unset: never).
    pub idle_timeout_secs: Option<u64>,
    /// "pause" (default) or "destroy".
    pub on_idle: Option<String>,
    /// This daemon's name on the host (default: "grove" for /var/lib/grove, else derived from the
    /// state dir); the defaults of run_dir, cgroup_root (so the nft table) and net_pool derive
    /// from it, so two daemons never share them unless told to.
    pub instance: Option<String>,
    /// Address pool for egress sandboxes (CIDR; derived from the instance when unset).
    pub net_pool: Option<String>,
    /// Host id ranges for `userns` sandboxes: `{ first = N, ranges = M }` (M ranges of 65536 ids
    /// from host id N; derived from the instance when unset).
    pub userns_pool: Option<grove_runtime::userns::IdPool>,
    /// Cgroup directory name under each hierarchy (default: the instance); also names the nft table.
    pub cgroup_root: Option<String>,
    /// Host ports sandboxes may publish, "FIRST-LAST" (default "30000-32767").
    pub host_port_range: Option<String>,
    /// On SIGTERM, leave sandboxes running for the next groved to adopt (needs overlay roots).
    pub keep_sandboxes_on_stop: Option<bool>,
    /// Memory limit of groved's own cgroup in MiB (0: unlimited).
    pub daemon_memory_max_mb: Option<u64>,
    /// Memory limit of grove-fsd's own cgroup in MiB (0: unlimited).
    pub fsd_memory_max_mb: Option<u64>,
    /// How long creates wait when the node or their job is full (ms; 0 = fail at once).
    pub queue_timeout_ms: Option<u64>,
    /// `[jobs.<name>]`: share and quotas per job; `[jobs.default]` applies to every other job.
    pub jobs: BTreeMap<String, JobPolicy>,
    /// `[[pools]]`: warm pools (image, limits, mode, min, max).
    pub pools: Vec<PoolRequest>,
    /// How many of the most-requested other sizes get an automatic predictive pool.
    pub auto_pools: Option<u32>,
    /// Largest size of an automatic pool.
    pub auto_pool_max: Option<u32>,
    /// `[[peers]]`: the groveds whose snapshots this node pulls with a key.
    pub peers: Vec<PeerFile>,
    /// How often failed background imports of snapshot images are retried (s, default 30).
    pub import_retry_secs: Option<u64>,
    /// Fork branches share their clean pages through kernel samepage merging (default true).
    pub merge_fork_pages: Option<bool>,
    /// Turn on the cgroup2 superblock's `favordynmods` at start, so that moving a task into a
    /// cgroup (every restored task, every new sandbox's init) waits out no RCU grace period
    /// (default true; a host setting that Linux 6.18 keeps until reboot).
    pub favor_cgroup_moves: Option<bool>,
    /// Fork branches restore with CRIU lazy pages where the kernel can (default true;
    /// `GROVE_LAZY_PAGES=0` in groved's environment turns it off).
    pub lazy_pages: Option<bool>,
    /// Snapshots dump only the pages written since the sandbox's last snapshot, where the
    /// kernel can track them (default true; `GROVE_TRACK_DIRTY_PAGES=0` in groved's environment
    /// turns it off).
    pub track_dirty_pages: Option<bool>,
    /// The TTL of sandboxes created without `ttl_secs` (a crashed trainer does not leak them
    /// forever); unset or 0: no default, such sandboxes live until deleted.
    pub default_ttl_secs: Option<u64>,
    /// The build step cache keeps at most this many entries, the most recently used.
    pub build_cache_max_entries: Option<usize>,
    /// Build cache entries unused for longer than this (s) are pruned.
    pub build_cache_max_age_secs: Option<u64>,
    /// `[registries]`: where image pulls may go, mirrors, credentials.
    pub registries: crate::registry::RegistriesConfig,
}

/// Command-line overrides.
#[derive(Debug, Default, Clone, clap::Args)]
pub struct Overrides {
    /// Config file (default /etc/grove/groved.toml; a missing default file is fine).
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Unix socket of the API.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// TCP address to serve on as well (repeatable); needs --api-key-file.
    #[arg(long)]
    pub listen: Vec<String>,
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// TCP address of the E2B-compatible endpoint (HTTP/1.1 and h2c); off the loopback it
    /// needs --api-key-file.
    #[arg(long)]
    pub e2b_listen: Option<String>,
    /// "nodefs" or "overlay".
    #[arg(long)]
    pub root_provider: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RootKind {
    Nodefs,
    Overlay,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub state_dir: PathBuf,
    pub run_dir: PathBuf,
    pub socket: PathBuf,
    pub listen: Vec<SocketAddr>,
    pub api_key: Option<String>,
    /// The E2B-compatible endpoint's address, when it is served.
    pub e2b_listen: Option<SocketAddr>,
    pub init_binary: PathBuf,
    pub criu: Option<PathBuf>,
    pub root: RootKind,
    pub capacity: CapacityOverrides,
    pub defaults: Limits,
    pub labels: BTreeMap<String, String>,
    pub reap_interval: Duration,
    pub idle: Option<grove_runtime::IdlePolicy>,
    pub net_pool: Option<String>,
    pub userns_pool: Option<grove_runtime::userns::IdPool>,
    pub cgroup_root: String,
    pub host_port_range: grove_runtime::PortRange,
    /// SIGTERM leaves sandboxes running (a restart adopts them) instead of destroying them.
    pub keep_sandboxes_on_stop: bool,
    /// Memory limits of the daemons' own cgroups, MiB (0: unlimited).
    pub daemon_memory_max_mb: u64,
    pub fsd_memory_max_mb: u64,
    pub jobs: JobsConfig,
    pub pools: PoolsConfig,
    pub peers: Vec<Peer>,
    pub import_retry: Duration,
    pub merge_fork_pages: bool,
    pub favor_cgroup_moves: bool,
    pub lazy_pages: bool,
    pub track_dirty_pages: bool,
    /// See `FileConfig::default_ttl_secs` (0 is None here).
    pub default_ttl_secs: Option<u64>,
    /// What a prune of the build step cache keeps (after each build, and on request).
    pub build_cache: crate::build::cache::Policy,
    pub registries: std::sync::Arc<crate::registry::RegistriesConfig>,
}

impl Config {
    pub fn load(o: &Overrides) -> Result<Config, ConfigError> {
        let path = o
            .config
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG));
        let file = match std::fs::read_to_string(&path) {
            Ok(s) => toml::from_str(&s).map_err(|source| ConfigError::Parse {
                path: path.clone(),
                source,
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && o.config.is_none() => {
                FileConfig::default()
            }
            Err(source) => return Err(ConfigError::Read { path, source }),
        };
        Self::resolve(file, o)
    }

    pub fn resolve(f: FileConfig, o: &Overrides) -> Result<Config, ConfigError> {
        let state_dir = o
            .state_dir
            .clone()
            .or(f.state_dir)
            .unwrap_or_else(|| DEFAULT_STATE_DIR.into());
        let instance = f
            .instance
            .clone()
            .unwrap_or_else(|| grove_runtime::config::instance_for(&state_dir));
        // It names a directory under /run and cgroup dirs: no path tricks.
        if !instance.starts_with("grove")
            || !instance
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(ConfigError::Instance(instance));
        }
        let run_dir = o
            .run_dir
            .clone()
            .or(f.run_dir)
            .unwrap_or_else(|| grove_runtime::config::run_dir_for(&instance));
        let socket = o
            .socket
            .clone()
            .or(f.socket)
            .unwrap_or_else(|| run_dir.join("groved.sock"));
        let listen_src = if o.listen.is_empty() {
            f.listen
        } else {
            o.listen.clone()
        };
        let listen = listen_src
            .iter()
            .map(|a| {
                a.parse()
                    .map_err(|_| ConfigError::Listen { addr: a.clone() })
            })
            .collect::<Result<Vec<SocketAddr>, _>>()?;
        let api_key = read_key(o.api_key_file.clone().or(f.api_key_file))?;
        let peers = f
            .peers
            .into_iter()
            .enumerate()
            .map(|(index, p)| {
                let addr = peer_addr(&p.url).map_err(|why| ConfigError::PeerUrl {
                    index,
                    url: p.url.clone(),
                    why,
                })?;
                Ok(Peer {
                    addr,
                    api_key: read_key(p.api_key_file)?,
                })
            })
            .collect::<Result<Vec<Peer>, ConfigError>>()?;
        if !listen.is_empty() && api_key.is_none() {
            return Err(ConfigError::NoApiKey);
        }
        let e2b_listen = match o.e2b_listen.clone().or(f.e2b_listen) {
            None => None,
            Some(a) => {
                let addr: SocketAddr = a.parse().map_err(|_| ConfigError::Listen { addr: a })?;
                if !addr.ip().is_loopback() && api_key.is_none() {
                    return Err(ConfigError::NoApiKey);
                }
                Some(addr)
            }
        };
        let root = match o.root_provider.clone().or(f.root_provider).as_deref() {
            None | Some("nodefs") => RootKind::Nodefs,
            Some("overlay") => RootKind::Overlay,
            Some(other) => return Err(ConfigError::RootProvider(other.into())),
        };
        let keep_sandboxes_on_stop = f.keep_sandboxes_on_stop.unwrap_or(false);
        let default_ttl_secs = f.default_ttl_secs.filter(|t| *t > 0);
        if let Some(t) = default_ttl_secs.filter(|t| *t > grove_runtime::MAX_TTL_SECS) {
            return Err(ConfigError::DefaultTtl(t));
        }
        let init_binary = find_init(f.init_binary).ok_or(ConfigError::NoInit)?;
        let idle = crate::api_shapes::idle_from_wire(f.idle_timeout_secs, f.on_idle.as_deref())
            .map_err(|(field, why)| ConfigError::Idle { field, why })?;
        // The file's, else `$GROVE_CRIU`, else the set-up's private install where it exists
        // (else the snapshotter looks on PATH).
        let criu = f
            .criu
            .or_else(|| {
                std::env::var_os("GROVE_CRIU")
                    .filter(|p| !p.is_empty())
                    .map(PathBuf::from)
            })
            .or_else(|| Some(PathBuf::from(DEFAULT_CRIU)).filter(|p| p.exists()));
        let defaults = f.defaults.fill(&Limits::default());
        let mut jobs = JobsConfig {
            queue_timeout_ms: f.queue_timeout_ms.unwrap_or(DEFAULT_QUEUE_TIMEOUT_MS),
            ..JobsConfig::default()
        };
        for (name, policy) in f.jobs {
            if name == grove_runtime::jobs::DEFAULT_JOB {
                jobs.default = policy;
            } else {
                jobs.jobs.insert(name, policy);
            }
        }
        let pools = PoolsRequest {
            pools: f.pools,
            auto_sizes: f.auto_pools,
            auto_max: f.auto_pool_max,
            window_ms: None,
            half_life_ms: None,
            headroom: None,
        }
        .into_config(&defaults);
        Ok(Config {
            state_dir,
            run_dir,
            socket,
            listen,
            api_key,
            e2b_listen,
            init_binary,
            criu,
            root,
            capacity: f.capacity,
            defaults,
            labels: f.labels,
            reap_interval: Duration::from_millis(f.reap_interval_ms.unwrap_or(1000).max(50)),
            idle,
            net_pool: Some(
                f.net_pool
                    .unwrap_or_else(|| grove_runtime::config::pool_for(&instance)),
            ),
            userns_pool: f.userns_pool,
            cgroup_root: f.cgroup_root.unwrap_or(instance),
            host_port_range: match f.host_port_range {
                Some(r) => r.parse().map_err(ConfigError::PortRange)?,
                None => grove_runtime::PortRange::default(),
            },
            keep_sandboxes_on_stop,
            daemon_memory_max_mb: f
                .daemon_memory_max_mb
                .unwrap_or(DEFAULT_DAEMON_MEMORY_MAX_MB),
            fsd_memory_max_mb: f.fsd_memory_max_mb.unwrap_or(DEFAULT_FSD_MEMORY_MAX_MB),
            jobs,
            pools,
            peers,
            import_retry: Duration::from_secs(f.import_retry_secs.unwrap_or(30).max(1)),
            merge_fork_pages: f.merge_fork_pages.unwrap_or(true),
            favor_cgroup_moves: f.favor_cgroup_moves.unwrap_or(true),
            lazy_pages: f.lazy_pages.unwrap_or(true)
                && std::env::var("GROVE_LAZY_PAGES").as_deref() != Ok("0"),
            track_dirty_pages: f.track_dirty_pages.unwrap_or(true)
                && std::env::var("GROVE_TRACK_DIRTY_PAGES").as_deref() != Ok("0"),
            default_ttl_secs,
            build_cache: crate::build::cache::Policy {
                max_entries: f
                    .build_cache_max_entries
                    .unwrap_or(crate::build::cache::DEFAULT_MAX_ENTRIES),
                max_age_secs: f
                    .build_cache_max_age_secs
                    .unwrap_or(crate::build::cache::DEFAULT_MAX_AGE_SECS),
            },
            registries: std::sync::Arc::new(f.registries),
        })
    }

    /// The key to send the peer at `addr`: only a configured peer's own.
    pub fn peer_key(&self, addr: &SocketAddr) -> Option<&str> {
        self.peers
            .iter()
            .find(|p| p.addr == *addr)
            .and_then(|p| p.api_key.as_deref())
    }

    pub fn runtime_config(&self) -> RuntimeConfig {
        let mut rc = RuntimeConfig::default_paths();
        rc.state_dir = self.state_dir.clone();
        rc.run_dir = self.run_dir.clone();
        rc.init_binary = self.init_binary.clone();
        rc.cgroup_root = self.cgroup_root.clone();
        rc.capacity = self.capacity.clone();
        rc.defaults = self.defaults;
        rc.idle = self.idle;
        if let Some(p) = &self.net_pool {
            rc.net_pool = p.clone();
        }
        rc.userns_pool = self.userns_pool;
        rc.host_port_range = self.host_port_range;
        // A DNAT on one of our own ports would hand its traffic (bearer keys included) to a sandbox.
        rc.reserved_ports = self.listen.iter().map(|a| a.port()).collect();
        rc.reserved_ports.extend(self.e2b_listen.map(|a| a.port()));
        rc
    }
}

/// The trimmed contents of a key file, if one is named.
fn read_key(file: Option<PathBuf>) -> Result<Option<String>, ConfigError> {
    let Some(p) = file else { return Ok(None) };
    let k = std::fs::read_to_string(&p).map_err(|source| ConfigError::Read {
        path: p.clone(),
        source,
    })?;
    let k = k.trim().to_string();
    if k.is_empty() {
        return Err(ConfigError::EmptyKey { path: p });
    }
    Ok(Some(k))
}

/// `GROVE_INIT_BINARY`, then the config, then `grove-init` next to the running executable or where
/// `grove install` puts it (`<prefix>/libexec/grove/`).
fn find_init(configured: Option<PathBuf>) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("GROVE_INIT_BINARY").map(PathBuf::from) {
        return Some(p);
    }
    if configured.is_some() {
        return configured;
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [
        dir.join("grove-init"),
        dir.join("../grove-init"),
        dir.join("../libexec/grove/grove-init"),
    ]
    .into_iter()
    .find(|p| Path::new(p).exists())
}

#[cfg(test)]
#[path = "config_shipped_tests.rs"]
mod shipped_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_file_and_tcp_needs_a_key() {
        std::env::set_var("GROVE_INIT_BINARY", "/bin/true");
        let f: FileConfig =
            toml::from_str("state_dir = \"/a\"\nlisten = [\"127.0.0.1:7000\"]\n").unwrap();
        assert!(matches!(
            Config::resolve(f, &Overrides::default()),
            Err(ConfigError::NoApiKey)
        ));
        let f: FileConfig =
            toml::from_str("state_dir = \"/a\"\n[defaults]\nmemory_mb = 64\n").unwrap();
        let o = Overrides {
            run_dir: Some("/r".into()),
            ..Default::default()
        };
        let c = Config::resolve(f, &o).unwrap();
        assert_eq!(c.state_dir, PathBuf::from("/a"));
        assert_eq!(c.socket, PathBuf::from("/r/groved.sock"));
        assert_eq!(c.defaults.memory_mb, 64);
        assert!(toml::from_str::<FileConfig>("bogus = 1").is_err());
    }

    #[test]
    fn names_derive_from_the_instance_and_listeners_are_reserved() {
        std::env::set_var("GROVE_INIT_BINARY", "/bin/true");
        let c = Config::resolve(FileConfig::default(), &Overrides::default()).unwrap();
        assert_eq!(c.run_dir, PathBuf::from("/run/grove"));
        assert_eq!(c.cgroup_root, "grove");
        assert_eq!(c.runtime_config().net_pool, "10.200.0.0/16");
        // Another state dir: names of its own.
        let f: FileConfig = toml::from_str("state_dir = \"/srv/b\"\n").unwrap();
        let b = Config::resolve(f, &Overrides::default()).unwrap();
        assert_ne!(b.cgroup_root, "grove");
        assert!(b.cgroup_root.starts_with("grove-"));
        assert_eq!(b.run_dir, PathBuf::from("/run").join(&b.cgroup_root));
        assert_ne!(b.runtime_config().net_pool, "10.200.0.0/16");
        let f: FileConfig =
            toml::from_str("instance = \"grove-x\"\nhost_port_range = \"40000-40100\"\n").unwrap();
        let x = Config::resolve(f, &Overrides::default()).unwrap();
        assert_eq!(
            (x.cgroup_root.as_str(), x.run_dir.as_path()),
            ("grove-x", Path::new("/run/grove-x"))
        );
        assert_eq!(
            x.runtime_config().host_port_range.to_string(),
            "40000-40100"
        );
        let f: FileConfig = toml::from_str("instance = \"grove/../x\"\n").unwrap();
        assert!(matches!(
            Config::resolve(f, &Overrides::default()),
            Err(ConfigError::Instance(_))
        ));
        let f: FileConfig = toml::from_str("host_port_range = \"9-1\"\n").unwrap();
        assert!(matches!(
            Config::resolve(f, &Overrides::default()),
            Err(ConfigError::PortRange(_))
        ));
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key");
        std::fs::write(&key, "k").unwrap();
        let f: FileConfig = toml::from_str(&format!(
            "listen = [\"127.0.0.1:18090\"]\napi_key_file = \"{}\"\n",
            key.display()
        ))
        .unwrap();
        let l = Config::resolve(f, &Overrides::default()).unwrap();
        assert_eq!(l.runtime_config().reserved_ports, vec![18090]);
    }

    #[test]
    fn peers_are_known_by_address_and_only_they_get_a_key() {
        std::env::set_var("GROVE_INIT_BINARY", "/bin/true");
        let tmp = tempfile::tempdir().unwrap();
        let key = tmp.path().join("peer.key");
        std::fs::write(&key, "s3cret\n").unwrap();
        let f: FileConfig = toml::from_str(&format!(
            "[[peers]]\nurl = \"http://10.0.0.2:7070/\"\napi_key_file = \"{}\"\n",
            key.display()
        ))
        .unwrap();
        let c = Config::resolve(f, &Overrides::default()).unwrap();
        assert_eq!(
            c.peer_key(&"10.0.0.2:7070".parse().unwrap()),
            Some("s3cret")
        );
        assert_eq!(c.peer_key(&"10.0.0.2:7071".parse().unwrap()), None);
        assert_eq!(c.peer_key(&"10.0.0.3:7070".parse().unwrap()), None);
        assert_eq!(
            peer_addr("http://[::1]").unwrap(),
            "[::1]:80".parse().unwrap()
        );
        for bad in [
            "https://10.0.0.2:1",
            "http://peer.example:1",
            "http://10.0.0.2:1/v1",
            "x",
        ] {
            assert!(peer_addr(bad).is_err(), "{bad}");
        }
        let f: FileConfig = toml::from_str("[[peers]]\nurl = \"http://name:1\"\n").unwrap();
        assert!(matches!(
            Config::resolve(f, &Overrides::default()),
            Err(ConfigError::PeerUrl { index: 0, .. })
        ));
    }

    #[test]
    fn sandboxes_may_be_kept_across_a_stop_with_either_root() {
        std::env::set_var("GROVE_INIT_BINARY", "/bin/true");
        let keep = "keep_sandboxes_on_stop = true\n";
        for root in [
            "",
            "root_provider = \"overlay\"\n",
            "root_provider = \"nodefs\"\n",
        ] {
            let f: FileConfig = toml::from_str(&format!("{keep}{root}")).unwrap();
            let c = Config::resolve(f, &Overrides::default()).unwrap();
            assert!(c.keep_sandboxes_on_stop, "{root}");
        }
        let f: FileConfig = toml::from_str("").unwrap();
        assert!(
            !Config::resolve(f, &Overrides::default())
                .unwrap()
                .keep_sandboxes_on_stop
        );
    }
}
