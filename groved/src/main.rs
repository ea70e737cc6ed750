//! groved: serves the Grove API on a unix socket (and TCP when configured).

use clap::Parser;
use groved::config::{Config, Overrides};

#[derive(Parser)]
#[command(name = "groved", version, about = "The Grove node daemon")]
struct Args {
    #[command(flatten)]
    overrides: Overrides,
}

fn main() {
    groved::init_logging();
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("groved: {e:#}");
        std::process::exit(1);
    }
}

/// Turns on the host's cgroup2 `favordynmods` (`grove_runtime::cgroup::moves`): a failure
/// only costs restores and creates their grace period, so it is logged, not fatal.
fn favor_cgroup_moves() {
    use grove_runtime::cgroup::moves;
    match moves::favor_moves() {
        Ok(moves::Favored::TurnedOn) => tracing::info!(
            "turned on the cgroup2 superblock's favordynmods: moving a task into a cgroup no \
             longer waits out an RCU grace period"
        ),
        Ok(moves::Favored::AlreadyOn) => {}
        Err(e) => tracing::warn!(
            error = %groved::error::chain(&e),
            "favordynmods stays off: each move of a task into a cgroup waits out an RCU grace period"
        ),
    }
}

fn run(args: &Args) -> anyhow::Result<()> {
    let config = Config::load(&args.overrides)?;
    // Dropped last, at exit: groved leaves its cgroup and removes it.
    let _cgroups = groved::daemon_cgroup::enter(&config)?;
    if config.favor_cgroup_moves {
        favor_cgroup_moves();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let backend = groved::backend_build::build(&config, false)?;
    let configured = backend
        .runtime
        .set_jobs(config.jobs.clone())
        .map_err(|e| anyhow::anyhow!("jobs in the config: {}", groved::error::chain(&e)))
        .and_then(|()| {
            backend
                .runtime
                .set_pools(config.pools.clone())
                .map_err(|e| anyhow::anyhow!("pools in the config: {}", groved::error::chain(&e)))
        });
    if let Err(e) = configured {
        if let Some(fsd) = &backend.fsd {
            groved::nodefs_backend::stop_fsd_if_idle(fsd);
        }
        return Err(e);
    }
    let app = groved::app::App::new(
        config,
        backend.runtime,
        backend.images,
        backend.snapshots,
        backend.fsd,
    );
    rt.block_on(groved::server::serve(app))
}
