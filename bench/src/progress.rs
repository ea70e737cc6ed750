//! One line per step on stderr: elapsed time and an ETA from the scenarios' estimated durations.

use std::sync::Mutex;
use std::time::Instant;

struct State {
    start: Instant,
    /// Estimated seconds of all selected scenarios.
    total_est: f64,
    /// Estimated seconds of the scenarios already finished.
    done_est: f64,
    current_est: f64,
    current: String,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn mmss(s: f64) -> String {
    let s = s.max(0.0) as u64;
    format!("{:02}:{:02}", s / 60, s % 60)
}

/// Starts the clock for a run whose scenarios are estimated to take `total_est` seconds.
pub fn start(total_est: f64) {
    *STATE.lock().unwrap_or_else(|e| e.into_inner()) = Some(State {
        start: Instant::now(),
        total_est,
        done_est: 0.0,
        current_est: 0.0,
        current: String::new(),
    });
}

pub fn begin_scenario(name: &str, est: f64) {
    if let Some(s) = STATE.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        s.current = name.into();
        s.current_est = est;
    }
}

pub fn end_scenario() {
    if let Some(s) = STATE.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        s.done_est += s.current_est;
        s.current_est = 0.0;
    }
}

/// Reports a step; `frac` is how far into the current scenario it is (0..1).
pub fn step(frac: f64, msg: &str) {
    let g = STATE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(s) = g.as_ref() else {
        eprintln!("[bench] {msg}");
        return;
    };
    let elapsed = s.start.elapsed().as_secs_f64();
    let done = s.done_est + s.current_est * frac.clamp(0.0, 1.0);
    let pct = if s.total_est > 0.0 {
        100.0 * done / s.total_est
    } else {
        0.0
    };
    // Scale the remaining estimate by how the run has kept to its estimates so far.
    let pace = if done > 1.0 {
        (elapsed / done).clamp(0.3, 5.0)
    } else {
        1.0
    };
    let eta = (s.total_est - done) * pace;
    eprintln!(
        "[{:>3.0}% {} elapsed, ETA {}] {}: {msg}",
        pct,
        mmss(elapsed),
        mmss(eta),
        s.current
    );
}

#[cfg(test)]
mod tests {
    #[test]
    fn mmss_formats() {
        assert_eq!(super::mmss(0.0), "00:00");
        assert_eq!(super::mmss(125.4), "02:05");
    }
}
