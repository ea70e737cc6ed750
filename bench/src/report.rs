//! The results of a run (`results.json`) and their rendering as `report.md`.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::promises::{Goal, Promise, Stat};
use crate::stats::{ratio, summarize, Summary};

/// Whether smaller or larger figures are better (decides how ratios read).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Better {
    Lower,
    Higher,
}

/// What one system gave for one figure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Outcome {
    /// A distribution over repeated runs.
    Samples { summary: Summary },
    /// A single figure (a throughput over a window, a byte count).
    Value { value: f64 },
    /// The system ran and failed; the error it gave.
    Failed { error: String },
    /// Grove's piece for this figure is not usable yet (never a made-up figure).
    NotAvailable { reason: String },
}

/// One figure for one system.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Measurement {
    /// The figure, e.g. "create → exec true → destroy".
    pub metric: String,
    /// The parameter the figure was taken at, e.g. "concurrency 8"; empty when none.
    pub param: String,
    /// The system, e.g. "grove (nodefs root)", "bwrap", "overlayfs".
    pub system: String,
    pub is_grove: bool,
    pub unit: String,
    pub better: Better,
    pub outcome: Outcome,
}

impl Measurement {
    pub fn samples(m: &Key, system: &str, is_grove: bool, samples: &[f64]) -> Self {
        let outcome = match summarize(samples) {
            Some(summary) => Outcome::Samples { summary },
            None => Outcome::Failed {
                error: "no successful sample".into(),
            },
        };
        Self::new(m, system, is_grove, outcome)
    }
    pub fn value(m: &Key, system: &str, is_grove: bool, value: f64) -> Self {
        Self::new(m, system, is_grove, Outcome::Value { value })
    }
    pub fn failed(m: &Key, system: &str, is_grove: bool, error: impl Into<String>) -> Self {
        Self::new(
            m,
            system,
            is_grove,
            Outcome::Failed {
                error: error.into(),
            },
        )
    }
    pub fn not_available(m: &Key, system: &str, reason: impl Into<String>) -> Self {
        Self::new(
            m,
            system,
            true,
            Outcome::NotAvailable {
                reason: reason.into(),
            },
        )
    }
    fn new(m: &Key, system: &str, is_grove: bool, outcome: Outcome) -> Self {
        Measurement {
            metric: m.metric.clone(),
            param: m.param.clone(),
            system: system.into(),
            is_grove,
            unit: m.unit.clone(),
            better: m.better,
            outcome,
        }
    }
    /// The figure ratios are taken on: the median of a distribution, or the single value.
    pub fn headline(&self) -> Option<f64> {
        self.stat(Stat::P50)
    }
    pub fn stat(&self, stat: Stat) -> Option<f64> {
        match (&self.outcome, stat) {
            (Outcome::Samples { summary }, Stat::P50) => Some(summary.p50),
            (Outcome::Value { value }, _) => Some(*value),
            _ => None,
        }
    }
}

/// Names one figure (without the system).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    pub metric: String,
    pub param: String,
    pub unit: String,
    pub better: Better,
}

impl Key {
    pub fn new(metric: &str, param: impl Into<String>, unit: &str, better: Better) -> Self {
        Key {
            metric: metric.into(),
            param: param.into(),
            unit: unit.into(),
            better,
        }
    }
}

/// One scenario's results.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ScenarioResult {
    pub name: String,
    pub title: String,
    pub notes: Vec<String>,
    pub measurements: Vec<Measurement>,
    /// Plot file names, relative to the report directory.
    pub plots: Vec<String>,
    /// Set when the scenario stopped early; the figures taken before still count.
    pub error: Option<String>,
    pub seconds: f64,
}

