//! `--stats-json FILE`: the figures of a run, written once at exit as JSON, for the
//! programs that would otherwise read them out of the log's wording (the benchmark,
//! tests). The log keeps saying the same things to people; this file is the
//! interface, and its keys are what must not change.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

use anyhow::{Context as _, Result};
use heapprof_common::DropReason;
use serde::Serialize;

use crate::{
    health::{map_memory::TableMemory, stats::StackLookups},
    report,
    unwind::table_upload::TableUsage,
};

/// How a `--pid` target was joined.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Joining {
    /// The target.
    pub pid: u32,
    /// `injected` (heapprofd's library serves its allocator calls) or `probes` (the
    /// allocator's probes).
    pub how: JoinedBy,
    /// Why it was not joined in-process (`--inject off`, or what stood in the way).
    pub reason: Option<String>,
}

/// The two ways a running process is profiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JoinedBy {
    /// The preload library, loaded into the process.
    Injected,
    /// Uprobes on its allocator.
    Probes,
}

/// How heapprofd left a `--pid` target it had joined in-process, as the session ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "how", rename_all = "snake_case")]
pub enum Leaving {
    /// The library put the process's allocator slots back.
    SlotsRestored {
        /// How many.
        slots: u64,
    },
    /// The process had exec'd since it was joined: the image joined was gone, so
    /// nothing was called; the library in its new image stops by itself once heapprofd
    /// has exited.
    Replaced,
    /// The process had exited.
    Exited,
    /// It could not be reached (the library puts its calls back by itself once it sees
    /// heapprofd gone).
    NotLeft {
        /// What stood in the way.
        reason: String,
    },
}

/// What start-up learns that the stats file reports at exit.
#[derive(Debug, Default)]
pub struct StartFigures {
    /// The BPF object's programs: their names, and the kernel's id of each one loaded
    /// by then (some are loaded only when their first probe is attached, after start).
    pub programs: ProgramNames,
    /// The kernel memory of the BPF maps, as measured once everything was loaded.
    pub kernel_memory: Vec<TableMemory>,
    /// `--pid`: how the target was joined.
    pub joining: Option<Joining>,
}

impl StartFigures {
    /// The names of `ebpf`'s programs, with the ids of those loaded.
    pub fn programs_of(ebpf: &aya::Ebpf) -> ProgramNames {
        ProgramNames {
            by_id: ebpf
                .programs()
                .filter_map(|(name, program)| Some((program.info().ok()?.id(), name.to_owned())))
                .collect(),
            names: ebpf.programs().map(|(name, _)| name.to_owned()).collect(),
        }
    }
}

/// The longest program name the kernel keeps (`BPF_OBJ_NAME_LEN` less its NUL).
const KERNEL_NAME_LEN: usize = 15;

/// The BPF object's program names, to name the programs the kernel lists: the kernel
/// keeps 15 characters of a name, so `kmem_cache_alloc` and `kmem_cache_alloc_node`
/// are both `kmem_cache_allo` there, and a name is found by the program's id.
#[derive(Debug, Default)]
pub struct ProgramNames {
    /// The loaded programs' names by their kernel ids.
    pub by_id: BTreeMap<u32, String>,
    /// Every program's name, loaded or not.
    pub names: Vec<String>,
}

impl ProgramNames {
    /// The object's name of program `id`, which the kernel calls `kernel_name`. A
    /// program loaded after start has no id here: its name is the one the kernel's
    /// stands for (itself when shorter than the kernel keeps, else the only name it
    /// begins), or the kernel's own when several could be meant.
    pub fn name_of(&self, id: u32, kernel_name: &str) -> String {
        if let Some(name) = self.by_id.get(&id) {
            return name.clone();
        }
        let mut meant = self.names.iter().filter(|name| {
            name.as_str() == kernel_name
                || (kernel_name.len() == KERNEL_NAME_LEN && name.starts_with(kernel_name))
        });
        match (meant.next(), meant.next()) {
            (Some(name), None) => name.clone(),
            _ => kernel_name.to_owned(),
        }
    }
}

