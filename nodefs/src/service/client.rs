//! The daemon's side of `grove-fsd`: finds (or starts) the server and speaks its protocol over a
//! pool of persistent connections.

use std::collections::HashSet;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::proto::{self, Reply, Request, WireError, VERSION};
use super::{FsService, ImportPolicy, MountInfo};
use crate::error::Error;
use crate::fs::{MountOptions, Usage};
use crate::id::{ManifestId, ObjectId};
use crate::store::{FsckReport, GcReport, StoreStats};

/// How long a freshly started server may take to answer (it opens the store first).
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How to start a server when none answers.
#[derive(Debug, Clone)]
pub struct Spawn {
    pub binary: PathBuf,
    pub store: PathBuf,
    /// Its stderr (truncated at each start).
    pub log: PathBuf,
    /// cgroup.procs files the server joins before it execs: its own cgroup (and memory limit),
    /// from its first instruction on.
    pub cgroup_procs: Vec<PathBuf>,
}

/// A connection to `grove-fsd`. Connections are pooled; one that fails is dropped, and the next
/// call connects again (starting a new server if `spawn` says how and none answers).
#[derive(Debug)]
pub struct Client {
    socket: PathBuf,
    spawn: Option<Spawn>,
    session: String,
    pool: Mutex<Vec<UnixStream>>,
    start: Mutex<()>,
    /// Set by [`Client::shutdown`]: a server this client stopped is not started again by a
    /// later call (a background store still running while its daemon stops), which would
    /// outlive the daemon.
    stopped: AtomicBool,
}

/// A transport failure (the server is gone or misbehaves), as opposed to its answer.
fn transport(socket: &Path, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Unreachable(format!("{what} ({}): {e}", socket.display()))
}

impl Client {
    /// Connects to the server on `socket`, starting one with `spawn` if none answers. Fails when
    /// no server can be reached.
    pub fn start(socket: &Path, spawn: Option<Spawn>) -> Result<Client, Error> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let c = Client {
            socket: socket.to_path_buf(),
            spawn,
            session: format!("{}-{nanos}", std::process::id()),
            pool: Mutex::new(Vec::new()),
            start: Mutex::new(()),
            stopped: AtomicBool::new(false),
        };
        let conn = c.connect()?;
        c.pool.lock().push(conn);
        Ok(c)
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Whether a server answers on `socket` (without starting one).
    pub fn answers(socket: &Path) -> bool {
        Client::start(socket, None).is_ok()
    }

    fn hello(&self, sock: &UnixStream) -> Result<(), Error> {
        let hello = Request::Hello {
            version: VERSION,
            session: self.session.clone(),
        };
        proto::send(sock, &hello, None).map_err(|e| transport(&self.socket, "hello", e))?;
        match proto::recv::<Reply>(sock) {
            Ok(Some((Reply::Ok(_), _))) => Ok(()),
            Ok(Some((Reply::Err(e), _))) => Err(Error::from(e)),
            Ok(None) => Err(transport(&self.socket, "hello", "connection closed")),
            Err(e) => Err(transport(&self.socket, "hello", e)),
        }
    }

    /// Err once [`Client::shutdown`] ran: no call reaches or starts a server after it.
    fn refuse_if_stopped(&self) -> Result<(), Error> {
        if self.stopped.load(Ordering::SeqCst) {
            return Err(transport(
                &self.socket,
                "connect",
                "grove-fsd was stopped by this client",
            ));
        }
        Ok(())
    }

