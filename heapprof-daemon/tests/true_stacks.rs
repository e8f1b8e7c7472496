//! True call stacks of code built without frame pointers: heapprofd's stacks equal those of
//! valgrind's DHAT, which unwinds with CFI, on the same program and input.
//!
//! Programs built with plain `-O2` (C++ through STL containers, C through libc's wrappers)
//! must match DHAT stack for stack, bytes and blocks; for Debian's own python3 and sqlite3
//! (no frame pointers, no debug info) nearly every byte's stack must reach main. See
//! tests/common/dhat.rs for how the two tools' stacks are made comparable.

mod common;

use std::{ffi::OsStr, path::Path};

use common::{dhat, *};

/// Runs `program args` (environment `env`) under DHAT and under heapprofd (launch mode);
/// returns DHAT's normalized stacks and heapprofd's, after checking that both counted the
/// same totals (a difference there is a counting problem, not an unwinding one).
fn dhat_and_heapprofd(
    dir: &Path,
    program: &Path,
    args: &[&OsStr],
    env: &[(&str, &str)],
) -> (dhat::StackMap, dhat::StackMap) {
    let truth_dir = dir.join("dhat");
    std::fs::create_dir(&truth_dir).expect("creating the DHAT directory");
    let truth = dhat::run(program, args, env, &truth_dir);

    let out = dir.join("profiles");
    run_ok(
        heapprofd(&out)
            .arg("--")
            .arg(program)
            .args(args)
            .envs(env.iter().copied())
            .current_dir(dir),
    );
    let ours = dhat::heapprofd_points(&last_profile(&out));
    assert_eq!(
        dhat::point_totals(&ours),
        truth.totals(),
        "bytes and blocks allocated, heapprofd vs DHAT ({})",
        truth.command
    );
    (truth.stacks(), dhat::normalize(&ours, &truth.aliases))
}

/// DHAT's view, printed for the record (`--nocapture`), and checked to be the ground truth
/// the comparison needs: a frame the compiler inlined, `inlined`, is in its stacks.
fn check_ground_truth(what: &str, truth: &dhat::StackMap, inlined: &str) {
    eprintln!(
        "DHAT's stacks of {what} ({} stacks, {:.2}% of bytes reach main):\n{}",
        truth.len(),
        dhat::reach_main_percent(truth),
        dhat::render(truth)
    );
    assert!(
        truth.keys().any(|stack| stack.iter().any(|f| f == inlined)),
        "DHAT shows no stack through the inlined {inlined}: valgrind did not read inline \
         info, the comparison would be meaningless:\n{}",
        dhat::render(truth)
    );
}

#[test]
fn cxx_stl_at_o2_has_dhat_stacks() {
    require_root();
    let dir = scratch();
    // Plain -O2 as distributions build: no frame pointers in the program or in libstdc++.
    let program = compile_exact("g++", dir.path(), "cxx_stl.cpp", "cxx_stl", &["-O2", "-g"]);
    let (truth, ours) = dhat_and_heapprofd(dir.path(), &program, &[], &[]);
    check_ground_truth("cxx_stl (g++ -O2)", &truth, "make_values");
    dhat::assert_same_stacks("cxx_stl (g++ -O2)", &truth, &ours, dhat::CXX_STL_FUNCTIONS);
    // Every stack was unwound to its end: libstdc++'s constructor allocating its
    // emergency pool included, whose outermost frame is the loader's entry code.
    let profile = last_profile(&dir.path().join("profiles"));
    assert_eq!(
        drop_count(&profile, heapprof_common::DropReason::StackIncomplete),
        0,
        "{:?}",
        comments(&profile)
    );
}

#[test]
fn c_wrappers_at_o2_without_frame_pointers_have_dhat_stacks() {
    require_root();
    let dir = scratch();
    let program = compile_exact(
        "gcc",
        dir.path(),
        "wrappers.c",
        "wrappers",
        &["-O2", "-g", "-fomit-frame-pointer"],
    );
    let work = dir.path().join("work");
    std::fs::create_dir(&work).expect("creating the program's directory");
    let args = [work.as_os_str()];
    let (truth, ours) = dhat_and_heapprofd(dir.path(), &program, &args, &[]);
    // getline is an inline wrapper in glibc's stdio.h.
    check_ground_truth("wrappers (gcc -O2 -fomit-frame-pointer)", &truth, "getline");
    dhat::assert_same_stacks(
        "wrappers (gcc -O2 -fomit-frame-pointer)",
        &truth,
        &ours,
        dhat::WRAPPERS_FUNCTIONS,
    );
}

