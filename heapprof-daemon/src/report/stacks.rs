//! Stacks of a profile as the reports name them: folded stacks (root first, one
//! line per stack) and allocation sites (the allocator and its nearest callers).

use std::collections::{BTreeMap, HashMap};

use heapprof_common::kernel::{KernelAllocKind, is_allocator_frame};

use super::model::{Profile, Sample};

/// Whether `leaf` is the pseudo-frame of a kernel allocation (kernel profiles).
fn is_kernel_allocation(leaf: &str) -> bool {
    KernelAllocKind::ALL
        .iter()
        .any(|kind| kind.function() == leaf)
}

/// Caller frames named in a site's description after the allocator function.
pub const SITE_CALLERS: usize = 4;

/// Samples to report: those of one process, or all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProcessFilter {
    /// Every process in the profile.
    #[default]
    All,
    /// Only this pid.
    Pid(u32),
}

impl ProcessFilter {
    /// Whether `sample` is one of the samples to report.
    pub fn admits(self, sample: &Sample) -> bool {
        match self {
            ProcessFilter::All => true,
            ProcessFilter::Pid(pid) => sample.pid == Some(pid),
        }
    }
}

/// An allocation site: the samples whose allocator and nearest callers match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Site {
    /// `malloc in b <- a <- main`: the allocator, then up to [`SITE_CALLERS`] callers,
    /// the first with its file and line when known.
    pub description: String,
    /// One value per sample type, summed over the merged samples.
    pub values: Vec<i64>,
}

/// The name of a sample's site: the allocator and up to [`SITE_CALLERS`] callers,
/// none above `main`.
pub fn site_description(sample: &Sample) -> String {
    let mut frames = sample.frames().peekable();
    let allocator = frames.next().unwrap_or("[unknown]");
    if is_kernel_allocation(allocator) {
        // The kernel allocator's own entries and wrappers name no site.
        while frames.next_if(|&frame| is_allocator_frame(frame)).is_some() {}
    }
    // The C runtime's start code above `main` says nothing about the site.
    let mut reached_main = false;
    let callers: Vec<&str> = frames
        .take_while(|&frame| !std::mem::replace(&mut reached_main, frame == "main"))
        .take(SITE_CALLERS)
        .collect();
    if callers.is_empty() {
        allocator.to_owned()
    } else {
        format!("{allocator} in {}", callers.join(" <- "))
    }
}

/// What the rows of a table stand for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Grouping {
    /// Allocation sites (see [`site_description`]).
    #[default]
    Site,
    /// Kernel slab caches and kmalloc size classes (the `cache` label, as `slabtop`
    /// names them); page samples are `(pages)`.
    Cache,
    /// Kernel page orders (the `order` label: blocks of 2^order pages); slab samples
    /// are `(slab)`.
    Order,
}

impl Grouping {
    /// The row `sample` belongs to.
    pub fn key(self, sample: &Sample) -> String {
        match self {
            Grouping::Site => site_description(sample),
            Grouping::Cache => sample.cache.clone().unwrap_or_else(|| "(pages)".to_owned()),
            Grouping::Order => sample
                .order
                .map_or_else(|| "(slab)".to_owned(), |order| format!("order {order}")),
        }
    }
}

/// The sites of a profile, merged by description, in no particular order. With
/// several processes and no filter, sites of different processes are merged too.
pub fn sites(profile: &Profile, filter: ProcessFilter) -> Vec<Site> {
    groups(profile, filter, Grouping::Site)
}

/// The rows of a profile merged by `by`, in no particular order.
pub fn groups(profile: &Profile, filter: ProcessFilter, by: Grouping) -> Vec<Site> {
    let mut merged: HashMap<String, Vec<i64>> = HashMap::new();
    for sample in profile.samples.iter().filter(|s| filter.admits(s)) {
        let values = merged
            .entry(by.key(sample))
            .or_insert_with(|| vec![0; sample.values.len()]);
        for (total, value) in values.iter_mut().zip(&sample.values) {
            *total += value;
        }
    }
    merged
        .into_iter()
        .map(|(description, values)| Site {
            description,
            values,
        })
        .collect()
}

