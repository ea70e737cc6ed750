//! The step engine: runs a parsed Dockerfile's stages, each filesystem step a nodefs commit.
//!
//! RUN executes in a Grove sandbox made from the current root (no network unless the build has
//! an allowlist); COPY/ADD and WORKDIR write into a nodefs view of the root mounted on the host
//! (no sandbox: faster), every path resolved inside that root. Each filesystem step is cached in
//! the store as a ref `grove-build/<key>`, the key hashing the parent root, the instruction with
//! its variables resolved (and for RUN the env/user/cwd/shell/network it runs with), and the
//! digest of the files it copies; a hit skips the step.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use grove_runtime::{ConfinedRoot, ExecRequest, NetworkPolicy, OutputChunk, Runtime, SandboxSpec};
use nodefs::service::{FsService, ImportPolicy, MountInfo};
use nodefs::{ManifestId, MountOptions};
use sha2::{Digest as _, Sha256};

use super::cache::{CacheError, Index, Policy, Pruned};
use super::dockerfile::{expand, CmdForm, Copy, Dockerfile, Instr, Kind};
use super::glob::{self, Ignore};
use super::ImageConfig;
use crate::error::chain;

/// Cache refs live under this prefix (image names cannot hold `/`, so they never list as images).
pub const CACHE_PREFIX: &str = "grove-build/";
/// Sandboxes running a RUN step carry this label (found and removed after a crash).
pub const BUILD_LABEL: &str = "grove.build";
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("step {step} (Dockerfile line {line}) `{text}`: {reason}")]
    Step {
        step: usize,
        line: usize,
        text: String,
        reason: String,
    },
    #[error("Dockerfile line {line}: {reason}")]
    Line { line: usize, reason: String },
    #[error("the build was cancelled (its client went away)")]
    Cancelled,
}

/// What the build reports as it goes.
#[derive(Debug)]
pub enum Progress<'a> {
    Step {
        step: usize,
        total: usize,
        line: usize,
        text: &'a str,
        /// None for steps that change no files (ENV, LABEL, ...): nothing to run or cache.
        cached: Option<bool>,
    },
    Output {
        stderr: bool,
        data: &'a [u8],
    },
}

/// Finds a `FROM` that is neither `scratch` nor a stage: its root and config.
pub type BaseFn<'a> = dyn Fn(&str) -> Result<(ManifestId, Option<ImageConfig>), BaseError> + 'a;

/// Why a `FROM` base was not found, naming it: rendered into the step's reason. (Pull errors
/// are boxed: they are large, and a base is looked up once a stage.)
#[derive(Debug, thiserror::Error)]
pub enum BaseError {
    /// The node's image of that name has a config that cannot be read.
    #[error("{}", .0.message)]
    Config(crate::error::ApiError),
    /// The store could not say whether the node has an image of that name.
    #[error("image {name:?}: {}", chain(.error))]
    Store { name: String, error: nodefs::Error },
    /// Neither an image here nor a reference a registry could serve.
    #[error("{name:?} is no image on this node nor a registry reference: {why}")]
    NotAReference { name: String, why: String },
    /// A reference whose manifest could not be resolved.
    #[error("no image {name:?} on this node, and pulling it: {error}")]
    Resolve {
        name: String,
        error: Box<crate::registry::pull::PullError>,
    },
    /// A reference whose layers could not be pulled.
    #[error("pulling {name:?}: {error}")]
    Fetch {
        name: String,
        error: Box<crate::registry::pull::PullError>,
    },
    /// A pull that ended without a root.
    #[error("pulling {name:?}: no root")]
    NoRoot { name: String },
}

/// Where a build finds things outside the Dockerfile.
pub struct Inputs<'a> {
    pub context: &'a Path,
    pub ignore: &'a Ignore,
    pub build_args: &'a BTreeMap<String, String>,
    pub network: &'a NetworkPolicy,
    /// A `FROM` that is neither `scratch` nor a stage: its root and config.
    pub base: &'a BaseFn<'a>,
}

pub struct Engine {
    pub store: Arc<dyn FsService>,
    pub runtime: Arc<Runtime>,
    /// Mountpoints (`<run_dir>/build`) and upper layers (`<state_dir>/build`) of the views.
    pub mounts: PathBuf,
    pub uppers: PathBuf,
    /// When each cache entry was last used (see [`super::cache`]).
    pub cache: Index,
}

#[derive(Debug, Clone)]
struct StageOut {
    root: ManifestId,
    cfg: ImageConfig,
}

/// A stage's state as its steps run.
struct State {
    root: ManifestId,
    cfg: ImageConfig,
    shell: Vec<String>,
    args: BTreeMap<String, String>,
    /// CMD was set in this stage (an ENTRYPOINT then keeps it).
    cmd_here: bool,
}

impl State {
    /// What `$VAR` sees: the stage's ARGs, then its ENV over them.
    fn vars(&self) -> BTreeMap<String, String> {
        let mut v = self.args.clone();
        v.extend(self.cfg.env_map());
        v
    }

    fn workdir(&self) -> String {
        self.cfg.working_dir.clone().unwrap_or_else(|| "/".into())
    }
}

type Emit<'a> = dyn FnMut(Progress<'_>) -> bool + 'a;

static VIEW_SEQ: AtomicU64 = AtomicU64::new(0);
/// Builds under way in this process: the scratch directories go when the last one ends.
static ACTIVE: parking_lot::Mutex<usize> = parking_lot::Mutex::new(0);

