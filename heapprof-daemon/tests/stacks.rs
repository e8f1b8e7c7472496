//! Call stacks: the allocator's immediate caller is present and every stack is the true one.

mod common;

use common::*;

fn check_stacks(optimization: &str) {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "stacks", "stacks", &[optimization]);
    let out = dir.path().join("profiles");
    run_ok(heapprofd(&out).arg("--").arg(&program));

    let (stacks, leaves) = abc_stacks(&samples(&last_profile(&out)));
    for leaf in &leaves {
        assert_eq!(leaf, "malloc", "leaf of a stack through a or b");
    }
    assert_eq!(
        stacks,
        expected_abc_stacks(),
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
