//! Kernel addresses to function names and modules, from `/proc/kallsyms`.
//!
//! Every text symbol of the kernel and its loaded modules is kept sorted by address;
//! an address belongs to the nearest symbol at or below it. `/proc/modules` gives
//! each module's extent, so that an address past a module's last function is not
//! credited to it.
//!
//! Not blazesym's kallsyms resolver, though the user side symbolizes with blazesym:
//! kernel profiles group frames by module (`[kernel.kallsyms]`, `[ext4]`), and in
//! blazesym 0.2.7 that resolver leaves module names empty. Its `KsymResolver` keeps
//! only each line's address, type and name, dropping the `[module]` column, and its
//! `Kfunc::resolve` answers `module: None` (`src/kernel/ksym.rs`, with a TODO to add
//! it). Only with a vmlinux file does its kernel resolver place an address in a
//! module, and then it symbolizes from the module's `.ko` found through depmod
//! (`src/kernel/resolver.rs`), which a machine without its modules' files on disk
//! cannot do.

use std::{collections::HashMap, sync::Arc};

use thiserror::Error;

/// The module name used for the core kernel (perf's and pprof's convention).
pub const KERNEL_MODULE: &str = "[kernel.kallsyms]";

/// Longest a symbol is assumed to extend when nothing bounds it (the last one of a range).
const MAX_SYMBOL_SIZE: u64 = 1 << 20;

/// A kernel text symbol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelSymbol {
    /// Start address.
    pub address: u64,
    /// Function name.
    pub name: Arc<str>,
    /// `[module]`, or [`KERNEL_MODULE`] for the core kernel.
    pub module: Arc<str>,
}

/// A loaded module's (or the core kernel's) address range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleRange {
    /// `[module]` or [`KERNEL_MODULE`].
    pub name: Arc<str>,
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
}

/// Why the kernel's symbols cannot be used.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum KallsymsError {
    /// A line is not `address type name [module]`.
    #[error("/proc/kallsyms line {line} is malformed: `{text}`")]
    Malformed {
        /// 1-based line number.
        line: usize,
        /// The line.
        text: String,
    },
    /// Every address reads as zero: the kernel hides them from this process.
    #[error(
        "kernel symbol addresses are hidden (all zero in /proc/kallsyms); run heapprofd as root, \
         or lower kernel.kptr_restrict (sysctl kernel.kptr_restrict=0)"
    )]
    AddressesHidden,
    /// No text symbol at all.
    #[error("/proc/kallsyms lists no kernel functions")]
    Empty,
}

/// The kernel's text symbols, sorted by address.
#[derive(Debug, Clone, Default)]
pub struct KernelSymbols {
    symbols: Vec<KernelSymbol>,
    ranges: Vec<ModuleRange>,
}

impl KernelSymbols {
    /// Reads `/proc/kallsyms` and `/proc/modules`.
    pub fn load() -> anyhow::Result<Self> {
        use anyhow::Context as _;
        let kallsyms =
            std::fs::read_to_string("/proc/kallsyms").context("reading /proc/kallsyms")?;
        // Without modules support the file does not exist: no modules then.
        let modules = std::fs::read_to_string("/proc/modules").unwrap_or_default();
        Ok(Self::parse(&kallsyms, &modules)?)
    }

    /// Parses the text of `/proc/kallsyms` and `/proc/modules`.
    pub fn parse(kallsyms: &str, modules: &str) -> Result<Self, KallsymsError> {
        let mut symbols = Vec::new();
        let mut module_names = ModuleNames::default();
        let mut nonzero = false;
        let (mut text_start, mut text_end) = (None, None);
        for (index, line) in kallsyms.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let Some(entry) = KallsymsLine::parse(line, &mut module_names) else {
                return Err(KallsymsError::Malformed {
                    line: index + 1,
                    text: line.chars().take(200).collect(),
                });
            };
            nonzero |= entry.address != 0;
            match entry.name {
                "_stext" => text_start = Some(entry.address),
                "_etext" => text_end = Some(entry.address),
                _ => {}
            }
            // Text symbols only: t/T (and weak w/W, which are functions in kallsyms).
            if !matches!(entry.kind, "t" | "T" | "w" | "W") {
                continue;
            }
            symbols.push(KernelSymbol {
                address: entry.address,
                name: Arc::from(entry.name),
                module: entry.module,
            });
        }
        if symbols.is_empty() {
            return Err(KallsymsError::Empty);
        }
        if !nonzero {
            return Err(KallsymsError::AddressesHidden);
        }
        symbols.sort_by_key(|s| s.address);
        let mut ranges = Vec::new();
        if let (Some(start), Some(end)) = (text_start, text_end)
            && start < end
        {
            ranges.push(ModuleRange {
                name: Arc::clone(&module_names.kernel),
                start,
                end,
            });
        }
        ranges.extend(modules.lines().filter_map(module_range));
        ranges.sort_by_key(|r| r.start);
        Ok(Self { symbols, ranges })
    }

    /// The function containing `address`, with the offset into it.
    pub fn lookup(&self, address: u64) -> Option<(&KernelSymbol, u64)> {
        let index = self.symbols.partition_point(|s| s.address <= address);
        let symbol = self.symbols.get(index.checked_sub(1)?)?;
        let offset = address - symbol.address;
        // Bounded by the range it lies in (core text or a module), else by a maximum size.
        let limit = match self.range_of(symbol.address) {
            Some(range) => range.end,
            None => symbol.address.saturating_add(MAX_SYMBOL_SIZE),
        };
        (address < limit).then_some((symbol, offset))
    }

    /// The core-kernel or module range containing `address`.
    pub fn range_of(&self, address: u64) -> Option<&ModuleRange> {
        let index = self.ranges.partition_point(|r| r.start <= address);
        let range = self.ranges.get(index.checked_sub(1)?)?;
        (address < range.end).then_some(range)
    }

    /// The core kernel's and the modules' address ranges, by start address.
    pub fn ranges(&self) -> &[ModuleRange] {
        &self.ranges
    }

    /// Number of text symbols.
    pub fn len(&self) -> usize {
        self.symbols.len()
    }

    /// Whether there is no symbol.
    pub fn is_empty(&self) -> bool {
        self.symbols.is_empty()
    }
}

