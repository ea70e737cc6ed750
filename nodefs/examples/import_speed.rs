//! Debug helper: `import_speed STORE_DIR SRC_DIR [OUT_DIR]` times import_dir (pages-*.img
//! files with 4 KiB fixed chunks) and, with OUT_DIR, export_dir.

use std::path::Path;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: import_speed STORE_DIR SRC_DIR [OUT_DIR]");
        std::process::exit(2);
    }
    let store = nodefs::Store::open(Path::new(&args[1])).expect("open store");
    let t = Instant::now();
    let id = store
        .import_dir_with(Path::new(&args[2]), &|p| {
            if p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("pages-"))
            {
                nodefs::ChunkPolicy::Fixed(4096)
            } else {
                nodefs::ChunkPolicy::Cdc
            }
        })
        .expect("import");
    println!("import {id}: {:?} {:?}", t.elapsed(), store.stats());
    if let Some(out) = args.get(3) {
        let t = Instant::now();
        store.export_dir(&id, Path::new(out)).expect("export");
        println!("export: {:?}", t.elapsed());
    }
}
