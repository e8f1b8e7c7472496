//! Walks remembered per CPU, so that an allocation at a stack walked before costs one
//! copy of the stack and a hash of some of its words instead of a walk.
//!
//! A walk depends on nothing but the caller's registers (return address, stack
//! pointer, and the frame pointer if the walk used it), the unwind rules of the
//! addresses it visits (fixed while the process's mappings are: `WALK_EPOCH` counts
//! the daemon's mapping writes, and its site retirements, since a remembered walk
//! keeps its site's index) and the stack words it reads. The walk notes the places and
//! values of those words (`unwind::note_read`); while they are all unchanged, a new
//! walk would find the same frames, hence the same hash. Programs in loops allocate
//! from the same few spots with the same stacks, so most allocations of a deep stack
//! skip the walk's rule lookups and steps.
//!
//! Each set holds two walks: the one used last (checked first, the only one checked
//! when it holds) and the one before, which takes its place when it holds instead. So
//! a spot reached by two call paths at the same depth (a helper called from two
//! places) keeps a walk for each: the C++ STL benchmark misses 5% of its walks with
//! one walk per set, 0.1% with two.
//!
//! The checks and arithmetic (whether a walk starts where a new one would, where it is
//! kept, the hash of its words, where its sites are kept, which words it can check)
//! are `heapprof_common::walk_cache`'s, tested there.

use aya_ebpf::{helpers::bpf_probe_read_user_buf, macros::map, maps::PerCpuArray};
use heapprof_common::{
    SiteId, WalkOutcome,
    preload::{REPLY_READS, StackReply},
    walk_cache::{
        NO_SITE, SETS, SITE_WAYS, WalkOrigin, first_entry, mix, same_origin, site_tag, site_way,
        stack_place,
    },
};

use crate::maps::{
    REPLY_SCRATCH, STACK_WINDOW, STACK_WINDOW_BYTES, STACK_WINDOW_WORDS, walk_epoch,
};

/// One remembered walk.
#[repr(C)]
pub struct CachedWalk {
    /// The thread (0: the entry is empty).
    pid_tgid: u64,
    /// The caller's registers at the walk's start.
    pc: u64,
    sp: u64,
    fp: u64,
    /// The walk's stack hash.
    hash: u64,
    /// `maps::walk_epoch` when the walk was made.
    epoch: u64,
    /// A hash of the words' values, in order ([`mix`]): an entry is a fifth of its
    /// size with the values themselves; a changed word makes an equal hash as rarely as
    /// two stacks share a stack hash.
    values: u64,
    /// The process image the walk was made in.
    exec_gen: u32,
    /// Words read (at most `REPLY_READS`).
    reads: u32,
    /// Whether the walk used the caller's frame pointer register.
    uses_fp: u32,
    /// Bytes above `sp` that hold every word read.
    span: u32,
    /// Per size class modulo [`SITE_WAYS`]: the function and size class of the last
    /// allocation of that class counted with this walk ([`site_tag`]), or [`NO_SITE`].
    site_tags: [u32; SITE_WAYS],
    /// Those allocations' site indices.
    sites: [SiteId; SITE_WAYS],
    /// The words' places, in words above `sp`.
    places: [u16; REPLY_READS],
}

/// [`CachedWalk`] as words, to move it without a call of the BPF target's
/// byte-at-a-time `memmove`.
const WALK_WORDS: usize = size_of::<CachedWalk>() / 8;

const _: () = assert!(size_of::<CachedWalk>() % 8 == 0);

#[map(name = "WALK_CACHE")]
static WALK_CACHE: PerCpuArray<CachedWalk> = PerCpuArray::with_max_entries(SETS * 2, 0);

/// Per-CPU counts of the cache's outcomes, indexed by `WalkOutcome`.
#[map(name = "WALK_STATS")]
static WALK_STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(WalkOutcome::COUNT, 0);

/// Counts an outcome.
#[inline(always)]
fn count(outcome: WalkOutcome) {
    if let Some(slot) = WALK_STATS.get_ptr_mut(outcome as u32) {
        // SAFETY: this CPU's slot; programs on one CPU do not interleave.
        unsafe { *slot += 1 };
    }
}

/// A walk's start: the thread, its image and the caller's registers.
#[repr(C)]
pub struct WalkStart {
    /// The thread.
    pub pid_tgid: u64,
    /// The caller's return address, frame pointer and stack pointer.
    pub pc: u64,
    /// As above.
    pub fp: u64,
    /// As above.
    pub sp: u64,
    /// The process image.
    pub exec_gen: u32,
    /// The allocator function called (its `ProbeSlot`): with the walk and the size
    /// class, the site.
    pub slot: u32,
    /// The request's size class (`heapprof_common::size_class`).
    pub size_class: u32,
    /// The daemon's epochs (see `maps::walk_epoch`), read before the walk.
    pub epoch: u64,
}

