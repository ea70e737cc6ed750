//! Sandbox networking. `none`: the sandbox's own netns with only `lo` (made by init, no work here).
//! `egress`: a veth pair (host end `grove<10 hex of the id>`, sandbox end `eth0`), a /30 from the
//! pool, and nftables rules in the runtime's own table: per sandbox a chain accepting only the
//! allowlisted destinations (forwarded and to the host alike), masquerade out, published ports by
//! DNAT. Done with the `ip` and `nft` commands (off the hot path of `none`).

use std::collections::HashSet;
use std::io::Write;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

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
    state: Mutex<NetState>,
}

#[derive(Default)]
struct NetState {
    used: HashSet<u32>,
    leases: usize,
}

/// Host-end interface name of a sandbox's veth (15 chars, the kernel maximum).
pub fn host_if(id: &SandboxId) -> String {
    format!("grove{}", &id.short()[..10])
}

fn run(cmd: &mut Command, input: Option<&str>) -> Result<(), String> {
    cmd.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| format!("{cmd:?}: {e}"))?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        let _ = stdin.write_all(text.as_bytes());
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{:?} failed: {}",
            cmd.get_program(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn nft(script: &str) -> Result<(), String> {
    run(Command::new("nft").arg("-f").arg("-"), Some(script))
}

impl Network {
    pub fn new(table: &str, pool: &str) -> Result<Network, String> {
        let pool = validate::cidr(pool).map_err(|e| e.to_string())?;
        if pool.1 > 28 {
            return Err(format!("address pool /{} is too small", pool.1));
        }
        Ok(Network {
            table: table.to_string(),
            pool,
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
  map ports {{ type inet_service : ipv4_addr . inet_service; }}
  chain forward {{ type filter hook forward priority -1; policy accept;
    iifname vmap @fwd_in
    oifname vmap @fwd_out
  }}
  chain input {{ type filter hook input priority -1; policy accept;
    iifname vmap @fwd_in
  }}
  chain prerouting {{ type nat hook prerouting priority -101; policy accept;
    fib daddr type local dnat ip to tcp dport map @ports
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
    ) -> Result<NetLease, String> {
        let mut st = self.state.lock();
        if st.leases == 0 {
            // Made under the lock so a concurrent setup never adds rules to a missing table.
            std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
                .map_err(|e| format!("enable ip_forward: {e}"))?;
            let _ = nft(&format!("delete table inet {}\n", self.table));
            nft(&self.base_table())?;
        }
        let blocks = 1u32 << (32 - u32::from(self.pool.1) - 2);
        let index = (0..blocks)
            .find(|i| !st.used.contains(i))
            .ok_or("address pool exhausted")?;
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

    fn wire(&self, l: &NetLease, pid: i32, allow: &[EgressRule]) -> Result<(), String> {
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
        let mut s = format!("add chain inet {t} {c}\nadd chain inet {t} {c}_out\n");
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
        s += &format!("add rule inet {t} {c} ct state established,related accept\nadd rule inet {t} {c} drop\n");
        s += &format!(
            "add rule inet {t} {c}_out ct state established,related accept\nadd rule inet {t} {c}_out ct status dnat accept\nadd rule inet {t} {c}_out drop\n"
        );
        s += &format!("add element inet {t} fwd_in {{ \"{h}\" : jump {c} }}\nadd element inet {t} fwd_out {{ \"{h}\" : jump {c}_out }}\n");
        for p in &l.ports {
            s += &format!(
                "add element inet {t} ports {{ {} : {} . {} }}\n",
                p.host_port, l.sandbox_addr, p.sandbox_port
            );
        }
        s
    }

    /// Removes the link, the rules and the lease; the table goes with the last lease.
    pub fn teardown(&self, l: &NetLease) -> Result<(), String> {
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
        let (t, c, h) = (&self.table, &l.chain, &l.host_if);
        let script = if st.leases == 0 {
            format!("delete table inet {t}\n")
        } else {
            let mut s = format!("delete element inet {t} fwd_in {{ \"{h}\" }}\ndelete element inet {t} fwd_out {{ \"{h}\" }}\n");
            for p in &l.ports {
                s += &format!("delete element inet {t} ports {{ {} }}\n", p.host_port);
            }
            s += &format!("flush chain inet {t} {c}\ndelete chain inet {t} {c}\nflush chain inet {t} {c}_out\ndelete chain inet {t} {c}_out\n");
            s
        };
        if let Err(e) = nft(&script) {
            errors.push(e);
        }
        drop(st);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }

    /// At start-up, with the leases of the sandboxes a restart adopted: the table is rebuilt to hold
    /// exactly their rules, in one nft transaction (no instant without the filter). With none, the
    /// table goes.
    pub fn restore(&self, adopted: &[(NetLease, Vec<EgressRule>)]) -> Result<(), String> {
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
