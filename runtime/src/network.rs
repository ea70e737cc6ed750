//! Sandbox networking. `none`: the sandbox's own netns with only `lo` (made by init, no work here).
//! `egress`: a veth pair (host end `grove<10 hex of the id>`, sandbox end `eth0`), a /30 from the
//! pool, and nftables rules in the runtime's own table: per sandbox a chain accepting only the
//! allowlisted destinations, masquerade out, published ports by DNAT. Done with the `ip` and `nft`
//! commands (off the hot path of `none`).
//!
//! What an allowlist can never open: the host itself (the input hook drops everything from a
//! sandbox link but replies), and other sandboxes — the forward hook first runs the *receiver's*
//! chain (which only `return`s for replies and DNATed connections, else drops), and drops a
//! sender's traffic to the pool unless DNATed; an `accept` in the sender's chain comes after both.
//! Published ports (DNAT from a host address) are the only way in. A published host port is held
//! by a bound socket for the lease's lifetime, so no host service (another groved included) can
//! take it later, and it is refused when something has it already.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::process::{Command, Stdio};

use nix::sys::socket::{bind, socket, AddressFamily, SockFlag, SockType, SockaddrIn};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::types::{EgressRule, PortMapping, SandboxId};
use crate::validate;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NetLease {
    pub index: u32,
    pub host_if: String,
    pub host_addr: Ipv4Addr,
    pub sandbox_addr: Ipv4Addr,
    pub chain: String,
    pub ports: Vec<PortMapping>,
}

pub struct Network {
    table: String,
    pool: (Ipv4Addr, u8),
    /// `net.ipv4.ip_nonlocal_bind` was set at start: a bind cannot tell a host address then.
    nonlocal_bind: bool,
    state: Mutex<NetState>,
}

#[derive(Default)]
struct NetState {
    used: HashSet<u32>,
    leases: usize,
    /// Published host ports, each held by a bound (not listening) socket.
    held: HashMap<u16, OwnedFd>,
}

/// Why a sandbox's network could not be set up, torn down or restored.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// A published port that cannot be had: the client's to fix (a 4xx naming the field).
    #[error("{0}")]
    Port(Error),
    /// The address pool of the config is not a usable CIDR.
    #[error("{0}")]
    BadPool(Error),
    #[error("address pool /{0} is too small")]
    PoolTooSmall(u8),
    #[error("address pool exhausted")]
    PoolExhausted,
    #[error("enable ip_forward: {0}")]
    IpForward(std::io::Error),
    /// A command (`ip`, `nsenter`, `nft`) could not be started or waited for.
    #[error("{cmd}: {error}")]
    Run { cmd: String, error: std::io::Error },
    /// A command ran and failed; `stderr` is what it said.
    #[error("{program:?} failed: {stderr}")]
    Failed { program: String, stderr: String },
    /// Each step of a teardown that failed (the others were still done).
    #[error("{}", join(.0))]
    Teardown(Vec<NetError>),
}