/// A remembered walk that still holds: its hash, and its site if the last allocation
/// counted with it was by the same function.
#[repr(C)]
pub struct WalkHit {
    /// The stack's hash.
    pub hash: u64,
    /// The site's index, when `known`.
    pub site: SiteId,
    /// Nonzero when `site` is known.
    pub known: u32,
}

/// The first entry (the last used) of the set of a walk starting at `start`.
#[inline(always)]
fn set_of(start: &WalkStart) -> u32 {
    first_entry(start.pid_tgid, start.pc, start.sp)
}

/// The daemon's epochs, read before a walk starts: a walk made while mappings change
/// (or sites are retired) is remembered with the epochs before the change, so it is
/// not trusted after it.
#[inline(always)]
pub fn epoch_now() -> u64 {
    walk_epoch()
}

/// Whether `entry` is a walk from `start`'s registers, made with the same mappings.
#[inline(always)]
fn starts_at(entry: &CachedWalk, start: &WalkStart) -> bool {
    let remembered = WalkOrigin {
        pid_tgid: entry.pid_tgid,
        pc: entry.pc,
        sp: entry.sp,
        fp: entry.fp,
        exec_gen: entry.exec_gen,
        epoch: entry.epoch,
    };
    let now = WalkOrigin {
        pid_tgid: start.pid_tgid,
        pc: start.pc,
        sp: start.sp,
        fp: start.fp,
        exec_gen: start.exec_gen,
        epoch: start.epoch,
    };
    same_origin(&remembered, entry.uses_fp != 0, &now)
}

/// Copies the `span` bytes of the stack above `sp` into this CPU's window.
#[inline(always)]
fn copy_stack(sp: u64, span: u32) -> bool {
    let Some(window) = STACK_WINDOW.get_ptr_mut(0) else {
        return false;
    };
    // The length keeps its bounds in every copy the compiler makes (see
    // `unwind::copy_to_window`): ((span - 1) & 4095) + 1.
    let mut len = u64::from(span);
    if len == 0 || len > STACK_WINDOW_BYTES as u64 {
        return false;
    }
    // SAFETY: arithmetic on a register.
    unsafe {
        core::arch::asm!(
            "{len} += -1",
            "{len} &= 0xfff",
            "{len} += 1",
            len = inout(reg) len,
            options(nostack)
        );
    }
    // SAFETY: a prefix of this CPU's window, viewed as bytes; programs on one CPU do
    // not interleave.
    let bytes = unsafe {
        core::slice::from_raw_parts_mut((*window).words.as_mut_ptr().cast::<u8>(), len as usize)
    };
    // SAFETY: bpf_probe_read_user_buf checks the user address.
    unsafe { bpf_probe_read_user_buf(sp as *const u8, bytes) }.is_ok()
}

/// Whether entry `index` holds a walk from `start` whose words are unchanged (then
/// written to `hit`): a copy of the stack above the stack pointer as far as the walk
/// read (unless `*copied`, the bytes copied for the other entry, covers it) and a hash
/// of the words it read. A global function: the verifier checks its loop once, and
/// its code is there once for both entries.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn heapprof_walk_check(
    start: *const WalkStart,
    index: u32,
    copied: *mut u32,
    hit: *mut WalkHit,
) -> i64 {
    if start.is_null() || copied.is_null() || hit.is_null() {
        return 0;
    }
    // SAFETY: the caller's own values.
    let (start, copied) = unsafe { (&*start, &mut *copied) };
    let Some(entry) = WALK_CACHE.get(index) else {
        return 0;
    };
    if !starts_at(entry, start) {
        return 0;
    }
    if entry.span > *copied {
        if !copy_stack(start.sp, entry.span) {
            return 0;
        }
        *copied = entry.span;
    }
    let Some(window) = STACK_WINDOW.get(0) else {
        return 0;
    };
    let reads = (entry.reads as usize).min(REPLY_READS);
    let mut values = 0;
    #[expect(
        clippy::needless_range_loop,
        reason = "the iterator form adds a second exit test and a spill to this per-walk check; \
                  the index loop is the code the verifier has accepted"
    )]
    for read in 0..REPLY_READS {
        if read >= reads {
            break;
        }
        let place = entry.places[read] as usize & (STACK_WINDOW_WORDS - 1);
        values = mix(values, window.words[place]);
    }
    if values != entry.values {
        return 0;
    }
    // SAFETY: the caller's own value.
    unsafe {
        (*hit).hash = entry.hash;
        let way = site_way(start.size_class);
        (*hit).site = entry.sites[way];
        (*hit).known = u32::from(entry.site_tags[way] == site_tag(start.slot, start.size_class));
    }
    1
}

