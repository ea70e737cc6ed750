//! The kernel's FUSE-over-io_uring ABI (`include/uapi/linux/fuse.h`, protocol 7.42+): the header
//! block of a ring entry and the command in an SQE128's 80-byte command area.

/// Bytes of `fuse_uring_req_header::in_out`: the `fuse_in_header` on fetch, the
/// `fuse_out_header` on commit.
pub(super) const IN_OUT_SZ: usize = 128;
/// Bytes of `fuse_uring_req_header::op_in`: the opcode's own header (`in_args[0]`).
pub(super) const OP_IN_SZ: usize = 128;
/// `sizeof(struct fuse_in_header)`.
pub(super) const IN_HEADER_LEN: usize = 40;
/// `sizeof(struct fuse_out_header)`.
pub(super) const OUT_HEADER_LEN: usize = 16;

/// `FUSE_IO_URING_CMD_REGISTER`: hand the kernel an entry's buffers; completes with the first
/// request for it.
pub(super) const CMD_REGISTER: u32 = 1;
/// `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`: the entry holds the reply to `commit_id`; completes
/// with the entry's next request.
pub(super) const CMD_COMMIT_AND_FETCH: u32 = 2;

/// `struct fuse_uring_ent_in_out`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct EntInOut {
    pub flags: u64,
    /// The request's `unique`, to name it in the commit.
    pub commit_id: u64,
    /// Bytes of the payload buffer used (request arguments after the first, or the reply's).
    pub payload_sz: u32,
    pub padding: u32,
    pub reserved: u64,
}

/// `struct fuse_uring_req_header`, the first of an entry's two buffers.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct ReqHeader {
    pub in_out: [u8; IN_OUT_SZ],
    pub op_in: [u8; OP_IN_SZ],
    pub ent: EntInOut,
}

/// `struct fuse_uring_cmd_req`, at the start of the SQE's command area.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct CmdReq {
    pub flags: u64,
    pub commit_id: u64,
    pub qid: u16,
    pub padding: [u8; 6],
}

impl CmdReq {
    /// The SQE128 command area holding this command.
    pub(super) fn to_cmd_area(self) -> [u8; 80] {
        let mut a = [0u8; 80];
        a[0..8].copy_from_slice(&self.flags.to_ne_bytes());
        a[8..16].copy_from_slice(&self.commit_id.to_ne_bytes());
        a[16..18].copy_from_slice(&self.qid.to_ne_bytes());
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layouts_match_the_kernel_headers() {
        assert_eq!(size_of::<EntInOut>(), 32);
        assert_eq!(offset_of!(EntInOut, commit_id), 8);
        assert_eq!(offset_of!(EntInOut, payload_sz), 16);
        assert_eq!(size_of::<ReqHeader>(), 288);
        assert_eq!(offset_of!(ReqHeader, op_in), 128);
        assert_eq!(offset_of!(ReqHeader, ent), 256);
        assert_eq!(size_of::<CmdReq>(), 24);
    }

    #[test]
    fn the_command_area_starts_with_flags_commit_id_and_qid() {
        let a = CmdReq {
            commit_id: 0x0102_0304_0506_0708,
            qid: 3,
            ..Default::default()
        }
        .to_cmd_area();
        assert_eq!(&a[8..16], &0x0102_0304_0506_0708u64.to_ne_bytes());
        assert_eq!(&a[16..18], &3u16.to_ne_bytes());
        assert!(a[18..].iter().all(|b| *b == 0));
    }
}
