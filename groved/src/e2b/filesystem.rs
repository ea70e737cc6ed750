//! envd's `filesystem.Filesystem` Connect service onto the runtime's files layer: stat, list
//! with depth, make dir, move, remove, and watch dir.
//!
//! Watching polls: every [`WATCH_TICK`] the watched tree (at most [`WATCH_MAX_ENTRIES`]
//! entries) is stat-ed from the host through the sandbox's root and compared with the last
//! look, giving create / write / chmod / remove events (a rename shows as remove + create).
//! Nothing runs inside the sandbox, so nothing there can disturb or outlive a watch; the poll
//! stops when the client goes away (the stream is dropped) or the sandbox does.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderMap;
use base64::Engine as _;
use grove_runtime::files::{FileStat, Root};

use super::connect::{Code, ConnectError, Ctx, Services};
use super::files::{path_for, user, Names, User};
use super::proto::filesystem as pb;
use crate::app::blocking;

/// How often a watch looks again.
pub const WATCH_TICK: Duration = Duration::from_millis(100);
/// Most entries one watch tracks (and one recursive list returns).
pub const WATCH_MAX_ENTRIES: usize = 10_000;
/// A keep-alive message this often on a quiet watch.
const KEEPALIVE: Duration = Duration::from_secs(30);

pub fn register(s: &mut Services) {
    s.unary("/filesystem.Filesystem/Stat", stat);
    s.unary("/filesystem.Filesystem/MakeDir", make_dir);
    s.unary("/filesystem.Filesystem/Move", move_entry);
    s.unary("/filesystem.Filesystem/ListDir", list_dir);
    s.unary("/filesystem.Filesystem/Remove", remove);
    s.server_stream("/filesystem.Filesystem/WatchDir", watch_dir);
    s.unary("/filesystem.Filesystem/CreateWatcher", create_watcher);
    s.unary(
        "/filesystem.Filesystem/GetWatcherEvents",
        get_watcher_events,
    );
    s.unary("/filesystem.Filesystem/RemoveWatcher", remove_watcher);
}

fn err(e: super::error::E2bError) -> ConnectError {
    let code = match e.status.as_u16() {
        400 => Code::InvalidArgument,
        401 => Code::Unauthenticated,
        404 => Code::NotFound,
        409 => Code::FailedPrecondition,
        507 => Code::ResourceExhausted,
        502 | 503 => Code::Unavailable,
        _ => Code::Internal,
    };
    ConnectError::new(code, e.message)
}

fn rt_err(e: grove_runtime::Error) -> ConnectError {
    err(super::files::from_runtime(e))
}

/// The user of a Connect request: E2B sends `Authorization: Basic base64("<user>:")`.
pub fn user_of(h: &HeaderMap) -> Result<Option<String>, ConnectError> {
    let Some(v) = h.get("authorization") else {
        return Ok(None);
    };
    let bad = || ConnectError::new(Code::Unauthenticated, "authorization: not Basic <user>:");
    let v = v.to_str().map_err(|_| bad())?;
    let Some(b64) = v.strip_prefix("Basic ") else {
        return Err(bad());
    };
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|_| bad())?;
    let s = String::from_utf8(raw).map_err(|_| bad())?;
    let name = s.split(':').next().unwrap_or("").to_string();
    Ok(Some(name).filter(|n| !n.is_empty()))
}

/// The sandbox's root and the request's user, on the blocking pool.
async fn open(ctx: &Ctx) -> Result<(Arc<Root>, User), ConnectError> {
    let name = user_of(&ctx.headers)?;
    let (rt, id) = (ctx.app.runtime.clone(), ctx.sandbox.clone());
    blocking(move || {
        Ok((|| {
            let root = rt.files(&id).map_err(rt_err)?;
            let u = user(&root, name.as_deref()).map_err(err)?;
            Ok((Arc::new(root), u))
        })())
    })
    .await
    .map_err(ConnectError::from)?
}

async fn on_root<T: Send + 'static>(
    ctx: &Ctx,
    f: impl FnOnce(&Root, &User) -> Result<T, ConnectError> + Send + 'static,
) -> Result<T, ConnectError> {
    let (root, u) = open(ctx).await?;
    blocking(move || Ok(f(&root, &u)))
        .await
        .map_err(ConnectError::from)?
}

fn abs(u: &User, p: &str) -> Result<String, ConnectError> {
    if p.is_empty() {
        return Err(ConnectError::invalid("path: must not be empty"));
    }
    path_for(u, p).map_err(err)
}