/// Swaps entries `set` and `set + 1`, word by word. A global function: its code is
/// there once.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn heapprof_walk_swap(set: u32) -> i64 {
    let (Some(first), Some(second)) = (
        WALK_CACHE.get_ptr_mut(set),
        WALK_CACHE.get_ptr_mut(set.wrapping_add(1)),
    ) else {
        return 0;
    };
    let (first, second) = (first.cast::<u64>(), second.cast::<u64>());
    for word in 0..WALK_WORDS {
        // SAFETY: this CPU's slots, distinct entries viewed as words; programs on one
        // CPU do not interleave.
        unsafe {
            let a = core::ptr::read_volatile(first.add(word));
            let b = core::ptr::read_volatile(second.add(word));
            core::ptr::write_volatile(first.add(word), b);
            core::ptr::write_volatile(second.add(word), a);
        }
    }
    1
}

/// The remembered walk from `start`, if one still holds. The set's last used walk
/// is checked first; when the other holds instead, the two change places.
#[inline(always)]
pub fn cached(start: &WalkStart) -> Option<WalkHit> {
    let mut hit = WalkHit {
        hash: 0,
        site: 0,
        known: 0,
    };
    let set = set_of(start);
    let mut copied = 0;
    if heapprof_walk_check(start, set, &mut copied, &mut hit) != 0 {
        count(WalkOutcome::Remembered);
        return Some(hit);
    }
    if heapprof_walk_check(start, set + 1, &mut copied, &mut hit) != 0 {
        heapprof_walk_swap(set);
        count(WalkOutcome::Remembered);
        return Some(hit);
    }
    None
}

/// Notes that an allocation by `start.slot`'s function with the walk from `start`,
/// now its set's first entry (a hit's, or [`remember`]'s), was counted at site
/// `site`, for the next one there.
#[inline(always)]
pub fn note_site(start: &WalkStart, site: SiteId) {
    let Some(entry) = WALK_CACHE.get_ptr_mut(set_of(start)) else {
        return;
    };
    // SAFETY: this CPU's slot; programs on one CPU do not interleave.
    let entry = unsafe { &mut *entry };
    if entry.pid_tgid == start.pid_tgid && entry.pc == start.pc && entry.sp == start.sp {
        let way = site_way(start.size_class);
        entry.site_tags[way] = site_tag(start.slot, start.size_class);
        entry.sites[way] = site;
    }
}

/// Remembers the walk just made from `start` with hash `hash`, from the places and
/// values it noted in this CPU's reply scratch, if its stack words all lie in one
/// window above the stack pointer: it becomes its set's first entry, the first its
/// second. A global function, as [`heapprof_walk_check`].
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn heapprof_walk_remember(start: *const WalkStart, hash: u64) -> i64 {
    if start.is_null() {
        return 0;
    }
    // SAFETY: the caller's own value.
    let start = unsafe { &*start };
    let set = set_of(start);
    let Some(scratch) = REPLY_SCRATCH.get(0) else {
        return 0;
    };
    let reply = &scratch.reply;
    if reply.status != StackReply::KNOWN || scratch.base != start.sp {
        return 0;
    }
    // The second entry, the one used longest ago, is replaced.
    heapprof_walk_swap(set);
    let Some(entry) = WALK_CACHE.get_ptr_mut(set) else {
        return 0;
    };
    // SAFETY: this CPU's slot; programs on one CPU do not interleave.
    let entry = unsafe { &mut *entry };
    let reads = (reply.reads as usize).min(REPLY_READS);
    let mut span = 0u32;
    let mut values = 0;
    // Emptied first: a walk that cannot be remembered leaves no stale one in its slot.
    entry.pid_tgid = 0;
    for index in 0..REPLY_READS {
        if index >= reads {
            break;
        }
        let offset = reply.offsets[index];
        let Some(place) = stack_place(offset, STACK_WINDOW_BYTES) else {
            return 0;
        };
        entry.places[index] = place;
        values = mix(values, scratch.values[index]);
        span = span.max(offset as u32 + 8);
    }
    entry.values = values;
    entry.pc = start.pc;
    entry.sp = start.sp;
    entry.fp = start.fp;
    entry.hash = hash;
    entry.epoch = start.epoch;
    entry.exec_gen = start.exec_gen;
    entry.reads = reads as u32;
    entry.uses_fp = reply.uses_fp;
    // A walk that read nothing (its first frame ended it) still copies a word.
    entry.span = span.max(8);
    entry.site_tags = [NO_SITE; SITE_WAYS];
    entry.pid_tgid = start.pid_tgid;
    1
}

/// Remembers the walk just made (see [`heapprof_walk_remember`]); returns whether it
/// could.
#[inline(always)]
pub fn remember(start: &WalkStart, hash: u64) -> bool {
    let remembered = heapprof_walk_remember(start, hash) != 0;
    count(if remembered {
        WalkOutcome::Walked
    } else {
        WalkOutcome::NotRememberable
    });
    remembered
}
