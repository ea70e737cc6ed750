//! The `grove` command line: verbs a crictl/podman user knows, over the daemon's unix socket.

mod build;
mod embedded;
mod files;
mod images;
pub mod install;
mod mount;
mod node;
mod pull;
mod sandbox;
mod session;
mod snapshots;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::client::{Client, ClientError};

#[derive(Parser, Debug)]
#[command(name = "grove", version, about = "Grove sandboxes on this node")]
pub struct Cli {
    /// The daemon's socket.
    #[arg(
        long,
        global = true,
        env = "GROVE_SOCKET",
        default_value = "/run/grove/groved.sock"
    )]
    pub socket: PathBuf,
    /// groved's config, for commands that run without the daemon (`grove run` when none is up).
    #[arg(long, global = true, env = "GROVE_CONFIG")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Create sandbox(es); prints their ids.
    Create(CreateArgs),
    /// Create a sandbox, run a command in it, destroy it; exits with the command's code.
    Run(RunArgs),
    /// Run a command in a sandbox; exits with its code.
    Exec(ExecArgs),
    /// List sandboxes.
    Ls(LsArgs),
    /// Show a sandbox as JSON.
    Inspect { id: String },
    /// Delete sandboxes.
    Rm(RmArgs),
    /// Snapshot a sandbox (files, processes, memory); prints the snapshot name.
    Snapshot(SnapshotArgs),
    /// Fork a snapshot into new sandboxes; prints their ids.
    Fork(ForkArgs),
    /// Freeze a sandbox.
    Pause { id: String },
    /// Thaw a paused sandbox.
    Resume { id: String },
    /// Copy files: `grove cp ./dir sb-...:/work` or `grove cp sb-...:/etc/os-release ./`.
    Cp { src: String, dst: String },
    /// Follow lifecycle events.
    Events {
        #[arg(long)]
        sandbox: Option<String>,
    },
    /// Build an image from a Dockerfile.
    Build(build::BuildArgs),
    /// Manage images.
    Images {
        #[command(subcommand)]
        cmd: ImagesCmd,
    },
    /// Free unreferenced content in the store.
    Gc,
    /// Check the store.
    Fsck,
    /// List Grove-owned leftovers on the host; exits non-zero if there are any.
    Residue,
    /// Check the host for what Grove needs.
    Doctor,
    /// Mount a writable nodefs view of an image until Ctrl-C (no daemon needed).
    Mount(mount::MountArgs),
    /// Install groved on this node as a systemd service: binaries, unit, tmpfiles.d entry, default config.
    Install(install::InstallArgs),
    /// Shell sessions in a sandbox: state (cwd, variables, jobs) carries across runs.
    Session {
        #[command(subcommand)]
        cmd: session::SessionCmd,
    },
}

#[derive(Subcommand, Debug)]
pub enum ImagesCmd {
    /// Import a root directory (default), an OCI layout (--oci) or a tar (--tar FILE, - for stdin).
    Import {
        name: String,
        path: PathBuf,
        #[arg(long, conflicts_with = "tar")]
        oci: bool,
        #[arg(long)]
        tar: bool,
        /// Tag or digest inside an OCI layout.
        #[arg(long = "ref", requires = "oci")]
        reference: Option<String>,
    },
    Ls,
    Rm {
        name: String,
    },
    /// Show an image and its config (env, workdir, user, entrypoint/cmd, exposed ports) as JSON.
    Inspect {
        name: String,
    },
    /// Pull an image from an OCI registry: `grove images pull registry.example/ns/app:1.0`.
    Pull(PullArgs),
    /// Prune the Dockerfile build step cache to the node's bound (or empty it with --all); `grove
    /// gc` then frees the bytes.
    PruneCache {
        #[arg(long)]
        all: bool,
        /// Keep at most this many entries, the most recently used.
        #[arg(long, conflicts_with = "all")]
        max_entries: Option<usize>,
        /// Drop entries unused for longer than this many seconds.
        #[arg(long)]
        max_age_secs: Option<u64>,
    },
}

