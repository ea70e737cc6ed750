//! Measurement helper: the two FUSE transports side by side in one process, interleaved so that
//! load from elsewhere on the machine hits both alike. `transports WORK_DIR TARBALL ROUNDS`:
//! each round mounts a fresh writable view over each transport (the order alternates), untars
//! TARBALL into it with `tar -xf`, and unmounts; then 200 bare mount + unmount pairs each. Prints
//! the medians and the median of the per-round ratios (ring ÷ /dev/fuse).

use std::path::Path;
use std::process::Command;
use std::time::Instant;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: transports WORK_DIR TARBALL ROUNDS");
        std::process::exit(2);
    }
    let work = Path::new(&args[1]);
    let tarball = Path::new(&args[2]);
    let rounds: usize = args[3].parse().expect("ROUNDS");
    let store = nodefs::Store::open(&work.join("store")).expect("open store");
    let src = work.join("src");
    std::fs::create_dir_all(&src).unwrap();
    let id = store.import_dir(&src).expect("import");
    let fs = nodefs::NodeFs::with_options(
        store,
        nodefs::ServerOptions {
            uring: true,
            ..Default::default()
        },
    );
    let mut n = 0usize;
    let mut mount = |uring: bool| {
        n += 1;
        let mp = work.join(format!("m{n}"));
        std::fs::create_dir_all(&mp).unwrap();
        let t = Instant::now();
        let m = fs
            .mount(
                &id,
                &mp,
                nodefs::MountOptions {
                    upper_dir: work.join(format!("u{n}")),
                    uring,
                    ..Default::default()
                },
            )
            .expect("mount");
        let want = if uring {
            nodefs::Transport::IoUring
        } else {
            nodefs::Transport::DevFuse
        };
        assert_eq!(m.transport(), want);
        (m, mp, t.elapsed().as_secs_f64() * 1e3)
    };
    // [dev_fuse, io_uring]
    let mut untar = [Vec::new(), Vec::new()];
    let mut ratio = Vec::new();
    for r in 0..rounds {
        let mut this = [0f64; 2];
        for k in 0..2 {
            let uring = (k + r) % 2 == 1;
            let (m, mp, _) = mount(uring);
            let t = Instant::now();
            let st = Command::new("tar")
                .arg("-xf")
                .arg(tarball)
                .arg("-C")
                .arg(&mp)
                .status()
                .unwrap();
            assert!(st.success());
            let ms = t.elapsed().as_secs_f64() * 1e3;
            this[uring as usize] = ms;
            untar[uring as usize].push(ms);
            m.unmount().unwrap();
            let _ = std::fs::remove_dir(&mp);
        }
        ratio.push(this[1] / this[0]);
    }
    let mut setup = [Vec::new(), Vec::new()];
    let mut cycle = [Vec::new(), Vec::new()];
    for i in 0..400 {
        let uring = i % 2 == 1;
        let t = Instant::now();
        let (m, mp, ms) = mount(uring);
        let _ = std::fs::metadata(&mp).unwrap();
        m.unmount().unwrap();
        cycle[uring as usize].push(t.elapsed().as_secs_f64() * 1e3);
        setup[uring as usize].push(ms);
        let _ = std::fs::remove_dir(&mp);
    }
    println!(
        "untar ({rounds} rounds): /dev/fuse p50 {:.1} ms, io_uring p50 {:.1} ms, per-round ratio p50 {:.3}",
        median(&mut untar[0]),
        median(&mut untar[1]),
        median(&mut ratio)
    );
    println!(
        "mount: /dev/fuse p50 {:.3} ms, io_uring p50 {:.3} ms; mount+stat+unmount: /dev/fuse p50 {:.3} ms, io_uring p50 {:.3} ms",
        median(&mut setup[0]),
        median(&mut setup[1]),
        median(&mut cycle[0]),
        median(&mut cycle[1])
    );
}
