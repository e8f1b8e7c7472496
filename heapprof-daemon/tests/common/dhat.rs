//! Ground truth for call stacks: valgrind's DHAT, which unwinds with CFI (`.eh_frame`)
//! and expands inlined frames from DWARF, on the same program and input as heapprofd.
//!
//! Both sides are turned into one form, a [`StackMap`]: per normalized stack (function
//! names, innermost first), the bytes and blocks allocated there. What differs between
//! the two tools and how each difference is removed (with the frame strings it was
//! decided from):
//!
//! - **The allocator's own frames.** DHAT's innermost frames are its replacements in
//!   `vgpreload_dhat-amd64-linux.so` (`0x48417B4: malloc (in /usr/libexec/valgrind/
//!   vgpreload_dhat-amd64-linux.so)`, `operator new(unsigned long) (in ...)`): valgrind
//!   replaces `operator new` itself, so the program's caller comes next. heapprofd's leaf
//!   is the allocator function the program called (`malloc`, its probe), and a C++ `new`
//!   goes through libstdc++: `malloc <- operator new(unsigned long) <- caller`. So DHAT's
//!   `vgpreload_*` frames and heapprofd's leaf are dropped, then on both sides every
//!   innermost frame that is an allocator entry point ([`ALLOCATORS`]: the malloc family,
//!   `operator new`/`new[]` in all their nothrow and aligned forms, which normalize to
//!   one name).
//! - **Below main.** DHAT stops at `main` (`0x10A3FA: main (cxx_stl.cpp:104)`) and, when
//!   main has no name (a stripped `/usr/bin/sqlite3`), at valgrind's `(below main)
//!   (libc_start_call_main.h:58)`. heapprofd goes on to `__libc_start_call_main`,
//!   `__libc_start_main_impl` and `_start`. Stacks are cut after `main`; the first
//!   below-main frame (`(below main)`, `__libc_start_call_main`, `__libc_start_main*`)
//!   becomes `(below main)` and ends the stack.
//! - **Before main.** Code the dynamic loader runs before main (library constructors:
//!   libstdc++'s emergency exception pool, `??? (in libstdc++.so.6.0.30) <- call_init <-
//!   call_init <- _dl_init <- ??? (in ld-linux-x86-64.so.2)`) ends in `_start`'s
//!   `_dl_start_user` label, which valgrind cannot name and blazesym can. A stack that
//!   reaches neither main nor below-main is cut after `_dl_init`.
//! - **Symbol aliases.** The C library has several names per function and the two tools
//!   pick different ones: DHAT `strdup (strdup.c:42)`, heapprofd `__GI___strdup`; DHAT
//!   `_IO_file_doallocate`, heapprofd `__GI__IO_file_doallocate`; DHAT
//!   `_IO_file_overflow@@GLIBC_2.2.5`, heapprofd `_IO_new_file_overflow`; DHAT `printf`,
//!   heapprofd `__printf`. Symbol versions (`@@GLIBC_2.2.5`) are dropped, and two names
//!   are one function when a symbol table of the objects DHAT loaded (with the debug
//!   files valgrind found for them) gives them the same address ([`Aliases`]). Only
//!   literal aliases are merged: different functions never become equal.
//! - **Compiler clones.** `.isra.0`, `.constprop.0`, `.part.0`, `.cold` suffixes and
//!   libiberty's ` [clone .isra.0]` are dropped: DHAT names an out-of-line clone from the
//!   symbol table (`void std::__cxx11::basic_string<...>::_M_construct<char*>(char*,
//!   char*, std::forward_iterator_tag) [clone .isra.0]`), heapprofd from DWARF, without
//!   the suffix. It is the same source function.
//! - **C++ names.** valgrind names the function containing an address from the symbol
//!   table, demangled by libiberty
//!   (`void std::vector<int, std::allocator<int> >::_M_realloc_insert<int>(...)`), and an
//!   inlined frame by its bare DWARF `DW_AT_name` (`push_back`, `emplace_back<int>`,
//!   `_Scoped_node<const std::__cxx11::basic_string<...>&, long unsigned int&>`,
//!   `operator[]`). heapprofd demangles linkage names with `cpp_demangle` for both
//!   (`std::vector<int, std::allocator<int> >::push_back(int&&)`), and GCC's DWARF
//!   spells types its own way (`long unsigned int` where demanglers say `unsigned long`).
//!   So return types, template arguments, parameter lists, `[abi:cxx11]` tags are
//!   dropped; the containing function keeps its scope (`std::vector::_M_realloc_insert`,
//!   `workload::make_record`), an inlined frame keeps only its last component
//!   (`push_back`), which is all DHAT has. Inlined frames are known on both sides: in
//!   DHAT they share their address with the frames after them up to the containing
//!   function (see [`parse_dhat_json`] for recursion), in a profile they are the leading
//!   lines of a location.
//! - **Frames without a name.** DHAT `??? (in /usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30)`,
//!   a profile location without lines in the same mapping: both become
//!   `[libstdc++.so.6.0.30]`, so a junk frame cannot vanish from either side.
//! - **realloc.** DHAT charges the new block of a `realloc(p, n)` to the site that
//!   allocated `p` (a 100-byte `malloc` in `f` and a `realloc` to 5000 in `g`: one point
//!   in `f`, 5100 bytes in 2 blocks); heapprofd charges it to the realloc's own stack.
//!   The totals agree; per stack they agree only when each realloc happens at the same
//!   normalized stack as the block's allocation (getline's growth inside `getdelim`,
//!   asprintf's shrink inside `__vasprintf_internal`). The C and C++ test programs keep to
//!   that; CPython (`PyList_Append`, `_PyBytes_Resize`) and SQLite (`sqlite3Realloc`) do
//!   not, so their per-stack figures are not judged.

