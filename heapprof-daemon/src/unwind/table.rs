//! Laying out the rows of many FDEs as one sorted, non-overlapping list of rows, with
//! deduplicated rules.

use std::{
    collections::{BTreeMap, HashMap},
    ops::{Bound, Range},
};

use heapprof_common::unwind::{MAX_OBJECT_ROWS, RULE_NONE, UnwindRow, UnwindRule};

use super::UnwindError;

/// One row of an FDE: `rule` holds for `[start, end)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct FdeRow {
    pub start: u64,
    pub end: u64,
    pub rule: UnwindRule,
}

/// A range of addresses with its rule's index, once overlaps are resolved.
#[derive(Clone, Copy, Debug)]
struct Span {
    start: u32,
    end: u32,
    rule: u32,
}

/// Collects the FDEs' rows, in priority order: where a new FDE overlaps the addresses of
/// FDEs added before it, those keep them.
#[derive(Default)]
pub(super) struct Builder {
    /// The addresses covered so far: disjoint `[start, end)` ranges by start, adjacent
    /// ones merged (FDEs mostly tile the code, so few ranges remain).
    covered: BTreeMap<u64, u64>,
    /// The parts of `covered` still free in the FDE being added (reused buffer).
    free: Vec<(u64, u64)>,
    /// Starts of the `covered` ranges the FDE being added merges with (reused buffer).
    absorbed: Vec<u64>,
    spans: Vec<Span>,
    /// Per FDE that added spans: its first span's start and its spans' index range.
    blocks: Vec<(u32, Range<usize>)>,
    rules: Rules,
}

impl Builder {
    /// Adds the rows of the FDE covering `[start, end)` (which must fit `u32`; the rows
    /// are sorted, disjoint and inside it). Returns whether the FDE overlapped one added
    /// before.
    pub fn add_fde(&mut self, start: u64, end: u64, rows: &[FdeRow]) -> bool {
        let overlapped = self.claim(start, end);
        let first_span = self.spans.len();
        let mut free = self.free.iter().copied().peekable();
        for row in rows {
            // The free parts of the row: free ranges are sorted, as are the rows, so
            // both advance together.
            while let Some(&(free_start, free_end)) = free.peek() {
                if free_end <= row.start {
                    free.next();
                    continue;
                }
                if free_start >= row.end {
                    break;
                }
                let from = free_start.max(row.start);
                let to = free_end.min(row.end);
                let rule = self.rules.intern(row.rule);
                // Both fit u32: the caller checked the FDE's end.
                self.spans.push(Span {
                    start: from as u32,
                    end: to as u32,
                    rule,
                });
                if free_end > row.end {
                    break;
                }
                free.next();
            }
        }
        if let Some(first) = self.spans.get(first_span) {
            self.blocks
                .push((first.start, first_span..self.spans.len()));
        }
        overlapped
    }

    /// The end of the run of addresses no FDE covers that starts at `start`, at most
    /// `max` long; `None` when an FDE covers `start`, or when none was added at all
    /// (an object without CFI gets no table).
    pub fn uncovered_run(&self, start: u64, max: u64) -> Option<u64> {
        if self.spans.is_empty() {
            return None;
        }
        if let Some((_, &end)) = self.covered.range(..=start).next_back()
            && end > start
        {
            return None;
        }
        let limit = start.saturating_add(max);
        let next = self
            .covered
            .range((Bound::Excluded(start), Bound::Unbounded))
            .next()
            .map_or(limit, |(&next, _)| next);
        Some(limit.min(next))
    }

    /// Marks `[start, end)` covered, leaving in `self.free` the parts that were not
    /// covered before. Returns whether some part was.
    fn claim(&mut self, start: u64, end: u64) -> bool {
        self.free.clear();
        let mut cursor = start;
        let mut merged = (start, end);
        self.absorbed.clear();
        // The range starting at or before `start` (at most one overlaps or touches it).
        if let Some((&s, &e)) = self.covered.range(..=start).next_back()
            && e >= start
        {
            cursor = cursor.max(e);
            merged = (s, merged.1.max(e));
            self.absorbed.push(s);
        }
        // The ranges starting inside `(start, end]`: overlapped, or touching at `end`.
        for (&s, &e) in self
            .covered
            .range((Bound::Excluded(start), Bound::Included(end)))
        {
            if s > cursor && cursor < end {
                self.free.push((cursor, s.min(end)));
            }
            cursor = cursor.max(e);
            merged.1 = merged.1.max(e);
            self.absorbed.push(s);
        }
        if cursor < end {
            self.free.push((cursor, end));
        }
        for s in &self.absorbed {
            self.covered.remove(s);
        }
        self.covered.insert(merged.0, merged.1);
        !matches!(self.free.as_slice(), [(s, e)] if *s == start && *e == end)
    }

