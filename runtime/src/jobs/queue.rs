//! The fair queue's state: who waits, what each job holds, and whose turn it is.
//!
//! Order across jobs is start-time fair queuing: each admission of job j advances j's finish tag
//! by 1/share; the waiting job with the smallest start tag (max of its finish tag and the virtual
//! clock) goes next. Admissions therefore follow the shares while jobs compete, and a job that was
//! idle starts at the clock, not in the past, so it cannot starve the others by catching up.
//! Within a job, higher priority goes first, then arrival order. One waiter tries the node at a
//! time; after it finds the node full, nobody tries again until something is freed.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{JobStatus, JobsConfig};
use crate::error::Error;
use crate::types::Limits;

/// What a job's live sandboxes hold.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub sandboxes: u64,
    pub cpu_millis: u64,
    pub memory_mb: u64,
}

impl Usage {
    fn add(&mut self, l: &Limits) {
        self.sandboxes += 1;
        self.cpu_millis += u64::from(l.cpu_millis);
        self.memory_mb += l.memory_mb;
    }
    fn sub(&mut self, l: &Limits) {
        self.sandboxes = self.sandboxes.saturating_sub(1);
        self.cpu_millis = self.cpu_millis.saturating_sub(u64::from(l.cpu_millis));
        self.memory_mb = self.memory_mb.saturating_sub(l.memory_mb);
    }
}

#[derive(Debug, Default)]
struct JobState {
    usage: Usage,
    finish: f64,
    admitted: u64,
    waited: u64,
    wait_ms_total: u64,
    wait_ms_max: u64,
    timed_out: u64,
}

#[derive(Debug)]
struct Waiter {
    seq: u64,
    job: String,
    priority: i32,
    limits: Limits,
    /// Told to wait at least once.
    waited: bool,
}

/// What a waiter does next.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Reserve node capacity now (only this waiter tries).
    Try,
    /// Sleep until something changes. `full`: the node or the job's quota is full (rather than
    /// another waiter being ahead or trying); `why` is for the timeout error.
    Wait { why: String, full: bool },
}

pub struct Queue {
    pub config: JobsConfig,
    jobs: BTreeMap<String, JobState>,
    waiters: Vec<Waiter>,
    next_seq: u64,
    vclock: f64,
    /// Bumped whenever capacity is freed.
    gen: u64,
    /// The waiter that last found the node full, and the generation it found it full at.
    blocked: Option<(u64, u64)>,
    trying: Option<u64>,
    recent_grants: VecDeque<Instant>,
}

const RECENT_GRANTS: usize = 64;

impl Queue {
    pub fn new(config: JobsConfig) -> Self {
        Queue {
            config,
            jobs: BTreeMap::new(),
            waiters: Vec::new(),
            next_seq: 0,
            vclock: 0.0,
            gen: 0,
            blocked: None,
            trying: None,
            recent_grants: VecDeque::new(),
        }
    }

    pub fn waiting(&self) -> usize {
        self.waiters.len()
    }

    /// Whether one more sandbox of `l` stays within the job's quota.
    pub fn fits_quota(&self, job: &str, l: &Limits) -> bool {
        self.quota_excess(job, l).is_none()
    }

    fn quota_excess(&self, job: &str, l: &Limits) -> Option<String> {
        let p = self.config.policy(job);
        let u = self.jobs.get(job).map(|j| j.usage).unwrap_or_default();
        let checks = [
            ("max_sandboxes", p.max_sandboxes, u.sandboxes + 1),
            (
                "max_cpu_millis",
                p.max_cpu_millis,
                u.cpu_millis + u64::from(l.cpu_millis),
            ),
            ("max_memory_mb", p.max_memory_mb, u.memory_mb + l.memory_mb),
        ];
        checks.into_iter().find_map(|(name, max, want)| {
            max.filter(|&m| want > m)
                .map(|m| format!("job {job} is at its quota ({name} = {m})"))
        })
    }

