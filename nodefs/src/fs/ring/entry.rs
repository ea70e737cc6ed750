//! One ring entry's memory: the header block and the payload buffer the kernel copies requests
//! into and replies out of, laid out so that a request can be handed to fuser's parser as the
//! contiguous bytes a `/dev/fuse` read would have returned, without copying its payload.
//!
//! Layout of the entry's anonymous mapping (page aligned):
//! ```text
//! 0                  the kernel's header block (`ReqHeader`, 288 bytes)
//! IOV_OFF            the two iovecs REGISTER names (header block, payload)
//! PAGE - 40 - arg0   request assembly: fuse_in_header, then the opcode header (arg0)
//! PAGE               payload (`payload_size` bytes): the rest of the request, then the reply
//! ```

use std::io::{self, IoSlice};
use std::mem::size_of;

use memmap2::MmapMut;

use super::abi::{EntInOut, ReqHeader, IN_HEADER_LEN, OP_IN_SZ, OUT_HEADER_LEN};

const PAGE: usize = 4096;
const IOV_OFF: usize = 512;

/// The memory of one entry. The kernel writes it between REGISTER/COMMIT and the completion;
/// the queue thread reads and writes it only in between, through raw pointers (no Rust
/// reference to it outlives a call).
pub(super) struct EntryBuf {
    /// Owns the mapping `base` points into.
    _map: MmapMut,
    base: *mut u8,
    payload_size: usize,
}

/// A request that is not what the protocol says (lengths that do not add up): answered with
/// EIO to `unique`.
#[derive(Debug)]
pub(super) struct Malformed {
    /// The request's id (the kernel's `unique`), to answer it under.
    pub commit_id: u64,
}

impl EntryBuf {
    pub(super) fn new(payload_size: usize) -> io::Result<EntryBuf> {
        let mut map = MmapMut::map_anon(PAGE + payload_size)?;
        let base = map.as_mut_ptr();
        let iov = [
            libc::iovec {
                iov_base: base.cast(),
                iov_len: size_of::<ReqHeader>(),
            },
            libc::iovec {
                // SAFETY: PAGE is within the mapping (its length is PAGE + payload_size).
                iov_base: unsafe { base.add(PAGE) }.cast(),
                iov_len: payload_size,
            },
        ];
        // SAFETY: IOV_OFF + 2 iovecs lies within the first page, past the header block; the
        // mapping is page aligned, so the iovecs are aligned.
        unsafe { std::ptr::write(base.add(IOV_OFF).cast::<[libc::iovec; 2]>(), iov) };
        Ok(EntryBuf {
            _map: map,
            base,
            payload_size,
        })
    }

    fn base(&self) -> *mut u8 {
        self.base
    }

    /// The address of the two iovecs, for REGISTER's `sqe->addr`.
    pub(super) fn iovecs_addr(&self) -> u64 {
        self.base() as u64 + IOV_OFF as u64
    }

    fn header(&self) -> ReqHeader {
        // SAFETY: the header block is at the start of the mapping and ReqHeader is plain old
        // data; read unaligned-safe by value while the kernel does not own the entry.
        unsafe { std::ptr::read(self.base().cast::<ReqHeader>()) }
    }