use std::{
    collections::{BTreeMap, HashMap},
    ffi::OsStr,
    fmt::Write as _,
    path::{Path, PathBuf},
};

use heapprof_daemon::pprof::proto::Profile;

/// Per normalized stack (function names, innermost first): (bytes allocated, blocks allocated).
pub type StackMap = BTreeMap<Vec<String>, (i64, i64)>;

/// Allocator entry points, as [`normalize_name`] spells them: dropped from the inner end
/// of every stack. glibc's allocator and libstdc++'s `operator new` family (nothrow and
/// aligned forms lose their parameter lists and so share these names).
pub const ALLOCATORS: &[&str] = &[
    "malloc",
    "calloc",
    "realloc",
    "reallocarray",
    "free",
    "posix_memalign",
    "aligned_alloc",
    "memalign",
    "valloc",
    "pvalloc",
    "operator new",
    "operator new[]",
];

/// One frame before normalization.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The function name as the tool gave it, or `[OBJECT]` when it had none.
    pub name: String,
    /// Inlined into the next (outer) frame.
    pub inlined: bool,
}

/// One allocation site before normalization: frames innermost first, the allocator's
/// own frames already removed (DHAT's `vgpreload` frames, heapprofd's leaf).
#[derive(Debug, Clone)]
pub struct Point {
    /// Frames, innermost first.
    pub frames: Vec<Frame>,
    /// Bytes allocated.
    pub bytes: i64,
    /// Blocks allocated.
    pub blocks: i64,
}

/// What DHAT saw of one run.
pub struct Dhat {
    /// Its program points.
    pub points: Vec<Point>,
    /// The symbol aliases of the objects it loaded.
    pub aliases: Aliases,
    /// The command, for messages.
    pub command: String,
}

impl Dhat {
    /// The normalized stacks.
    pub fn stacks(&self) -> StackMap {
        normalize(&self.points, &self.aliases)
    }

    /// Total (bytes, blocks) allocated.
    pub fn totals(&self) -> (i64, i64) {
        point_totals(&self.points)
    }
}

