//! The live-block table (`heapprof_common::live`): blocks by process and address, in
//! one array changed with atomic instructions only, so that an allocation's insert
//! and a free's removal cost no kernel function call, and mostly touch one cache line
//! of one bucket near the ones the program's last calls touched.
//!
//! A slot is claimed by swapping its tag from 0 to `TAG_BUSY`, filled, then published
//! by storing the block's tag; it is released by swapping the tag back to 0. Two
//! programs working on the same block at once (a free applied from a preload queue
//! while another thread's allocation takes the address) can miss each other, as they
//! could with a hash map; the table itself stays consistent.
//!
//! A block's home usually holds it alone (its 32-byte span of address space holds
//! one block at a time), so the usual insert finds the home empty and takes its
//! first slot, and the usual removal finds the block there: neither scans the nine
//! tags (61 ns less per return and about 40 per free, on the C++ STL bench).
//!
//! The operations are global functions: the verifier checks each once, on its own,
//! instead of once per path of every program that reaches it (the slot loops,
//! inlined, took the entry program past the verifier's instruction limit).

use heapprof_common::live::{
    self, BUCKET_SLOTS, LiveBucket, LiveEntry, OVERFLOWED, SPILLED, TAG_BUSY,
};

use crate::{
    atomic::{compare_exchange_32, exchange_32, fetch_or_32},
    maps::{LIVE, live_buckets},
};

/// What an insert did.
pub enum Inserted {
    /// The block took a free slot.
    New,
    /// The address was still recorded for the process (its free went unseen, or waits
    /// in a preload queue): that entry, now replaced by the new block.
    Replaced(LiveEntry),
    /// The block's three buckets are full.
    Full,
}

/// Copies a live entry field by field, as another CPU may change the source: a struct
/// copy becomes a call of a byte-at-a-time `memmove` on the BPF target.
///
/// # Safety
/// Both point to live entries (map values or the stack).
#[inline(always)]
unsafe fn copy_entry(dst: *mut LiveEntry, src: *const LiveEntry) {
    // SAFETY: both point to live entries, as the caller promises; each field is read
    // once and written once.
    unsafe {
        (*dst).ptr = core::ptr::read_volatile(&raw const (*src).ptr);
        (*dst).size = core::ptr::read_volatile(&raw const (*src).size);
        (*dst).tgid = core::ptr::read_volatile(&raw const (*src).tgid);
        (*dst).site = core::ptr::read_volatile(&raw const (*src).site);
    }
}

/// [`heapprof_live_insert`]'s results.
const INSERTED_NEW: i64 = 0;
const INSERTED_REPLACED: i64 = 1;
const INSERTED_FULL: i64 = 2;

/// No slot found (above every slot index).
const NO_SLOT: usize = 16;

const _: () = assert!(BUCKET_SLOTS < NO_SLOT);

/// 1 if `x` is not 0, else 0, without a branch. In assembly: the compiler would turn
/// the arithmetic back into a comparison, which the BPF target makes a branch.
#[inline(always)]
fn nonzero(x: u64) -> u64 {
    let result: u64;
    // SAFETY: arithmetic on registers.
    unsafe {
        core::arch::asm!(
            "{r} = {x}",
            "{r} = -{r}",
            "{r} |= {x}",
            "{r} >>= 63",
            x = in(reg) x,
            r = out(reg) result,
            options(pure, nomem, nostack),
        );
    }
    result
}

/// The index of the lowest set bit of `mask` (below `2^16`), or [`NO_SLOT`] for 0,
/// without a branch.
#[inline(always)]
fn lowest_slot(mask: u64) -> usize {
    let bit = mask.isolate_lowest_one();
    let index = nonzero(bit & 0xaaaa)
        | nonzero(bit & 0xcccc) << 1
        | nonzero(bit & 0xf0f0) << 2
        | nonzero(bit & 0xff00) << 3;
    (index | (1 - nonzero(mask)) << 4) as usize
}

/// What a scan of one bucket found, as masks of slots: those with the tag, the free
/// ones. Computed without branches: a branch per slot, on constants the verifier
/// tracks, took it past its instruction limit.
struct Scan {
    tagged: u64,
    free: u64,
}

