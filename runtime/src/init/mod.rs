//! The code of the `grove-init` binary: `--setup` (build the sandbox and become its pid 1) and
//! `--serve` (the init loop, exec'd from inside the sandbox).

pub mod harden;
mod live;
mod procs;
mod pty;
pub mod server;
pub mod session;
pub mod setup;
mod spawn;
mod user;

/// Dispatches on argv[1].
pub fn main() -> ! {
    match std::env::args().nth(1).as_deref() {
        Some("--setup") => setup::main(),
        Some("--serve") => server::main(),
        _ => {
            eprintln!("usage: grove-init --setup | --serve (started by the Grove runtime)");
            std::process::exit(2)
        }
    }
}
