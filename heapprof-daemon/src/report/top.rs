//! `--format top`: the allocation sites holding the most, in the table the daemon's
//! own `--top` prints, or the change per site from a base profile.

use std::io::{self, Write};

use super::{
    model::Profile,
    stacks::{self, Grouping, ProcessFilter, Site},
};

/// The table's value columns, by sample type, in the order `--top` prints them.
const COLUMNS: [&str; 4] = [
    "inuse_space",
    "inuse_objects",
    "alloc_space",
    "alloc_objects",
];

/// Where each of [`COLUMNS`] is among a profile's sample types.
fn column_indices(profile: &Profile) -> [Option<usize>; 4] {
    COLUMNS.map(|name| profile.sample_types.iter().position(|t| t == name))
}

/// Where a kernel profile's requested bytes and allocated bytes are, for the
/// REQUESTED and WASTE columns (as `perf kmem stat --caller` shows them).
fn waste_indices(profile: &Profile) -> Option<(usize, usize)> {
    let index = |name: &str| profile.sample_types.iter().position(|t| t == name);
    Some((index("alloc_requested_space")?, index("alloc_space")?))
}

/// Where a user-space profile's bytes at the peak and temporary allocations are, for
/// the PEAK BYTES and TEMP columns (heaptrack's peak consumption and temporaries).
fn view_indices(profile: &Profile) -> Option<(usize, usize)> {
    let index = |name: &str| profile.sample_types.iter().position(|t| t == name);
    Some((index("peak_inuse_space")?, index("temp_objects")?))
}

/// What to put in the table: sites sorted as they should be printed.
struct Table<'a> {
    title: String,
    sites: &'a [Site],
    columns: [Option<usize>; 4],
    /// Requested and allocated bytes (kernel profiles).
    waste: Option<(usize, usize)>,
    /// Bytes at the peak and temporary allocations (user-space profiles).
    views: Option<(usize, usize)>,
    signed: bool,
    /// What the profile lost (see [`super::losses`]), stated above the table.
    losses: Vec<super::losses::Loss>,
}

/// Writes the `limit` sites (0: all) of `profile` with the most of sample type `index`.
pub fn write(
    out: &mut dyn Write,
    profile: &Profile,
    index: usize,
    limit: usize,
    filter: ProcessFilter,
    by: Grouping,
) -> io::Result<()> {
    let sites = stacks::top_groups(profile, index, limit, filter, by);
    let rows = match by {
        Grouping::Site => "allocation sites",
        Grouping::Cache => "slab caches",
        Grouping::Order => "page orders",
    };
    let table = Table {
        title: format!(
            "Top {rows} of {} by {} (in use / allocated in total):",
            profile.path.display(),
            profile.sample_types[index]
        ),
        sites: &sites,
        columns: column_indices(profile),
        waste: waste_indices(profile),
        views: view_indices(profile),
        signed: false,
        losses: super::losses::losses(&profile.comments),
    };
    print(out, &table, &profile.sample_types[index])
}

/// Writes the `limit` sites (0: all) whose sample type `index` changed the most from
/// `base` to `profile`, signed. The profiles must have the same sample types.
pub fn write_diff(
    out: &mut dyn Write,
    base: &Profile,
    profile: &Profile,
    index: usize,
    limit: usize,
    filter: ProcessFilter,
) -> io::Result<()> {
    let sites = biggest_changes(stacks::site_diff(base, profile, filter), index, limit);
    let table = Table {
        title: format!(
            "Change per allocation site by {} from {} to {} (in use / allocated in total):",
            profile.sample_types[index],
            base.path.display(),
            profile.path.display()
        ),
        sites: &sites,
        columns: column_indices(profile),
        waste: waste_indices(profile),
        views: view_indices(profile),
        signed: true,
        losses: super::losses::losses(&profile.comments),
    };
    print(out, &table, &profile.sample_types[index])
}

/// The `limit` sites (0: all) whose value `index` changed, biggest change (either way)
/// first, ties broken by description so the order is stable.
fn biggest_changes(mut sites: Vec<Site>, index: usize, limit: usize) -> Vec<Site> {
    sites.retain(|s| s.values[index] != 0);
    sites.sort_by(|a, b| {
        b.values[index]
            .unsigned_abs()
            .cmp(&a.values[index].unsigned_abs())
            .then_with(|| a.description.cmp(&b.description))
    });
    if limit > 0 {
        sites.truncate(limit);
    }
    sites
}

