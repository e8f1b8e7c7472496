//! `--format top`: the allocation sites holding the most, in the table the daemon's
//! own `--top` prints, or the change per site from a base profile.

use std::io::{self, Write};

use super::{
    model::Profile,
    stacks::{self, ProcessFilter, Site},
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

/// What to put in the table: sites sorted as they should be printed.
struct Table<'a> {
    title: String,
    sites: &'a [Site],
    columns: [Option<usize>; 4],
    signed: bool,
}

/// Writes the `limit` sites (0: all) of `profile` with the most of sample type `index`.
pub fn write(
    out: &mut dyn Write,
    profile: &Profile,
    index: usize,
    limit: usize,
    filter: ProcessFilter,
) -> io::Result<()> {
    let sites = stacks::top_sites(profile, index, limit, filter);
    let table = Table {
        title: format!(
            "Top allocation sites of {} by {} (in use / allocated in total):",
            profile.path.display(),
            profile.sample_types[index]
        ),
        sites: &sites,
        columns: column_indices(profile),
        signed: false,
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
        signed: true,
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
    writeln!(
        out,
        "{:>12} {:>9} {:>13} {:>10}  SITE",
        "LIVE BYTES", "LIVE", "TOTAL BYTES", "TOTAL"
    )?;
    for site in table.sites {
        let [inuse_bytes, inuse_objects, alloc_bytes, alloc_objects] =
            table
                .columns
                .map(|column| match column.and_then(|i| site.values.get(i)) {
                    Some(value) if table.signed => format!("{value:+}"),
                    Some(value) => value.to_string(),
                    None => "-".to_owned(),
                });
        writeln!(
            out,
            "{inuse_bytes:>12} {inuse_objects:>9} {alloc_bytes:>13} {alloc_objects:>10}  {}",
            site.description
        )?;
    }
    if table.sites.is_empty() {
        let what = if table.signed { "changed" } else { "any" };
        writeln!(out, "(no site has {what} {sample_type})")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::test_profiles::{PID, abc_profile, profile_of, text};

    #[test]
    fn prints_the_daemon_table_sorted_by_the_chosen_type() {
        let profile = abc_profile();
        let inuse = profile.sample_index("inuse_space").expect("type");
        let table = text(|out| write(out, &profile, inuse, 20, ProcessFilter::All));
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
        let table = text(|out| write(out, &freed, objects, 1, ProcessFilter::All));
        assert!(
            table
                .lines()
                .nth(2)
                .is_some_and(|l| l.ends_with("malloc in c <- main")),
            "{table}"
        );
        let inuse = text(|out| write(out, &freed, inuse, 1, ProcessFilter::All));
        assert!(inuse.contains("(no site has any inuse_space)"), "{inuse}");
    }

    #[test]
    fn unsymbolized_frames_show_as_file_and_offset() {
        let profile = profile_of(&[(&["malloc", "?", "main"], [1, 64, 1, 64])]);
        let table = text(|out| write(out, &profile, 3, 0, ProcessFilter::Pid(PID)));
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
