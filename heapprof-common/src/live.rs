//! The live-block table's layout: the blocks allocated while tracing and not yet
//! freed, each with its size and site, found again by process and address when it is
//! freed.
//!
//! A BPF hash map costs a bucket lock, a free-list pop or push and several kernel
//! function calls per insert and delete (about 250 ns each on the development
//! machine, a third of heapprofd's work per malloc/free pair). This table is a plain
//! BPF array instead, `LIVE`, which the programs index directly and change with
//! atomic instructions only. Each element is a [`LiveBucket`] of four cache lines:
//! a word of flags, [`BUCKET_SLOTS`] tags (a slot's tag is 0 when it is free,
//! [`TAG_BUSY`] while a program fills it, else the [`tag`] of the block in it) and
//! the slots' [`LiveEntry`]s. The first line holds the flags, every tag and the first
//! slot's entry, so an insert into or a removal from a bucket that holds one block
//! touches one line: on a heap larger than the caches each operation is a miss, and
//! a second line for the entry was a second miss (half of the table's time).
//!
//! A block goes to its **home** bucket, chosen by its address (each bucket covers 32
//! bytes of a process's address space, so blocks allocated one after the other share
//! buckets and cache lines, and a program's frees find their buckets in the cache),
//! or, when that is full, to a second bucket chosen by hash; the home bucket is then
//! marked [`OVERFLOWED`], and lookups of its blocks read the second bucket too (and,
//! where that one is full as well, a third bucket chosen by hash, the second marked
//! [`SPILLED`]). No tombstones are needed: a lookup reads its buckets whole. Tags are
//! 31 bits of the block's hash, so two blocks of a bucket may share one: a lookup
//! checks the entry of every slot with its tag. The daemon maps the array
//! (`BPF_F_MMAPABLE`) to read and clear the entries of exited processes with the same
//! atomic operations.

use crate::SiteId;

/// Slots per bucket: 9 tags and the flags take 40 bytes, the first entry the rest of
/// the first cache line, the other 8 entries the next three.
pub const BUCKET_SLOTS: usize = 9;

/// A bucket's flag: a block whose home it is went to its second bucket.
pub const OVERFLOWED: u32 = 1;

/// A bucket's flag: a block whose second bucket it is (its home full too) went to
/// its third bucket.
pub const SPILLED: u32 = 2;

/// Bytes of a process's address space a home span covers: one block of glibc's
/// smallest chunk (32 bytes), so neighbouring blocks go to neighbouring buckets. A
/// dense heap larger than the table's spans wraps around it, and a bucket takes the
/// blocks of several spans: the smaller the span, the closer each bucket's share to
/// the table's average. 128-byte spans (glibc's 48-byte chunks two or three to a
/// span) or 64-byte ones (one or two) filled both buckets of some blocks at the
/// tests' loads, and 128-byte ones those of thousands of blocks of a redis holding a
/// million keys (jemalloc's 32-byte blocks, four to a span, eight to a bucket).
pub const HOME_SPAN_SHIFT: u32 = 5;

/// The tag of a slot a program has claimed and is filling (even: no [`tag`] is).
pub const TAG_BUSY: u32 = 2;

/// The slots provisioned per block of capacity asked for, as a fraction
/// (`SLOTS_NUMERATOR / SLOTS_DENOMINATOR`): two-choice buckets start to overflow at
/// about 80% of their slots (with hashed homes; address homes are fuller where a
/// heap is dense, emptier elsewhere).
const SLOTS_NUMERATOR: u64 = 5;
const SLOTS_DENOMINATOR: u64 = 4;

/// Most buckets: the table stays below 4 GiB (its byte offsets fit in a `u32`).
pub const MAX_BUCKETS: u32 = u32::MAX / core::mem::size_of::<LiveBucket>() as u32;

/// A block allocated while tracing and not yet freed (a slot of a [`LiveBucket`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LiveEntry {
    /// The block's address in its process.
    pub ptr: u64,
    /// Size the user asked for, in bytes.
    pub size: u64,
    /// The process.
    pub tgid: u32,
    /// The site that allocated it; its counters are decremented on free.
    pub site: SiteId,
}

