//! The independent count of kernel allocations that kernel mode is checked against:
//! a bpftrace script counting the kmem tracepoints for one process, and its output
//! read back. tests/kernel.rs runs it on the host, tests/x86_vm.rs inside the VM.

use std::collections::BTreeMap;

use super::Sample;

/// The script: the process's pid is its first argument (`bpftrace -e SCRIPT PID`).
/// It prints `counting` once its probes are attached, and its maps when stopped
/// (SIGINT or SIGTERM).
pub const SCRIPT: &str = r#"BEGIN { printf("counting\n"); }
tracepoint:kmem:kmalloc /pid == $1 && args->ptr != 0/ { @kmalloc = count(); @kmalloc_size[args->bytes_alloc] = count(); }
tracepoint:kmem:kmem_cache_alloc /pid == $1 && args->ptr != 0/ { @cache = count(); @cache_size[args->bytes_alloc] = count(); }
tracepoint:kmem:mm_page_alloc /pid == $1 && args->pfn + 1 != 0/ { @pages = count(); @order[args->order] = count(); }
"#;

/// What bpftrace counted: allocations by kmalloc, kmem_cache_alloc and the page
/// allocator, pages by order, and kmalloc and kmem_cache_alloc objects by the size
/// handed out.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct IndependentCount {
    pub kinds: [i64; 3],
    pub orders: BTreeMap<i64, i64>,
    pub kmalloc_sizes: BTreeMap<i64, i64>,
    pub cache_sizes: BTreeMap<i64, i64>,
}

impl IndependentCount {
    /// Reads the maps bpftrace printed (a missing one is 0); other lines are skipped.
    pub fn parse<'a>(lines: impl IntoIterator<Item = &'a str>) -> Self {
        let mut counts = Self::default();
        for line in lines {
            let Some((name, value)) = line.trim_end_matches('\r').split_once(": ") else {
                continue;
            };
            let Ok(value) = value.trim().parse::<i64>() else {
                panic!("bpftrace printed {line:?}");
            };
            // `@order[2]`: a map keyed by a number.
            let keyed = |map: &str| {
                name.strip_prefix(map)
                    .and_then(|rest| rest.strip_prefix('['))
                    .and_then(|rest| rest.strip_suffix(']'))
                    .and_then(|key| key.parse::<i64>().ok())
            };
            match name.trim() {
                "@kmalloc" => counts.kinds[0] = value,
                "@cache" => counts.kinds[1] = value,
                "@pages" => counts.kinds[2] = value,
                _ => {
                    if let Some(order) = keyed("@order") {
                        counts.orders.insert(order, value);
                    } else if let Some(size) = keyed("@kmalloc_size") {
                        counts.kmalloc_sizes.insert(size, value);
                    } else if let Some(size) = keyed("@cache_size") {
                        counts.cache_sizes.insert(size, value);
                    }
                }
            }
        }
        counts
    }
}

/// The same figures from heapprofd's profile: the samples of `pid` by their leaf (the
/// allocator kind), pages by their `order` label, objects by their size (each sample
/// has one).
pub fn counted_by_heapprofd(samples: &[Sample], pid: &str) -> IndependentCount {
    let mut counts = IndependentCount::default();
    for sample in samples {
        let objects = sample.values[0];
        if sample.labels.get("pid").is_none_or(|p| p != pid) || objects == 0 {
            continue;
        }
        let per_object = sample.values[1] / objects;
        assert_eq!(
            per_object * objects,
            sample.values[1],
            "one size per sample: {sample:?}"
        );
        // Kind, the map it is counted in, and its key there.
        let (kind, map, key) = match sample.stack.first().map(String::as_str) {
            Some("kmalloc") => (0, &mut counts.kmalloc_sizes, per_object),
            Some("kmem_cache_alloc") => (1, &mut counts.cache_sizes, per_object),
            Some("alloc_pages") => {
                let order = sample
                    .labels
                    .get("order")
                    .and_then(|o| o.parse().ok())
                    .unwrap_or_else(|| panic!("a page sample without its order: {sample:?}"));
                (2, &mut counts.orders, order)
            }
            _ => panic!("a kernel sample of no allocator kind: {sample:?}"),
        };
        counts.kinds[kind] += objects;
        *map.entry(key).or_default() += objects;
    }
    counts
}