    /// The request now in the entry, as the contiguous bytes fuser parses (in header, opcode
    /// header, payload), and its `commit_id`.
    pub(super) fn request(&self) -> Result<(&[u8], u64), Malformed> {
        let h = self.header();
        let unique = u64::from_ne_bytes(h.in_out[8..16].try_into().unwrap_or_default());
        let len = u32::from_ne_bytes(h.in_out[0..4].try_into().unwrap_or_default()) as usize;
        let payload = h.ent.payload_sz as usize;
        let arg0 = len
            .checked_sub(IN_HEADER_LEN + payload)
            .filter(|a| *a <= OP_IN_SZ && payload <= self.payload_size)
            .ok_or(Malformed { commit_id: unique })?;
        let start = PAGE - IN_HEADER_LEN - arg0;
        if !start.is_multiple_of(8) {
            // fuser reads headers in place and needs them 8-byte aligned; every opcode header
            // is a multiple of 8 bytes long, so this is a protocol error.
            return Err(Malformed { commit_id: unique });
        }
        // SAFETY: start..PAGE lies in the first page, past IOV_OFF + 32 (arg0 <= 128), so it
        // overlaps neither the header block nor the iovecs; the sources are a local copy.
        unsafe {
            let dst = self.base().add(start);
            std::ptr::copy_nonoverlapping(h.in_out.as_ptr(), dst, IN_HEADER_LEN);
            std::ptr::copy_nonoverlapping(h.op_in.as_ptr(), dst.add(IN_HEADER_LEN), arg0);
        }
        // SAFETY: start..PAGE + payload is within the mapping, initialised (assembled above
        // and written by the kernel), and nothing writes it while the slice lives: the kernel
        // does not, as the queue thread holds the entry until it commits, after the dispatch
        // that reads it; a reply does not, as it goes to the header block (below `IOV_OFF`)
        // and, only for a request without payload, to PAGE.. (`queue::answer` keeps the reply
        // to a request with one aside until dispatch has returned).
        let bytes = unsafe {
            std::slice::from_raw_parts(self.base().add(start), IN_HEADER_LEN + arg0 + payload)
        };
        Ok((bytes, h.ent.commit_id))
    }

    /// Bytes of the payload buffer the reply now in the entry uses.
    pub(super) fn reply_len(&self) -> usize {
        self.header().ent.payload_sz as usize
    }

    /// Give the payload buffer's pages back to the kernel (they read as zeros, and are mapped
    /// again as a request or reply touches them); the header page stays. Only while the
    /// kernel is not writing the entry.
    pub(super) fn trim(&self) {
        // SAFETY: the payload range lies within the mapping; MADV_DONTNEED on private
        // anonymous memory only drops its contents, which nothing needs between requests.
        let r = unsafe {
            libc::madvise(
                self.base().add(PAGE).cast(),
                self.payload_size,
                libc::MADV_DONTNEED,
            )
        };
        if r != 0 {
            tracing::debug!(error = %io::Error::last_os_error(), "madvise of a ring entry");
        }
    }

    /// Where a reply to the entry's request is written.
    pub(super) fn reply_region(&self) -> ReplyRegion {
        ReplyRegion {
            base: self.base(),
            payload_size: self.payload_size,
        }
    }
}

/// The part of an entry a reply is written to: the out header in the header block, the rest
/// in the payload buffer.
#[derive(Debug)]
pub(super) struct ReplyRegion {
    base: *mut u8,
    payload_size: usize,
}

// SAFETY: the region points into an `EntryBuf` that the queue thread neither commits nor frees
// before it has taken the region back after dispatch (see `queue::EntryReply`); a reply written
// from another thread in the meantime is the only access.
unsafe impl Send for ReplyRegion {}

