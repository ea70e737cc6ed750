//! Debug helper: `layer_speed STORE_DIR LAYER.tar.gz...` times `apply_layer` of gzip layers,
//! each onto the one before, as a registry pull applies them (without the network and the
//! daemon around it): where a pull's time goes on this machine.

use std::path::Path;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: layer_speed STORE_DIR LAYER.tar.gz...");
        std::process::exit(2);
    }
    let store = nodefs::Store::open(Path::new(&args[1])).expect("open store");
    let all = Instant::now();
    let mut base = None;
    for layer in &args[2..] {
        let t = Instant::now();
        let mut f = std::io::BufReader::with_capacity(
            1 << 20,
            std::fs::File::open(layer).expect("open layer"),
        );
        let id = store
            .apply_layer(base.as_ref(), nodefs::LayerCompression::Gzip, None, &mut f)
            .expect("apply layer");
        println!("{layer}: {:?}", t.elapsed());
        base = Some(id);
    }
    println!("all: {:?} {:?}", all.elapsed(), store.stats());
}
