//! The pages of a dump that a lazily restored branch should have at once rather than by a fault
//! each: its small private areas, and the argument and environment strings other processes read.
//!
//! A branch restored with lazy pages gets a page when it touches it, or when the lazy-pages
//! daemon's background copy reaches it (after its tree's quiet wait, `criu::lazy_quiet`). Two
//! kinds of pages should not wait for that:
//!
//! - **Small private anonymous areas** (at most [`SMALL_AREA`] each, [`SMALL_TOTAL`] a process):
//!   the interpreter's heap and arenas, `.bss`, stacks. A python answering one HTTP request in a
//!   fresh branch touched ≈ 420 pages of them, each a fault, a round trip through the daemon and
//!   ≈ 23 µs of its CPU; restored eagerly, CRIU's restore reads them in bulk (a few MiB). The large
//!   areas (the heaps that make a sandbox big) stay lazy.
//! - **Argument and environment strings.** Another process reading that memory (`ps` and
//!   `pgrep -f` reading /proc/<pid>/cmdline, /proc/<pid>/environ) does not wait for the daemon:
//!   the kernel fails a remote access to a page userfaultfd has not filled, and `ps` shows
//!   `[sleep]` for `sleep 1000`, `pgrep -f` matches nothing. The strings sit at the top of the
//!   stack, which the background copy reaches last.
//!
//! So right after the dump the pagemap entries holding them are marked eager (`PE_LAZY` cleared):
//! CRIU's restore then writes those pages itself, as it does the page under each thread's stack
//! pointer.
//!
//! Format: images/mm.proto (CRIU 4.1): after the words `IMG_COMMON_MAGIC` and `MM_MAGIC`, one
//! `mm_entry` prefixed by its length (u32, host order), whose fields 8-11 are `mm_arg_start`,
//! `mm_arg_end`, `mm_env_start`, `mm_env_end` (varints) and 14 the `vma_entry` messages, each
//! with `start` (1), `end` (2) and `flags` (6, mmap's). Pagemaps: see `pagemap.rs`.

use std::io;
use std::path::Path;

use crate::pagemap::{
    bad, varint, word, Entry, Pagemap, IMG_COMMON_MAGIC, PAGE, PE_LAZY, PE_PRESENT,
};

const MM_MAGIC: u32 = 0x5749_2820;
/// Larger than any argument and environment area Linux accepts (a quarter of an 8 MiB stack
/// limit, by default): a range beyond it is not trusted.
const MOST: u64 = 64 << 20;
/// A private anonymous area this small is restored eagerly...
const SMALL_AREA: u64 = 16 << 20;
/// ...up to this much of them in one process (the first ones, by address).
const SMALL_TOTAL: u64 = 64 << 20;
const MAP_PRIVATE: u64 = 0x02;
const MAP_ANONYMOUS: u64 = 0x20;

