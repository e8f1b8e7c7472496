//! The names the daemon uses for the BPF object's maps, programs and globals (the
//! constants of `heapprof_common::names` and `heapprof_common::kernel::names`) are the
//! names in the object it embeds, and the object has no map without a constant.
//!
//! The BPF side writes each name as a literal (aya's `#[map]` takes only a literal), so
//! a typo on either side would otherwise only show at run time, or never: aya ignores
//! `map_max_entries` for a name it does not know, and the map keeps its placeholder
//! size. Needs no root: the object is parsed, not loaded.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

use heapprof_common::{
    kernel::KernelEvent,
    kernel::names as kernel_names,
    kernel::{HASHED_PROGRAMS, HASHED_SUFFIX},
    names,
};
use object::{Object as _, ObjectSection as _, ObjectSymbol as _, SymbolKind};

#[path = "common/bpf_object.rs"]
mod bpf_object;

use bpf_object::{BPF_OBJECT, is_program};

/// `(module::CONSTANT, ...)` as `("module::CONSTANT", value)` pairs.
macro_rules! constants {
    ($($module:ident :: $name:ident),* $(,)?) => {
        [$((concat!(stringify!($module), "::", stringify!($name)), $module::$name)),*]
    };
}

/// The constants that name maps.
const MAPS: [(&str, &str); 44] = constants![
    names::IN_FLIGHT,
    names::IN_FLIGHT_SLOTS,
    names::PROBES,
    names::SLOT_BY_PAGE_OFFSET,
    names::THREAD_ON_CPU,
    names::CONTROL,
    names::LIVE,
    names::LIVE_FILTER,
    names::SITES,
    names::SITE_COUNTERS,
    names::SITE_IDS_NEXT,
    names::SITE_IDS_FREE,
    names::STACKS,
    names::DROPS,
    names::SAMPLER,
    names::EXEC_GEN,
    names::PROCESS_USAGE,
    names::USAGE_SLOTS,
    names::EXEC_EVENTS,
    names::PROCESS_MAPPINGS,
    names::UNWIND_OBJECTS,
    names::UNWIND_ROWS,
    names::UNWIND_RULES,
    names::WALK_EPOCH,
    names::WALK_STATS,
    names::RULE_CACHE,
    names::UNWIND_GAPS,
    names::MAPPINGS_REQUESTS,
    names::MAPPINGS_REQUESTED,
    names::FORK_ORIGINS,
    names::LOADER_SYNCS,
    names::PRELOADED,
    names::REPORT_QUEUES,
    names::REPLIES,
    kernel_names::KERNEL_SITES,
    kernel_names::KERNEL_SITE_COUNTERS,
    kernel_names::KERNEL_SITE_IDS,
    kernel_names::KERNEL_SITE_CACHE,
    kernel_names::KERNEL_LIVE,
    kernel_names::KERNEL_STACKS,
    kernel_names::TRACED,
    kernel_names::COMMS,
    kernel_names::CACHE_NAMES,
    kernel_names::KERNEL_DEFERRED_FREES,
];

/// The constants that name programs (the kernel-mode tracepoint programs are named by
/// [`KernelEvent::name`]).
const PROGRAMS: [(&str, &str); 24] = constants![
    names::PROG_EXEC,
    names::PROG_FORK,
    names::PROG_LOADER_STATE_MULTI,
    names::PROG_LOADER_STATE,
    names::PROG_THREAD_EXIT,
    names::PROG_SWITCH,
    names::PROG_THREAD_ON_CPU_RESET,
    names::PROG_SYSCALL,
    names::PROG_FUTEX_ENTRY,
    names::PROG_EXEC_ENTRY,
    names::PROG_PRELOAD,
    names::PROG_ALLOC_RETURN,
    names::PROG_ENTRY,
    names::PROG_ENTRY_MULTI,
    names::PROG_ALLOC_RETURN_MULTI,
    names::PROG_ENTRY_SESSION,
    kernel_names::PROG_RCU_FREE,
    kernel_names::PROG_BULK_FREE,
    kernel_names::PROG_RCU_FREE_KPROBE,
    kernel_names::PROG_BULK_FREE_KPROBE,
    kernel_names::PROG_KFREE_RAW,
    kernel_names::PROG_KFREE_RAW_NESTED,
    kernel_names::PROG_KMEM_CACHE_FREE_RAW,
    kernel_names::PROG_KMEM_CACHE_FREE_RAW_NESTED,
];

