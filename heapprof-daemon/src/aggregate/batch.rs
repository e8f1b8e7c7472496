//! Reading whole BPF hash maps a batch of entries per system call.
//!
//! Walking a map key by key costs two system calls per entry (next key, then
//! lookup): 0.6 s for 131,072 per-CPU sites. `BPF_MAP_LOOKUP_BATCH` (Linux 5.6)
//! copies out thousands of entries per call. Where the kernel refuses it, the
//! caller walks the map as before.

use std::{
    io,
    mem::{align_of, size_of},
    os::fd::{AsFd, AsRawFd as _},
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
    mut each: impl FnMut(&[K], &[V]),
) -> io::Result<bool> {
    // The kernel lays per-CPU values out 8-byte aligned: a plain `[V]` only when
    // their size is a multiple of 8 (true of every table read this way). The
    // buffers are of u64, aligned for any key and value.
    if align_of::<K>() > 8
        || align_of::<V>() > 8
        || per_cpu.is_some() && !size_of::<V>().is_multiple_of(8)
    {
        return Ok(false);
    }
    let slots = per_cpu.map_or(1, |cpus| cpus.max(1));
    let entries = (BATCH_BYTES / (size_of::<V>() * slots).max(1))
        .clamp(*BATCH_ENTRIES.start(), *BATCH_ENTRIES.end());
    let mut keys = vec![0u64; (entries * size_of::<K>()).div_ceil(8)];
    let mut values = vec![0u64; (entries * size_of::<V>() * slots).div_ceil(8)];
    // The batch token of a hash map is a bucket number (u32); room for a u64.
    let mut token_in = 0u64;
    let mut token_out = 0u64;
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first {
                0
            } else {
                std::ptr::addr_of_mut!(token_in) as u64
            },
            out_batch: std::ptr::addr_of_mut!(token_out) as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: entries as u32,
            map_fd: map.as_fd().as_raw_fd() as u32,
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
        let done = match &error {
            None => false,
            // The last batch: `count` entries were still copied.
            Some(err) if err.raw_os_error() == Some(libc::ENOENT) => true,
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
                return Ok(false);
            }
            Some(_) => return Err(error.unwrap_or_else(io::Error::last_os_error)),
        };
        let count = (attr.count as usize).min(entries);
        // SAFETY: the kernel wrote `count` keys and `count * slots` values, packed,
        // into buffers aligned for K and V; both are Pod, so any bytes are valid.
        let (batch_keys, batch_values) = unsafe {
            (
                std::slice::from_raw_parts(keys.as_ptr().cast::<K>(), count),
                std::slice::from_raw_parts(values.as_ptr().cast::<V>(), count * slots),
            )
        };
        if count > 0 {
            each(batch_keys, batch_values);
        }
        if done {
            return Ok(true);
        }
        token_in = token_out;
        first = false;
    }
}
