//! The test-only features stay out of every shipped build: nodefs's and grove-snapshotter's
//! `test-knobs` (setters only tests call) and groved's `debug-hooks` (faults injected into a real
//! daemon). No manifest may turn one on but a crate's dev-dependency (which only a build of tests
//! activates): not a `[dependencies]` entry, not `[workspace.dependencies]`, not a `default` or any
//! other feature. A shipped build (`cargo build [--release]`, plain `--bins`) then has none of them.

use std::path::{Path, PathBuf};

const TEST_ONLY: &[&str] = &["test-knobs", "debug-hooks"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn read_toml(path: &Path) -> toml::Table {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.parse()
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The workspace's manifest and every member's.
fn manifests() -> Vec<(PathBuf, toml::Table)> {
    let path = root().join("Cargo.toml");
    let ws = read_toml(&path);
    let members: Vec<String> = ws["workspace"]["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap().to_string())
        .collect();
    let mut v = vec![(path, ws)];
    for m in members {
        let p = root().join(m).join("Cargo.toml");
        let t = read_toml(&p);
        v.push((p, t));
    }
    v
}

/// The test-only features a dependency table (`name = { features = [...] }` entries) turns on.
fn test_only_in(deps: Option<&toml::Value>) -> Vec<String> {
    let Some(deps) = deps.and_then(toml::Value::as_table) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for (name, dep) in deps {
        let features = dep.get("features").and_then(toml::Value::as_array);
        for f in features
            .into_iter()
            .flatten()
            .filter_map(toml::Value::as_str)
        {
            if TEST_ONLY.contains(&f) {
                found.push(format!("{name}/{f}"));
            }
        }
    }
    found
}

#[test]
fn test_only_features_are_turned_on_by_dev_dependencies_alone() {
    let mut defined = Vec::new();
    for (path, m) in manifests() {
        let at = path.display();
        let ws_deps = m.get("workspace").and_then(|w| w.get("dependencies"));
        let mut normal = test_only_in(ws_deps);
        normal.extend(test_only_in(m.get("dependencies")));
        normal.extend(test_only_in(m.get("build-dependencies")));
        let targets = m.get("target").and_then(toml::Value::as_table);
        for t in targets.into_iter().flat_map(|t| t.values()) {
            normal.extend(test_only_in(t.get("dependencies")));
            normal.extend(test_only_in(t.get("build-dependencies")));
        }
        assert!(
            normal.is_empty(),
            "{at}: a normal dependency turns on {normal:?}"
        );
        let features = m.get("features").and_then(toml::Value::as_table);
        for (name, list) in features.into_iter().flatten() {
            if TEST_ONLY.contains(&name.as_str()) {
                defined.push(name.clone());
            }
            for item in list
                .as_array()
                .unwrap()
                .iter()
                .filter_map(toml::Value::as_str)
            {
                // "f", "dep/f", "dep?/f".
                let f = item.rsplit('/').next().unwrap();
                assert!(
                    !TEST_ONLY.contains(&f),
                    "{at}: feature {name:?} turns on the test-only {item:?}"
                );
            }
        }
    }
    // The check above looks at something: each test-only feature is defined somewhere.
    for f in TEST_ONLY {
        assert!(defined.iter().any(|d| d == f), "no crate defines {f:?}");
    }
}

#[test]
fn the_scripts_that_build_what_runs_turn_on_no_features() {
    for script in ["scripts/setup", "scripts/build-init", "scripts/demo"] {
        let text = std::fs::read_to_string(root().join(script)).unwrap();
        assert!(!text.contains("--all-features"), "{script}: --all-features");
        for f in TEST_ONLY {
            assert!(
                !text.contains(f),
                "{script} names the test-only feature {f}"
            );
        }
    }
}
