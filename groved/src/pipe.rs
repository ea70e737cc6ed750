//! Adapters between async bodies and the blocking `Read`/`Write` the runtime, store and snapshotter take, so
//! tars and snapshot exports stream instead of sitting in memory.

use std::io::{self, Read, Write};

use axum::body::{Body, Bytes};
use futures::StreamExt as _;
use tokio::sync::mpsc;

const CHUNK: usize = 256 << 10;

/// A blocking reader fed by an async task that pulls the request body.
pub struct ChanReader {
    rx: mpsc::Receiver<Result<Bytes, io::Error>>,
    cur: Bytes,
}

impl ChanReader {
    /// Starts pumping `body` into the returned reader (on the current tokio runtime).
    pub fn spawn(body: Body) -> ChanReader {
        let (tx, rx) = mpsc::channel(8);
        tokio::spawn(async move {
            let mut stream = body.into_data_stream();
            while let Some(item) = stream.next().await {
                let item = item.map_err(io::Error::other);
                let stop = item.is_err();
                if tx.send(item).await.is_err() || stop {
                    break;
                }
            }
        });
        ChanReader {
            rx,
            cur: Bytes::new(),
        }
    }
}

impl Read for ChanReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(b)) => self.cur = b,
                Some(Err(e)) => return Err(e),
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.cur.len());
        buf[..n].copy_from_slice(&self.cur[..n]);
        self.cur = self.cur.slice(n..);
        Ok(n)
    }
}

/// A blocking writer whose bytes become a streamed response body.
pub struct ChanWriter {
    tx: mpsc::Sender<Result<Bytes, io::Error>>,
    buf: Vec<u8>,
}

impl ChanWriter {
    pub fn new() -> (ChanWriter, Body) {
        let (tx, rx) = mpsc::channel(8);
        let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
        (
            ChanWriter {
                tx,
                buf: Vec::with_capacity(CHUNK),
            },
            body,
        )
    }

    /// Ends the body with an error (the client sees a truncated transfer, not a clean end).
    pub fn fail(self, why: String) {
        let _ = self.tx.blocking_send(Err(io::Error::other(why)));
    }
}

impl Write for ChanWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            self.flush()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK)));
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "client went away"))
    }
}
