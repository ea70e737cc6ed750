//! Predictive sizing: how many warm sandboxes a pool should hold, from the recent create rate.
//!
//! Creates are counted per window (default 1 s). The rate estimate is an exponentially decaying
//! peak of the per-window rate: a burst raises it at once, and it halves every `half_life` without
//! demand. A plain moving average would spread a burst over the quiet time between rollouts and
//! size the pool for the mean, so the next burst would find it short; the decaying peak remembers
//! the bursts of the last few minutes and still shrinks the pool when demand falls away.
//! Target = ceil(rate × horizon × headroom), bounded by the pool's min/max, where the horizon is
//! the time the pool must bridge before refills catch up: one window, or one build if longer.

use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Demand {
    window_start: Instant,
    in_window: u32,
    peak_per_sec: f64,
}

impl Demand {
    pub fn new(now: Instant) -> Self {
        Demand {
            window_start: now,
            in_window: 0,
            peak_per_sec: 0.0,
        }
    }

    pub fn note(&mut self, now: Instant, window: Duration, half_life: Duration) {
        self.roll(now, window, half_life);
        self.in_window += 1;
    }

    /// Closes every window that ended before `now`, folding it into the decaying peak.
    pub fn roll(&mut self, now: Instant, window: Duration, half_life: Duration) {
        let w = window.as_secs_f64().max(1e-3);
        let elapsed = now
            .saturating_duration_since(self.window_start)
            .as_secs_f64();
        let closed = (elapsed / w).floor();
        if closed < 1.0 {
            return;
        }
        let decay = 0.5f64.powf(w / half_life.as_secs_f64().max(1e-3));
        // The first closed window held `in_window` creates; the rest were empty.
        let rate = f64::from(self.in_window) / w;
        self.peak_per_sec = rate.max(self.peak_per_sec * decay) * decay.powf(closed - 1.0);
        // Under one create per 20 s the pool is not worth its memory.
        if self.peak_per_sec < 0.05 {
            self.peak_per_sec = 0.0;
        }
        self.in_window = 0;
        self.window_start += Duration::from_secs_f64(closed * w);
    }

    /// Creates per second: the decaying peak, or the window in progress if it is already higher.
    pub fn rate(&self, window: Duration) -> f64 {
        let current = f64::from(self.in_window) / window.as_secs_f64().max(1e-3);
        self.peak_per_sec.max(current)
    }
}

/// The pool size for a demand of `rate` creates/s.
pub fn target(rate: f64, horizon: Duration, headroom: f64, min: u32, max: u32) -> u32 {
    let want = (rate * horizon.as_secs_f64() * headroom).ceil();
    let want = if want.is_finite() && want > 0.0 {
        want.min(f64::from(u32::MAX)) as u32
    } else {
        0
    };
    want.clamp(min, max.max(min))
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_secs(1);
    const H: Duration = Duration::from_secs(30);

    #[test]
    fn a_burst_sizes_the_pool_and_quiet_shrinks_it() {
        let t0 = Instant::now();
        let mut d = Demand::new(t0);
        for _ in 0..40 {
            d.note(t0 + Duration::from_millis(100), W, H);
        }
        assert_eq!(d.rate(W), 40.0, "the burst counts while it happens");
        d.roll(t0 + Duration::from_millis(1500), W, H);
        let after_burst = target(d.rate(W), W, 1.25, 0, 1000);
        assert!((49..=50).contains(&after_burst), "{after_burst}");
        // Ten quiet seconds (the gap between rollouts): still most of it.
        d.roll(t0 + Duration::from_secs(11), W, H);
        assert!(target(d.rate(W), W, 1.25, 0, 1000) >= 39);
        // Five quiet minutes: gone.
        d.roll(t0 + Duration::from_secs(300), W, H);
        assert_eq!(target(d.rate(W), W, 1.25, 0, 1000), 0);
        assert_eq!(target(d.rate(W), W, 1.25, 2, 1000), 2, "min holds");
    }

    #[test]
    fn bounds_and_horizon() {
        assert_eq!(target(100.0, W, 1.0, 0, 16), 16);
        assert_eq!(target(2.0, Duration::from_secs(3), 1.0, 0, 16), 6);
        assert_eq!(target(f64::NAN, W, 1.0, 1, 16), 1);
    }
}