fn join(errors: &[NetError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

impl NetError {
    pub(crate) fn into_error(self, id: &SandboxId) -> Error {
        match self {
            NetError::Port(e) => e,
            e => Error::Network {
                id: id.clone(),
                reason: e.to_string(),
            },
        }
    }
}

/// A TCP socket bound to `addr:port` with no SO_REUSEADDR: while it lives, every other bind of that
/// port (with or without SO_REUSEADDR) fails, and it fails itself when anything holds the port.
fn bind_tcp(addr: Ipv4Addr, port: u16) -> nix::Result<OwnedFd> {
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    bind(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrIn::from(std::net::SocketAddrV4::new(addr, port)),
    )?;
    Ok(fd)
}

/// Whether `addr` is one of the host's own addresses (binding to it works).
fn is_host_address(addr: Ipv4Addr) -> bool {
    bind_tcp(addr, 0).is_ok()
}

/// Host-end interface name of a sandbox's veth (15 chars, the kernel maximum).
pub fn host_if(id: &SandboxId) -> String {
    format!("grove{}", &id.short()[..10])
}

fn run(cmd: &mut Command, input: Option<&str>) -> Result<(), NetError> {
    cmd.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    let failed = |cmd: &Command, error| NetError::Run {
        cmd: format!("{cmd:?}"),
        error,
    };
    let mut child = cmd.spawn().map_err(|e| failed(cmd, e))?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        let _ = stdin.write_all(text.as_bytes());
    }
    let out = child.wait_with_output().map_err(|e| failed(cmd, e))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NetError::Failed {
            program: cmd.get_program().to_string_lossy().into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

fn nft(script: &str) -> Result<(), NetError> {
    run(Command::new("nft").arg("-f").arg("-"), Some(script))
}

impl Network {
    pub fn new(table: &str, pool: &str) -> Result<Network, NetError> {
        let pool = validate::cidr(pool).map_err(NetError::BadPool)?;
        if pool.1 > 28 {
            return Err(NetError::PoolTooSmall(pool.1));
        }
        let nonlocal_bind = std::fs::read_to_string("/proc/sys/net/ipv4/ip_nonlocal_bind")
            .is_ok_and(|v| v.trim() != "0");
        Ok(Network {
            table: table.to_string(),
            pool,
            nonlocal_bind,
            state: Mutex::new(NetState::default()),
        })
    }

    pub fn table(&self) -> &str {
        &self.table
    }

    fn block(&self, index: u32) -> (Ipv4Addr, Ipv4Addr) {
        let base = u32::from(self.pool.0) + index * 4;
        (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2))
    }

    fn base_table(&self) -> String {
        let t = &self.table;
        let (net, len) = self.pool;
        format!(
            "table inet {t} {{
  map fwd_in {{ type ifname : verdict; }}
  map fwd_out {{ type ifname : verdict; }}
  set ifs {{ type ifname; }}
  map ports {{ type inet_service : ipv4_addr . inet_service; }}
  chain forward {{ type filter hook forward priority -1; policy accept;
    oifname vmap @fwd_out
    iifname @ifs ip daddr {net}/{len} ct status & dnat == 0 drop
    iifname vmap @fwd_in
  }}
  chain input {{ type filter hook input priority -1; policy accept;
    iifname @ifs ct state established,related accept
    iifname @ifs drop
  }}
  chain prerouting {{ type nat hook prerouting priority -101; policy accept;
    fib daddr type local dnat ip to tcp dport map @ports
  }}
  chain output {{ type nat hook output priority -101; policy accept;
    ip daddr != 127.0.0.0/8 fib daddr type local dnat ip to tcp dport map @ports
  }}
  chain postrouting {{ type nat hook postrouting priority 99; policy accept;
    ip saddr {net}/{len} oifname != \"grove*\" masquerade
  }}
}}\n"
        )
    }

    /// Wires a sandbox whose init has host pid `pid`. When the host end `grove<id>` already exists
    /// (CRIU restored the veth under that name) it is reused and the sandbox end re-addressed.
    pub fn setup(
        &self,
        id: &SandboxId,
        pid: i32,
        allow: &[EgressRule],
        ports: &[PortMapping],
    ) -> Result<NetLease, NetError> {
        let mut st = self.state.lock();
        let held = Self::hold_ports(&mut st, ports).map_err(NetError::Port)?;
        if st.leases == 0 {
            // Made under the lock so a concurrent setup never adds rules to a missing table.
            let made = std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
                .map_err(NetError::IpForward)
                .and_then(|()| {
                    let _ = nft(&format!("delete table inet {}\n", self.table));
                    nft(&self.base_table())
                });
            if let Err(e) = made {
                Self::release_ports(&mut st, &held);
                return Err(e);
            }
        }
        let blocks = 1u32 << (32 - u32::from(self.pool.1) - 2);
        // A block whose host address the host has already (another instance drew the same pool,
        // or an operator's network) would make two routes for one /30: skip it. One bind each.
        let index = (0..blocks)
            .filter(|i| !st.used.contains(i))
            .find(|&i| self.nonlocal_bind || !is_host_address(self.block(i).0));
        let Some(index) = index else {
            Self::release_ports(&mut st, &held);
            if st.leases == 0 {
                self.delete_table();
            }
            return Err(NetError::PoolExhausted);
        };
        let (host_addr, sandbox_addr) = self.block(index);
        let lease = NetLease {
            index,
            host_if: host_if(id),
            host_addr,
            sandbox_addr,
            chain: format!("sb_{}", id.short()),
            ports: ports.to_vec(),
        };
        st.used.insert(index);
        st.leases += 1;
        drop(st);
        match self.wire(&lease, pid, allow) {
            Ok(()) => Ok(lease),
            Err(e) => {
                let _ = self.teardown(&lease);
                Err(e)
            }
        }
    }

    /// Takes every published host port or none: refused when another sandbox of ours has it, or
    /// anything on the host is bound to it (a listener, groved's own port, another instance's
    /// published port). Returns the ports taken, for `release_ports`.
    fn hold_ports(st: &mut NetState, ports: &[PortMapping]) -> Result<Vec<u16>, Error> {
        let mut taken = Vec::new();
        for (i, p) in ports.iter().enumerate() {
            let port = p.host_port;
            let why = match st.held.entry(port) {
                std::collections::hash_map::Entry::Occupied(_) => {
                    Some("published by another sandbox".to_string())
                }
                std::collections::hash_map::Entry::Vacant(slot) => {
                    match bind_tcp(Ipv4Addr::UNSPECIFIED, port) {
                        Ok(fd) => {
                            slot.insert(fd);
                            taken.push(port);
                            None
                        }
                        Err(nix::errno::Errno::EADDRINUSE) => {
                            Some("in use on the host (a socket is bound to it)".into())
                        }
                        Err(e) => Some(format!("cannot be reserved on the host: {e}")),
                    }
                }
            };
            if let Some(why) = why {
                Self::release_ports(st, &taken);
                return Err(Error::invalid(
                    &format!("ports[{i}].host_port"),
                    format!("{port} is {why}"),
                ));
            }
        }
        Ok(taken)
    }

    fn release_ports(st: &mut NetState, ports: &[u16]) {
        for p in ports {
            st.held.remove(p);
        }
    }

    /// Whether `ports` could be published now (no side effect): for refusing a create before
    /// anything is made; `setup` takes them for real.
    pub fn check_ports(&self, ports: &[PortMapping]) -> Result<(), Error> {
        if ports.is_empty() {
            return Ok(());
        }
        let mut st = self.state.lock();
        let taken = Self::hold_ports(&mut st, ports)?;
        Self::release_ports(&mut st, &taken);
        Ok(())
    }

    fn wire(&self, l: &NetLease, pid: i32, allow: &[EgressRule]) -> Result<(), NetError> {
        let h = &l.host_if;
        let restored = std::path::Path::new("/sys/class/net").join(h).exists();
        let mut host_cmds = String::new();
        if restored {
            host_cmds += &format!("addr flush dev {h}\n");
        } else {
            host_cmds += &format!("link add {h} type veth peer name eth0 netns {pid}\n");
        }
        // The alias names this instance (its table), so residue scans of other instances skip it.
        host_cmds += &format!(
            "link set {h} alias {}\naddr add {}/30 dev {h}\nlink set {h} up\n",
            self.table, l.host_addr
        );
        run(Command::new("ip").args(["-batch", "-"]), Some(&host_cmds))?;
        let sb_cmds = format!(
            "addr flush dev eth0\naddr add {}/30 dev eth0\nlink set eth0 up\nroute replace default via {}\n",
            l.sandbox_addr, l.host_addr
        );
        let netns = format!("--net=/proc/{pid}/ns/net");
        run(
            Command::new("nsenter").args([netns.as_str(), "ip", "-batch", "-"]),
            Some(&sb_cmds),
        )?;

        nft(&self.rules(l, allow))
    }

    /// The nft commands that give one sandbox its chains, allowlist and published ports.
    fn rules(&self, l: &NetLease, allow: &[EgressRule]) -> String {
        let h = &l.host_if;
        let (t, c) = (&self.table, &l.chain);
        let mut s = format!(
            "add chain inet {t} {c}\nadd chain inet {t} {c}_out\nadd rule inet {t} {c} ct state established,related accept\n"
        );
        for r in allow {
            if r.ports.is_empty() {
                s += &format!("add rule inet {t} {c} ip daddr {} accept\n", r.cidr);
            } else {
                let ports: Vec<String> = r.ports.iter().map(u16::to_string).collect();
                s += &format!(
                    "add rule inet {t} {c} ip daddr {} meta l4proto {{ tcp, udp }} th dport {{ {} }} accept\n",
                    r.cidr,
                    ports.join(", ")
                );
            }
        }
        s += &format!("add rule inet {t} {c} drop\n");
        // The receiver's chain runs first and must not end the hook: `return`, not `accept`, so
        // the sender's chain still judges the packet.
        s += &format!(
            "add rule inet {t} {c}_out ct state established,related return\nadd rule inet {t} {c}_out ct status dnat return\nadd rule inet {t} {c}_out drop\n"
        );
        s += &format!("add element inet {t} fwd_in {{ \"{h}\" : jump {c} }}\nadd element inet {t} fwd_out {{ \"{h}\" : jump {c}_out }}\nadd element inet {t} ifs {{ \"{h}\" }}\n");
        for p in &l.ports {
            s += &format!(
                "add element inet {t} ports {{ {} : {} . {} }}\n",
                p.host_port, l.sandbox_addr, p.sandbox_port
            );
        }
        s
    }

    /// The nft commands that undo `rules` for one sandbox; the whole table with the `last` lease.
    fn teardown_rules(&self, l: &NetLease, last: bool) -> String {
        let (t, c, h) = (&self.table, &l.chain, &l.host_if);
        if last {
            return format!("delete table inet {t}\n");
        }
        let mut s = format!("delete element inet {t} fwd_in {{ \"{h}\" }}\ndelete element inet {t} fwd_out {{ \"{h}\" }}\ndelete element inet {t} ifs {{ \"{h}\" }}\n");
        for p in &l.ports {
            s += &format!("delete element inet {t} ports {{ {} }}\n", p.host_port);
        }
        s += &format!("flush chain inet {t} {c}\ndelete chain inet {t} {c}\nflush chain inet {t} {c}_out\ndelete chain inet {t} {c}_out\n");
        s
    }

    /// Removes the link, the rules and the lease; the table goes with the last lease.
    pub fn teardown(&self, l: &NetLease) -> Result<(), NetError> {
        let mut errors = Vec::new();
        if std::path::Path::new("/sys/class/net")
            .join(&l.host_if)
            .exists()
        {
            if let Err(e) = run(Command::new("ip").args(["link", "del", &l.host_if]), None) {
                if std::path::Path::new("/sys/class/net")
                    .join(&l.host_if)
                    .exists()
                {
                    errors.push(e);
                }
            }
        }
        let mut st = self.state.lock();
        st.used.remove(&l.index);
        st.leases = st.leases.saturating_sub(1);
        let ports: Vec<u16> = l.ports.iter().map(|p| p.host_port).collect();
        Self::release_ports(&mut st, &ports);
        let script = self.teardown_rules(l, st.leases == 0);
        if let Err(e) = nft(&script) {
            errors.push(e);
        }
        drop(st);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(NetError::Teardown(errors))
        }
    }

    /// At start-up, with the leases of the sandboxes a restart adopted: the table is rebuilt to hold
    /// exactly their rules, in one nft transaction (no instant without the filter). With none, the
    /// table goes.
    pub fn restore(&self, adopted: &[(NetLease, Vec<EgressRule>)]) -> Result<(), NetError> {
        let mut st = self.state.lock();
        let t = &self.table;
        if adopted.is_empty() {
            if self.table_chains().is_some() {
                self.delete_table();
            }
            return Ok(());
        }
        let mut s = format!("add table inet {t}\ndelete table inet {t}\n") + &self.base_table();
        for (lease, allow) in adopted {
            s += &self.rules(lease, allow);
        }
        nft(&s)?;
        for (lease, _) in adopted {
            st.used.insert(lease.index);
            st.leases += 1;
            if let Err(e) = Self::hold_ports(&mut st, &lease.ports) {
                // The DNAT still works; only a later service may now take the port under it.
                tracing::warn!(link = %lease.host_if, error = %e, "re-holding a published port");
            }
        }
        Ok(())
    }

    /// Chains in our table (for residue), or None when the table does not exist.
    pub fn table_chains(&self) -> Option<Vec<String>> {
        let out = Command::new("nft")
            .args(["list", "table", "inet", &self.table])
            .stderr(Stdio::null())
            .output()
            .ok()?;
        if !out.status.success() {
            return None;
        }
        Some(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter_map(|l| {
                    l.trim()
                        .strip_prefix("chain ")?
                        .split_whitespace()
                        .next()
                        .map(String::from)
                })
                .collect(),
        )
    }

    pub fn delete_table(&self) {
        let _ = nft(&format!("delete table inet {}\n", self.table));
    }

    pub fn has_leases(&self) -> bool {
        self.state.lock().leases > 0
    }
}

