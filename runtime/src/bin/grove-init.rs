//! Sandbox pid 1 for Grove (see `grove_runtime::init`). Single-threaded by design.

fn main() {
    grove_runtime::init::main()
}
