//! Lifecycle events: the runtime's own (bridged from its channel) plus groved's (snapshots, forks), fanned out
//! to every `/v1/events` subscriber.

use std::sync::Arc;

use grove_runtime::{Event, Runtime};
use tokio::sync::broadcast;

use crate::api_shapes::EventWire;

pub type EventTx = broadcast::Sender<EventWire>;

pub use grove_runtime::now_ms;

/// The civil date (year, month 1-12, day 1-31) of `days` since 1970-01-01 (Howard Hinnant's
/// algorithm), for the timestamps groved and the bench print.
pub fn civil_date(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
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