/// Held for a build's whole life (its context included).
pub struct Active {
    dirs: [PathBuf; 2],
}

impl Drop for Active {
    fn drop(&mut self) {
        let mut n = ACTIVE.lock();
        *n -= 1;
        if *n == 0 {
            for d in &self.dirs {
                let _ = std::fs::remove_dir(d);
            }
        }
    }
}

/// A nodefs view of a root mounted on the host; unmounted (its upper dropped) on drop.
struct View<'a> {
    store: &'a dyn FsService,
    info: MountInfo,
    dir: PathBuf,
}

impl Drop for View<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.store.unmount(self.info.id) {
            tracing::warn!(dir = %self.dir.display(), "unmounting a build view: {}", chain(&e));
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Destroys a RUN step's sandbox however the step ends.
struct SandboxGuard<'a> {
    rt: &'a Runtime,
    id: grove_runtime::SandboxId,
}

impl Drop for SandboxGuard<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.rt.destroy(&self.id) {
            tracing::warn!(sandbox = %self.id, "destroying a build sandbox: {}", chain(&e));
        }
    }
}

impl Engine {
    /// Marks a build as running until the guard drops.
    pub fn begin(&self) -> Active {
        *ACTIVE.lock() += 1;
        Active {
            dirs: [self.mounts.clone(), self.uppers.clone()],
        }
    }

    /// Builds the last stage (and the stages it needs); returns its root and config.
    pub fn build(
        &self,
        df: &Dockerfile,
        inp: &Inputs<'_>,
        emit: &mut Emit<'_>,
    ) -> Result<(ManifestId, ImageConfig), BuildError> {
        let globals = global_args(df, inp.build_args);
        let froms: Vec<String> = df
            .stages
            .iter()
            .map(|s| {
                expand(&s.from, &globals).map_err(|reason| BuildError::Line {
                    line: s.line,
                    reason,
                })
            })
            .collect::<Result<_, _>>()?;
        let needed = needed_stages(df, &froms);
        let total: usize = needed.iter().map(|&i| df.stages[i].steps.len() + 1).sum();
        let mut outs: Vec<Option<StageOut>> = vec![None; df.stages.len()];
        let mut step = 0;
        for &i in &needed {
            let out = self.stage(
                df, i, &froms[i], &globals, &outs, inp, &mut step, total, emit,
            )?;
            outs[i] = Some(out);
        }
        let last = outs
            .pop()
            .flatten()
            .expect("the last stage is always needed");
        Ok((last.root, last.cfg))
    }