/// Runs `program args` under DHAT in `dir` (its output file and log go there) with the
/// extra environment `env`, and reads its output.
///
/// `--read-inline-info=yes`: `valgrind --help` and the manual give it as the default only
/// for Memcheck, Massif, Helgrind and DRD (valgrind 3.19 here expands inlined frames for
/// DHAT without it too); explicit, it does not depend on the version. `--num-callers=100`
/// (the default is 12) covers Python's ~40-frame stacks. `--run-libc-freeres=no
/// --run-cxx-freeres=no`: a real exit does not free glibc's and libstdc++'s buffers.
/// DHAT's allocated totals are the same either way (cxx_stl: 374,215 bytes in 4,652
/// blocks; python3: 7,454,152 bytes in 2,326 blocks); only its in-use figures at exit
/// change (cxx_stl: 0 bytes with freeres, 76,800 bytes in 2 blocks without, as
/// heapprofd counts). `-v` makes valgrind log the objects it read symbols from and their
/// debug files, which [`Aliases`] reads.
pub fn run(program: &Path, args: &[&OsStr], env: &[(&str, &str)], dir: &Path) -> Dhat {
    let json_path = dir.join("dhat.json");
    let log_path = dir.join("dhat.log");
    let mut cmd = super::valgrind::command();
    cmd.args([
        "--tool=dhat",
        "--num-callers=100",
        "--read-inline-info=yes",
        "--run-libc-freeres=no",
        "--run-cxx-freeres=no",
        "-v",
    ])
    .arg(format!("--dhat-out-file={}", json_path.display()))
    .arg(format!("--log-file={}", log_path.display()))
    .arg(program)
    .args(args)
    .envs(env.iter().copied())
    .current_dir(dir);
    let command = format!("{cmd:?}");
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("running valgrind ({e}); install it: cargo xtask setup"));
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        output.status.success(),
        "{command} failed ({}):\nstderr: {}\nvalgrind log (end):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr),
        tail(&log, 40)
    );
    let json = std::fs::read_to_string(&json_path)
        .unwrap_or_else(|e| panic!("reading DHAT's output {}: {e}", json_path.display()));
    Dhat {
        points: parse_dhat_json(&json),
        aliases: Aliases::from_objects(&loaded_objects(&log)),
        command,
    }
}

/// The last `lines` lines of `text`.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// DHAT's JSON: `ftbl` holds frame strings, each `pps` entry has `tb` (total bytes), `tbk`
/// (total blocks) and `fs`, indices into `ftbl`, innermost first. Frames become
/// [`Frame`]s as [`dhat_frames`] says.
pub fn parse_dhat_json(json: &str) -> Vec<Point> {
    let value: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("DHAT's output is not JSON: {e}"));
    assert_eq!(value["mode"], "heap", "DHAT's output is not a heap profile");
    let ftbl: Vec<&str> = value["ftbl"]
        .as_array()
        .expect("DHAT's output has no ftbl")
        .iter()
        .map(|f| f.as_str().expect("ftbl entries are strings"))
        .collect();
    value["pps"]
        .as_array()
        .expect("DHAT's output has no pps")
        .iter()
        .map(|pp| {
            let number = |key: &str| {
                pp[key]
                    .as_i64()
                    .unwrap_or_else(|| panic!("program point without {key}: {pp}"))
            };
            let strings: Vec<&str> = pp["fs"]
                .as_array()
                .expect("program point without fs")
                .iter()
                .map(|i| {
                    let i = i.as_u64().expect("frame indices are numbers") as usize;
                    *ftbl.get(i).expect("frame index inside ftbl")
                })
                .collect();
            Point {
                frames: dhat_frames(&strings),
                bytes: number("tb"),
                blocks: number("tbk"),
            }
        })
        .collect()
}

