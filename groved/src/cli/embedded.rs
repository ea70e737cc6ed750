//! Without a daemon: `grove run` starts the runtime in-process for one sandbox, and `grove residue` scans the
//! host itself (starting a runtime would clean up first and hide what was left).

use std::io::Write as _;

use grove_runtime::{ExecRequest, OutputChunk, ResidueItem};

use super::sandbox::{exit_code, spec_json};
use super::{CliError, CliResult, RunArgs};
use crate::api_shapes::CreateSandboxRequest;
use crate::config::{Config, Overrides};

pub fn run(a: RunArgs, config: Option<std::path::PathBuf>) -> CliResult {
    let config = Config::load(&Overrides {
        config,
        ..Default::default()
    })
    .map_err(|e| CliError::Other(crate::error::chain(&e)))?;
    let req: CreateSandboxRequest = crate::request_parse::parse_json(
        &serde_json::to_vec(&spec_json(Some(&a.image), &a.spec)?).unwrap_or_default(),
    )
    .map_err(|e| CliError::Usage(e.message))?;
    let mut spec = crate::api::build_spec(&req, &config.defaults)
        .map_err(|e| CliError::Usage(format!("{}: {}", e.field.unwrap_or_default(), e.message)))?;
    let configs = crate::image_config::ImageConfigs::new(&config.state_dir);
    configs
        .apply(&a.image, &mut spec)
        .map_err(|e| CliError::Other(e.message))?;
    let cmd = if a.cmd.is_empty() {
        let cmd = configs
            .get(&a.image)
            .ok()
            .flatten()
            .map(|c| c.default_command())
            .unwrap_or_default();
        if cmd.is_empty() {
            return Err(CliError::Usage(format!(
                "image {:?} has no default command (Entrypoint/Cmd): give one after --",
                a.image
            )));
        }
        cmd
    } else {
        a.cmd.clone()
    };
    let backend = crate::backend_build::build(&config, true)
        .map_err(|e| CliError::Other(format!("{e:#}")))?;
    let rt = backend.runtime;
    let info = rt
        .create(spec)
        .map_err(|e| CliError::Other(crate::error::chain(&e)));
    let result = info.and_then(|info| {
        let mut req = ExecRequest::argv(cmd.clone());
        req.timeout_ms = a.timeout.map(|t| (t * 1000.0).ceil() as u64);
        let mut out = |c: OutputChunk| {
            let _ = match c {
                OutputChunk::Stdout(d) => std::io::stdout()
                    .write_all(&d)
                    .and_then(|()| std::io::stdout().flush()),
                OutputChunk::Stderr(d) => std::io::stderr().write_all(&d),
            };
        };
        let r = rt
            .exec_stream(&info.id, req, &mut out)
            .map_err(|e| CliError::Other(crate::error::chain(&e)));
        let destroyed = rt
            .destroy(&info.id)
            .map_err(|e| CliError::Other(crate::error::chain(&e)));
        let r = r?;
        destroyed?;
        Ok(exit_code(r.exit_code, r.signal, r.timed_out))
    });
    rt.shutdown();
    let _ = std::fs::remove_file(config.run_dir.join("grove-init"));
    match result? {
        0 => Ok(()),
        n => Err(CliError::Exit(n)),
    }
}

pub fn residue() -> CliResult {
    super::node::print_residue(&scan_host())
}

/// Everything Grove-named on the host: mounts, cgroups, netns, links, nft tables, grove-init and grove-fsd
/// processes, shm, sandbox upper layers under the default state dir.
pub fn scan_host() -> Vec<ResidueItem> {
    let mut items = Vec::new();
    let mut add = |kind: &str, what: String| {
        items.push(ResidueItem {
            kind: kind.into(),
            what,
        })
    };
    if let Ok(mi) = std::fs::read_to_string("/proc/self/mountinfo") {
        for line in mi.lines() {
            let l = line.to_ascii_lowercase();
            if l.contains("grove") || l.contains("nodefs") {
                add("mount", line.split(' ').nth(4).unwrap_or(line).to_string());
            }
        }
    }
    if let Ok(ctrls) = std::fs::read_dir("/sys/fs/cgroup") {
        for c in ctrls.flatten() {
            if let Ok(children) = std::fs::read_dir(c.path().join("grove")) {
                for ch in children.flatten().filter(|e| e.path().is_dir()) {
                    add("cgroup", ch.path().display().to_string());
                }
            }
        }
    }
    for (dir, kind, prefix) in [
        ("/run/netns", "netns", "grove"),
        ("/sys/class/net", "link", "grove"),
        ("/dev/shm", "file", "grove"),
        ("/var/lib/grove/uppers", "upper", "sb-"),
    ] {
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().starts_with(prefix) {
                    add(kind, e.path().display().to_string());
                }
            }
        }
    }
    if let Ok(procs) = std::fs::read_dir("/proc") {
        for p in procs.flatten() {
            // A zombie holds nothing but its pid until its parent reaps it (the host's pid 1 for
            // a server whose daemon exited): not residue.
            let stat = std::fs::read_to_string(p.path().join("stat")).unwrap_or_default();
            let state = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().next());
            if matches!(state, Some("Z" | "X")) {
                continue;
            }
            let comm = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
            if comm.trim() == "grove-init" {
                add(
                    "process",
                    format!("pid {} grove-init", p.file_name().to_string_lossy()),
                );
            }
            // A store and FUSE server with no daemon; its command line names its socket.
            if comm.trim() == "grove-fsd" {
                let cmd = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
                let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
                add(
                    "process",
                    format!("pid {} {}", p.file_name().to_string_lossy(), cmd.trim()),
                );
            }
        }
    }
    if let Ok(out) = std::process::Command::new("nft")
        .args(["list", "tables"])
        .output()
    {
        for t in String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains("grove"))
        {
            add("nft", t.to_string());
        }
    }
    items
}
