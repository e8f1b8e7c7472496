//! heapprofd's BPF programs live in the `heapprof` binary of this package
//! (built for the bpf target by aya-build). This library target exists so the
//! daemon can name the package as a build-dependency.
#![no_std]
