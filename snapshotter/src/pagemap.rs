//! CRIU's pagemap images, read and rewritten for one purpose: an incremental dump made
//! self-contained right after it is taken ([`flatten`]).
//!
//! An incremental dump leaves the pages nobody wrote in its parent images (`PE_PARENT`
//! entries). CRIU 4.1 restores such images, but not lazily: its lazy-pages daemon reads a
//! parent's pages without delivering them (the parent's page reader has no `io_complete`), and
//! a restore that is not lazy copies everything at once (a branch of a 256 MiB heap took 375 ms
//! instead of 128). So the new images take the parent's pages into their own pages file, with
//! the parent entries' flags (`PE_LAZY` where CRIU chose it). Both page files are mapped and
//! the new one is written with `pwritev` in address order, one copy through the page cache.
//!
//! Format (CRIU 4.1, criu/include/magic.h, images/pagemap.proto, criu/protobuf.c,
//! criu/pagemap.c): the words `IMG_COMMON_MAGIC` and `PAGEMAP_MAGIC`, then messages each
//! prefixed by its length as a u32 in host order: one `pagemap_head { uint32 pages_id = 1; }`
//! naming `pages-<pages_id>.img`, then `pagemap_entry { uint64 vaddr = 1; uint32 nr_pages = 2;
//! bool in_parent = 3 (old images); uint32 flags = 4; }` sorted by address. The pages file holds
//! the pages of the `PE_PRESENT` entries, in entry order, and nothing else.

use std::io;
use std::path::Path;

pub(crate) const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
const PAGEMAP_MAGIC: u32 = 0x5608_4025;
pub(crate) const PAGE: u64 = 4096;

pub(crate) const PE_PARENT: u32 = 1;
pub(crate) const PE_LAZY: u32 = 2;
pub(crate) const PE_PRESENT: u32 = 4;

/// One page range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub vaddr: u64,
    pub nr_pages: u64,
    pub flags: u32,
}

impl Entry {
    fn end(&self) -> u64 {
        self.vaddr + self.nr_pages * PAGE
    }
}

/// A pagemap image: its head's message, kept as it was, and its entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pagemap {
    head: Vec<u8>,
    pub entries: Vec<Entry>,
}

pub(crate) fn bad(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

pub(crate) fn varint(b: &[u8], at: &mut usize) -> io::Result<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*at).ok_or_else(|| bad("truncated varint"))?;
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return Ok(v);
        }
    }
    Err(bad("varint too long"))
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

pub(crate) fn word(b: &[u8], at: usize) -> io::Result<u32> {
    let w = b.get(at..at + 4).ok_or_else(|| bad("truncated image"))?;
    Ok(u32::from_ne_bytes([w[0], w[1], w[2], w[3]]))
}