/// The layout of `heapprofd --top` (see `app::run::print_top`), `-` for a sample type
/// the profile lacks.
fn print(out: &mut dyn Write, table: &Table, sample_type: &str) -> io::Result<()> {
    writeln!(out, "{}", table.title)?;
    for loss in &table.losses {
        writeln!(out, "{}", loss.line())?;
    }
    write!(
        out,
        "{:>12} {:>9} {:>13} {:>10}",
        "LIVE BYTES", "LIVE", "TOTAL BYTES", "TOTAL"
    )?;
    if table.waste.is_some() {
        write!(out, " {:>13} {:>6}", "REQUESTED", "WASTE")?;
    }
    if table.views.is_some() {
        write!(out, " {:>12} {:>9}", "PEAK BYTES", "TEMP")?;
    }
    writeln!(out, "  SITE")?;
    for site in table.sites {
        let [inuse_bytes, inuse_objects, alloc_bytes, alloc_objects] =
            table
                .columns
                .map(|column| match column.and_then(|i| site.values.get(i)) {
                    Some(value) if table.signed => format!("{value:+}"),
                    Some(value) => value.to_string(),
                    None => "-".to_owned(),
                });
        write!(
            out,
            "{inuse_bytes:>12} {inuse_objects:>9} {alloc_bytes:>13} {alloc_objects:>10}"
        )?;
        if let Some((requested, allocated)) = table.waste {
            let requested = site.values.get(requested).copied().unwrap_or(0);
            let allocated = site.values.get(allocated).copied().unwrap_or(0);
            let requested_text = if table.signed {
                format!("{requested:+}")
            } else {
                requested.to_string()
            };
            write!(
                out,
                " {requested_text:>13} {:>6}",
                waste_percent(requested, allocated)
            )?;
        }
        if let Some((peak, temporary)) = table.views {
            let [peak, temporary] = [peak, temporary].map(|i| {
                let value = site.values.get(i).copied().unwrap_or(0);
                if table.signed {
                    format!("{value:+}")
                } else {
                    value.to_string()
                }
            });
            write!(out, " {peak:>12} {temporary:>9}")?;
        }
        writeln!(out, "  {}", site.description)?;
    }
    if table.sites.is_empty() {
        let what = if table.signed { "changed" } else { "any" };
        writeln!(out, "(no site has {what} {sample_type})")?;
    }
    Ok(())
}

