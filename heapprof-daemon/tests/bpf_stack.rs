//! Every program of the embedded BPF object fits the verifier's limit on the combined
//! stack of a call chain (512 bytes), counted as the oldest kernel we support counts it.
//!
//! The verifier adds up the frames of the deepest chain of BPF-to-BPF calls, each frame
//! rounded up to 32 bytes and never less than 32 (a function with no stack still costs
//! 32). Kernels up to at least 6.1 also count a `bpf_loop` callback as a call from the
//! function that takes its address. A program over the limit loads on a newer kernel
//! and is refused on Debian 12's 6.1 ("combined stack size of 4 calls is 544. Too
//! large"), so only the arm64 VM test would see it, after a quarter of an hour. This
//! test sees it from the object, without root.
//!
//! A frame's size is the deepest stack slot its instructions touch, directly through
//! `r10` or through a register that holds `r10` plus a constant, which is what the
//! verifier records as the function's stack depth.

use std::collections::BTreeMap;

use object::{
    Object as _, ObjectSection as _, ObjectSymbol as _, RelocationTarget, SectionIndex,
    SectionKind, SymbolKind,
};

#[path = "common/bpf_object.rs"]
mod bpf_object;

use bpf_object::{BPF_OBJECT, is_program};

/// A function's place: its section's index and its byte offset there.
type Key = (usize, u64);

/// The verifier's limit on a chain's combined stack (`MAX_BPF_STACK`).
const MAX_COMBINED_STACK: u32 = 512;
/// The verifier's limit on the depth of a call chain (`MAX_CALL_FRAMES`).
const MAX_CALL_FRAMES: usize = 8;
/// The granularity the verifier rounds each frame up to.
const FRAME_GRANULE: u32 = 32;
/// The size of one BPF instruction slot.
const INSN: u64 = 8;
/// The frame pointer register.
const FP: u8 = 10;

/// A function: where it is and what its instructions do with the stack and with calls.
#[derive(Debug)]
struct Function {
    name: String,
    /// Whether it is a program (a global function outside `.text`), not a subprogram.
    program: bool,
    /// The deepest stack byte it touches, below the frame pointer.
    stack_depth: u32,
    /// The functions it calls or hands to a helper as a callback, by key.
    callees: Vec<Key>,
}

impl Function {
    /// The frame as the verifier counts it: as the oldest kernel we support counts it,
    /// or (`jit_rounding`) as kernels that round a JIT'd program's frames up to 16
    /// bytes, with no minimum, count it.
    fn verifier_frame(&self, jit_rounding: bool) -> u32 {
        if jit_rounding {
            self.stack_depth.div_ceil(16) * 16
        } else {
            self.stack_depth.max(1).div_ceil(FRAME_GRANULE) * FRAME_GRANULE
        }
    }
}

/// Programs the daemon loads only on kernels newer than the oldest it supports, and
/// only where a refusal falls back (said once, nothing lost): `entry_session`, the
/// uprobe session program, loaded on x86-64 for sampled sessions and used on Linux
/// 6.13+ (Debian's 6.12 loads it, then refuses its link). Those kernels round a JIT'd
/// program's frames up to 16 bytes with no minimum, so its empty dispatching frame
/// costs nothing: with the oldest kernels' rule its chain would count 544 bytes, and
/// 6.12 would have refused it. On arm64 it is never loaded.
const NEWER_KERNELS_ONLY: [&str; 1] = ["entry_session"];

/// One decoded instruction slot.
struct Insn {
    code: u8,
    dst: u8,
    src: u8,
    off: i16,
    imm: i32,
}

impl Insn {
    fn decode(bytes: &[u8]) -> Insn {
        Insn {
            code: bytes[0],
            dst: bytes[1] & 0x0f,
            src: bytes[1] >> 4,
            off: i16::from_le_bytes([bytes[2], bytes[3]]),
            imm: i32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]),
        }
    }
}

const CLASS_LD: u8 = 0x00;
const CLASS_LDX: u8 = 0x01;
const CLASS_ST: u8 = 0x02;
const CLASS_STX: u8 = 0x03;
const CLASS_ALU: u8 = 0x04;
const CLASS_ALU64: u8 = 0x07;
const CODE_LD_IMM64: u8 = 0x18;
const CODE_CALL: u8 = 0x85;
const CODE_MOV64_REG: u8 = 0xbf;
const CODE_ADD64_IMM: u8 = 0x07;
const PSEUDO_CALL: u8 = 1;