impl Pagemap {
    pub(crate) fn parse(b: &[u8]) -> io::Result<Pagemap> {
        if word(b, 0)? != IMG_COMMON_MAGIC || word(b, 4)? != PAGEMAP_MAGIC {
            return Err(bad("not a CRIU pagemap image"));
        }
        let mut at = 8;
        let mut messages = Vec::new();
        while at < b.len() {
            let len = word(b, at)? as usize;
            let msg = b
                .get(at + 4..at + 4 + len)
                .ok_or_else(|| bad("truncated message"))?;
            messages.push(msg);
            at += 4 + len;
        }
        let (head, rest) = messages
            .split_first()
            .ok_or_else(|| bad("no pagemap head"))?;
        let mut entries = Vec::with_capacity(rest.len());
        for m in rest {
            let (mut e, mut at, mut in_parent, mut has_flags) = (
                Entry {
                    vaddr: 0,
                    nr_pages: 0,
                    flags: 0,
                },
                0,
                false,
                false,
            );
            while at < m.len() {
                let key = varint(m, &mut at)?;
                if key & 7 != 0 {
                    return Err(bad(format!(
                        "pagemap entry field {} is not a varint",
                        key >> 3
                    )));
                }
                let v = varint(m, &mut at)?;
                match key >> 3 {
                    1 => e.vaddr = v,
                    2 => e.nr_pages = v,
                    3 => in_parent = v != 0,
                    4 => {
                        e.flags = v as u32;
                        has_flags = true;
                    }
                    f => return Err(bad(format!("unknown pagemap entry field {f}"))),
                }
            }
            // CRIU's reading of old images (criu/pagemap.c, init_compat_pagemap_entry).
            if !has_flags {
                e.flags = if in_parent { PE_PARENT } else { 4 };
            }
            if entries.last().is_some_and(|p: &Entry| p.end() > e.vaddr) {
                return Err(bad(format!("pagemap entries unsorted at {:#x}", e.vaddr)));
            }
            entries.push(e);
        }
        Ok(Pagemap {
            head: head.to_vec(),
            entries,
        })
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + 4 + self.head.len() + self.entries.len() * 20);
        out.extend_from_slice(&IMG_COMMON_MAGIC.to_ne_bytes());
        out.extend_from_slice(&PAGEMAP_MAGIC.to_ne_bytes());
        out.extend_from_slice(&(self.head.len() as u32).to_ne_bytes());
        out.extend_from_slice(&self.head);
        let mut msg = Vec::with_capacity(24);
        for e in &self.entries {
            msg.clear();
            msg.push(1 << 3);
            put_varint(&mut msg, e.vaddr);
            msg.push(2 << 3);
            put_varint(&mut msg, e.nr_pages);
            msg.push(4 << 3);
            put_varint(&mut msg, u64::from(e.flags));
            out.extend_from_slice(&(msg.len() as u32).to_ne_bytes());
            out.extend_from_slice(&msg);
        }
        out
    }

    /// The id of the pages file (`pages-<id>.img`) the head names.
    pub(crate) fn pages_id(&self) -> io::Result<u64> {
        let (mut at, mut id) = (0, None);
        while at < self.head.len() {
            let key = varint(&self.head, &mut at)?;
            let v = varint(&self.head, &mut at)?;
            if key == 1 << 3 {
                id = Some(v);
            }
        }
        id.ok_or_else(|| bad("pagemap head without pages_id"))
    }

    /// The byte offset in the pages file of each entry's first page (`None` for entries that
    /// hold no pages there).
    fn offsets(&self) -> Vec<Option<u64>> {
        let mut off = 0;
        self.entries
            .iter()
            .map(|e| {
                (e.flags & PE_PRESENT != 0).then(|| {
                    let at = off;
                    off += e.nr_pages * PAGE;
                    at
                })
            })
            .collect()
    }
}

/// Where the bytes of one run of output pages come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum From {
    Own(u64),
    Parent(u64),
}

/// The self-contained entries for `own` (which may have `PE_PARENT` entries) over `parent`
/// (which has none), and where each output entry's pages come from. A parent range the parent
/// does not hold in its pages file is an error (CRIU checked it at dump).
fn plan(own: &Pagemap, parent: &Pagemap) -> io::Result<Vec<(Entry, Option<From>)>> {
    let (own_off, parent_off) = (own.offsets(), parent.offsets());
    let mut out: Vec<(Entry, Option<From>)> = Vec::with_capacity(own.entries.len() * 2);
    let mut p = 0;
    for (i, e) in own.entries.iter().enumerate() {
        if e.flags & PE_PARENT == 0 {
            out.push((*e, own_off[i].map(From::Own)));
            continue;
        }
        let mut at = e.vaddr;
        while at < e.end() {
            // Both lists are sorted: the parent's cursor only moves forward.
            while p < parent.entries.len() && parent.entries[p].end() <= at {
                p += 1;
            }
            let (pe, base) = parent
                .entries
                .get(p)
                .filter(|pe| pe.vaddr <= at)
                .zip(parent_off.get(p).copied().flatten())
                .ok_or_else(|| bad(format!("page {at:#x} is not in the parent's pages")))?;
            let end = e.end().min(pe.end());
            let src = base + (at - pe.vaddr);
            let flags = (e.flags & !(PE_PARENT | PE_LAZY)) | PE_PRESENT | (pe.flags & PE_LAZY);
            match out.last_mut() {
                Some((l, Some(From::Parent(lsrc))))
                    if l.end() == at && l.flags == flags && *lsrc + l.nr_pages * PAGE == src =>
                {
                    l.nr_pages += (end - at) / PAGE;
                }
                _ => out.push((
                    Entry {
                        vaddr: at,
                        nr_pages: (end - at) / PAGE,
                        flags,
                    },
                    Some(From::Parent(src)),
                )),
            }
            at = end;
        }
    }
    Ok(out)
}

/// What [`flatten`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Flattened {
    /// Pagemaps that had pages in the parent.
    pub pagemaps: usize,
    /// Pages copied in from the parent.
    pub parent_pages: u64,
}