/// The file's contents.
#[derive(Debug, Serialize)]
pub struct RunStats {
    /// The final profile, as read back from the file written.
    pub final_profile: ProfileTotals,
    /// Events dropped over the run, by the reason's stable name
    /// (`heapprof_common::DropReason::name`), from the final profile's comments.
    pub dropped: BTreeMap<&'static str, u64>,
    /// `--pid`: how the target was joined.
    pub joined: Option<Joining>,
    /// `--pid` joined in-process: how it was left at the end.
    pub left: Option<Leaving>,
    /// The BPF maps' kernel memory at start: bytes by table, and their total.
    pub kernel_memory: KernelMemory,
    /// Probes placed where the kernel single-steps them (each logged as a warning).
    pub single_stepped_probes: usize,
    /// Sampled user mode with multi-uprobe links: whether the allocators were attached
    /// through uprobe session links (Linux 6.13+; unsampled allocations then skip their
    /// return probe), `false` when the kernel refused them; `None` when not tried.
    pub session_links: Option<bool>,
    /// `--bpf-stats`: the programs' run time since they were loaded; `None` without it.
    pub bpf_run_time: Option<BpfRunTime>,
    /// `--bpf-stats`, user mode: how the stacks of the allocations were looked up.
    pub stack_lookups: Option<Lookups>,
    /// User mode: the unwind tables at the end (what the log's `unwind tables:` line
    /// says).
    pub unwind_tables: Option<TableUsage>,
    /// `--preload system`: how the processes were served.
    pub system_preload: Option<SystemPreloadFigures>,
    /// Interval profiles that could not be written (each said in the log, and as a
    /// `write_failed` line of `--profiles-json`); the session went on.
    pub failed_profile_writes: u64,
    /// `--push`: each target's figures at exit (what the log's `push to URL:` line
    /// says), in the order of the flags; empty without `--push`.
    pub push: Vec<PushFigures>,
}

/// `--push`: one target's figures over the run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PushFigures {
    /// The target's URL, without credentials.
    pub target: String,
    /// Profiles (one per process with `--all`) the backend took.
    pub sent: u64,
    /// Pushes that failed (each retry counts).
    pub failed_pushes: u64,
    /// Profiles queued in the spool.
    pub spooled: u64,
    /// Profiles never pushed: the spool full, rejected, or left in memory at exit.
    pub dropped: u64,
    /// Profiles not pushed at exit: they stay in the spool for the next run with
    /// `--push-spool`, else they are lost (and counted in `dropped` too).
    pub left: u64,
}

/// `--preload system`: how the processes of the run were served.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SystemPreloadFigures {
    /// Processes the system-wide library joined.
    pub joined: u64,
    /// Processes whose copy asked but did not join (they got the probes).
    pub declined: u64,
    /// Processes that got their allocator's probes for themselves alone.
    pub probed_alone: u64,
    /// Processes that ran before heapprofd whose copy of the library (loaded by
    /// ptrace) asked to join: their answers count in `joined` or `declined`.
    pub running_asked: u64,
    /// Processes that ran before heapprofd and could not be asked (they got the
    /// probes).
    pub running_not_asked: u64,
    /// Processes left alone because they opted out (`HEAPPROFD_SYSTEM_PRELOAD=off`):
    /// neither joined nor probed.
    pub opted_out: u64,
}

/// The stack lookups of a run, and their total.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Lookups {
    /// Lookups, however made.
    pub total: u64,
    /// By way of lookup.
    #[serde(flatten)]
    pub by_way: StackLookups,
}

impl From<StackLookups> for Lookups {
    fn from(by_way: StackLookups) -> Self {
        Lookups {
            total: by_way.total(),
            by_way,
        }
    }
}

/// The sums of a profile's first four values (allocated and in-use blocks and bytes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProfileTotals {
    /// Where it was written.
    pub path: String,
    /// Its samples (allocation sites with their labels).
    pub samples: usize,
    /// Blocks allocated (estimates when sampled).
    pub allocated_blocks: u64,
    /// Bytes allocated.
    pub allocated_bytes: u64,
    /// Blocks in use at the end.
    pub inuse_blocks: u64,
    /// Bytes in use at the end.
    pub inuse_bytes: u64,
}

/// The BPF maps' kernel memory.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct KernelMemory {
    /// All of it, in bytes.
    pub total_bytes: u64,
    /// By table (`live_blocks`, `sites`, ..., `other`), in bytes.
    pub tables: BTreeMap<&'static str, u64>,
}

/// The BPF programs' run time.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct BpfRunTime {
    /// Every program's, in nanoseconds.
    pub total_ns: u64,
    /// Each program that ran, busiest first.
    pub programs: Vec<ProgramRunTime>,
}

/// One program's runs and run time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProgramRunTime {
    /// Its name in heapprofd's BPF object.
    pub name: String,
    /// Times it ran.
    pub runs: u64,
    /// Nanoseconds spent in it.
    pub run_time_ns: u64,
}

