//! The profiles follow the pprof format's rules and the reference reader accepts them.

mod common;

use std::os::unix::fs::PermissionsExt as _;

use common::*;

#[test]
fn go_pprof_reads_every_sample_type_and_the_structure_holds() {
    require_root();
    let dir = scratch();
    let program = compile(dir.path(), "stacks", "stacks", &["-O0"]);
    let out = dir.path().join("profiles");
    run_ok(heapprofd(&out).arg("--").arg(&program));
    let (path, profile) = read_profiles(&out).pop().expect("a profile");

    let mode = std::fs::metadata(&path)
        .expect("metadata")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "profile file mode");
    let string = |i: i64| profile.string_table[i as usize].as_str();
    let types: Vec<(&str, &str)> = profile
        .sample_type
        .iter()
        .map(|t| (string(t.r#type), string(t.unit)))
        .collect();
    assert_eq!(
        types,
        [
            ("alloc_objects", "count"),
            ("alloc_space", "bytes"),
            ("inuse_objects", "count"),
            ("inuse_space", "bytes"),
            ("temp_objects", "count"),
            ("temp_space", "bytes"),
            ("peak_inuse_objects", "count"),
            ("peak_inuse_space", "bytes"),
        ]
    );
    let period = profile.period_type.expect("period_type");
    assert_eq!(
        (string(period.r#type), string(period.unit)),
        ("space", "bytes")
    );
    assert!(profile.time_nanos > 0 && profile.duration_nanos > 0);
    let main_mapping = profile.mapping.first().expect("mappings");
    assert_eq!(
        string(main_mapping.filename),
        program.display().to_string(),
        "main binary first"
    );
    assert!(
        string(main_mapping.build_id).len() >= 16,
        "build-id recorded"
    );
    let stacks = samples(&profile);
    assert!(stacks.iter().any(|s| s.up_to_main() == ["b", "a", "main"]));

    // The size class is a numeric label in bytes on every sample.
    for sample in &profile.sample {
        let class = sample
            .label
            .iter()
            .find(|l| string(l.key) == "size_class")
            .expect("a size_class label");
        assert_eq!(string(class.num_unit), "bytes");
    }
    for index in [
        "alloc_objects",
        "alloc_space",
        "inuse_objects",
        "inuse_space",
        "peak_inuse_space",
    ] {
        let stdout = go_pprof_top(&path, index);
        assert!(stdout.contains(" main"), "{index}: no main in\n{stdout}");
        assert!(
            stdout.contains(" malloc"),
            "{index}: no malloc in\n{stdout}"
        );
    }
}
