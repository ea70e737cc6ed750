//! The numeric promises of SPECIFICATION.md, each tied to the bench figure that measures it.

use crate::scenarios::{
    api, checkpoint as ck, density as de, e2b, elastic as el, filesystem as fs, fork_memory as fm,
    images as im, images_build as ib, lifecycle as lc, rounds as ro, storage as st,
};

/// Which statistic of a figure a promise is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stat {
    P50,
}

/// The bound a promise sets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Goal {
    AtMost(f64),
    AtLeast(f64),
}

/// One promise: Grove's figure `metric`/`param` in `scenario` (or its ratio to `relative_to`) against `goal`.
#[derive(Debug, Clone)]
pub struct Promise {
    pub id: &'static str,
    pub text: &'static str,
    pub scenario: &'static str,
    pub metric: &'static str,
    pub param: &'static str,
    pub stat: Stat,
    pub relative_to: Option<&'static str>,
    pub goal: Goal,
}

impl Promise {
    pub fn at_most(
        id: &'static str,
        text: &'static str,
        scenario: &'static str,
        metric: &'static str,
        param: &'static str,
        stat: Stat,
        bound: f64,
    ) -> Self {
        Promise {
            id,
            text,
            scenario,
            metric,
            param,
            stat,
            relative_to: None,
            goal: Goal::AtMost(bound),
        }
    }
    pub fn at_least(
        id: &'static str,
        text: &'static str,
        scenario: &'static str,
        metric: &'static str,
        param: &'static str,
        bound: f64,
    ) -> Self {
        let goal = Goal::AtLeast(bound);
        Promise {
            id,
            text,
            scenario,
            metric,
            param,
            stat: Stat::P50,
            relative_to: None,
            goal,
        }
    }
    /// A goal on Grove ÷ `peer` (medians).
    pub fn relative(
        id: &'static str,
        text: &'static str,
        scenario: &'static str,
        metric: &'static str,
        param: &'static str,
        peer: &'static str,
        goal: Goal,
    ) -> Self {
        Promise {
            id,
            text,
            scenario,
            metric,
            param,
            stat: Stat::P50,
            relative_to: Some(peer),
            goal,
        }
    }
    pub fn goal_text(&self) -> String {
        let (op, v) = match self.goal {
            Goal::AtMost(v) => ("≤", v),
            Goal::AtLeast(v) => ("≥", v),
        };
        match self.relative_to {
            Some(peer) => format!("{op} {v}× {peer}"),
            None => format!("{op} {v}"),
        }
    }
}

