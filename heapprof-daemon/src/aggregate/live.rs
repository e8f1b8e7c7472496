//! The live-block table as the daemon sees it: both of its arrays mapped while the
//! daemon drops the blocks of processes and images that are gone (see
//! `heapprof_common::live`), without a system call per block.

use std::sync::atomic::Ordering;

use anyhow::Result;
use aya::Ebpf;
use heapprof_common::{
    live::{BUCKET_SLOTS, LiveBucket, LiveEntry, TAG_BUSY},
    names,
};

use crate::bpf_array::ArrayHandle;

/// The live-block table.
pub(crate) struct LiveTable {
    tags: ArrayHandle<LiveBucket>,
    entries: ArrayHandle<LiveEntry>,
}

impl LiveTable {
    /// The table's arrays of a loaded object.
    pub(crate) fn of(ebpf: &Ebpf) -> Result<Self> {
        Ok(Self {
            tags: ArrayHandle::of(ebpf, names::LIVE)?,
            entries: ArrayHandle::of(ebpf, names::LIVE_ENTRIES)?,
        })
    }

    /// Removes the blocks `pick` picks; returns how many. A slot is released with the
    /// same atomic swap the programs use, so a block freed meanwhile is not counted.
    pub(crate) fn remove_where(&self, pick: impl Fn(&LiveEntry) -> bool) -> Result<usize> {
        let (tags, entries) = (self.tags.map()?, self.entries.map()?);
        let mut removed = 0;
        for bucket in 0..tags.len() {
            for index in 0..BUCKET_SLOTS {
                let Some(tag_word) = tags.word(bucket, index * 8) else {
                    continue;
                };
                let tag = tag_word.load(Ordering::Acquire);
                if tag == 0 || tag == TAG_BUSY {
                    continue;
                }
                let Some(entry) = entries.read(bucket * BUCKET_SLOTS + index) else {
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