    #[allow(clippy::too_many_arguments)]
    fn stage(
        &self,
        df: &Dockerfile,
        idx: usize,
        from: &str,
        globals: &BTreeMap<String, String>,
        outs: &[Option<StageOut>],
        inp: &Inputs<'_>,
        step: &mut usize,
        total: usize,
        emit: &mut Emit<'_>,
    ) -> Result<StageOut, BuildError> {
        let st = &df.stages[idx];
        *step += 1;
        let from_text = match &st.name {
            Some(n) => format!("FROM {from} AS {n}"),
            None => format!("FROM {from}"),
        };
        let at = |step: usize, reason: String| BuildError::Step {
            step,
            line: st.line,
            text: from_text.clone(),
            reason,
        };
        if !emit(Progress::Step {
            step: *step,
            total,
            line: st.line,
            text: &from_text,
            cached: None,
        }) {
            return Err(BuildError::Cancelled);
        }
        let base = if from.eq_ignore_ascii_case("scratch") {
            StageOut {
                root: self.empty_root().map_err(|r| at(*step, r.to_string()))?,
                cfg: ImageConfig::default(),
            }
        } else if let Some(j) = df.stage_index(from, idx) {
            outs[j]
                .clone()
                .expect("stages a stage needs are built first")
        } else {
            let (root, cfg) = (inp.base)(from).map_err(|r| at(*step, r.to_string()))?;
            StageOut {
                root,
                cfg: cfg.unwrap_or_default(),
            }
        };
        let mut s = State {
            root: base.root,
            cfg: base.cfg,
            shell: vec!["/bin/sh".into(), "-c".into()],
            args: BTreeMap::new(),
            cmd_here: false,
        };
        for ins in &st.steps {
            *step += 1;
            let n = *step;
            let fail = |reason: String| BuildError::Step {
                step: n,
                line: ins.line,
                text: ins.text.clone(),
                reason,
            };
            self.step(df, idx, ins, &mut s, globals, outs, inp, n, total, emit)
                .map_err(|e| match e {
                    StepError::Cancelled => BuildError::Cancelled,
                    StepError::Failed(r) => fail(r),
                })?;
        }
        Ok(StageOut {
            root: s.root,
            cfg: s.cfg,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn step(
        &self,
        df: &Dockerfile,
        idx: usize,
        ins: &Instr,
        s: &mut State,
        globals: &BTreeMap<String, String>,
        outs: &[Option<StageOut>],
        inp: &Inputs<'_>,
        n: usize,
        total: usize,
        emit: &mut Emit<'_>,
    ) -> Result<(), StepError> {
        let vars = s.vars();
        let x = |t: &str| expand(t, &vars).map_err(StepError::Failed);
        let announce = |emit: &mut Emit<'_>, cached: Option<bool>| {
            if emit(Progress::Step {
                step: n,
                total,
                line: ins.line,
                text: &ins.text,
                cached,
            }) {
                Ok(())
            } else {
                Err(StepError::Cancelled)
            }
        };
        match &ins.kind {
            Kind::Env(kv) => {
                announce(emit, None)?;
                for (k, v) in kv {
                    let v = x(v)?;
                    s.cfg
                        .env
                        .retain(|e| e.split_once('=').map(|p| p.0) != Some(k));
                    s.cfg.env.push(format!("{k}={v}"));
                }
            }
            Kind::Arg(k, default) => {
                announce(emit, None)?;
                let v = match inp.build_args.get(k) {
                    Some(v) => Some(v.clone()),
                    None => match default {
                        Some(d) => Some(x(d)?),
                        None => globals.get(k).cloned(),
                    },
                };
                s.args.insert(k.clone(), v.unwrap_or_default());
            }
            Kind::Label(kv) => {
                announce(emit, None)?;
                for (k, v) in kv {
                    s.cfg.labels.insert(x(k)?, x(v)?);
                }
            }
            Kind::Expose(ports) => {
                announce(emit, None)?;
                for p in ports {
                    let p = normalize_port(&x(p)?)?;
                    if !s.cfg.exposed_ports.contains(&p) {
                        s.cfg.exposed_ports.push(p);
                    }
                }
                s.cfg.exposed_ports.sort();
            }
            Kind::User(u) => {
                announce(emit, None)?;
                let u = x(u)?;
                if u.is_empty() || u.contains(char::is_whitespace) {
                    return Err(StepError::Failed(format!("USER {u:?} is not a user")));
                }
                s.cfg.user = Some(u);
            }
            Kind::Shell(sh) => {
                announce(emit, None)?;
                s.shell = sh.clone();
            }
            Kind::Cmd(c) => {
                announce(emit, None)?;
                s.cfg.cmd = Some(argv_of(c, &s.shell));
                s.cmd_here = true;
            }
            Kind::Entrypoint(c) => {
                announce(emit, None)?;
                s.cfg.entrypoint = Some(argv_of(c, &s.shell));
                if !s.cmd_here {
                    s.cfg.cmd = None;
                }
            }
            Kind::Workdir(w) => {
                let w = absolute(&s.workdir(), &x(w)?);
                let key = cache_key(&s.root, &format!("WORKDIR {w}"), &[]);
                let cached = self.cached(&key)?;
                announce(emit, Some(cached.is_some()))?;
                s.root = match cached {
                    Some(r) => r,
                    None => self.in_view(&s.root, &key, |root| {
                        root.mkdir_all(&w).map_err(|error| StepFailure::Confined {
                            what: format!("making {w}"),
                            error,
                        })
                    })?,
                };
                s.cfg.working_dir = Some(w);
            }
            Kind::Run(c) => {
                let argv = argv_of(c, &s.shell);
                let env = run_env(s);
                let cwd = s.workdir();
                let user = s.cfg.user.clone();
                let resolved = serde_json::json!({
                    "argv": argv, "env": env, "cwd": cwd, "user": user,
                    "network": inp.network,
                })
                .to_string();
                let key = cache_key(&s.root, &format!("RUN {resolved}"), &[]);
                let cached = self.cached(&key)?;
                announce(emit, Some(cached.is_some()))?;
                s.root = match cached {
                    Some(r) => r,
                    None => self.run(&s.root, &key, argv, env, cwd, user, inp.network, emit)?,
                };
            }
            Kind::Copy(c) => {
                let c = Copy {
                    add: c.add,
                    srcs: c.srcs.iter().map(|v| x(v)).collect::<Result<_, _>>()?,
                    dst: absolute(&s.workdir(), &x(&c.dst)?),
                    from: c.from.clone(),
                    chown: c.chown.as_deref().map(x).transpose()?,
                    chmod: c.chmod,
                };
                // A trailing `/` (kept by `absolute`) says "into this directory".
                let dst_dir = c.dst.ends_with('/');
                self.copy(df, idx, &c, dst_dir, s, outs, inp, announce, emit)?;
            }
        }
        Ok(())
    }

    /// A store ref for `key`, if this step was done before (a hit counts as a use).
    fn cached(&self, key: &str) -> Result<Option<ManifestId>, StepError> {
        let hit = self
            .store
            .get_ref(&format!("{CACHE_PREFIX}{key}"))
            .map_err(|e| StepError::Failed(format!("reading the build cache: {}", chain(&e))))?;
        if hit.is_some() {
            self.cache
                .touch(key, grove_runtime::now_ms())
                .map_err(|e| StepError::Failed(e.to_string()))?;
        }
        Ok(hit)
    }

    /// Records `root` as the result of `key` (a ref, so gc keeps it while the cache does).
    fn remember(&self, key: &str, root: &ManifestId) -> Result<(), StepFailure> {
        self.cache.touch(key, grove_runtime::now_ms())?;
        self.store
            .set_ref(&format!("{CACHE_PREFIX}{key}"), root)
            .map_err(|error| StepFailure::Store {
                what: "writing the build cache".into(),
                error,
            })
    }

    /// Prunes the step cache to `policy` if no build is under way (none can start meanwhile:
    /// a build's trees must not lose their refs while it uses them).
    pub fn prune_cache(&self, policy: Policy) -> Result<Pruned, CacheError> {
        let n = ACTIVE.lock();
        if *n > 0 {
            return Err(CacheError::BuildRunning);
        }
        let r = self
            .cache
            .prune(&*self.store, policy, grove_runtime::now_ms());
        drop(n);
        r
    }

    fn empty_root(&self) -> Result<ManifestId, StepFailure> {
        make_dir(&self.uppers)?;
        let d = tempfile::tempdir_in(&self.uppers).map_err(StepFailure::Scratch)?;
        self.store
            .import_dir(d.path(), ImportPolicy::Cdc, None)
            .map_err(|error| StepFailure::Store {
                what: "making an empty root".into(),
                error,
            })
    }

    fn view(&self, root: &ManifestId, read_only: bool) -> Result<View<'_>, StepFailure> {
        let n = VIEW_SEQ.fetch_add(1, Ordering::Relaxed);
        let name = format!("v{}-{n}", std::process::id());
        let dir = self.mounts.join(&name);
        make_dir(&dir)?;
        make_dir(&self.uppers)?;
        let opts = MountOptions {
            quota_bytes: None,
            quota_inodes: None,
            upper_dir: self.uppers.join(&name),
            read_only,
            passthrough: false,
            uring: true,
            id_shift: None,
        };
        match self.store.mount(root, &dir, &opts) {
            Ok(info) => Ok(View {
                store: self.store.as_ref(),
                info,
                dir,
            }),
            Err(e) => {
                let _ = std::fs::remove_dir(&dir);
                Err(StepFailure::Store {
                    what: format!("mounting a view of {}", root.to_hex()),
                    error: e,
                })
            }
        }
    }

    /// Mounts `root`, lets `f` change it, commits the result and caches it under `key`.
    fn in_view(
        &self,
        root: &ManifestId,
        key: &str,
        f: impl FnOnce(&ConfinedRoot) -> Result<(), StepFailure>,
    ) -> Result<ManifestId, StepError> {
        let v = self.view(root, false)?;
        let r = ConfinedRoot::open_dir(&v.dir)
            .map_err(|e| StepError::Failed(format!("opening the view: {e}")))?;
        f(&r)?;
        drop(r);
        let id = self
            .store
            .commit(v.info.id)
            .map_err(|e| StepError::Failed(format!("committing: {}", chain(&e))))?;
        // While the view lives its commit is pinned; the ref keeps it after.
        self.remember(key, &id)?;
        drop(v);
        Ok(id)
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        root: &ManifestId,
        key: &str,
        argv: Vec<String>,
        env: BTreeMap<String, String>,
        cwd: String,
        user: Option<String>,
        network: &NetworkPolicy,
        emit: &mut Emit<'_>,
    ) -> Result<ManifestId, StepError> {
        let f = |what: &str, e: &dyn std::error::Error| {
            StepError::Failed(format!("{what}: {}", chain(e)))
        };
        let spec = SandboxSpec {
            image: root.to_hex(),
            env: env.clone(),
            workdir: Some(cwd.clone()),
            network: network.clone(),
            labels: BTreeMap::from([(BUILD_LABEL.to_string(), "run".to_string())]),
            ..Default::default()
        };
        let info = self
            .runtime
            .create(spec)
            .map_err(|e| f("making the step's sandbox", &e))?;
        let guard = SandboxGuard {
            rt: &self.runtime,
            id: info.id.clone(),
        };
        let mut env = env;
        let argv = match user {
            // Exec as a user is not in the runtime yet: setpriv in the sandbox drops to it.
            Some(u) => {
                let passwd = self.runtime.read_file(&guard.id, "/etc/passwd").ok();
                let group = self.runtime.read_file(&guard.id, "/etc/group").ok();
                let (uid, gid, home) = resolve_user(&u, passwd.as_deref(), group.as_deref())?;
                if let Some(h) = home {
                    env.entry("HOME".into()).or_insert(h);
                }
                if uid == 0 && gid == 0 {
                    argv
                } else {
                    let mut v = vec![
                        "setpriv".to_string(),
                        format!("--reuid={uid}"),
                        format!("--regid={gid}"),
                        "--clear-groups".to_string(),
                        "--".to_string(),
                    ];
                    v.extend(argv);
                    v
                }
            }
            None => argv,
        };
        let req = ExecRequest {
            argv,
            env,
            cwd: Some(cwd),
            max_output_bytes: Some(0),
            ..Default::default()
        };
        let mut gone = false;
        let res = self.runtime.exec_stream_while(&guard.id, req, &mut |c| {
            let (stderr, data) = match &c {
                OutputChunk::Stdout(d) => (false, d),
                OutputChunk::Stderr(d) => (true, d),
            };
            let ok = emit(Progress::Output { stderr, data });
            gone |= !ok;
            ok
        });
        if gone {
            return Err(StepError::Cancelled);
        }
        let r = res.map_err(|e| f("running", &e))?;
        if r.exit_code != Some(0) {
            return Err(StepError::Failed(match (r.exit_code, r.signal) {
                (_, Some(sig)) => format!("the command was killed by signal {sig}"),
                (Some(c), _) => format!("the command exited with code {c}"),
                _ => "the command did not finish".into(),
            }));
        }
        let view = self
            .runtime
            .checkpoint_view(&guard.id)
            .map_err(|e| f("reaching the step's root", &e))?;
        let mount = view
            .root
            .committer()
            .ok_or_else(|| StepError::Failed("RUN needs the nodefs root provider".into()))?;
        let id = nodefs::ObjectId(mount.commit().map_err(|e| f("committing", &e))?);
        self.remember(key, &id)?;
        drop(view);
        drop(guard);
        Ok(id)
    }

    #[allow(clippy::too_many_arguments)]
    fn copy(
        &self,
        df: &Dockerfile,
        idx: usize,
        c: &Copy,
        dst_dir: bool,
        s: &mut State,
        outs: &[Option<StageOut>],
        inp: &Inputs<'_>,
        announce: impl Fn(&mut Emit<'_>, Option<bool>) -> Result<(), StepError>,
        emit: &mut Emit<'_>,
    ) -> Result<(), StepError> {
        let failed = StepError::Failed;
        // The source: the context, or another stage's (or image's) root in a read-only view.
        let (src_view, src_id, ignore) = match &c.from {
            None => (None, None, Some(inp.ignore)),
            Some(from) => {
                let id = match df.stage_index(from, idx) {
                    Some(j) => outs[j]
                        .as_ref()
                        .map(|o| o.root)
                        .ok_or_else(|| failed(format!("--from={from}: stage not built")))?,
                    None if df
                        .stages
                        .iter()
                        .any(|st| st.name.as_deref() == Some(from.as_str())) =>
                    {
                        return Err(failed(format!("--from={from}: a later stage")))
                    }
                    None => (inp.base)(from).map_err(|e| failed(e.to_string()))?.0,
                };
                (Some(self.view(&id, true)?), Some(id), None)
            }
        };
        let src_root = match &src_view {
            Some(v) => ConfinedRoot::open_dir(&v.dir),
            None => ConfinedRoot::open_dir(inp.context),
        }
        .map_err(|e| failed(format!("opening the source: {e}")))?;
        let plan = plan_copy(&src_root, c, dst_dir, ignore)?;
        // Context files are hashed (their content is the key); a stage's are named by its root.
        let digest = match &src_id {
            Some(id) => id.to_hex().into_bytes(),
            None => digest_plan(&src_root, &plan)?,
        };
        let text = format!(
            "{} {:?} {:?} chown={:?} chmod={:?} from={:?}",
            if c.add { "ADD" } else { "COPY" },
            c.srcs,
            c.dst,
            c.chown,
            c.chmod,
            c.from
        );
        let key = cache_key(&s.root, &text, &digest);
        let cached = self.cached(&key)?;
        announce(emit, Some(cached.is_some()))?;
        s.root = match cached {
            Some(r) => r,
            None => self.in_view(&s.root, &key, |dst| {
                let owner = match &c.chown {
                    Some(spec) => Some(resolve_owner(dst, spec)?),
                    None => None,
                };
                for item in &plan {
                    apply_item(&src_root, dst, item, owner, c.chmod, c.add)?;
                }
                Ok(())
            })?,
        };
        Ok(())
    }

    /// After a crash: views no process serves any more and sandboxes of RUN steps that never
    /// ended. Call with no build running.
    pub fn clean_stale(&self) {
        if let Ok(ms) = self.store.mounts() {
            for m in ms.iter().filter(|m| m.mountpoint.starts_with(&self.mounts)) {
                if let Err(e) = self.store.unmount(m.id) {
                    tracing::warn!("unmounting a stale build view: {}", chain(&e));
                }
            }
        }
        for sb in self.runtime.list() {
            if sb.spec.labels.contains_key(BUILD_LABEL) {
                if let Err(e) = self.runtime.destroy(&sb.id) {
                    tracing::warn!(sandbox = %sb.id, "removing a stale build sandbox: {}", chain(&e));
                }
            }
        }
        for d in [&self.mounts, &self.uppers] {
            if let Ok(rd) = std::fs::read_dir(d) {
                for e in rd.flatten() {
                    let p = e.path();
                    if std::fs::remove_dir(&p).is_err() {
                        let _ = std::fs::remove_dir_all(&p);
                    }
                }
            }
        }
    }
}

#[derive(Debug)]
enum StepError {
    Failed(String),
    Cancelled,
}

/// What a filesystem step's helpers fail with, saying what they were doing and on which
/// path, user or port; a step renders it into its reason ([`BuildError::Step`]).
#[derive(Debug, thiserror::Error)]
enum StepFailure {
    /// A directory of the node's own (the views' mount points, the upper dirs).
    #[error("{}: {error}", .path.display())]
    Dir {
        path: PathBuf,
        error: std::io::Error,
    },
    /// The scratch directory an empty root is made from.
    #[error("scratch: {0}")]
    Scratch(std::io::Error),
    /// The content store refused what the step asked of it (`what` it was doing).
    #[error("{what}: {}", chain(.error))]
    Store { what: String, error: nodefs::Error },
    /// The step cache's index.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// A path in a view, refused by its confined root (`what`: the path or the copy).
    #[error("{what}: {error}")]
    Confined {
        what: String,
        error: grove_runtime::Error,
    },
    /// A source file that could not be read (`what`: the file, or reading it).
    #[error("{what}: {error}")]
    Read { what: String, error: std::io::Error },
    /// A COPY source, refused by the source's confined root.
    #[error("{0}")]
    Source(grove_runtime::Error),
    /// A COPY glob that matches nothing.
    #[error("no source files match {0:?}")]
    NoMatch(String),
    /// A COPY source the context (or stage) lacks, or that .dockerignore excludes.
    #[error("{0:?} is not in the source")]
    NotInSource(String),
    /// A COPY source that was there a moment ago.
    #[error("{0:?} vanished")]
    Vanished(String),
    /// Several COPY sources into a destination not marked as a directory.
    #[error("copying several sources, the destination {0:?} must end with /")]
    DestNotDir(String),
    /// USER or --chown naming a user the image's /etc/passwd lacks.
    #[error("user {0:?} is not in the image's /etc/passwd")]
    UnknownUser(String),
    /// --chown naming a group the image's /etc/group lacks.
    #[error("group {0:?} is not in the image's /etc/group")]
    UnknownGroup(String),
    /// EXPOSE with what is not a port.
    #[error("EXPOSE {0:?}: not PORT[/tcp|udp|sctp]")]
    BadPort(String),
}

impl From<StepFailure> for StepError {
    fn from(e: StepFailure) -> Self {
        StepError::Failed(e.to_string())
    }
}

/// One thing to copy: a context-relative source path and where it lands.
#[derive(Debug)]
struct Item {
    src: String,
    dst: String,
    kind: &'static str,
    /// A single source named as the destination: if that is an existing directory, the source
    /// goes into it under this name.
    into_dir: Option<String>,
}

/// Every file, directory and link a COPY takes, in order (parents before children).
fn plan_copy(
    src: &ConfinedRoot,
    c: &Copy,
    dst_dir: bool,
    ignore: Option<&Ignore>,
) -> Result<Vec<Item>, StepFailure> {
    let excluded = |p: &str| ignore.is_some_and(|i| !p.is_empty() && i.excluded(p));
    let mut tops: Vec<String> = Vec::new();
    for pat in &c.srcs {
        let pat = glob::clean(pat);
        if glob::has_magic(&pat) {
            let mut found: Vec<String> = walk(src, "")?
                .into_iter()
                .filter(|(p, _)| glob::matches(&pat, p) && !excluded(p))
                .map(|(p, _)| p)
                .collect();
            if found.is_empty() {
                return Err(StepFailure::NoMatch(pat));
            }
            found.sort();
            tops.extend(found);
        } else {
            if excluded(&pat) || src.lstat(&format!("/{pat}")).ok().flatten().is_none() {
                return Err(StepFailure::NotInSource(if pat.is_empty() {
                    ".".into()
                } else {
                    pat
                }));
            }
            tops.push(pat);
        }
    }
    let many = tops.len() > 1 || c.srcs.iter().any(|p| glob::has_magic(p));
    if many && !dst_dir {
        return Err(StepFailure::DestNotDir(c.dst.clone()));
    }
    let mut items = Vec::new();
    for top in tops {
        let shown = format!("/{top}");
        let (kind, _) = src
            .lstat(&shown)
            .map_err(StepFailure::Source)?
            .ok_or_else(|| StepFailure::Vanished(top.clone()))?;
        if kind == "dir" {
            // A directory's contents go into the destination, not the directory itself.
            items.push(Item {
                src: top.clone(),
                dst: c.dst.clone(),
                kind: "dir",
                into_dir: None,
            });
            for (p, k) in walk(src, &top)? {
                if excluded(&p) {
                    continue;
                }
                let rel = p.strip_prefix(&top).unwrap_or(&p).trim_start_matches('/');
                items.push(Item {
                    src: p.clone(),
                    dst: format!("{}/{rel}", c.dst.trim_end_matches('/')),
                    kind: k,
                    into_dir: None,
                });
            }
        } else {
            let base = top.rsplit('/').next().unwrap_or(&top);
            let (dst, into_dir) = if dst_dir || many {
                (format!("{}/{base}", c.dst.trim_end_matches('/')), None)
            } else {
                (c.dst.clone(), Some(base.to_string()))
            };
            items.push(Item {
                src: top,
                dst,
                kind,
                into_dir,
            });
        }
    }
    Ok(items)
}

/// Every entry below `dir` (relative paths, parents first); symlinks are listed, never followed.
fn walk(root: &ConfinedRoot, dir: &str) -> Result<Vec<(String, &'static str)>, StepFailure> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_string()];
    while let Some(d) = stack.pop() {
        let entries = root
            .list(&format!("/{d}"))
            .map_err(|error| StepFailure::Confined {
                what: format!("listing {d:?}"),
                error,
            })?;
        for e in entries {
            let p = if d.is_empty() {
                e.name.clone()
            } else {
                format!("{d}/{}", e.name)
            };
            let kind = match e.kind.as_str() {
                "dir" => "dir",
                "file" => "file",
                "symlink" => "symlink",
                _ => continue,
            };
            if kind == "dir" {
                stack.push(p.clone());
            }
            out.push((p, kind));
        }
    }
    out.sort();
    Ok(out)
}

/// The digest of what a context COPY takes: paths, kinds, modes, contents, link targets.
fn digest_plan(src: &ConfinedRoot, plan: &[Item]) -> Result<Vec<u8>, StepFailure> {
    let mut h = Sha256::new();
    for it in plan {
        let shown = format!("/{}", it.src);
        let mode = src
            .lstat(&shown)
            .map_err(StepFailure::Source)?
            .map(|(_, m)| m)
            .unwrap_or(0);
        h.update(format!("{}\0{}\0{}\0{mode:o}\0", it.src, it.dst, it.kind).as_bytes());
        match it.kind {
            "file" => {
                let (mut f, _) = src.open_read(&shown).map_err(StepFailure::Source)?;
                let mut buf = vec![0u8; 256 << 10];
                loop {
                    let n = f.read(&mut buf).map_err(|error| StepFailure::Read {
                        what: format!("reading {shown}"),
                        error,
                    })?;
                    if n == 0 {
                        break;
                    }
                    h.update(&buf[..n]);
                }
            }
            "symlink" => h.update(
                src.read_link(&shown)
                    .map_err(StepFailure::Source)?
                    .as_bytes(),
            ),
            _ => {}
        }
        h.update(b"\n");
    }
    Ok(h.finalize().to_vec())
}

fn apply_item(
    src: &ConfinedRoot,
    dst: &ConfinedRoot,
    it: &Item,
    owner: Option<(u32, u32)>,
    chmod: Option<u32>,
    add: bool,
) -> Result<(), StepFailure> {
    let shown = format!("/{}", it.src);
    let e = |error: grove_runtime::Error| StepFailure::Confined {
        what: format!("{} -> {}", it.src, it.dst),
        error,
    };
    if let Some(base) = &it.into_dir {
        if matches!(dst.lstat(&it.dst).map_err(e)?, Some(("dir", _))) {
            let it = Item {
                src: it.src.clone(),
                dst: format!("{}/{base}", it.dst.trim_end_matches('/')),
                kind: it.kind,
                into_dir: None,
            };
            return apply_item(src, dst, &it, owner, chmod, add);
        }
    }
    match it.kind {
        "dir" => {
            dst.mkdir_all(&it.dst).map_err(e)?;
            let mode = src.lstat(&shown).map_err(e)?.map(|(_, m)| m);
            dst.set_owner_mode(&it.dst, owner, chmod.or(mode))
                .map_err(e)?;
        }
        "file" => {
            let (mut f, _) = src.open_read(&shown).map_err(e)?;
            let read = |error| StepFailure::Read {
                what: shown.clone(),
                error,
            };
            if add && is_archive(&mut f).map_err(read)? {
                // ADD unpacks a local tar (plain or gzip) into the destination directory.
                let mut head = [0u8; 2];
                let (mut f, _) = src.open_read(&shown).map_err(e)?;
                let gz = f.read_exact(&mut head).is_ok() && head == [0x1f, 0x8b];
                let (f, _) = src.open_read(&shown).map_err(e)?;
                let mut r: Box<dyn Read> = if gz {
                    Box::new(flate2::read::GzDecoder::new(f))
                } else {
                    Box::new(f)
                };
                return dst.upload_tar(&it.dst, &mut r).map_err(e);
            }
            let mode = src
                .lstat(&shown)
                .map_err(e)?
                .map(|(_, m)| m)
                .unwrap_or(0o644);
            dst.write_from(&it.dst, &mut f, Some(chmod.unwrap_or(mode)))
                .map_err(e)?;
            if owner.is_some() {
                dst.set_owner_mode(&it.dst, owner, None).map_err(e)?;
            }
        }
        _ => {
            let target = src.read_link(&shown).map_err(e)?;
            if let Some((parent, _)) = it.dst.rsplit_once('/') {
                dst.mkdir_all(if parent.is_empty() { "/" } else { parent })
                    .map_err(e)?;
            }
            dst.make_symlink(&it.dst, &target).map_err(e)?;
            if owner.is_some() {
                dst.set_owner_mode(&it.dst, owner, None).map_err(e)?;
            }
        }
    }
    Ok(())
}

/// Makes `path` and its parents.
fn make_dir(path: &Path) -> Result<(), StepFailure> {
    std::fs::create_dir_all(path).map_err(|error| StepFailure::Dir {
        path: path.into(),
        error,
    })
}

/// A tar (ustar magic at 257) or a gzip stream (which ADD takes to be a gzipped tar).
fn is_archive(f: &mut std::fs::File) -> std::io::Result<bool> {
    let mut head = vec![0u8; 512];
    let mut got = 0;
    while got < head.len() {
        match f.read(&mut head[got..])? {
            0 => break,
            n => got += n,
        }
    }
    Ok((got >= 2 && head[..2] == [0x1f, 0x8b]) || (got >= 262 && &head[257..262] == b"ustar"))
}

/// `user[:group]` by name (the destination's /etc/passwd and /etc/group) or number.
fn resolve_owner(root: &ConfinedRoot, spec: &str) -> Result<(u32, u32), StepFailure> {
    let passwd = root.read("/etc/passwd").ok();
    let group = root.read("/etc/group").ok();
    let (u, g, _) = resolve_user(spec, passwd.as_deref(), group.as_deref())?;
    Ok((u, g))
}

/// Resolves `user[:group]` against passwd/group texts: (uid, gid, home).
fn resolve_user(
    spec: &str,
    passwd: Option<&[u8]>,
    group: Option<&[u8]>,
) -> Result<(u32, u32, Option<String>), StepFailure> {
    let (user, grp) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    let find = |text: Option<&[u8]>, name: &str, col: usize| -> Option<Vec<String>> {
        let text = String::from_utf8_lossy(text?).into_owned();
        text.lines()
            .map(|l| l.split(':').map(String::from).collect::<Vec<_>>())
            .find(|f| f.len() > col && (f[0] == name || f[2] == name))
    };
    let pw = find(passwd, user, 3);
    let uid = match user.parse::<u32>() {
        Ok(n) => n,
        Err(_) => pw
            .as_ref()
            .and_then(|f| f[2].parse().ok())
            .ok_or_else(|| StepFailure::UnknownUser(user.into()))?,
    };
    let gid = match grp {
        Some(g) => match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => find(group, g, 2)
                .and_then(|f| f[2].parse().ok())
                .ok_or_else(|| StepFailure::UnknownGroup(g.into()))?,
        },
        None => pw.as_ref().and_then(|f| f[3].parse().ok()).unwrap_or(uid),
    };
    let home = pw.and_then(|f| f.get(5).cloned()).filter(|h| !h.is_empty());
    Ok((uid, gid, home))
}

fn run_env(s: &State) -> BTreeMap<String, String> {
    // ARGs reach RUN as env; ENV wins over them.
    let mut env = s.args.clone();
    env.extend(s.cfg.env_map());
    env.entry("PATH".into())
        .or_insert_with(|| DEFAULT_PATH.into());
    env
}

fn argv_of(c: &CmdForm, shell: &[String]) -> Vec<String> {
    match c {
        CmdForm::Exec(v) => v.clone(),
        CmdForm::Shell(s) => {
            let mut v = shell.to_vec();
            v.push(s.clone());
            v
        }
    }
}

/// `p` made absolute against `cwd` and normalized (`..` stops at `/`).
fn absolute(cwd: &str, p: &str) -> String {
    let joined = if p.starts_with('/') {
        p.to_string()
    } else {
        format!("{cwd}/{p}")
    };
    let mut out: Vec<&str> = Vec::new();
    for c in joined.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            c => out.push(c),
        }
    }
    let mut s = format!("/{}", out.join("/"));
    if p.ends_with('/') && s != "/" {
        s.push('/');
    }
    s
}

