//! Debug helper: `mount STORE_DIR SRC_DIR_OR_REF MOUNTPOINT` imports (if a directory) and
//! mounts until stdin closes, then unmounts. The server's options come from the environment
//! (`NODEFS_URING`, `NODEFS_NO_PASSTHROUGH`: see `ServerOptions::from_env`).

use std::path::Path;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: mount STORE_DIR SRC_DIR_OR_REF MOUNTPOINT");
        std::process::exit(2);
    }
    let store = nodefs::Store::open(Path::new(&args[1])).expect("open store");
    let t = std::time::Instant::now();
    let id = if Path::new(&args[2]).is_dir() {
        store.import_dir(Path::new(&args[2])).expect("import")
    } else {
        store.resolve(&args[2]).expect("resolve")
    };
    eprintln!("manifest {id} ({:?})", t.elapsed());
    let fs = nodefs::NodeFs::with_options(store, nodefs::ServerOptions::from_env());
    let upper = std::env::temp_dir().join(format!("nodefs-upper-{}", std::process::id()));
    let t = std::time::Instant::now();
    let m = fs
        .mount(
            &id,
            Path::new(&args[3]),
            nodefs::MountOptions {
                upper_dir: upper,
                ..Default::default()
            },
        )
        .expect("mount");
    eprintln!("mounted in {:?} over {}", t.elapsed(), m.transport());
    let mut s = String::new();
    let _ = std::io::stdin().read_line(&mut s);
    m.unmount().expect("unmount");
}
