//! heapprofd's BPF programs.
//!
//! Entry uprobes on the libc allocator functions record the outermost call of a
//! thread in `IN_FLIGHT`; one shared uretprobe completes it: it takes the user
//! stack (at return the caller's frame is intact, so the immediate caller is the
//! first frame), counts the allocation per site in `SITES` and remembers the block
//! in `LIVE`. A uprobe on free finds the block and credits the free to its site.
//! Everything stays in maps; the daemon reads and aggregates them on its interval.
//!
//! Kernel mode (`kernel`) does the same for the kernel heap from the `kmem:*`
//! tracepoints, with kernel stacks and per-object live tracking.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod kernel;
#[cfg(target_arch = "bpf")]
mod programs;

#[cfg(not(target_arch = "bpf"))]
fn main() {}

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any reachable panic, so this is never called.
    loop {}
}
