//! create → exec → destroy, for real (root).

mod common;

use common::*;
use grove_runtime::SandboxState;

#[test]
fn create_exec_destroy() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let info = rt.create(spec()).expect("create");
    assert_eq!(info.state, SandboxState::Running);
    let id = info.id.clone();
    let r = sh(
        &rt,
        &id,
        "echo hello; echo err >&2; hostname; echo $$; exit 3",
    );
    assert_eq!(r.exit_code, Some(3), "{r:?}");
    let lines: Vec<String> = out(&r).lines().map(String::from).collect();
    assert_eq!(lines[0], "hello");
    assert_eq!(lines[1], id.to_string());
    assert_eq!(String::from_utf8_lossy(&r.stderr), "err\n");
    rt.destroy(&id).expect("destroy");
    assert_gone(&rt, &id);
}
