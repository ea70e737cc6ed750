//! Cutting file content into chunks.

use std::io::Read;

/// How a file's content is cut into chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkPolicy {
    /// FastCDC content-defined chunks of about 16/64/256 KiB (min/avg/max).
    Cdc,
    /// Fixed-size chunks (e.g. 4096 for CRIU page images, so pages dedup one by one), cut on
    /// every core at import and given no whole-file passthrough object: for data read back
    /// by export, not served by a mount.
    Fixed(u32),
}

pub const CDC_MIN: u32 = 16 * 1024;
pub const CDC_AVG: u32 = 64 * 1024;
pub const CDC_MAX: u32 = 256 * 1024;

/// Feed every chunk of `r` to `f` in order.
pub fn chunk_reader(
    r: &mut dyn Read,
    policy: ChunkPolicy,
    f: &mut dyn FnMut(&[u8]) -> Result<(), crate::Error>,
) -> Result<(), ChunkError> {
    match policy {
        ChunkPolicy::Cdc => {
            for c in fastcdc::v2020::StreamCDC::new(r, CDC_MIN, CDC_AVG, CDC_MAX) {
                let c = c.map_err(|e| match e {
                    fastcdc::v2020::Error::IoError(e) => ChunkError::Io(e),
                    other => ChunkError::Io(std::io::Error::other(other.to_string())),
                })?;
                f(&c.data).map_err(ChunkError::Sink)?;
            }
        }
        ChunkPolicy::Fixed(n) => {
            let n = n.max(1) as usize;
            let mut buf = vec![0u8; n];
            loop {
                let mut got = 0;
                while got < n {
                    let k = r.read(&mut buf[got..]).map_err(ChunkError::Io)?;
                    if k == 0 {
                        break;
                    }
                    got += k;
                }
                if got == 0 {
                    break;
                }
                f(&buf[..got]).map_err(ChunkError::Sink)?;
                if got < n {
                    break;
                }
            }
        }
    }
    Ok(())
}

/// Reading or storing failed while chunking.
#[derive(Debug, thiserror::Error)]
pub enum ChunkError {
    #[error("reading content")]
    Io(#[source] std::io::Error),
    #[error(transparent)]
    Sink(crate::Error),
}