/// `-rwxr-xr-x`, as envd (Go's FileMode) writes it.
fn permissions(st: &FileStat) -> String {
    let kind = match st.kind {
        "dir" => 'd',
        "symlink" => 'L',
        _ => '-',
    };
    let mut s = String::with_capacity(10);
    s.push(kind);
    for shift in [6u32, 3, 0] {
        let bits = (st.mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

fn entry(path: &str, st: &FileStat, names: &Names) -> pb::EntryInfo {
    let kind = match st.kind {
        "file" => pb::FileType::File,
        "dir" => pb::FileType::Directory,
        "symlink" => pb::FileType::Symlink,
        _ => pb::FileType::Unspecified,
    };
    pb::EntryInfo {
        name: st.name.clone(),
        r#type: kind as i32,
        path: path.to_string(),
        size: st.size as i64,
        mode: st.mode & 0o7777,
        permissions: permissions(st),
        owner: names
            .users
            .get(&st.uid)
            .cloned()
            .unwrap_or_else(|| st.uid.to_string()),
        group: names
            .groups
            .get(&st.gid)
            .cloned()
            .unwrap_or_else(|| st.gid.to_string()),
        modified_time: Some(pbjson_types::Timestamp {
            seconds: st.mtime_secs,
            nanos: st.mtime_nanos as i32,
        }),
        symlink_target: st.symlink_target.clone(),
        metadata: Default::default(),
    }
}

fn stat_entry(root: &Root, path: &str) -> Result<pb::EntryInfo, ConnectError> {
    let st = root.stat(path).map_err(rt_err)?;
    Ok(entry(path, &st, &Names::read(root)))
}

async fn stat(ctx: Ctx, req: pb::StatRequest) -> Result<pb::StatResponse, ConnectError> {
    on_root(&ctx, move |root, u| {
        let p = abs(u, &req.path)?;
        Ok(pb::StatResponse {
            entry: Some(stat_entry(root, &p)?),
        })
    })
    .await
}

async fn make_dir(ctx: Ctx, req: pb::MakeDirRequest) -> Result<pb::MakeDirResponse, ConnectError> {
    on_root(&ctx, move |root, u| {
        let p = abs(u, &req.path)?;
        let made = root.make_dir(&p, Some((u.uid, u.gid))).map_err(rt_err)?;
        if !made {
            return Err(ConnectError::new(
                Code::AlreadyExists,
                format!("directory {p:?} already exists"),
            ));
        }
        Ok(pb::MakeDirResponse {
            entry: Some(stat_entry(root, &p)?),
        })
    })
    .await
}

async fn move_entry(ctx: Ctx, req: pb::MoveRequest) -> Result<pb::MoveResponse, ConnectError> {
    on_root(&ctx, move |root, u| {
        let from = abs(u, &req.source)?;
        let to = abs(u, &req.destination)?;
        root.rename(&from, &to).map_err(rt_err)?;
        Ok(pb::MoveResponse {
            entry: Some(stat_entry(root, &to)?),
        })
    })
    .await
}

async fn remove(ctx: Ctx, req: pb::RemoveRequest) -> Result<pb::RemoveResponse, ConnectError> {
    on_root(&ctx, move |root, u| {
        let p = abs(u, &req.path)?;
        if p == "/" {
            return Err(ConnectError::invalid(
                "path: the root directory is not removed",
            ));
        }
        root.remove(&p).map_err(rt_err)?;
        Ok(pb::RemoveResponse {})
    })
    .await
}

fn join(dir: &str, name: &str) -> String {
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// The entries under `dir` down to `depth` levels (1: its children), at most `max`.
/// Directories reached through symlinks are not descended into.
fn walk(
    root: &Root,
    dir: &str,
    depth: u32,
    max: usize,
    out: &mut Vec<(String, FileStat)>,
) -> Result<(), ConnectError> {
    let list = root.list(dir).map_err(rt_err)?;
    for e in list {
        if out.len() >= max {
            return Ok(());
        }
        let p = join(dir, &e.name);
        let Ok(st) = root.stat(&p) else { continue };
        let is_dir = st.kind == "dir";
        out.push((p.clone(), st));
        if is_dir && depth > 1 {
            // A directory that went away or cannot be read meanwhile is skipped.
            let _ = walk(root, &p, depth - 1, max, out);
        }
    }
    Ok(())
}

async fn list_dir(ctx: Ctx, req: pb::ListDirRequest) -> Result<pb::ListDirResponse, ConnectError> {
    on_root(&ctx, move |root, u| {
        let p = abs(u, &req.path)?;
        let st = root.stat(&p).map_err(rt_err)?;
        if st.kind != "dir" {
            return Err(ConnectError::invalid(format!(
                "path: {p:?} is not a directory"
            )));
        }
        let mut found = Vec::new();
        walk(root, &p, req.depth.max(1), WATCH_MAX_ENTRIES, &mut found)?;
        let names = Names::read(root);
        Ok(pb::ListDirResponse {
            entries: found.iter().map(|(p, st)| entry(p, st, &names)).collect(),
        })
    })
    .await
}

/// What a watch remembers of one entry.
#[derive(Clone, PartialEq, Eq)]
struct Seen {
    kind: &'static str,
    size: u64,
    mtime: (i64, i64),
    mode: u32,
}

fn look(root: &Root, dir: &str, recursive: bool) -> Result<BTreeMap<String, Seen>, ConnectError> {
    let mut found = Vec::new();
    let depth = if recursive { u32::MAX } else { 1 };
    walk(root, dir, depth, WATCH_MAX_ENTRIES, &mut found)?;
    Ok(found
        .into_iter()
        .map(|(p, st)| {
            (
                p,
                Seen {
                    kind: st.kind,
                    size: st.size,
                    mtime: (st.mtime_secs, st.mtime_nanos),
                    mode: st.mode,
                },
            )
        })
        .collect())
}

/// Events between two looks, named relative to the watched directory.
fn diff(
    dir: &str,
    old: &BTreeMap<String, Seen>,
    new: &BTreeMap<String, Seen>,
) -> Vec<(String, pb::EventType)> {
    let rel = |p: &str| {
        p.strip_prefix(dir)
            .unwrap_or(p)
            .trim_start_matches('/')
            .to_string()
    };
    let mut out = Vec::new();
    for (p, s) in new {
        match old.get(p) {
            None => {
                out.push((rel(p), pb::EventType::Create));
                if s.kind == "file" && s.size > 0 {
                    out.push((rel(p), pb::EventType::Write));
                }
            }
            Some(o) if o.kind != s.kind => {
                out.push((rel(p), pb::EventType::Remove));
                out.push((rel(p), pb::EventType::Create));
            }
            Some(o) => {
                if o.size != s.size || o.mtime != s.mtime {
                    out.push((rel(p), pb::EventType::Write));
                }
                if o.mode != s.mode {
                    out.push((rel(p), pb::EventType::Chmod));
                }
            }
        }
    }
    for p in old.keys() {
        if !new.contains_key(p) {
            out.push((rel(p), pb::EventType::Remove));
        }
    }
    out
}

fn watch_msg(event: pb::watch_dir_response::Event) -> pb::WatchDirResponse {
    pb::WatchDirResponse { event: Some(event) }
}

struct Watch {
    root: Arc<Root>,
    dir: String,
    recursive: bool,
    include_entry: bool,
    seen: BTreeMap<String, Seen>,
    queue: std::collections::VecDeque<pb::WatchDirResponse>,
    quiet_since: tokio::time::Instant,
    rt: Arc<grove_runtime::Runtime>,
    id: grove_runtime::SandboxId,
}

async fn watch_dir(
    ctx: Ctx,
    req: pb::WatchDirRequest,
) -> Result<impl futures::Stream<Item = Result<pb::WatchDirResponse, ConnectError>>, ConnectError> {
    let (root, u) = open(&ctx).await?;
    let dir = abs(&u, &req.path)?;
    let recursive = req.recursive;
    let first = {
        let (root, dir) = (root.clone(), dir.clone());
        blocking(move || {
            Ok((|| {
                let st = root.stat(&dir).map_err(rt_err)?;
                if st.kind != "dir" {
                    return Err(ConnectError::invalid(format!(
                        "path: {dir:?} is not a directory"
                    )));
                }
                look(&root, &dir, recursive)
            })())
        })
        .await
        .map_err(ConnectError::from)??
    };
    let mut w = Watch {
        root,
        dir,
        recursive,
        include_entry: req.include_entry,
        seen: first,
        queue: Default::default(),
        quiet_since: tokio::time::Instant::now(),
        rt: ctx.app.runtime.clone(),
        id: ctx.sandbox.clone(),
    };
    w.queue
        .push_back(watch_msg(pb::watch_dir_response::Event::Start(
            pb::watch_dir_response::StartEvent {},
        )));
    Ok(futures::stream::unfold(Some(w), |w| async move {
        let mut w = w?;
        loop {
            if let Some(m) = w.queue.pop_front() {
                return Some((Ok(m), Some(w)));
            }
            tokio::time::sleep(WATCH_TICK).await;
            let (root, dir, rec, rt, id) = (
                w.root.clone(),
                w.dir.clone(),
                w.recursive,
                w.rt.clone(),
                w.id.clone(),
            );
            let (old, include) = (std::mem::take(&mut w.seen), w.include_entry);
            let looked = tokio::task::spawn_blocking(move || {
                // The sandbox went (or stopped running): the watch ends with it.
                match rt.get(&id) {
                    Ok(i) if i.state == grove_runtime::SandboxState::Running => {}
                    _ => {
                        return Err(ConnectError::new(
                            Code::Unavailable,
                            format!("The sandbox {id} was not found"),
                        ))
                    }
                }
                let now = look(&root, &dir, rec)?;
                let names = Names::read(&root);
                let events: Vec<pb::FilesystemEvent> = diff(&dir, &old, &now)
                    .into_iter()
                    .map(|(name, kind)| {
                        let full = join(&dir, &name);
                        let entry = if include && kind != pb::EventType::Remove {
                            root.stat(&full).ok().map(|st| entry(&full, &st, &names))
                        } else {
                            None
                        };
                        pb::FilesystemEvent {
                            name,
                            r#type: kind as i32,
                            entry,
                        }
                    })
                    .collect();
                Ok((now, events))
            })
            .await;
            let (now, events) = match looked {
                Ok(Ok(l)) => l,
                Ok(Err(e)) => return Some((Err(e), None)),
                Err(e) => return Some((Err(ConnectError::internal(e.to_string())), None)),
            };
            for ev in events {
                w.queue
                    .push_back(watch_msg(pb::watch_dir_response::Event::Filesystem(ev)));
            }
            w.seen = now;
            if !w.queue.is_empty() {
                w.quiet_since = tokio::time::Instant::now();
            } else if w.quiet_since.elapsed() >= KEEPALIVE {
                w.quiet_since = tokio::time::Instant::now();
                w.queue
                    .push_back(watch_msg(pb::watch_dir_response::Event::Keepalive(
                        pb::watch_dir_response::KeepAlive {},
                    )));
            }
        }
    }))
}

/// A polled watcher of the non-streaming watch API (what the sync SDK uses): it keeps the last
/// look, and each GetWatcherEvents answers what changed since. Watchers live in groved's memory,
/// at most [`MAX_WATCHERS`]; one not polled for [`WATCHER_IDLE`] or whose sandbox is gone is
/// dropped at the next access.
struct Watcher {
    sandbox: grove_runtime::SandboxId,
    root: Arc<Root>,
    dir: String,
    recursive: bool,
    include_entry: bool,
    seen: BTreeMap<String, Seen>,
    used: std::time::Instant,
}

const MAX_WATCHERS: usize = 256;
const WATCHER_IDLE: Duration = Duration::from_secs(600);

static WATCHERS: std::sync::LazyLock<
    parking_lot::Mutex<std::collections::HashMap<String, Watcher>>,
> = std::sync::LazyLock::new(Default::default);

fn sweep(rt: &grove_runtime::Runtime) {
    WATCHERS.lock().retain(|_, w| {
        w.used.elapsed() < WATCHER_IDLE
            && rt
                .get(&w.sandbox)
                .is_ok_and(|i| i.state != grove_runtime::SandboxState::Destroyed)
    });
}

async fn create_watcher(
    ctx: Ctx,
    req: pb::CreateWatcherRequest,
) -> Result<pb::CreateWatcherResponse, ConnectError> {
    let (root, u) = open(&ctx).await?;
    let dir = abs(&u, &req.path)?;
    let (rt, sandbox) = (ctx.app.runtime.clone(), ctx.sandbox.clone());
    blocking(move || {
        Ok((|| {
            let st = root.stat(&dir).map_err(rt_err)?;
            if st.kind != "dir" {
                return Err(ConnectError::invalid(format!(
                    "path: {dir:?} is not a directory"
                )));
            }
            let seen = look(&root, &dir, req.recursive)?;
            sweep(&rt);
            let mut all = WATCHERS.lock();
            if all.len() >= MAX_WATCHERS {
                return Err(ConnectError::new(
                    Code::ResourceExhausted,
                    format!("at most {MAX_WATCHERS} watchers at a time on this node"),
                ));
            }
            let bytes: [u8; 16] = rand::random();
            let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            all.insert(
                id.clone(),
                Watcher {
                    sandbox,
                    root,
                    dir,
                    recursive: req.recursive,
                    include_entry: req.include_entry,
                    seen,
                    used: std::time::Instant::now(),
                },
            );
            Ok(pb::CreateWatcherResponse { watcher_id: id })
        })())
    })
    .await
    .map_err(ConnectError::from)?
}

/// Takes the sandbox's watcher out of the table (a watcher of another sandbox is not found).
fn take_watcher(sandbox: &grove_runtime::SandboxId, id: &str) -> Result<Watcher, ConnectError> {
    let mut all = WATCHERS.lock();
    match all.get(id) {
        Some(w) if &w.sandbox == sandbox => Ok(all.remove(id).expect("present")),
        _ => Err(ConnectError::not_found(format!("watcher {id:?} not found"))),
    }
}

async fn get_watcher_events(
    ctx: Ctx,
    req: pb::GetWatcherEventsRequest,
) -> Result<pb::GetWatcherEventsResponse, ConnectError> {
    let mut w = take_watcher(&ctx.sandbox, &req.watcher_id)?;
    let rt = ctx.app.runtime.clone();
    blocking(move || {
        Ok((|| {
            if !rt
                .get(&w.sandbox)
                .is_ok_and(|i| i.state == grove_runtime::SandboxState::Running)
            {
                return Err(ConnectError::new(
                    Code::Unavailable,
                    format!("The sandbox {} was not found", w.sandbox),
                ));
            }
            let now = match look(&w.root, &w.dir, w.recursive) {
                Ok(n) => n,
                Err(e) => {
                    WATCHERS.lock().insert(req.watcher_id.clone(), w);
                    return Err(e);
                }
            };
            let names = Names::read(&w.root);
            let events = diff(&w.dir, &w.seen, &now)
                .into_iter()
                .map(|(name, kind)| {
                    let full = join(&w.dir, &name);
                    let entry = if w.include_entry && kind != pb::EventType::Remove {
                        w.root.stat(&full).ok().map(|st| entry(&full, &st, &names))
                    } else {
                        None
                    };
                    pb::FilesystemEvent {
                        name,
                        r#type: kind as i32,
                        entry,
                    }
                })
                .collect();
            w.seen = now;
            w.used = std::time::Instant::now();
            WATCHERS.lock().insert(req.watcher_id.clone(), w);
            Ok(pb::GetWatcherEventsResponse { events })
        })())
    })
    .await
    .map_err(ConnectError::from)?
}

async fn remove_watcher(
    ctx: Ctx,
    req: pb::RemoveWatcherRequest,
) -> Result<pb::RemoveWatcherResponse, ConnectError> {
    take_watcher(&ctx.sandbox, &req.watcher_id)?;
    Ok(pb::RemoveWatcherResponse {})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(size: u64, mtime: i64, mode: u32) -> Seen {
        Seen {
            kind: "file",
            size,
            mtime: (mtime, 0),
            mode,
        }
    }

    #[test]
    fn diff_names_events_relative_to_the_watched_dir() {
        let old: BTreeMap<_, _> = [
            ("/w/a".to_string(), seen(1, 1, 0o644)),
            ("/w/b".to_string(), seen(1, 1, 0o644)),
            ("/w/c".to_string(), seen(1, 1, 0o644)),
        ]
        .into();
        let new: BTreeMap<_, _> = [
            ("/w/a".to_string(), seen(2, 2, 0o644)),
            ("/w/b".to_string(), seen(1, 1, 0o600)),
            ("/w/d/e".to_string(), seen(0, 3, 0o644)),
        ]
        .into();
        let d = diff("/w", &old, &new);
        assert_eq!(
            d,
            vec![
                ("a".to_string(), pb::EventType::Write),
                ("b".to_string(), pb::EventType::Chmod),
                ("d/e".to_string(), pb::EventType::Create),
                ("c".to_string(), pb::EventType::Remove),
            ]
        );
    }

    #[test]
    fn the_user_comes_from_basic_auth() {
        let mut h = HeaderMap::new();
        assert_eq!(user_of(&h).unwrap(), None);
        h.insert("authorization", "Basic cm9vdDo=".parse().unwrap());
        assert_eq!(user_of(&h).unwrap().as_deref(), Some("root"));
        h.insert("authorization", "Bearer x".parse().unwrap());
        assert!(user_of(&h).is_err());
    }
}
