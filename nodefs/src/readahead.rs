//! A reader run on a thread of its own, a few buffers ahead of its consumer.
//!
//! A registry layer is gunzipped, hashed, untarred, cut, hashed again and compressed. The
//! gunzip and the blob's sha256 are a third of that CPU and need nothing from the rest, so
//! they run here while the consumer untars and cuts what came before.
//!
//! The thread reads its input to the end even after the consumer has stopped (dropped its
//! [`ReadAhead`]): the blob's digest covers all of it, padding and the rest of a bad blob
//! included. Its handle yields the outcome of that whole read.

use std::io::{self, Read};
use std::sync::mpsc::{sync_channel, Receiver};
use std::thread::{Scope, ScopedJoinHandle};

/// Bytes per buffer handed over.
const BLOCK: usize = 256 << 10;
/// Buffers read ahead of the consumer.
const AHEAD: usize = 8;

/// The consumer's end: reads what the thread read, in order.
pub(crate) struct ReadAhead {
    rx: Receiver<io::Result<Vec<u8>>>,
    cur: Vec<u8>,
    pos: usize,
    /// The thread's read error, repeated to every later read.
    failed: Option<(io::ErrorKind, String)>,
}

/// Starts reading `input` on a thread in `scope`.
pub(crate) fn spawn<'scope, 'env, R: Read + Send + 'scope>(
    scope: &'scope Scope<'scope, 'env>,
    mut input: R,
) -> (ReadAhead, ScopedJoinHandle<'scope, io::Result<()>>) {
    let (tx, rx) = sync_channel(AHEAD);
    let reader = scope.spawn(move || {
        let mut consumer = Some(tx);
        loop {
            let mut buf = vec![0u8; BLOCK];
            let mut got = 0;
            let res = loop {
                match input.read(&mut buf[got..]) {
                    Ok(0) => break Ok(()),
                    Ok(n) => {
                        got += n;
                        if got == BLOCK {
                            break Ok(());
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => break Err(e),
                }
            };
            buf.truncate(got);
            let done = got < BLOCK;
            match res {
                Err(e) => {
                    if let Some(tx) = &consumer {
                        let _ = tx.send(Err(io::Error::new(e.kind(), e.to_string())));
                    }
                    return Err(e);
                }
                Ok(()) => {
                    if got > 0
                        && consumer
                            .as_ref()
                            .is_some_and(|tx| tx.send(Ok(buf)).is_err())
                    {
                        // The consumer is done: read on for the digest, handing nothing over.
                        consumer = None;
                    }
                    if done {
                        return Ok(());
                    }
                }
            }
        }
    });
    let ahead = ReadAhead {
        rx,
        cur: Vec::new(),
        pos: 0,
        failed: None,
    };
    (ahead, reader)
}

impl Read for ReadAhead {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if let Some((kind, why)) = &self.failed {
            return Err(io::Error::new(*kind, why.clone()));
        }
        while self.pos == self.cur.len() {
            match self.rx.recv() {
                Ok(Ok(buf)) => {
                    self.cur = buf;
                    self.pos = 0;
                }
                Ok(Err(e)) => {
                    self.failed = Some((e.kind(), e.to_string()));
                    return Err(e);
                }
                // The thread is done: the end of the input.
                Err(_) => return Ok(0),
            }
        }
        let n = out.len().min(self.cur.len() - self.pos);
        out[..n].copy_from_slice(&self.cur[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hands out `data`, then fails if `fail` is set.
    struct Source {
        data: io::Cursor<Vec<u8>>,
        fail: bool,
        read: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Read for Source {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let max = buf.len().min(10_000);
            let n = self.data.read(&mut buf[..max])?;
            self.read.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            if n == 0 && self.fail {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "corrupt deflate",
                ));
            }
            Ok(n)
        }
    }

    fn source(len: usize, fail: bool) -> (Source, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        let read = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let data = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        let s = Source {
            data: io::Cursor::new(data),
            fail,
            read: read.clone(),
        };
        (s, read)
    }

    #[test]
    fn hands_over_every_byte_in_order() {
        let (src, _) = source(3 * BLOCK + 12_345, false);
        let want = src.data.get_ref().clone();
        std::thread::scope(|s| {
            let (mut ahead, reader) = spawn(s, src);
            let mut got = Vec::new();
            ahead.read_to_end(&mut got).unwrap();
            assert_eq!(got, want);
            reader.join().unwrap().unwrap();
        });
    }

    #[test]
    fn reads_to_the_end_after_the_consumer_stops() {
        let len = 20 * BLOCK + 7;
        let (src, read) = source(len, false);
        std::thread::scope(|s| {
            let (mut ahead, reader) = spawn(s, src);
            let mut first = [0u8; 100];
            ahead.read_exact(&mut first).unwrap();
            drop(ahead);
            reader.join().unwrap().unwrap();
        });
        assert_eq!(read.load(std::sync::atomic::Ordering::Relaxed), len);
    }

    #[test]
    fn an_input_error_reaches_the_consumer_and_the_handle() {
        let (src, _) = source(BLOCK + 5, true);
        std::thread::scope(|s| {
            let (mut ahead, reader) = spawn(s, src);
            let err = ahead.read_to_end(&mut Vec::new()).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidData);
            assert_eq!(
                ahead.read(&mut [0u8; 8]).unwrap_err().kind(),
                io::ErrorKind::InvalidData
            );
            assert_eq!(
                reader.join().unwrap().unwrap_err().kind(),
                io::ErrorKind::InvalidData
            );
        });
    }
}
