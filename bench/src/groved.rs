//! A private groved for the scenarios that go through the HTTP API (`api`, `soak`): the binaries
//! built next to grove-bench, its own state and run dirs, cgroup root and address pool.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::scenarios::Ctx;

pub struct Daemon {
    child: Child,
    pub dir: PathBuf,
    pub cgroup_root: String,
    /// The state dir is a tmpfs of this daemon's (unmounted by `unmount_state` or on drop).
    state_fs: bool,
}

impl Daemon {
    /// Starts groved in a fresh dir named after `name`; `config` is appended to the generated
    /// groved.toml (capacity, defaults). Returns once the API answers.
    pub fn start(ctx: &Ctx, name: &str, net_pool: &str, config: &str) -> Result<Daemon> {
        Self::start_on_fs(ctx, name, net_pool, config, None)
    }

    /// [`Daemon::start`] with the state dir on a tmpfs of `state_fs_mb` MiB (a disk that fills).
    pub fn start_on_fs(
        ctx: &Ctx,
        name: &str,
        net_pool: &str,
        config: &str,
        state_fs_mb: Option<u64>,
    ) -> Result<Daemon> {
        let exe = std::env::current_exe()?;
        let groved = std::env::var_os("GROVED_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| exe.with_file_name("groved"));
        let init = crate::util::grove_init();
        if !groved.is_file() || !init.is_file() {
            bail!(
                "{} and {} must exist (build groved and grove-runtime next to grove-bench, or set \
                 GROVED_BIN / GROVE_INIT_BINARY)",
                groved.display(),
                init.display()
            );
        }
        let dir = ctx.fresh_dir(name)?;
        if let Some(mb) = state_fs_mb {
            let state = dir.join("state");
            std::fs::create_dir_all(&state)?;
            nix::mount::mount(
                Some("tmpfs"),
                &state,
                Some("tmpfs"),
                nix::mount::MsFlags::empty(),
                Some(format!("size={mb}m,mode=0700").as_str()),
            )
            .with_context(|| format!("mounting a {mb} MiB tmpfs on {}", state.display()))?;
        }
        let cgroup_root = format!("grove-bench-{}-{name}", std::process::id());
        let toml = format!(
            "state_dir = \"{d}/state\"\nrun_dir = \"{d}/run\"\nroot_provider = \"nodefs\"\n\
             cgroup_root = \"{cgroup_root}\"\nnet_pool = \"{net_pool}\"\n{config}",
            d = dir.display()
        );
        std::fs::write(dir.join("groved.toml"), toml)?;
        let log = std::fs::File::create(dir.join("groved.log"))?;
        let spawned = Command::new(&groved)
            .arg("--config")
            .arg(dir.join("groved.toml"))
            .env("GROVE_INIT_BINARY", &init)
            .env("GROVE_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", groved.display()));
        let child = match spawned {
            Ok(c) => c,
            Err(e) => {
                if state_fs_mb.is_some() {
                    let _ = nix::mount::umount(&dir.join("state"));
                }
                return Err(e);
            }
        };
        let mut d = Daemon {
            child,
            dir,
            cgroup_root,
            state_fs: state_fs_mb.is_some(),
        };
        let t = Instant::now();
        while std::os::unix::net::UnixStream::connect(d.socket()).is_err() {
            if let Some(st) = d.child.try_wait()? {
                bail!("groved exited at start ({st}): {}", d.log_tail());
            }
            if t.elapsed() > Duration::from_secs(60) {
                bail!("groved did not come up in 60 s: {}", d.log_tail());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(d)
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.join("run/groved.sock")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("groved.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().rev().take(20).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    /// SIGTERM, then waits: groved destroys what is left and removes its cgroup root and run dir.
    pub fn stop(&mut self) -> Result<()> {
        // Our own child's pid, which we have not reaped yet.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let t = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait()? {
                if !st.success() {
                    bail!("groved exited with {st}: {}", self.log_tail());
                }
                return Ok(());
            }
            if t.elapsed() > Duration::from_secs(120) {
                let _ = self.child.kill();
                let _ = self.child.wait();
                bail!("groved did not stop in 120 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Daemon {
    /// Unmounts the tmpfs state dir once groved has stopped (a no-op without one).
    pub fn unmount_state(&mut self) -> Result<()> {
        if !self.state_fs {
            return Ok(());
        }
        let state = self.dir.join("state");
        nix::mount::umount(&state).with_context(|| format!("unmounting {}", state.display()))?;
        self.state_fs = false;
        Ok(())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.stop();
        }
        if self.state_fs {
            let _ = nix::mount::umount2(&self.dir.join("state"), nix::mount::MntFlags::MNT_DETACH);
        }
    }
}
