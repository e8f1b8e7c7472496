//! The kernel memory heapprofd's BPF maps hold, as the kernel accounts it: the
//! `memlock` line of each map descriptor's `/proc/self/fdinfo` entry. Most of it is
//! allocated when the maps are created, for the tables' full capacities, so it is
//! stated at start-up and in the metrics, beside the flags that size it.

use std::collections::BTreeMap;

use heapprof_common::{kernel::names as kernel_names, names};

/// The tables the kernel memory is reported for, each with the maps it is made of and
/// the flag that sizes it; every other map counts as `other`.
const TABLES: [(&str, &[&str], &str); 5] = [
    (
        "live_blocks",
        &[names::LIVE, kernel_names::KERNEL_LIVE],
        "--max-live-blocks",
    ),
    (
        "sites",
        &[
            names::SITES,
            names::SITE_COUNTERS,
            kernel_names::KERNEL_SITES,
            kernel_names::KERNEL_SITE_COUNTERS,
            kernel_names::KERNEL_SITE_IDS,
        ],
        "--max-sites",
    ),
    (
        "stacks",
        &[names::STACKS, kernel_names::KERNEL_STACKS],
        "--max-stacks",
    ),
    (
        "unwind_rows",
        &[
            names::UNWIND_ROWS,
            names::UNWIND_RULES,
            names::UNWIND_OBJECTS,
        ],
        "--max-unwind-rows, --max-unwind-rules",
    ),
    (
        "threads",
        &[names::IN_FLIGHT, names::IN_FLIGHT_SLOTS],
        "--max-threads",
    ),
];

/// The kernel memory of one table (or of the other maps).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableMemory {
    /// The table (`live_blocks`, `sites`, ..., `other`).
    pub table: &'static str,
    /// Bytes the kernel accounts to its maps.
    pub bytes: u64,
    /// The flag that sizes it (empty for `other`).
    pub flag: &'static str,
}

/// Each BPF map this process holds a descriptor of, by name, with its bytes (a map
/// whose name cannot be read is left out).
fn maps_of_this_process() -> BTreeMap<String, u64> {
    let mut maps = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir("/proc/self/fdinfo") else {
        return maps;
    };
    for entry in entries.flatten() {
        let Ok(text) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        let field = |name: &str| {
            text.lines()
                .find_map(|line| line.strip_prefix(name))
                .and_then(|value| value.trim().parse::<u64>().ok())
        };
        let (Some(id), Some(bytes)) = (field("map_id:"), field("memlock:")) else {
            continue;
        };
        let Ok(info) = aya::maps::MapInfo::from_id(id as u32) else {
            continue;
        };
        if let Some(name) = info.name_as_str() {
            // Descriptors of one map opened twice count once.
            maps.insert(format!("{name}#{id}"), bytes);
        }
    }
    maps
}

/// The kernel memory of heapprofd's tables, in the order of [`TABLES`], then `other`.
pub fn tables() -> Vec<TableMemory> {
    let mut tables: Vec<TableMemory> = TABLES
        .iter()
        .map(|&(table, _, flag)| TableMemory {
            table,
            bytes: 0,
            flag,
        })
        .collect();
    let mut other = 0;
    for (key, bytes) in maps_of_this_process() {
        let name = key.rsplit_once('#').map_or(key.as_str(), |(name, _)| name);
        // The kernel keeps the first 15 bytes of a map's name.
        let belongs = |map: &&str| map.get(..15).unwrap_or(map) == name;
        match TABLES
            .iter()
            .position(|(_, maps, _)| maps.iter().any(belongs))
        {
            Some(index) => tables[index].bytes += bytes,
            None => other += bytes,
        }
    }
    tables.push(TableMemory {
        table: "other",
        bytes: other,
        flag: "",
    });
    tables
}

/// One line for the start-up log: the total, then each table with its flag.
pub fn describe(tables: &[TableMemory]) -> String {
    let mib = |bytes: u64| bytes as f64 / f64::from(1 << 20);
    let total: u64 = tables.iter().map(|t| t.bytes).sum();
    let parts: Vec<String> = tables
        .iter()
        .filter(|t| t.bytes > 0)
        .map(|t| {
            if t.flag.is_empty() {
                format!("{} {:.1} MiB", t.table, mib(t.bytes))
            } else {
                format!("{} {:.1} MiB ({})", t.table, mib(t.bytes), t.flag)
            }
        })
        .collect();
    format!(
        "BPF maps hold {:.1} MiB of kernel memory: {}",
        mib(total),
        parts.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_names_each_table_and_its_flag() {
        let line = describe(&[
            TableMemory {
                table: "live_blocks",
                bytes: 43 << 20,
                flag: "--max-live-blocks",
            },
            TableMemory {
                table: "stacks",
                bytes: 0,
                flag: "--max-stacks",
            },
            TableMemory {
                table: "other",
                bytes: 1 << 20,
                flag: "",
            },
        ]);
        assert_eq!(
            line,
            "BPF maps hold 44.0 MiB of kernel memory: live_blocks 43.0 MiB \
             (--max-live-blocks), other 1.0 MiB"
        );
    }
}
