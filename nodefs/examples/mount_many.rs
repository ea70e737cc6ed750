//! Debug helper: `mount_many STORE_DIR REF N WORKDIR` mounts N views of REF, touches each
//! root, and prints the process RSS before and after (memory per idle mount).

use std::path::Path;

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 5 {
        eprintln!("usage: mount_many STORE_DIR REF N WORKDIR");
        std::process::exit(2);
    }
    let store = nodefs::Store::open(Path::new(&a[1])).expect("store");
    let id = store.resolve(&a[2]).expect("ref");
    let n: usize = a[3].parse().expect("N");
    let work = Path::new(&a[4]);
    let fs = nodefs::NodeFs::new(store);
    let before = rss_kib();
    let t = std::time::Instant::now();
    let mut mounts = Vec::new();
    for i in 0..n {
        let mp = work.join(format!("m{i}"));
        std::fs::create_dir_all(&mp).unwrap();
        let opts = nodefs::MountOptions {
            upper_dir: work.join(format!("u{i}")),
            ..Default::default()
        };
        let m = fs.mount(&id, &mp, opts).expect("mount");
        let _ = std::fs::read_dir(mp.join("etc")).map(|d| d.count());
        mounts.push(m);
    }
    let after = rss_kib();
    println!(
        "{n} mounts in {:?}; RSS {before} KiB -> {after} KiB ({} KiB per mount)",
        t.elapsed(),
        (after - before) / n as u64
    );
    if std::env::var_os("SMAPS").is_some() {
        let sm = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
        let mut cur = String::new();
        let mut big = Vec::new();
        for l in sm.lines() {
            if l.starts_with("Rss:") {
                let kb: u64 = l
                    .split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                if kb > 1000 {
                    big.push((kb, cur.clone()));
                }
            } else if !l.contains(':')
                || l.split_whitespace().next().is_some_and(|w| w.contains('-'))
            {
                cur = l.to_string();
            }
        }
        big.sort();
        for (kb, m) in big.iter().rev().take(8) {
            println!("{kb} KiB  {m}");
        }
    }
    for m in mounts {
        m.unmount().unwrap();
    }
}
