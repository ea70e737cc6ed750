//! Lifecycle events: the runtime's own (bridged from its channel) plus groved's (snapshots, forks), fanned out
//! to every `/v1/events` subscriber.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use grove_runtime::{Event, Runtime};
use tokio::sync::broadcast;

use crate::wire::EventWire;

pub type EventTx = broadcast::Sender<EventWire>;

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub fn channel() -> EventTx {
    broadcast::channel(4096).0
}

pub fn from_runtime(e: &Event) -> EventWire {
    let kind = serde_json::to_value(e.kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string));
    EventWire {
        at_ms: e.at_ms,
        kind: kind.unwrap_or_else(|| "unknown".into()),
        sandbox: Some(e.sandbox.to_string()),
        snapshot: None,
        reason: e.reason.clone(),
    }
}

/// Forwards the runtime's events until it drops its sender. Runs on its own thread (the runtime's channel blocks).
pub fn bridge(runtime: &Arc<Runtime>, tx: EventTx) {
    let rx = runtime.subscribe();
    let spawned = std::thread::Builder::new()
        .name("grove-events".into())
        .spawn(move || {
            while let Ok(e) = rx.recv() {
                let _ = tx.send(from_runtime(&e));
            }
        });
    if let Err(e) = spawned {
        tracing::error!("cannot start the event bridge: {e}");
    }
}

/// An event groved itself raises (snapshot and fork lifecycle).
pub fn own(
    kind: &str,
    sandbox: Option<String>,
    snapshot: Option<String>,
    reason: Option<String>,
) -> EventWire {
    EventWire {
        at_ms: now_ms(),
        kind: kind.into(),
        sandbox,
        snapshot,
        reason,
    }
}