/// Marks eager, in every process of the dump at `images`, its small private anonymous areas and
/// its argument and environment strings. Returns how many pagemap entries changed. A dump
/// without them (no mm image, a kernel thread) is left as it is.
pub(crate) fn mark(images: &Path) -> io::Result<usize> {
    let mut changed = 0;
    for entry in std::fs::read_dir(images)? {
        let name = entry?.file_name();
        let Some(id) = name
            .to_str()
            .and_then(|n| n.strip_prefix("pagemap-")?.strip_suffix(".img"))
            .filter(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let mm = match std::fs::read(images.join(format!("mm-{id}.img"))) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        let ranges = eager_ranges(&mm)?;
        let path = images.join(&name);
        let mut map = Pagemap::parse(&std::fs::read(&path)?)?;
        let (entries, n) = eager_in(&map.entries, &ranges);
        if n == 0 {
            continue;
        }
        map.entries = entries;
        let tmp = images.join(format!(".{id}.pagemap.tmp"));
        std::fs::write(&tmp, map.encode())?;
        std::fs::rename(&tmp, &path)?;
        changed += n;
    }
    Ok(changed)
}

/// The page ranges [start, end) of a process to restore eagerly, from its mm image: its small
/// private anonymous areas, then its argument and environment strings.
fn eager_ranges(mm: &[u8]) -> io::Result<Vec<(u64, u64)>> {
    if word(mm, 0)? != IMG_COMMON_MAGIC || word(mm, 4)? != MM_MAGIC {
        return Err(bad("not a CRIU mm image"));
    }
    let len = word(mm, 8)? as usize;
    let msg = mm
        .get(12..12 + len)
        .ok_or_else(|| bad("truncated mm entry"))?;
    let mut strings = [0u64; 4];
    let mut ranges = Vec::new();
    let mut small_total = 0;
    each_field(msg, "mm entry", |field, value| {
        match (field, value) {
            (8..=11, Value::Int(v)) => strings[field as usize - 8] = v,
            (14, Value::Bytes(vma)) => {
                let (mut start, mut end, mut flags) = (0, 0, 0);
                each_field(vma, "vma entry", |field, value| {
                    match (field, value) {
                        (1, Value::Int(v)) => start = v,
                        (2, Value::Int(v)) => end = v,
                        (6, Value::Int(v)) => flags = v,
                        _ => {}
                    }
                    Ok(())
                })?;
                let size = end.saturating_sub(start);
                let private_anon =
                    flags & (MAP_PRIVATE | MAP_ANONYMOUS) == MAP_PRIVATE | MAP_ANONYMOUS;
                if private_anon
                    && size > 0
                    && size <= SMALL_AREA
                    && small_total + size <= SMALL_TOTAL
                {
                    small_total += size;
                    ranges.push((start, end));
                }
            }
            _ => {}
        }
        Ok(())
    })?;
    ranges.extend(strings_range(strings));
    Ok(ranges)
}

/// A protobuf field's value, as far as the mm image needs it.
enum Value<'a> {
    Int(u64),
    Bytes(&'a [u8]),
    Other,
}

/// Calls `f` with each field of the protobuf message `msg` (`what` names it in errors).
fn each_field<'a>(
    msg: &'a [u8],
    what: &str,
    mut f: impl FnMut(u64, Value<'a>) -> io::Result<()>,
) -> io::Result<()> {
    let mut at = 0;
    while at < msg.len() {
        let key = varint(msg, &mut at)?;
        let value = match key & 7 {
            0 => Value::Int(varint(msg, &mut at)?),
            1 => {
                at += 8;
                Value::Other
            }
            2 => {
                let len = varint(msg, &mut at)? as usize;
                let bytes = at
                    .checked_add(len)
                    .and_then(|end| msg.get(at..end))
                    .ok_or_else(|| bad(format!("{what}: a field runs past its end")))?;
                at += len;
                Value::Bytes(bytes)
            }
            5 => {
                at += 4;
                Value::Other
            }
            w => return Err(bad(format!("{what}: wire type {w}"))),
        };
        if at > msg.len() {
            return Err(bad(format!("{what}: a field runs past its end")));
        }
        f(key >> 3, value)?;
    }
    Ok(())
}

/// The pages [start, end) holding a process's argument and environment strings, from its
/// `mm_arg_start`, `mm_arg_end`, `mm_env_start`, `mm_env_end`; None where it names none.
fn strings_range([arg_start, arg_end, env_start, env_end]: [u64; 4]) -> Option<(u64, u64)> {
    let start = arg_start.min(env_start) & !(PAGE - 1);
    let end = arg_end.max(env_end).div_ceil(PAGE) * PAGE;
    if arg_start == 0 || end <= start || end - start > MOST {
        return None;
    }
    Some((start, end))
}

/// `entries` with the lazy present pages inside any of `ranges` split off and made eager; the
/// pages stay in the same order, so the pages image still matches. Also how many entries
/// changed. One pass over the entries (a process may have thousands of small areas).
fn eager_in(entries: &[Entry], ranges: &[(u64, u64)]) -> (Vec<Entry>, usize) {
    let ranges = coalesce(ranges);
    let mut out = Vec::with_capacity(entries.len() + 2);
    let mut changed = 0;
    for e in entries {
        let e_end = e.vaddr + e.nr_pages * PAGE;
        let lazy_present = e.flags & (PE_LAZY | PE_PRESENT) == PE_LAZY | PE_PRESENT;
        let first = ranges.partition_point(|r| r.1 <= e.vaddr);
        if !lazy_present || ranges.get(first).is_none_or(|r| r.0 >= e_end) {
            out.push(*e);
            continue;
        }
        changed += 1;
        let part = |a: u64, b: u64, flags: u32| Entry {
            vaddr: a,
            nr_pages: (b - a) / PAGE,
            flags,
        };
        let mut at = e.vaddr;
        for &(start, end) in ranges[first..].iter().take_while(|r| r.0 < e_end) {
            let (from, to) = (start.max(at), end.min(e_end));
            if at < from {
                out.push(part(at, from, e.flags));
            }
            out.push(part(from, to, e.flags & !PE_LAZY));
            at = to;
        }
        if at < e_end {
            out.push(part(at, e_end, e.flags));
        }
    }
    (out, changed)
}

/// `ranges` sorted, with the empty ones dropped and the overlapping or touching ones joined.
fn coalesce(ranges: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut sorted: Vec<_> = ranges.iter().copied().filter(|(a, b)| a < b).collect();
    sorted.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(sorted.len());
    for (a, b) in sorted {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pagemap::PE_PARENT;

    fn e(vaddr: u64, nr_pages: u64, flags: u32) -> Entry {
        Entry {
            vaddr,
            nr_pages,
            flags,
        }
    }

    fn put_varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    /// A varint field's key (wire type 0).
    fn key(field: u64) -> u64 {
        field << 3
    }

    /// A vma_entry message: start, end, pgoff, shmid, prot, flags, status, fd.
    fn vma(start: u64, end: u64, flags: u64) -> Vec<u8> {
        let mut msg = Vec::new();
        for (field, v) in [
            (1, start),
            (2, end),
            (3, 0),
            (4, 0),
            (5, 3),
            (6, flags),
            (7, 0x201),
        ] {
            put_varint(&mut msg, key(field));
            put_varint(&mut msg, v);
        }
        msg.extend([8 << 3, 2]); // fd -1, zigzag (sint64)
        msg
    }

    /// An mm image as CRIU writes one: fields 1-11, a repeated auxv, its vmas.
    fn mm_image(arg: (u64, u64), env: (u64, u64)) -> Vec<u8> {
        mm_image_with(arg, env, &[])
    }

    fn mm_image_with(arg: (u64, u64), env: (u64, u64), vmas: &[(u64, u64, u64)]) -> Vec<u8> {
        let mut msg = Vec::new();
        let values = [
            0x400000, 0x500000, 0x600000, 0x700000, 0x7ffd0000, 0x800000, 0x900000,
        ];
        for (i, v) in values
            .into_iter()
            .chain([arg.0, arg.1, env.0, env.1])
            .enumerate()
        {
            put_varint(&mut msg, key(i as u64 + 1));
            put_varint(&mut msg, v);
        }
        put_varint(&mut msg, key(12));
        put_varint(&mut msg, 7);
        for a in [33u64, 0x7ffd1000] {
            put_varint(&mut msg, key(13));
            put_varint(&mut msg, a);
        }
        for &(start, end, flags) in vmas {
            let v = vma(start, end, flags);
            put_varint(&mut msg, (14 << 3) | 2);
            put_varint(&mut msg, v.len() as u64);
            msg.extend(v);
        }
        let mut img = Vec::new();
        img.extend(IMG_COMMON_MAGIC.to_ne_bytes());
        img.extend(MM_MAGIC.to_ne_bytes());
        img.extend((msg.len() as u32).to_ne_bytes());
        img.extend(msg);
        img
    }

    #[test]
    fn the_strings_range_covers_args_and_env_in_whole_pages() {
        let mm = mm_image((0x7ffd_e123, 0x7ffd_e200), (0x7ffd_e200, 0x7ffd_f010));
        assert_eq!(eager_ranges(&mm).unwrap(), [(0x7ffd_e000, 0x7ffe_0000)]);
        let none = mm_image((0, 0), (0, 0));
        assert_eq!(eager_ranges(&none).unwrap(), [], "a kernel thread");
        let huge = mm_image((0x1000, 0x2000), (0x2000, 0x1000 + MOST + PAGE));
        assert_eq!(eager_ranges(&huge).unwrap(), [], "not trusted");
        let mut truncated = mm.clone();
        truncated.truncate(mm.len() - 2);
        assert!(eager_ranges(&truncated).is_err());
        assert!(eager_ranges(&mm[4..]).is_err(), "no magic");
    }

    #[test]
    fn several_ranges_in_one_entry_split_it_once_each() {
        let lazy = PE_PRESENT | PE_LAZY;
        let entries = [e(0x10000, 16, lazy), e(0x30000, 2, lazy)];
        // Unsorted, one inside another, two touching, one empty, one beyond every entry.
        let ranges = [
            (0x1c000, 0x1e000),
            (0x12000, 0x14000),
            (0x12000, 0x13000),
            (0x16000, 0x18000),
            (0x18000, 0x19000),
            (0x30000, 0x30000),
            (0x40000, 0x41000),
        ];
        let (out, changed) = eager_in(&entries, &ranges);
        assert_eq!(changed, 1);
        assert_eq!(
            out,
            [
                e(0x10000, 2, lazy),
                e(0x12000, 2, PE_PRESENT),
                e(0x14000, 2, lazy),
                e(0x16000, 3, PE_PRESENT),
                e(0x19000, 3, lazy),
                e(0x1c000, 2, PE_PRESENT),
                e(0x1e000, 2, lazy),
                e(0x30000, 2, lazy),
            ]
        );
    }

    #[test]
    fn small_private_anonymous_areas_are_eager_up_to_a_total() {
        const ANON: u64 = MAP_PRIVATE | MAP_ANONYMOUS;
        const MIB: u64 = 1 << 20;
        let vmas = [
            (0x40_0000, 0x41_f000, MAP_PRIVATE), // the binary's text: a file's
            (0x1115_a000, 0x1136_6000, ANON),    // the heap
            (0x7000_0000, 0x7000_0000 + 256 * MIB, ANON), // a large heap: lazy
            (0x8000_0000, 0x8000_0000 + SMALL_AREA, ANON), // as large as a small one gets
            (0x9000_0000, 0x9000_1000, 0x01 | MAP_ANONYMOUS), // shared: not in the pagemap
            (0xa000_0000, 0xa000_0000 + 15 * MIB, ANON),
            (0xb000_0000, 0xb000_0000 + 15 * MIB, ANON),
            (0xc000_0000, 0xc000_0000 + 15 * MIB, ANON), // 63 MiB so far
            (0xc800_0000, 0xc800_0000 + 15 * MIB, ANON), // past the total
            (0xd000_0000, 0xd000_1000, ANON),            // still fits
        ];
        let mm = mm_image_with(
            (0x7ffd_e000, 0x7ffd_e100),
            (0x7ffd_e100, 0x7ffd_e200),
            &vmas,
        );
        assert_eq!(
            eager_ranges(&mm).unwrap(),
            [
                (0x1115_a000, 0x1136_6000),
                (0x8000_0000, 0x8000_0000 + SMALL_AREA),
                (0xa000_0000, 0xa000_0000 + 15 * MIB),
                (0xb000_0000, 0xb000_0000 + 15 * MIB),
                (0xc000_0000, 0xc000_0000 + 15 * MIB),
                (0xd000_0000, 0xd000_1000),
                (0x7ffd_e000, 0x7ffd_f000),
            ]
        );
        let mut bad_vma = mm_image_with((0, 0), (0, 0), &[]);
        // A vma whose length runs past the message.
        bad_vma.extend([(14 << 3) | 2, 100, 8]);
        let len = (bad_vma.len() - 12) as u32;
        bad_vma[8..12].copy_from_slice(&len.to_ne_bytes());
        assert!(eager_ranges(&bad_vma).is_err());
    }

    #[test]
    fn lazy_present_pages_in_the_range_become_eager_and_keep_their_order() {
        let lazy = PE_PRESENT | PE_LAZY;
        let entries = [
            e(0x10000, 4, lazy),                // before the range
            e(0x20000, 8, lazy),                // straddles its start
            e(0x28000, 2, PE_PRESENT),          // eager already
            e(0x2a000, 2, PE_PARENT | PE_LAZY), // in the parent: its own images decide
            e(0x2c000, 8, lazy),                // straddles its end
            e(0x40000, 1, lazy),                // after
        ];
        let (out, changed) = eager_in(&entries, &[(0x24000, 0x2e000)]);
        assert_eq!(changed, 2);
        assert_eq!(
            out,
            [
                e(0x10000, 4, lazy),
                e(0x20000, 4, lazy),
                e(0x24000, 4, PE_PRESENT),
                e(0x28000, 2, PE_PRESENT),
                e(0x2a000, 2, PE_PARENT | PE_LAZY),
                e(0x2c000, 2, PE_PRESENT),
                e(0x2e000, 6, lazy),
                e(0x40000, 1, lazy),
            ]
        );
        let pages = |es: &[Entry]| -> u64 {
            es.iter()
                .filter(|e| e.flags & PE_PRESENT != 0)
                .map(|e| e.nr_pages)
                .sum()
        };
        assert_eq!(
            pages(&out),
            pages(&entries),
            "the pages image still matches"
        );
        let (same, none) = eager_in(&entries, &[(0x50000, 0x51000)]);
        assert_eq!((same.as_slice(), none), (&entries[..], 0));
    }
}
