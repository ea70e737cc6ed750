//! The pages of a dump that another process may read before a lazily restored branch has them:
//! each process's argument and environment strings.
//!
//! A branch restored with lazy pages gets a page when it touches it, or when the lazy-pages
//! daemon's background copy reaches it. Another process reading that memory (`ps` and `pgrep -f`
//! reading /proc/<pid>/cmdline, /proc/<pid>/environ) does not wait for the daemon: the kernel
//! fails a remote access to a page userfaultfd has not filled, and `ps` shows `[sleep]` for
//! `sleep 1000`, `pgrep -f` matches nothing. The strings sit at the top of the stack, which
//! the background copy reaches last. So the pagemap entries holding them are marked eager
//! (`PE_LAZY` cleared) right after the dump: CRIU's restore then writes those few pages itself,
//! as it does the page under each thread's stack pointer.
//!
//! Format: images/mm.proto (CRIU 4.1): after the words `IMG_COMMON_MAGIC` and `MM_MAGIC`, one
//! `mm_entry` prefixed by its length (u32, host order), whose fields 8-11 are `mm_arg_start`,
//! `mm_arg_end`, `mm_env_start`, `mm_env_end` (varints). Pagemaps: see `pagemap.rs`.

use std::io;
use std::path::Path;

use crate::pagemap::{
    bad, varint, word, Entry, Pagemap, IMG_COMMON_MAGIC, PAGE, PE_LAZY, PE_PRESENT,
};

const MM_MAGIC: u32 = 0x5749_2820;
/// Larger than any argument and environment area Linux accepts (a quarter of an 8 MiB stack
/// limit, by default): a range beyond it is not trusted.
const MOST: u64 = 64 << 20;

/// Marks the argument and environment pages of every process in the dump at `images` eager.
/// Returns how many pagemap entries changed. A dump without them (no mm image, a kernel
/// thread) is left as it is.
pub(crate) fn args_and_env(images: &Path) -> io::Result<usize> {
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
        let Some(range) = strings_range(&mm)? else {
            continue;
        };
        let path = images.join(&name);
        let mut map = Pagemap::parse(&std::fs::read(&path)?)?;
        let (entries, n) = eager_in(&map.entries, range);
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

/// The pages [start, end) holding a process's argument and environment strings, from its mm
/// image; None where it names none.
fn strings_range(mm: &[u8]) -> io::Result<Option<(u64, u64)>> {
    if word(mm, 0)? != IMG_COMMON_MAGIC || word(mm, 4)? != MM_MAGIC {
        return Err(bad("not a CRIU mm image"));
    }
    let len = word(mm, 8)? as usize;
    let msg = mm
        .get(12..12 + len)
        .ok_or_else(|| bad("truncated mm entry"))?;
    let mut fields = [0u64; 4];
    let mut at = 0;
    while at < msg.len() {
        let key = varint(msg, &mut at)?;
        match key & 7 {
            0 => {
                let v = varint(msg, &mut at)?;
                if let 8..=11 = key >> 3 {
                    fields[(key >> 3) as usize - 8] = v;
                }
            }
            1 => at += 8,
            2 => at += varint(msg, &mut at)? as usize,
            5 => at += 4,
            w => return Err(bad(format!("mm entry: wire type {w}"))),
        }
    }
    if at != msg.len() {
        return Err(bad("mm entry: a field runs past its end"));
    }
    let [arg_start, arg_end, env_start, env_end] = fields;
    let start = arg_start.min(env_start) & !(PAGE - 1);
    let end = arg_end.max(env_end).div_ceil(PAGE) * PAGE;
    if arg_start == 0 || end <= start || end - start > MOST {
        return Ok(None);
    }
    Ok(Some((start, end)))
}

/// `entries` with the lazy present pages inside `range` split off and made eager; the pages
/// stay in the same order, so the pages image still matches. Also how many entries changed.
fn eager_in(entries: &[Entry], (start, end): (u64, u64)) -> (Vec<Entry>, usize) {
    let mut out = Vec::with_capacity(entries.len() + 2);
    let mut changed = 0;
    for e in entries {
        let e_end = e.vaddr + e.nr_pages * PAGE;
        let lazy_present = e.flags & (PE_LAZY | PE_PRESENT) == PE_LAZY | PE_PRESENT;
        if !lazy_present || e_end <= start || e.vaddr >= end {
            out.push(*e);
            continue;
        }
        changed += 1;
        let (from, to) = (e.vaddr.max(start), e_end.min(end));
        let part = |a: u64, b: u64, flags: u32| Entry {
            vaddr: a,
            nr_pages: (b - a) / PAGE,
            flags,
        };
        if e.vaddr < from {
            out.push(part(e.vaddr, from, e.flags));
        }
        out.push(part(from, to, e.flags & !PE_LAZY));
        if to < e_end {
            out.push(part(to, e_end, e.flags));
        }
    }
    (out, changed)
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

    /// An mm image as CRIU writes one: fields 1-11, a repeated auxv, a vma message.
    fn mm_image(arg: (u64, u64), env: (u64, u64)) -> Vec<u8> {
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
        put_varint(&mut msg, (14 << 3) | 2);
        put_varint(&mut msg, 3);
        msg.extend([8, 1, 16]);
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
        assert_eq!(
            strings_range(&mm).unwrap(),
            Some((0x7ffd_e000, 0x7ffe_0000))
        );
        let none = mm_image((0, 0), (0, 0));
        assert_eq!(strings_range(&none).unwrap(), None, "a kernel thread");
        let huge = mm_image((0x1000, 0x2000), (0x2000, 0x1000 + MOST + PAGE));
        assert_eq!(strings_range(&huge).unwrap(), None, "not trusted");
        let mut truncated = mm.clone();
        truncated.truncate(mm.len() - 2);
        assert!(strings_range(&truncated).is_err());
        assert!(strings_range(&mm[4..]).is_err(), "no magic");
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
        let (out, changed) = eager_in(&entries, (0x24000, 0x2e000));
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
        let (same, none) = eager_in(&entries, (0x50000, 0x51000));
        assert_eq!((same.as_slice(), none), (&entries[..], 0));
    }
}
