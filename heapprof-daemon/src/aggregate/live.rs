//! The live-block table as the daemon sees it: its array mapped while the daemon
//! drops the blocks of processes and images that are gone (see
//! `heapprof_common::live`), without a system call per block.

use std::sync::atomic::Ordering;

use anyhow::Result;
use aya::Ebpf;
use heapprof_common::{
    live::{BUCKET_SLOTS, FIRST_ENTRY_OFFSET, LiveBucket, LiveEntry, TAG_BUSY},
    names,
};

use crate::bpf_array::ArrayHandle;

/// The live-block table.
pub(crate) struct LiveTable {
    buckets: ArrayHandle<LiveBucket>,
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
        })
    }

    /// Removes the blocks `pick` picks; returns how many. A slot is released with the
    /// same atomic swap the programs use, so a block freed meanwhile is not counted.
    pub(crate) fn remove_where(&self, pick: impl Fn(&LiveEntry) -> bool) -> Result<usize> {
        let buckets = self.buckets.map()?;
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
                }
            }
        }
        Ok(removed)
    }
}
