//! `--format sizes`: allocations and bytes per power-of-two size class, allocated and
//! in use, for the whole profile and for its top sites; in kernel profiles with the
//! bytes requested beside those allocated (the waste per class).
//!
//! User-space samples carry their class (the `size_class` label: a stack that
//! allocates several sizes is one sample per class). Kernel samples are one slab
//! cache, kmalloc size or page order each, so their object size is exact: allocated
//! bytes over objects. A profile without either (written before size classes
//! existed) is classed by each sample's average object size, and the report says so.

use std::{
    collections::{BTreeMap, HashMap},
    io::{self, Write},
};

use super::{
    model::{Profile, Sample},
    stacks::{self, ProcessFilter},
    units,
};

/// Sites whose classes are listed after the profile's, at most.
pub const MAX_SITES: usize = 10;

/// One size class's totals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClassTotals {
    /// Blocks allocated.
    pub alloc_objects: i64,
    /// Bytes allocated.
    pub alloc_space: i64,
    /// Blocks in use.
    pub inuse_objects: i64,
    /// Bytes in use.
    pub inuse_space: i64,
    /// Bytes requested (kernel profiles; `None` elsewhere).
    pub requested: Option<i64>,
}

impl ClassTotals {
    fn add(&mut self, more: &ClassTotals) {
        self.alloc_objects += more.alloc_objects;
        self.alloc_space += more.alloc_space;
        self.inuse_objects += more.inuse_objects;
        self.inuse_space += more.inuse_space;
        if let Some(requested) = more.requested {
            *self.requested.get_or_insert(0) += requested;
        }
    }
}

/// Size classes by their smallest size (0 for empty requests), smallest first.
pub type Histogram = BTreeMap<u64, ClassTotals>;

/// Where the values the histogram needs are among a profile's sample types.
#[derive(Debug, Clone, Copy)]
struct Columns {
    alloc_objects: usize,
    alloc_space: usize,
    inuse_objects: usize,
    inuse_space: usize,
    requested: Option<usize>,
}

impl Columns {
    fn of(profile: &Profile) -> Option<Self> {
        let index = |name: &str| profile.sample_types.iter().position(|t| t == name);
        Some(Self {
            alloc_objects: index("alloc_objects")?,
            alloc_space: index("alloc_space")?,
            inuse_objects: index("inuse_objects")?,
            inuse_space: index("inuse_space")?,
            requested: index("alloc_requested_space"),
        })
    }

    fn totals(&self, sample: &Sample) -> ClassTotals {
        let value = |i: usize| sample.values.get(i).copied().unwrap_or(0);
        ClassTotals {
            alloc_objects: value(self.alloc_objects),
            alloc_space: value(self.alloc_space),
            inuse_objects: value(self.inuse_objects),
            inuse_space: value(self.inuse_space),
            requested: self.requested.map(value),
        }
    }
}

/// The smallest size of the power-of-two class holding `size` (0 for 0).
pub fn class_floor(size: u64) -> u64 {
    if size == 0 { 0 } else { 1 << size.ilog2() }
}

/// `256 KiB`: a power of two in the largest binary unit it is a whole number of.
pub fn power_of_two(size: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut value = size;
    let mut unit = 0;
    while value >= 1024 && value.is_multiple_of(1024) && unit + 1 < UNITS.len() {
        value /= 1024;
        unit += 1;
    }
    format!("{value} {}", UNITS[unit])
}

/// A class's row label: `256 KiB - 512 KiB` (the upper bound excluded), `0 B`.
pub fn class_label(floor: u64) -> String {
    match floor.checked_mul(2) {
        _ if floor == 0 => "0 B".to_owned(),
        Some(ceiling) => format!("{} - {}", power_of_two(floor), power_of_two(ceiling)),
        None => format!("{} -", power_of_two(floor)),
    }
}

/// How a profile's samples get their class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClassSource {
    /// The `size_class` labels (exact).
    Labels,
    /// Each kernel sample's object size (exact: one cache, size or order each).
    ObjectSizes,
    /// Each sample's average object size (approximate).
    Averages,
}

/// The size classes of a profile's samples.
#[derive(Debug, Clone)]
pub struct Sizes {
    /// How the samples were classed.
    pub source: ClassSource,
    /// The whole profile's classes (the samples `filter` admits).
    pub total: Histogram,
    /// The top sites by the chosen sample type, most first, each with its classes.
    pub sites: Vec<(String, Histogram)>,
}