    fn connect(&self) -> Result<UnixStream, Error> {
        self.refuse_if_stopped()?;
        if let Ok(s) = UnixStream::connect(&self.socket) {
            self.hello(&s)?;
            return Ok(s);
        }
        let Some(spawn) = &self.spawn else {
            return Err(transport(&self.socket, "connect", "no grove-fsd answers"));
        };
        // One starter at a time; whoever comes second finds the server up.
        let _g = self.start.lock();
        self.refuse_if_stopped()?;
        if let Ok(s) = UnixStream::connect(&self.socket) {
            self.hello(&s)?;
            return Ok(s);
        }
        self.spawn_server(spawn)?;
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(s) = UnixStream::connect(&self.socket) {
                self.hello(&s)?;
                return Ok(s);
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(&spawn.log).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(5).collect();
                return Err(transport(
                    &self.socket,
                    "start",
                    format!(
                        "{} did not answer within {START_TIMEOUT:?}; its log {} ends: {}",
                        spawn.binary.display(),
                        spawn.log.display(),
                        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Starts the server detached: its own session, reparented to init (double fork), so it
    /// neither dies with this process nor stays its child.
    fn spawn_server(&self, spawn: &Spawn) -> Result<(), Error> {
        let err = |e: std::io::Error| transport(&self.socket, "start grove-fsd", e);
        if let Some(d) = spawn.log.parent() {
            std::fs::create_dir_all(d).map_err(err)?;
        }
        let log = File::create(&spawn.log).map_err(err)?;
        let mut cmd = std::process::Command::new(&spawn.binary);
        cmd.arg("--store")
            .arg(&spawn.store)
            .arg("--socket")
            .arg(&self.socket)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log);
        let procs: Vec<std::ffi::CString> = spawn
            .cgroup_procs
            .iter()
            .map(|p| std::ffi::CString::new(p.as_os_str().as_encoded_bytes()))
            .collect::<Result<_, _>>()
            .map_err(|e| err(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))?;
        // SAFETY: between fork and exec only async-signal-safe calls (fork, _exit, setsid, open,
        // write, close) on memory prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                use nix::fcntl::{open, OFlag};
                use nix::sys::stat::Mode;
                if let nix::unistd::ForkResult::Parent { .. } = nix::unistd::fork()? {
                    grove_sys::process::exit_now(0);
                }
                nix::unistd::setsid()?;
                // "0" moves the writer itself.
                for p in &procs {
                    let fd = open(
                        p.as_c_str(),
                        OFlag::O_WRONLY | OFlag::O_CLOEXEC,
                        Mode::empty(),
                    )?;
                    let fd = OwnedFd::from_raw_fd(fd);
                    if nix::unistd::write(&fd, b"0")? != 1 {
                        return Err(std::io::Error::from(nix::errno::Errno::EIO));
                    }
                }
                Ok(())
            })
        };
        let mut child = cmd.spawn().map_err(err)?;
        child.wait().map_err(err)?;
        tracing::info!(socket = %self.socket.display(), "started grove-fsd");
        Ok(())
    }

    /// Runs one exchange on a pooled connection. A transport failure drops every pooled
    /// connection (the server likely died); the next call reconnects.
    fn exchange<T>(
        &self,
        f: impl FnOnce(&UnixStream) -> std::io::Result<Result<T, WireError>>,
    ) -> Result<T, Error> {
        let conn = match self.pool.lock().pop() {
            Some(c) => c,
            None => self.connect()?,
        };
        match f(&conn) {
            Ok(r) => {
                self.pool.lock().push(conn);
                r.map_err(Error::from)
            }
            Err(e) => {
                self.pool.lock().clear();
                Err(transport(&self.socket, "request", e))
            }
        }
    }

    fn reply(sock: &UnixStream) -> std::io::Result<Result<Value, WireError>> {
        match proto::recv::<Reply>(sock)? {
            Some((Reply::Ok(v), _)) => Ok(Ok(v)),
            Some((Reply::Err(e), _)) => Ok(Err(e)),
            None => Err(std::io::Error::other("connection closed")),
        }
    }

    fn call<T: DeserializeOwned>(&self, req: Request) -> Result<T, Error> {
        let v = self.exchange(|c| {
            proto::send(c, &req, None)?;
            Client::reply(c)
        })?;
        serde_json::from_value(v).map_err(|e| transport(&self.socket, "reply", e))
    }

    /// An import whose data flows through a pipe.
    fn import_pipe<T: DeserializeOwned>(
        &self,
        req: Request,
        input: &mut dyn Read,
    ) -> Result<T, Error> {
        let (r, w) = pipe().map_err(|e| transport(&self.socket, "pipe", e))?;
        let v = self.exchange(|c| {
            proto::send(c, &req, Some(r.as_raw_fd()))?;
            drop(r);
            let mut w = File::from(w);
            let mut buf = vec![0u8; 256 << 10];
            let mut input_err = None;
            loop {
                let n = match input.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        input_err = Some(e.to_string());
                        break;
                    }
                };
                // The server stopped reading (it failed, or needed no more): its reply says.
                if w.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            drop(w);
            let end = Request::StreamEnd {
                ok: input_err.is_none(),
                error: input_err,
            };
            proto::send(c, &end, None)?;
            Client::reply(c)
        })?;
        serde_json::from_value(v).map_err(|e| transport(&self.socket, "reply", e))
    }

