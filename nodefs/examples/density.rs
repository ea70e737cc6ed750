//! Measurement helper: what idle mounts cost the server. `density STORE_DIR N` mounts N
//! writable views of an empty tree (the server's options from the environment: `NODEFS_URING`,
//! see `ServerOptions::from_env`), touches each as a sandbox start would (a stat, a listing, a
//! small file written and read back; with `DENSITY_BIG` set also a 2 MiB file, so that large
//! requests went through each mount), and prints the set-up time per mount and the process's
//! resident memory and threads before, with the N mounts idle, and after unmounting them.

use std::path::Path;
use std::time::Instant;

fn status(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse().ok()))
        .unwrap_or(0)
}

fn snapshot(what: &str) -> (u64, u64) {
    let (rss, threads) = (status("VmRSS:"), status("Threads:"));
    let maps = std::fs::read_to_string("/proc/self/maps").map_or(0, |m| m.lines().count());
    eprintln!("{what}: rss {rss} KiB, threads {threads}, mappings {maps}");
    (rss, threads)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        eprintln!("usage: density STORE_DIR N");
        std::process::exit(2);
    }
    let n: usize = args[2].parse().expect("N");
    let work = Path::new(&args[1]);
    let big = std::env::var_os("DENSITY_BIG").is_some();
    let store = nodefs::Store::open(&work.join("store")).expect("open store");
    let src = work.join("src");
    std::fs::create_dir_all(src.join("etc")).unwrap();
    std::fs::write(src.join("etc/hostname"), "grove\n").unwrap();
    let id = store.import_dir(&src).expect("import");
    let fs = nodefs::NodeFs::with_options(store, nodefs::ServerOptions::from_env());
    let (rss0, th0) = snapshot("before");
    let mut mounts = Vec::new();
    let mut setup = Vec::new();
    for i in 0..n {
        let mp = work.join(format!("m{i}"));
        std::fs::create_dir_all(&mp).unwrap();
        let t = Instant::now();
        let m = fs
            .mount(
                &id,
                &mp,
                nodefs::MountOptions {
                    upper_dir: work.join(format!("u{i}")),
                    ..Default::default()
                },
            )
            .expect("mount");
        setup.push(t.elapsed().as_secs_f64() * 1e3);
        let _ = std::fs::metadata(mp.join("etc/hostname")).unwrap();
        let _ = std::fs::read_dir(&mp).unwrap().count();
        std::fs::write(mp.join("tmpfile"), b"hello").unwrap();
        assert_eq!(std::fs::read(mp.join("tmpfile")).unwrap(), b"hello");
        if big {
            let data = vec![7u8; 2 << 20];
            std::fs::write(mp.join("big"), &data).unwrap();
            assert_eq!(std::fs::read(mp.join("big")).unwrap(), data);
        }
        mounts.push(m);
    }
    std::thread::sleep(std::time::Duration::from_millis(200));
    let transport = mounts.first().map(|m| m.transport().to_string());
    let (rss1, th1) = snapshot(&format!("{n} idle mounts"));
    // The ring gives large payload pages back after a second idle.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let (rss2, _) = snapshot(&format!("{n} mounts idle 1.7 s"));
    if std::env::var_os("DENSITY_SMAPS").is_some() {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
        let mut cur = String::new();
        let mut rows = Vec::new();
        for l in smaps.lines() {
            if let Some(v) = l.strip_prefix("Rss:") {
                let kb: u64 = v.trim().trim_end_matches(" kB").trim().parse().unwrap_or(0);
                rows.push((kb, cur.clone()));
            } else if !l.contains(':') || l.split_whitespace().count() >= 5 {
                cur = l.to_string();
            }
        }
        rows.sort();
        for (kb, m) in rows.iter().rev().take(12) {
            eprintln!("{kb:>8} kB {m}");
        }
    }
    setup.sort_by(f64::total_cmp);
    let t = Instant::now();
    for m in mounts.drain(..) {
        m.unmount().expect("unmount");
    }
    let unmount_ms = t.elapsed().as_secs_f64() * 1e3 / n.max(1) as f64;
    std::thread::sleep(std::time::Duration::from_millis(200));
    snapshot("after unmount");
    println!(
        "transport {} mounts {n}: set-up p50 {:.3} ms p90 {:.3} ms; unmount mean {unmount_ms:.3} ms; \
         per idle mount {:.1} KiB RSS ({:.1} after 1.7 s), {:.2} threads",
        transport.unwrap_or_default(),
        setup[n / 2],
        setup[n * 9 / 10],
        (rss1 as f64 - rss0 as f64) / n as f64,
        (rss2 as f64 - rss0 as f64) / n as f64,
        (th1 as f64 - th0 as f64) / n as f64,
    );
    for i in 0..n {
        let _ = std::fs::remove_dir(work.join(format!("m{i}")));
    }
}
