//! The flags of `heapprofd report`.

use std::path::PathBuf;

use clap::Parser;

use super::stacks::Grouping;

/// Read heapprofd's profiles back: tables, folded stacks, flamegraphs, the gperftools
/// text format, and over a session's directory, the in-use timeline, leak suspects
/// and one self-contained HTML page.
#[derive(Debug, Parser)]
#[command(
    name = "heapprofd report",
    bin_name = "heapprofd report",
    after_help = "Examples:\n  \
                  heapprofd report heap-...pb.gz                    the top sites by in-use bytes\n  \
                  heapprofd report NEW.pb.gz --base OLD.pb.gz       what grew between two profiles\n  \
                  heapprofd report KERNEL.pb.gz --by cache          kernel memory per slab cache\n  \
                  heapprofd report DIR --format suspects            sites whose in-use keeps growing\n  \
                  heapprofd report heap-...pb.gz --format sizes     size histogram, per top site too\n  \
                  heapprofd report DIR --html report.html           everything, one page\n\
                  Given a directory, the single-profile formats read its newest profile."
)]
pub struct ReportArgs {
    /// A profile (.pb.gz), or a session's output directory.
    #[arg(value_name = "PROFILE|DIR")]
    pub input: PathBuf,

    /// What to write.
    #[arg(long, value_enum, default_value_t = Format::Top)]
    pub format: Format,

    /// The sample type to report: inuse_space, inuse_objects, alloc_space or
    /// alloc_objects (kernel profiles add *_requested_space).
    #[arg(long, value_name = "TYPE", default_value = "inuse_space")]
    pub sample_index: String,

    /// Report the difference from this older profile (top, collapsed, flamegraph).
    #[arg(long, value_name = "OLD")]
    pub base: Option<PathBuf>,

    /// Only this process (profiles of --all hold many; the legacy format needs one).
    #[arg(long, value_name = "PID")]
    pub pid: Option<u32>,

    /// What the rows of the top table are: allocation sites, or (kernel profiles) slab
    /// caches and kmalloc size classes, or page orders.
    #[arg(long, value_enum, default_value_t = Grouping::Site)]
    pub by: Grouping,

    /// Rows of the top table; sites per process in the timeline.
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub top: usize,

    /// Write one self-contained HTML page of the session (timeline, RSS beside the heap,
    /// the peak, suspects, a flamegraph of every profile, the top table) to this file.
    #[arg(long, value_name = "OUT.html")]
    pub html: Option<PathBuf>,

    /// Write the output to this file instead of standard output.
    #[arg(short, long, value_name = "OUT")]
    pub output: Option<PathBuf>,
}

/// The output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// The sites holding the most, as `--top` prints them.
    Top,
    /// Folded stacks, one line per stack (`main;a;b;malloc 4194304`).
    Collapsed,
    /// A flamegraph SVG (differential with --base).
    Flamegraph,
    /// gperftools' heap-profile text format, with MAPPED_LIBRARIES (google-pprof reads it).
    Legacy,
    /// CSV over a session's directory: in-use per process and per top site at each profile.
    Timeline,
    /// Sites whose in-use bytes keep growing across a session, ranked.
    Suspects,
    /// Allocations and bytes per power-of-two size class (allocated and in use), for
    /// the profile and its top sites; kernel profiles add requested bytes and waste.
    Sizes,
}
