//! Faults the systemd tests inject into a real daemon. Compiled only with the `debug-hooks` feature (on in
//! the builds of groved's tests, off in every shipped build), and even then off unless `GROVED_DEBUG_HOOKS`
//! is set in groved's environment (a comma-separated list), so production cannot reach them:
//! - `ready-delay-ms=N`: wait N ms between binding the API socket and telling systemd READY=1;
//! - `hang-on-sigusr2`: on SIGUSR2, block every async worker thread forever (a deadlocked daemon: the
//!   API stops answering and the watchdog stops being pinged).

use std::time::Duration;

pub const ENV: &str = "GROVED_DEBUG_HOOKS";

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DebugHooks {
    pub ready_delay: Option<Duration>,
    pub hang_on_sigusr2: bool,
}

impl DebugHooks {
    pub fn from_env() -> DebugHooks {
        std::env::var(ENV)
            .map(|v| Self::parse(&v))
            .unwrap_or_default()
    }

    fn parse(spec: &str) -> DebugHooks {
        let mut h = DebugHooks::default();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match item.split_once('=') {
                Some(("ready-delay-ms", ms)) => match ms.parse() {
                    Ok(ms) => h.ready_delay = Some(Duration::from_millis(ms)),
                    Err(_) => tracing::warn!("{ENV}: bad ready-delay-ms {ms:?}"),
                },
                None if item == "hang-on-sigusr2" => h.hang_on_sigusr2 = true,
                _ => tracing::warn!("{ENV}: unknown hook {item:?}"),
            }
        }
        if h != DebugHooks::default() {
            tracing::warn!("debug hooks enabled: {h:?}");
        }
        h
    }

    /// Installs the SIGUSR2 hang when enabled.
    pub fn arm(&self) -> std::io::Result<()> {
        if !self.hang_on_sigusr2 {
            return Ok(());
        }
        let mut usr2 =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined2())?;
        tokio::spawn(async move {
            usr2.recv().await;
            hang_workers();
        });
        Ok(())
    }
}

/// Pins every tokio worker thread in a blocking sleep: nothing spawned on the runtime runs again.
fn hang_workers() {
    let workers = tokio::runtime::Handle::current().metrics().num_workers();
    tracing::warn!("debug hook: hanging all {workers} async workers");
    for _ in 0..workers {
        tokio::spawn(async {
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_hook_list() {
        let h = DebugHooks::parse("ready-delay-ms=1500, hang-on-sigusr2,bogus");
        assert_eq!(h.ready_delay, Some(Duration::from_millis(1500)));
        assert!(h.hang_on_sigusr2);
        assert_eq!(DebugHooks::parse(""), DebugHooks::default());
    }
}
