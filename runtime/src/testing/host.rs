//! A recording fake of the host (`crate::host::HostParts` and a `RootProvider`): every call is
//! journaled with its sandbox and outcome, any call can be made to fail once, and what it makes
//! lives in a tempdir (empty cgroup dirs, each with a `cgroup.procs` file beside it; upper dirs)
//! or in its tables (links, leases), so a test sees exactly what is left. Inits are real unprivileged child processes
//! (`sleep`): their pidfds, deaths and reaping are the runtime's own code at work.

use std::collections::{HashMap, HashSet};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::cgroup::{self, CgroupBackend, CgroupError, CgroupUsage};
use crate::client::ClientError;
use crate::error::Error;
use crate::host::{HostParts, InitControl, InitStore, SandboxNet, Spawner};
use crate::hostname::HostnameError;
use crate::init_handle::{HandleError, InitHandle};
use crate::network::{host_if, NetError, NetLease};
use crate::proto::SetupConfig;
use crate::root::{DiskQuota, DiskUsage, RootError, RootMount, RootProvider};
use crate::spawner::{SetupFailure, SpawnError};
use crate::types::{EgressRule, Limits, PortMapping, SandboxId};
use crate::userns::IdRange;

/// A host call the runtime made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Prepare,
    Unprepare,
    InitInstall,
    InitRemove,
    RootMount,
    RootReattach,
    RootUnmount,
    CgroupCreate,
    CgroupFreeze,
    CgroupThaw,
    CgroupKill,
    CgroupRemove,
    Spawn,
    Ping,
    SetHostname,
    NetSetup,
    NetTeardown,
    NetRestore,
    LinkRemove,
}

impl Op {
    /// The call that undoes what this one made, if it makes something.
    pub fn undo(self) -> Option<Op> {
        match self {
            Op::RootMount | Op::RootReattach => Some(Op::RootUnmount),
            Op::CgroupCreate => Some(Op::CgroupRemove),
            // Pid 1 dies with everything in its cgroups.
            Op::Spawn => Some(Op::CgroupKill),
            Op::NetSetup => Some(Op::NetTeardown),
            _ => None,
        }
    }
}

/// One journal entry: `id` is the sandbox's ("" for calls about the whole instance).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub op: Op,
    pub id: String,
    pub ok: bool,
}

const INJECTED: &str = "injected failure";

#[derive(Default)]
struct State {
    journal: Vec<Call>,
    /// Ops whose next call fails.
    faults: HashSet<Op>,
    /// Ops whose next call takes this long (slept after it is journaled, outside the lock).
    slow: HashMap<Op, Duration>,
    /// The next spawned init exits right after it reported ready.
    die_after_ready: bool,
    /// The next spawn puts a directory where the sandbox's record goes (its write then fails).
    block_record: bool,
    /// Every init started (pid → sandbox), reaped or not.
    inits: HashMap<i32, String>,
    /// Inits that do not answer a ping.
    deaf: HashSet<i32>,
    hostnames: HashMap<i32, String>,
    links: HashSet<String>,
    leases: HashMap<String, NetLease>,
    next_index: u32,
    /// Roots whose server "died": `reattach` finds nothing.
    lost_roots: HashSet<String>,
}

/// The fake host; one per test node, shared by every runtime started on it (it outlives a
/// runtime as a host outlives a daemon's restart).
pub struct FakeHost {
    dir: PathBuf,
    table: String,
    /// Shared with the roots it mounted, which journal their unmounts.
    st: Arc<Mutex<State>>,
}

impl FakeHost {
    pub fn new(dir: &Path, table: &str) -> Arc<FakeHost> {
        std::fs::create_dir_all(dir.join("cgroup")).unwrap();
        std::fs::create_dir_all(dir.join("procs")).unwrap();
        std::fs::create_dir_all(dir.join("upper")).unwrap();
        Arc::new(FakeHost {
            dir: dir.to_path_buf(),
            table: table.into(),
            st: Arc::default(),
        })
    }

    pub fn parts(self: &Arc<Self>) -> HostParts {
        HostParts {
            cgroups: self.clone(),
            net: self.clone(),
            spawner: self.clone(),
            inits: self.clone(),
            init_store: self.clone(),
        }
    }

    fn call(&self, op: Op, id: &str) -> Result<(), ()> {
        call(&self.st, op, id)
    }

    /// The next call of `op` fails (after it is journaled).
    pub fn fail(&self, op: Op) {
        self.st.lock().faults.insert(op);
    }

    /// The next call of `op` takes `d`: something else can happen while it is under way.
    pub fn slow(&self, op: Op, d: Duration) {
        self.st.lock().slow.insert(op, d);
    }

