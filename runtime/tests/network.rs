//! Network policy, for real (root): `none` has no route out; `egress` reaches only its allowlist
//! (tested against listeners inside a network namespace made here, never an outside address);
//! sandboxes don't reach each other or host services; a published port is forwarded.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use grove_runtime::{EgressRule, ExecRequest, NetworkPolicy, PortMapping, SandboxId};

const PEER_NS: &str = "grove-rtest-peer";
const PEER_LINK: &str = "grovetp0";

fn ip(args: &str) {
    let ok = Command::new("ip")
        .args(args.split(' '))
        .status()
        .unwrap()
        .success();
    assert!(ok, "ip {args}");
}

/// A TCP server printing "hi" to every client, run by /usr/bin/python3 (in `ns` when given).
fn listener(ns: Option<&str>, port: u16) -> Child {
    let py = format!(
        "import socket\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind(('0.0.0.0',{port})); s.listen()\nwhile True:\n  c,_=s.accept(); c.sendall(b'hi'); c.close()\n"
    );
    let mut cmd = match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "/usr/bin/python3", "-c", &py]);
            c
        }
        None => {
            let mut c = Command::new("/usr/bin/python3");
            c.args(["-c", &py]);
            c
        }
    };
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Tries a TCP connection from inside the sandbox; "hi" on success, else the error class.
fn connect(rt: &grove_runtime::Runtime, id: &SandboxId, addr: &str, port: u16) -> String {
    let py = format!(
        "import socket\ntry:\n  s=socket.create_connection(('{addr}',{port}),timeout=1); print(s.recv(2).decode())\nexcept Exception as e:\n  print(type(e).__name__)\n"
    );
    out(&rt
        .exec(id, ExecRequest::argv(["python3", "-c", &py]))
        .unwrap())
}

fn egress(cidr: &str, ports: Vec<u16>) -> NetworkPolicy {
    NetworkPolicy::Egress {
        allow: vec![EgressRule {
            cidr: cidr.into(),
            ports,
        }],
    }
}

/// Removes the test's own network fixtures even when an assertion fails.
struct Fixture {
    forward_before: String,
    servers: Vec<Child>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        for s in &mut self.servers {
            let _ = s.kill();
            let _ = s.wait();
        }
        let _ = Command::new("ip").args(["netns", "del", PEER_NS]).status();
        let _ = Command::new("ip")
            .args(["link", "del", PEER_LINK])
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::write("/proc/sys/net/ipv4/ip_forward", &self.forward_before);
    }
}

#[test]
fn network_policies() {
    if !can_run() {
        return;
    }
    let mut fx = Fixture {
        forward_before: std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").unwrap(),
        servers: Vec::new(),
    };
    // The "outside world": a netns with two addresses, listeners on 8000 and 8001.
    let _ = Command::new("ip").args(["netns", "del", PEER_NS]).status();
    ip(&format!("netns add {PEER_NS}"));
    ip(&format!(
        "link add {PEER_LINK} type veth peer name eth0 netns {PEER_NS}"
    ));
    ip(&format!("addr add 10.212.0.1/24 dev {PEER_LINK}"));
    ip(&format!("link set {PEER_LINK} up"));
    for cmd in [
        "addr add 10.212.0.2/24 dev eth0",
        "addr add 10.212.0.3/24 dev eth0",
        "link set eth0 up",
        "link set lo up",
        "route add default via 10.212.0.1",
    ] {
        ip(&format!("-n {PEER_NS} {cmd}"));
    }
    fx.servers = vec![
        listener(Some(PEER_NS), 8000),
        listener(Some(PEER_NS), 8001),
        listener(None, 18002),
    ];
    std::thread::sleep(Duration::from_millis(400));

    let rt = rt();
    let mut s = spec();
    let none = rt.create(s.clone()).unwrap().id;
    assert_eq!(connect(&rt, &none, "10.212.0.2", 8000), "OSError"); // ENETUNREACH

    s.network = egress("10.212.0.2/32", vec![8000]);
    s.ports = vec![PortMapping {
        host_port: 31080,
        sandbox_port: 9000,
    }];
    let a = rt.create(s.clone()).unwrap();
    let mut s2 = spec();
    s2.network = egress("10.212.0.0/24", vec![]);
    let b = rt.create(s2).unwrap();

    assert_eq!(
        connect(&rt, &a.id, "10.212.0.2", 8000),
        "hi",
        "allowlisted address and port"
    );
    assert_eq!(
        connect(&rt, &a.id, "10.212.0.2", 8001),
        "TimeoutError",
        "port not allowlisted"
    );
    assert_eq!(
        connect(&rt, &a.id, "10.212.0.3", 8000),
        "TimeoutError",
        "address not allowlisted"
    );
    assert_eq!(
        connect(&rt, &b.id, "10.212.0.3", 8001),
        "hi",
        "whole /24 allowed for b"
    );
    // No host services, no other sandbox.
    let a_gw = {
        let addr: std::net::Ipv4Addr = a.address.clone().unwrap().parse().unwrap();
        std::net::Ipv4Addr::from(u32::from(addr) - 1).to_string()
    };
    assert_eq!(
        connect(&rt, &a.id, &a_gw, 18002),
        "TimeoutError",
        "host service"
    );
    let mut srv = ExecRequest::argv([
        "python3",
        "-c",
        "import socket\ns=socket.socket(); s.bind(('0.0.0.0',9000)); s.listen()\nwhile True:\n  c,_=s.accept(); c.sendall(b'hi'); c.close()\n",
    ]);
    srv.background = true;
    rt.exec(&b.id, srv.clone()).unwrap();
    rt.exec(&a.id, srv).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        connect(&rt, &a.id, b.address.as_deref().unwrap(), 9000),
        "TimeoutError",
        "other sandbox"
    );
    // The published port: peer → host:31080 → a:9000.
    let got = Command::new("ip")
        .args(["netns", "exec", PEER_NS, "/usr/bin/python3", "-c", "import socket; s=socket.create_connection(('10.212.0.1',31080),timeout=2); print(s.recv(2).decode())"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&got.stdout).trim(),
        "hi",
        "{}",
        String::from_utf8_lossy(&got.stderr)
    );
    assert!(rt.usage(&a.id).unwrap().net_tx_bytes > 0);

    for id in [&none, &a.id, &b.id] {
        rt.destroy(id).unwrap();
    }
    drop(fx);
    for id in [&none, &a.id, &b.id] {
        assert_gone(&rt, id);
    }
    let nft = Command::new("nft")
        .args(["list", "table", "inet", "grove_rtest"])
        .output()
        .unwrap();
    assert!(!nft.status.success(), "our nft table is gone");
}
