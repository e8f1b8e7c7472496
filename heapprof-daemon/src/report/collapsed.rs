//! `--format collapsed`: folded stacks, the input of flamegraph.pl and inferno, or
//! with a base profile Brendan Gregg's difffolded form (`stack before after`).

use std::io::{self, Write};

use super::{
    model::Profile,
    stacks::{self, ProcessFilter},
};

/// Writes one `stack value` line per stack of sample type `index`, root first, lines
/// sorted; stacks with nothing of that type are left out, so the values add up to
/// the profile's total.
pub fn write(
    out: &mut dyn Write,
    profile: &Profile,
    index: usize,
    filter: ProcessFilter,
) -> io::Result<()> {
    for (stack, value) in stacks::folded(profile, index, filter) {
        writeln!(out, "{stack} {value}")?;
    }
    Ok(())
}

/// Writes one `stack before after` line per stack present in either profile, sorted.
pub fn write_diff(
    out: &mut dyn Write,
    base: &Profile,
    profile: &Profile,
    index: usize,
    filter: ProcessFilter,
) -> io::Result<()> {
    for (stack, before, after) in stacks::folded_diff(base, profile, index, filter) {
        writeln!(out, "{stack} {before} {after}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::test_profiles::{abc_profile, build, profile_of, text};

    #[test]
    fn one_sorted_line_per_stack_summing_to_the_total() {
        let profile = abc_profile();
        for sample_type in ["inuse_space", "alloc_objects"] {
            let index = profile.sample_index(sample_type).expect("type");
            let folded = text(|out| write(out, &profile, index, ProcessFilter::All));
            let sum: i64 = folded
                .lines()
                .map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<i64>().ok()))
                .map(|v| v.expect("a value at the end"))
                .sum();
            assert_eq!(sum, profile.total(index), "{sample_type}: {folded}");
        }
        let folded = text(|out| write(out, &profile, 3, ProcessFilter::All));
        assert_eq!(
            folded,
            "main;a;b;malloc 100\nmain;a;malloc 1000\nmain;b;malloc 100\n"
        );
    }

    #[test]
    fn several_processes_are_told_apart_unless_one_is_chosen() {
        let profile = build(
            &[
                (1, &["malloc", "main"], [1, 8, 1, 8]),
                (2, &["malloc", "main"], [1, 4, 1, 4]),
            ],
            1,
        );
        let all = text(|out| write(out, &profile, 3, ProcessFilter::All));
        assert_eq!(all, "prog (1);main;malloc 8\nprog (2);main;malloc 4\n");
        let one = text(|out| write(out, &profile, 3, ProcessFilter::Pid(2)));
        assert_eq!(one, "main;malloc 4\n");
    }

    #[test]
    fn a_diff_has_both_values_of_every_stack() {
        let old = profile_of(&[
            (&["malloc", "a", "main"], [1, 1000, 1, 1000]),
            (&["malloc", "c", "main"], [1, 10, 1, 10]),
        ]);
        let new = profile_of(&[
            (&["malloc", "a", "main"], [2, 2000, 2, 2000]),
            (&["malloc", "b", "main"], [1, 100, 1, 100]),
        ]);
        let diff = text(|out| write_diff(out, &old, &new, 3, ProcessFilter::All));
        assert_eq!(
            diff,
            "main;a;malloc 1000 2000\nmain;b;malloc 0 100\nmain;c;malloc 10 0\n"
        );
    }
}
