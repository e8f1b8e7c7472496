//! Reports over a session's directory: timeline, suspects, the HTML page.

use std::io::Write;

use anyhow::Result;

use super::ReportArgs;

/// Writes a session-wide report (PLACEHOLDER: owned by the session work).
pub fn run(_args: &ReportArgs, _out: &mut dyn Write) -> Result<()> {
    anyhow::bail!("not built yet")
}