    /// Asks the server to unmount everything and exit; returns once it has exited. From then on
    /// this client starts no server: its calls fail as unreachable.
    pub fn shutdown(&self) -> Result<(), Error> {
        {
            // Under the start lock: a connect that is starting a server finishes first.
            let _g = self.start.lock();
            self.stopped.store(true, Ordering::SeqCst);
        }
        self.pool.lock().clear();
        let sock =
            UnixStream::connect(&self.socket).map_err(|e| transport(&self.socket, "connect", e))?;
        self.hello(&sock)?;
        proto::send(&sock, &Request::Shutdown, None)
            .map_err(|e| transport(&self.socket, "shutdown", e))?;
        match Client::reply(&sock) {
            Ok(r) => r.map_err(Error::from)?,
            Err(e) => return Err(transport(&self.socket, "shutdown", e)),
        };
        let server =
            nix::sys::socket::getsockopt(&sock, nix::sys::socket::sockopt::PeerCredentials)
                .map(|c| c.pid())
                .ok();
        // The connection ends when the process does.
        let _ = sock.set_read_timeout(Some(Duration::from_secs(10)));
        let _ = (&sock).read(&mut [0u8; 1]);
        if let Some(pid) = server {
            reap(pid);
        }
        Ok(())
    }
}

/// Reaps the exited server if it is our child: a daemon that is a child subreaper (groved is,
/// for its sandboxes) inherits the double-forked server, which would otherwise stay a zombie
/// until the daemon exits. Gives up at once when it is not our child (ECHILD).
fn reap(pid: i32) {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    let pid = nix::unistd::Pid::from_raw(pid);
    for _ in 0..100 {
        match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => std::thread::sleep(Duration::from_millis(20)),
            _ => return,
        }
    }
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    // 1 MiB rather than 64 KiB: an import streams hundreds of MB through it, and each full
    // pipe is a context switch on both ends. Best effort: a lower pipe-max-size keeps 64 KiB.
    let _ = nix::fcntl::fcntl(w.as_raw_fd(), nix::fcntl::FcntlArg::F_SETPIPE_SZ(1 << 20));
    Ok((r, w))
}

impl FsService for Client {
    fn resolve(&self, name_or_hex: &str) -> Result<ManifestId, Error> {
        self.call(Request::Resolve {
            name: name_or_hex.into(),
        })
    }

    fn get_ref(&self, name: &str) -> Result<Option<ManifestId>, Error> {
        self.call(Request::GetRef { name: name.into() })
    }

    fn set_ref(&self, name: &str, id: &ManifestId) -> Result<(), Error> {
        self.call(Request::SetRef {
            name: name.into(),
            id: *id,
        })
    }

    fn delete_ref(&self, name: &str) -> Result<(), Error> {
        self.call(Request::DeleteRef { name: name.into() })
    }

    fn refs(&self) -> Result<Vec<(String, ManifestId)>, Error> {
        self.call(Request::Refs)
    }

    fn stats(&self) -> Result<StoreStats, Error> {
        self.call(Request::Stats)
    }

    fn stored_bytes(&self) -> Result<u64, Error> {
        self.call(Request::StoredBytes)
    }

    fn manifest_bytes(&self, id: &ManifestId) -> Result<u64, Error> {
        self.call(Request::ManifestBytes { id: *id })
    }

    fn import_dir(
        &self,
        dir: &Path,
        policy: ImportPolicy,
        base: Option<&ManifestId>,
    ) -> Result<ManifestId, Error> {
        self.call(Request::ImportDir {
            dir: absolute(dir),
            policy,
            base: base.copied(),
        })
    }

