//! The runs the kernel skipped of each program (`recursion_misses`), which the
//! profile reports as what its frees may undercount.

use aya::Ebpf;

/// How many times the kernel skipped each program that has skipped runs, by name:
/// a tracepoint program is not run when another tracing BPF program already runs on
/// that CPU (the kernel's `bpf_prog_active` guard; an interrupt's or softirq's free
/// inside a program's run is lost that way). From `recursion_misses` of the
/// program's `bpf_prog_info` (Linux 5.12+; older kernels count none).
pub fn recursion_misses(ebpf: &Ebpf) -> Vec<(String, u64)> {
    use std::os::fd::{AsFd as _, AsRawFd as _};

    /// `BPF_OBJ_GET_INFO_BY_FD`.
    const OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    /// Offset of `recursion_misses` in `struct bpf_prog_info` (uapi, stable).
    const RECURSION_MISSES: usize = 208;
    #[repr(C)]
    struct InfoAttr {
        fd: u32,
        info_len: u32,
        info: u64,
    }
    let mut misses = Vec::new();
    for (name, program) in ebpf.programs() {
        let Ok(fd) = program.fd() else {
            continue; // not loaded
        };
        // Larger than any kernel's struct: the kernel fills what it has, zeroes stay.
        let mut info = [0u64; 64];
        let mut attr = InfoAttr {
            fd: fd.as_fd().as_raw_fd() as u32,
            info_len: std::mem::size_of_val(&info) as u32,
            info: info.as_mut_ptr() as u64,
        };
        // SAFETY: the attribute and the buffer it points to outlive the call, and
        // info_len is the buffer's size.
        let result = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                OBJ_GET_INFO_BY_FD,
                &raw mut attr,
                std::mem::size_of::<InfoAttr>(),
            )
        };
        let count = info[RECURSION_MISSES / 8];
        if result == 0 && count > 0 {
            misses.push((name.to_owned(), count));
        }
    }
    misses.sort();
    misses
}