#[derive(Args, Debug)]
pub struct PullArgs {
    /// `[REGISTRY/]REPOSITORY[:TAG][@DIGEST]`.
    pub reference: String,
    /// The image's name here (default: the repository's last part and the tag, e.g. `app-1.0`).
    #[arg(long)]
    pub name: Option<String>,
    /// `OS/ARCH[/VARIANT]` to pick from a multi-platform index (default linux/amd64).
    #[arg(long)]
    pub platform: Option<String>,
    /// Print the progress events as JSON lines.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone, Default)]
pub struct SpecArgs {
    /// CPU in millicores.
    #[arg(long)]
    pub cpu: Option<u32>,
    /// Memory in MiB.
    #[arg(long)]
    pub memory: Option<u64>,
    #[arg(long)]
    pub pids: Option<u32>,
    /// Disk in MiB.
    #[arg(long)]
    pub disk: Option<u64>,
    /// KEY=VALUE (repeatable).
    #[arg(long, short = 'e')]
    pub env: Vec<String>,
    /// KEY=VALUE (repeatable).
    #[arg(long, short = 'l')]
    pub label: Vec<String>,
    #[arg(long)]
    pub ttl: Option<u64>,
    #[arg(long)]
    pub hostname: Option<String>,
    #[arg(long)]
    pub workdir: Option<String>,
    /// Allow egress to CIDR[:PORT,PORT...] (repeatable); default is no network.
    #[arg(long)]
    pub allow: Vec<String>,
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    /// Image name (or use --snapshot).
    #[arg(required_unless_present = "snapshot")]
    pub image: Option<String>,
    #[arg(long, conflicts_with = "image")]
    pub snapshot: Option<String>,
    #[arg(long, short = 'n')]
    pub count: Option<u32>,
    /// Run in a user namespace of its own: sandbox root is an unprivileged host uid.
    #[arg(long, conflicts_with = "snapshot")]
    pub userns: bool,
    #[command(flatten)]
    pub spec: SpecArgs,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    pub image: String,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Seconds before the command is killed.
    #[arg(long)]
    pub timeout: Option<f64>,
    /// The command; without one, the image's Entrypoint + Cmd.
    #[arg(last = true)]
    pub cmd: Vec<String>,
}

#[derive(Args, Debug)]
pub struct ExecArgs {
    pub id: String,
    #[arg(long)]
    pub timeout: Option<f64>,
    #[arg(long, short = 'e')]
    pub env: Vec<String>,
    #[arg(long)]
    pub cwd: Option<String>,
    /// Start in the background; prints the pid.
    #[arg(long, short = 'd')]
    pub detach: bool,
    #[arg(last = true, required = true)]
    pub cmd: Vec<String>,
}

#[derive(Args, Debug)]
pub struct LsArgs {
    #[arg(long, short = 'l')]
    pub label: Vec<String>,
    #[arg(long)]
    pub state: Option<String>,
    #[arg(long)]
    pub json: bool,
    /// Ids only.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

#[derive(Args, Debug)]
pub struct RmArgs {
    pub ids: Vec<String>,
    /// Delete every sandbox with these labels.
    #[arg(long, short = 'l')]
    pub label: Vec<String>,
    /// Delete every sandbox.
    #[arg(long, short = 'a')]
    pub all: bool,
}

#[derive(Args, Debug)]
pub struct SnapshotArgs {
    pub id: String,
    #[arg(long)]
    pub name: Option<String>,
    /// Destroy the sandbox after the snapshot.
    #[arg(long)]
    pub stop: bool,
}

#[derive(Args, Debug)]
pub struct ForkArgs {
    pub snapshot: String,
    #[arg(long, short = 'n', default_value_t = 1)]
    pub count: u32,
    #[arg(long, short = 'l')]
    pub label: Vec<String>,
    #[arg(long)]
    pub ttl: Option<u64>,
}

/// A failure of a `grove` command: printed as one line.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Other(String),
    /// The command ran and this is its exit code (nothing more to print).
    #[error("exit {0}")]
    Exit(i32),
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> Self {
        CliError::Other(e.to_string())
    }
}

pub type CliResult<T = ()> = Result<T, CliError>;

/// Parses `KEY=VALUE` pairs.
pub fn pairs(
    what: &str,
    items: &[String],
) -> CliResult<serde_json::Map<String, serde_json::Value>> {
    let mut m = serde_json::Map::new();
    for it in items {
        let (k, v) = it
            .split_once('=')
            .ok_or_else(|| CliError::Usage(format!("{what} {it:?} is not KEY=VALUE")))?;
        m.insert(k.to_string(), v.into());
    }
    Ok(m)
}

/// Runs the command line; returns the process exit code.
pub fn main() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return 0;
            }
            let text = e.to_string();
            let first = text
                .lines()
                .next()
                .unwrap_or("bad usage")
                .trim_start_matches("error: ");
            eprintln!("grove: {first} (see grove --help)");
            return 2;
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("grove: starting tokio: {e}");
            return 1;
        }
    };
    match rt.block_on(dispatch(cli)) {
        Ok(()) => 0,
        Err(CliError::Exit(code)) => code,
        Err(CliError::Usage(u)) => {
            eprintln!("grove: {u}");
            2
        }
        Err(e) => {
            eprintln!("grove: {}", one_line(&e));
            1
        }
    }
}