    pub fn init_dies_after_ready(&self) {
        self.st.lock().die_after_ready = true;
    }

    pub fn block_record(&self) {
        self.st.lock().block_record = true;
    }

    pub fn journal(&self) -> Vec<Call> {
        self.st.lock().journal.clone()
    }

    /// The calls about sandbox `id`, in order.
    pub fn calls(&self, id: &str) -> Vec<Call> {
        self.journal().into_iter().filter(|c| c.id == id).collect()
    }

    /// Ids of sandboxes the journal has calls for, first seen first.
    pub fn sandboxes(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for c in self.journal() {
            if !c.id.is_empty() && !out.contains(&c.id) {
                out.push(c.id);
            }
        }
        out
    }

    pub fn deafen(&self, pid: i32) {
        self.st.lock().deaf.insert(pid);
    }

    pub fn hostname_of(&self, pid: i32) -> Option<String> {
        self.st.lock().hostnames.get(&pid).cloned()
    }

    /// The veth of `id` vanishes (deleted behind the runtime's back).
    pub fn cut_link(&self, id: &SandboxId) {
        self.st.lock().links.remove(&host_if(id));
    }

    pub fn lose_root(&self, id: &SandboxId) {
        self.st.lock().lost_roots.insert(id.to_string());
    }

    /// The pids of the inits started for `id`.
    pub fn inits_of(&self, id: &str) -> Vec<i32> {
        let st = self.st.lock();
        st.inits
            .iter()
            .filter(|(_, s)| *s == id)
            .map(|(p, _)| *p)
            .collect()
    }

    fn cgroup_dir(&self, id: &str) -> PathBuf {
        self.dir.join("cgroup").join(id)
    }

    /// Outside the cgroup dir, which stays empty so that an rmdir (the sweep's) removes it.
    fn procs(&self, id: &str) -> PathBuf {
        self.dir.join("procs").join(id)
    }

    fn upper(&self, id: &str) -> PathBuf {
        self.dir.join("upper").join(id)
    }

    /// Everything of sandbox `id` on the fake host: cgroups, upper layer, link, lease, its
    /// init processes that are not reaped (zombies included). Empty: nothing is left.
    pub fn held(&self, id: &str) -> Vec<String> {
        let mut out = Vec::new();
        if self.cgroup_dir(id).exists() {
            out.push(format!("cgroup {}", self.cgroup_dir(id).display()));
        }
        if self.upper(id).exists() {
            out.push(format!("upper {}", self.upper(id).display()));
        }
        let st = self.st.lock();
        if let Ok(sid) = id.parse::<SandboxId>() {
            let link = host_if(&sid);
            if st.links.contains(&link) {
                out.push(format!("link {link}"));
            }
            if st.leases.contains_key(&link) {
                out.push(format!("lease {link}"));
            }
        }
        for (pid, _) in st.inits.iter().filter(|(_, s)| *s == id) {
            if unreaped(*pid) {
                out.push(format!("process {pid}"));
            }
        }
        out
    }

    /// Starts an init for sandbox `id`: a real child of this process (in no cgroup yet) that
    /// dies with the test's thread if nothing else kills it.
    pub fn start_init(&self, id: &str) -> i32 {
        let mut cmd = std::process::Command::new("sleep");
        cmd.arg("300");
        // SAFETY: the closure runs in the forked child before exec and makes one prctl call.
        unsafe {
            cmd.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                    .map_err(std::io::Error::from)
            });
        }
        let pid = cmd.spawn().expect("start a fake init (sleep)").id() as i32;
        self.st.lock().inits.insert(pid, id.into());
        pid
    }

    /// An init as CRIU restores one: started inside the sandbox's cgroups.
    pub fn restore_init(&self, id: &str) -> i32 {
        let pid = self.start_init(id);
        append_pid(&self.procs(id), pid);
        pid
    }
}

/// Journals `op` for `id`; Err when a fault was set for it (consumed), after a delay set for it.
fn call(st: &Mutex<State>, op: Op, id: &str) -> Result<(), ()> {
    let (ok, slow) = {
        let mut st = st.lock();
        let ok = !st.faults.remove(&op);
        st.journal.push(Call {
            op,
            id: id.into(),
            ok,
        });
        (ok, st.slow.remove(&op))
    };
    if let Some(d) = slow {
        std::thread::sleep(d);
    }
    ok.then_some(()).ok_or(())
}

/// Whether `pid` still exists (running or a zombie nobody reaped).
pub fn unreaped(pid: i32) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
}