    /// The rows, sorted by address with gaps marked by [`RULE_NONE`] rows, and the rules.
    pub fn finish(mut self) -> Result<(Vec<UnwindRow>, Vec<UnwindRule>), UnwindError> {
        if self.spans.is_empty() {
            return Err(UnwindError::NoCfi);
        }
        self.sort_spans();
        let mut rows: Vec<UnwindRow> = Vec::with_capacity(self.spans.len() + 1);
        let mut push = |pc: u32, rule: u32| {
            // Consecutive rows with one rule are one row.
            if rows.last().is_none_or(|last| last.rule != rule) {
                rows.push(UnwindRow { pc, rule });
            }
        };
        let mut previous_end: Option<u32> = None;
        for span in &self.spans {
            if let Some(end) = previous_end
                && end < span.start
            {
                push(end, RULE_NONE);
            }
            push(span.start, span.rule);
            previous_end = Some(span.end);
        }
        if let Some(end) = previous_end {
            push(end, RULE_NONE);
        }
        if rows.len() > MAX_OBJECT_ROWS as usize {
            return Err(UnwindError::TooManyRows { rows: rows.len() });
        }
        Ok((rows, self.rules.rules))
    }

    /// Sorts the spans by address. Spans are disjoint, so their starts are distinct.
    fn sort_spans(&mut self) {
        if self.spans.is_sorted_by_key(|span| span.start) {
            return;
        }
        // Sections list FDEs in link order, not always address order (lld, hot/cold
        // text), but each FDE's spans are sorted: ordering FDEs is enough, unless
        // overlaps interleaved them.
        self.blocks.sort_unstable_by_key(|(start, _)| *start);
        let mut sorted = Vec::with_capacity(self.spans.len());
        for (_, range) in &self.blocks {
            sorted.extend_from_slice(&self.spans[range.clone()]);
        }
        if !sorted.is_sorted_by_key(|span| span.start) {
            sorted.sort_unstable_by_key(|span| span.start);
        }
        self.spans = sorted;
    }
}

/// The deduplicated rules, in order of first use.
struct Rules {
    rules: Vec<UnwindRule>,
    index: HashMap<UnwindRule, u32>,
    /// A direct-mapped cache in front of `index`: a table has a few hundred distinct
    /// rules but a million rows, and the cache's cheap hash spares most of `index`'s
    /// (keyed, since the rules come from untrusted files) hashing.
    cache: Box<[Option<(UnwindRule, u32)>; CACHE_SLOTS]>,
}

const CACHE_SLOTS: usize = 1024;

impl Default for Rules {
    fn default() -> Self {
        Rules {
            rules: Vec::new(),
            index: HashMap::new(),
            cache: Box::new([None; CACHE_SLOTS]),
        }
    }
}

impl Rules {
    /// The index of `rule`, added if new.
    fn intern(&mut self, rule: UnwindRule) -> u32 {
        let slot = cache_slot(&rule);
        if let Some((cached, index)) = self.cache[slot]
            && cached == rule
        {
            return index;
        }
        let rules = &mut self.rules;
        let index = *self.index.entry(rule).or_insert_with(|| {
            rules.push(rule);
            // Every rule is used by a row and rows are at most MAX_OBJECT_ROWS (checked
            // in `finish`), so an index that does not fit never reaches a table.
            (rules.len() - 1) as u32
        });
        self.cache[slot] = Some((rule, index));
        index
    }
}

/// A cheap hash of a rule, below `CACHE_SLOTS`. Collisions only cost cache misses.
fn cache_slot(rule: &UnwindRule) -> usize {
    let head = u64::from(u32::from_le_bytes([rule.cfa, rule.fp, rule.ra, rule._pad]));
    let cfa_offset = u64::from(rule.cfa_offset as u32);
    let fp_offset = u64::from(rule.fp_offset as u32);
    let ra_offset = u64::from(rule.ra_offset as u32);
    let mixed = (head ^ (cfa_offset << 32))
        .wrapping_add((fp_offset << 16) ^ ra_offset)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (mixed >> 54) as usize
}