/// Scans `bucket`'s tags for `tag`.
///
/// # Safety
/// `bucket` is a live map value.
#[inline(always)]
unsafe fn scan(bucket: *mut LiveBucket, tag: u32) -> Scan {
    let mut scan = Scan { tagged: 0, free: 0 };
    for index in 0..BUCKET_SLOTS {
        // SAFETY: as the caller promises; other CPUs change tags atomically.
        let value =
            u64::from(unsafe { core::ptr::read_volatile(&raw const (*bucket).tags[index]) });
        scan.tagged |= (1 - nonzero(value ^ u64::from(tag))) << index;
        scan.free |= (1 - nonzero(value)) << index;
    }
    scan
}

/// The slot of `bucket` among the `tagged` ones (a mask) that holds the block
/// `(ptr, tgid)`, if any. Two blocks of a bucket may share a tag: each tagged slot's
/// entry is checked, the lowest first (almost always the only one).
///
/// # Safety
/// `bucket` is a live map value.
#[inline(always)]
unsafe fn find(bucket: *mut LiveBucket, mut tagged: u64, ptr: u64, tgid: u32) -> Option<usize> {
    for _ in 0..BUCKET_SLOTS {
        let index = lowest_slot(tagged);
        if index >= BUCKET_SLOTS {
            return None;
        }
        // SAFETY: as the caller promises; a published slot's fields are set.
        let entry = unsafe { &raw const (*bucket).entries[index] };
        // SAFETY: as above.
        if unsafe { (*entry).ptr == ptr && (*entry).tgid == tgid } {
            return Some(index);
        }
        tagged &= tagged - 1;
    }
    None
}

/// Claims slot `index` of `bucket` for `block` and publishes it with `tag`, if the
/// slot is still free; returns whether it got it.
///
/// # Safety
/// `bucket` is a live map value; `index` is below [`BUCKET_SLOTS`].
#[inline(always)]
unsafe fn claim_slot(bucket: *mut LiveBucket, index: usize, tag: u32, block: &LiveEntry) -> bool {
    // SAFETY: `bucket` is a live map value, as the caller promises; only a place is
    // computed.
    let slot_tag = unsafe { &raw mut (*bucket).tags[index] };
    // SAFETY: a tag of that map value, aligned; a tag is only changed atomically, and
    // a claimed slot is this program's until published.
    if unsafe { compare_exchange_32(slot_tag, 0, TAG_BUSY) } != 0 {
        return false; // taken meanwhile
    }
    // SAFETY: the slot claimed above; then published.
    unsafe {
        copy_entry(&raw mut (*bucket).entries[index], block);
        exchange_32(slot_tag, tag);
    }
    true
}

/// Claims one of the `free` slots (a mask) of `bucket` for `block` and publishes it
/// with `tag`; returns whether it got one.
///
/// # Safety
/// `bucket` is a live map value.
#[inline(always)]
unsafe fn claim(bucket: *mut LiveBucket, mut free: u64, tag: u32, block: &LiveEntry) -> bool {
    for _ in 0..BUCKET_SLOTS {
        let index = lowest_slot(free);
        if index >= BUCKET_SLOTS {
            return false;
        }
        free &= free - 1;
        // SAFETY: as the caller promises; `index` is a slot's.
        if unsafe { claim_slot(bucket, index, tag, block) } {
            return true;
        }
    }
    false
}

/// Copies the published block in slot `index` of `bucket` (with `tag`) to `found`,
/// then releases the slot; returns whether this program released it (a failed swap
/// means another program released it first).
///
/// # Safety
/// `bucket` is a live map value; `index` is below [`BUCKET_SLOTS`].
#[inline(always)]
unsafe fn release_slot(
    bucket: *mut LiveBucket,
    index: usize,
    tag: u32,
    found: *mut LiveEntry,
) -> bool {
    // SAFETY: as the caller promises; a published slot is copied out, then released.
    unsafe {
        copy_entry(found, &raw const (*bucket).entries[index]);
        compare_exchange_32(&raw mut (*bucket).tags[index], tag, 0) == tag
    }
}

