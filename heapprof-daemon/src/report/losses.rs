//! What a profile lost, from its comments: every report format states it, so that a
//! table that overflowed never reads as a complete one.
//!
//! The daemon writes one `dropped: <reason> = <count>` comment per drop reason
//! (`heapprof_common::DropReason`), and kernel sessions that cannot see deferred
//! frees an `undercounted: ...` comment.

use heapprof_common::DropReason;

/// One kind of loss in a profile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loss {
    /// What was lost, as the daemon describes it.
    pub what: String,
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

/// What a suspect's row says when the profile undercounts frees (a kernel session
/// that cannot see every deferred free, or whose programs the kernel skipped): its
/// in-use may be objects freed unseen, not a leak.
pub const FREES_UNDERCOUNTED: &str = "frees undercounted: in-use may be overstated";

/// Whether `comments` say frees went uncounted (an `undercounted:` comment).
pub fn frees_undercounted(comments: &[String]) -> bool {
    comments.iter().any(|c| c.starts_with("undercounted: "))
}

/// The losses `comments` record, in the order written.
pub fn losses(comments: &[String]) -> Vec<Loss> {
    comments.iter().filter_map(|c| parse(c)).collect()
}

/// The loss one comment records, if it records one.
fn parse(comment: &str) -> Option<Loss> {
    if let Some(statement) = comment.strip_prefix("undercounted: ") {
        return Some(Loss {
            what: statement.to_owned(),
            count: None,
            remedy: None,
            untracked_blocks: false,
        });
    }
    let (what, count) = comment.strip_prefix("dropped: ")?.rsplit_once(" = ")?;
    let count: u64 = count.trim().parse().ok()?;
    if count == 0 {
        return None;
    }
    let reason = DropReason::ALL.into_iter().find(|r| r.describe() == what);
    Some(Loss {
        what: what.to_owned(),
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
}