/// The share of bytes whose stack reaches main: at least 99% for heapprofd, and DHAT
/// documents what is possible (a stack deeper than its 100 frames cannot reach main).
fn check_reach_main(what: &str, truth: &dhat::StackMap, ours: &dhat::StackMap) {
    let (theirs, mine) = (
        dhat::reach_main_percent(truth),
        dhat::reach_main_percent(ours),
    );
    // Not judged: DHAT charges a realloc to the block's first site, heapprofd to the
    // realloc (CPython's list and bytes growth, sqlite3Realloc), so even true stacks
    // differ there.
    let (exact, _) = dhat::agreement(truth, ours, &[]);
    eprintln!(
        "{what}: stacks reaching main or the libc start routine: DHAT {theirs:.2}% of bytes, \
         heapprofd {mine:.2}%; {exact:.1}% of DHAT's bytes on identical stacks (reallocs \
         differ by design)"
    );
    assert!(
        theirs >= 99.9,
        "DHAT's stacks of {what} reach main for only {theirs:.2}% of bytes: the ground truth \
         is not what this test assumes:\n{}",
        dhat::render(truth)
    );
    if mine < 99.0 {
        let short: dhat::StackMap = ours
            .iter()
            .filter(|(stack, _)| {
                !stack
                    .last()
                    .is_some_and(|f| f == "main" || f == "(below main)")
            })
            .map(|(s, v)| (s.clone(), *v))
            .collect();
        let rendered = dhat::render(&short);
        let lines: Vec<&str> = rendered.lines().take(25).collect();
        panic!(
            "{what}: only {mine:.2}% of heapprofd's bytes have a stack reaching main or the \
             libc start routine (DHAT: {theirs:.2}%); the biggest of its {} stacks that do \
             not:\n{}",
            short.len(),
            lines.join("\n")
        );
    }
}

#[test]
fn python3_stacks_reach_main() {
    require_root();
    let dir = scratch();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/stacks_script.py");
    // -B: root must not write .pyc files into the system's library. PYTHONHASHSEED: the
    // same dict layouts, so the same allocations, in both runs.
    let args = [OsStr::new("-B"), script.as_os_str()];
    let (truth, ours) = dhat_and_heapprofd(
        dir.path(),
        Path::new("/usr/bin/python3"),
        &args,
        &[("PYTHONHASHSEED", "0")],
    );
    check_reach_main("python3 (Debian)", &truth, &ours);
}

/// A few thousand rows inserted in one transaction, an index, and queries that sort,
/// group and join.
fn sqlite_workload() -> String {
    let mut sql = String::from(
        "CREATE TABLE items(id INTEGER PRIMARY KEY, name TEXT NOT NULL, category INTEGER, \
         payload TEXT);\nBEGIN;\n",
    );
    for i in 0..3000 {
        sql.push_str(&format!(
            "INSERT INTO items(name, category, payload) VALUES('item-{i:05}', {}, '{}');\n",
            i % 17,
            "x".repeat(20 + i % 50)
        ));
    }
    sql.push_str(
        "COMMIT;\n\
         CREATE INDEX items_by_category ON items(category, name);\n\
         SELECT category, count(*), sum(length(payload)) FROM items GROUP BY category ORDER BY category;\n\
         SELECT name FROM items WHERE category = 3 ORDER BY name DESC LIMIT 5;\n\
         SELECT count(*) FROM items a JOIN items b ON a.category = b.category AND a.id < b.id WHERE a.id < 200;\n\
         SELECT group_concat(name, ',') FROM (SELECT name FROM items WHERE id % 97 = 0);\n",
    );
    sql
}

#[test]
fn sqlite3_stacks_reach_main() {
    require_root();
    let dir = scratch();
    let sql = dir.path().join("workload.sql");
    std::fs::write(&sql, sqlite_workload()).expect("writing the SQL workload");
    let read = format!(".read {}", sql.display());
    let args = [
        OsStr::new("-batch"),
        OsStr::new(":memory:"),
        OsStr::new(&read),
    ];
    let (truth, ours) = dhat_and_heapprofd(dir.path(), Path::new("/usr/bin/sqlite3"), &args, &[]);
    check_reach_main("sqlite3 (Debian)", &truth, &ours);
}

