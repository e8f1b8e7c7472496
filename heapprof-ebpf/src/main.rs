//! heapprofd's BPF programs.
//!
//! Entry uprobes on the allocator functions record the outermost call of a thread in
//! `IN_FLIGHT` (`calls`); one shared uretprobe completes it: it takes the user stack
//! (`stack`; at return the caller's frame is intact, so the immediate caller is the
//! first frame), counts the allocation per site in `SITES` and remembers the block in
//! `LIVE` (`sites`). A uprobe on free finds the block and credits the free to its site.
//! Each process's in-use total and its exact peak are kept beside (`usage`).
//! Everything stays in maps (`maps`); the daemon reads and aggregates them on its
//! interval. The programs themselves are in `user`.
//!
//! Kernel mode (`kernel`) does the same for the kernel heap from the `kmem:*`
//! tracepoints, with kernel stacks and per-object live tracking.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]
// `usage` writes two atomic instructions the BPF target's types do not offer.
#![cfg_attr(target_arch = "bpf", feature(asm_experimental_arch))]

#[cfg(target_arch = "bpf")]
mod atomic;
#[cfg(target_arch = "bpf")]
mod call_sites;
#[cfg(target_arch = "bpf")]
mod calls;
#[cfg(target_arch = "bpf")]
mod forks;
#[cfg(target_arch = "bpf")]
mod kernel;
#[cfg(target_arch = "bpf")]
mod live;
#[cfg(target_arch = "bpf")]
mod live_filter;
#[cfg(target_arch = "bpf")]
mod log;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod preload;
#[cfg(target_arch = "bpf")]
mod regs;
#[cfg(target_arch = "bpf")]
mod sampling;
#[cfg(target_arch = "bpf")]
mod sites;
#[cfg(target_arch = "bpf")]
mod stack;
#[cfg(target_arch = "bpf")]
mod threads;
#[cfg(target_arch = "bpf")]
mod unwind;
#[cfg(target_arch = "bpf")]
mod usage;
#[cfg(target_arch = "bpf")]
mod user;
#[cfg(target_arch = "bpf")]
mod walk_cache;

#[cfg(not(target_arch = "bpf"))]
fn main() {}

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any reachable panic, so this is never called.
    loop {}
}
