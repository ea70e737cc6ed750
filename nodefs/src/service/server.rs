//! `grove-fsd`'s server: a [`Local`] service on a unix socket, one thread per connection.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use serde_json::{json, Value};

use super::proto::{self, Reply, Request, WireError, VERSION};
use super::{FsService, ImportPolicy, Local};
use crate::error::Error;
use crate::id::ObjectId;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("another grove-fsd answers on {0}")]
    AlreadyRunning(PathBuf),
    #[error("opening the content store")]
    Store(#[source] Error),
    #[error("binding {path}")]
    Bind {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A result as the reply's value.
fn v<T: serde::Serialize>(r: Result<T, Error>) -> Result<Value, Error> {
    r.map(|x| serde_json::to_value(x).unwrap_or(Value::Null))
}

/// Pins of one client process, released when its last connection closes (a killed daemon
/// must not keep garbage alive for the life of the server).
#[derive(Default)]
struct Session {
    conns: usize,
    pins: HashMap<ObjectId, usize>,
}

struct Server {
    svc: Local,
    socket: PathBuf,
    sessions: Mutex<HashMap<String, Session>>,
}

/// Serves the store in `store_dir` on `socket` until told to shut down (then exits the process).
pub fn serve(store_dir: &Path, socket: &Path) -> Result<(), ServeError> {
    serve_with(store_dir, socket, crate::ServerOptions::default())
}

/// `serve`, the FUSE server mounting with `options`.
pub fn serve_with(
    store_dir: &Path,
    socket: &Path,
    options: crate::ServerOptions,
) -> Result<(), ServeError> {
    if UnixStream::connect(socket).is_ok() {
        return Err(ServeError::AlreadyRunning(socket.to_path_buf()));
    }
    let svc = Local::open_with(store_dir, options).map_err(ServeError::Store)?;
    let bind_err = |source| ServeError::Bind {
        path: socket.to_path_buf(),
        source,
    };
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).map_err(bind_err)?;
    }
    // A stale socket of a dead server (nothing answered above; the store lock is ours now).
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket).map_err(bind_err)?;
    let server = Arc::new(Server {
        svc,
        socket: socket.to_path_buf(),
        sessions: Mutex::new(HashMap::new()),
    });
    tracing::info!(socket = %socket.display(), store = %store_dir.display(), "grove-fsd serving");
    for conn in listener.incoming() {
        match conn {
            Ok(c) => {
                let s = server.clone();
                std::thread::spawn(move || s.connection(c));
            }
            Err(e) => tracing::warn!(error = %e, "accept"),
        }
    }
    Ok(())
}

impl Server {
    fn connection(&self, sock: UnixStream) {
        let session = match proto::recv::<Request>(&sock) {
            Ok(Some((Request::Hello { version, session }, _))) if version == VERSION => session,
            Ok(Some((Request::Hello { version, .. }, _))) => {
                let msg = format!("client speaks protocol {version}, this server {VERSION}");
                let _ = proto::send(
                    &sock,
                    &Reply::Err(WireError::Other {
                        message: msg,
                        errno: None,
                    }),
                    None,
                );
                return;
            }
            _ => return,
        };
        let _ = proto::send(
            &sock,
            &Reply::Ok(json!({"version": VERSION, "pid": std::process::id()})),
            None,
        );
        self.sessions
            .lock()
            .entry(session.clone())
            .or_default()
            .conns += 1;
        while let Ok(Some((req, fd))) = proto::recv::<Request>(&sock) {
            let shutdown = matches!(req, Request::Shutdown);
            let reply = match self.handle(&session, req, fd, &sock) {
                Ok(v) => Reply::Ok(v),
                Err(e) => Reply::Err(WireError::from(&e)),
            };
            if proto::send(&sock, &reply, None).is_err() {
                break;
            }
            if shutdown {
                tracing::info!("grove-fsd stopped");
                std::process::exit(0);
            }
        }
        self.end_session(&session);
    }

    fn end_session(&self, session: &str) {
        let mut sessions = self.sessions.lock();
        let Some(s) = sessions.get_mut(session) else {
            return;
        };
        s.conns -= 1;
        if s.conns == 0 {
            if let Some(s) = sessions.remove(session) {
                for (id, n) in s.pins {
                    (0..n).for_each(|_| self.svc.unpin(&id));
                }
            }
        }
    }

