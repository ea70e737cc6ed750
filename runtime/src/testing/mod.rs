//! Root-free lifecycle tests: a `Runtime` built with `with_parts` over a recording fake of the
//! host (`host::FakeHost`) on a tempdir. They need no cgroupfs, nft, FUSE or CRIU, and run as
//! any user; the same paths on the real host are the integration tests' (runtime/tests/).

mod host;

mod create;
mod park;
mod reclaim;
mod recover;

use std::path::PathBuf;
use std::sync::Arc;

pub use host::{Call, FakeHost, Op};

use crate::config::RuntimeConfig;
use crate::runtime::Runtime;
use crate::types::{
    CapacityOverrides, EgressRule, NetworkPolicy, PortMapping, Resources, SandboxId, SandboxSpec,
};

/// A fake node: its host, and the config every runtime on it starts with.
pub struct Node {
    pub host: Arc<FakeHost>,
    pub config: RuntimeConfig,
    _tmp: tempfile::TempDir,
}

impl Node {
    pub fn new() -> Node {
        let tmp = tempfile::tempdir().unwrap();
        let instance = format!("grove-ut{:08x}", rand::random::<u32>());
        let mut config = RuntimeConfig::for_instance(&instance, &tmp.path().join("state"));
        config.run_dir = tmp.path().join("run");
        config.init_binary = tmp.path().join("grove-init");
        std::fs::write(&config.init_binary, b"#!/bin/false\n").unwrap();
        config.capacity = CapacityOverrides {
            cpu_millis: Some(8000),
            memory_mb: Some(8192),
            pids: Some(4096),
            open_files: Some(1 << 20),
            disk_mb: Some(1 << 20),
            sandboxes: Some(16),
            memory_reserve_mb: Some(0),
        };
        let host = FakeHost::new(&tmp.path().join("host"), &instance.replace('-', "_"));
        Node {
            host,
            config,
            _tmp: tmp,
        }
    }

    /// A runtime on this node (a restart when one ran before: it recovers what that one left).
    pub fn runtime(&self) -> Arc<Runtime> {
        Runtime::with_parts(self.config.clone(), self.host.clone(), self.host.parts()).unwrap()
    }

    pub fn sandbox_dir(&self, id: &SandboxId) -> PathBuf {
        self.config.run_dir.join("sandboxes").join(id.as_str())
    }
}

/// A sandbox with loopback only.
pub fn offline() -> SandboxSpec {
    SandboxSpec {
        image: "base".into(),
        ..Default::default()
    }
}

/// A sandbox with an egress allowlist and a published port.
pub fn egress() -> SandboxSpec {
    SandboxSpec {
        image: "base".into(),
        network: NetworkPolicy::Egress {
            allow: vec![EgressRule {
                cidr: "1.2.3.0/24".into(),
                ports: vec![],
            }],
        },
        ports: vec![PortMapping {
            host_port: 30080,
            sandbox_port: 80,
        }],
        ..Default::default()
    }
}

/// Nothing admitted: every reservation was given back.
pub fn nothing_allocated(rt: &Runtime) -> bool {
    rt.capacity().allocated == Resources::default()
}

/// What of sandbox `id` is left on the node: its fake host parts, and its run dir.
pub fn left(node: &Node, id: &SandboxId) -> Vec<String> {
    let mut out = node.host.held(id.as_str());
    if node.sandbox_dir(id).exists() {
        out.push(format!("dir {}", node.sandbox_dir(id).display()));
    }
    out
}

/// The ops of `calls`, in order.
pub fn ops(calls: &[Call]) -> Vec<Op> {
    calls.iter().map(|c| c.op).collect()
}