impl ScenarioResult {
    pub fn new(name: &str, title: &str) -> Self {
        ScenarioResult {
            name: name.into(),
            title: title.into(),
            ..Default::default()
        }
    }
    pub fn push(&mut self, m: Measurement) {
        self.measurements.push(m);
    }
    pub fn note(&mut self, n: impl Into<String>) {
        self.notes.push(n.into());
    }
    pub fn find(&self, metric: &str, param: &str, system: &str) -> Option<&Measurement> {
        self.measurements
            .iter()
            .find(|m| m.metric == metric && m.param == param && m.system == system)
    }
    /// The Grove measurement for a figure.
    pub fn grove(&self, metric: &str, param: &str) -> Option<&Measurement> {
        self.measurements
            .iter()
            .find(|m| m.metric == metric && m.param == param && m.is_grove)
    }
}

/// A promise checked against this run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PromiseResult {
    pub id: String,
    /// Where it is measured: scenario, figure, parameter.
    pub scenario: String,
    pub metric: String,
    pub param: String,
    pub text: String,
    pub goal: String,
    pub measured: Option<f64>,
    pub shown: String,
    pub met: Option<bool>,
}

/// A whole run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Report {
    pub started_utc: String,
    pub finished_utc: String,
    pub command: String,
    pub quick: bool,
    pub host: String,
    pub scenarios: Vec<ScenarioResult>,
    pub promises: Vec<PromiseResult>,
    /// Anything of the bench's own left on the host after the run (should be empty).
    pub residue: Vec<String>,
}

