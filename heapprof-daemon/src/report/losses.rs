//! What a profile lost, from its comments: every report format states it, so that a
//! table that overflowed never reads as a complete one.
//!
//! The daemon writes one comment per drop reason (`heapprof_common::DropReason`),
//! `dropped: <description> [<name>] = <count>` ([`drop_comment`]): the stable name
//! is what a reader keys by, the description is for people. Profiles written before
//! the name was added (`dropped: <description> = <count>`) are still read, by their
//! description. Kernel sessions that cannot see deferred frees add an
//! `undercounted: ...` comment.

use heapprof_common::DropReason;

/// One kind of loss in a profile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loss {
    /// What was lost, as the daemon describes it.
    pub what: String,
    /// The drop reason, when the comment names one heapprofd knows.
    pub reason: Option<DropReason>,
    /// How many events (`None`: a statement without a count).
    pub count: Option<u64>,
    /// What the user can do about it.
    pub remedy: Option<&'static str>,
    /// Whether blocks went untracked, so in-use totals and peaks are too low.
    pub untracked_blocks: bool,
}

impl Loss {
    /// One line for tables, logs and banners.
    pub fn line(&self) -> String {
        let mut line = match self.count {
            Some(count) => format!("lost: {count} events: {}", self.what),
            None => format!("lost: {}", self.what),
        };
        if let Some(remedy) = self.remedy {
            line.push_str(&format!(" ({remedy})"));
        }
        line
    }
}

/// How a comment counting drops begins.
const DROPPED: &str = "dropped: ";

/// How a comment stating an undercount begins; the statement after it is for people.
const UNDERCOUNTED: &str = "undercounted: ";

/// The profile comment of `count` drops for `reason`.
pub fn drop_comment(reason: DropReason, count: u64) -> String {
    crate::pprof::keyed_comments::keyed(
        &format!("{DROPPED}{}", reason.describe()),
        reason.name(),
        count,
    )
}

/// What a suspect's row says when the profile undercounts frees (a kernel session
/// that cannot see every deferred free, or whose programs the kernel skipped): its
/// in-use may be objects freed unseen, not a leak.
pub const FREES_UNDERCOUNTED: &str = "frees undercounted: in-use may be overstated";

/// The profile comment stating that frees are undercounted, and why (`statement`):
/// what [`frees_undercounted`] and [`losses`] find.
pub fn undercounted_comment(statement: &str) -> String {
    format!("{UNDERCOUNTED}{statement}")
}

/// Whether `comments` say frees went uncounted (an [`undercounted_comment`]).
pub fn frees_undercounted<S: AsRef<str>>(comments: &[S]) -> bool {
    comments
        .iter()
        .any(|c| c.as_ref().starts_with(UNDERCOUNTED))
}

/// The losses `comments` record, in the order written.
pub fn losses<S: AsRef<str>>(comments: &[S]) -> Vec<Loss> {
    comments.iter().filter_map(|c| parse(c.as_ref())).collect()
}

/// The loss one comment records, if it records one.
fn parse(comment: &str) -> Option<Loss> {
    if let Some(statement) = comment.strip_prefix(UNDERCOUNTED) {
        return Some(Loss {
            what: statement.to_owned(),
            reason: None,
            count: None,
            remedy: None,
            untracked_blocks: false,
        });
    }
    let (what, count) = comment.strip_prefix(DROPPED)?.rsplit_once(" = ")?;
    let count: u64 = count.trim().parse().ok()?;
    if count == 0 {
        return None;
    }
    let (what, reason) = match what.rsplit_once(" [") {
        Some((text, name)) if name.ends_with(']') => {
            let name = name.trim_end_matches(']');
            (text, DropReason::ALL.into_iter().find(|r| r.name() == name))
        }
        // Written before drops carried their name.
        _ => (
            what,
            DropReason::ALL.into_iter().find(|r| r.describe() == what),
        ),
    };
    Some(Loss {
        what: what.to_owned(),
        reason,
        count: Some(count),
        remedy: reason.map(DropReason::remedy),
        untracked_blocks: reason.is_some_and(|r| {
            matches!(
                r,
                DropReason::LiveTableFull | DropReason::SiteTableFull | DropReason::InFlightFull
            )
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn comments(lines: &[&str]) -> Vec<String> {
        lines.iter().map(|l| (*l).to_owned()).collect()
    }

    #[test]
    fn drops_with_a_count_and_statements_are_losses_zero_counts_are_not() {
        let full = DropReason::LiveTableFull.describe();
        let found = losses(&comments(&[
            "heapprofd 0.1.0",
            &format!("dropped: {full} = 1800000"),
            &format!("dropped: {} = 0", DropReason::StackTableFull.describe()),
            "undercounted: objects released with kfree_rcu() ...",
        ]));
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(
            found[0].line(),
            format!("lost: 1800000 events: {full} (raise --max-live-blocks)")
        );
        assert!(found[0].untracked_blocks);
        assert_eq!(
            found[1].line(),
            "lost: objects released with kfree_rcu() ..."
        );
        assert!(!found[1].untracked_blocks);
    }

    #[test]
    fn drops_are_keyed_by_name_whatever_their_wording() {
        let written = drop_comment(DropReason::SiteTableFull, 12);
        let found = losses(&comments(&[&written]));
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].reason, Some(DropReason::SiteTableFull));
        assert_eq!(found[0].what, DropReason::SiteTableFull.describe());
        assert_eq!(found[0].count, Some(12));
        assert!(found[0].untracked_blocks);
        // Reworded: the name still finds the reason and its remedy.
        let reworded = losses(&comments(&[
            "dropped: sites overflowed [site_table_full] = 3",
        ]));
        assert_eq!(reworded[0].reason, Some(DropReason::SiteTableFull));
        assert_eq!(reworded[0].remedy, Some("raise --max-sites"));
        assert_eq!(reworded[0].what, "sites overflowed");
        // The old form, by its description.
        let old = losses(&comments(&[&format!(
            "dropped: {} = 4",
            DropReason::InFlightFull.describe()
        )]));
        assert_eq!(old[0].reason, Some(DropReason::InFlightFull));
    }
}