    /// A request no amount of waiting can admit: larger than the job's whole quota.
    pub fn check_fits_quota_ever(&self, job: &str, l: &Limits) -> Result<(), Error> {
        let p = self.config.policy(job);
        let too_big = [
            ("max_sandboxes", p.max_sandboxes, 1),
            ("max_cpu_millis", p.max_cpu_millis, u64::from(l.cpu_millis)),
            ("max_memory_mb", p.max_memory_mb, l.memory_mb),
        ]
        .into_iter()
        .find(|(_, max, want)| max.is_some_and(|m| *want > m));
        match too_big {
            Some((name, Some(max), want)) => Err(Error::invalid(
                "job",
                format!("job {job} has {name} = {max}; one sandbox needs {want}"),
            )),
            _ => Ok(()),
        }
    }

    pub fn enqueue(&mut self, job: &str, priority: i32, limits: Limits) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.jobs.entry(job.to_string()).or_default();
        self.waiters.push(Waiter {
            seq,
            job: job.to_string(),
            priority,
            limits,
            waited: false,
        });
        seq
    }

    fn share(&self, job: &str) -> f64 {
        f64::from(self.config.policy(job).share.max(1))
    }

    /// The waiter whose turn it is: quota permitting, the job with the smallest start tag, and
    /// in it the highest priority, then the earliest.
    fn head(&self) -> Option<u64> {
        let mut best: Option<(f64, i32, u64)> = None;
        for w in &self.waiters {
            if !self.fits_quota(&w.job, &w.limits) {
                continue;
            }
            let finish = self.jobs.get(&w.job).map_or(0.0, |j| j.finish);
            let start = finish.max(self.vclock);
            let key = (start, -w.priority, w.seq);
            let better = match best {
                None => true,
                Some((s, p, q)) => key.partial_cmp(&(s, p, q)) == Some(std::cmp::Ordering::Less),
            };
            if better {
                best = Some(key);
            }
        }
        best.map(|(_, _, seq)| seq)
    }

    pub fn verdict(&mut self, seq: u64) -> Verdict {
        let verdict = self.verdict_of(seq);
        if let Verdict::Wait { .. } = verdict {
            if let Some(w) = self.waiters.iter_mut().find(|w| w.seq == seq) {
                w.waited = true;
            }
        }
        verdict
    }

    fn verdict_of(&self, seq: u64) -> Verdict {
        let Some(me) = self.waiters.iter().find(|w| w.seq == seq) else {
            return Verdict::Wait {
                why: "left the queue".into(),
                full: true,
            };
        };
        if let Some(why) = self.quota_excess(&me.job, &me.limits) {
            return Verdict::Wait { why, full: true };
        }
        let why = || {
            let others = self.waiters.len() - 1;
            format!("node full, {others} other creates queued")
        };
        if self.blocked == Some((seq, self.gen)) {
            return Verdict::Wait {
                why: why(),
                full: true,
            };
        }
        if self.trying.is_some() || self.head() != Some(seq) {
            // Behind a waiter that found no room: as full for this one.
            let full = self.blocked.is_some_and(|(_, g)| g == self.gen);
            return Verdict::Wait { why: why(), full };
        }
        Verdict::Try
    }

    pub fn begin_try(&mut self, seq: u64) {
        self.trying = Some(seq);
    }

    /// The trying waiter found the node full: wait for a release.
    pub fn node_full(&mut self, seq: u64) {
        if self.trying == Some(seq) {
            self.trying = None;
        }
        self.blocked = Some((seq, self.gen));
    }

    /// Something may have freed room that nobody announced: let the head try again.
    pub fn bump(&mut self) {
        self.gen += 1;
        self.blocked = None;
    }

    fn charge(&mut self, job: &str, l: &Limits) {
        let share = self.share(job);
        let vclock = self.vclock;
        let j = self.jobs.entry(job.to_string()).or_default();
        j.usage.add(l);
        let start = j.finish.max(vclock);
        j.finish = start + 1.0 / share;
        j.admitted += 1;
        self.vclock = start;
        let now = Instant::now();
        if self.recent_grants.len() == RECENT_GRANTS {
            self.recent_grants.pop_front();
        }
        self.recent_grants.push_back(now);
    }

    pub fn grant(&mut self, seq: u64, waited_for: Duration) {
        let Some(pos) = self.waiters.iter().position(|w| w.seq == seq) else {
            return;
        };
        let w = self.waiters.remove(pos);
        if self.trying == Some(seq) {
            self.trying = None;
        }
        self.unblock(seq);
        self.charge(&w.job, &w.limits);
        if w.waited {
            let ms = waited_for.as_millis() as u64;
            let j = self.jobs.entry(w.job).or_default();
            j.waited += 1;
            j.wait_ms_total += ms;
            j.wait_ms_max = j.wait_ms_max.max(ms);
        }
    }

    /// A waiter that found the node full leaves: whoever is head now gets to try.
    fn unblock(&mut self, seq: u64) {
        if self.blocked.is_some_and(|(s, _)| s == seq) {
            self.blocked = None;
        }
    }

    pub fn grant_direct(&mut self, job: &str, l: &Limits) {
        self.charge(job, l);
    }

    pub fn abandon(&mut self, seq: u64, timed_out: bool) {
        self.unblock(seq);
        if let Some(pos) = self.waiters.iter().position(|w| w.seq == seq) {
            let w = self.waiters.remove(pos);
            if timed_out {
                self.jobs.entry(w.job).or_default().timed_out += 1;
            }
        }
        if self.trying == Some(seq) {
            self.trying = None;
        }
    }

    pub fn release(&mut self, job: &str, l: &Limits) {
        if let Some(j) = self.jobs.get_mut(job) {
            j.usage.sub(l);
        }
        self.bump();
    }

    /// A guess of when a create could get in: the queue ahead over the recent admission rate.
    pub fn retry_after_secs(&self) -> u64 {
        let fallback = (self.config.queue_timeout_ms / 1000).clamp(1, 60);
        let (Some(first), Some(_)) = (self.recent_grants.front(), self.recent_grants.back()) else {
            return fallback;
        };
        let span = first.elapsed().as_secs_f64();
        if self.recent_grants.len() < 2 || span <= 0.0 {
            return fallback;
        }
        let rate = self.recent_grants.len() as f64 / span;
        ((self.waiters.len() + 1) as f64 / rate)
            .ceil()
            .clamp(1.0, 60.0) as u64
    }

    pub fn status(&self) -> Vec<JobStatus> {
        let mut names: Vec<&String> = self.jobs.keys().chain(self.config.jobs.keys()).collect();
        names.sort();
        names.dedup();
        names
            .into_iter()
            .map(|name| {
                let j = self.jobs.get(name);
                JobStatus {
                    job: name.clone(),
                    policy: self.config.policy(name).clone(),
                    usage: j.map(|j| j.usage).unwrap_or_default(),
                    queued: self.waiters.iter().filter(|w| &w.job == name).count() as u64,
                    admitted: j.map_or(0, |j| j.admitted),
                    waited: j.map_or(0, |j| j.waited),
                    wait_ms_total: j.map_or(0, |j| j.wait_ms_total),
                    wait_ms_max: j.map_or(0, |j| j.wait_ms_max),
                    timed_out: j.map_or(0, |j| j.timed_out),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jobs::JobPolicy;

    fn config(shares: &[(&str, u32)]) -> JobsConfig {
        JobsConfig {
            queue_timeout_ms: 1000,
            jobs: shares
                .iter()
                .map(|(n, s)| {
                    (
                        n.to_string(),
                        JobPolicy {
                            share: *s,
                            ..Default::default()
                        },
                    )
                })
                .collect(),
            ..Default::default()
        }
    }

    /// Serves `n` admissions from a queue kept full by both jobs; returns how many each got.
    fn serve(q: &mut Queue, n: usize) -> BTreeMap<String, usize> {
        let l = Limits::default();
        let mut got = BTreeMap::new();
        for _ in 0..n {
            for job in ["big", "small"] {
                if !q.waiters.iter().any(|w| w.job == job) {
                    q.enqueue(job, 0, l);
                }
            }
            let seq = q.head().expect("a head");
            assert_eq!(q.verdict(seq), Verdict::Try);
            let job = q.waiters.iter().find(|w| w.seq == seq).unwrap().job.clone();
            q.grant(seq, Duration::ZERO);
            *got.entry(job).or_default() += 1;
        }
        got
    }

    #[test]
    fn admissions_follow_shares() {
        let mut q = Queue::new(config(&[("big", 3), ("small", 1)]));
        let got = serve(&mut q, 400);
        assert_eq!((got["big"], got["small"]), (300, 100));
    }

    #[test]
    fn an_idle_job_does_not_catch_up() {
        let mut q = Queue::new(config(&[("big", 3), ("small", 1)]));
        let l = Limits::default();
        for _ in 0..100 {
            let s = q.enqueue("big", 0, l);
            q.grant(s, Duration::ZERO);
        }
        // "small" arrives late: it gets its share from now on, not 100 admissions in a row.
        let got = serve(&mut q, 40);
        assert!(got["big"].abs_diff(30) <= 1, "{got:?}");
    }

    #[test]
    fn priority_orders_within_a_job_only() {
        let mut q = Queue::new(config(&[]));
        let l = Limits::default();
        let low = q.enqueue("a", 0, l);
        let high = q.enqueue("a", 5, l);
        assert_eq!(q.head(), Some(high));
        q.grant(high, Duration::ZERO);
        assert_eq!(q.head(), Some(low));
    }

    #[test]
    fn quota_holds_a_job_back_but_not_the_others() {
        let mut cfg = config(&[]);
        cfg.jobs.insert(
            "capped".into(),
            JobPolicy {
                max_sandboxes: Some(1),
                ..Default::default()
            },
        );
        let mut q = Queue::new(cfg);
        let l = Limits::default();
        let a = q.enqueue("capped", 0, l);
        q.grant(a, Duration::ZERO);
        let b = q.enqueue("capped", 0, l);
        let c = q.enqueue("other", 0, l);
        assert!(
            matches!(q.verdict(b), Verdict::Wait { why, full: true } if why.contains("max_sandboxes"))
        );
        assert_eq!(q.verdict(c), Verdict::Try);
        q.grant(c, Duration::ZERO);
        q.release("capped", &l);
        assert_eq!(q.verdict(b), Verdict::Try);
        assert!(q.check_fits_quota_ever("capped", &l).is_ok());
    }

    #[test]
    fn a_full_node_blocks_until_a_release() {
        let mut q = Queue::new(config(&[]));
        let l = Limits::default();
        let a = q.enqueue("a", 0, l);
        assert_eq!(q.verdict(a), Verdict::Try);
        q.begin_try(a);
        q.node_full(a);
        assert!(matches!(q.verdict(a), Verdict::Wait { full: true, .. }));
        q.release("b", &l);
        assert_eq!(q.verdict(a), Verdict::Try);
        q.grant(a, Duration::from_millis(7));
        // A waiter that found no room and left does not block the next one.
        let big = q.enqueue("a", 0, l);
        q.begin_try(big);
        q.node_full(big);
        q.abandon(big, true);
        let small = q.enqueue("a", 0, l);
        assert_eq!(q.verdict(small), Verdict::Try);
        let st = q.status();
        assert_eq!((st[0].waited, st[0].wait_ms_max), (1, 7));
    }
}
