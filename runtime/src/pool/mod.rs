//! Warm pools: per image and size, sandboxes kept ready (root mounted, cgroups made, init
//! listening) so a create is a hand-over, not a build. A pooled sandbox has never run user code;
//! its id has never been shown to anyone. Pools refill in the background, yielding to foreground
//! creates, and are sized by a fixed count or predictively from demand (see `sizing`).

mod claim;
mod refill;
pub mod sizing;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::sandbox::Sandbox;
use crate::types::{Limits, SandboxId};
use sizing::Demand;

/// What makes pooled sandboxes interchangeable. Network policy, env, hostname, labels and ttl
/// are applied at claim.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PoolKey {
    pub image: String,
    pub limits: Limits,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolMode {
    /// Always `max` ready.
    Fixed,
    /// Sized from demand, between `min` and `max`.
    #[default]
    Predictive,
}

/// One configured pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    pub image: String,
    /// None: the runtime's default limits.
    #[serde(default)]
    pub limits: Option<Limits>,
    #[serde(default)]
    pub mode: PoolMode,
    #[serde(default)]
    pub min: u32,
    pub max: u32,
}

/// Every pool of the node, and how predictive sizing behaves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PoolsConfig {
    pub pools: Vec<PoolSpec>,
    /// The most-requested sizes without a configured pool get a predictive one (min 0,
    /// max `auto_max`): this many of them. 0 = only configured pools.
    pub auto_sizes: u32,
    pub auto_max: u32,
    /// Demand is counted per window...
    pub window_ms: u64,
    /// ...and its peak halves after this long without demand.
    pub half_life_ms: u64,
    /// Predictive targets are the expected demand times this.
    pub headroom: f64,
}

impl Default for PoolsConfig {
    fn default() -> Self {
        PoolsConfig {
            pools: Vec::new(),
            auto_sizes: 0,
            auto_max: 32,
            window_ms: 1000,
            half_life_ms: 60_000,
            headroom: 1.25,
        }
    }
}

/// Most pools (configured and automatic) and most sizes whose demand is tracked.
const MAX_POOLS: usize = 64;
const MAX_TRACKED: usize = 256;
const MAX_POOL_SIZE: u32 = 4096;

impl PoolsConfig {
    pub fn validate(&self) -> Result<(), Error> {
        if self.pools.len() > MAX_POOLS {
            return Err(Error::invalid(
                "pools",
                format!("at most {MAX_POOLS} pools"),
            ));
        }
        for (i, p) in self.pools.iter().enumerate() {
            if p.max > MAX_POOL_SIZE || p.min > p.max {
                return Err(Error::invalid(
                    &format!("pools[{i}]"),
                    format!("need min <= max <= {MAX_POOL_SIZE}"),
                ));
            }
            if let Some(l) = &p.limits {
                crate::validate::limits(l)?;
            }
        }
        if self.auto_max > MAX_POOL_SIZE || self.auto_sizes as usize > MAX_POOLS {
            return Err(Error::invalid("auto_max", "too large"));
        }
        if !(1..=60_000).contains(&self.window_ms)
            || self.half_life_ms < self.window_ms
            || self.half_life_ms > 86_400_000
        {
            return Err(Error::invalid(
                "window_ms",
                "need 1 <= window_ms <= 60000 and window_ms <= half_life_ms <= 1 day",
            ));
        }
        if !(self.headroom.is_finite() && (1.0..=10.0).contains(&self.headroom)) {
            return Err(Error::invalid("headroom", "must be within 1..=10"));
        }
        Ok(())
    }

    fn window(&self) -> Duration {
        Duration::from_millis(self.window_ms)
    }
    fn half_life(&self) -> Duration {
        Duration::from_millis(self.half_life_ms)
    }
}

/// A pool as it stands.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolStatus {
    pub image: String,
    pub limits: Limits,
    pub mode: PoolMode,
    /// Made by `auto_sizes`, not configured.
    pub auto: bool,
    pub min: u32,
    pub max: u32,
    /// The size the pool is heading for now.
    pub target: u32,
    pub idle: u32,
    pub filling: u32,
    /// Creates served from the pool, and creates of this size it could not serve.
    pub hits: u64,
    pub misses: u64,
    pub demand_per_sec: f64,
    /// Memory the idle sandboxes hold (their cgroups' usage).
    pub idle_memory_bytes: u64,
}