/// Classes `profile`'s samples; `None` if it lacks the four heap sample types.
pub fn sizes(profile: &Profile, index: usize, top: usize, filter: ProcessFilter) -> Option<Sizes> {
    let columns = Columns::of(profile)?;
    let source = if profile.samples.iter().any(|s| s.size_class.is_some()) {
        ClassSource::Labels
    } else if columns.requested.is_some() {
        ClassSource::ObjectSizes
    } else {
        ClassSource::Averages
    };
    let mut total = Histogram::new();
    let mut per_site: HashMap<String, Histogram> = HashMap::new();
    for sample in profile.samples.iter().filter(|s| filter.admits(s)) {
        let totals = columns.totals(sample);
        let floor = match (source, sample.size_class) {
            (ClassSource::Labels, Some(floor)) => u64::try_from(floor).unwrap_or(0),
            _ => class_floor(object_size(&totals)),
        };
        total.entry(floor).or_default().add(&totals);
        per_site
            .entry(stacks::site_description(sample))
            .or_default()
            .entry(floor)
            .or_default()
            .add(&totals);
    }
    let sites = stacks::top_sites(profile, index, top.min(MAX_SITES), filter)
        .into_iter()
        .filter_map(|site| {
            let classes = per_site.remove(&site.description)?;
            Some((site.description, classes))
        })
        .collect();
    Some(Sizes {
        source,
        total,
        sites,
    })
}

/// A sample's object size: its allocated bytes over its objects (in use when none
/// were counted as allocated, as in a difference).
fn object_size(totals: &ClassTotals) -> u64 {
    let (objects, bytes) = if totals.alloc_objects > 0 {
        (totals.alloc_objects, totals.alloc_space)
    } else {
        (totals.inuse_objects, totals.inuse_space)
    };
    if objects <= 0 || bytes <= 0 {
        0
    } else {
        (bytes / objects) as u64
    }
}

/// Writes the size classes of `profile` and of its top `top` sites by sample type
/// `index`.
pub fn write(
    out: &mut dyn Write,
    profile: &Profile,
    index: usize,
    top: usize,
    filter: ProcessFilter,
) -> io::Result<()> {
    writeln!(
        out,
        "Size classes of {} (allocated in total / in use):",
        profile.path.display()
    )?;
    for loss in super::losses::losses(&profile.comments) {
        writeln!(out, "{}", loss.line())?;
    }
    let Some(sizes) = sizes(profile, index, top, filter) else {
        return writeln!(
            out,
            "(the profile has no alloc/inuse objects and space: not a heap profile)"
        );
    };
    match sizes.source {
        ClassSource::Labels => {}
        ClassSource::ObjectSizes => writeln!(
            out,
            "(kernel objects by their allocated size; REQUESTED is what callers asked for)"
        )?,
        ClassSource::Averages => writeln!(
            out,
            "(approximate: the profile has no size_class labels, so each stack is classed \
             by its average block size)"
        )?,
    }
    let kernel = sizes.source == ClassSource::ObjectSizes;
    print_histogram(out, &sizes.total, kernel, "")?;
    if sizes.sites.is_empty() {
        return Ok(());
    }
    writeln!(out)?;
    writeln!(
        out,
        "Top {} sites by {}:",
        sizes.sites.len(),
        profile.sample_types[index]
    )?;
    for (description, classes) in &sizes.sites {
        writeln!(out)?;
        writeln!(out, "  {description}")?;
        print_histogram(out, classes, kernel, "  ")?;
    }
    Ok(())
}

/// One table of classes, with a total line when it has more than one.
fn print_histogram(
    out: &mut dyn Write,
    classes: &Histogram,
    kernel: bool,
    indent: &str,
) -> io::Result<()> {
    write!(
        out,
        "{indent}{:<21} {:>10} {:>13} {:>9} {:>12}",
        "SIZE CLASS", "ALLOCS", "ALLOC BYTES", "LIVE", "LIVE BYTES"
    )?;
    if kernel {
        write!(out, " {:>13} {:>6}", "REQUESTED", "WASTE")?;
    }
    writeln!(out)?;
    let mut sum = ClassTotals::default();
    for (&floor, totals) in classes {
        print_row(out, &class_label(floor), totals, kernel, indent)?;
        sum.add(totals);
    }
    if classes.len() > 1 {
        print_row(out, "total", &sum, kernel, indent)?;
    }
    Ok(())
}

fn print_row(
    out: &mut dyn Write,
    label: &str,
    totals: &ClassTotals,
    kernel: bool,
    indent: &str,
) -> io::Result<()> {
    write!(
        out,
        "{indent}{label:<21} {:>10} {:>13} {:>9} {:>12}",
        totals.alloc_objects, totals.alloc_space, totals.inuse_objects, totals.inuse_space
    )?;
    if kernel {
        let requested = totals.requested.unwrap_or(0);
        let waste = units::waste_percent(requested, totals.alloc_space)
            .map_or_else(|| "-".to_owned(), |w| format!("{w:.1}%"));
        write!(out, " {requested:>13} {waste:>6}")?;
    }
    writeln!(out)
}