/// Whether `bucket` is empty and unflagged: no block is in it, and none whose home it
/// is went to another bucket. Nine loads and their OR: the usual home (a block's
/// 32-byte span of address space, empty since the last block there was freed) needs
/// no scan.
///
/// # Safety
/// `bucket` is a live map value.
#[inline(always)]
unsafe fn untouched(bucket: *mut LiveBucket) -> bool {
    // SAFETY: as the caller promises; other CPUs change tags and flags atomically.
    let mut any = unsafe { core::ptr::read_volatile(&raw const (*bucket).flags) };
    for index in 0..BUCKET_SLOTS {
        // SAFETY: as above.
        any |= unsafe { core::ptr::read_volatile(&raw const (*bucket).tags[index]) };
    }
    any == 0
}

/// Whether `bucket`'s first slot holds the block `(ptr, tgid)` with `tag` (where a
/// bucket's only block is).
///
/// # Safety
/// `bucket` is a live map value.
#[inline(always)]
unsafe fn first_holds(bucket: *mut LiveBucket, tag: u32, ptr: u64, tgid: u32) -> bool {
    // SAFETY: as the caller promises; a published slot's fields are set.
    unsafe {
        core::ptr::read_volatile(&raw const (*bucket).tags[0]) == tag
            && (*bucket).entries[0].ptr == ptr
            && (*bucket).entries[0].tgid == tgid
    }
}

/// Whether `bucket` has `flag` set: [`OVERFLOWED`] on a home (its blocks may be in
/// their second bucket), [`SPILLED`] on a second bucket (blocks whose second bucket
/// it is may be in their third).
///
/// # Safety
/// `bucket` is a live map value.
#[inline(always)]
unsafe fn flagged(bucket: *mut LiveBucket, flag: u32) -> bool {
    // SAFETY: as the caller promises.
    unsafe { core::ptr::read_volatile(&raw const (*bucket).flags) & flag != 0 }
}

/// The entry of the block `(ptr, tgid)` with `tag` in bucket `index`, if there.
#[inline(always)]
fn find_in(index: u32, tag: u32, ptr: u64, tgid: u32) -> Option<*mut LiveEntry> {
    let bucket = LIVE.get_ptr_mut(index)?;
    // SAFETY: the bucket's own map value.
    unsafe {
        let slot = find(bucket, scan(bucket, tag).tagged, ptr, tgid)?;
        Some(&raw mut (*bucket).entries[slot])
    }
}

/// Claims a free slot of bucket `index` for `block`; returns whether it got one.
#[inline(always)]
fn claim_in(index: u32, tag: u32, block: &LiveEntry) -> bool {
    let Some(bucket) = LIVE.get_ptr_mut(index) else {
        return false;
    };
    // SAFETY: the bucket's own map value.
    unsafe { claim(bucket, scan(bucket, tag).free, tag, block) }
}

/// Sets `flag` on bucket `index` if it is not set yet.
#[inline(always)]
fn mark(index: u32, flag: u32) {
    if let Some(bucket) = LIVE.get_ptr_mut(index) {
        // SAFETY: the bucket's own map value; its flags are only changed atomically.
        unsafe {
            if !flagged(bucket, flag) {
                fetch_or_32(&raw mut (*bucket).flags, flag);
            }
        }
    }
}

/// Whether bucket `index` has `flag` set.
#[inline(always)]
fn bucket_flagged(index: u32, flag: u32) -> bool {
    // SAFETY: the bucket's own map value.
    LIVE.get_ptr_mut(index)
        .is_some_and(|bucket| unsafe { flagged(bucket, flag) })
}