struct Entry {
    idle: Vec<Arc<Sandbox>>,
    filling: u32,
    demand: Demand,
    hits: u64,
    misses: u64,
    /// Seconds one build took, smoothed.
    build_secs: f64,
    last_demand: Instant,
}

impl Entry {
    fn new(now: Instant) -> Self {
        Entry {
            idle: Vec::new(),
            filling: 0,
            demand: Demand::new(now),
            hits: 0,
            misses: 0,
            build_secs: 0.0,
            last_demand: now,
        }
    }
}

/// The (mode, min, max, auto) a key is pooled under, if it is.
type Bounds = (PoolMode, u32, u32, bool);

#[derive(Default)]
struct State {
    config: PoolsConfig,
    /// `config.pools` with their limits filled in.
    configured: HashMap<PoolKey, (PoolMode, u32, u32)>,
    keys: HashMap<PoolKey, Entry>,
}

impl State {
    /// Configured pools, then the most-demanded other keys up to `auto_sizes`.
    fn bounds(&self, now: Instant) -> HashMap<PoolKey, Bounds> {
        let mut out: HashMap<PoolKey, Bounds> = self
            .configured
            .iter()
            .map(|(k, &(m, lo, hi))| (k.clone(), (m, lo, hi, false)))
            .collect();
        if self.config.auto_sizes > 0 {
            let w = self.config.window();
            let mut demanded: Vec<(f64, &PoolKey)> = self
                .keys
                .iter()
                .filter(|(k, _)| !self.configured.contains_key(*k))
                .map(|(k, e)| {
                    let mut d = e.demand.clone();
                    d.roll(now, w, self.config.half_life());
                    (d.rate(w), k)
                })
                .filter(|(r, _)| *r > 0.0)
                .collect();
            demanded.sort_by(|a, b| b.0.total_cmp(&a.0));
            for (_, k) in demanded.into_iter().take(self.config.auto_sizes as usize) {
                out.insert(
                    k.clone(),
                    (PoolMode::Predictive, 0, self.config.auto_max, true),
                );
            }
        }
        out
    }

    fn target(&mut self, key: &PoolKey, b: &Bounds, now: Instant) -> u32 {
        let (mode, min, max, _) = *b;
        if mode == PoolMode::Fixed {
            return max;
        }
        let (w, h, headroom) = (
            self.config.window(),
            self.config.half_life(),
            self.config.headroom,
        );
        let Some(e) = self.keys.get_mut(key) else {
            return min;
        };
        e.demand.roll(now, w, h);
        let horizon = w.max(Duration::from_secs_f64(e.build_secs));
        sizing::target(e.demand.rate(w), horizon, headroom, min, max)
    }

    /// Drops demand records of unpooled keys nobody asked for lately, beyond `MAX_TRACKED`.
    /// The entry of `key`, made (first seen `now`) if the pool has none yet.
    fn entry(&mut self, key: &PoolKey, now: Instant) -> &mut Entry {
        self.keys
            .entry(key.clone())
            .or_insert_with(|| Entry::new(now))
    }

    fn forget_old(&mut self) {
        if self.keys.len() <= MAX_TRACKED {
            return;
        }
        let mut old: Vec<(Instant, PoolKey)> = self
            .keys
            .iter()
            .filter(|(k, e)| {
                e.idle.is_empty() && e.filling == 0 && !self.configured.contains_key(*k)
            })
            .map(|(k, e)| (e.last_demand, k.clone()))
            .collect();
        old.sort_by_key(|(t, _)| *t);
        let excess = self.keys.len() - MAX_TRACKED;
        for (_, k) in old.into_iter().take(excess) {
            self.keys.remove(&k);
        }
    }
}

/// What the refill worker should do next.
pub(crate) enum Step {
    Fill(PoolKey),
    Shrink(Arc<Sandbox>),
    Idle,
}

