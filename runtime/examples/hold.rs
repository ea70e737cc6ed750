//! Debug aid: create one sandbox, print its id and init pid, run a background `sleep`, wait for
//! Enter on stdin, destroy. Run as root: cargo run -p grove-runtime --example hold [egress]

use std::sync::Arc;

use grove_runtime::{ExecRequest, OverlayRoot, Runtime, RuntimeConfig, SandboxSpec};

fn main() {
    let mut cfg = RuntimeConfig::default_paths();
    cfg.run_dir = "/run/grove-hold".into();
    cfg.cgroup_root = "grove-hold".into();
    let rt = Runtime::new(cfg, Arc::new(OverlayRoot::new("/var/lib/grove"))).expect("runtime");
    let mut spec = SandboxSpec::from_image("debian12");
    if std::env::args().nth(1).as_deref() == Some("egress") {
        spec.network = grove_runtime::NetworkPolicy::Egress { allow: vec![] };
    }
    let info = rt.create(spec).expect("create");
    let mut bg =
        ExecRequest::shell("i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done");
    bg.background = true;
    rt.exec(&info.id, bg).expect("exec");
    println!("{} {}", info.id, info.init_pid.unwrap_or(0));
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    rt.shutdown();
    println!("residue: {:?}", rt.residue().items);
}
