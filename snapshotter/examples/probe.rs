//! Debug probe: mount a nodefs view of the Debian image and run commands in it.
use std::path::Path;
use std::process::Command;

use nodefs::{MountOptions, NodeFs, Store};

fn main() {
    let base = Path::new("/run/grove-probe");
    std::fs::create_dir_all(base.join("root")).unwrap();
    let store = Store::open(&base.join("store")).unwrap();
    let image = store
        .import_dir(Path::new("/var/lib/grove/images/debian12"))
        .unwrap();
    let nfs = NodeFs::new(store.clone());
    let opts = MountOptions {
        quota_bytes: None,
        quota_inodes: None,
        upper_dir: base.join("upper"),
        read_only: false,
        passthrough: true,
        uring: true,
        id_shift: None,
    };
    let m = nfs.mount(&image, &base.join("root"), opts).unwrap();
    for cmd in std::env::args().skip(1) {
        let out = Command::new("sh")
            .arg("-c")
            .arg(&cmd)
            .current_dir(base.join("root"))
            .output()
            .unwrap();
        println!(
            "$ {cmd}\n{}{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            out.status
        );
    }
    m.unmount().unwrap();
    drop(store);
    std::fs::remove_dir_all(base).unwrap();
}
