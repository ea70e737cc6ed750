//! Grove's side of the scenarios: the runtime library in-process over a root provider, opened once per run
//! and probed with a real create → exec → destroy. When a piece is not usable yet the reason is returned and
//! the scenario reports "not available (<reason>)" — never a made-up figure.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use anyhow::{anyhow, bail, Context, Result};
use grove_runtime::{
    ExecRequest, Limits, OverlayRoot, RootProvider, Runtime, RuntimeConfig, SandboxId, SandboxSpec,
};

/// Lazily opened Grove pieces shared by the scenarios of one run.
pub struct GroveEnv {
    image: PathBuf,
    work: PathBuf,
    runtime: OnceLock<Result<Arc<GroveRuntime>, String>>,
}

impl GroveEnv {
    pub fn new(image: &Path, work: &Path) -> Self {
        GroveEnv {
            image: image.into(),
            work: work.into(),
            runtime: OnceLock::new(),
        }
    }

    /// The runtime, or why it is not usable.
    pub fn runtime(&self) -> Result<Arc<GroveRuntime>, String> {
        self.runtime
            .get_or_init(|| {
                GroveRuntime::open(&self.image, &self.work)
                    .map(Arc::new)
                    .map_err(|e| format!("{e:#}"))
            })
            .clone()
    }

    /// Shuts down what was opened (destroys every sandbox left).
    pub fn shutdown(&self) {
        if let Some(Ok(rt)) = self.runtime.get() {
            rt.shutdown();
        }
    }

    /// Residue the runtime itself sees (mounts, cgroups, netns, ... it owns).
    pub fn residue(&self) -> Vec<String> {
        match self.runtime.get() {
            Some(Ok(rt)) => rt
                .rt
                .residue()
                .items
                .iter()
                .map(|i| format!("grove {}: {}", i.kind, i.what))
                .collect(),
            _ => Vec::new(),
        }
    }
}

/// The Grove runtime used by the bench.
pub struct GroveRuntime {
    pub rt: Arc<Runtime>,
    pub image: String,
    root_kind: &'static str,
    run_dir: PathBuf,
    cgroup_root: String,
}

impl GroveRuntime {
    fn open(image_dir: &Path, work: &Path) -> Result<GroveRuntime> {
        let (roots, image, root_kind) = root_provider(image_dir)?;
        let pid = std::process::id();
        let mut cfg = RuntimeConfig::default_paths();
        if let Some(p) = std::env::var_os("GROVE_INIT_BINARY") {
            cfg.init_binary = p.into();
        }
        if !cfg.init_binary.is_file() {
            bail!(
                "grove-init not found at {} (build the runtime crate, or set GROVE_INIT_BINARY)",
                cfg.init_binary.display()
            );
        }
        cfg.state_dir = work.join("grove-state");
        std::fs::create_dir_all(&cfg.state_dir)?;
        cfg.run_dir = PathBuf::from(format!("/run/grove-bench-{pid}"));
        cfg.cgroup_root = format!("grove-bench-{pid}");
        let run_dir = cfg.run_dir.clone();
        let cgroup_root = cfg.cgroup_root.clone();
        let rt = Runtime::new(cfg, roots).map_err(|e| anyhow!("Runtime::new: {e}"))?;
        let g = GroveRuntime {
            rt,
            image,
            root_kind,
            run_dir,
            cgroup_root,
        };
        g.cycle_true()
            .context("probe create → exec true → destroy")?;
        Ok(g)
    }

    /// "grove (overlayfs root)" and the like.
    pub fn label(&self) -> String {
        format!("grove ({} root)", self.root_kind)
    }

    pub fn describe(&self) -> String {
        format!(
            "sandbox roots from {} (image {:?})",
            self.root_kind, self.image
        )
    }

    pub fn spec(&self, limits: Option<Limits>) -> SandboxSpec {
        let mut s = SandboxSpec::from_image(self.image.clone());
        s.limits = limits;
        s
    }

    pub fn create(&self, spec: SandboxSpec) -> Result<SandboxId> {
        Ok(self.rt.create(spec).map_err(|e| anyhow!("create: {e}"))?.id)
    }

    pub fn destroy(&self, id: &SandboxId) -> Result<()> {
        self.rt
            .destroy(id)
            .map_err(|e| anyhow!("destroy {id}: {e}"))
    }

    /// Runs argv to completion; fails unless it exits 0.
    pub fn exec_ok(&self, id: &SandboxId, argv: &[&str]) -> Result<Vec<u8>> {
        let r = self
            .rt
            .exec(id, ExecRequest::argv(argv.iter().copied()))
            .map_err(|e| anyhow!("exec: {e}"))?;
        if r.exit_code != Some(0) {
            bail!(
                "exec {argv:?}: exit {:?} signal {:?}: {}",
                r.exit_code,
                r.signal,
                String::from_utf8_lossy(&r.stderr).trim()
            );
        }
        Ok(r.stdout)
    }

    /// Starts argv in the background (it outlives the exec).
    pub fn exec_background(&self, id: &SandboxId, argv: &[&str]) -> Result<()> {
        let mut req = ExecRequest::argv(argv.iter().copied());
        req.background = true;
        self.rt
            .exec(id, req)
            .map_err(|e| anyhow!("exec background: {e}"))?;
        Ok(())
    }

    /// create → exec `true` → destroy.
    pub fn cycle_true(&self) -> Result<()> {
        let id = self.create(self.spec(None))?;
        let r = self.exec_ok(&id, &["true"]);
        let d = self.destroy(&id);
        r?;
        d
    }

    pub fn init_pid(&self, id: &SandboxId) -> Option<i32> {
        self.rt.get(id).ok().and_then(|i| i.init_pid)
    }

    fn shutdown(&self) {
        self.rt.shutdown();
    }
}

impl Drop for GroveRuntime {
    fn drop(&mut self) {
        self.rt.shutdown();
        let _ = std::fs::remove_dir(&self.run_dir);
        if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
            for e in rd.flatten() {
                let _ = std::fs::remove_dir(e.path().join(&self.cgroup_root));
            }
        }
    }
}

/// The root provider: overlayfs over the base image directory (the image is `<state>/images/<name>`).
fn root_provider(image_dir: &Path) -> Result<(Arc<dyn RootProvider>, String, &'static str)> {
    let name = image_dir
        .file_name()
        .and_then(|n| n.to_str())
        .context("image dir has no name")?
        .to_string();
    let state = image_dir
        .parent()
        .and_then(|p| p.parent())
        .filter(|_| image_dir.parent().and_then(|p| p.file_name()) == Some("images".as_ref()))
        .context("image dir must be <state>/images/<name> for OverlayRoot")?;
    let roots: Arc<dyn RootProvider> = Arc::new(OverlayRoot::new(state));
    if !roots.image_exists(&name) {
        bail!("OverlayRoot does not find image {name:?}");
    }
    Ok((roots, name, "overlayfs"))
}
