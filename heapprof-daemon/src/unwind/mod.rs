//! Unwind tables: each object's call-frame information (CFI) turned into the compact
//! rows and rules the BPF unwinder reads (see `heapprof_common::unwind`).
