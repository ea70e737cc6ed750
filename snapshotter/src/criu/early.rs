//! A dump's CRIU started before the sandbox is frozen. Starting CRIU costs about 5 ms here (the
//! loader maps and relocates its 22 libraries) before it reads an argument; in a dump that is
//! time the sandbox spends frozen. So the snapshotter starts the dump's CRIU first, held by the
//! shim before CRIU's main (compat/criu-shim.c, 8) until it says it is ready, freezes the
//! sandbox, and lets it go.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use super::{dump_outcome, Criu, DumpOptions, Error, Timing};

/// A dump's CRIU, started and waiting to be let go. Dropped without [`EarlyDump::go`], it exits
/// before it has read an argument or opened a file (and is reaped here).
#[derive(Debug)]
pub struct EarlyDump {
    child: Option<Child>,
    /// Our end of the socket CRIU waits on: one "g" lets it go; closed, it exits.
    start: Option<UnixStream>,
    opts: DumpOptions,
}

impl Criu {
    /// Starts CRIU for `opts`'s dump, held before its main. None where no shim is preloaded into
    /// such a dump (nothing would hold it): the caller dumps with [`Criu::dump`] then.
    pub fn start_dump_early(&self, opts: &DumpOptions) -> Option<Result<EarlyDump, Error>> {
        self.dump_shim(opts)?;
        Some(self.spawn_early(opts))
    }

    fn spawn_early(&self, opts: &DumpOptions) -> Result<EarlyDump, Error> {
        std::fs::create_dir_all(&opts.work_dir).map_err(|e| Error::io(&opts.work_dir, e))?;
        let (ours, theirs) = UnixStream::pair().map_err(|e| Error::io("socketpair", e))?;
        let mut cmd = self.dump_command(opts, Some(theirs.as_raw_fd()));
        let child = cmd
            .args(opts.to_args())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| Error::Spawn {
                binary: self.binary.clone(),
                source,
            })?;
        drop(theirs);
        let mut early = EarlyDump {
            child: Some(child),
            start: Some(ours),
            opts: opts.clone(),
        };
        early.wait_ready()?;
        Ok(early)
    }
}

/// How long CRIU may take to load before the dump starts it frozen instead.
const READY_WAIT: Duration = Duration::from_secs(2);

impl EarlyDump {
    /// Waits for CRIU's "r": loaded, held before its main.
    fn wait_ready(&mut self) -> Result<(), Error> {
        let start = self.start.as_mut().expect("not started");
        let not_ready = |e| Error::io("the early criu's start socket", e);
        start
            .set_read_timeout(Some(READY_WAIT))
            .map_err(not_ready)?;
        let mut said = [0u8; 1];
        start.read_exact(&mut said).map_err(not_ready)?;
        if said != *b"r" {
            return Err(not_ready(std::io::Error::other("it said something else")));
        }
        Ok(())
    }

    /// The options it was started with.
    pub fn options(&self) -> &DumpOptions {
        &self.opts
    }

    /// Lets CRIU go and waits for the dump; the time counts from here.
    pub fn go(mut self) -> Result<Timing, Error> {
        let start = Instant::now();
        let mut socket = self.start.take().expect("started once");
        // A CRIU that died since it said ready answers through its status below.
        let _ = socket.write_all(b"g");
        drop(socket);
        let mut child = self.child.take().expect("waited once");
        let status = child.wait().map_err(|e| Error::io("wait for criu", e))?;
        dump_outcome(status, &self.opts, start)
    }
}

impl Drop for EarlyDump {
    fn drop(&mut self) {
        // Closing the socket first: a CRIU held at the shim's read exits there.
        drop(self.start.take());
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
