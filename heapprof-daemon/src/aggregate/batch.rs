//! Reading whole BPF hash maps a batch of entries per system call.
//!
//! Walking a map key by key costs two system calls per entry (next key, then
//! lookup): 0.6 s for 131,072 per-CPU sites. `BPF_MAP_LOOKUP_BATCH` (Linux 5.6)
//! copies out thousands of entries per call. Where the kernel refuses it, the
//! caller walks the map as before.

use std::{
    io,
    marker::PhantomData,
    mem::{align_of, size_of},
    os::fd::{AsFd, AsRawFd as _, BorrowedFd},
};

use aya::Pod;

/// `BPF_MAP_LOOKUP_BATCH` in `enum bpf_cmd` (include/uapi/linux/bpf.h).
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Bytes of values asked for per call, which bounds the buffers (a machine with
/// many CPUs gets fewer per-CPU entries per call).
const BATCH_BYTES: usize = 1 << 20;

/// Entries asked for per call, at least and at most. A hash map's batch ends at a
/// bucket boundary, and a bucket never holds the smaller figure.
const BATCH_ENTRIES: std::ops::RangeInclusive<usize> = 64..=4096;

/// Entries asked for at most when a bucket did not fit a batch.
const MAX_GROWN_ENTRIES: usize = 1 << 16;

/// Calls `each(keys, values)` for every batch of entries of the hash map `map`.
/// `values` holds one value per key, or for a per-CPU map (`per_cpu`: `Some(possible
/// CPUs)`) one per possible CPU, key after key. Returns `Ok(false)`, having called
/// nothing, when the kernel has no batch lookups for this map (the caller walks it
/// key by key instead).
///
/// Entries added or removed during the walk may be missed, as with a walk key by key.
pub fn for_each_batch<K: Pod, V: Pod>(
    map: impl AsFd,
    per_cpu: Option<usize>,
    each: impl FnMut(&[K], &[V]),
) -> io::Result<bool> {
    for_each_batch_upto(map, per_cpu, usize::MAX, each)
}

/// [`for_each_batch`], stopping after `limit` entries (an array's first `limit`
/// values: an array's batches are its indices in order).
pub fn for_each_batch_upto<K: Pod, V: Pod>(
    map: impl AsFd,
    per_cpu: Option<usize>,
    limit: usize,
    mut each: impl FnMut(&[K], &[V]),
) -> io::Result<bool> {
    if limit == 0 {
        return Ok(true);
    }
    let mut left = limit;
    let Some(mut buffers) = BatchBuffers::<K, V>::new(per_cpu, limit) else {
        return Ok(false);
    };
    loop {
        let (error, copied) = buffers.lookup(map.as_fd(), left);
        let can_grow = buffers.entries < MAX_GROWN_ENTRIES;
        let last = match classify(error, buffers.first, can_grow) {
            Answer::More => false,
            Answer::Last => true,
            Answer::Grow => {
                buffers.grow();
                continue;
            }
            Answer::Unsupported => return Ok(false),
            Answer::Failed(err) => return Err(err),
        };
        let (batch_keys, batch_values) = buffers.batch(copied, left);
        let count = batch_keys.len();
        if count > 0 {
            each(batch_keys, batch_values);
        }
        left -= count;
        if last || left == 0 {
            return Ok(true);
        }
        buffers.next_batch();
    }
}

/// What the answer to one batch lookup means for the walk.
enum Answer {
    /// A batch, with more to come.
    More,
    /// The last batch.
    Last,
    /// Nothing copied: ask for the same batch again with bigger buffers.
    Grow,
    /// The kernel has no batch lookups for this map: the caller walks it instead.
    Unsupported,
    /// Any other error, the walk's.
    Failed(io::Error),
}

/// The meaning of a lookup's `error` (`None`: success); `first` for the walk's first
/// lookup, `can_grow` while the buffers may still grow.
fn classify(error: Option<io::Error>, first: bool, can_grow: bool) -> Answer {
    match error {
        None => Answer::More,
        // The last batch: `count` entries were still copied.
        Some(err) if err.raw_os_error() == Some(libc::ENOENT) => Answer::Last,
        // One bucket holds more entries than asked for (colliding keys): the
        // same batch again, with room for twice as many.
        Some(err) if err.raw_os_error() == Some(libc::ENOSPC) && can_grow => Answer::Grow,
        // No batch operations for this kernel or map type.
        Some(err)
            if first
                && matches!(
                    err.raw_os_error(),
                    Some(
                        libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP | 524 /* ENOTSUPP */
                    )
                ) =>
        {
            Answer::Unsupported
        }
        Some(err) => Answer::Failed(err),
    }
}

/// The buffers a walk hands the kernel, and where the walk is: typed by the map's
/// key `K` and value `V`.
struct BatchBuffers<K, V> {
    /// Room for `entries` keys, as u64s (aligned for any key).
    keys: Vec<u64>,
    /// Room for `entries` values of each of `slots` CPUs, as u64s.
    values: Vec<u64>,
    /// Entries asked for per call.
    entries: usize,
    /// Values per key: the possible CPUs of a per-CPU map, else 1.
    slots: usize,
    /// The batch token of a hash map is a bucket number (u32); room for a u64.
    token_in: u64,
    token_out: u64,
    /// Whether no batch was read yet (the lookup starts at the map's beginning).
    first: bool,
    types: PhantomData<(K, V)>,
}

impl<K: Pod, V: Pod> BatchBuffers<K, V> {
    /// Buffers for up to `limit` entries a call; `None` when the kernel's layout of
    /// `K` and `V` cannot be read as typed slices.
    fn new(per_cpu: Option<usize>, limit: usize) -> Option<Self> {
        // The kernel lays per-CPU values out 8-byte aligned: a plain `[V]` only when
        // their size is a multiple of 8 (true of every table read this way). The
        // buffers are of u64, aligned for any key and value.
        if align_of::<K>() > 8
            || align_of::<V>() > 8
            || per_cpu.is_some() && !size_of::<V>().is_multiple_of(8)
        {
            return None;
        }
        let slots = per_cpu.map_or(1, |cpus| cpus.max(1));
        let entries = (BATCH_BYTES / (size_of::<V>() * slots).max(1))
            .clamp(*BATCH_ENTRIES.start(), *BATCH_ENTRIES.end())
            .min(limit);
        Some(Self {
            keys: vec![0u64; (entries * size_of::<K>()).div_ceil(8)],
            values: vec![0u64; (entries * size_of::<V>() * slots).div_ceil(8)],
            entries,
            slots,
            token_in: 0,
            token_out: 0,
            first: true,
            types: PhantomData,
        })
    }

    /// Asks the kernel for the next batch of at most `left` entries: the error, if
    /// any, and the entries it says it copied.
    fn lookup(&mut self, map: BorrowedFd<'_>, left: usize) -> (Option<io::Error>, u32) {
        let mut attr = BatchAttr {
            in_batch: if self.first {
                0
            } else {
                std::ptr::addr_of_mut!(self.token_in) as u64
            },
            out_batch: std::ptr::addr_of_mut!(self.token_out) as u64,
            keys: self.keys.as_mut_ptr() as u64,
            values: self.values.as_mut_ptr() as u64,
            count: self.entries.min(left) as u32,
            map_fd: map.as_raw_fd() as u32,
            ..Default::default()
        };
        // SAFETY: `attr` is a valid `bpf_attr` batch member whose buffers hold
        // `count` keys and values of `K` and `V`, which the callers take from the
        // typed aya map of the same fd (aya checks its key and value sizes against
        // the map's), and the tokens are 8 bytes, more than a hash map's 4-byte token.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                std::ptr::addr_of_mut!(attr),
                size_of::<BatchAttr>(),
            )
        };
        let error = (ret < 0).then(io::Error::last_os_error);
        (error, attr.count)
    }

    /// Doubles the entries asked for, and the buffers with them.
    fn grow(&mut self) {
        self.entries *= 2;
        self.keys
            .resize((self.entries * size_of::<K>()).div_ceil(8), 0);
        self.values
            .resize((self.entries * size_of::<V>() * self.slots).div_ceil(8), 0);
    }

    /// The keys and values of the batch just read: the `copied` entries the kernel
    /// says it wrote, at most `left`.
    fn batch(&self, copied: u32, left: usize) -> (&[K], &[V]) {
        let count = (copied as usize).min(self.entries).min(left);
        // SAFETY: the kernel wrote `count` keys and `count * slots` values, packed,
        // into buffers aligned for K and V; both are Pod, so any bytes are valid.
        unsafe {
            (
                std::slice::from_raw_parts(self.keys.as_ptr().cast::<K>(), count),
                std::slice::from_raw_parts(self.values.as_ptr().cast::<V>(), count * self.slots),
            )
        }
    }

    /// Moves on past the batch just read.
    fn next_batch(&mut self) {
        self.token_in = self.token_out;
        self.first = false;
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{FromRawFd as _, OwnedFd};

    use heapprof_common::SiteCounters;

    use super::*;

    /// `BPF_MAP_CREATE`, `BPF_MAP_UPDATE_ELEM`.
    const BPF_MAP_CREATE: libc::c_long = 0;
    const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
    const BPF_MAP_TYPE_HASH: u32 = 1;
    const BPF_MAP_TYPE_PERCPU_HASH: u32 = 5;

    fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<i64> {
        // SAFETY: `attr` is the `bpf_attr` member `cmd` reads, its pointers valid.
        let ret =
            unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_mut(attr), size_of::<T>()) };
        if ret < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(ret)
        }
    }

    /// A hash map made for the test (BPF needs root, as every BPF test here).
    fn create_map(map_type: u32, key_size: u32, value_size: u32, max_entries: u32) -> OwnedFd {
        #[repr(C)]
        struct CreateAttr {
            map_type: u32,
            key_size: u32,
            value_size: u32,
            max_entries: u32,
        }
        let mut attr = CreateAttr {
            map_type,
            key_size,
            value_size,
            max_entries,
        };
        let fd = bpf(BPF_MAP_CREATE, &mut attr).unwrap_or_else(|err| {
            panic!("creating a BPF map ({err}): this test needs root (CI runs as root)")
        });
        // SAFETY: a descriptor the kernel just returned, owned by no one else.
        unsafe { OwnedFd::from_raw_fd(fd as i32) }
    }

    #[repr(C)]
    struct ElemAttr {
        map_fd: u32,
        _pad: u32,
        key: u64,
        value: u64,
        flags: u64,
    }

    fn update<K, V>(map: &OwnedFd, key: &K, value: &[V]) {
        let mut attr = ElemAttr {
            map_fd: map.as_raw_fd() as u32,
            _pad: 0,
            key: std::ptr::from_ref(key) as u64,
            value: value.as_ptr() as u64,
            flags: 0,
        };
        bpf(BPF_MAP_UPDATE_ELEM, &mut attr).expect("updating a test map");
    }

    #[test]
    fn batches_read_every_entry() {
        const ENTRIES: u64 = 10_000;
        let map = create_map(BPF_MAP_TYPE_HASH, 8, 16, ENTRIES as u32);
        for key in 0..ENTRIES {
            update(&map, &key, &[[key * 3, !key]]);
        }
        let mut seen = Vec::new();
        let mut batches = 0;
        let batched = for_each_batch(&map, None, |keys: &[u64], values: &[[u64; 2]]| {
            batches += 1;
            assert_eq!(keys.len(), values.len());
            for (key, value) in keys.iter().zip(values) {
                assert_eq!(*value, [key * 3, !key], "the value of key {key}");
                seen.push(*key);
            }
        })
        .expect("reading in batches");
        assert!(batched, "this kernel has batch lookups for hash maps");
        seen.sort_unstable();
        assert_eq!(seen, (0..ENTRIES).collect::<Vec<_>>(), "every key, once");
        assert!(batches > 1, "more than one batch: {batches}");
    }

    #[test]
    fn per_cpu_values_come_one_per_possible_cpu() {
        let cpus = crate::aggregate::possible_cpus().expect("possible CPUs");
        let map = create_map(
            BPF_MAP_TYPE_PERCPU_HASH,
            8,
            size_of::<SiteCounters>() as u32,
            1000,
        );
        for key in 0..500u64 {
            let per_cpu: Vec<SiteCounters> = (0..cpus as u64)
                .map(|cpu| SiteCounters {
                    alloc_objects: key,
                    alloc_bytes: cpu,
                    free_objects: 0,
                    free_bytes: key + cpu,
                    ..SiteCounters::default()
                })
                .collect();
            update(&map, &key, &per_cpu);
        }
        let mut seen = 0;
        let batched = for_each_batch(&map, Some(cpus), |keys: &[u64], values: &[SiteCounters]| {
            assert_eq!(values.len(), keys.len() * cpus);
            for (key, per_cpu) in keys.iter().zip(values.chunks_exact(cpus)) {
                for (cpu, counters) in per_cpu.iter().enumerate() {
                    let cpu = cpu as u64;
                    assert_eq!(
                        (
                            counters.alloc_objects,
                            counters.alloc_bytes,
                            counters.free_bytes
                        ),
                        (*key, cpu, key + cpu),
                        "key {key}, cpu {cpu}"
                    );
                }
                seen += 1;
            }
        })
        .expect("reading in batches");
        assert!(batched);
        assert_eq!(seen, 500);
    }
}