/// The HTML report's size-class section for `profile` (its last profile): one row
/// per class with a bar of its share of the allocations.
pub fn html_section(out: &mut String, profile: &Profile, filter: ProcessFilter) {
    use std::fmt::Write as _;
    let Some(index) = profile.sample_types.iter().position(|t| t == "alloc_space") else {
        return;
    };
    let Some(sizes) = sizes(profile, index, 0, filter) else {
        return;
    };
    if sizes.total.is_empty() {
        return;
    }
    let kernel = sizes.source == ClassSource::ObjectSizes;
    let most = sizes
        .total
        .values()
        .map(|t| t.alloc_objects)
        .max()
        .unwrap_or(0)
        .max(1);
    let note = match sizes.source {
        ClassSource::Labels => "Power-of-two classes of the sizes requested, in the last profile.",
        ClassSource::ObjectSizes => "Power-of-two classes of the kernel objects' allocated sizes.",
        ClassSource::Averages => {
            "Approximate: the profile has no size_class labels, so each stack is classed by its \
             average block size."
        }
    };
    let _ = write!(
        out,
        "<h2>Size classes</h2><p class=\"note\">{note}</p><table id=\"sizes\"><tr>\
         <th>size class</th><th>allocations</th><th>bytes allocated</th><th>in use</th>\
         <th>bytes in use</th>"
    );
    if kernel {
        out.push_str("<th>requested</th><th>waste %</th>");
    }
    out.push_str("<th>share of allocations</th></tr>");
    for (&floor, totals) in &sizes.total {
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>",
            units::escape_html(&class_label(floor)),
            totals.alloc_objects,
            units::escape_html(&units::bytes(totals.alloc_space as f64)),
            totals.inuse_objects,
            units::escape_html(&units::bytes(totals.inuse_space as f64)),
        );
        if kernel {
            let requested = totals.requested.unwrap_or(0);
            let waste = units::waste_percent(requested, totals.alloc_space).unwrap_or(0.0);
            let _ = write!(
                out,
                "<td>{}</td><td>{waste:.1}</td>",
                units::escape_html(&units::bytes(requested as f64))
            );
        }
        let width = (totals.alloc_objects.max(0) as f64 * 300.0 / most as f64).round();
        let _ = write!(
            out,
            "<td class=\"site\"><span class=\"bar\" style=\"width:{width}px\"></span></td></tr>"
        );
    }
    out.push_str("</table>");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::test_profiles::{abc_profile, kernel_profile, text};

    #[test]
    fn classes_are_powers_of_two() {
        assert_eq!(class_floor(0), 0);
        assert_eq!(class_floor(1), 1);
        assert_eq!(class_floor(3), 2);
        assert_eq!(class_floor(256 << 10), 256 << 10);
        assert_eq!(class_floor((512 << 10) - 1), 256 << 10);
        assert_eq!(class_label(256 << 10), "256 KiB - 512 KiB");
        assert_eq!(class_label(512), "512 B - 1 KiB");
        assert_eq!(class_label(0), "0 B");
        assert_eq!(class_label(1 << 63), "8 EiB -");
        // The daemon's classes (the label's value) are these classes.
        for size in [0u64, 1, 2, 3, 64, 100, 4096, (1 << 20) + 1, u64::MAX] {
            assert_eq!(
                heapprof_common::size_class_floor(heapprof_common::size_class(size)),
                class_floor(size),
                "{size}"
            );
        }
    }

    #[test]
    fn unlabelled_profiles_are_classed_by_average_size_and_say_so() {
        let profile = abc_profile();
        let index = profile.sample_index("inuse_space").expect("type");
        let report = text(|out| write(out, &profile, index, 20, ProcessFilter::All));
        assert!(report.contains("approximate"), "{report}");
        // a() holds one block of 1000 bytes: class 512 B - 1 KiB.
        assert!(report.contains("512 B - 1 KiB"), "{report}");
        assert!(report.contains("malloc in a <- main"), "{report}");
    }

    #[test]
    fn kernel_profiles_show_the_waste_per_class() {
        // Ten kmalloc-64 objects for 40 bytes each, four pages of order 0.
        let profile = kernel_profile(&[
            (
                &["kmalloc", "foo"],
                Some("kmalloc-64"),
                [10, 640, 2, 128, 400, 80],
            ),
            (
                &["mm_page_alloc", "bar"],
                None,
                [4, 16384, 1, 4096, 16384, 4096],
            ),
        ]);
        let index = profile.sample_index("alloc_space").expect("type");
        let report = text(|out| write(out, &profile, index, 20, ProcessFilter::All));
        assert!(!report.contains("approximate"), "{report}");
        let row = |label: &str| {
            report
                .lines()
                .find(|l| l.starts_with(label))
                .unwrap_or_else(|| panic!("no row {label}: {report}"))
                .split_whitespace()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            row("64 B - 128 B")[5..],
            ["10", "640", "2", "128", "400", "37.5%"],
            "{report}"
        );
        assert_eq!(
            row("4 KiB - 8 KiB")[5..],
            ["4", "16384", "1", "4096", "16384", "0.0%"],
            "{report}"
        );
        assert_eq!(
            row("total")[1..],
            ["14", "17024", "3", "4224", "16784", "1.4%"]
        );

        let mut html = String::new();
        html_section(&mut html, &profile, ProcessFilter::All);
        assert!(html.contains("<h2>Size classes</h2>"), "{html}");
        assert!(html.contains("<td>64 B - 128 B</td><td>10</td>"), "{html}");
        assert!(html.contains("<td>37.5</td>"), "{html}");
    }
}
