//! Profile comments that programs read as well as people:
//! `<words for people> [<stable name>] = <value>`. A reader keys by the name (the
//! reports' losses, the stats file, tests), so the words can be reworded without
//! changing what any program finds; the drop counters were the first such comments.

use std::fmt::Display;

/// The comment saying `value` under `name`, with `words` for people.
pub fn keyed(words: &str, name: &str, value: impl Display) -> String {
    format!("{words} [{name}] = {value}")
}

/// A keyed comment's words, name and value; `None` for a comment of prose only.
pub fn split(comment: &str) -> Option<(&str, &str, &str)> {
    let (left, value) = comment.split_once("] = ")?;
    let (words, name) = left.rsplit_once(" [")?;
    Some((words, name, value))
}

/// The value `comments` give under `name` (the first, if several do).
pub fn value<'a, S: AsRef<str>>(comments: &'a [S], name: &str) -> Option<&'a str> {
    comments
        .iter()
        .filter_map(|comment| split(comment.as_ref()))
        .find_map(|(_, key, value)| (key == name).then_some(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_is_found_by_its_name_whatever_the_words_around_it() {
        let comments = [
            "heapprofd 0.1.0".to_owned(),
            keyed(
                "frees through f seen by",
                "deferred_free_program.f",
                "fentry",
            ),
            keyed("reworded [brackets] and = signs", "count.g", 12),
            "tracepoints: kmem:kmalloc".to_owned(),
        ];
        assert_eq!(value(&comments, "deferred_free_program.f"), Some("fentry"));
        assert_eq!(value(&comments, "count.g"), Some("12"));
        assert_eq!(value(&comments, "count"), None);
        assert_eq!(split(&comments[0]), None);
        assert_eq!(
            split(&comments[2]),
            Some(("reworded [brackets] and = signs", "count.g", "12"))
        );
    }

    #[test]
    fn drop_comments_are_keyed_comments() {
        let comment =
            crate::report::losses::drop_comment(heapprof_common::DropReason::SiteTableFull, 7);
        let (_, name, count) = split(&comment).expect("keyed");
        assert_eq!(name, heapprof_common::DropReason::SiteTableFull.name());
        assert_eq!(count, "7");
    }
}