/// Makes the incremental images in `images` self-contained: every pagemap (process or shared
/// memory) with pages in `parent` (the parent dump's images) gets those pages into its own
/// pages file. Files are replaced (written beside, then renamed), never rewritten in place, so
/// hard links to the parent's files elsewhere keep their content. The caller removes the
/// `parent` link afterwards.
pub(crate) fn flatten(images: &Path, parent: &Path) -> io::Result<Flattened> {
    let mut done = Flattened::default();
    let mut names: Vec<String> = std::fs::read_dir(images)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("pagemap-") && n.ends_with(".img"))
        .collect();
    names.sort();
    let ctx = |name: &str, err: io::Error| io::Error::new(err.kind(), format!("{name}: {err}"));
    for name in names {
        let own = Pagemap::parse(&std::fs::read(images.join(&name))?).map_err(|e| ctx(&name, e))?;
        if !own.entries.iter().any(|x| x.flags & PE_PARENT != 0) {
            continue;
        }
        let theirs = Pagemap::parse(&std::fs::read(parent.join(&name))?)
            .map_err(|e| ctx(&format!("parent's {name}"), e))?;
        let plan = plan(&own, &theirs).map_err(|e| ctx(&name, e))?;
        let pages = format!("pages-{}.img", own.pages_id()?);
        let their_pages = format!("pages-{}.img", theirs.pages_id()?);
        let own_map = open_mapped(&images.join(&pages))?;
        let their_map = open_mapped(&parent.join(&their_pages))?;
        let tmp = images.join(format!("{pages}.tmp"));
        let copied = write_pages(&tmp, &plan, own_map.bytes(), their_map.bytes()).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            ctx(&pages, e)
        })?;
        let flat = Pagemap {
            head: own.head.clone(),
            entries: merged(plan.iter().map(|(e, _)| *e)),
        };
        let map_tmp = images.join(format!("{name}.tmp"));
        std::fs::write(&map_tmp, flat.encode())?;
        std::fs::rename(&tmp, images.join(&pages))?;
        std::fs::rename(&map_tmp, images.join(&name))?;
        done.pagemaps += 1;
        done.parent_pages += copied;
    }
    Ok(done)
}

/// At most this many pages per merged entry: what CRIU's own dumps write (its page pipes hold
/// 1 MiB), so no reader meets an entry larger than it would from CRIU.
const MAX_MERGED: u64 = 256;

/// Adjacent entries with the same flags as one (their pages are adjacent in the pages file,
/// written in entry order): a dump with 5 % of its pages written has thousands of runs, and a
/// restore pays per entry (measured: a fork of 8 took 960 ms from unmerged images, 602 from a
/// full dump's).
fn merged(entries: impl Iterator<Item = Entry>) -> Vec<Entry> {
    let mut out: Vec<Entry> = Vec::new();
    for e in entries {
        match out.last_mut() {
            Some(l)
                if l.end() == e.vaddr
                    && l.flags == e.flags
                    && l.nr_pages + e.nr_pages <= MAX_MERGED =>
            {
                l.nr_pages += e.nr_pages;
            }
            _ => out.push(e),
        }
    }
    out
}

fn open_mapped(path: &Path) -> io::Result<crate::sys::Mapping> {
    let f = std::fs::File::open(path)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    crate::sys::Mapping::file(&f)
}