/// The constants that name globals (set with `EbpfLoader::override_global`).
const GLOBALS: [(&str, &str); 2] = constants![names::CONFIG, kernel_names::KERNEL_CONFIG];

/// The constants that name what the programs attach to, in the kernel: not in the object.
const ATTACH_POINTS: [(&str, &str); 10] = constants![
    names::EXEC_TRACEPOINT,
    names::FORK_TRACEPOINT,
    names::SCHED_CATEGORY,
    names::EXIT_TRACEPOINT,
    names::SWITCH_TRACEPOINT,
    names::SYSCALL_TRACEPOINT,
    names::FUTEX_TRACEPOINT,
    names::SYSCALLS_CATEGORY,
    kernel_names::RCU_FREE_FUNCTION,
    kernel_names::BULK_FREE_FUNCTION,
];

/// Maps that only the programs use, which the daemon never names: per-CPU scratch
/// space, the remembered walks, the log's rate limit, and aya-log's buffer.
const PRIVATE_MAPS: [&str; 16] = [
    "AYA_LOGS",
    "KERNEL_FREE_SEEN",
    "KERNEL_RECORD_SCRATCH",
    "KERNEL_STACK_SCRATCH",
    "LAST_TRACED",
    "LOGGED",
    "LOG_CLAIMS",
    "QUEUE_SCRATCH",
    "REPLY_SCRATCH",
    "STACK_REACH",
    "STACK_SCRATCH",
    "STACK_WINDOW",
    "STALE_FREES",
    "STALE_PENDING",
    "WALK_CACHE",
    "WALK_SCRATCH",
];

/// What the object defines, by kind.
struct Contents {
    maps: BTreeSet<String>,
    programs: BTreeSet<String>,
    globals: BTreeSet<String>,
}

/// The object's maps (symbols in its `maps` or `.maps` section), programs (global
/// functions in an executable section other than `.text`, which holds the functions
/// they call) and globals (data symbols in `.rodata`, `.data` or `.bss` sections).
fn contents() -> Contents {
    let file = object::File::parse(BPF_OBJECT).expect("the embedded BPF object parses");
    let mut contents = Contents {
        maps: BTreeSet::new(),
        programs: BTreeSet::new(),
        globals: BTreeSet::new(),
    };
    for symbol in file.symbols() {
        let (Some(index), Ok(name)) = (symbol.section_index(), symbol.name()) else {
            continue;
        };
        let Ok(section) = file.section_by_index(index) else {
            continue;
        };
        let section_name = section.name().unwrap_or_default();
        let name = name.to_owned();
        if section_name == "maps" || section_name == ".maps" {
            contents.maps.insert(name);
        } else if symbol.kind() == SymbolKind::Text {
            if is_program(&symbol, &section) {
                contents.programs.insert(name);
            }
        } else if symbol.kind() == SymbolKind::Data
            && symbol.is_global()
            && [".rodata", ".data", ".bss"]
                .iter()
                .any(|prefix| section_name.starts_with(prefix))
        {
            contents.globals.insert(name);
        }
    }
    contents
}

/// The `(constant, value)` pairs whose value is not in `present`, as `constant = value`.
fn absent<'a>(
    constants: impl IntoIterator<Item = &'a (&'a str, &'a str)>,
    present: &BTreeSet<String>,
) -> Vec<String> {
    constants
        .into_iter()
        .filter(|(_, value)| !present.contains(*value))
        .map(|(constant, value)| format!("{constant} = {value:?}"))
        .collect()
}

#[test]
fn every_map_constant_names_a_map_and_every_map_has_one() {
    let contents = contents();
    let missing = absent(&MAPS, &contents.maps);
    assert!(
        missing.is_empty(),
        "map names with no such map in the BPF object: {missing:?}; its maps: {:?}",
        contents.maps
    );
    let named: BTreeSet<&str> = MAPS
        .iter()
        .map(|(_, value)| *value)
        .chain(PRIVATE_MAPS)
        .collect();
    let unnamed: Vec<&String> = contents
        .maps
        .iter()
        .filter(|map| !named.contains(map.as_str()))
        .collect();
    assert!(
        unnamed.is_empty(),
        "maps in the BPF object with no constant in heapprof_common (a misspelt #[map] \
         name, or a new map: give it a constant, or list it in PRIVATE_MAPS if only the \
         programs use it): {unnamed:?}"
    );
    let stale: Vec<&str> = PRIVATE_MAPS
        .into_iter()
        .filter(|map| !contents.maps.contains(*map))
        .collect();
    assert!(
        stale.is_empty(),
        "PRIVATE_MAPS not in the BPF object: {stale:?}"
    );
}