impl BpfRunTime {
    /// The kernel's statistics of the BPF programs this process holds, read now, named
    /// as in `names` (the object's, by the programs' ids). The kernel counts only
    /// while statistics are enabled (`--bpf-stats`). Found through the process's
    /// descriptors, not through the session that loaded them: programs are loaded as
    /// their first probes are attached, some after start.
    pub fn read(names: &ProgramNames) -> Self {
        let ours = program_ids_of_this_process();
        let mut found: Vec<ProgramRunTime> = aya::programs::loaded_programs()
            .filter_map(Result::ok)
            .filter(|info| ours.contains(&info.id()))
            .map(|info| ProgramRunTime {
                name: names.name_of(info.id(), info.name_as_str().unwrap_or("?")),
                runs: info.run_count(),
                run_time_ns: u64::try_from(info.run_time().as_nanos()).unwrap_or(u64::MAX),
            })
            .filter(|program| program.runs > 0)
            .collect();
        found.sort_by_key(|program| std::cmp::Reverse(program.run_time_ns));
        BpfRunTime {
            total_ns: found.iter().map(|program| program.run_time_ns).sum(),
            programs: found,
        }
    }
}

/// The ids of the BPF programs this process holds a descriptor of (a program's, or a
/// link's to it), from `/proc/self/fdinfo`.
fn program_ids_of_this_process() -> BTreeSet<u32> {
    std::fs::read_dir("/proc/self/fdinfo")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|entry| std::fs::read_to_string(entry.path()).ok())
        .filter_map(|info| {
            info.lines()
                .find_map(|line| line.strip_prefix("prog_id:"))
                .and_then(|id| id.trim().parse().ok())
        })
        .collect()
}

impl KernelMemory {
    /// The figures of the start-up measurement.
    pub fn of(tables: &[TableMemory]) -> Self {
        let mut by_table = BTreeMap::new();
        for table in tables {
            *by_table.entry(table.table).or_default() += table.bytes;
        }
        KernelMemory {
            total_bytes: tables.iter().map(|table| table.bytes).sum(),
            tables: by_table,
        }
    }
}

impl ProfileTotals {
    /// Reads the profile at `path` back and sums its values.
    pub fn read(path: &Path) -> Result<(Self, Vec<String>)> {
        let profile = report::model::Profile::load(path)?;
        let mut totals = [0u64; 4];
        for sample in &profile.samples {
            for (total, value) in totals.iter_mut().zip(&sample.values) {
                *total += u64::try_from(*value).unwrap_or(0);
            }
        }
        let [allocated_blocks, allocated_bytes, inuse_blocks, inuse_bytes] = totals;
        Ok((
            ProfileTotals {
                path: path.display().to_string(),
                samples: profile.samples.len(),
                allocated_blocks,
                allocated_bytes,
                inuse_blocks,
                inuse_bytes,
            },
            profile.comments,
        ))
    }
}

/// The drops `comments` record, by reason name (every reason, zeros included, when
/// the comments hold any).
pub fn dropped(comments: &[String]) -> BTreeMap<&'static str, u64> {
    let mut dropped = BTreeMap::new();
    for loss in report::losses::losses(comments) {
        if let (Some(reason), Some(count)) = (loss.reason, loss.count) {
            *dropped.entry(reason.name()).or_default() += count;
        }
    }
    if !dropped.is_empty() || comments.iter().any(|c| c.starts_with("dropped: ")) {
        for reason in DropReason::ALL {
            dropped.entry(reason.name()).or_default();
        }
    }
    dropped
}

