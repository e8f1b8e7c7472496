//! Reports of one profile (or the newest in a directory): top, collapsed, flamegraph, legacy.

use std::io::Write;

use anyhow::Result;

use super::ReportArgs;

/// Writes the report of one profile (PLACEHOLDER: owned by the formats work).
pub fn run(_args: &ReportArgs, _out: &mut dyn Write) -> Result<()> {
    anyhow::bail!("not built yet")
}
