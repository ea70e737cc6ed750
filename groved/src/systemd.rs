//! Running under systemd without libsystemd: readiness and watchdog notifications (datagrams to
//! `$NOTIFY_SOCKET`), and the daemon's own leaf cgroup under `Delegate=yes` on cgroup v2.

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum SystemdError {
    #[error("NOTIFY_SOCKET {0:?} is not a socket path or @abstract name")]
    BadSocket(String),
    #[error("sending {state:?} to {socket}")]
    Send {
        state: String,
        socket: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{op} {}", path.display())]
    Cgroup {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Sends `state` (e.g. "READY=1") to the service manager. Returns false when not run by one
/// (no `$NOTIFY_SOCKET`), so callers need not care whether systemd is there.
pub fn notify(state: &str) -> Result<bool, SystemdError> {
    let Some(socket) = std::env::var_os("NOTIFY_SOCKET") else {
        return Ok(false);
    };
    let socket = socket.to_string_lossy().into_owned();
    let send_err = |source| SystemdError::Send {
        state: state.into(),
        socket: socket.clone(),
        source,
    };
    let sock = UnixDatagram::unbound().map_err(send_err)?;
    if let Some(name) = socket.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt as _;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(send_err)?;
        sock.send_to_addr(state.as_bytes(), &addr)
            .map_err(send_err)?;
    } else if socket.starts_with('/') {
        sock.send_to(state.as_bytes(), &socket).map_err(send_err)?;
    } else {
        return Err(SystemdError::BadSocket(socket));
    }
    Ok(true)
}

/// Logs instead of failing: a lost notification must not take the daemon down.
pub fn notify_or_log(state: &str) {
    if let Err(e) = notify(state) {
        tracing::warn!("sd_notify: {e}");
    }
}

/// How often to ping the watchdog: half of `WatchdogSec` when it is meant for this process.
pub fn watchdog_interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID") {
        if pid.parse::<u32>().ok()? != std::process::id() {
            return None;
        }
    }
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}

/// The name of the daemon's own leaf cgroup inside its (delegated) service cgroup.
pub const LEAF: &str = "groved";

/// Under `Delegate=yes` on a pure cgroup v2 host, moves the daemon into `<its cgroup>/groved` so the
/// service cgroup holds no processes itself and may have child cgroups beside it (v2's "no internal
/// processes" rule). Returns the leaf it moved into; None where it does not apply: not started by
/// systemd (`$INVOCATION_ID` unset), cgroup v1/hybrid hosts (limits live in the v1 hierarchies
/// there, outside the service's tree), or already in a leaf named `groved`.
pub fn enter_leaf_cgroup() -> Result<Option<PathBuf>, SystemdError> {
    let mount = Path::new("/sys/fs/cgroup");
    if std::env::var_os("INVOCATION_ID").is_none() || !mount.join("cgroup.controllers").exists() {
        return Ok(None);
    }
    let own = "/proc/self/cgroup";
    let text = std::fs::read_to_string(own).map_err(|source| SystemdError::Cgroup {
        op: "reading",
        path: own.into(),
        source,
    })?;
    let Some(rel) = v2_path(&text) else {
        return Ok(None);
    };
    if rel == "/" || rel.rsplit('/').next() == Some(LEAF) {
        return Ok(None);
    }
    let leaf = mount.join(rel.trim_start_matches('/')).join(LEAF);
    match std::fs::create_dir(&leaf) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(source) => {
            return Err(SystemdError::Cgroup {
                op: "creating",
                path: leaf,
                source,
            })
        }
    }
    let procs = leaf.join("cgroup.procs");
    std::fs::write(&procs, std::process::id().to_string()).map_err(|source| {
        SystemdError::Cgroup {
            op: "joining",
            path: procs,
            source,
        }
    })?;
    Ok(Some(leaf))
}

/// The cgroup v2 path (`0::/...`) in a `/proc/<pid>/cgroup` text.
fn v2_path(text: &str) -> Option<&str> {
    text.lines().find_map(|l| l.strip_prefix("0::"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notify_reaches_a_path_and_an_abstract_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let rx = UnixDatagram::bind(&path).unwrap();
        let abs = format!("grove-notify-test-{}", std::process::id());
        use std::os::linux::net::SocketAddrExt as _;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(abs.as_bytes()).unwrap();
        let rx_abs = UnixDatagram::bind_addr(&addr).unwrap();
        let mut buf = [0u8; 64];

        std::env::set_var("NOTIFY_SOCKET", &path);
        assert!(notify("READY=1").unwrap());
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");

        std::env::set_var("NOTIFY_SOCKET", format!("@{abs}"));
        assert!(notify("WATCHDOG=1").unwrap());
        let n = rx_abs.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"WATCHDOG=1");

        std::env::set_var("NOTIFY_SOCKET", "relative");
        assert!(matches!(notify("READY=1"), Err(SystemdError::BadSocket(_))));
        std::env::remove_var("NOTIFY_SOCKET");
        assert!(!notify("READY=1").unwrap());

        std::env::set_var("WATCHDOG_USEC", "4000000");
        std::env::set_var("WATCHDOG_PID", std::process::id().to_string());
        assert_eq!(watchdog_interval(), Some(Duration::from_secs(2)));
        std::env::set_var("WATCHDOG_PID", "1");
        assert_eq!(watchdog_interval(), None);
        std::env::remove_var("WATCHDOG_USEC");
        std::env::remove_var("WATCHDOG_PID");
    }

    #[test]
    fn v2_path_is_the_0_line() {
        let t = "4:memory:/x\n0::/system.slice/groved.service\n";
        assert_eq!(v2_path(t), Some("/system.slice/groved.service"));
        assert_eq!(v2_path("4:memory:/x\n"), None);
    }
}