/// The functions of the object, by `(section, byte offset)`.
fn functions(data: &[u8]) -> BTreeMap<Key, Function> {
    let file = object::File::parse(data).expect("the embedded BPF object is not an ELF file");
    let mut starts: BTreeMap<Key, (String, bool)> = BTreeMap::new();
    for symbol in file.symbols() {
        let (Some(section_index), Ok(name)) = (symbol.section_index(), symbol.name()) else {
            continue;
        };
        let Ok(section) = file.section_by_index(section_index) else {
            continue;
        };
        if symbol.kind() != SymbolKind::Text || section.kind() != SectionKind::Text {
            continue;
        }
        let program = is_program(&symbol, &section);
        starts.insert(
            (section_index.0, symbol.address()),
            (name.to_owned(), program),
        );
    }
    assert!(
        !starts.is_empty(),
        "no function symbols in the embedded BPF object"
    );

    let mut functions = BTreeMap::new();
    for section in file
        .sections()
        .filter(|section| section.kind() == SectionKind::Text)
    {
        let code = section
            .data()
            .unwrap_or_else(|error| panic!("reading section {:?}: {error}", section.name()));
        let relocations: BTreeMap<u64, Key> = section
            .relocations()
            .filter_map(|(offset, relocation)| {
                let RelocationTarget::Symbol(index) = relocation.target() else {
                    return None;
                };
                let symbol = file.symbol_by_index(index).ok()?;
                Some((offset, (symbol.section_index()?.0, symbol.address())))
            })
            .collect();
        let in_section: Vec<_> = starts
            .range((section.index().0, 0)..=(section.index().0, u64::MAX))
            .map(|(&(_, start), (name, program))| (start, name.clone(), *program))
            .collect();
        for (position, (start, name, program)) in in_section.iter().enumerate() {
            let end = in_section
                .get(position + 1)
                .map_or(code.len() as u64, |next| next.0);
            let function = scan(
                &code[*start as usize..end as usize],
                *start,
                section.index().0,
                &relocations,
                |target| {
                    file.section_by_index(SectionIndex(target))
                        .is_ok_and(|s| s.kind() == SectionKind::Text)
                },
                name,
                *program,
            );
            functions.insert((section.index().0, *start), function);
        }
    }
    functions
}

/// Reads one function's instructions: its stack depth and its callees.
fn scan(
    code: &[u8],
    start: u64,
    section: usize,
    relocations: &BTreeMap<u64, Key>,
    is_code: impl Fn(usize) -> bool,
    name: &str,
    program: bool,
) -> Function {
    // Registers holding `r10 + offset`, as the compiler forms stack pointers.
    let mut frame_offsets: [Option<i64>; 11] = [None; 11];
    frame_offsets[FP as usize] = Some(0);
    let mut deepest: i64 = 0;
    let mut callees = Vec::new();
    let mut at = 0usize;
    while at + INSN as usize <= code.len() {
        let insn = Insn::decode(&code[at..at + INSN as usize]);
        let offset = start + at as u64;
        let relocation = relocations.get(&offset);
        at += INSN as usize;
        let class = insn.code & 0x07;
        match insn.code {
            CODE_LD_IMM64 => {
                // A callback's address (`BPF_PSEUDO_FUNC`) is an `ld_imm64` relocated
                // against code; the verifier walks into it as if it were called.
                if let Some(&(target, base)) = relocation
                    && is_code(target)
                {
                    callees.push((target, base + insn.imm as u64));
                }
                frame_offsets[insn.dst as usize] = None;
                at += INSN as usize;
                continue;
            }
            CODE_CALL => {
                if insn.src == PSEUDO_CALL {
                    let callee = match relocation {
                        Some(&(target, base)) => (
                            target,
                            base.wrapping_add(((insn.imm as i64 + 1) * INSN as i64) as u64),
                        ),
                        None => (
                            section,
                            offset.wrapping_add(((insn.imm as i64 + 1) * INSN as i64) as u64),
                        ),
                    };
                    callees.push(callee);
                }
                frame_offsets[..=5].fill(None);
                continue;
            }
            CODE_MOV64_REG => {
                frame_offsets[insn.dst as usize] = frame_offsets[insn.src as usize];
                continue;
            }
            CODE_ADD64_IMM => {
                if let Some(base) = frame_offsets[insn.dst as usize].as_mut()
                    && insn.dst != FP
                {
                    *base += i64::from(insn.imm);
                    deepest = deepest.max(-*base);
                }
                continue;
            }
            _ => {}
        }
        match class {
            CLASS_LDX => {
                if let Some(base) = frame_offsets[insn.src as usize] {
                    deepest = deepest.max(-(base + i64::from(insn.off)));
                }
                frame_offsets[insn.dst as usize] = None;
            }
            CLASS_ST | CLASS_STX => {
                if let Some(base) = frame_offsets[insn.dst as usize] {
                    deepest = deepest.max(-(base + i64::from(insn.off)));
                }
            }
            // Any other ALU or load result in a register ends what it held.
            CLASS_ALU64 | CLASS_ALU | CLASS_LD if insn.dst != FP => {
                frame_offsets[insn.dst as usize] = None;
            }
            _ => {}
        }
    }
    Function {
        name: name.to_owned(),
        program,
        stack_depth: u32::try_from(deepest.max(0)).unwrap_or(u32::MAX),
        callees,
    }
}

