//! What the VM tests boot, fetched from Debian's archive into `target/*-vm/assets`:
//! the arm64 VM's kernels and libraries (`arm64`), the x86-64 VM's kernels (`x86`)
//! and the bpftrace disk one of its boots mounts (`bpftrace`), all through the
//! archive access they share (`debian`).

pub mod arm64;
pub mod bpftrace;
mod debian;
pub mod x86;