/// Whether the host end `host_if` of a sandbox's veth exists.
pub fn link_exists(host_if: &str) -> bool {
    std::path::Path::new("/sys/class/net")
        .join(host_if)
        .exists()
}

/// Deletes the link `host_if` if it exists (a previous run's leftover; best effort).
pub fn remove_link(host_if: &str) {
    if link_exists(host_if) {
        let _ = Command::new("ip").args(["link", "del", host_if]).status();
    }
}

/// (rx, tx) bytes as seen from inside the sandbox (the host end's counters swapped).
pub fn counters(l: &NetLease) -> (u64, u64) {
    let read = |f: &str| {
        std::fs::read_to_string(format!("/sys/class/net/{}/statistics/{f}", l.host_if))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    };
    (read("tx_bytes"), read("rx_bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease() -> NetLease {
        NetLease {
            index: 3,
            host_if: "grovesb0123".into(),
            host_addr: "10.77.0.13".parse().unwrap(),
            sandbox_addr: "10.77.0.14".parse().unwrap(),
            chain: "sb_0123".into(),
            ports: vec![PortMapping {
                host_port: 8080,
                sandbox_port: 80,
            }],
        }
    }

    fn pos(script: &str, line: &str) -> usize {
        script
            .lines()
            .position(|l| l == line)
            .unwrap_or_else(|| panic!("{line:?} not in\n{script}"))
    }

    #[test]
    fn sandbox_rules_accept_only_the_allowlist_then_drop() {
        let net = Network::new("grove_t", "10.77.0.0/16").unwrap();
        let allow = [
            EgressRule {
                cidr: "1.2.3.0/24".into(),
                ports: vec![],
            },
            EgressRule {
                cidr: "9.9.9.9/32".into(),
                ports: vec![53, 443],
            },
        ];
        let s = net.rules(&lease(), &allow);
        let (t, c) = ("inet grove_t", "sb_0123");
        // Chains exist before any rule or map element names them.
        let made = pos(&s, &format!("add chain {t} {c}"));
        let made_out = pos(&s, &format!("add chain {t} {c}_out"));
        let everything = format!("add rule {t} {c} ip daddr 1.2.3.0/24 accept");
        let some_ports = format!(
            "add rule {t} {c} ip daddr 9.9.9.9/32 meta l4proto {{ tcp, udp }} th dport {{ 53, 443 }} accept"
        );
        let drop = pos(&s, &format!("add rule {t} {c} drop"));
        for accept in [&everything, &some_ports] {
            let at = pos(&s, accept);
            assert!(
                made < at && at < drop,
                "{accept:?} between the chain and its drop:\n{s}"
            );
        }
        // Nothing else is accepted on the way out, and the receiver's chain never ends the hook.
        let accepts = s.lines().filter(|l| l.ends_with(" accept")).count();
        assert_eq!(accepts, 3, "established + two allowlist rules:\n{s}");
        assert!(!s
            .lines()
            .any(|l| l.starts_with(&format!("add rule {t} {c}_out")) && l.ends_with("accept")));
        assert!(pos(&s, &format!("add rule {t} {c}_out drop")) > made_out);
        // The maps send the sandbox's link through its chains; its published port is DNATed.
        let link = pos(
            &s,
            &format!("add element {t} fwd_in {{ \"grovesb0123\" : jump {c} }}"),
        );
        assert!(link > drop);
        pos(
            &s,
            &format!("add element {t} fwd_out {{ \"grovesb0123\" : jump {c}_out }}"),
        );
        pos(&s, &format!("add element {t} ifs {{ \"grovesb0123\" }}"));
        pos(
            &s,
            &format!("add element {t} ports {{ 8080 : 10.77.0.14 . 80 }}"),
        );

        // No allowlist: replies only, then drop.
        let none = net.rules(&lease(), &[]);
        let rules: Vec<&str> = none
            .lines()
            .filter(|l| l.starts_with(&format!("add rule {t} {c} ")))
            .collect();
        assert_eq!(
            rules,
            [
                format!("add rule {t} {c} ct state established,related accept"),
                format!("add rule {t} {c} drop")
            ]
        );
    }

    #[test]
    fn teardown_rules_undo_exactly_what_rules_added() {
        let net = Network::new("grove_t", "10.77.0.0/16").unwrap();
        let l = lease();
        let added = net.rules(&l, &[]);
        let removed = net.teardown_rules(&l, false);
        // Every element added is deleted by its key, every chain added is flushed and deleted.
        for line in added.lines() {
            if let Some(rest) = line.strip_prefix("add element ") {
                let (set, body) = rest.split_once(" { ").unwrap();
                let key = body.trim_end_matches(" }").split(" : ").next().unwrap();
                let want = format!("delete element {set} {{ {key} }}");
                assert!(
                    removed.lines().any(|r| r == want),
                    "{want:?} not in\n{removed}"
                );
            }
            if let Some(chain) = line.strip_prefix("add chain ") {
                pos(&removed, &format!("flush chain {chain}"));
                assert!(
                    pos(&removed, &format!("delete chain {chain}"))
                        > pos(&removed, &format!("flush chain {chain}"))
                );
            }
        }
        assert_eq!(
            removed.lines().filter(|l| l.starts_with("delete ")).count(),
            6
        );
        assert_eq!(net.teardown_rules(&l, true), "delete table inet grove_t\n");
    }

    #[test]
    fn the_base_table_drops_forwarding_into_the_pool_and_masquerades_out_of_it() {
        let s = Network::new("grove_t", "10.77.0.0/16")
            .unwrap()
            .base_table();
        assert!(s.starts_with("table inet grove_t {"), "{s}");
        assert!(
            s.contains("iifname @ifs ip daddr 10.77.0.0/16 ct status & dnat == 0 drop"),
            "{s}"
        );
        assert!(
            s.contains("ip saddr 10.77.0.0/16 oifname != \"grove*\" masquerade"),
            "{s}"
        );
        assert!(
            s.contains("iifname @ifs drop"),
            "the host's own services are closed: {s}"
        );
    }

    #[test]
    fn net_errors_read_as_before_and_map_by_variant() {
        let failed = NetError::Failed {
            program: "nft".into(),
            stderr: "no such table".into(),
        };
        assert_eq!(failed.to_string(), r#""nft" failed: no such table"#);
        let both = NetError::Teardown(vec![failed, NetError::PoolExhausted]);
        assert_eq!(
            both.to_string(),
            r#""nft" failed: no such table; address pool exhausted"#
        );
        assert_eq!(
            NetError::PoolTooSmall(30).to_string(),
            "address pool /30 is too small"
        );
        let id = SandboxId::generate();
        assert!(matches!(
            NetError::PoolExhausted.into_error(&id),
            Error::Network { reason, .. } if reason == "address pool exhausted"
        ));
        let port = NetError::Port(Error::invalid("ports[0].host_port", "80 is in use"));
        assert_eq!(port.into_error(&id).field(), Some("ports[0].host_port"));
        assert!(matches!(
            Network::new("t", "10.0.0.0/30"),
            Err(NetError::PoolTooSmall(30))
        ));
        assert!(matches!(
            Network::new("t", "nonsense"),
            Err(NetError::BadPool(_))
        ));
    }
}