/// The deepest chain from `key`: its combined stack and the functions on it.
fn deepest_chain(
    functions: &BTreeMap<Key, Function>,
    key: Key,
    on_chain: &mut Vec<Key>,
    jit_rounding: bool,
) -> (u32, Vec<String>) {
    let function = functions
        .get(&key)
        .unwrap_or_else(|| panic!("a call into {key:?}, where no function starts"));
    assert!(
        !on_chain.contains(&key),
        "{} is recursive, which the verifier refuses",
        function.name
    );
    on_chain.push(key);
    let mut best = (0, Vec::new());
    for &callee in &function.callees {
        let chain = deepest_chain(functions, callee, on_chain, jit_rounding);
        if chain.0 > best.0 {
            best = chain;
        }
    }
    on_chain.pop();
    let mut names = vec![format!("{} ({})", function.name, function.stack_depth)];
    names.extend(best.1);
    (function.verifier_frame(jit_rounding) + best.0, names)
}

/// The programs of `object` whose deepest chain is over the verifier's limits, with
/// the chain; prints every program's deepest chain.
fn chains_over_the_limit(object: &[u8], arch: &str) -> Vec<String> {
    let functions = functions(object);
    let programs: Vec<_> = functions
        .iter()
        .filter(|(_, function)| function.program)
        .map(|(&key, function)| (key, function.name.clone()))
        .collect();
    assert!(
        programs.len() > 10,
        "found only {} programs in the BPF object",
        programs.len()
    );
    let mut over = Vec::new();
    for (key, name) in programs {
        let newer_only = NEWER_KERNELS_ONLY.contains(&name.as_str());
        if newer_only && arch != "x86_64" {
            continue;
        }
        let (combined, chain) = deepest_chain(&functions, key, &mut Vec::new(), newer_only);
        println!("{name}: {combined} bytes: {}", chain.join(" -> "));
        if combined > MAX_COMBINED_STACK || chain.len() > MAX_CALL_FRAMES {
            over.push(format!(
                "{name}: {combined} bytes in {} frames: {}",
                chain.len(),
                chain.join(" -> ")
            ));
        }
    }
    over
}

/// `arch`: the architecture the object's programs run on.
fn assert_fits(object: &[u8], which: &str, arch: &str) {
    let over = chains_over_the_limit(object, arch);
    assert!(
        over.is_empty(),
        "call chains of the {which} BPF object over the verifier's {MAX_COMBINED_STACK}-byte or \
         {MAX_CALL_FRAMES}-frame limit (frames in bytes, each counted rounded up to \
         {FRAME_GRANULE}, at least {FRAME_GRANULE}); move locals of the first frames into a \
         per-CPU scratch map or give a callee its own global function:\n{}",
        over.join("\n")
    );
}

#[test]
fn every_program_fits_the_verifiers_combined_stack_limit() {
    assert_fits(BPF_OBJECT, "embedded", std::env::consts::ARCH);
}