/// Inserts `block` of process `tgid` (see [`insert`]); returns an `INSERTED_*`, with
/// the entry replaced in `found`. Its frame is kept small (the buckets away from
/// home are looked up again rather than kept): it is the third of a chain of calls
/// from the preload library's probe, whose frames together must fit in 512 bytes.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn heapprof_live_insert(
    tgid: u32,
    block: *const LiveEntry,
    found: *mut LiveEntry,
) -> i64 {
    if block.is_null() || found.is_null() {
        return INSERTED_FULL;
    }
    // SAFETY: the caller's own value.
    let block = unsafe { &*block };
    let ptr = block.ptr;
    let place = live::placement(ptr, tgid, live_buckets());
    let Some(home) = LIVE.get_ptr_mut(place.first) else {
        return INSERTED_FULL;
    };
    // An empty home without the overflow flag: the block is recorded nowhere, and
    // takes the first slot unless another program took it meanwhile.
    // SAFETY: the bucket's own map value.
    if unsafe { untouched(home) && claim_slot(home, 0, place.tag, block) } {
        return INSERTED_NEW;
    }
    // SAFETY: the bucket's own map value.
    let at_home = unsafe { scan(home, place.tag) };
    // SAFETY: as above.
    let mut existing = unsafe { find(home, at_home.tagged, ptr, tgid) }
        // SAFETY: as above; only a place is computed.
        .map(|slot| unsafe { &raw mut (*home).entries[slot] });
    // SAFETY: as above.
    let overflowed = unsafe { flagged(home, OVERFLOWED) };
    if existing.is_none() && overflowed {
        existing = find_in(place.second, place.tag, ptr, tgid);
        if existing.is_none() && bucket_flagged(place.second, SPILLED) {
            existing = find_in(place.third, place.tag, ptr, tgid);
        }
    }
    if let Some(entry) = existing {
        // SAFETY: a published slot; replaced in place under the same tag.
        unsafe {
            copy_entry(found, entry);
            copy_entry(entry, block);
        }
        return INSERTED_REPLACED;
    }
    // SAFETY: `home` is bucket `place.first`'s map value.
    if unsafe { claim(home, at_home.free, place.tag, block) } {
        return INSERTED_NEW;
    }
    // Home is full: the flag first, so that a lookup that misses the block at home
    // after it is published in the second bucket looks there.
    if !overflowed {
        mark(place.first, OVERFLOWED);
    }
    if claim_in(place.second, place.tag, block) {
        return INSERTED_NEW;
    }
    // The second is full too (a dense heap wrapped around the table): the same again
    // with the third.
    mark(place.second, SPILLED);
    if claim_in(place.third, place.tag, block) {
        INSERTED_NEW
    } else {
        INSERTED_FULL
    }
}

/// Removes the block at `ptr` of process `tgid` from `bucket` into `found`:
/// `Some(removed)` if the bucket held it.
///
/// # Safety
/// `bucket` is a live map value.
#[inline(always)]
unsafe fn remove_from(
    bucket: *mut LiveBucket,
    tag: u32,
    (ptr, tgid): (u64, u32),
    found: *mut LiveEntry,
) -> Option<bool> {
    // SAFETY: as the caller promises.
    let slot = unsafe { find(bucket, scan(bucket, tag).tagged, ptr, tgid) }?;
    // SAFETY: a published slot of that bucket.
    Some(unsafe { release_slot(bucket, slot, tag, found) })
}

/// Removes the block at `ptr` of process `tgid` into `found`; returns 1 if it was
/// recorded.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn heapprof_live_remove(ptr: u64, tgid: u32, found: *mut LiveEntry) -> i64 {
    if found.is_null() {
        return 0;
    }
    let place = live::placement(ptr, tgid, live_buckets());
    let Some(home) = LIVE.get_ptr_mut(place.first) else {
        return 0;
    };
    // The block alone at home, the usual case: no scan.
    // SAFETY: `home` is a live map value.
    if unsafe { first_holds(home, place.tag, ptr, tgid) } {
        // SAFETY: as above; its first slot holds the block.
        return i64::from(unsafe { release_slot(home, 0, place.tag, found) });
    }
    // SAFETY: `home` is a live map value.
    if let Some(removed) = unsafe { remove_from(home, place.tag, (ptr, tgid), found) } {
        return i64::from(removed);
    }
    // SAFETY: as above.
    if !unsafe { flagged(home, OVERFLOWED) } {
        return 0;
    }
    let Some(second) = LIVE.get_ptr_mut(place.second) else {
        return 0;
    };
    // SAFETY: `second` is a live map value.
    if let Some(removed) = unsafe { remove_from(second, place.tag, (ptr, tgid), found) } {
        return i64::from(removed);
    }
    // SAFETY: as above.
    if !unsafe { flagged(second, SPILLED) } {
        return 0;
    }
    let Some(third) = LIVE.get_ptr_mut(place.third) else {
        return 0;
    };
    // SAFETY: `third` is a live map value.
    unsafe { remove_from(third, place.tag, (ptr, tgid), found) }.map_or(0, i64::from)
}