/// The share of `allocated` bytes nobody asked for, as `12.5%` (`-` without bytes).
fn waste_percent(requested: i64, allocated: i64) -> String {
    super::units::waste_percent(requested, allocated)
        .map_or_else(|| "-".to_owned(), |waste| format!("{waste:.1}%"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::test_profiles::{PID, abc_profile, kernel_profile, profile_of, text};

    /// Two getname_flags samples of names_cache and one kmalloc-192 sample, values
    /// (alloc objects, alloc bytes, in-use objects, in-use bytes, requested, in-use
    /// requested).
    fn slab_profile() -> Profile {
        let getname: &[&str] = &[
            "kmem_cache_alloc",
            "kmem_cache_alloc_noprof",
            "getname_flags",
            "do_sys_openat2",
        ];
        let other: &[&str] = &[
            "kmem_cache_alloc",
            "kmem_cache_alloc_noprof",
            "getname_flags",
            "__x64_sys_unlink",
        ];
        let kmalloc: &[&str] = &["kmalloc", "__kmalloc_cache_noprof", "alloc_pipe_info"];
        kernel_profile(&[
            (getname, Some("names_cache"), [4, 16384, 1, 4096, 400, 100]),
            (other, Some("names_cache"), [2, 8192, 0, 0, 200, 0]),
            (
                kmalloc,
                Some("kmalloc-192"),
                [10, 1920, 10, 1920, 1600, 1600],
            ),
        ])
    }

    #[test]
    fn kernel_sites_are_named_after_the_allocators_caller_with_their_waste() {
        let profile = slab_profile();
        let alloc = profile.sample_index("alloc_space").expect("type");
        let table = text(|out| write(out, &profile, alloc, 0, ProcessFilter::All, Grouping::Site));
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[1].ends_with("REQUESTED  WASTE  SITE"), "{table}");
        assert_eq!(
            lines[2],
            "        4096         1         16384          4           400  97.6%  \
             kmem_cache_alloc in getname_flags <- do_sys_openat2"
        );
        assert!(
            lines[4].ends_with("1600  16.7%  kmalloc in alloc_pipe_info"),
            "{table}"
        );
        // Sorted by requested bytes, the kmalloc site leads.
        let requested = profile.sample_index("alloc_requested_space").expect("type");
        let table = text(|out| {
            write(
                out,
                &profile,
                requested,
                1,
                ProcessFilter::All,
                Grouping::Site,
            )
        });
        assert!(
            table
                .lines()
                .nth(2)
                .is_some_and(|l| l.ends_with("kmalloc in alloc_pipe_info")),
            "{table}"
        );
    }

    #[test]
    fn kernel_tables_group_by_slab_cache() {
        let profile = slab_profile();
        let alloc = profile.sample_index("alloc_space").expect("type");
        let table = text(|out| write(out, &profile, alloc, 0, ProcessFilter::All, Grouping::Cache));
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("Top slab caches of"), "{table}");
        assert_eq!(
            lines[2],
            "        4096         1         24576          6           600  97.6%  names_cache"
        );
        assert!(lines[3].ends_with("  kmalloc-192"), "{table}");
        assert_eq!(lines.len(), 4, "{table}");
    }

    #[test]
    fn prints_the_daemon_table_sorted_by_the_chosen_type() {
        let profile = abc_profile();
        let inuse = profile.sample_index("inuse_space").expect("type");
        let table = text(|out| write(out, &profile, inuse, 20, ProcessFilter::All, Grouping::Site));
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].contains("by inuse_space"), "{table}");
        assert_eq!(
            lines[1],
            "  LIVE BYTES      LIVE   TOTAL BYTES      TOTAL  SITE"
        );
        assert_eq!(
            lines[2],
            "        1000         1          1000          1  malloc in a <- main"
        );
        assert_eq!(lines.len(), 5, "{table}");
        // b <- a <- main holds 100 bytes, b <- main 100 too; ties go by name.
        assert!(lines[3].ends_with("malloc in b <- a <- main"), "{table}");
        assert!(lines[4].ends_with("malloc in b <- main"), "{table}");

        // By allocated objects the freed site leads; --top 1 keeps only it.
        let freed = profile_of(&[(&["malloc", "c", "main"], [5, 50, 0, 0])]);
        let objects = freed.sample_index("alloc_objects").expect("type");
        let table = text(|out| write(out, &freed, objects, 1, ProcessFilter::All, Grouping::Site));
        assert!(
            table
                .lines()
                .nth(2)
                .is_some_and(|l| l.ends_with("malloc in c <- main")),
            "{table}"
        );
        let inuse = text(|out| write(out, &freed, inuse, 1, ProcessFilter::All, Grouping::Site));
        assert!(inuse.contains("(no site has any inuse_space)"), "{inuse}");
    }

    #[test]
    fn a_profile_that_lost_data_says_so_above_the_table() {
        let mut profile = abc_profile();
        let inuse = profile.sample_index("inuse_space").expect("type");
        let clean = text(|out| write(out, &profile, inuse, 20, ProcessFilter::All, Grouping::Site));
        assert!(!clean.contains("lost:"), "{clean}");
        let full = heapprof_common::DropReason::LiveTableFull.describe();
        profile.comments.push(format!("dropped: {full} = 42"));
        let table = text(|out| write(out, &profile, inuse, 20, ProcessFilter::All, Grouping::Site));
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(
            lines[1],
            format!("lost: 42 events: {full} (raise --max-live-blocks)"),
            "{table}"
        );
        assert!(lines[2].contains("LIVE BYTES"), "{table}");
    }

    #[test]
    fn unsymbolized_frames_show_as_file_and_offset() {
        let profile = profile_of(&[(&["malloc", "?", "main"], [1, 64, 1, 64])]);
        let table = text(|out| write(out, &profile, 3, 0, ProcessFilter::Pid(PID), Grouping::Site));
        assert!(table.contains("malloc in prog+0x1f00 <- main"), "{table}");
    }

    #[test]
    fn a_diff_is_signed_and_sorted_by_the_size_of_the_change() {
        let old = profile_of(&[
            (&["malloc", "a", "main"], [1, 1000, 1, 1000]),
            (&["malloc", "b", "main"], [1, 100, 1, 100]),
        ]);
        let new = profile_of(&[
            (&["malloc", "a", "main"], [1, 1000, 0, 0]),
            (&["malloc", "b", "main"], [3, 300, 3, 300]),
        ]);
        let table = text(|out| write_diff(out, &old, &new, 3, 0, ProcessFilter::All));
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("Change per allocation site by inuse_space"));
        assert_eq!(
            lines[2],
            "       -1000        -1            +0         +0  malloc in a <- main"
        );
        assert_eq!(
            lines[3],
            "        +200        +2          +200         +2  malloc in b <- main"
        );
        assert_eq!(lines.len(), 4, "{table}");
        let same = text(|out| write_diff(out, &old, &old, 3, 0, ProcessFilter::All));
        assert!(same.contains("(no site has changed inuse_space)"), "{same}");
    }
}
