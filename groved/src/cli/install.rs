//! `grove install`: places groved, grove, grove-init and grove-fsd, the systemd unit, the tmpfiles.d entry and a
//! default config (never overwriting an existing one), then enables and (re)starts the service.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Args;

use super::{CliError, CliResult};

pub const UNIT: &str = include_str!("../../../systemd/groved.service");
pub const CONFIG: &str = include_str!("../../../systemd/groved.toml");
pub const TMPFILES: &str = include_str!("../../../systemd/grove.tmpfiles");
/// The prefix the shipped files name; rewritten to `--prefix`.
const SHIPPED_PREFIX: &str = "/usr/local";

#[derive(Args, Debug)]
pub struct InstallArgs {
    /// Prefix for the binaries: <prefix>/bin/{groved,grove}, <prefix>/libexec/grove/grove-init.
    #[arg(long, default_value = SHIPPED_PREFIX)]
    pub prefix: PathBuf,
    /// Directory holding the groved, grove and grove-init to install (default: where this grove is).
    #[arg(long)]
    pub from: Option<PathBuf>,
    /// Install under this directory instead of / (images, packaging); implies --no-start.
    #[arg(long, default_value = "/")]
    pub root: PathBuf,
    /// Only place the files: no systemctl daemon-reload, enable, restart.
    #[arg(long)]
    pub no_start: bool,
}

/// The unit with its paths under `prefix`.
pub fn render_unit(prefix: &Path) -> String {
    UNIT.replace(
        &format!("{SHIPPED_PREFIX}/bin/"),
        &format!("{}/bin/", prefix.display()),
    )
}

fn render_config(prefix: &Path) -> String {
    CONFIG.replace(
        &format!("{SHIPPED_PREFIX}/libexec/"),
        &format!("{}/libexec/", prefix.display()),
    )
}

pub fn run(a: InstallArgs) -> CliResult {
    if !a.prefix.is_absolute() {
        return Err(CliError::Usage("--prefix must be an absolute path".into()));
    }
    let from = match a.from {
        Some(d) => d,
        None => std::env::current_exe()?
            .parent()
            .map(Path::to_path_buf)
            .ok_or_else(|| CliError::Other("cannot tell where grove runs from".into()))?,
    };
    let under = |p: &Path| a.root.join(p.strip_prefix("/").unwrap_or(p));
    let bin = under(&a.prefix.join("bin"));
    let libexec = under(&a.prefix.join("libexec/grove"));
    for (name, dir) in [
        ("groved", &bin),
        ("grove", &bin),
        ("grove-init", &libexec),
        ("grove-fsd", &libexec),
    ] {
        place_binary(&source_of(&from, name), &dir.join(name))?;
    }
    let unit = under(Path::new("/etc/systemd/system/groved.service"));
    write_file(&unit, &render_unit(&a.prefix), 0o644)?;
    let tmpfiles = under(Path::new("/etc/tmpfiles.d/grove.conf"));
    write_file(&tmpfiles, TMPFILES, 0o644)?;
    let config = under(Path::new(crate::config::DEFAULT_CONFIG));
    if config.exists() {
        println!("kept {}", config.display());
    } else {
        write_file(&config, &render_config(&a.prefix), 0o644)?;
    }
    if a.no_start || a.root != Path::new("/") {
        return Ok(());
    }
    if !Path::new("/run/systemd/system").is_dir() {
        println!(
            "systemd is not running here: start {}/groved yourself",
            bin.display()
        );
        return Ok(());
    }
    systemctl_like(
        "systemd-tmpfiles",
        &["--create", "/etc/tmpfiles.d/grove.conf"],
    )?;
    systemctl_like("systemctl", &["daemon-reload"])?;
    systemctl_like("systemctl", &["enable", "--quiet", "groved.service"])?;
    // restart, not start: a reinstall must run the new binaries. Type=notify makes this wait for READY=1.
    systemctl_like("systemctl", &["restart", "groved.service"])?;
    println!("groved.service is active");
    Ok(())
}

/// Copies a binary in atomically (a running groved keeps its old file; no ETXTBSY).
fn place_binary(src: &Path, dst: &Path) -> CliResult {
    if !src.is_file() {
        return Err(CliError::Other(format!(
            "{} not found (build it, or pass --from DIR)",
            src.display()
        )));
    }
    let dir = dst.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(dir).map_err(|e| io_err("creating", dir, e))?;
    let tmp = dir.join(format!(
        ".{}.{}",
        dst.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    std::fs::copy(src, &tmp).map_err(|e| io_err("copying to", &tmp, e))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| io_err("chmod", &tmp, e))?;
    std::fs::rename(&tmp, dst).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_err("installing", dst, e)
    })?;
    println!("installed {}", dst.display());
    Ok(())
}

fn write_file(path: &Path, text: &str, mode: u32) -> CliResult {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io_err("creating", dir, e))?;
    }
    std::fs::write(path, text).map_err(|e| io_err("writing", path, e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| io_err("chmod", path, e))?;
    println!("installed {}", path.display());
    Ok(())
}

fn systemctl_like(prog: &str, args: &[&str]) -> CliResult {
    let st = Command::new(prog)
        .args(args)
        .status()
        .map_err(|e| CliError::Other(format!("running {prog}: {e}")))?;
    if !st.success() {
        return Err(CliError::Other(format!(
            "{prog} {} failed ({st})",
            args.join(" ")
        )));
    }
    Ok(())
}

fn io_err(op: &str, path: &Path, e: std::io::Error) -> CliError {
    CliError::Other(format!("{op} {}: {e}", path.display()))
}

/// The build of `name` in `from` to install: grove-init's static build (`scripts/build-init`)
/// where there is one, which starts sandboxes faster.
fn source_of(from: &Path, name: &str) -> PathBuf {
    let static_init = from.join("grove-init-static");
    match name {
        "grove-init" if static_init.exists() => static_init,
        _ => from.join(name),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn installs_the_static_grove_init_when_built() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(
            source_of(d.path(), "grove-init"),
            d.path().join("grove-init")
        );
        std::fs::write(d.path().join("grove-init-static"), b"").unwrap();
        assert_eq!(
            source_of(d.path(), "grove-init"),
            d.path().join("grove-init-static")
        );
        assert_eq!(source_of(d.path(), "groved"), d.path().join("groved"));
    }
}