/// One DHAT frame string, `0x10916B: main (cxx_stl.cpp:42)`, `0x49007B9: ??? (in
/// /usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30)`: (address, name, object when given).
fn parse_frame_string(frame: &str) -> (&str, &str, Option<&str>) {
    let Some((address, rest)) = frame.split_once(": ") else {
        return ("", frame, None);
    };
    // The location is the last balanced parenthesized group: names have parentheses too.
    if rest.ends_with(')') {
        let mut depth = 0;
        for (i, c) in rest.char_indices().rev() {
            match c {
                ')' => depth += 1,
                '(' => {
                    depth -= 1;
                    if depth == 0 {
                        let location = &rest[i + 1..rest.len() - 1];
                        let name = rest[..i].trim_end();
                        if let Some(object) = location.strip_prefix("in ") {
                            return (address, name, Some(object));
                        }
                        let is_file_line = location
                            .rsplit_once(':')
                            .is_some_and(|(_, line)| line.parse::<u32>().is_ok());
                        if is_file_line && !name.is_empty() {
                            return (address, name, None);
                        }
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    (address, rest, None)
}

/// DHAT frame strings (innermost first) to frames: valgrind's own replacement frames at
/// the inner end dropped, inlined frames marked, unnamed ones as `[OBJECT]`.
///
/// valgrind expands an address into its inlined frames, all with that address, the
/// containing function last (`0x10CA15: allocate (new_allocator.h:137)`, `0x10CA15:
/// _M_allocate (stl_vector.h:378)`, `0x10CA15: void std::vector<...>::_M_realloc_insert
/// <int>(...) (vector.tcc:453)`). A recursive function returning to one call site repeats
/// the same address too, with the same frame strings: a run of one address that is the
/// same group repeated is that many physical frames.
fn dhat_frames(strings: &[&str]) -> Vec<Frame> {
    let parsed: Vec<(&str, &str, Option<&str>, &str)> = strings
        .iter()
        .map(|s| {
            let (address, name, object) = parse_frame_string(s);
            let whole = s.split_once(": ").map_or(*s, |(_, rest)| rest);
            (address, name, object, whole)
        })
        .filter(|(_, name, _, _)| *name != "[root]")
        .collect();
    let first_ours = parsed
        .iter()
        .position(|(_, _, object, _)| !object.is_some_and(|o| o.contains("/valgrind/vgpreload_")))
        .unwrap_or(parsed.len());
    let parsed = &parsed[first_ours..];
    let mut frames = Vec::with_capacity(parsed.len());
    let mut start = 0;
    while start < parsed.len() {
        let address = parsed[start].0;
        let mut end = start + 1;
        while end < parsed.len() && !address.is_empty() && parsed[end].0 == address {
            end += 1;
        }
        let run = &parsed[start..end];
        let period = (1..=run.len())
            .find(|p| {
                run.len().is_multiple_of(*p) && (0..run.len() - p).all(|i| run[i].3 == run[i + p].3)
            })
            .unwrap_or(run.len());
        for (i, (_, name, object, _)) in run.iter().enumerate() {
            frames.push(Frame {
                name: if *name == "???" {
                    unnamed(*object)
                } else {
                    (*name).to_owned()
                },
                inlined: i % period != period - 1,
            });
        }
        start = end;
    }
    frames
}

/// The name of a frame no symbol covers: its object's file name in brackets.
fn unnamed(object: Option<&str>) -> String {
    match object {
        Some(path) => format!(
            "[{}]",
            Path::new(path)
                .file_name()
                .map_or(path.into(), |f| f.to_string_lossy())
        ),
        None => "[unknown]".to_owned(),
    }
}

/// The objects valgrind read symbols from (`Reading syms from PATH`), each with the debug
/// file it accepted for it (`Considering PATH ..` followed by `.. build-id is valid`),
/// except valgrind's own.
fn loaded_objects(log: &str) -> Vec<Vec<PathBuf>> {
    let lines: Vec<&str> = log.lines().collect();
    let mut objects: Vec<Vec<PathBuf>> = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if let Some((_, path)) = line.split_once("Reading syms from ") {
            objects.push(vec![PathBuf::from(path.trim())]);
        } else if let Some((_, rest)) = line.split_once("Considering ")
            && lines
                .get(i + 1)
                .is_some_and(|next| next.contains("build-id is valid"))
            && let Some(object) = objects.last_mut()
        {
            let path = rest.trim().trim_end_matches("..").trim_end();
            object.push(PathBuf::from(path));
        }
    }
    objects.retain(|files| !files[0].to_string_lossy().contains("/valgrind/"));
    objects
}

/// heapprofd's samples as points: frames from the caller of the allocator outwards (the
/// leaf, the allocator's entry, is dropped), with the inlined-frame marks the profile's
/// locations carry, and locations without a function as `[MAPPING FILE NAME]`.
///
/// `common::samples` would drop locations without lines, hiding junk frames.
pub fn heapprofd_points(profile: &Profile) -> Vec<Point> {
    let string = |i: i64| profile.string_table[i as usize].as_str();
    let functions: HashMap<u64, &str> = profile
        .function
        .iter()
        .map(|f| (f.id, string(f.name)))
        .collect();
    let mappings: HashMap<u64, &str> = profile
        .mapping
        .iter()
        .map(|m| (m.id, string(m.filename)))
        .collect();
    let locations: HashMap<u64, Vec<Frame>> = profile
        .location
        .iter()
        .map(|location| {
            let frames = if location.line.is_empty() {
                vec![Frame {
                    name: unnamed(mappings.get(&location.mapping_id).copied()),
                    inlined: false,
                }]
            } else {
                let last = location.line.len() - 1;
                location
                    .line
                    .iter()
                    .enumerate()
                    .map(|(i, line)| Frame {
                        name: functions
                            .get(&line.function_id)
                            .copied()
                            .unwrap_or("[unknown]")
                            .to_owned(),
                        inlined: i < last,
                    })
                    .collect()
            };
            (location.id, frames)
        })
        .collect();
    profile
        .sample
        .iter()
        .map(|sample| Point {
            frames: sample
                .location_id
                .iter()
                .skip(1)
                .flat_map(|id| locations[id].clone())
                .collect(),
            blocks: sample.value[0],
            bytes: sample.value[1],
        })
        .collect()
}

/// Total (bytes, blocks) of `points`.
pub fn point_totals(points: &[Point]) -> (i64, i64) {
    points
        .iter()
        .fold((0, 0), |(b, k), p| (b + p.bytes, k + p.blocks))
}

/// The normalized stacks of `points` (see the module's documentation for each rule).
pub fn normalize(points: &[Point], aliases: &Aliases) -> StackMap {
    let mut stacks = StackMap::new();
    for point in points {
        let entry = stacks
            .entry(normalize_stack(&point.frames, aliases))
            .or_default();
        entry.0 += point.bytes;
        entry.1 += point.blocks;
    }
    stacks
}

/// One stack's normalized names: allocator frames dropped at the inner end, cut after
/// `main`, at the first below-main frame, or (when it reaches neither) after `_dl_init`.
pub fn normalize_stack(frames: &[Frame], aliases: &Aliases) -> Vec<String> {
    let mut names: Vec<String> = frames
        .iter()
        .map(|f| normalize_name(&f.name, f.inlined, aliases))
        .skip_while(|name| ALLOCATORS.contains(&name.as_str()))
        .collect();
    if let Some(end) = names.iter().position(|n| n == "main" || is_below_main(n)) {
        if is_below_main(&names[end]) {
            names[end] = "(below main)".to_owned();
        }
        names.truncate(end + 1);
    } else if let Some(end) = names.iter().position(|n| n == "_dl_init") {
        names.truncate(end + 1);
    }
    names
}

/// The C library's start-up code that calls main: valgrind shows it as `(below main)`.
fn is_below_main(name: &str) -> bool {
    name == "(below main)"
        || name == "__libc_start_call_main"
        || name.starts_with("__libc_start_main")
        || name == "generic_start_main"
}

/// A function name in the form both tools agree on (see the module's documentation).
pub fn normalize_name(name: &str, inlined: bool, aliases: &Aliases) -> String {
    let name = name.trim();
    if name == "(below main)" || name.starts_with('[') {
        return name.to_owned();
    }
    let is_c = !name.contains(['(', '<', ':', ' ', '[']);
    if is_c {
        // `_IO_file_overflow@@GLIBC_2.2.5`, `write_input.part.0`, `foo.cold`.
        let base = name.split(['@', '.']).next().unwrap_or(name);
        return aliases.canonical(base).to_owned();
    }
    let components = cxx_components(name);
    if inlined {
        components.last().cloned().unwrap_or_default()
    } else {
        components.join("::")
    }
}

/// The scope components of a demangled C++ function name without return type, template
/// arguments, parameter list, ABI tags and clone suffixes: `void std::vector<int,
/// std::allocator<int> >::_M_realloc_insert<int>(...)` -> [std, vector,
/// _M_realloc_insert]. Operator names keep their symbol (`operator+=`, `operator[]`,
/// `operator()`, `operator new[]`), lambdas their braces (`{lambda(int)#1}`).
pub fn cxx_components(name: &str) -> Vec<String> {
    let chars: Vec<char> = name.chars().collect();
    let mut components: Vec<String> = Vec::new();
    let mut current = String::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == 'o' && starts_word(&chars, i, "operator") {
            let (symbol, next) = operator_symbol(&chars, i + "operator".len());
            current.push_str("operator");
            current.push_str(&symbol);
            i = next;
            continue;
        }
        match c {
            '<' => i = skip_balanced(&chars, i, '<', '>'),
            '[' => i = skip_balanced(&chars, i, '[', ']'),
            '{' => {
                let end = skip_balanced(&chars, i, '{', '}');
                current.extend(&chars[i..end]);
                i = end;
            }
            '(' if starts_with(&chars, i, "(anonymous namespace)") => {
                current.push_str("(anonymous namespace)");
                i += "(anonymous namespace)".len();
            }
            // The parameter list: the name ends here (cv-qualifiers, clones follow).
            '(' => break,
            ':' if chars.get(i + 1) == Some(&':') => {
                components.push(std::mem::take(&mut current));
                i += 2;
            }
            // A space outside brackets ends a return type: `int& std::vector<...>::...`.
            ' ' => {
                components.clear();
                current.clear();
                i += 1;
            }
            _ => {
                current.push(c);
                i += 1;
            }
        }
    }
    components.push(current);
    components.retain(|c| !c.is_empty());
    components
}

fn starts_with(chars: &[char], at: usize, word: &str) -> bool {
    word.chars()
        .enumerate()
        .all(|(k, w)| chars.get(at + k) == Some(&w))
}

fn is_identifier_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `word` starts at `at` as a whole identifier.
fn starts_word(chars: &[char], at: usize, word: &str) -> bool {
    starts_with(chars, at, word)
        && (at == 0 || !is_identifier_char(chars[at - 1]))
        && !chars
            .get(at + word.len())
            .is_some_and(|c| is_identifier_char(*c))
}

/// The index after the bracket group opening at `at` (or the end of the name).
fn skip_balanced(chars: &[char], at: usize, open: char, close: char) -> usize {
    let mut depth = 0;
    for (k, c) in chars.iter().enumerate().skip(at) {
        if *c == open {
            depth += 1;
        } else if *c == close {
            depth -= 1;
            if depth == 0 {
                return k + 1;
            }
        }
    }
    chars.len()
}

/// The symbol of an operator name whose `operator` keyword ends at `at`, and the index
/// after it: `()`, `[]`, ` new[]`, `+=`, `<<`, or a conversion's type (` bool`).
fn operator_symbol(chars: &[char], at: usize) -> (String, usize) {
    const SYMBOLS: &[&str] = &[
        "()", "[]", "<=>", "<<=", ">>=", "->*", "<<", ">>", "<=", ">=", "==", "!=", "&&", "||",
        "++", "--", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "->", ",", "<", ">", "+", "-",
        "*", "/", "%", "^", "&", "|", "~", "!", "=",
    ];
    for word in [" new[]", " delete[]", " new", " delete"] {
        if starts_with(chars, at, word)
            && !chars
                .get(at + word.len())
                .is_some_and(|c| is_identifier_char(*c))
        {
            return (word.to_owned(), at + word.len());
        }
    }
    for symbol in SYMBOLS {
        if starts_with(chars, at, symbol) {
            let mut next = at + symbol.len();
            // libiberty separates template arguments from `<`-like symbols: `operator< <int>`.
            if chars.get(next) == Some(&' ') && chars.get(next + 1) == Some(&'<') {
                next += 1;
            }
            return ((*symbol).to_owned(), next);
        }
    }
    // A conversion operator: ` bool`, ` std::string`, up to its parameter list.
    let mut end = at;
    let mut depth = 0;
    while end < chars.len() {
        match chars[end] {
            '<' => depth += 1,
            '>' => depth -= 1,
            '(' if depth == 0 => break,
            _ => {}
        }
        end += 1;
    }
    (chars[at..end].iter().collect(), end)
}

/// Names that a symbol table gives the same address, so that both tools' choices among a
/// function's aliases compare equal. Each name maps to one representative: the one with
/// the fewest leading underscores, then the shortest (`strdup` for `__strdup` and
/// `__GI___strdup`). Aliases are taken per object (a library and its debug file); a name
/// that two objects give different representatives stays as it is.
#[derive(Debug, Default)]
pub struct Aliases {
    canonical: HashMap<String, String>,
}

impl Aliases {
    /// Reads the function symbols (`.symtab` and `.dynsym`) of `objects`, each a list of
    /// files (a library and its debug file). Unreadable files are skipped: their names
    /// stay as they are.
    pub fn from_objects(objects: &[Vec<PathBuf>]) -> Self {
        use object::{Object as _, ObjectSymbol as _, SymbolKind};
        let mut seen: HashMap<String, Option<String>> = HashMap::new();
        for files in objects {
            let mut union = NameUnion::default();
            let mut by_address: HashMap<u64, Vec<usize>> = HashMap::new();
            for path in files {
                let Ok(data) = std::fs::read(path) else {
                    continue;
                };
                let Ok(file) = object::File::parse(data.as_slice()) else {
                    continue;
                };
                for symbol in file.symbols().chain(file.dynamic_symbols()) {
                    if symbol.kind() != SymbolKind::Text || symbol.address() == 0 {
                        continue;
                    }
                    let Ok(name) = symbol.name() else { continue };
                    let name = name.split('@').next().unwrap_or(name);
                    if name.is_empty() {
                        continue;
                    }
                    let id = union.id(name);
                    by_address.entry(symbol.address()).or_default().push(id);
                }
            }
            for ids in by_address.values() {
                for pair in ids.windows(2) {
                    union.join(pair[0], pair[1]);
                }
            }
            for (name, representative) in union.representatives() {
                let entry = seen.entry(name).or_insert(Some(representative.clone()));
                if entry.as_ref() != Some(&representative) {
                    *entry = None;
                }
            }
        }
        Self {
            canonical: seen
                .into_iter()
                .filter_map(|(name, rep)| rep.filter(|r| *r != name).map(|r| (name, r)))
                .collect(),
        }
    }

    /// The representative of `name`'s aliases (`name` itself when no table has it).
    pub fn canonical<'a>(&'a self, name: &'a str) -> &'a str {
        self.canonical.get(name).map_or(name, String::as_str)
    }
}

/// Union-find over names.
#[derive(Default)]
struct NameUnion {
    ids: HashMap<String, usize>,
    names: Vec<String>,
    parent: Vec<usize>,
}

impl NameUnion {
    fn id(&mut self, name: &str) -> usize {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = self.names.len();
        self.ids.insert(name.to_owned(), id);
        self.names.push(name.to_owned());
        self.parent.push(id);
        id
    }

    fn root(&mut self, mut id: usize) -> usize {
        while self.parent[id] != id {
            self.parent[id] = self.parent[self.parent[id]];
            id = self.parent[id];
        }
        id
    }

    fn join(&mut self, a: usize, b: usize) {
        let (a, b) = (self.root(a), self.root(b));
        if a != b {
            self.parent[a] = b;
        }
    }

    fn representatives(mut self) -> HashMap<String, String> {
        let rank = |name: &str| {
            (
                name.len() - name.trim_start_matches('_').len(),
                name.len(),
                name.to_owned(),
            )
        };
        let mut best: HashMap<usize, usize> = HashMap::new();
        for id in 0..self.names.len() {
            let root = self.root(id);
            let current = best.entry(root).or_insert(id);
            if rank(&self.names[id]) < rank(&self.names[*current]) {
                *current = id;
            }
        }
        (0..self.names.len())
            .map(|id| {
                let representative = best[&self.root(id)];
                (self.names[id].clone(), self.names[representative].clone())
            })
            .collect()
    }
}

/// Total (bytes, blocks) of a stack map.
pub fn stack_totals(stacks: &StackMap) -> (i64, i64) {
    stacks
        .values()
        .fold((0, 0), |(b, k), (bytes, blocks)| (b + bytes, k + blocks))
}

/// Percentage of the bytes whose stack reaches `main` or the C library's start routine
/// (normalized: ends in `main` or `(below main)`).
pub fn reach_main_percent(stacks: &StackMap) -> f64 {
    let (total, _) = stack_totals(stacks);
    let reached: i64 = stacks
        .iter()
        .filter(|(stack, _)| {
            stack
                .last()
                .is_some_and(|f| f == "main" || f == "(below main)")
        })
        .map(|(_, (bytes, _))| bytes)
        .sum();
    percent(reached, total)
}

fn percent(part: i64, whole: i64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

/// A stack for messages: `inner <- ... <- main`.
pub fn show(stack: &[String]) -> String {
    if stack.is_empty() {
        "(no frame above the allocator)".to_owned()
    } else {
        stack.join(" <- ")
    }
}

/// The innermost frame of `stack` that is one of `user_functions` (compared by the last
/// component of the normalized name).
fn innermost_user<'a>(stack: &'a [String], user_functions: &[&str]) -> Option<&'a str> {
    stack
        .iter()
        .find(|f| {
            let last = f.rsplit("::").next().unwrap_or(f);
            user_functions.contains(&last)
        })
        .map(String::as_str)
}

/// How close `ours` is to `truth`: the percentage of the truth's bytes on identical
/// stacks, and the percentage charged to the right innermost function of `user_functions`
/// (bytes whose stack has none of them, such as code run before main, are right when
/// they are charged to no user function on both sides).
pub fn agreement(truth: &StackMap, ours: &StackMap, user_functions: &[&str]) -> (f64, f64) {
    let (total, _) = stack_totals(truth);
    let exact: i64 = truth
        .iter()
        .map(|(stack, (bytes, _))| (*bytes).min(ours.get(stack).map_or(0, |v| v.0)))
        .sum();
    let by_user = |stacks: &StackMap| {
        let mut sums: HashMap<Option<String>, i64> = HashMap::new();
        for (stack, (bytes, _)) in stacks {
            *sums
                .entry(innermost_user(stack, user_functions).map(str::to_owned))
                .or_default() += bytes;
        }
        sums
    };
    let (truth_users, our_users) = (by_user(truth), by_user(ours));
    let right_user: i64 = truth_users
        .iter()
        .map(|(user, bytes)| (*bytes).min(our_users.get(user).copied().unwrap_or(0)))
        .sum();
    (percent(exact, total), percent(right_user, total))
}

/// The stack maps as text, biggest first: `BYTES B in BLOCKS blocks  STACK`.
pub fn render(stacks: &StackMap) -> String {
    let mut rows: Vec<(&Vec<String>, &(i64, i64))> = stacks.iter().collect();
    rows.sort_by(|a, b| b.1.0.cmp(&a.1.0).then(a.0.cmp(b.0)));
    let mut text = String::new();
    for (stack, (bytes, blocks)) in rows {
        let _ = writeln!(text, "  {bytes:>10} B {blocks:>7} blocks  {}", show(stack));
    }
    text
}

/// Asserts that heapprofd's stacks (`ours`) equal DHAT's (`truth`), bytes and blocks per
/// stack. On failure the message lists the stacks only one side has and those whose
/// counts differ, with both values, and the two agreement figures of [`agreement`].
pub fn assert_same_stacks(what: &str, truth: &StackMap, ours: &StackMap, user_functions: &[&str]) {
    let (exact, right_user) = agreement(truth, ours, user_functions);
    let (truth_bytes, truth_blocks) = stack_totals(truth);
    let (our_bytes, our_blocks) = stack_totals(ours);
    let summary = format!(
        "{what}: {exact:.1}% of DHAT's bytes on identical stacks, {right_user:.1}% charged to \
         the right innermost user function; DHAT {} stacks, {truth_bytes} B in {truth_blocks} \
         blocks; heapprofd {} stacks, {our_bytes} B in {our_blocks} blocks",
        truth.len(),
        ours.len()
    );
    eprintln!("{summary}");
    if truth == ours {
        return;
    }
    let only = |a: &StackMap, b: &StackMap| -> StackMap {
        a.iter()
            .filter(|(stack, _)| !b.contains_key(*stack))
            .map(|(s, v)| (s.clone(), *v))
            .collect()
    };
    let mut message = format!("heapprofd's stacks differ from DHAT's\n{summary}\n");
    let only_truth = only(truth, ours);
    let only_ours = only(ours, truth);
    if !only_truth.is_empty() {
        let _ = write!(
            message,
            "\nonly in DHAT ({} stacks):\n{}",
            only_truth.len(),
            render(&only_truth)
        );
    }
    if !only_ours.is_empty() {
        let _ = write!(
            message,
            "\nonly in heapprofd ({} stacks):\n{}",
            only_ours.len(),
            render(&only_ours)
        );
    }
    let differing: Vec<String> = truth
        .iter()
        .filter_map(|(stack, theirs)| {
            let mine = ours.get(stack)?;
            (mine != theirs).then(|| {
                format!(
                    "  DHAT {} B in {} blocks, heapprofd {} B in {} blocks  {}",
                    theirs.0,
                    theirs.1,
                    mine.0,
                    mine.1,
                    show(stack)
                )
            })
        })
        .collect();
    if !differing.is_empty() {
        let _ = write!(
            message,
            "\non both sides, with different counts ({}):\n{}\n",
            differing.len(),
            differing.join("\n")
        );
    }
    panic!("{message}");
}

/// The functions of tests/programs/cxx_stl.cpp: `main` and its `workload::*` functions
/// (`make_values` is inlined).
pub const CXX_STL_FUNCTIONS: &[&str] = &[
    "main",
    "run",
    "build_records",
    "make_record",
    "make_name",
    "make_values",
    "make_tags",
    "index_records",
    "queue_work",
    "summarize",
];

/// The functions of tests/programs/wrappers.c.
pub const WRAPPERS_FUNCTIONS: &[&str] = &[
    "main",
    "run",
    "write_input",
    "read_lines",
    "remember_line",
    "format_lines",
    "tag_line",
];