/// The module names met so far, each allocated once and shared by its symbols.
#[derive(Debug)]
struct ModuleNames<'a> {
    /// [`KERNEL_MODULE`], for the symbols with no `[module]` column.
    kernel: Arc<str>,
    seen: HashMap<&'a str, Arc<str>>,
}

impl Default for ModuleNames<'_> {
    fn default() -> Self {
        ModuleNames {
            kernel: Arc::from(KERNEL_MODULE),
            seen: HashMap::new(),
        }
    }
}

impl<'a> ModuleNames<'a> {
    /// The shared name `[module]`, or the core kernel's when there is none; `None` if
    /// the column is not a bracketed name.
    fn intern(&mut self, column: Option<&'a str>) -> Option<Arc<str>> {
        match column {
            Some(module) if module.starts_with('[') && module.ends_with(']') => Some(Arc::clone(
                self.seen.entry(module).or_insert_with(|| Arc::from(module)),
            )),
            Some(_) => None,
            None => Some(Arc::clone(&self.kernel)),
        }
    }
}

/// One line of `/proc/kallsyms`: `address type name [module]`.
struct KallsymsLine<'a> {
    address: u64,
    kind: &'a str,
    name: &'a str,
    module: Arc<str>,
}

impl<'a> KallsymsLine<'a> {
    /// The line's fields; `None` if it is malformed.
    fn parse(line: &'a str, module_names: &mut ModuleNames<'a>) -> Option<Self> {
        let mut parts = line.split_whitespace();
        let (address, kind, name) = (parts.next()?, parts.next()?, parts.next()?);
        let address = u64::from_str_radix(address, 16).ok()?;
        if kind.len() != 1 {
            return None;
        }
        let module = module_names.intern(parts.next())?;
        Some(KallsymsLine {
            address,
            kind,
            name,
            module,
        })
    }
}

/// A module's range from a line of `/proc/modules` (`name size refcount deps state
/// address`); `None` for a line without one (short, unreadable, or hidden as zero).
fn module_range(line: &str) -> Option<ModuleRange> {
    let parts: Vec<&str> = line.split_whitespace().collect();
    let (name, size, address) = (parts.first()?, parts.get(1)?, parts.get(5)?);
    let (Ok(size), Ok(start)) = (
        size.parse::<u64>(),
        u64::from_str_radix(address.trim_start_matches("0x"), 16),
    ) else {
        return None;
    };
    if start == 0 || size == 0 {
        return None;
    }
    Some(ModuleRange {
        name: Arc::from(format!("[{name}]")),
        start,
        end: start.saturating_add(size),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const KALLSYMS: &str = "\
ffffffff81000000 T _stext
ffffffff81000000 T startup_64
ffffffff81001000 t do_one
ffffffff81002000 D some_data
ffffffff81003000 T alloc_pipe_info
ffffffff81004000 T _etext
ffffffffc0100000 t mydrv_probe\t[mydrv]
ffffffffc0100400 t mydrv_alloc_ring\t[mydrv]
ffffffffc0200000 t bpf_prog_1234_kmalloc\t[bpf]
";
    const MODULES: &str = "mydrv 8192 0 - Live 0xffffffffc0100000\n";

    #[test]
    fn finds_functions_and_modules() {
        let symbols = KernelSymbols::parse(KALLSYMS, MODULES).expect("valid");
        let (sym, offset) = symbols.lookup(0xffffffff81003010).expect("found");
        assert_eq!(
            (&*sym.name, &*sym.module, offset),
            ("alloc_pipe_info", KERNEL_MODULE, 0x10)
        );
        // Data symbols are not functions: the address stays in do_one.
        let (sym, _) = symbols.lookup(0xffffffff81002008).expect("found");
        assert_eq!(&*sym.name, "do_one");
        let (sym, offset) = symbols.lookup(0xffffffffc0100410).expect("found");
        assert_eq!(
            (&*sym.name, &*sym.module, offset),
            ("mydrv_alloc_ring", "[mydrv]", 0x10)
        );
        // Past the module's extent, and below the first symbol: unknown.
        assert!(symbols.lookup(0xffffffffc0102000).is_none());
        assert!(symbols.lookup(0x1000).is_none());
        assert_eq!(
            symbols.range_of(0xffffffffc0100010).map(|r| &*r.name),
            Some("[mydrv]")
        );
    }

    #[test]
    fn hidden_addresses_and_garbage_are_errors() {
        let hidden = "0000000000000000 T _stext\n0000000000000000 T startup_64\n";
        assert_eq!(
            KernelSymbols::parse(hidden, "").err(),
            Some(KallsymsError::AddressesHidden)
        );
        assert!(matches!(
            KernelSymbols::parse("zzz T name\n", ""),
            Err(KallsymsError::Malformed { line: 1, .. })
        ));
        assert!(matches!(
            KernelSymbols::parse("ffff T\n", ""),
            Err(KallsymsError::Malformed { line: 1, .. })
        ));
        assert_eq!(
            KernelSymbols::parse("", "").err(),
            Some(KallsymsError::Empty)
        );
    }
}