/// Formats a figure with a precision that suits its size.
pub fn fmt_num(v: f64) -> String {
    let a = v.abs();
    if a >= 1000.0 || a == 0.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn fmt_ratio(r: Option<f64>) -> String {
    r.map(|r| format!("{r:.2}×")).unwrap_or_else(|| "–".into())
}

fn cell_escape(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

/// Checks each promise against the measurements of the run.
pub fn check_promises(promises: &[Promise], scenarios: &[ScenarioResult]) -> Vec<PromiseResult> {
    promises
        .iter()
        .map(|p| {
            let sc = scenarios.iter().find(|s| s.name == p.scenario);
            let grove = sc.and_then(|s| s.grove(p.metric, p.param));
            let base = match (p.relative_to, sc) {
                (Some(peer), Some(s)) => {
                    s.find(p.metric, p.param, peer).and_then(|m| m.stat(p.stat))
                }
                _ => None,
            };
            let gv = grove.and_then(|m| m.stat(p.stat));
            let measured = match p.relative_to {
                Some(_) => ratio(gv, base),
                None => gv,
            };
            let shown = match (measured, grove) {
                (Some(v), _) if p.relative_to.is_some() => {
                    format!("{v:.2}× {}", p.relative_to.unwrap_or(""))
                }
                (Some(v), Some(g)) => format!("{} {}", fmt_num(v), g.unit),
                (_, Some(g)) => match &g.outcome {
                    Outcome::NotAvailable { reason } => format!("not available ({reason})"),
                    Outcome::Failed { error } => format!("failed ({error})"),
                    _ => "peer missing".into(),
                },
                (_, None) if sc.is_none() => "not measured in this run".into(),
                _ => "not measured".into(),
            };
            let met = measured.map(|v| match p.goal {
                Goal::AtMost(g) => v <= g,
                Goal::AtLeast(g) => v >= g,
            });
            PromiseResult {
                id: p.id.into(),
                scenario: p.scenario.into(),
                metric: p.metric.into(),
                param: p.param.into(),
                text: p.text.into(),
                goal: p.goal_text(),
                measured,
                shown,
                met,
            }
        })
        .collect()
}

fn outcome_cells(m: &Measurement) -> (String, String, String) {
    match &m.outcome {
        Outcome::Samples { summary } => (
            fmt_num(summary.p50),
            fmt_num(summary.p99),
            summary.n.to_string(),
        ),
        Outcome::Value { value } => (fmt_num(*value), "–".into(), "1".into()),
        Outcome::Failed { error } => (
            format!("failed: {}", cell_escape(error)),
            "–".into(),
            "0".into(),
        ),
        Outcome::NotAvailable { reason } => (
            format!("not available ({})", cell_escape(reason)),
            "–".into(),
            "0".into(),
        ),
    }
}

/// The figures of one scenario, one table per (metric, parameter), with Grove ÷ system ratios.
pub fn render_scenario(out: &mut String, s: &ScenarioResult) {
    let _ = writeln!(out, "## {}\n", s.title);
    let _ = writeln!(out, "_scenario `{}`, {:.0} s_\n", s.name, s.seconds);
    if let Some(e) = &s.error {
        let _ = writeln!(out, "**Stopped early:** {}\n", cell_escape(e));
    }
    for n in &s.notes {
        let _ = writeln!(out, "- {n}");
    }
    if !s.notes.is_empty() {
        out.push('\n');
    }
    let mut keys: Vec<(&str, &str)> = Vec::new();
    for m in &s.measurements {
        if !keys.contains(&(m.metric.as_str(), m.param.as_str())) {
            keys.push((&m.metric, &m.param));
        }
    }
    for (metric, param) in keys {
        let rows: Vec<&Measurement> = s
            .measurements
            .iter()
            .filter(|m| m.metric == metric && m.param == param)
            .collect();
        let unit = &rows[0].unit;
        let better = match rows[0].better {
            Better::Lower => "lower is better",
            Better::Higher => "higher is better",
        };
        let title = if param.is_empty() {
            metric.to_string()
        } else {
            format!("{metric}, {param}")
        };
        let _ = writeln!(out, "**{title}** ({unit}, {better})\n");
        let _ = writeln!(out, "| system | p50 / value | p99 | n | Grove ÷ system |");
        let _ = writeln!(out, "|---|---:|---:|---:|---:|");
        let grove = rows.iter().find(|m| m.is_grove).and_then(|m| m.headline());
        for m in &rows {
            let (p50, p99, n) = outcome_cells(m);
            let r = if m.is_grove {
                "–".into()
            } else {
                fmt_ratio(ratio(grove, m.headline()))
            };
            let _ = writeln!(
                out,
                "| {} | {p50} | {p99} | {n} | {r} |",
                cell_escape(&m.system)
            );
        }
        out.push('\n');
    }
    for p in &s.plots {
        let _ = writeln!(out, "![{p}]({p})\n");
    }
}

/// The figures quoted first: (scenario, metric, parameter of the full run).
pub const HEADLINE: [(&str, &str, &str); 11] = [
    ("lifecycle", "create → exec true → destroy", "sequential"),
    (
        "lifecycle",
        "create → exec true → destroy throughput",
        "concurrency 8",
    ),
    (
        "checkpoint",
        "checkpoint (snapshot) time",
        "256 MiB heap, first",
    ),
    (
        "checkpoint",
        "second checkpoint: bytes added ÷ bytes touched",
        "256 MiB heap",
    ),
    (
        "checkpoint",
        "restore / fork: all copies running and answering",
        "256 MiB heap, 8 branches",
    ),
    ("filesystem", "sequential read, cold", "1024 MiB file"),
    (
        "filesystem",
        "untar of a source tree",
        "python3.11 stdlib + /usr/share",
    ),
    (
        "filesystem",
        "cold python3 -c 'import email, json, http.client' (chroot)",
        "",
    ),
    ("filesystem", "find + stat, warm", "50000 files"),
    (
        "density",
        "memory per idle sandbox (MemAvailable drop ÷ sandboxes)",
        "2000 sandboxes",
    ),
    (
        "storage",
        "store bytes after 10 commits ÷ first commit's bytes",
        "100 MiB tree",
    ),
];

/// One row per headline figure: Grove's p50 (p99) and every peer's p50 with Grove ÷ peer. A quick run
/// (other sizes) shows the same figure at its own parameter.
pub fn render_headline(out: &mut String, r: &Report) {
    let mut rows = Vec::new();
    for (scenario, metric, param) in HEADLINE {
        let Some(s) = r.scenarios.iter().find(|s| s.name == scenario) else {
            continue;
        };
        let exact = s
            .measurements
            .iter()
            .any(|m| m.metric == metric && m.param == param);
        let Some(param) = (if exact {
            Some(param.to_string())
        } else {
            s.measurements
                .iter()
                .find(|m| m.metric == metric)
                .map(|m| m.param.clone())
        }) else {
            continue;
        };
        let ms: Vec<&Measurement> = s
            .measurements
            .iter()
            .filter(|m| m.metric == metric && m.param == param)
            .collect();
        let grove = ms.iter().find(|m| m.is_grove);
        let g = grove.and_then(|m| m.headline());
        let gcell = match grove {
            Some(m) => match &m.outcome {
                Outcome::Samples { summary } => {
                    format!("{} (p99 {})", fmt_num(summary.p50), fmt_num(summary.p99))
                }
                _ => outcome_cells(m).0,
            },
            None => "–".into(),
        };
        let peers: Vec<String> = ms
            .iter()
            .filter(|m| !m.is_grove)
            .map(|m| match m.headline() {
                Some(v) => format!(
                    "{} {} ({})",
                    m.system,
                    fmt_num(v),
                    fmt_ratio(ratio(g, Some(v)))
                ),
                None => format!("{} failed", m.system),
            })
            .collect();
        let label = if param.is_empty() {
            metric.to_string()
        } else {
            format!("{metric}, {param}")
        };
        rows.push(format!(
            "| {} | {} | {} | {} |",
            cell_escape(&label),
            ms[0].unit,
            cell_escape(&gcell),
            cell_escape(&peers.join(" · "))
        ));
    }
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(out, "## Headline\n");
    let _ = writeln!(
        out,
        "| figure | unit | Grove p50 (p99) | peers p50 (Grove ÷ peer) |"
    );
    let _ = writeln!(out, "|---|---|---|---|");
    for row in rows {
        let _ = writeln!(out, "{row}");
    }
    out.push('\n');
}

/// The whole report as Markdown.
pub fn render(r: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# Grove benchmark report\n");
    let _ = writeln!(
        out,
        "- run: {} → {} UTC{}\n- command: `{}`\n- host: {}\n",
        r.started_utc,
        r.finished_utc,
        if r.quick {
            " (**--quick**: small sizes, few iterations; not for quoting)"
        } else {
            ""
        },
        r.command,
        r.host
    );
    let _ = writeln!(out, "Medians (p50) and p99 over the runs shown in `n`; every ratio is Grove ÷ peer from this same run.\n");
    render_headline(&mut out, r);
    if !r.promises.is_empty() {
        let _ = writeln!(out, "## Promises (SPECIFICATION.md)\n");
        if r.quick {
            let _ = writeln!(out, "_Quick run: workloads are smaller than the promises', so size-bound promises show \"not measured\"._\n");
        }
        let _ = writeln!(out, "| id | promise | goal | measured | met |");
        let _ = writeln!(out, "|---|---|---|---|---|");
        for p in &r.promises {
            let met = match p.met {
                Some(true) => "yes",
                Some(false) => "**no**",
                None => "–",
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {met} |",
                p.id,
                cell_escape(&p.text),
                p.goal,
                cell_escape(&p.shown)
            );
        }
        out.push('\n');
    }
    for s in &r.scenarios {
        render_scenario(&mut out, s);
    }
    let _ = writeln!(out, "## Residue after the run\n");
    if r.finished_utc.is_empty() {
        let _ = writeln!(
            out,
            "Not checked yet: the run is still going (this report is partial)."
        );
    } else if r.residue.is_empty() {
        let _ = writeln!(
            out,
            "None: no mount, cgroup, container, image or temp dir of the bench is left."
        );
    } else {
        for x in &r.residue {
            let _ = writeln!(out, "- {}", cell_escape(x));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario() -> ScenarioResult {
        let k = Key::new(
            "create → exec true → destroy",
            "sequential",
            "ms",
            Better::Lower,
        );
        let mut s = ScenarioResult::new("lifecycle", "Lifecycle");
        s.push(Measurement::samples(&k, "grove", true, &[10.0, 20.0, 30.0]));
        s.push(Measurement::samples(&k, "bwrap", false, &[5.0, 5.0, 5.0]));
        s.push(Measurement::failed(&k, "podman", false, "exit 126 | boom"));
        s
    }

    #[test]
    fn scenario_table_has_ratio_and_failure() {
        let mut out = String::new();
        render_scenario(&mut out, &scenario());
        assert!(out.contains("| grove | 20.00 | 29.80 | 3 | – |"), "{out}");
        assert!(out.contains("| bwrap | 5.00 | 5.00 | 3 | 4.00× |"), "{out}");
        assert!(out.contains("failed: exit 126 \\| boom"), "{out}");
        assert!(out.contains("**create → exec true → destroy, sequential** (ms, lower is better)"));
    }

    #[test]
    fn not_available_grove_gives_no_ratio() {
        let k = Key::new("m", "", "ms", Better::Lower);
        let mut s = ScenarioResult::new("x", "X");
        s.push(Measurement::not_available(
            &k,
            "grove",
            "runtime create unsupported",
        ));
        s.push(Measurement::value(&k, "crun", false, 16.0));
        let mut out = String::new();
        render_scenario(&mut out, &s);
        assert!(
            out.contains("not available (runtime create unsupported)"),
            "{out}"
        );
        assert!(out.contains("| crun | 16.00 | – | 1 | – |"), "{out}");
    }

    #[test]
    fn promises_are_checked_against_grove_and_peers() {
        let s = scenario();
        let ps = [
            Promise::at_most(
                "L1",
                "p50",
                "lifecycle",
                "create → exec true → destroy",
                "sequential",
                Stat::P50,
                30.0,
            ),
            Promise::at_most(
                "L2",
                "p50 tight",
                "lifecycle",
                "create → exec true → destroy",
                "sequential",
                Stat::P50,
                15.0,
            ),
            Promise::relative(
                "L3",
                "vs bwrap",
                "lifecycle",
                "create → exec true → destroy",
                "sequential",
                "bwrap",
                Goal::AtMost(2.0),
            ),
            Promise::at_most("X", "other", "density", "m", "", Stat::P50, 1.0),
        ];
        let r = check_promises(&ps, &[s]);
        assert_eq!(r[0].met, Some(true));
        assert_eq!(r[0].shown, "20.00 ms");
        assert_eq!(r[1].met, Some(false));
        assert_eq!(r[2].measured, Some(4.0));
        assert_eq!(r[2].met, Some(false));
        assert_eq!(r[3].met, None);
        assert_eq!(r[3].shown, "not measured in this run");
    }

    #[test]
    fn full_report_renders_and_roundtrips_json() {
        let rep = Report {
            started_utc: "a".into(),
            finished_utc: "b".into(),
            command: "grove-bench --quick".into(),
            quick: true,
            host: "h".into(),
            scenarios: vec![scenario()],
            promises: vec![],
            residue: vec!["mount /x".into()],
        };
        let md = render(&rep);
        assert!(md.contains("--quick"));
        let partial = render(&Report {
            finished_utc: String::new(),
            ..rep.clone()
        });
        assert!(partial.contains("Not checked yet"));
        assert!(md.contains("## Headline"), "{md}");
        assert!(md.contains("| create → exec true → destroy, sequential | ms | 20.00 (p99 29.80) | bwrap 5.00 (4.00×) · podman failed |"), "{md}");
        assert!(md.contains("## Lifecycle"));
        assert!(md.contains("- mount /x"));
        let json = serde_json::to_string(&rep).unwrap();
        let back: Report = serde_json::from_str(&json).unwrap();
        assert_eq!(
            back.scenarios[0].measurements,
            rep.scenarios[0].measurements
        );
    }

    #[test]
    fn numbers_are_formatted_by_size() {
        assert_eq!(fmt_num(1234.6), "1235");
        assert_eq!(fmt_num(123.45), "123.5");
        assert_eq!(fmt_num(3.256), "3.26");
        assert_eq!(fmt_num(0.5), "0.500");
        assert_eq!(fmt_num(0.0), "0");
    }
}
