//! zstd with one context per thread. `zstd::bulk::compress` builds and zeroes a fresh context
//! on every call, which at level 1 costs about as much as compressing a small chunk: a
//! profile of a registry pull spent 9 % of the store's CPU in `ZSTD_initCCtx` alone.

use std::cell::RefCell;
use std::io;

thread_local! {
    static COMPRESSOR: RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> =
        const { RefCell::new(None) };
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { RefCell::new(None) };
}

/// `data` compressed at `level` (a plain zstd frame, as `zstd::bulk::compress` writes).
pub(crate) fn compress(data: &[u8], level: i32) -> io::Result<Vec<u8>> {
    COMPRESSOR.with_borrow_mut(|slot| {
        match slot {
            Some((l, c)) if *l != level => {
                c.set_compression_level(level)?;
                *l = level;
            }
            Some(_) => {}
            None => *slot = Some((level, zstd::bulk::Compressor::new(level)?)),
        }
        let (_, c) = slot.as_mut().expect("set above");
        c.compress(data)
    })
}

/// A zstd frame decompressed, refused if it holds more than `capacity` bytes.
pub(crate) fn decompress(data: &[u8], capacity: usize) -> io::Result<Vec<u8>> {
    DECOMPRESSOR.with_borrow_mut(|slot| {
        if slot.is_none() {
            *slot = Some(zstd::bulk::Decompressor::new()?);
        }
        slot.as_mut().expect("set above").decompress(data, capacity)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_match_the_one_shot_api_across_levels() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        for level in [1, 3, 1, 19, 1] {
            let ours = compress(&data, level).unwrap();
            assert_eq!(
                ours,
                zstd::bulk::compress(&data, level).unwrap(),
                "level {level}"
            );
            assert_eq!(decompress(&ours, data.len()).unwrap(), data);
        }
        assert!(decompress(&compress(&data, 1).unwrap(), data.len() - 1).is_err());
    }
}
