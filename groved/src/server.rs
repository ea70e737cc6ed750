//! Listeners, the TTL reaper, and orderly shutdown: on SIGTERM/SIGINT stop accepting, let in-flight requests
//! finish, end event streams, then destroy every sandbox (or, with `keep_sandboxes_on_stop`, leave them to
//! the next groved, which adopts them).

use std::future::IntoFuture as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

use crate::app::App;
use crate::systemd;

/// How long in-flight requests get to finish after a shutdown signal.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(120);

/// Binds the unix socket, refusing to steal one a live daemon is serving.
pub fn bind_unix(path: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            bail!("{} is in use: another groved is running", path.display());
        }
        std::fs::remove_file(path)
            .with_context(|| format!("removing stale socket {}", path.display()))?;
    }
    let l = tokio::net::UnixListener::bind(path)
        .with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .with_context(|| format!("chmod {}", path.display()))?;
    Ok(l)
}

/// A TCP listener whose connections send small writes at once. With Nagle's algorithm on, a
/// response written in pieces (headers, then body; HTTP/2's frames) waits for the client's
/// delayed ACK of the first piece: 40 ms per request on loopback.
pub fn no_delay(
    l: tokio::net::TcpListener,
) -> impl axum::serve::Listener<Addr = std::net::SocketAddr> {
    use axum::serve::ListenerExt as _;
    l.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY: {e}");
        }
    })
}

/// Serves until a shutdown signal, then drains and shuts the runtime down.
pub async fn serve(app: Arc<App>) -> anyhow::Result<()> {
    // Before the socket exists: a SIGTERM sent as soon as groved answers (a supervisor's stop
    // right after start) must drain and stop it, not kill it with the default action and leave
    // its sandboxes behind.
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let uds = bind_unix(&app.config.socket)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let mut servers = tokio::task::JoinSet::new();
    let router = crate::api::router(app.clone(), None);
    servers.spawn(
        axum::serve(uds, router)
            .with_graceful_shutdown(stopped(stop_rx.clone()))
            .into_future(),
    );
    for addr in &app.config.listen {
        let tcp = match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) => {
                let _ = std::fs::remove_file(&app.config.socket);
                return Err(e).with_context(|| format!("binding {addr}"));
            }
        };
        let router = crate::api::router(app.clone(), app.config.api_key.clone());
        servers.spawn(
            axum::serve(no_delay(tcp), router)
                .with_graceful_shutdown(stopped(stop_rx.clone()))
                .into_future(),
        );
    }
    if let Some(addr) = app.config.e2b_listen {
        let tcp = match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) => {
                let _ = std::fs::remove_file(&app.config.socket);
                return Err(e).with_context(|| format!("binding the E2B endpoint {addr}"));
            }
        };
        tracing::info!(addr = %tcp.local_addr()?, "E2B-compatible endpoint serving");
        servers.spawn(crate::e2b::serve(app.clone(), tcp, stop_rx.clone()));
    }
    tracing::info!(socket = %app.config.socket.display(), tcp = ?app.config.listen, "groved serving");
    let reaper = tokio::spawn(reap(app.clone(), stop_rx.clone()));
    #[cfg(feature = "debug-hooks")]
    {
        let hooks = crate::debug_hooks::DebugHooks::from_env();
        hooks.arm()?;
        if let Some(d) = hooks.ready_delay {
            tokio::time::sleep(d).await;
        }
    }
    #[cfg(not(feature = "debug-hooks"))]
    if std::env::var_os("GROVED_DEBUG_HOOKS").is_some() {
        tracing::warn!(
            "GROVED_DEBUG_HOOKS ignored: this groved is built without the debug-hooks feature"
        );
    }
    // Every listener is bound: clients connecting from now on are served.
    systemd::notify_or_log("READY=1\nSTATUS=serving");
    let watchdog =
        systemd::watchdog_interval().map(|every| tokio::spawn(watchdog(app.clone(), every)));

    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: draining"),
        _ = int.recv() => tracing::info!("SIGINT: draining"),
        r = servers.join_next() => tracing::error!("a listener stopped: {r:?}"),
    }
    systemd::notify_or_log("STOPPING=1\nSTATUS=draining");
    if let Some(w) = watchdog {
        w.abort();
    }
    app.start_draining();
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while servers.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!("requests still running after {DRAIN_TIMEOUT:?}; shutting down anyway");
        servers.abort_all();
    }
    // A reap under way finishes (its destroys and pauses run on blocking threads an abort would
    // not stop); the runtime's shutdown also waits for any such work a request left behind.
    if tokio::time::timeout(DRAIN_TIMEOUT, reaper).await.is_err() {
        tracing::warn!("the reaper still busy after {DRAIN_TIMEOUT:?}; shutting down anyway");
    }
    let _ = std::fs::remove_file(&app.config.socket);
    let running = app.runtime.list().len();
    if app.config.keep_sandboxes_on_stop && running > 0 {
        // Warm pools are Grove's own, not the users': they go now.
        let rt = app.runtime.clone();
        tokio::task::spawn_blocking(move || rt.drain_pools()).await?;
        // Records, roots, cgroups, network and the private grove-init stay for the next groved to adopt.
        tracing::info!(
            "groved stopped; {running} sandboxes left running for the next start to adopt"
        );
        return Ok(());
    }
    let rt = app.runtime.clone();
    tokio::task::spawn_blocking(move || rt.shutdown()).await?;
    // Every root is unmounted: the FUSE server goes too (kept above, it serves the kept roots).
    if let Some(fsd) = app.fsd.clone() {
        if let Err(e) = tokio::task::spawn_blocking(move || fsd.shutdown()).await? {
            tracing::warn!("stopping grove-fsd: {}", crate::error::chain(&e));
        }
    }
    let _ = std::fs::remove_file(app.config.run_dir.join("fsd.log"));
    let _ = std::fs::remove_file(app.config.run_dir.join("grove-init"));
    // The snapshotter's scratch, then the run dir itself: nothing of ours stays in it.
    if let Some(s) = &app.snapshots {
        s.close();
    }
    let _ = std::fs::remove_dir(&app.config.run_dir);
    tracing::info!("groved stopped");
    Ok(())
}