/// Records `block`, a block of process `tgid`.
#[inline(always)]
pub fn insert(tgid: u32, block: &LiveEntry) -> Inserted {
    let mut found = core::mem::MaybeUninit::<LiveEntry>::uninit();
    match heapprof_live_insert(tgid, block, found.as_mut_ptr()) {
        INSERTED_NEW => Inserted::New,
        // SAFETY: set by the insert when it replaced an entry.
        INSERTED_REPLACED => Inserted::Replaced(unsafe { found.assume_init() }),
        _ => Inserted::Full,
    }
}

/// [`insert`] and [`remove`] for kernel mode, whose out-parameter is zeroed first:
/// some verifiers (Debian's 6.1, for fentry and kprobe programs) refuse a global
/// function's read of stack memory not written yet (`invalid indirect read from stack`).
pub mod zeroed {
    use super::{
        INSERTED_NEW, INSERTED_REPLACED, Inserted, LiveEntry, heapprof_live_insert,
        heapprof_live_remove,
    };

    /// Zeroes every field of `entry`: volatile, as the compiler drops the stores of
    /// fields the function overwrites before the program reads them.
    ///
    /// # Safety
    /// `entry` points to a local of the program.
    #[inline(always)]
    unsafe fn clear(entry: *mut LiveEntry) {
        // SAFETY: as the caller promises.
        unsafe {
            core::ptr::write_volatile(&raw mut (*entry).ptr, 0);
            core::ptr::write_volatile(&raw mut (*entry).size, 0);
            core::ptr::write_volatile(&raw mut (*entry).tgid, 0);
            core::ptr::write_volatile(&raw mut (*entry).site, 0);
        }
    }

    /// As [`super::insert`].
    #[inline(always)]
    pub fn insert(tgid: u32, block: &LiveEntry) -> Inserted {
        let mut found = core::mem::MaybeUninit::<LiveEntry>::uninit();
        // SAFETY: a local; every field is written.
        unsafe { clear(found.as_mut_ptr()) };
        match heapprof_live_insert(tgid, block, found.as_mut_ptr()) {
            INSERTED_NEW => Inserted::New,
            // SAFETY: written whole by `clear`, then by the insert.
            INSERTED_REPLACED => Inserted::Replaced(unsafe { found.assume_init() }),
            _ => Inserted::Full,
        }
    }

    /// As [`super::remove`].
    #[inline(always)]
    pub fn remove(tgid: u32, ptr: u64) -> Option<LiveEntry> {
        let mut found = core::mem::MaybeUninit::<LiveEntry>::uninit();
        // SAFETY: a local; every field is written.
        unsafe { clear(found.as_mut_ptr()) };
        // SAFETY: written whole by `clear`, then by the removal.
        (heapprof_live_remove(ptr, tgid, found.as_mut_ptr()) != 0)
            .then(|| unsafe { found.assume_init() })
    }
}

/// Removes the block at `ptr` of process `tgid`; returns it if it was recorded.
#[inline(always)]
pub fn remove(tgid: u32, ptr: u64) -> Option<LiveEntry> {
    let mut found = core::mem::MaybeUninit::<LiveEntry>::uninit();
    // SAFETY: set by the removal when it found the block.
    (heapprof_live_remove(ptr, tgid, found.as_mut_ptr()) != 0)
        .then(|| unsafe { found.assume_init() })
}