impl ReplyRegion {
    /// Write a reply as fuser hands it over (`reply[0]` the out header, the rest payload).
    /// A reply that does not fit becomes EIO.
    pub(super) fn write(&self, reply: &[IoSlice<'_>]) {
        let (head, data) = match reply.split_first() {
            Some((h, d)) if h.len() == OUT_HEADER_LEN => (h, d),
            _ => return self.write_error(0, libc::EIO),
        };
        let unique = u64::from_ne_bytes(head[8..16].try_into().unwrap_or_default());
        let total: usize = data.iter().map(|d| d.len()).sum();
        if total > self.payload_size {
            tracing::warn!(bytes = total, "FUSE reply larger than the ring buffer: EIO");
            return self.write_error(unique, libc::EIO);
        }
        // SAFETY: the out header goes to offset 0 (in_out, 128 bytes); the payload to PAGE..
        // PAGE + total, within the mapping (checked above); sources are the caller's slices.
        unsafe {
            std::ptr::copy_nonoverlapping(head.as_ptr(), self.base, OUT_HEADER_LEN);
            let mut at = self.base.add(PAGE);
            for d in data {
                std::ptr::copy_nonoverlapping(d.as_ptr(), at, d.len());
                at = at.add(d.len());
            }
        }
        self.set_payload_sz(total as u32);
    }

    /// An error reply (`errno` positive) to `unique`.
    pub(super) fn write_error(&self, unique: u64, errno: i32) {
        let mut head = [0u8; OUT_HEADER_LEN];
        head[0..4].copy_from_slice(&(OUT_HEADER_LEN as u32).to_ne_bytes());
        head[4..8].copy_from_slice(&(-errno).to_ne_bytes());
        head[8..16].copy_from_slice(&unique.to_ne_bytes());
        // SAFETY: 16 bytes at offset 0, the header block's in_out.
        unsafe { std::ptr::copy_nonoverlapping(head.as_ptr(), self.base, OUT_HEADER_LEN) };
        self.set_payload_sz(0);
    }

    fn set_payload_sz(&self, n: u32) {
        let off = std::mem::offset_of!(ReqHeader, ent) + std::mem::offset_of!(EntInOut, payload_sz);
        // SAFETY: the field lies in the header block; u32 at an 8-aligned struct's offset 16.
        unsafe { std::ptr::write(self.base.add(off).cast::<u32>(), n) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::ring::abi::OUT_HEADER_LEN;

    /// Fill the header block as the kernel would for a request of `arg0` + `payload` bytes.
    fn kernel_writes(e: &EntryBuf, unique: u64, arg0: &[u8], payload: &[u8]) {
        let mut h = e.header();
        let len = (IN_HEADER_LEN + arg0.len() + payload.len()) as u32;
        h.in_out[0..4].copy_from_slice(&len.to_ne_bytes());
        h.in_out[8..16].copy_from_slice(&unique.to_ne_bytes());
        h.op_in[..arg0.len()].copy_from_slice(arg0);
        h.ent.commit_id = unique;
        h.ent.payload_sz = payload.len() as u32;
        // SAFETY: test: the header block and payload buffer are the entry's own.
        unsafe {
            std::ptr::write(e.base().cast::<ReqHeader>(), h);
            std::ptr::copy_nonoverlapping(payload.as_ptr(), e.base().add(PAGE), payload.len());
        }
    }

    #[test]
    fn a_request_is_reassembled_contiguously_and_aligned() {
        let e = EntryBuf::new(8192).unwrap();
        kernel_writes(&e, 7, &[1u8; 16], b"name\0");
        let (bytes, commit) = e.request().unwrap();
        assert_eq!(commit, 7);
        assert_eq!(bytes.len(), 40 + 16 + 5);
        assert_eq!(bytes.as_ptr() as usize % 8, 0);
        assert_eq!(&bytes[40..56], &[1u8; 16]);
        assert_eq!(&bytes[56..], b"name\0");
    }

    #[test]
    fn lengths_that_do_not_add_up_are_malformed() {
        let e = EntryBuf::new(8192).unwrap();
        kernel_writes(&e, 9, &[0u8; 8], b"x");
        let mut h = e.header();
        h.in_out[0..4].copy_from_slice(&10u32.to_ne_bytes());
        // SAFETY: test: the entry's own header block.
        unsafe { std::ptr::write(e.base().cast::<ReqHeader>(), h) };
        assert_eq!(e.request().unwrap_err().commit_id, 9);
    }

    #[test]
    fn a_reply_lands_in_the_header_and_payload_and_too_big_is_eio() {
        let e = EntryBuf::new(8192).unwrap();
        let mut head = [0u8; OUT_HEADER_LEN];
        head[8..16].copy_from_slice(&5u64.to_ne_bytes());
        e.reply_region()
            .write(&[IoSlice::new(&head), IoSlice::new(b"ab"), IoSlice::new(b"c")]);
        let h = e.header();
        assert_eq!(h.ent.payload_sz, 3);
        // SAFETY: test: reading the entry's own payload.
        let p = unsafe { std::slice::from_raw_parts(e.base().add(PAGE), 3) };
        assert_eq!(p, b"abc");
        let big = vec![0u8; 8193];
        e.reply_region()
            .write(&[IoSlice::new(&head), IoSlice::new(&big)]);
        let h = e.header();
        assert_eq!(h.ent.payload_sz, 0);
        assert_eq!(
            i32::from_ne_bytes(h.in_out[4..8].try_into().unwrap()),
            -libc::EIO
        );
        assert_eq!(u64::from_ne_bytes(h.in_out[8..16].try_into().unwrap()), 5);
    }
}
