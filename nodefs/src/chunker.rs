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

/// Feed every chunk of `data` to `f` in order: the cuts [`chunk_reader`] makes of the same
/// bytes (a test holds the two to that), without the stream's buffer of `CDC_MAX` zeroed bytes
/// per call, which for a tree of small files cost more than cutting them.
pub fn chunk_slice(
    data: &[u8],
    policy: ChunkPolicy,
    f: &mut dyn FnMut(&[u8]) -> Result<(), crate::Error>,
) -> Result<(), crate::Error> {
    match policy {
        ChunkPolicy::Cdc => {
            for c in fastcdc::v2020::FastCDC::new(data, CDC_MIN, CDC_AVG, CDC_MAX) {
                f(&data[c.offset..c.offset + c.length])?;
            }
        }
        ChunkPolicy::Fixed(n) => {
            for c in data.chunks(n.max(1) as usize) {
                f(c)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn cuts_of_stream(data: &[u8], policy: ChunkPolicy) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        chunk_reader(&mut &data[..], policy, &mut |c| {
            out.push(c.to_vec());
            Ok(())
        })
        .unwrap();
        out
    }

    fn cuts_of_slice(data: &[u8], policy: ChunkPolicy) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        chunk_slice(data, policy, &mut |c| {
            out.push(c.to_vec());
            Ok(())
        })
        .unwrap();
        out
    }

    /// The same bytes must cut the same way on both paths, or an import would not dedup
    /// against what the other path stored.
    #[test]
    fn slice_and_stream_cut_the_same() {
        let mut x = 0x9e3779b97f4a7c15u64;
        let data: Vec<u8> = (0..3_000_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 56) as u8
            })
            .collect();
        for len in [
            0,
            1,
            4095,
            16 * 1024,
            70_000,
            256 * 1024,
            300_001,
            3_000_000,
        ] {
            for policy in [ChunkPolicy::Cdc, ChunkPolicy::Fixed(4096)] {
                let d = &data[..len];
                let s = cuts_of_stream(d, policy);
                assert_eq!(s, cuts_of_slice(d, policy), "{len} bytes, {policy:?}");
                assert_eq!(s.concat(), d);
            }
        }
        assert!(cuts_of_slice(&data, ChunkPolicy::Cdc).len() > 10);
    }
}
