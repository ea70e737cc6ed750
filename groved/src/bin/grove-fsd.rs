//! grove-fsd: owns the node's content store and every nodefs FUSE session, so sandbox roots
//! outlive a groved restart. groved starts it (detached) and talks to it over a unix socket.

use std::path::PathBuf;

use clap::Parser;

#[derive(Parser)]
#[command(name = "grove-fsd", version, about = "The Grove store and FUSE server")]
struct Args {
    /// The content store directory (locked exclusively while serving).
    #[arg(long)]
    store: PathBuf,
    /// The unix socket to serve on.
    #[arg(long)]
    socket: PathBuf,
}

fn main() {
    groved::init_logging();
    let args = Args::parse();
    // NODEFS_NO_PASSTHROUGH / NODEFS_CLONE_FD: switches for measurements, read here.
    let options = nodefs::ServerOptions::from_env();
    if let Err(e) = nodefs::service::serve_with(&args.store, &args.socket, options) {
        eprintln!("grove-fsd: {}", groved::error::chain(&e));
        std::process::exit(1);
    }
}