#[test]
fn every_program_constant_names_a_program_and_every_program_has_one() {
    let contents = contents();
    let events: Vec<(&str, &str)> = KernelEvent::ALL
        .iter()
        .map(|event| ("KernelEvent::name", event.name()))
        .collect();
    let missing = absent(PROGRAMS.iter().chain(&events), &contents.programs);
    assert!(
        missing.is_empty(),
        "program names with no such program in the BPF object: {missing:?}; its programs: \
         {:?}",
        contents.programs
    );
    let named: BTreeSet<&str> = PROGRAMS
        .iter()
        .chain(&events)
        .map(|(_, value)| *value)
        .collect();
    // Each program of HASHED_PROGRAMS has its copy for kernels before 5.12.
    let hashed: Vec<String> = HASHED_PROGRAMS
        .iter()
        .inspect(|base| assert!(named.contains(*base), "{base} is not a program's name"))
        .map(|base| format!("{base}{HASHED_SUFFIX}"))
        .collect();
    for copy in &hashed {
        assert!(
            contents.programs.contains(copy),
            "no program {copy} in the BPF object: {:?}",
            contents.programs
        );
    }
    let unnamed: Vec<&String> = contents
        .programs
        .iter()
        .filter(|program| !named.contains(program.as_str()) && !hashed.contains(program))
        .collect();
    assert!(
        unnamed.is_empty(),
        "programs in the BPF object with no constant in heapprof_common: {unnamed:?}"
    );
}

#[test]
fn every_global_constant_names_a_global() {
    let contents = contents();
    let missing = absent(&GLOBALS, &contents.globals);
    assert!(
        missing.is_empty(),
        "global names with no such global in the BPF object: {missing:?}; its globals: {:?}",
        contents.globals
    );
}

/// The `pub const NAME: &str` of the `pub mod names` block of `source`, as
/// `"module::NAME"`.
fn declared_names(source: &str, module: &str) -> BTreeSet<String> {
    let block = source
        .split_once("\npub mod names {\n")
        .and_then(|(_, rest)| rest.split_once("\n}\n"))
        .map(|(block, _)| block)
        .expect("a `pub mod names` block");
    declared_consts(block, module)
}

/// The `pub const NAME: &str` of `source` (a module's whole file), as `"module::NAME"`.
fn declared_consts(source: &str, module: &str) -> BTreeSet<String> {
    source
        .lines()
        .filter_map(|line| line.trim().strip_prefix("pub const "))
        .filter_map(|rest| rest.split_once(": &str"))
        .map(|(name, _)| format!("{module}::{name}"))
        .collect()
}

#[test]
fn every_name_constant_is_checked_above() {
    let common = Path::new(env!("CARGO_MANIFEST_DIR")).join("../heapprof-common/src");
    let read = |file: &str| {
        std::fs::read_to_string(common.join(file)).unwrap_or_else(|err| panic!("{file}: {err}"))
    };
    let mut declared = declared_consts(&read("names.rs"), "names");
    declared.extend(declared_names(&read("kernel.rs"), "kernel_names"));
    let checked: BTreeMap<&str, &str> = MAPS
        .iter()
        .chain(&PROGRAMS)
        .chain(&GLOBALS)
        .chain(&ATTACH_POINTS)
        .copied()
        .collect();
    let unchecked: Vec<&String> = declared
        .iter()
        .filter(|name| !checked.contains_key(name.as_str()))
        .collect();
    assert!(
        unchecked.is_empty(),
        "name constants this test does not check (add each to MAPS, PROGRAMS, GLOBALS or \
         ATTACH_POINTS): {unchecked:?}"
    );
    let undeclared: Vec<&str> = checked
        .keys()
        .filter(|name| !declared.contains(**name))
        .copied()
        .collect();
    assert!(
        undeclared.is_empty(),
        "constants not found in the `pub mod names` blocks read: {undeclared:?}"
    );
}