fn one_line(e: &dyn std::error::Error) -> String {
    crate::error::chain(e).replace('\n', " ")
}

async fn dispatch(cli: Cli) -> CliResult {
    let c = Client::new(&cli.socket);
    match cli.cmd {
        Cmd::Create(a) => sandbox::create(&c, a).await,
        Cmd::Run(a) => {
            if c.reachable() {
                sandbox::run(&c, a).await
            } else {
                let config = cli.config.clone();
                tokio::task::spawn_blocking(move || embedded::run(a, config))
                    .await
                    .map_err(|e| CliError::Other(e.to_string()))?
            }
        }
        Cmd::Exec(a) => sandbox::exec(&c, a).await,
        Cmd::Session { cmd } => session::run(&c, cmd).await,
        Cmd::Ls(a) => sandbox::ls(&c, a).await,
        Cmd::Inspect { id } => sandbox::inspect(&c, &id).await,
        Cmd::Rm(a) => sandbox::rm(&c, a).await,
        Cmd::Pause { id } => sandbox::pause_resume(&c, &id, "pause").await,
        Cmd::Resume { id } => sandbox::pause_resume(&c, &id, "resume").await,
        Cmd::Snapshot(a) => snapshots::snapshot(&c, a).await,
        Cmd::Fork(a) => snapshots::fork(&c, a).await,
        Cmd::Cp { src, dst } => files::cp(&c, &src, &dst).await,
        Cmd::Events { sandbox } => node::events(&c, sandbox).await,
        Cmd::Images { cmd } => images::images(&c, cmd).await,
        Cmd::Build(a) => build::run(&c, a).await,
        Cmd::Gc => node::maintenance(&c, "gc").await,
        Cmd::Fsck => node::maintenance(&c, "fsck").await,
        Cmd::Residue => {
            if c.reachable() {
                node::residue(&c).await
            } else {
                tokio::task::spawn_blocking(embedded::residue)
                    .await
                    .map_err(|e| CliError::Other(e.to_string()))?
            }
        }
        Cmd::Doctor => Err(CliError::Exit(crate::doctor::run())),
        Cmd::Mount(a) => mount::run(a).await,
        Cmd::Install(a) => tokio::task::spawn_blocking(move || install::run(a))
            .await
            .map_err(|e| CliError::Other(e.to_string()))?,
    }
}
