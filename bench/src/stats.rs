//! Summary statistics over benchmark samples: percentiles, ratios.
//!
//! Percentiles use linear interpolation between closest ranks (the same definition as numpy's default), so a
//! p99 over few samples is pulled towards the maximum rather than jumping to it.

use serde::{Deserialize, Serialize};

/// Distribution of one measured quantity.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub n: usize,
    pub min: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
}

/// The `p`-th percentile (0..=100) of already sorted samples; `None` when there are none.
pub fn percentile_sorted(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() || !(0.0..=100.0).contains(&p) {
        return None;
    }
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let frac = rank - lo as f64;
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * frac)
}

/// Summarises samples; NaNs are ignored. `None` when no finite sample is left.
pub fn summarize(samples: &[f64]) -> Option<Summary> {
    let mut s: Vec<f64> = samples.iter().copied().filter(|v| v.is_finite()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    let pct = |p| percentile_sorted(&s, p).unwrap_or(f64::NAN);
    Some(Summary {
        n: s.len(),
        min: s[0],
        p50: pct(50.0),
        p90: pct(90.0),
        p99: pct(99.0),
        max: s[s.len() - 1],
        mean: s.iter().sum::<f64>() / s.len() as f64,
    })
}

/// Grove ÷ peer; `None` when either side is missing or the peer is zero.
pub fn ratio(grove: Option<f64>, peer: Option<f64>) -> Option<f64> {
    match (grove, peer) {
        (Some(g), Some(p)) if p != 0.0 && g.is_finite() && p.is_finite() => Some(g / p),
        _ => None,
    }
}

/// Median of samples (convenience for figures that are not reported as distributions).
pub fn median(samples: &[f64]) -> Option<f64> {
    summarize(samples).map(|s| s.p50)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_interpolates_between_ranks() {
        let s = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile_sorted(&s, 0.0), Some(1.0));
        assert_eq!(percentile_sorted(&s, 100.0), Some(4.0));
        assert_eq!(percentile_sorted(&s, 50.0), Some(2.5));
        let p99 = percentile_sorted(&s, 99.0).unwrap();
        assert!((p99 - 3.97).abs() < 1e-9, "{p99}");
    }

    #[test]
    fn percentile_rejects_empty_and_out_of_range() {
        assert_eq!(percentile_sorted(&[], 50.0), None);
        assert_eq!(percentile_sorted(&[1.0], 101.0), None);
        assert_eq!(percentile_sorted(&[1.0], -1.0), None);
        assert_eq!(percentile_sorted(&[7.0], 99.0), Some(7.0));
    }

    #[test]
    fn summarize_sorts_and_ignores_nan() {
        let s = summarize(&[5.0, f64::NAN, 1.0, 3.0]).unwrap();
        assert_eq!(s.n, 3);
        assert_eq!(s.min, 1.0);
        assert_eq!(s.max, 5.0);
        assert_eq!(s.p50, 3.0);
        assert_eq!(s.mean, 3.0);
        assert!(summarize(&[f64::NAN]).is_none());
        assert!(summarize(&[]).is_none());
    }

    #[test]
    fn p99_of_hundred_samples() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = summarize(&v).unwrap();
        assert!((s.p99 - 99.01).abs() < 1e-9, "{}", s.p99);
        assert!((s.p50 - 50.5).abs() < 1e-9);
    }

    #[test]
    fn ratio_handles_missing_and_zero() {
        assert_eq!(ratio(Some(10.0), Some(20.0)), Some(0.5));
        assert_eq!(ratio(None, Some(1.0)), None);
        assert_eq!(ratio(Some(1.0), None), None);
        assert_eq!(ratio(Some(1.0), Some(0.0)), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
    }
}
