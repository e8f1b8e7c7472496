//! What the kernel-mode VM tests (x86_vm.rs, arm64_vm_fentry.rs) read of a profile:
//! how each deferred-free path was seen and what its program freed (from the
//! profile's keyed comments, by their stable names), and in-use against allocated
//! figures of a set of stacks.

use std::collections::BTreeMap;

use heapprof_common::kernel::DeferredFreePath;
use heapprof_daemon::{
    pprof::{keyed_comments, proto::Profile},
    probes::kernel::{DeferredFreeWatch, freed_key, watch_key},
};

use super::{Sample, comments, samples, totals};

/// (major, minor) of a kernel release.
pub fn version(release: &str) -> (u32, u32) {
    let mut parts = release.split(['.', '-', '+']);
    let mut next = || {
        parts
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("a kernel release without a version: {release}"))
    };
    (next(), next())
}

/// How the profile says the frees through each deferred path were seen, and the
/// objects its program freed (when one was attached): from its keyed comments,
/// found by their stable names.
pub fn deferred_paths(
    profile: &Profile,
) -> BTreeMap<&'static str, (DeferredFreeWatch, Option<i64>)> {
    let notes = comments(profile);
    DeferredFreePath::ALL
        .into_iter()
        .filter_map(|path| {
            let watch = keyed_comments::value(&notes, &watch_key(path))?;
            let watch = DeferredFreeWatch::from_name(watch)
                .unwrap_or_else(|| panic!("an unknown watch {watch:?}: {notes:?}"));
            let freed = keyed_comments::value(&notes, &freed_key(path)).map(|count| {
                count
                    .parse()
                    .unwrap_or_else(|_| panic!("a count that is not a number: {count:?}"))
            });
            Some((path.function(), (watch, freed)))
        })
        .collect()
}

/// The objects each attached program freed.
pub fn freed_by(profile: &Profile) -> BTreeMap<&'static str, i64> {
    deferred_paths(profile)
        .into_iter()
        .filter_map(|(function, (_, freed))| Some((function, freed?)))
        .collect()
}

/// The watches alone of [`deferred_paths`].
pub fn watches(profile: &Profile) -> BTreeMap<&'static str, DeferredFreeWatch> {
    deferred_paths(profile)
        .into_iter()
        .map(|(function, (watch, _))| (function, watch))
        .collect()
}

/// Allocated objects, allocated bytes and in-use bytes of the samples that pass `filter`.
pub fn in_use(profile: &Profile, filter: impl Fn(&Sample) -> bool) -> (i64, i64, i64) {
    let [objects, bytes, _, inuse_bytes] = totals(&samples(profile), filter);
    (objects, bytes, inuse_bytes)
}

/// How each deferred path is seen on a kernel of `(major, minor)` that has BTF (or,
/// `btf` false, not): fentry, or the kprobes without BTF; the bulk program not
/// before 5.17, which it needs for `bpf_loop()`.
pub fn expected_watches(
    (major, minor): (u32, u32),
    btf: bool,
) -> BTreeMap<&'static str, DeferredFreeWatch> {
    let attached = if btf {
        DeferredFreeWatch::Fentry
    } else {
        DeferredFreeWatch::Kprobe
    };
    let bulk = if (major, minor) >= (5, 17) {
        attached
    } else {
        DeferredFreeWatch::NeedsBpfLoop
    };
    BTreeMap::from([
        (DeferredFreePath::Rcu.function(), attached),
        (DeferredFreePath::Bulk.function(), bulk),
    ])
}