fn normalize_port(p: &str) -> Result<String, StepFailure> {
    let (num, proto) = match p.split_once('/') {
        Some((n, pr)) => (n, pr.to_ascii_lowercase()),
        None => (p, "tcp".to_string()),
    };
    let ok =
        num.parse::<u16>().is_ok_and(|n| n > 0) && matches!(proto.as_str(), "tcp" | "udp" | "sctp");
    if ok {
        Ok(format!("{num}/{proto}"))
    } else {
        Err(StepFailure::BadPort(p.into()))
    }
}

fn cache_key(parent: &ManifestId, text: &str, digest: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(b"grove-build-v1\0");
    h.update(parent.to_hex().as_bytes());
    h.update(b"\0");
    h.update(text.as_bytes());
    h.update(b"\0");
    h.update(digest);
    hex_of(&h.finalize())
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The global ARGs with their defaults, overridden by `--build-arg`.
fn global_args(df: &Dockerfile, given: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut v = BTreeMap::new();
    for (k, d) in &df.global_args {
        let val = given
            .get(k)
            .cloned()
            .or_else(|| d.as_ref().map(|d| expand(d, &v).unwrap_or_default()))
            .unwrap_or_default();
        v.insert(k.clone(), val);
    }
    v
}

/// The stages the last one needs (through FROM and COPY --from), in file order.
fn needed_stages(df: &Dockerfile, froms: &[String]) -> Vec<usize> {
    let mut need = BTreeSet::new();
    let mut todo = vec![df.stages.len() - 1];
    while let Some(i) = todo.pop() {
        if !need.insert(i) {
            continue;
        }
        if let Some(j) = df.stage_index(&froms[i], i) {
            todo.push(j);
        }
        for ins in &df.stages[i].steps {
            if let Kind::Copy(Copy { from: Some(f), .. }) = &ins.kind {
                if let Some(j) = df.stage_index(f, i) {
                    todo.push(j);
                }
            }
        }
    }
    need.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_ports_users() {
        assert_eq!(absolute("/app", "src"), "/app/src");
        assert_eq!(absolute("/app", "../../x/"), "/x/");
        assert_eq!(absolute("/", "/a/./b"), "/a/b");
        assert_eq!(normalize_port("80").unwrap(), "80/tcp");
        assert_eq!(normalize_port("53/UDP").unwrap(), "53/udp");
        assert!(normalize_port("0").is_err());
        assert!(normalize_port("80/xyz").is_err());
        let pw = b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1001::/home/app:/bin/sh\n";
        let gr = b"root:x:0:\nstaff:x:50:\n";
        assert_eq!(
            resolve_user("app", Some(pw), Some(gr)).unwrap(),
            (1000, 1001, Some("/home/app".into()))
        );
        assert_eq!(resolve_user("app:staff", Some(pw), Some(gr)).unwrap().1, 50);
        assert_eq!(resolve_user("7:8", None, None).unwrap(), (7, 8, None));
        assert!(resolve_user("nobody2", Some(pw), Some(gr)).is_err());
        // The step's reason names what was wrong, as the text it always was.
        assert_eq!(
            normalize_port("80/xyz").unwrap_err().to_string(),
            "EXPOSE \"80/xyz\": not PORT[/tcp|udp|sctp]"
        );
        assert_eq!(
            resolve_user("nobody2", Some(pw), Some(gr))
                .unwrap_err()
                .to_string(),
            "user \"nobody2\" is not in the image's /etc/passwd"
        );
        assert_eq!(
            resolve_user("app:wheel", Some(pw), Some(gr))
                .unwrap_err()
                .to_string(),
            "group \"wheel\" is not in the image's /etc/group"
        );
    }

    #[test]
    fn stages_needed_by_the_last() {
        let df = super::super::dockerfile::parse(
            "FROM scratch AS a\nFROM scratch AS unused\nFROM a AS b\nFROM scratch\nCOPY --from=b / /\n",
        )
        .unwrap();
        let froms: Vec<String> = df.stages.iter().map(|s| s.from.clone()).collect();
        assert_eq!(needed_stages(&df, &froms), vec![0, 2, 3]);
    }
}