/// Every promise, in SPECIFICATION.md order.
pub fn all() -> Vec<Promise> {
    use Goal::*;
    vec![
        Promise::at_most("LC-1", "create → exec true → destroy, sequential, p50 (ms)", lc::NAME, lc::CYCLE, lc::SEQ, Stat::P50, 30.0),
        Promise::relative("LC-2", "cold create → exec → destroy no slower than crun (p50)", lc::NAME, lc::CYCLE, lc::SEQ, lc::CRUN, AtMost(1.0)),
        Promise::at_least("LC-3", "cycles/s with 2 concurrent clients", lc::NAME, lc::RATE, "concurrency 2", 200.0),
        Promise::at_least("LC-4", "cycles/s with 8 concurrent clients", lc::NAME, lc::RATE, "concurrency 8", 200.0),
        Promise::at_most("LC-5", "warm-pool claim → exec true, p50 (ms)", el::NAME, el::WARM, el::SEQ, Stat::P50, 5.0),
        Promise::at_most("DE-1", "memory per idle sandbox at 2,000 sandboxes, FUSE server share included (KiB)", de::NAME, de::PER_SANDBOX, "2000 sandboxes", Stat::P50, 1024.0),
        Promise::at_most("CK-1", "first snapshot of python3 with 256 MiB heap, p50 (ms)", ck::NAME, ck::SNAPSHOT, "256 MiB heap, first", Stat::P50, 300.0),
        Promise::at_most("CK-2", "second snapshot after touching 5 % of the heap: store bytes added ÷ bytes touched", ck::NAME, ck::SECOND_RATIO, "256 MiB heap", Stat::P50, 1.2),
        Promise::at_most("CK-3", "restore one copy to running and answering, p50 (ms)", ck::NAME, ck::FORK, "256 MiB heap, 1 branches", Stat::P50, 200.0),
        Promise::at_most("CK-4", "fork into 8 branches, all running and answering, p50 (ms)", ck::NAME, ck::FORK, "256 MiB heap, 8 branches", Stat::P50, 600.0),
        Promise::at_most("CK-5", "100 rounds of snapshot → fork 4 → destroy: per-round latency, last tenth ÷ first tenth", ro::NAME, ro::GROWTH, "100 rounds", Stat::P50, 1.2),
        Promise::at_most("CK-6", "100 rounds: store bytes each round adds ÷ bytes it touched, last tenth, p50", ro::NAME, ro::STORE, "100 rounds, last tenth", Stat::P50, 1.2),
        Promise::at_most("CK-7", "100 rounds: Grove residue and scratch files left after them", ro::NAME, ro::RESIDUE, "100 rounds", Stat::P50, 0.0),
        Promise::at_most("CK-8", "8 branches of one snapshot, each dirtying 1 % after the fork: host MemAvailable drop ÷ one copy", ck::NAME, fm::HOST_DROP, "256 MiB heap, 8 branches", Stat::P50, 1.5),
        Promise::at_most("CK-9", "32 branches of one snapshot, each dirtying 1 % after the fork: host MemAvailable drop ÷ one copy", ck::NAME, fm::HOST_DROP, "256 MiB heap, 32 branches", Stat::P50, 2.0),
        Promise::at_most("CK-10", "second snapshot after touching 5 % of the heap, p50 (ms)", ck::NAME, ck::SNAPSHOT, "256 MiB heap, second, after touching 5 % of the heap", Stat::P50, 60.0),
        Promise::at_most("CK-11", "fork into 8 branches, all running and answering, p50 (ms), the tree-search bar", ck::NAME, ck::FORK, "256 MiB heap, 8 branches", Stat::P50, 250.0),
        Promise::at_most("CK-12", "second snapshot after touching 5 % of the heap: time frozen, p50 (ms)", ck::NAME, ck::SECOND_FROZEN, "256 MiB heap", Stat::P50, 30.0),
        Promise::at_most("CK-13", "snapshot after dirtying 5 % of the heap's pages: store bytes added ÷ bytes dirtied", ck::NAME, ck::DIRTY_RATIO, "256 MiB heap, 5 % dirtied", Stat::P50, 1.1),
        Promise::relative("FS-1", "sequential read of a 1 GiB file, cold (MiB/s)", fs::NAME, fs::SEQ_READ, "1024 MiB file", fs::OVERLAY, AtLeast(0.7)),
        Promise::relative("FS-2", "cold python3 -c 'import email, json, http.client' (ms)", fs::NAME, fs::PY_IMPORT, "", fs::OVERLAY, AtMost(1.2)),
        Promise::relative("FS-3", "untar of a source tree (ms)", fs::NAME, fs::UNTAR, "python3.11 stdlib + /usr/share", fs::OVERLAY, AtMost(2.0)),
        Promise::relative("FS-4", "find + stat over 50,000 files, warm (ms)", fs::NAME, fs::FIND_STAT, "50000 files", fs::OVERLAY, AtMost(1.0)),
        Promise::relative("FS-5", "pip install of a 2,000-file wheel into the sandbox root (ms)", fs::NAME, fs::PIP_INSTALL, "2000-module wheel", fs::OVERLAY, AtMost(1.5)),
        Promise::at_most("ST-1", "second import of the base image: bytes added ÷ first import's bytes", st::NAME, st::REIMPORT, "", Stat::P50, 0.01),
        Promise::at_most("ST-2", "store bytes after 10 commits each changing 1 % of a 100 MiB tree ÷ first commit's bytes", st::NAME, st::CHAIN_RATIO, "100 MiB tree", Stat::P50, 1.2),
        Promise::relative("IM-1", "pull of a ~300 MB image from a local registry, no slower than the faster of skopeo and podman", im::NAME, im::PULL, "cold", im::FASTER_PEER, AtMost(1.0)),
        Promise::at_most("IM-2", "a second image sharing all but its top layer: store bytes it adds ÷ the first image's", im::NAME, im::ADDED_RATIO, im::RATIO_PARAM, Stat::P50, 0.1),
        Promise::at_most("IM-3", "rebuild of a 6-step Dockerfile with nothing changed (fully cached), p50 (ms)", ib::NAME, ib::CACHED, "sequential", Stat::P50, 500.0),
        Promise::at_most("API-1", "latency the HTTP API adds to exec true over a library call, p50 (ms)", api::NAME, api::ADDED, api::EXEC_ADDED_P50, Stat::P50, 1.0),
        Promise::at_most("EB-1", "latency the E2B path adds per commands.run over Grove's own client, p50 (ms)", e2b::NAME, e2b::ADDED, "p50", Stat::P50, 1.0),
        Promise::at_most("EB-2", "E2B SDK create → first command, warm pool of the template, p50 (ms)", e2b::NAME, e2b::CREATE, e2b::POOLED, Stat::P50, 20.0),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_match_what_full_runs_emit() {
        assert_eq!(fs::file_param(1 << 30), "1024 MiB file");
        assert_eq!(fs::files_param(50_000), "50000 files");
        assert_eq!(fs::tar_param(false), "python3.11 stdlib + /usr/share");
        assert_eq!(st::tree_param(100), "100 MiB tree");
        assert_eq!(ck::heap_param(256 << 20), "256 MiB heap");
        let ps = all();
        let find = |id: &str| ps.iter().find(|p| p.id == id).unwrap().param;
        assert_eq!(find("FS-1"), fs::file_param(1 << 30));
        assert_eq!(find("FS-3"), fs::tar_param(false));
        assert_eq!(find("FS-4"), fs::files_param(50_000));
        assert_eq!(find("FS-5"), fs::pip_param(fs::PIP_MODULES));
        assert_eq!(find("ST-2"), st::tree_param(100));
        assert_eq!(find("CK-2"), ck::heap_param(256 << 20));
        assert!(find("CK-4").starts_with(&ck::heap_param(256 << 20)));
        assert!(find("CK-6").starts_with(&ro::rounds_param(100)));
        assert_eq!(find("CK-7"), ro::rounds_param(100));
        assert_eq!(find("CK-8"), fm::branches_param(256 << 20, 8));
        assert_eq!(find("CK-9"), fm::branches_param(256 << 20, 32));
        assert_eq!(
            find("CK-10"),
            format!("{}, {}", ck::heap_param(256 << 20), ck::SECOND)
        );
        assert_eq!(find("CK-11"), find("CK-4"));
        assert_eq!(find("CK-12"), ck::heap_param(256 << 20));
        assert_eq!(
            find("CK-13"),
            format!("{}, 5 % dirtied", ck::heap_param(256 << 20))
        );
        assert_eq!(find("API-1"), format!("{}, p50", api::EXEC));
        assert_eq!(find("EB-2"), e2b::POOLED);
    }

    #[test]
    fn headline_names_real_figures() {
        let known = [
            lc::CYCLE,
            lc::RATE,
            ck::SNAPSHOT,
            ck::SECOND_RATIO,
            ck::FORK,
            fs::SEQ_READ,
            fs::UNTAR,
            fs::PY_IMPORT,
            fs::FIND_STAT,
            fs::PIP_INSTALL,
            de::PER_SANDBOX,
            st::CHAIN_RATIO,
        ];
        for (scenario, metric, _) in crate::report::HEADLINE {
            assert!(known.contains(&metric), "{scenario}: {metric}");
        }
        assert_eq!(
            crate::report::HEADLINE[2].2,
            format!("{}, {}", ck::heap_param(256 << 20), ck::FIRST)
        );
    }

    #[test]
    fn ids_are_unique_and_goals_render() {
        let ps = all();
        let mut ids: Vec<_> = ps.iter().map(|p| p.id).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), ps.len());
        assert_eq!(ps[0].goal_text(), "≤ 30");
        assert_eq!(ps[1].goal_text(), "≤ 1× crun");
    }
}