/// The normalization rules on frame names both tools really produced (see
/// tests/common/dhat.rs): each pair must become one name, and different functions must not.
#[test]
fn names_of_both_tools_normalize_alike() {
    let aliases = dhat::Aliases::default();
    let same = |dhat_name: &str, heapprofd_name: &str, inlined: bool, expected: &str| {
        for name in [dhat_name, heapprofd_name] {
            assert_eq!(
                dhat::normalize_name(name, inlined, &aliases),
                expected,
                "{name:?} (inlined: {inlined})"
            );
        }
    };
    same(
        "void std::vector<int, std::allocator<int> >::_M_realloc_insert<int>(__gnu_cxx::__normal_iterator<int*, std::vector<int, std::allocator<int> > >, int&&)",
        "void std::vector<int, std::allocator<int> >::_M_realloc_insert<int>(__gnu_cxx::__normal_iterator<int*, std::vector<int, std::allocator<int> > >, int&&)",
        false,
        "std::vector::_M_realloc_insert",
    );
    same(
        "emplace_back<int>",
        "int& std::vector<int, std::allocator<int> >::emplace_back<int>(int&&)",
        true,
        "emplace_back",
    );
    same(
        "_Scoped_node<const std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >&, long unsigned int&>",
        "std::_Hashtable<std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >, std::pair<std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> > const, unsigned long>, std::allocator<std::pair<std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> > const, unsigned long> >, std::__detail::_Select1st, std::equal_to<std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> > >, std::hash<std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> > >, std::__detail::_Mod_range_hashing, std::__detail::_Default_ranged_hash, std::__detail::_Prime_rehash_policy, std::__detail::_Hashtable_traits<true, false, true> >::_Scoped_node::_Scoped_node<std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> > const&, unsigned long&>(std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> > const&, unsigned long&)",
        true,
        "_Scoped_node",
    );
    same(
        "workload::make_name[abi:cxx11](int)",
        "workload::make_name[abi:cxx11](int)",
        false,
        "workload::make_name",
    );
    same(
        "void std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >::_M_construct<char*>(char*, char*, std::forward_iterator_tag) [clone .isra.0]",
        "void std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >::_M_construct<char*>(char*, char*, std::forward_iterator_tag)",
        false,
        "std::__cxx11::basic_string::_M_construct",
    );
    // cpp_demangle's rendering of make_unique's pack is broken; the name survives.
    same(
        "make_unique<std::map<int, std::__cxx11::basic_string<char> > >",
        "std::__detail::_MakeUniq<std::map<int, std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >, std::less<int>, std::allocator<std::pair<int const, std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> > > > > >::__single_object std::make_unique<std::map<int, std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >, std::less<int>, std::allocator<std::pair<int const, std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> > > > >, >(&&)",
        true,
        "make_unique",
    );
    same(
        "operator+<char, std::char_traits<char>, std::allocator<char> >",
        "std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> > std::operator+<char, std::char_traits<char>, std::allocator<char> >(char const*, std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >&&)",
        true,
        "operator+",
    );
    same(
        "operator[]",
        "std::map<int, std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >, std::less<int>, std::allocator<std::pair<int const, std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> > > > >::operator[](int const&)",
        true,
        "operator[]",
    );
    same(
        "operator new(unsigned long)",
        "operator new(unsigned long, std::align_val_t, std::nothrow_t const&)",
        false,
        "operator new",
    );
    same(
        "operator new[](unsigned long)",
        "operator new[](unsigned long)",
        false,
        "operator new[]",
    );
    same(
        "_IO_file_overflow@@GLIBC_2.2.5",
        "_IO_file_overflow",
        false,
        "_IO_file_overflow",
    );
    same("write_input.part.0", "write_input", false, "write_input");
    same(
        "main::{lambda(int)#1}::operator()(int) const",
        "main::{lambda(int)#1}::operator()(int) const",
        false,
        "main::{lambda(int)#1}::operator()",
    );
    same(
        "(anonymous namespace)::pool::pool()",
        "(anonymous namespace)::pool::pool()",
        false,
        "(anonymous namespace)::pool::pool",
    );
    // Different functions stay different.
    for (a, b) in [
        ("operator+=", "operator+"),
        ("operator<", "operator<<"),
        ("operator new", "operator new[]"),
    ] {
        assert_ne!(
            dhat::normalize_name(a, true, &aliases),
            dhat::normalize_name(b, true, &aliases)
        );
    }
    assert_ne!(
        dhat::normalize_name("workload::make_name(int)", false, &aliases),
        dhat::normalize_name("other::make_name(int)", false, &aliases)
    );
}

