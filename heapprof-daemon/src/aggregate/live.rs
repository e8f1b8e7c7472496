//! The live-block table as the daemon sees it: its array mapped while the daemon
//! drops the blocks of processes and images that are gone (see
//! `heapprof_common::live`), without a system call per block.

use std::sync::atomic::Ordering;

use anyhow::Result;
use aya::Ebpf;
use heapprof_common::{
    live::{
        BUCKET_SLOTS, FIRST_ENTRY_OFFSET, FilterPair, LiveBucket, LiveEntry, TAG_BUSY,
        filter_place, filter_slot,
    },
    names,
};

use crate::bpf_array::ArrayHandle;

/// The live-block table.
pub(crate) struct LiveTable {
    buckets: ArrayHandle<LiveBucket>,
    /// Sampling's counts of the table's entries by span (`LIVE_FILTER`).
    filter: ArrayHandle<FilterPair>,
}

/// Where the tag of slot `index` lies in a bucket.
const fn tag_offset(index: usize) -> usize {
    core::mem::offset_of!(LiveBucket, tags) + index * size_of::<u32>()
}

/// Where the entry of slot `index` lies in a bucket.
const fn entry_offset(index: usize) -> usize {
    FIRST_ENTRY_OFFSET + index * size_of::<LiveEntry>()
}

impl LiveTable {
    /// The table of a loaded object.
    pub(crate) fn of(ebpf: &Ebpf) -> Result<Self> {
        Ok(Self {
            buckets: ArrayHandle::of(ebpf, names::LIVE)?,
            filter: ArrayHandle::of(ebpf, names::LIVE_FILTER)?,
        })
    }

    /// Removes the blocks `pick` picks; returns how many. A slot is released with the
    /// same atomic swap the programs use, so a block freed meanwhile is not counted.
    pub(crate) fn remove_where(&self, pick: impl Fn(&LiveEntry) -> bool) -> Result<usize> {
        let buckets = self.buckets.map()?;
        let filter = self.filter.map()?;
        let mut removed = 0;
        for bucket in 0..buckets.len() {
            for index in 0..BUCKET_SLOTS {
                let Some(tag_word) = buckets.word32(bucket, tag_offset(index)) else {
                    continue;
                };
                let tag = tag_word.load(Ordering::Acquire);
                if tag == 0 || tag == TAG_BUSY {
                    continue;
                }
                let Some(entry) = buckets.read_at::<LiveEntry>(bucket, entry_offset(index)) else {
                    continue;
                };
                if pick(&entry)
                    && tag_word
                        .compare_exchange(tag, 0, Ordering::AcqRel, Ordering::Relaxed)
                        .is_ok()
                {
                    removed += 1;
                    uncount(&filter, &entry);
                }
            }
        }
        Ok(removed)
    }
}

/// Takes a removed entry off its filter slot. Sampling counts every entry there
/// (exact mode none, whose slots stay 0): a slot left counting an entry that is gone
/// only costs its frees a lookup, but a process's blocks dropped at its exit would
/// leave their slots counting for good. Kernel mode's entries are counted at the
/// same place (`ptr` and `tgid` as stored: the address in `LIVE` and the space),
/// so this would uncount them right too; its session never drops entries.
fn uncount(filter: &crate::bpf_array::MappedArray<FilterPair>, entry: &LiveEntry) {
    let (index, counter) = filter_place(filter_slot(entry.ptr, entry.tgid));
    let offset = core::mem::offset_of!(FilterPair, counts) + counter * size_of::<u32>();
    if let Some(count) = filter.word32(index as usize, offset) {
        let _ = count.try_update(Ordering::AcqRel, Ordering::Relaxed, |n| n.checked_sub(1));
    }
}