/// One bucket of `LIVE`: four cache lines, the first holding the flags, the tags and
/// the first slot's entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LiveBucket {
    /// [`OVERFLOWED`] and [`SPILLED`], once set never cleared.
    pub flags: u32,
    /// 0 (free), [`TAG_BUSY`], or a block's [`tag`].
    pub tags: [u32; BUCKET_SLOTS],
    /// The slots' blocks, valid while their tags are a block's.
    pub entries: [LiveEntry; BUCKET_SLOTS],
}

/// Where a bucket's first entry starts: within the first cache line.
pub const FIRST_ENTRY_OFFSET: usize = core::mem::offset_of!(LiveBucket, entries);

const _: () = assert!(core::mem::size_of::<LiveBucket>() == 256);
const _: () = assert!(FIRST_ENTRY_OFFSET + core::mem::size_of::<LiveEntry>() <= 64);

/// Where a block can be: its two buckets and its tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The home bucket, by address.
    pub first: u32,
    /// The second bucket, by hash (may equal the first).
    pub second: u32,
    /// The third bucket, by the hash's other half (used when both are full).
    pub third: u32,
    /// The block's tag: odd, so never 0 or [`TAG_BUSY`].
    pub tag: u32,
}

/// A 64-bit mix of a block's address and process (the finalizer of MurmurHash3).
#[inline(always)]
pub const fn hash(ptr: u64, tgid: u32) -> u64 {
    let mut h = ptr ^ (tgid as u64).rotate_right(24);
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// The tag of a block with hash `hash`: its own mix of all the hash's bits, as the
/// blocks that share a second or third bucket share the top bits of a half.
#[inline(always)]
pub const fn tag(hash: u64) -> u32 {
    (hash.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as u32 | 1
}

/// The buckets and tag of the block at `ptr` in process `tgid`, in a table of
/// `buckets` buckets (at least 1). The home is the block's 32-byte span of address
/// space, shifted per process; the second bucket comes from the hash by
/// multiplication, so any bucket count works.
#[inline(always)]
pub const fn placement(ptr: u64, tgid: u32, buckets: u32) -> Placement {
    let h = hash(ptr, tgid);
    let shift = (tgid as u64).wrapping_mul(0x9e37_79b9);
    let first = ((ptr >> HOME_SPAN_SHIFT).wrapping_add(shift)) % buckets as u64;
    let second = ((h >> 32) * buckets as u64) >> 32;
    // From the hash's other half: a dense heap fills runs of neighbouring buckets, so
    // the third is as independent of the second as the second is of the home.
    let third = ((h & 0xffff_ffff) * buckets as u64) >> 32;
    Placement {
        first: first as u32,
        second: second as u32,
        third: third as u32,
        tag: tag(h),
    }
}

/// Slots of the filter in front of the table when sampling (`LIVE_FILTER`, 256 KiB
/// of `u32` counters, two to a value of the array, [`FilterPair`]; [`filter_slot`]):
/// each counts the table's entries of the
/// blocks whose spans it covers. A sampled session records few blocks, so most frees
/// find their slot at 0 and skip the lookup of their home bucket, a cache miss on a
/// heap larger than the caches (the table takes 8 bytes per byte of heap it covers).
pub const FILTER_SLOTS: u32 = 1 << 16;

/// The values `LIVE_FILTER` is sized to: exact sessions (`sample_rate` 0) never
/// read or count it, so one value spares them its 256 KiB.
pub const fn filter_values(sample_rate: u64) -> u32 {
    if sample_rate == 0 {
        1
    } else {
        FILTER_SLOTS / 2
    }
}

/// A value of `LIVE_FILTER`: two slots' counters (an array's values are mapped 8
/// bytes apart, so a value of one `u32` would leave half the lines unused).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FilterPair {
    /// The counters of slots `2 * index` and `2 * index + 1`.
    pub counts: [u32; 2],
}

/// The value of `LIVE_FILTER` holding `slot`, and the slot's counter in it.
#[inline(always)]
pub const fn filter_place(slot: u32) -> (u32, usize) {
    (slot / 2, (slot % 2) as usize)
}

/// The slot of `LIVE_FILTER` that counts the block at `ptr` of process `tgid`: its
/// home span, shifted per process as its home is, so that the frees of neighbouring
/// blocks read neighbouring slots (16 spans a cache line).
#[inline(always)]
pub const fn filter_slot(ptr: u64, tgid: u32) -> u32 {
    let shift = (tgid as u64).wrapping_mul(0x9e37_79b9);
    ((ptr >> HOME_SPAN_SHIFT).wrapping_add(shift) & (FILTER_SLOTS as u64 - 1)) as u32
}

/// Buckets for a table meant to hold `blocks` blocks (at least one bucket).
pub const fn buckets_for(blocks: u32) -> u32 {
    let slots = (blocks as u64 * SLOTS_NUMERATOR).div_ceil(SLOTS_DENOMINATOR);
    let buckets = slots.div_ceil(BUCKET_SLOTS as u64);
    if buckets == 0 {
        1
    } else if buckets > MAX_BUCKETS as u64 {
        MAX_BUCKETS
    } else {
        buckets as u32
    }
}

/// Bytes of kernel memory a table of `buckets` buckets takes.
pub const fn table_bytes(buckets: u32) -> u64 {
    buckets as u64 * core::mem::size_of::<LiveBucket>() as u64
}

/// The live-block capacity heapprofd chooses when none is asked for, on a machine with
/// `mem_total` bytes of memory: the largest power of two of blocks whose table takes
/// at most 1/128 of the memory, from [`MIN_DEFAULT_BLOCKS`] to [`MAX_DEFAULT_BLOCKS`]
/// (about 36 bytes per block: 4M blocks, enough for a redis of a million keys, on a
/// machine of 24 GiB).
pub const fn default_capacity(mem_total: u64) -> u32 {
    let budget = mem_total / 128;
    let mut blocks = MIN_DEFAULT_BLOCKS;
    while blocks < MAX_DEFAULT_BLOCKS && table_bytes(buckets_for(blocks * 2)) <= budget {
        blocks *= 2;
    }
    blocks
}

/// The smallest default capacity (the fixed default of earlier versions).
pub const MIN_DEFAULT_BLOCKS: u32 = 1 << 20;

/// The largest default capacity: larger tables are asked for with the flag.
pub const MAX_DEFAULT_BLOCKS: u32 = 1 << 23;

#[cfg(test)]
mod tests {
    extern crate std;

    use std::vec;

    use super::*;

    /// Fills a table of `capacity` blocks with `heap`'s blocks (start, block size,
    /// count) by the programs' rules (home, then second, then third bucket); returns
    /// how many found their three buckets full.
    fn overflows(capacity: u32, heap: &[(u64, u64, u64)]) -> usize {
        let buckets = buckets_for(capacity);
        let mut used = vec![0u8; buckets as usize];
        let mut full = 0;
        for &(start, size, count) in heap {
            for i in 0..count {
                let p = placement(start + i * size, 4242, buckets);
                match [p.first, p.second, p.third]
                    .into_iter()
                    .find(|&b| usize::from(used[b as usize]) < BUCKET_SLOTS)
                {
                    Some(bucket) => used[bucket as usize] += 1,
                    None => full += 1,
                }
            }
        }
        full
    }

    #[test]
    fn a_dense_heap_larger_than_the_table_fits_at_the_default_load() {
        // redis with a million keys under jemalloc (measured): three blocks of 17 to
        // 31 bytes a key, packed 32 bytes apart, three million in a table of four
        // million; scaled down by 8 here.
        assert_eq!(overflows(1 << 19, &[(0x7f00_0000_0000, 32, 372_000)]), 0);
        // Mixed classes, each packed in its own region, at the same load: a few in a
        // hundred thousand find their three buckets full (counted, never silent).
        let mixed = [
            (0x7f00_0000_0000, 32, 250_000),
            (0x7f10_0000_0000, 16, 60_000),
            (0x7f20_0000_0000, 48, 60_000),
        ];
        assert!(
            overflows(1 << 19, &mixed) < 370,
            "{}",
            overflows(1 << 19, &mixed)
        );
    }

    #[test]
    fn the_default_capacity_follows_the_memory() {
        const GIB: u64 = 1 << 30;
        assert_eq!(default_capacity(0), MIN_DEFAULT_BLOCKS);
        assert_eq!(default_capacity(GIB), MIN_DEFAULT_BLOCKS);
        assert_eq!(default_capacity(8 * GIB), MIN_DEFAULT_BLOCKS);
        assert_eq!(default_capacity(16 * GIB), 2 << 20);
        assert_eq!(default_capacity(24 * GIB), 4 << 20);
        assert_eq!(default_capacity(1024 * GIB), MAX_DEFAULT_BLOCKS);
        // At most 1/128 of the memory above the minimum.
        let table = table_bytes(buckets_for(default_capacity(24 * GIB)));
        assert!(table <= 24 * GIB / 128, "{table}");
    }

    #[test]
    fn tags_are_never_free_or_busy() {
        for ptr in [0u64, 1, 2, 0x7fff_0000_1000, u64::MAX] {
            for tgid in [0u32, 1, 4_194_304] {
                let t = placement(ptr, tgid, 7).tag;
                assert_ne!(t, 0);
                assert_ne!(t, TAG_BUSY);
            }
        }
    }

    #[test]
    fn blocks_sharing_a_bucket_have_their_own_tags() {
        // The blocks whose second (or third) bucket is the same share the top bits of
        // that half of their hash; their tags must not. 200,000 blocks in 2,276
        // buckets, about 88 to each bucket of each kind: a 31-bit tag shared by two
        // of them is a one-in-a-hundred event.
        let buckets = buckets_for(1 << 14);
        let mut seen = std::collections::HashSet::new();
        let mut shared = 0;
        for i in 0..200_000u64 {
            let p = placement(0x5555_0000_0000 + i * 32, 77, buckets);
            for (kind, bucket) in [(0, p.first), (1, p.second), (2, p.third)] {
                if !seen.insert((kind, bucket, p.tag)) {
                    shared += 1;
                }
            }
        }
        assert!(shared <= 1, "{shared} tags shared within a bucket");
    }

    #[test]
    fn buckets_stay_in_range_for_any_count() {
        for buckets in [1u32, 2, 3, 7, 1000, 163_840, MAX_BUCKETS] {
            for i in 0..2000u64 {
                let p = placement(0x5555_0000_0000 + i * 16, (i % 5) as u32, buckets);
                assert!(
                    p.first < buckets && p.second < buckets && p.third < buckets,
                    "{p:?} of {buckets}"
                );
            }
        }
    }

    #[test]
    fn the_two_buckets_differ_for_most_blocks() {
        let same = (0..10_000u64)
            .filter(|i| {
                let p = placement(0x5555_0000_0000 + i * 16, 42, 1 << 16);
                p.first == p.second
            })
            .count();
        assert!(same < 10, "{same} blocks with one bucket");
    }

    #[test]
    fn neighbouring_blocks_go_to_neighbouring_homes() {
        let base = 0x5555_0000_0000u64;
        let homes: [u32; 8] =
            core::array::from_fn(|i| placement(base + i as u64 * 32, 7, 163_840).first);
        // One 32-byte block a home, the next in the next bucket.
        for (i, &home) in homes.iter().enumerate() {
            assert_eq!((homes[0] + i as u32) % 163_840, home, "{homes:?}");
        }
        // A 16-byte block shares its home with its neighbour.
        assert_eq!(placement(base + 16, 7, 163_840).first, homes[0]);
    }

    #[test]
    fn filter_slots_follow_the_homes() {
        let base = 0x5555_0000_0000u64;
        let first = filter_slot(base, 7);
        for i in 0..64u64 {
            // In range, one span a slot, the next span the next slot (wrapping).
            let slot = filter_slot(base + i * 32, 7);
            assert!(slot < FILTER_SLOTS);
            assert_eq!(slot, (first + i as u32) % FILTER_SLOTS);
            assert_eq!(filter_slot(base + i * 32 + 16, 7), slot);
        }
        // The same address in two processes counts in two slots.
        assert_ne!(filter_slot(base, 7), filter_slot(base, 8));
        assert!(filter_slot(u64::MAX, u32::MAX) < FILTER_SLOTS);
        assert_eq!(filter_place(FILTER_SLOTS - 1), (FILTER_SLOTS / 2 - 1, 1));
        assert_eq!(filter_place(6), (3, 0));
    }

    #[test]
    fn capacity_is_provisioned_with_room() {
        assert_eq!(buckets_for(0), 1);
        assert_eq!(buckets_for(16), 3);
        // 1,048,576 blocks: 1,310,720 slots in 145,636 buckets of 9, 256 bytes each.
        assert_eq!(buckets_for(1 << 20), 145_636);
        assert_eq!(table_bytes(145_636), 145_636 * 256);
        assert_eq!(buckets_for(u32::MAX), MAX_BUCKETS);
    }
}
