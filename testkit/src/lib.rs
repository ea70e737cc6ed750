//! Helpers shared by the test suites of Grove's crates (a dev-dependency, never shipped).

use std::io::Write as _;

/// A capability this test needs is genuinely absent: say so on stderr (written past the test
/// harness's output capture, so it shows in a passing run), or, when
/// `GROVE_REQUIRE_CAPABILITIES=1` (CI, where every capability must be present), fail instead.
pub fn capability_missing(why: &str) {
    let test = std::thread::current()
        .name()
        .unwrap_or("<unnamed>")
        .to_string();
    if std::env::var("GROVE_REQUIRE_CAPABILITIES").as_deref() == Ok("1") {
        panic!("{test}: {why}; GROVE_REQUIRE_CAPABILITIES=1 forbids skipping");
    }
    let _ = writeln!(
        std::io::stderr(),
        "\n*** SKIPPED {test}: {why} (GROVE_REQUIRE_CAPABILITIES=1 makes this a failure)\n"
    );
}