/// The BPF object embedded in an executable: the ELF file for `EM_BPF` inside it,
/// copied to an aligned buffer.
fn embedded_bpf_object(executable: &[u8]) -> AlignedObject {
    const EM_BPF: u16 = 247;
    let field = |at: usize, len: usize| -> u64 {
        executable[at..at + len]
            .iter()
            .rev()
            .fold(0, |value, &byte| value << 8 | u64::from(byte))
    };
    let starts: Vec<usize> = executable
        .windows(4)
        .enumerate()
        .filter(|&(at, magic)| {
            magic == b"\x7fELF"
                && at > 0
                && at + 64 <= executable.len()
                && executable[at + 4] == 2
                && field(at + 18, 2) == u64::from(EM_BPF)
        })
        .map(|(at, _)| at)
        .collect();
    assert_eq!(
        starts.len(),
        1,
        "expected one embedded 64-bit BPF ELF object in the executable, found {}",
        starts.len()
    );
    let at = starts[0];
    let section_headers = field(at + 0x28, 8) as usize;
    let header_size = field(at + 0x3a, 2) as usize;
    let headers = field(at + 0x3c, 2) as usize;
    let end = at + section_headers + header_size * headers;
    assert!(
        end <= executable.len(),
        "the embedded BPF object runs past the executable"
    );
    AlignedObject::copy_of(&executable[at..end])
}

/// A copy of an object file on 8-byte boundaries: `object` reads its structures in
/// place, which needs them aligned.
struct AlignedObject {
    words: Vec<u64>,
    len: usize,
}

impl AlignedObject {
    fn copy_of(bytes: &[u8]) -> AlignedObject {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        for (word, chunk) in words.iter_mut().zip(bytes.chunks(8)) {
            let mut le = [0u8; 8];
            le[..chunk.len()].copy_from_slice(chunk);
            *word = u64::from_le_bytes(le);
        }
        AlignedObject {
            words,
            len: bytes.len(),
        }
    }

    fn bytes(&self) -> &[u8] {
        const { assert!(cfg!(target_endian = "little")) };
        // SAFETY: the words are initialized, `len` bytes lie within them, and u8 has no
        // alignment; little-endian words hold the bytes in order (asserted above).
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }
}

#[test]
fn the_aarch64_builds_programs_fit_the_verifiers_combined_stack_limit() {
    let Some(path) = std::env::var_os("HEAPPROFD_AARCH64_BINARY") else {
        panic!(
            "HEAPPROFD_AARCH64_BINARY is not set: this test reads the BPF object of the \
             static aarch64 build, which the arm64 VM loads on Debian's 6.1; run it through \
             `cargo xtask test`"
        );
    };
    let executable =
        std::fs::read(&path).unwrap_or_else(|error| panic!("reading {}: {error}", path.display()));
    let object = embedded_bpf_object(&executable);
    assert_fits(object.bytes(), "aarch64", "aarch64");
}
/// The scanner sees what the verifier sees, checked on known functions of the real
/// object (a hand-made one would need an assembler): a frame reached through a
/// pointer register, a callback handed to `bpf_loop` (an `ld_imm64` into `.text`),
/// and calls to global functions by relocation.
#[test]
fn the_scanner_finds_frames_calls_and_callbacks() {
    let functions = functions(BPF_OBJECT);
    let named = |name: &str| {
        functions
            .values()
            .find(|function| function.name == name || function.name.ends_with(name))
            .unwrap_or_else(|| panic!("no function {name} in the embedded BPF object"))
    };
    let callees = |function: &Function| -> Vec<String> {
        function
            .callees
            .iter()
            .map(|key| {
                functions
                    .get(key)
                    .map_or_else(|| format!("{key:?}"), |callee| callee.name.clone())
            })
            .collect()
    };
    let report = named("preload_report");
    assert!(
        report.stack_depth >= 64,
        "preload_report's frame read as {} bytes",
        report.stack_depth
    );
    let report_callees = callees(report);
    assert!(
        report_callees
            .iter()
            .any(|name| name.ends_with("12apply_record")),
        "preload_report hands bpf_loop its record callback, but its callees are {report_callees:?}"
    );
    let callback = named("12apply_record");
    assert_eq!(callees(callback), ["heapprof_apply_record"]);
    let record = named("heapprof_apply_record");
    let record_callees = callees(record);
    assert!(
        record_callees
            .iter()
            .any(|name| name == "heapprof_live_insert"),
        "heapprof_apply_record calls the live-block insert, but its callees are {record_callees:?}"
    );
    assert!(
        named("heapprof_live_insert").stack_depth > 0,
        "heapprof_live_insert's map keys are on its stack, but its frame read as empty"
    );
}