/// glibc's aliases come from its symbol tables: both tools' names of one function become
/// one, and valgrind's `(below main)` and heapprofd's start routine end a stack alike.
#[test]
fn glibc_aliases_and_below_main_normalize_alike() {
    let libc = own_libc();
    let libc = libc.as_path();
    let build_id = gnu_build_id(libc);
    let debug = Path::new("/usr/lib/debug/.build-id")
        .join(&build_id[..2])
        .join(format!("{}.debug", &build_id[2..]));
    assert!(
        debug.exists(),
        "no debug file {} for {} (install libc6-dbg, which valgrind depends on)",
        debug.display(),
        libc.display()
    );
    let aliases = dhat::Aliases::from_objects(&[vec![libc.to_owned(), debug]]);
    for (dhat_name, heapprofd_name) in [
        ("strdup", "__GI___strdup"),
        ("_IO_file_doallocate", "__GI__IO_file_doallocate"),
        ("_IO_file_overflow@@GLIBC_2.2.5", "_IO_new_file_overflow"),
        ("printf", "__printf"),
        ("getdelim", "__GI___getdelim"),
    ] {
        assert_eq!(
            dhat::normalize_name(dhat_name, false, &aliases),
            dhat::normalize_name(heapprofd_name, false, &aliases),
            "{dhat_name} and {heapprofd_name} are one function"
        );
    }
    assert_ne!(
        dhat::normalize_name("strdup", false, &aliases),
        dhat::normalize_name("strndup", false, &aliases)
    );
    let frames = |names: &[&str]| -> Vec<dhat::Frame> {
        names
            .iter()
            .map(|n| dhat::Frame {
                name: (*n).to_owned(),
                inlined: false,
            })
            .collect()
    };
    assert_eq!(
        dhat::normalize_stack(&frames(&["[sqlite3]", "(below main)"]), &aliases),
        dhat::normalize_stack(
            &frames(&[
                "[sqlite3]",
                "__libc_start_call_main",
                "__libc_start_main_impl",
                "_start"
            ]),
            &aliases
        ),
    );
}

/// The C library this test runs on (the one valgrind and heapprofd's targets use).
fn own_libc() -> std::path::PathBuf {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("reading /proc/self/maps");
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.ends_with("/libc.so.6"))
        .map(Into::into)
        .unwrap_or_else(|| panic!("no libc.so.6 in /proc/self/maps:\n{maps}"))
}

/// DHAT's JSON as valgrind 3.19 writes it: inlined frames share an address, a recursive
/// call repeats a whole group, valgrind's own frames come first.
#[test]
fn dhat_json_parses_into_frames() {
    let json = r#"{"dhatFileVersion":2,"mode":"heap","verb":"Allocated","pps":[
        {"tb":100,"tbk":2,"fs":[1,2,3,4,2,3,4,5,6]},
        {"tb":7,"tbk":1,"fs":[7,8,9]}],
      "ftbl":["[root]",
        "0x4841F2F: operator new(unsigned long) (in /usr/libexec/valgrind/vgpreload_dhat-amd64-linux.so)",
        "0x10CA15: allocate (new_allocator.h:137)",
        "0x10CA15: walk<int> (tree.h:10)",
        "0x10CA15: ns::Tree::walk(int) (tree.cpp:5)",
        "0x10B9BB: main (tree.cpp:20)",
        "0x10B9C0: (below main) (libc_start_call_main.h:58)",
        "0x48417B4: malloc (in /usr/libexec/valgrind/vgpreload_dhat-amd64-linux.so)",
        "0x49007B9: ??? (in /usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30)",
        "0x4004B03: _dl_init (dl-init.c:121)"]}"#;
    let points = dhat::parse_dhat_json(json);
    let frames = |i: usize| -> Vec<(String, bool)> {
        points[i]
            .frames
            .iter()
            .map(|f| (f.name.clone(), f.inlined))
            .collect()
    };
    let expected = |list: &[(&str, bool)]| -> Vec<(String, bool)> {
        list.iter().map(|(n, i)| ((*n).to_owned(), *i)).collect()
    };
    assert_eq!(
        frames(0),
        expected(&[
            ("allocate", true),
            ("walk<int>", true),
            ("ns::Tree::walk(int)", false),
            ("allocate", true),
            ("walk<int>", true),
            ("ns::Tree::walk(int)", false),
            ("main", false),
            ("(below main)", false),
        ])
    );
    assert_eq!((points[0].bytes, points[0].blocks), (100, 2));
    assert_eq!(
        frames(1),
        expected(&[("[libstdc++.so.6.0.30]", false), ("_dl_init", false)])
    );
    let stacks = dhat::normalize(&points, &dhat::Aliases::default());
    let stack = |names: &[&str]| names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>();
    assert_eq!(
        stacks.get(&stack(&[
            "allocate",
            "walk",
            "ns::Tree::walk",
            "allocate",
            "walk",
            "ns::Tree::walk",
            "main"
        ])),
        Some(&(100, 2))
    );
    assert_eq!(
        stacks.get(&stack(&["[libstdc++.so.6.0.30]", "_dl_init"])),
        Some(&(7, 1))
    );
}

/// The GNU build-id of an ELF file, as hex.
fn gnu_build_id(path: &Path) -> String {
    use object::Object as _;
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let file = object::File::parse(data.as_slice())
        .unwrap_or_else(|e| panic!("{} is not ELF: {e}", path.display()));
    let id = file
        .build_id()
        .ok()
        .flatten()
        .unwrap_or_else(|| panic!("{} has no build-id", path.display()));
    id.iter().map(|b| format!("{b:02x}")).collect()
}