pub struct Pools {
    state: Mutex<State>,
    wake: Condvar,
    stop: AtomicBool,
    worker: Mutex<Option<JoinHandle<()>>>,
    /// Foreground creates in flight: the refill waits for them.
    foreground: AtomicUsize,
}

impl Default for Pools {
    fn default() -> Self {
        Pools {
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            worker: Mutex::new(None),
            foreground: AtomicUsize::new(0),
        }
    }
}

/// Counts a foreground create while it lives.
pub(crate) struct Foreground<'a>(&'a AtomicUsize);

impl Drop for Foreground<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Pools {
    pub(crate) fn foreground(&self) -> Foreground<'_> {
        self.foreground.fetch_add(1, Ordering::SeqCst);
        Foreground(&self.foreground)
    }

    fn busy(&self) -> bool {
        self.foreground.load(Ordering::SeqCst) > 0
    }

    /// Ids of the idle sandboxes (owned by the runtime, for residue).
    pub(crate) fn ids(&self) -> Vec<SandboxId> {
        let st = self.state.lock();
        st.keys
            .values()
            .flat_map(|e| e.idle.iter().map(|s| s.id.clone()))
            .collect()
    }

    /// Counts a create of `key` and hands out an idle sandbox if there is one.
    pub(crate) fn take(&self, key: &PoolKey) -> Option<Arc<Sandbox>> {
        let now = Instant::now();
        let mut st = self.state.lock();
        let (w, h) = (st.config.window(), st.config.half_life());
        let e = st.entry(key, now);
        e.demand.note(now, w, h);
        e.last_demand = now;
        let got = e.idle.pop();
        if got.is_some() {
            e.hits += 1;
        } else {
            e.misses += 1;
        }
        st.forget_old();
        drop(st);
        self.wake.notify_all();
        got
    }

    /// Puts back a sandbox taken but not handed over (the claim gave way to the queue).
    pub(crate) fn put_back(&self, key: &PoolKey, sb: Arc<Sandbox>) {
        let mut st = self.state.lock();
        let e = st.entry(key, Instant::now());
        e.hits = e.hits.saturating_sub(1);
        e.misses += 1;
        e.idle.push(sb);
    }

    fn filling(&self, key: &PoolKey, delta: i32) {
        let now = Instant::now();
        let mut st = self.state.lock();
        let e = st.entry(key, now);
        e.filling = e.filling.saturating_add_signed(delta);
    }

    /// A freshly built sandbox joins the pool; `took` is how long its build took.
    fn add(&self, key: &PoolKey, sb: Arc<Sandbox>, took: Duration) {
        let now = Instant::now();
        let mut st = self.state.lock();
        let e = st.entry(key, now);
        let s = took.as_secs_f64();
        e.build_secs = if e.build_secs == 0.0 {
            s
        } else {
            0.8 * e.build_secs + 0.2 * s
        };
        e.idle.push(sb);
    }

    /// The next thing the refill should do: shrink a pool above its target first, then fill the
    /// pool furthest below its target — unless foreground creates are in flight or `queued`.
    pub(crate) fn next_step(&self, queued: bool) -> Step {
        let now = Instant::now();
        let mut st = self.state.lock();
        let bounds = st.bounds(now);
        for key in bounds.keys() {
            st.entry(key, now);
        }
        let keys: Vec<PoolKey> = st.keys.keys().cloned().collect();
        let mut deficit: Option<(u32, PoolKey)> = None;
        for key in keys {
            let target = match bounds.get(&key) {
                Some(b) => st.target(&key, b, now),
                None => 0,
            };
            let Some(e) = st.keys.get_mut(&key) else {
                continue;
            };
            let have = e.idle.len() as u32;
            if have > target {
                // Oldest first: the newest are the warmest in the page cache.
                return Step::Shrink(e.idle.remove(0));
            }
            let short = target - have;
            if short > e.filling && deficit.as_ref().is_none_or(|(d, _)| short > *d) {
                deficit = Some((short, key));
            }
        }
        match deficit {
            Some((_, key)) if !queued && !self.busy() => {
                // Counted from the decision on, so `set_pools` waits for it.
                if let Some(e) = st.keys.get_mut(&key) {
                    e.filling += 1;
                }
                Step::Fill(key)
            }
            _ => Step::Idle,
        }
    }

    /// An idle sandbox to evict so a foreground create fits: from the pool with the most idle
    /// sandboxes beyond its target.
    pub(crate) fn victim(&self) -> Option<Arc<Sandbox>> {
        let now = Instant::now();
        let mut st = self.state.lock();
        let bounds = st.bounds(now);
        let keys: Vec<PoolKey> = st.keys.keys().cloned().collect();
        let mut best: Option<(i64, PoolKey)> = None;
        for key in keys {
            let target = match bounds.get(&key) {
                Some(b) => st.target(&key, b, now),
                None => 0,
            };
            let have = st.keys.get(&key).map_or(0, |e| e.idle.len() as i64);
            let surplus = have - i64::from(target);
            if have > 0 && best.as_ref().is_none_or(|(s, _)| surplus > *s) {
                best = Some((surplus, key));
            }
        }
        let (_, key) = best?;
        st.keys.get_mut(&key)?.idle.pop()
    }

    fn filling_total(&self) -> u32 {
        self.state.lock().keys.values().map(|e| e.filling).sum()
    }

    /// Takes every idle sandbox (shutdown).
    pub(crate) fn take_all(&self) -> Vec<Arc<Sandbox>> {
        let mut st = self.state.lock();
        st.keys
            .values_mut()
            .flat_map(|e| e.idle.drain(..))
            .collect()
    }

    pub(crate) fn config(&self) -> PoolsConfig {
        self.state.lock().config.clone()
    }

    fn configure(&self, config: PoolsConfig, defaults: &Limits) {
        let mut st = self.state.lock();
        st.configured = config
            .pools
            .iter()
            .map(|p| {
                let key = PoolKey {
                    image: p.image.clone(),
                    limits: p.limits.unwrap_or(*defaults),
                };
                (key, (p.mode, p.min, p.max))
            })
            .collect();
        st.config = config;
        drop(st);
        self.wake.notify_all();
    }

    /// (key, status without memory, idle ids) of every pool and of every key with idle sandboxes.
    fn status(&self) -> Vec<(PoolStatus, Vec<SandboxId>)> {
        let now = Instant::now();
        let mut st = self.state.lock();
        let bounds = st.bounds(now);
        let window = st.config.window();
        let keys: Vec<PoolKey> = st.keys.keys().chain(bounds.keys()).cloned().collect();
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        for key in keys {
            if !seen.insert(key.clone()) {
                continue;
            }
            let b = bounds.get(&key).copied();
            let target = match &b {
                Some(b) => st.target(&key, b, now),
                None => 0,
            };
            let e = st.keys.get(&key);
            if b.is_none() && e.is_none_or(|e| e.idle.is_empty() && e.filling == 0) {
                continue;
            }
            let (mode, min, max, auto) = b.unwrap_or((PoolMode::Predictive, 0, 0, true));
            out.push((
                PoolStatus {
                    image: key.image.clone(),
                    limits: key.limits,
                    mode,
                    auto,
                    min,
                    max,
                    target,
                    idle: e.map_or(0, |e| e.idle.len() as u32),
                    filling: e.map_or(0, |e| e.filling),
                    hits: e.map_or(0, |e| e.hits),
                    misses: e.map_or(0, |e| e.misses),
                    demand_per_sec: e.map_or(0.0, |e| e.demand.rate(window)),
                    idle_memory_bytes: 0,
                },
                e.map(|e| e.idle.iter().map(|s| s.id.clone()).collect())
                    .unwrap_or_default(),
            ));
        }
        out.sort_by(|a, b| {
            (&a.0.image, a.0.limits.memory_mb, a.0.limits.cpu_millis).cmp(&(
                &b.0.image,
                b.0.limits.memory_mb,
                b.0.limits.cpu_millis,
            ))
        });
        out
    }
}