/// The `limit` sites with the most of sample type `index` (0: all), most first,
/// ties broken by description so the order is stable.
pub fn top_sites(
    profile: &Profile,
    index: usize,
    limit: usize,
    filter: ProcessFilter,
) -> Vec<Site> {
    top_groups(profile, index, limit, filter, Grouping::Site)
}

/// The `limit` rows grouped by `by` with the most of sample type `index` (0: all),
/// most first, ties broken by description.
pub fn top_groups(
    profile: &Profile,
    index: usize,
    limit: usize,
    filter: ProcessFilter,
    by: Grouping,
) -> Vec<Site> {
    let mut sites = groups(profile, filter, by);
    sites.retain(|s| s.values[index] != 0);
    sites.sort_by(|a, b| {
        b.values[index]
            .cmp(&a.values[index])
            .then_with(|| a.description.cmp(&b.description))
    });
    if limit > 0 {
        sites.truncate(limit);
    }
    sites
}

/// Folded stacks: `main;a;b;malloc` (root first, `;`-separated) to the sum of sample
/// type `index`. When the profile holds several processes and no filter picks one,
/// each stack starts with a `comm (pid)` frame.
pub fn folded(profile: &Profile, index: usize, filter: ProcessFilter) -> BTreeMap<String, i64> {
    let per_process = filter == ProcessFilter::All && profile.pids().len() > 1;
    let mut stacks = BTreeMap::new();
    for sample in profile.samples.iter().filter(|s| filter.admits(s)) {
        let value = sample.values[index];
        if value == 0 {
            continue;
        }
        *stacks.entry(fold(sample, per_process)).or_insert(0) += value;
    }
    stacks
}

/// One stack, root first, frames joined by `;` (a `;` inside a name becomes `:`).
pub fn fold(sample: &Sample, per_process: bool) -> String {
    let mut line = String::new();
    if per_process {
        let comm = sample.comm.as_deref().unwrap_or("?");
        let pid = sample.pid.map_or_else(|| "?".to_owned(), |p| p.to_string());
        line.push_str(&format!("{comm} ({pid})").replace(';', ":"));
    }
    for frame in sample.frames().rev() {
        if !line.is_empty() {
            line.push(';');
        }
        line.push_str(&frame.replace(';', ":"));
    }
    line
}

/// Folded stacks of two profiles side by side: (stack, value in `base`, value in
/// `profile`), for every stack present in either.
pub fn folded_diff(
    base: &Profile,
    profile: &Profile,
    index: usize,
    filter: ProcessFilter,
) -> Vec<(String, i64, i64)> {
    let before = folded(base, index, filter);
    let after = folded(profile, index, filter);
    let mut stacks: Vec<&String> = before.keys().chain(after.keys()).collect();
    stacks.sort();
    stacks.dedup();
    stacks
        .into_iter()
        .map(|stack| {
            (
                stack.clone(),
                before.get(stack).copied().unwrap_or(0),
                after.get(stack).copied().unwrap_or(0),
            )
        })
        .collect()
}

