//! The baselines measured beside heapprofd: bpftrace scripts with empty entry probes
//! on the allocator family, and a memleak-style script.

/// The allocator functions heapprofd probes, for the baselines.
pub(super) const FAMILY: [&str; 10] = [
    "malloc",
    "calloc",
    "realloc",
    "reallocarray",
    "posix_memalign",
    "aligned_alloc",
    "memalign",
    "valloc",
    "pvalloc",
    "free",
];

pub(super) fn empty_probes_script(libc: &str) -> String {
    let probes: Vec<String> = FAMILY
        .iter()
        .map(|f| format!("uprobe:{libc}:{f}"))
        .collect();
    format!(
        "{} {{ }}\nBEGIN {{ printf(\"ready\\n\"); }}\n",
        probes.join(",\n")
    )
}

/// A memleak-style bpftrace script: size at entry, pointer at return, a stack per live
/// block, deleted on free; for malloc, calloc, realloc, and free.
pub(super) fn memleak_script(libc: &str) -> String {
    format!(
        r#"uprobe:{libc}:malloc {{ @size[tid] = arg0; }}
uprobe:{libc}:calloc {{ @size[tid] = arg0 * arg1; }}
uprobe:{libc}:realloc {{ delete(@sizes[arg0]); delete(@stacks[arg0]); @size[tid] = arg1; }}
uretprobe:{libc}:malloc, uretprobe:{libc}:calloc, uretprobe:{libc}:realloc /@size[tid]/ {{
  if (retval != 0) {{ @sizes[retval] = @size[tid]; @stacks[retval] = ustack; }}
  delete(@size[tid]);
}}
uprobe:{libc}:free {{ delete(@sizes[arg0]); delete(@stacks[arg0]); }}
BEGIN {{ printf("ready\n"); }}
END {{ clear(@size); clear(@sizes); clear(@stacks); }}
"#
    )
}
