//! The filesystem seam for cgroup access.

use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

pub trait CgroupFs: Send + Sync {
    fn mkdir(&self, p: &Path) -> io::Result<()>;
    fn rmdir(&self, p: &Path) -> io::Result<()>;
    fn write(&self, p: &Path, v: &str) -> io::Result<()>;
    fn read(&self, p: &Path) -> io::Result<String>;
    fn exists(&self, p: &Path) -> bool;
    fn subdirs(&self, p: &Path) -> Vec<String>;

    /// Waits until `done` holds for the content of `p`, or `timeout` passes (Ok(false)). This
    /// default reads in growing naps; the real cgroupfs wakes the waiter on the change itself.
    fn wait_until(
        &self,
        p: &Path,
        done: &dyn Fn(&str) -> bool,
        timeout: Duration,
    ) -> io::Result<bool> {
        let start = Instant::now();
        let mut nap = Duration::from_micros(50);
        while !done(&self.read(p)?) {
            if start.elapsed() > timeout {
                return Ok(false);
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(5));
        }
        Ok(true)
    }
}

/// The real cgroupfs.
#[derive(Debug, Default)]
pub struct RealFs;

impl CgroupFs for RealFs {
    fn mkdir(&self, p: &Path) -> io::Result<()> {
        std::fs::create_dir(p)
    }
    fn rmdir(&self, p: &Path) -> io::Result<()> {
        std::fs::remove_dir(p)
    }
    fn write(&self, p: &Path, v: &str) -> io::Result<()> {
        std::fs::write(p, v)
    }
    fn read(&self, p: &Path) -> io::Result<String> {
        std::fs::read_to_string(p)
    }
    fn exists(&self, p: &Path) -> bool {
        p.exists()
    }
    fn subdirs(&self, p: &Path) -> Vec<String> {
        std::fs::read_dir(p)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// cgroupfs notifies pollers (POLLPRI) when a file such as `cgroup.events` changes, counted
    /// from the last read through the same descriptor: read, test, poll, with no lost wake-up.
    fn wait_until(
        &self,
        p: &Path,
        done: &dyn Fn(&str) -> bool,
        timeout: Duration,
    ) -> io::Result<bool> {
        use std::io::{Read, Seek};
        use std::os::fd::AsFd;
        let start = Instant::now();
        let mut f = std::fs::File::open(p)?;
        let mut text = String::new();
        loop {
            text.clear();
            f.rewind()?;
            f.read_to_string(&mut text)?;
            if done(&text) {
                return Ok(true);
            }
            let Some(left) = timeout.checked_sub(start.elapsed()) else {
                return Ok(false);
            };
            let ms = u16::try_from(left.as_millis().max(1)).unwrap_or(u16::MAX);
            let mut fds = [nix::poll::PollFd::new(
                f.as_fd(),
                nix::poll::PollFlags::POLLPRI,
            )];
            match nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(ms)) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}
