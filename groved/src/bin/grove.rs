//! `grove`: the Grove command line.

fn main() {
    std::process::exit(groved::cli::main());
}