/// Writes the output pages file in entry order, from the two mapped page files; returns the
/// pages that came from the parent.
fn write_pages(
    to: &Path,
    plan: &[(Entry, Option<From>)],
    own: &[u8],
    parent: &[u8],
) -> io::Result<u64> {
    use std::io::IoSlice;
    // Fewer, larger writes: the kernel copies from the mappings into the new file's pages.
    const BATCH: usize = 512;
    let out = std::fs::File::create(to)?;
    let (mut slices, mut at, mut from_parent) = (Vec::with_capacity(BATCH), 0i64, 0u64);
    let short = |what: &str, off: u64| bad(format!("{what} pages file too short at {off:#x}"));
    let flush = |slices: &mut Vec<IoSlice<'_>>, at: &mut i64| -> io::Result<()> {
        let mut rest: &mut [IoSlice<'_>] = slices;
        while !rest.is_empty() {
            let n = nix::sys::uio::pwritev(&out, rest, *at).map_err(io::Error::from)?;
            *at += n as i64;
            IoSlice::advance_slices(&mut rest, n);
        }
        slices.clear();
        Ok(())
    };
    for (e, from) in plan {
        let len = (e.nr_pages * PAGE) as usize;
        let bytes = match from {
            None => continue,
            Some(From::Own(off)) => own
                .get(*off as usize..*off as usize + len)
                .ok_or_else(|| short("own", *off))?,
            Some(From::Parent(off)) => {
                from_parent += e.nr_pages;
                parent
                    .get(*off as usize..*off as usize + len)
                    .ok_or_else(|| short("parent's", *off))?
            }
        };
        slices.push(IoSlice::new(bytes));
        if slices.len() == BATCH {
            flush(&mut slices, &mut at)?;
        }
    }
    flush(&mut slices, &mut at)?;
    Ok(from_parent)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PRESENT: u32 = 4;

    fn map(entries: &[(u64, u64, u32)]) -> Pagemap {
        Pagemap {
            head: vec![0x08, 0x01],
            entries: entries
                .iter()
                .map(|&(vaddr, nr_pages, flags)| Entry {
                    vaddr,
                    nr_pages,
                    flags,
                })
                .collect(),
        }
    }

    #[test]
    fn a_pagemap_criu_wrote_round_trips_byte_for_byte() {
        // The head and first two entries of a pagemap CRIU 4.1.1 wrote on this host.
        let real: &[u8] = &[
            0x19, 0x43, 0x56, 0x54, 0x25, 0x40, 0x08, 0x56, 0x02, 0x00, 0x00, 0x00, 0x08, 0x01,
            0x0c, 0x00, 0x00, 0x00, 0x08, 0x80, 0xc0, 0xf0, 0xf3, 0x95, 0xc2, 0x15, 0x10, 0x01,
            0x20, 0x04, 0x0c, 0x00, 0x00, 0x00, 0x08, 0x80, 0x80, 0xf1, 0xf3, 0x95, 0xc2, 0x15,
            0x10, 0x02, 0x20, 0x04,
        ];
        let m = Pagemap::parse(real).unwrap();
        assert_eq!(m.entries.len(), 2);
        assert_eq!(m.entries[0].vaddr, 0x5611_5e7c_2000);
        assert_eq!((m.entries[1].nr_pages, m.entries[1].flags), (2, PRESENT));
        assert_eq!(m.encode(), real);
        assert!(
            Pagemap::parse(&real[..real.len() - 1]).is_err(),
            "truncated"
        );
        assert!(Pagemap::parse(&real[4..]).is_err(), "no magic");
    }

    /// Writes a pagemap and its pages file (each page filled with one byte value).
    fn write(dir: &Path, name: &str, pages_id: u64, entries: &[(u64, u64, u32)], fill: &[u8]) {
        std::fs::create_dir_all(dir).unwrap();
        let mut m = map(entries);
        m.head = vec![0x08, pages_id as u8];
        std::fs::write(dir.join(name), m.encode()).unwrap();
        let mut data = Vec::new();
        let mut fills = fill.iter();
        for e in &m.entries {
            if e.flags & PE_PRESENT != 0 {
                for _ in 0..e.nr_pages {
                    data.extend(std::iter::repeat_n(*fills.next().unwrap(), PAGE as usize));
                }
            }
        }
        std::fs::write(dir.join(format!("pages-{pages_id}.img")), data).unwrap();
    }

    /// (vaddr, byte) of every page the images in `dir` hold for pagemap `name`.
    fn pages_of(dir: &Path, name: &str) -> Vec<(u64, u8, u32)> {
        let m = Pagemap::parse(&std::fs::read(dir.join(name)).unwrap()).unwrap();
        let data = std::fs::read(dir.join(format!("pages-{}.img", m.pages_id().unwrap()))).unwrap();
        let mut out = Vec::new();
        let mut off = 0;
        for e in &m.entries {
            assert_eq!(e.flags & PE_PARENT, 0, "flat");
            for i in 0..e.nr_pages {
                if e.flags & PE_PRESENT != 0 {
                    let page = &data[off..off + PAGE as usize];
                    assert!(page.iter().all(|b| *b == page[0]));
                    out.push((e.vaddr + i * PAGE, page[0], e.flags));
                    off += PAGE as usize;
                }
            }
        }
        assert_eq!(off, data.len(), "nothing more in the pages file");
        out
    }

    #[test]
    fn a_flattened_dump_holds_its_own_pages_and_the_parents_with_the_parents_laziness() {
        let d = tempfile::tempdir().unwrap();
        let (images, parent) = (d.path().join("images"), d.path().join("parent"));
        let lazy = PRESENT | PE_LAZY;
        // Parent: a non-lazy stack-like entry, two adjacent lazy ones, one far away.
        write(
            &parent,
            "pagemap-1.img",
            3,
            &[
                (0x10000, 4, PRESENT),
                (0x14000, 8, lazy),
                (0x1c000, 4, lazy),
                (0x30000, 2, lazy),
            ],
            &[
                1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 16, 17, 20, 21, 22, 23, 30, 31,
            ],
        );
        write(
            &images,
            "pagemap-1.img",
            5,
            &[
                (0x10000, 2, PE_PARENT),
                (0x12000, 1, PRESENT),
                (0x13000, 9, PE_PARENT), // the parent's non-lazy tail, then lazy pages
                (0x1c000, 2, lazy),
                (0x1e000, 2, PE_PARENT),
                (0x30000, 2, PE_PARENT),
                (0x40000, 1, lazy), // new since the parent
            ],
            &[99, 98, 97, 96],
        );
        // A hard link elsewhere to the parent's pages file must keep its content.
        std::fs::hard_link(parent.join("pages-3.img"), d.path().join("link")).unwrap();
        let before = std::fs::read(d.path().join("link")).unwrap();
        let got = flatten(&images, &parent).unwrap();
        assert_eq!(
            got,
            Flattened {
                pagemaps: 1,
                parent_pages: 2 + 9 + 2 + 2
            }
        );
        let mut want = vec![
            (0x10000, 1, PRESENT),
            (0x11000, 2, PRESENT),
            (0x12000, 99, PRESENT),
        ];
        want.push((0x13000, 4, PRESENT));
        for (i, b) in [10, 11, 12, 13, 14, 15, 16, 17].iter().enumerate() {
            want.push((0x14000 + i as u64 * PAGE, *b, lazy));
        }
        want.extend([
            (0x1c000, 98, lazy),
            (0x1d000, 97, lazy),
            (0x1e000, 22, lazy),
        ]);
        want.extend([
            (0x1f000, 23, lazy),
            (0x30000, 30, lazy),
            (0x31000, 31, lazy),
        ]);
        want.push((0x40000, 96, lazy));
        assert_eq!(pages_of(&images, "pagemap-1.img"), want);
        // Runs with the same flags are one entry, as in a full dump.
        let m = Pagemap::parse(&std::fs::read(images.join("pagemap-1.img")).unwrap()).unwrap();
        let runs: Vec<_> = m
            .entries
            .iter()
            .map(|e| (e.vaddr, e.nr_pages, e.flags))
            .collect();
        assert_eq!(
            runs,
            [
                (0x10000, 4, PRESENT),
                (0x14000, 12, lazy),
                (0x30000, 2, lazy),
                (0x40000, 1, lazy)
            ]
        );
        assert_eq!(std::fs::read(d.path().join("link")).unwrap(), before);
        let left: Vec<_> = std::fs::read_dir(&images)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
        // Flat already: nothing more to do.
        assert_eq!(flatten(&images, &parent).unwrap(), Flattened::default());
    }

    #[test]
    fn merged_entries_stop_at_a_gap_a_flag_or_256_pages() {
        let e = |vaddr, nr_pages, flags| Entry {
            vaddr,
            nr_pages,
            flags,
        };
        let got = merged(
            [
                e(0, 200, PRESENT),
                e(200 * PAGE, 56, PRESENT),
                e(256 * PAGE, 10, PRESENT),
                e(266 * PAGE, 1, PRESENT | PE_LAZY),
                e(300 * PAGE, 1, PRESENT | PE_LAZY),
            ]
            .into_iter(),
        );
        assert_eq!(
            got,
            [
                e(0, 256, PRESENT),
                e(256 * PAGE, 10, PRESENT),
                e(266 * PAGE, 1, PRESENT | PE_LAZY),
                e(300 * PAGE, 1, PRESENT | PE_LAZY),
            ]
        );
    }

    #[test]
    fn a_range_the_parent_lacks_is_an_error_and_changes_nothing() {
        let d = tempfile::tempdir().unwrap();
        let (images, parent) = (d.path().join("images"), d.path().join("parent"));
        write(
            &parent,
            "pagemap-1.img",
            1,
            &[(0x10000, 2, PRESENT | PE_LAZY)],
            &[1, 2],
        );
        write(&images, "pagemap-1.img", 2, &[(0x10000, 3, PE_PARENT)], &[]);
        let before = std::fs::read(images.join("pagemap-1.img")).unwrap();
        let e = flatten(&images, &parent).unwrap_err();
        assert!(e.to_string().contains("0x12000"), "{e}");
        assert_eq!(std::fs::read(images.join("pagemap-1.img")).unwrap(), before);
        assert!(!images.join("pages-2.img.tmp").exists());
    }
}
