//! Call stacks: the allocator's immediate caller is present and every stack is the true one.

mod common;

use std::collections::BTreeMap;

use common::*;

fn check_stacks(optimization: &str) {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "stacks", "stacks", &[optimization]);
    let out = dir.path().join("profiles");
    run_ok(heapprofd(&out).arg("--").arg(&program));

    let samples = samples(&last_profile(&out));
    let mut stacks: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    for sample in &samples {
        let frames = sample.up_to_main();
        if frames.iter().any(|f| *f == "a" || *f == "b") {
            assert_eq!(sample.stack[0], "malloc", "leaf of {frames:?}");
            let entry = stacks.entry(frames.join(" <- ")).or_default();
            entry.0 += sample.values[0];
            entry.1 += sample.values[1];
        }
    }
    let expected: BTreeMap<String, (i64, i64)> = [
        ("a <- main", (1, 1000)),
        ("b <- a <- main", (1, 100)),
        ("b <- main", (1, 100)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    assert_eq!(
        stacks, expected,
        "stacks at {optimization} (objects, bytes)"
    );
}

#[test]
fn three_stacks_at_o0() {
    check_stacks("-O0");
}

#[test]
fn three_stacks_at_o2_with_frame_pointers() {
    check_stacks("-O2");
}