/// Destroys sandboxes past their time-to-live (the runtime emits their `expired` events), then
/// reclaims idle ones; ends between two rounds once `stop` is set.
async fn reap(app: Arc<App>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(app.config.reap_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut imports = ImportRetry::default();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        // Sandboxes made through the E2B endpoint with autoPause pause where others expire.
        if app.config.e2b_listen.is_some() {
            crate::e2b::control::pause_due(&app).await;
        }
        let rt = app.runtime.clone();
        match tokio::task::spawn_blocking(move || rt.reap_expired()).await {
            Ok(ids) if !ids.is_empty() => {
                tracing::info!(count = ids.len(), "reaped expired sandboxes")
            }
            Ok(_) => {}
            Err(e) => tracing::error!("reaper: {e}"),
        }
        crate::api::pause::reclaim_idle(&app).await;
        crate::lifetimes::expire_snapshots(&app).await;
        imports.tick(&app).await;
    }
}

/// Background imports of snapshot images that failed (a full disk): each failure is an event once,
/// and every `import_retry` they are queued again, so a snapshot becomes durable when space returns.
#[derive(Default)]
struct ImportRetry {
    reported: std::collections::HashSet<String>,
    last_retry: Option<tokio::time::Instant>,
}

impl ImportRetry {
    async fn tick(&mut self, app: &Arc<App>) {
        let Some(snaps) = app.snapshots.clone() else {
            return;
        };
        let due = self
            .last_retry
            .is_none_or(|t| t.elapsed() >= app.config.import_retry);
        let failed = match tokio::task::spawn_blocking(move || {
            let failed = snaps.import_failures();
            if due && !failed.is_empty() {
                snaps.retry_imports();
            }
            failed
        })
        .await
        {
            Ok(f) => f,
            Err(e) => return tracing::error!("import retry: {e}"),
        };
        if due {
            self.last_retry = Some(tokio::time::Instant::now());
        }
        if self.reported.len() > 10_000 {
            self.reported.clear();
        }
        for (name, why) in &failed {
            if self.reported.insert(format!("{name}\0{why}")) {
                app.emit(crate::events::own(
                    "snapshot_import_failed",
                    None,
                    Some(name.clone()),
                    Some(why.clone()),
                ));
            }
        }
    }
}

/// Pings systemd's watchdog while the daemon really works: each ping follows a round trip through the
/// runtime's state on the blocking pool, answered within one interval, so a deadlocked daemon (async
/// workers or blocking pool stuck, the runtime's locks held) stops pinging and gets restarted.
async fn watchdog(app: Arc<App>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let rt = app.runtime.clone();
        let probe = tokio::task::spawn_blocking(move || rt.capacity());
        match tokio::time::timeout(every, probe).await {
            Ok(Ok(_)) => systemd::notify_or_log("WATCHDOG=1"),
            Ok(Err(e)) => tracing::error!("watchdog probe failed: {e}"),
            Err(_) => tracing::error!("watchdog probe took over {every:?}; not pinging"),
        }
    }
}