    fn handle(
        &self,
        session: &str,
        req: Request,
        fd: Option<OwnedFd>,
        sock: &UnixStream,
    ) -> Result<Value, Error> {
        let svc = &self.svc;
        let need_fd = || Error::fsd("request needs a pipe fd");
        match req {
            Request::Hello { .. } | Request::StreamEnd { .. } => {
                Err(Error::fsd("unexpected request"))
            }
            Request::Resolve { name } => v(svc.resolve(&name)),
            Request::GetRef { name } => v(svc.get_ref(&name)),
            Request::SetRef { name, id } => v(svc.set_ref(&name, &id)),
            Request::DeleteRef { name } => v(svc.delete_ref(&name)),
            Request::Refs => v(svc.refs()),
            Request::Stats => v(svc.stats()),
            Request::StoredBytes => v(svc.stored_bytes()),
            Request::ManifestBytes { id } => v(svc.manifest_bytes(&id)),
            // A snapshot's images are stored in the background: at a lower priority, so that
            // the sandboxes' own requests and the next snapshot's frozen dump come first.
            Request::ImportDir { dir, policy, base } if policy == ImportPolicy::CriuImages => {
                v(in_background(|| {
                    svc.import_dir(&dir, policy, base.as_ref())
                }))
            }
            Request::ImportDir { dir, policy, base } => {
                v(svc.import_dir(&dir, policy, base.as_ref()))
            }
            Request::ImportOci { dir, reference } => v(svc.import_oci(&dir, reference.as_deref())),
            Request::ImportTar => {
                let mut r = File::from(fd.ok_or_else(need_fd)?);
                let res = svc.import_tar(&mut r);
                v(self.finish_import(res, r, sock))
            }
            Request::ApplyLayer {
                base,
                compression,
                digest,
            } => {
                let mut r = File::from(fd.ok_or_else(need_fd)?);
                let res = svc.apply_layer(base.as_ref(), compression, digest.as_deref(), &mut r);
                v(self.finish_import(res, r, sock))
            }
            Request::ImportStreams { count } => {
                let mut r = File::from(fd.ok_or_else(need_fd)?);
                let res = svc.import_streams(&mut r, count);
                v(self.finish_import(res, r, sock))
            }
            Request::ExportStream { id, only } => {
                let mut w = File::from(fd.ok_or_else(need_fd)?);
                let only: Option<HashSet<ObjectId>> = only.map(|o| o.into_iter().collect());
                v(svc.export_stream(&id, only.as_ref(), &mut w))
            }
            Request::ExportDir { id, dst } => v(svc.export_dir(&id, &dst)),
            Request::ObjectsOf { id } => v(svc.objects_of(&id)),
            Request::Lacking { ids } => v(svc.lacking(&ids)),
            Request::Pin { id } => {
                svc.pin(&id)?;
                let mut s = self.sessions.lock();
                *s.entry(session.to_string())
                    .or_default()
                    .pins
                    .entry(id)
                    .or_default() += 1;
                Ok(Value::Null)
            }
            Request::Unpin { id } => {
                let mut s = self.sessions.lock();
                let pins = &mut s.entry(session.to_string()).or_default().pins;
                if let Some(n) = pins.get_mut(&id) {
                    *n -= 1;
                    if *n == 0 {
                        pins.remove(&id);
                    }
                    svc.unpin(&id);
                }
                Ok(Value::Null)
            }
            Request::Gc { live } => v(svc.gc(&live)),
            Request::Fsck => v(svc.fsck()),
            Request::Mount { base, target, opts } => v(svc.mount(&base, &target, &opts)),
            Request::Commit { mount } => v(svc.commit(mount)),
            Request::Usage { mount } => v(svc.usage(mount)),
            Request::CommitUnsealed { mount } => v(svc.commit_unsealed(mount)),
            Request::SealCommit { mount, id } => v(svc.seal_commit(mount, &id)),
            Request::Unmount { mount } => v(svc.unmount(mount)),
            Request::Mounts => v(svc.mounts()),
            Request::Shutdown => {
                svc.unmount_all();
                let _ = std::fs::remove_file(&self.socket);
                Ok(Value::Null)
            }
        }
    }

    /// Closes the pipe (a client still writing gets EPIPE), then takes the client's word on
    /// whether its input was whole: a cut-short input fails the import.
    fn finish_import<T>(
        &self,
        res: Result<T, Error>,
        pipe: File,
        sock: &UnixStream,
    ) -> Result<T, Error> {
        drop(pipe);
        let end = proto::recv::<Request>(sock)
            .map_err(|e| Error::fsd(format!("reading the end of the stream: {e}")))?;
        match end {
            Some((Request::StreamEnd { ok: true, .. }, _)) => res,
            Some((Request::StreamEnd { error, .. }, _)) => Err(Error::BadStream(format!(
                "read: {}",
                error.unwrap_or_else(|| "input ended early".into())
            ))),
            _ => Err(Error::fsd("expected the end of the stream")),
        }
    }
}

/// Runs `f` on a thread of its own at `grove_sys::sched::BACKGROUND_NICE` (Linux keeps nice
/// values per thread, and this one ends with `f`, so no thread of the server is left lowered).
fn in_background<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            let _ = grove_sys::sched::into_background();
            f()
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

#[cfg(test)]
mod background_tests {
    use super::*;

    #[test]
    fn background_work_runs_niced_and_leaves_the_caller_as_it_was() {
        let ours = grove_sys::sched::nice(0).unwrap();
        let theirs = in_background(|| grove_sys::sched::nice(0).unwrap());
        assert_eq!(theirs, grove_sys::sched::BACKGROUND_NICE.max(ours));
        assert_eq!(grove_sys::sched::nice(0).unwrap(), ours);
    }
}