    fn import_oci(&self, dir: &Path, reference: Option<&str>) -> Result<ManifestId, Error> {
        self.call(Request::ImportOci {
            dir: absolute(dir),
            reference: reference.map(String::from),
        })
    }

    fn import_tar(&self, input: &mut dyn Read) -> Result<ManifestId, Error> {
        self.import_pipe(Request::ImportTar, input)
    }

    fn apply_layer(
        &self,
        base: Option<&ManifestId>,
        compression: crate::LayerCompression,
        digest: Option<&str>,
        input: &mut (dyn Read + Send),
    ) -> Result<ManifestId, Error> {
        let req = Request::ApplyLayer {
            base: base.copied(),
            compression,
            digest: digest.map(String::from),
        };
        self.import_pipe(req, input)
    }

    fn export_dir(&self, id: &ManifestId, dst: &Path) -> Result<(), Error> {
        self.call(Request::ExportDir {
            id: *id,
            dst: absolute(dst),
        })
    }

    fn export_stream(
        &self,
        id: &ManifestId,
        only: Option<&HashSet<ObjectId>>,
        out: &mut dyn Write,
    ) -> Result<(), Error> {
        let (r, w) = pipe().map_err(|e| transport(&self.socket, "pipe", e))?;
        let req = Request::ExportStream {
            id: *id,
            only: only.map(|s| s.iter().copied().collect()),
        };
        let mut out_err = None;
        let res = self.exchange(|c| {
            proto::send(c, &req, Some(w.as_raw_fd()))?;
            drop(w);
            let mut r = File::from(r);
            if let Err(e) = std::io::copy(&mut r, out) {
                out_err = Some(e);
            }
            drop(r);
            Client::reply(c)
        });
        match out_err {
            Some(e) => Err(Error::BadStream(format!("write: {e}"))),
            None => res.map(|_| ()),
        }
    }

    fn import_streams(&self, input: &mut dyn Read, count: usize) -> Result<Vec<ManifestId>, Error> {
        self.import_pipe(Request::ImportStreams { count }, input)
    }

    fn objects_of(&self, id: &ManifestId) -> Result<Vec<ObjectId>, Error> {
        self.call(Request::ObjectsOf { id: *id })
    }

    fn lacking(&self, ids: &[ObjectId]) -> Result<Vec<ObjectId>, Error> {
        self.call(Request::Lacking { ids: ids.to_vec() })
    }

    fn pin(&self, id: &ObjectId) -> Result<(), Error> {
        self.call(Request::Pin { id: *id })
    }

    fn unpin(&self, id: &ObjectId) {
        if let Err(e) = self.call::<()>(Request::Unpin { id: *id }) {
            tracing::warn!(%id, error = %e, "unpin");
        }
    }

    fn gc(&self, live: &[ManifestId]) -> Result<GcReport, Error> {
        self.call(Request::Gc {
            live: live.to_vec(),
        })
    }

    fn fsck(&self) -> Result<FsckReport, Error> {
        self.call(Request::Fsck)
    }

    fn mount(
        &self,
        base: &ManifestId,
        target: &Path,
        opts: &MountOptions,
    ) -> Result<MountInfo, Error> {
        let mut opts = opts.clone();
        opts.upper_dir = absolute(&opts.upper_dir);
        self.call(Request::Mount {
            base: *base,
            target: absolute(target),
            opts,
        })
    }

    fn commit(&self, mount: u64) -> Result<ManifestId, Error> {
        self.call(Request::Commit { mount })
    }

    fn usage(&self, mount: u64) -> Result<Usage, Error> {
        self.call(Request::Usage { mount })
    }

    fn commit_unsealed(&self, mount: u64) -> Result<ManifestId, Error> {
        self.call(Request::CommitUnsealed { mount })
    }

    fn seal_commit(&self, mount: u64, id: &ManifestId) -> Result<(), Error> {
        self.call(Request::SealCommit { mount, id: *id })
    }

    fn unmount(&self, mount: u64) -> Result<(), Error> {
        self.call(Request::Unmount { mount })
    }

    fn mounts(&self) -> Result<Vec<MountInfo>, Error> {
        self.call(Request::Mounts)
    }
}

/// Paths cross to another process: make relative ones absolute against our working dir.
fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}