/// Sites of `profile` minus those of `base`, per sample type (a negative value: less
/// than before). Sites that did not change are left out.
pub fn site_diff(base: &Profile, profile: &Profile, filter: ProcessFilter) -> Vec<Site> {
    let mut merged: HashMap<String, Vec<i64>> = HashMap::new();
    let width = profile.sample_types.len();
    for (sign, side) in [(-1, base), (1, profile)] {
        for site in sites(side, filter) {
            let values = merged
                .entry(site.description)
                .or_insert_with(|| vec![0; width]);
            for (total, value) in values.iter_mut().zip(&site.values) {
                *total += sign * value;
            }
        }
    }
    merged
        .into_iter()
        .filter(|(_, values)| values.iter().any(|&v| v != 0))
        .map(|(description, values)| Site {
            description,
            values,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::report::model::Location;

    fn sample(pid: u32, frames: &[&str], values: [i64; 4]) -> Sample {
        Sample {
            cache: None,
            order: None,
            size_class: None,
            pid: Some(pid),
            comm: Some("prog".into()),
            locations: frames
                .iter()
                .map(|name| Location {
                    address: 0,
                    mapping: None,
                    names: vec![(*name).to_owned()],
                })
                .collect(),
            values: values.to_vec(),
        }
    }

    pub(crate) fn profile(samples: Vec<Sample>) -> Profile {
        Profile {
            path: PathBuf::from("p"),
            time_nanos: 0,
            duration_nanos: 0,
            sample_types: [
                "alloc_objects",
                "alloc_space",
                "inuse_objects",
                "inuse_space",
            ]
            .map(str::to_owned)
            .to_vec(),
            period: 1,
            comments: vec![],
            samples,
            mappings: vec![],
            processes: vec![],
            kernel_memory: None,
        }
    }

    #[test]
    fn folds_root_first_and_merges_sites() {
        let p = profile(vec![
            sample(1, &["malloc", "b", "a", "main"], [2, 64, 1, 32]),
            sample(1, &["malloc", "b", "a", "main"], [1, 16, 1, 16]),
            sample(1, &["calloc", "c;d", "main"], [1, 8, 0, 0]),
        ]);
        let folded = folded(&p, 3, ProcessFilter::All);
        assert_eq!(folded.get("main;a;b;malloc"), Some(&48));
        assert_eq!(
            folded.len(),
            1,
            "zero-valued stacks are left out: {folded:?}"
        );
        let alloc = super::folded(&p, 1, ProcessFilter::All);
        assert_eq!(alloc.get("main;c:d;calloc"), Some(&8));
        let top = top_sites(&p, 1, 0, ProcessFilter::All);
        assert_eq!(top[0].description, "malloc in b <- a <- main");
        assert_eq!(top[0].values, vec![3, 80, 2, 48]);
        assert_eq!(top[1].description, "calloc in c;d <- main");
    }

    #[test]
    fn sites_end_at_main() {
        let s = sample(
            1,
            &["malloc", "a", "main", "__libc_start_call_main", "_start"],
            [1; 4],
        );
        assert_eq!(site_description(&s), "malloc in a <- main");
        let deep = sample(1, &["malloc", "f1", "f2", "f3", "f4", "f5", "main"], [1; 4]);
        assert_eq!(site_description(&deep), "malloc in f1 <- f2 <- f3 <- f4");
    }

    #[test]
    fn several_processes_get_a_root_frame_unless_one_is_chosen() {
        let p = profile(vec![
            sample(1, &["malloc", "main"], [1, 8, 1, 8]),
            sample(2, &["malloc", "main"], [1, 4, 1, 4]),
        ]);
        let all = folded(&p, 3, ProcessFilter::All);
        assert_eq!(all.get("prog (1);main;malloc"), Some(&8));
        let one = folded(&p, 3, ProcessFilter::Pid(2));
        assert_eq!(
            one.into_iter().collect::<Vec<_>>(),
            [("main;malloc".to_owned(), 4)]
        );
    }

    #[test]
    fn diffs_cover_stacks_on_either_side() {
        let old = profile(vec![
            sample(1, &["malloc", "a", "main"], [1, 8, 1, 8]),
            sample(1, &["malloc", "gone", "main"], [1, 8, 1, 8]),
        ]);
        let new = profile(vec![
            sample(1, &["malloc", "a", "main"], [3, 24, 3, 24]),
            sample(1, &["malloc", "new", "main"], [1, 4, 1, 4]),
        ]);
        let diff = folded_diff(&old, &new, 3, ProcessFilter::All);
        assert_eq!(
            diff,
            [
                ("main;a;malloc".to_owned(), 8, 24),
                ("main;gone;malloc".to_owned(), 8, 0),
                ("main;new;malloc".to_owned(), 0, 4),
            ]
        );
        let mut sites = site_diff(&old, &new, ProcessFilter::All);
        sites.sort_by(|a, b| a.description.cmp(&b.description));
        assert_eq!(sites[0].values, vec![2, 16, 2, 16]);
        assert_eq!(sites[1].values, vec![-1, -8, -1, -8]);
    }
}
