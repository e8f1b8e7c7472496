//! Reading an allocation or free event's record: its head copied with one helper
//! call, fields at the positions the daemon found, and the cache's name (hashed from
//! the copy; read as a string only for a new site).

use aya_ebpf::{
    EbpfContext as _, helpers::bpf_probe_read_kernel_str_bytes, macros::map, maps::PerCpuArray,
    programs::TracePointContext,
};
use heapprof_common::kernel::{CACHE_NAME_LEN, FieldRef};

use super::config::HASH_MULTIPLIER;

/// The first [`RECORD_HEAD`] bytes of an allocation event's record, copied with one
/// helper call: its fields are then read from here, not one helper call each.
#[map(name = "KERNEL_RECORD_SCRATCH")]
static KERNEL_RECORD_SCRATCH: PerCpuArray<[u64; RECORD_HEAD / 8]> =
    PerCpuArray::with_max_entries(1, 0);

/// Bytes of an allocation record copied at once: every field the programs read of the
/// kmem allocation events lies in them on 5.10 to 6.18 (the largest, 6.18's
/// `kmem_cache_alloc`, ends its last read field at 48), and so does the cache's name
/// (6.18's starts at 61, right after the fixed fields), whose hash is then computed
/// from the copy instead of a string read per allocation.
const RECORD_HEAD: usize = 96;

/// The head of the record, copied into this CPU's scratch slot with one helper call
/// (`None` if the copy fails: then [`field`] reads each field itself).
#[inline(always)]
pub(super) fn record_head(ctx: &TracePointContext) -> Option<*const u8> {
    let head = KERNEL_RECORD_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: bpf_probe_read_kernel checks the source; the destination is this CPU's
    // slot of RECORD_HEAD bytes. The record lives in the tracing buffer, which holds
    // at least RECORD_HEAD bytes past its start.
    let copied = unsafe {
        aya_ebpf::helpers::generated::bpf_probe_read_kernel(
            head.cast(),
            RECORD_HEAD as u32,
            ctx.as_ptr(),
        )
    };
    (copied == 0).then_some(head.cast_const().cast())
}

/// Reads one field from the copied head of the record, or from the record itself when
/// there is no copy; `None` when the event lacks the field.
#[inline(always)]
pub(super) fn head_field(
    ctx: &TracePointContext,
    head: Option<*const u8>,
    field: FieldRef,
) -> Option<u64> {
    let Some(head) = head else {
        return self::field(ctx, field);
    };
    let offset = field.offset as usize;
    if offset > RECORD_HEAD - 8 {
        return self::field(ctx, field);
    }
    // SAFETY: `offset + 8 <= RECORD_HEAD` bytes of this CPU's slot; the format file
    // places fields at their natural alignment.
    unsafe {
        match field.size {
            8 => Some(core::ptr::read(head.add(offset).cast::<u64>())),
            4 => Some(u64::from(core::ptr::read(head.add(offset).cast::<u32>()))),
            _ => None,
        }
    }
}

/// Reads one field of the record, `None` when the event lacks it.
#[inline(always)]
pub(super) fn field(ctx: &TracePointContext, field: FieldRef) -> Option<u64> {
    let offset = field.offset as usize;
    // SAFETY: read_at reads kernel memory through bpf_probe_read_kernel, which checks it.
    unsafe {
        match field.size {
            8 => ctx.read_at::<u64>(offset).ok(),
            4 => ctx.read_at::<u32>(offset).ok().map(u64::from),
            _ => None,
        }
    }
}

/// Reads the `__data_loc` string `name` of the record into `out` (zero-padded, cut at
/// its size); false when the event has no name.
#[inline(always)]
pub(super) fn read_cache_name(
    ctx: &TracePointContext,
    head: Option<*const u8>,
    name: FieldRef,
    out: &mut [u8; CACHE_NAME_LEN],
) -> bool {
    let Some(location) = head_field(ctx, head, name) else {
        return false;
    };
    let offset = (location & 0xffff) as usize;
    let source = (ctx.as_ptr() as usize).wrapping_add(offset) as *const u8;
    // SAFETY: bpf_probe_read_kernel_str_bytes checks the kernel address.
    unsafe { bpf_probe_read_kernel_str_bytes(source, out) }.is_ok()
}

/// The hash of a cache name (its words, zero-padded), never 0.
#[inline(always)]
fn name_hash(name: &[u8; CACHE_NAME_LEN]) -> u64 {
    let mut hash = HASH_MULTIPLIER;
    for word in name.as_chunks::<8>().0 {
        hash = (hash ^ u64::from_le_bytes(*word)).wrapping_mul(HASH_MULTIPLIER);
        hash ^= hash >> 29;
    }
    hash | 1
}

/// The [`name_hash`] of the `__data_loc` string at `location` (offset in the low 16
/// bits, length with its NUL in the high 16) computed from the record's copied head,
/// as it would be of the name read into a zeroed `[u8; CACHE_NAME_LEN]` (at most
/// `CACHE_NAME_LEN - 1` characters); `None` when the name is not wholly in the copy.
#[inline(always)]
fn head_name_hash(head: *const u8, location: u64) -> Option<u64> {
    let offset = (location & 0xffff) as usize;
    if offset > RECORD_HEAD - CACHE_NAME_LEN {
        return None;
    }
    let kept = ((location >> 16) & 0xffff)
        .saturating_sub(1)
        .min(CACHE_NAME_LEN as u64 - 1);
    let mut hash = HASH_MULTIPLIER;
    for i in 0..CACHE_NAME_LEN / 8 {
        let start = 8 * i as u64;
        // SAFETY: `offset + CACHE_NAME_LEN <= RECORD_HEAD` bytes of this CPU's slot.
        // Unaligned: the string follows the fixed fields, which end at any byte (at
        // 61 on 6.18, after `bool accounted`).
        let word = unsafe { core::ptr::read_unaligned(head.add(offset + 8 * i).cast::<u64>()) };
        let mask = if kept >= start + 8 {
            u64::MAX
        } else if kept <= start {
            0
        } else {
            (1u64 << (8 * (kept - start))) - 1
        };
        hash = (hash ^ (word & mask)).wrapping_mul(HASH_MULTIPLIER);
        hash ^= hash >> 29;
    }
    Some(hash | 1)
}

/// The class of a `kmem_cache_alloc` site: the hash of its cache's name (0: the
/// event has none), from the record's copied head where the name lies in it.
#[inline(always)]
pub(super) fn cache_class(ctx: &TracePointContext, head: Option<*const u8>, name: FieldRef) -> u64 {
    let Some(location) = head_field(ctx, head, name) else {
        return 0;
    };
    if let Some(head) = head
        && let Some(hash) = head_name_hash(head, location)
    {
        return hash;
    }
    let mut cache_name = [0u8; CACHE_NAME_LEN];
    if read_cache_name(ctx, head, name, &mut cache_name) {
        name_hash(&cache_name)
    } else {
        0
    }
}