/// Whether `pid` runs (not dead, not a zombie).
pub fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| Some(s[s.rfind(')')? + 2..].starts_with('Z')))
        .is_some_and(|zombie| !zombie)
}

fn append_pid(procs: &Path, pid: i32) {
    let mut text = std::fs::read_to_string(procs).unwrap_or_default();
    text += &format!("{pid}\n");
    std::fs::write(procs, text).unwrap();
}

fn sigkill(pid: i32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
}

/// Waits until `pid` no longer runs (it is our child: it stays a zombie until reaped).
fn wait_dead(pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while running(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn cg_err(op: &'static str, path: &Path) -> CgroupError {
    CgroupError::new(op, path, std::io::Error::other(INJECTED))
}

impl CgroupBackend for FakeHost {
    fn prepare(&self) -> cgroup::Result<()> {
        self.call(Op::Prepare, "")
            .map_err(|()| cg_err("mkdir", &self.dir.join("cgroup")))
    }

    fn unprepare(&self) {
        let _ = self.call(Op::Unprepare, "");
    }

    fn create(&self, id: &str, _limits: &Limits) -> cgroup::Result<()> {
        let dir = self.cgroup_dir(id);
        self.call(Op::CgroupCreate, id)
            .map_err(|()| cg_err("mkdir", &dir))?;
        std::fs::create_dir(&dir).map_err(|e| CgroupError::new("mkdir", &dir, e))?;
        std::fs::write(self.procs(id), "").map_err(|e| CgroupError::new("create", &dir, e))
    }

    fn procs_files(&self, id: &str) -> Vec<PathBuf> {
        vec![self.procs(id)]
    }

    fn criu_paths(&self, id: &str) -> Vec<(String, PathBuf)> {
        vec![("fake".into(), PathBuf::from(&self.table).join(id))]
    }

    fn freeze(&self, id: &str) -> cgroup::Result<()> {
        self.call(Op::CgroupFreeze, id)
            .map_err(|()| cg_err("freeze", &self.cgroup_dir(id)))
    }

    fn thaw(&self, id: &str) -> cgroup::Result<()> {
        self.call(Op::CgroupThaw, id)
            .map_err(|()| cg_err("thaw", &self.cgroup_dir(id)))
    }

    /// SIGKILLs every pid in `cgroup.procs` and waits until none runs, as `cgroup.kill` does.
    fn kill_all(&self, id: &str) -> cgroup::Result<()> {
        let procs = self.procs(id);
        self.call(Op::CgroupKill, id)
            .map_err(|()| cg_err("kill", &procs))?;
        let text = std::fs::read_to_string(&procs).unwrap_or_default();
        let pids: Vec<i32> = text.lines().filter_map(|l| l.parse().ok()).collect();
        for &pid in &pids {
            sigkill(pid);
        }
        for pid in pids {
            wait_dead(pid);
        }
        if procs.exists() {
            std::fs::write(&procs, "").map_err(|e| CgroupError::new("kill", &procs, e))?;
        }
        Ok(())
    }

    /// Refuses (EBUSY) while a process is in it, as rmdir of a cgroup does.
    fn remove(&self, id: &str) -> cgroup::Result<()> {
        let dir = self.cgroup_dir(id);
        self.call(Op::CgroupRemove, id)
            .map_err(|()| cg_err("rmdir", &dir))?;
        let text = std::fs::read_to_string(self.procs(id)).unwrap_or_default();
        if text.lines().filter_map(|l| l.parse().ok()).any(running) {
            return Err(CgroupError::new(
                "rmdir",
                &dir,
                std::io::Error::from_raw_os_error(libc::EBUSY),
            ));
        }
        let _ = std::fs::remove_file(self.procs(id));
        match std::fs::remove_dir(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(CgroupError::new("rmdir", &dir, e))
            }
            _ => Ok(()),
        }
    }

    fn usage(&self, _id: &str) -> CgroupUsage {
        CgroupUsage::default()
    }

    fn existing(&self) -> Vec<String> {
        crate::residue::dir_names(&self.dir.join("cgroup"))
    }

    fn dirs(&self, id: &str) -> Vec<PathBuf> {
        let dir = self.cgroup_dir(id);
        if dir.exists() {
            vec![dir]
        } else {
            Vec::new()
        }
    }

    fn create_daemon(&self, name: &str, _memory_mb: u64) -> cgroup::Result<Vec<PathBuf>> {
        let dir = self.dir.join("cgroup-daemon").join(name);
        Err(CgroupError::new(
            "mkdir",
            &dir,
            std::io::Error::other("daemon cgroups are not modelled by the fake host"),
        ))
    }

    fn remove_daemons(&self, _names: &[&str]) {}
}

impl SandboxNet for FakeHost {
    fn table(&self) -> &str {
        &self.table
    }

    fn check_ports(&self, _ports: &[PortMapping]) -> Result<(), Error> {
        Ok(())
    }

    fn setup(
        &self,
        id: &SandboxId,
        _pid: i32,
        _allow: &[EgressRule],
        ports: &[PortMapping],
    ) -> Result<NetLease, NetError> {
        self.call(Op::NetSetup, id.as_str())
            .map_err(|()| NetError::Failed {
                program: "nft".into(),
                stderr: INJECTED.into(),
            })?;
        let mut st = self.st.lock();
        let index = st.next_index;
        st.next_index += 1;
        let base = u32::from(std::net::Ipv4Addr::new(10, 99, 0, 0)) + index * 4;
        let lease = NetLease {
            index,
            host_if: host_if(id),
            host_addr: (base + 1).into(),
            sandbox_addr: (base + 2).into(),
            chain: format!("sb_{}", id.short()),
            ports: ports.to_vec(),
        };
        st.links.insert(lease.host_if.clone());
        st.leases.insert(lease.host_if.clone(), lease.clone());
        Ok(lease)
    }

    /// A failure leaves link and lease in place (what a failed `ip link del` leaves).
    fn teardown(&self, lease: &NetLease) -> Result<(), NetError> {
        let id = self
            .sandbox_of_link(&lease.host_if)
            .unwrap_or_else(|| lease.host_if.clone());
        self.call(Op::NetTeardown, &id)
            .map_err(|()| NetError::Teardown(vec![NetError::PoolExhausted]))?;
        let mut st = self.st.lock();
        st.links.remove(&lease.host_if);
        st.leases.remove(&lease.host_if);
        Ok(())
    }

    /// The rules become exactly the adopted leases'.
    fn restore(&self, adopted: &[(NetLease, Vec<EgressRule>)]) -> Result<(), NetError> {
        let _ = self.call(Op::NetRestore, "");
        let mut st = self.st.lock();
        st.leases = adopted
            .iter()
            .map(|(l, _)| (l.host_if.clone(), l.clone()))
            .collect();
        Ok(())
    }

    fn table_chains(&self) -> Option<Vec<String>> {
        let st = self.st.lock();
        (!st.leases.is_empty()).then(|| st.leases.values().map(|l| l.chain.clone()).collect())
    }

    fn has_leases(&self) -> bool {
        !self.st.lock().leases.is_empty()
    }

    fn counters(&self, _lease: &NetLease) -> (u64, u64) {
        (0, 0)
    }

    fn link_exists(&self, host_if: &str) -> bool {
        self.st.lock().links.contains(host_if)
    }

    fn remove_link(&self, host_if: &str) {
        let id = self
            .sandbox_of_link(host_if)
            .unwrap_or_else(|| host_if.to_string());
        if self.st.lock().links.remove(host_if) {
            let _ = self.call(Op::LinkRemove, &id);
        }
    }
}

impl FakeHost {
    /// The sandbox whose veth host end is `link` (by the inits started).
    fn sandbox_of_link(&self, link: &str) -> Option<String> {
        let st = self.st.lock();
        st.inits
            .values()
            .find(|s| s.parse::<SandboxId>().is_ok_and(|id| host_if(&id) == link))
            .cloned()
    }
}

impl Spawner for FakeHost {
    /// Starts an init that joins `cfg.cgroup_procs` (as grove-init does) and reports ready; a
    /// fault kills it unreaped and reports a setup failure, as the real handshake does.
    fn spawn_init(
        &self,
        _init_binary: &Path,
        cfg: &SetupConfig,
        _instance: &str,
        sandbox: &str,
        _ids: Option<IdRange>,
    ) -> Result<i32, SpawnError> {
        let ok = self.call(Op::Spawn, sandbox).is_ok();
        let pid = self.start_init(sandbox);
        for procs in &cfg.cgroup_procs {
            append_pid(Path::new(procs), pid);
        }
        let (dies, block) = {
            let mut st = self.st.lock();
            (
                std::mem::take(&mut st.die_after_ready),
                std::mem::take(&mut st.block_record),
            )
        };
        if block {
            // cfg.root is <sandbox dir>/root; the record is written beside it.
            let dir = Path::new(&cfg.root).parent().unwrap();
            std::fs::create_dir(dir.join("sandbox.json.tmp")).unwrap();
        }
        if !ok || dies {
            sigkill(pid);
            wait_dead(pid);
        }
        if !ok {
            return Err(SpawnError::Failed {
                pid,
                reason: SetupFailure::Reported(INJECTED.into()),
            });
        }
        Ok(pid)
    }
}

impl InitControl for FakeHost {
    /// Answers while the init runs, unless it was made deaf.
    fn ping(&self, init: &InitHandle, _timeout: Duration) -> Result<(), ClientError> {
        let id = self.sandbox_of(init.pid());
        self.call(Op::Ping, &id)
            .map_err(|()| ClientError::Protocol(INJECTED.into()))?;
        if !init.alive() {
            return Err(ClientError::Connect(HandleError::Gone { pid: init.pid() }));
        }
        if self.st.lock().deaf.contains(&init.pid()) {
            return Err(ClientError::Io(std::io::ErrorKind::TimedOut.into()));
        }
        Ok(())
    }

    fn set_hostname(&self, init: &InitHandle, hostname: &str) -> Result<(), HostnameError> {
        let id = self.sandbox_of(init.pid());
        self.call(Op::SetHostname, &id)
            .map_err(|()| HostnameError::Setns(nix::errno::Errno::EPERM))?;
        self.st
            .lock()
            .hostnames
            .insert(init.pid(), hostname.to_string());
        Ok(())
    }
}

impl FakeHost {
    fn sandbox_of(&self, pid: i32) -> String {
        self.st.lock().inits.get(&pid).cloned().unwrap_or_default()
    }
}

/// A plain copy under the run dir (no tmpfs).
impl InitStore for FakeHost {
    fn install(&self, run_dir: &Path, binary: &Path) -> std::io::Result<PathBuf> {
        self.call(Op::InitInstall, "")
            .map_err(|()| std::io::Error::other(INJECTED))?;
        let dir = run_dir.join("init");
        std::fs::create_dir_all(&dir)?;
        let dst = dir.join("grove-init");
        std::fs::copy(binary, &dst)?;
        Ok(dst)
    }

    fn remove(&self, run_dir: &Path) {
        let _ = self.call(Op::InitRemove, "");
        let _ = std::fs::remove_dir_all(run_dir.join("init"));
    }
}

/// Roots as upper dirs under the fake host's tempdir, with a marker file in the mount point.
impl RootProvider for FakeHost {
    fn mount_root(
        &self,
        id: &SandboxId,
        image: &str,
        target: &Path,
        _disk: &DiskQuota,
        _ids: Option<IdRange>,
    ) -> Result<Box<dyn RootMount>, RootError> {
        self.call(Op::RootMount, id.as_str())
            .map_err(|()| RootError::new(INJECTED))?;
        let root = self.root(id, target);
        std::fs::create_dir(&root.upper).map_err(|e| RootError::with_source("upper", e))?;
        std::fs::write(target.join(MARKER), image)
            .map_err(|e| RootError::with_source("mount", e))?;
        Ok(Box::new(root))
    }

    fn image_exists(&self, image: &str) -> bool {
        image != "missing"
    }

    fn reattach(&self, id: &SandboxId, _image: &str, target: &Path) -> Option<Box<dyn RootMount>> {
        let lost = self.st.lock().lost_roots.contains(id.as_str());
        let alive = self.call(Op::RootReattach, id.as_str()).is_ok()
            && !lost
            && self.upper(id.as_str()).exists();
        alive.then(|| Box::new(self.root(id, target)) as Box<dyn RootMount>)
    }

    fn upper_dirs(&self) -> Vec<(String, PathBuf)> {
        crate::residue::dir_names(&self.dir.join("upper"))
            .into_iter()
            .map(|n| (n.clone(), self.upper(&n)))
            .collect()
    }
}

/// Where a fake root shows it is mounted.
pub const MARKER: &str = ".fake-root";

impl FakeHost {
    fn root(&self, id: &SandboxId, target: &Path) -> FakeRoot {
        FakeRoot {
            st: self.st.clone(),
            id: id.to_string(),
            upper: self.upper(id.as_str()),
            target: target.to_path_buf(),
        }
    }
}

struct FakeRoot {
    st: Arc<Mutex<State>>,
    id: String,
    upper: PathBuf,
    target: PathBuf,
}

impl RootMount for FakeRoot {
    fn usage(&self) -> DiskUsage {
        DiskUsage::default()
    }

    fn unmount(&self) -> Result<(), RootError> {
        call(&self.st, Op::RootUnmount, &self.id).map_err(|()| RootError::new(INJECTED))?;
        match std::fs::remove_file(self.target.join(MARKER)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(RootError::with_source("unmount", e))
            }
            _ => {}
        }
        match std::fs::remove_dir_all(&self.upper) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(RootError::with_source("drop the upper", e))
            }
            _ => Ok(()),
        }
    }
}