/// Writes `stats` to `path` (replaced whole: written beside it, then renamed).
pub fn write(path: &Path, stats: &RunStats) -> Result<()> {
    let text = serde_json::to_string_pretty(stats).context("encoding the stats")?;
    let partial = path.with_extension("partial");
    std::fs::write(&partial, text + "\n")
        .with_context(|| format!("writing {}", partial.display()))?;
    std::fs::rename(&partial, path).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_are_named_by_their_ids_not_by_a_prefix() {
        // The kernel's names: 15 characters kept. An object's order that put the
        // longer names first made a prefix match name `kmalloc` `kmalloc_hashed` and
        // `kmem_cache_allo` `kmem_cache_alloc_node`.
        let names = ProgramNames {
            by_id: BTreeMap::from([
                (11, "kmalloc".to_owned()),
                (12, "kmem_cache_alloc".to_owned()),
                (13, "kmem_cache_alloc_node".to_owned()),
                (14, "kmem_cache_free_raw_nested".to_owned()),
            ]),
            names: [
                "kmalloc_hashed",
                "kmalloc",
                "kmem_cache_alloc_node",
                "kmem_cache_alloc",
                "kmem_cache_free_raw",
                "kmem_cache_free_raw_nested",
                "alloc_return_multi",
                "alloc_return",
                "loader_state_multi",
            ]
            .map(str::to_owned)
            .to_vec(),
        };
        assert_eq!(names.name_of(11, "kmalloc"), "kmalloc");
        assert_eq!(names.name_of(12, "kmem_cache_allo"), "kmem_cache_alloc");
        assert_eq!(
            names.name_of(13, "kmem_cache_allo"),
            "kmem_cache_alloc_node"
        );
        assert_eq!(
            names.name_of(14, "kmem_cache_free"),
            "kmem_cache_free_raw_nested"
        );
        // Loaded after start (no id known): a short name is whole, a cut one is named
        // when only one name begins with it, and left as the kernel's when several do.
        assert_eq!(names.name_of(99, "alloc_return"), "alloc_return");
        assert_eq!(names.name_of(99, "loader_state_mu"), "loader_state_multi");
        assert_eq!(names.name_of(99, "kmem_cache_allo"), "kmem_cache_allo");
        assert_eq!(names.name_of(99, "kmem_cache_free"), "kmem_cache_free");
    }

    #[test]
    fn drops_are_keyed_by_the_reasons_names() {
        let comments: Vec<String> = vec![
            "heapprofd 0.1.0".into(),
            report::losses::drop_comment(DropReason::LiveTableFull, 23),
            format!("dropped: {} = 5", DropReason::StackTableFull.describe()),
            report::losses::drop_comment(DropReason::SiteTableFull, 0),
        ];
        let dropped = dropped(&comments);
        assert_eq!(dropped["live_table_full"], 23);
        assert_eq!(dropped["stack_table_full"], 5);
        assert_eq!(dropped["site_table_full"], 0);
        assert_eq!(dropped.len(), DropReason::ALL.len());
        assert!(super::dropped(&["heapprofd 0.1.0".to_owned()]).is_empty());
    }

    #[test]
    fn the_file_names_how_a_target_was_joined() {
        let stats = RunStats {
            final_profile: ProfileTotals {
                path: "/tmp/heap.pb.gz".into(),
                samples: 0,
                allocated_blocks: 0,
                allocated_bytes: 0,
                inuse_blocks: 0,
                inuse_bytes: 0,
            },
            dropped: BTreeMap::new(),
            joined: Some(Joining {
                pid: 42,
                how: JoinedBy::Probes,
                reason: Some("--inject off".into()),
            }),
            left: Some(Leaving::SlotsRestored { slots: 12 }),
            kernel_memory: KernelMemory::of(&[
                TableMemory {
                    table: "live_blocks",
                    bytes: 4096,
                    flag: "--max-live-blocks",
                },
                TableMemory {
                    table: "other",
                    bytes: 100,
                    flag: "",
                },
            ]),
            single_stepped_probes: 0,
            session_links: Some(true),
            bpf_run_time: None,
            stack_lookups: Some(
                StackLookups {
                    remembered: 5,
                    walked: 2,
                    not_rememberable: 1,
                }
                .into(),
            ),
            unwind_tables: Some(TableUsage {
                objects: 3,
                ..TableUsage::default()
            }),
            system_preload: Some(SystemPreloadFigures {
                joined: 7,
                declined: 1,
                probed_alone: 2,
                running_asked: 3,
                running_not_asked: 1,
                opted_out: 4,
            }),
            failed_profile_writes: 3,
            push: vec![PushFigures {
                target: "http://backend/ingest".into(),
                sent: 4,
                left: 1,
                ..PushFigures::default()
            }],
        };
        let value = serde_json::to_value(&stats).expect("serializable");
        assert_eq!(value["failed_profile_writes"], 3);
        assert_eq!(value["push"][0]["target"], "http://backend/ingest");
        assert_eq!(value["push"][0]["sent"], 4);
        assert_eq!(value["push"][0]["left"], 1);
        assert_eq!(value["left"]["how"], "slots_restored");
        assert_eq!(value["left"]["slots"], 12);
        assert_eq!(value["system_preload"]["joined"], 7);
        assert_eq!(value["system_preload"]["probed_alone"], 2);
        assert_eq!(value["system_preload"]["opted_out"], 4);
        assert_eq!(value["joined"]["how"], "probes");
        assert_eq!(value["joined"]["reason"], "--inject off");
        assert_eq!(value["kernel_memory"]["total_bytes"], 4196);
        assert_eq!(value["kernel_memory"]["tables"]["live_blocks"], 4096);
        assert!(value["bpf_run_time"].is_null());
        assert_eq!(value["stack_lookups"]["total"], 8);
        assert_eq!(value["stack_lookups"]["remembered"], 5);
        assert_eq!(value["unwind_tables"]["objects"], 3);
        assert_eq!(value["unwind_tables"]["build_ms"], 0);
        assert_eq!(value["session_links"], true);
    }
}
