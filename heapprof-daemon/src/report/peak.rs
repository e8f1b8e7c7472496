//! Who held the memory at the peak: each site's in-use value at the moment its
//! process's in-use total was highest (the `peak_inuse_*` sample types, exact from
//! the BPF programs), as heaptrack's peak consumption per site.

use std::fmt::Write as _;

use super::{
    model::Profile,
    stacks::{self, ProcessFilter, Site},
    units,
};

/// The `limit` sites (0: all) that held the most bytes at the peak, most first;
/// `None` when the profile does not record the peak's composition.
pub fn holders(profile: &Profile, limit: usize, filter: ProcessFilter) -> Option<Vec<Site>> {
    let index = profile.sample_index("peak_inuse_space").ok()?;
    Some(stacks::top_sites(profile, index, limit, filter))
}

/// The HTML report's table of the sites holding the peak, under its Peak section.
pub fn html_section(out: &mut String, profile: &Profile, limit: usize, filter: ProcessFilter) {
    let (Ok(bytes), Ok(objects)) = (
        profile.sample_index("peak_inuse_space"),
        profile.sample_index("peak_inuse_objects"),
    ) else {
        return;
    };
    let Some(sites) = holders(profile, limit, filter) else {
        return;
    };
    if sites.is_empty() {
        out.push_str(
            "<p class=\"note\">No site recorded at the peak (sampled sessions do not keep it).</p>",
        );
        return;
    }
    let total: i64 = stacks::sites(profile, filter)
        .iter()
        .map(|s| s.values[bytes])
        .sum();
    out.push_str(
        "<p class=\"note\">What each site held when the in-use total was at its peak.</p>\
         <table id=\"peak-sites\"><tr><th>bytes at the peak</th><th>blocks</th><th>share</th>\
         <th>site</th></tr>",
    );
    for site in &sites {
        let value = site.values[bytes];
        let share = if total > 0 {
            value as f64 * 100.0 / total as f64
        } else {
            0.0
        };
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{share:.1}%</td><td class=\"site\">{}</td></tr>",
            units::escape_html(&units::bytes(value as f64)),
            site.values[objects],
            units::escape_html(&site.description),
        );
    }
    out.push_str("</table>");
}
