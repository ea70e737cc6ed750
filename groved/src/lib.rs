//! groved: the Grove node daemon's HTTP API, and the `grove` command-line tool.

pub mod api;
pub mod api_shapes;
pub mod app;
pub mod backend;
pub mod backend_build;
pub mod build;
pub mod cli;
pub mod client;
pub mod config;
pub mod daemon_cgroup;
#[cfg(feature = "debug-hooks")]
pub mod debug_hooks;
pub mod doctor;
pub mod e2b;
pub mod error;
pub mod events;
pub mod idempotency;
pub mod image_config;
pub mod lifetimes;
pub mod metrics;
pub mod nodefs_backend;
pub mod pipe;
pub mod registry;
pub mod request_parse;
pub mod server;
mod sys;
pub mod systemd;

#[cfg(test)]
mod feature_gates_tests;

/// Logs of the daemons (groved, grove-fsd) go to stderr, filtered by `GROVE_LOG` (default info).
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("GROVE_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}
