//! `heapprofd report`: reading profiles back and turning them into tables,
//! flamegraphs, the legacy text format, timelines, leak suspects and an HTML page.
//!
//! [`model`] reads a file; [`stacks`] names its stacks and sites; one module per
//! output format; [`directory`] handles a session's directory of profiles.

pub mod cli;
pub mod directory;
pub mod flamegraph;
pub mod model;
pub mod single;
pub mod stacks;

use std::io::Write;

use anyhow::{Context as _, Result};

pub use cli::{Format, ReportArgs};

/// Runs `heapprofd report`.
pub fn run(args: &ReportArgs) -> Result<()> {
    let mut output = open_output(args)?;
    let session_wide =
        args.html.is_some() || matches!(args.format, Format::Timeline | Format::Suspects);
    if session_wide {
        directory::run(args, &mut output)?;
    } else {
        single::run(args, &mut output)?;
    }
    output.flush().context("writing the report")
}

/// Standard output, or the `-o` file.
fn open_output(args: &ReportArgs) -> Result<Box<dyn Write>> {
    Ok(match &args.output {
        Some(path) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| {
                format!("cannot create {}; choose another -o OUT", path.display())
            })?,
        )),
        None => Box::new(std::io::BufWriter::new(std::io::stdout().lock())),
    })
}
