//! `--push`: heapprofd sends its profiles to receivers built here from the official
//! definitions (no backend server can be installed on the test machines): a
//! Pyroscope `/ingest` endpoint that parses the multipart form, an OTLP/HTTP
//! endpoint, and an OTLP `ProfilesService` from `opentelemetry-proto`'s tonic server
//! trait. What they receive is compared with the files heapprofd wrote.

mod common;
mod push_receivers;

use std::{
    collections::HashMap,
    io::Read as _,
    path::{Path, PathBuf},
    process::Command,
    sync::Mutex,
    time::Duration,
};

use common::*;
use opentelemetry_proto::tonic::{
    collector::profiles::v1development::ExportProfilesServiceRequest, common::v1::any_value::Value,
};
use prost::Message as _;
use push_receivers::*;

/// The profiles heapprofd wrote into `out`, in order, as its `--profiles-json` lists them.
fn written(out: &Path) -> Vec<PathBuf> {
    let file = out.with_extension("jsonl");
    heapprof_daemon::profiles_file::read(&file)
        .unwrap_or_else(|e| panic!("no --profiles-json {}: {e:#}", file.display()))
        .into_iter()
        .filter_map(|line| match line {
            heapprof_daemon::profiles_file::Line::Interval(record)
            | heapprof_daemon::profiles_file::Line::Final(record) => Some(record.path),
            _ => None,
        })
        .collect()
}

/// heapprofd writing into `out` and listing its profiles, with `args`.
fn heapprofd_pushing(out: &Path, args: &[&str]) -> Command {
    let mut cmd = heapprofd(out);
    cmd.arg("--profiles-json").arg(out.with_extension("jsonl"));
    cmd.arg("--stats-json")
        .arg(out.with_extension("stats.json"));
    cmd.args(args);
    cmd
}

/// The push to `url`'s figures at exit, from `--stats-json` of the run writing to
/// `out`: (sent, failed, spooled, dropped, left).
fn summary(out: &Path, url: &str) -> [u64; 5] {
    let path = out.with_extension("stats.json");
    let stats = read_stats(&path);
    let target = stats["push"]
        .as_array()
        .and_then(|targets| targets.iter().find(|t| t["target"] == url))
        .unwrap_or_else(|| panic!("no figures of the push to {url} in {stats}"));
    ["sent", "failed_pushes", "spooled", "dropped", "left"].map(|key| {
        target[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key} in {target}"))
    })
}

#[test]
fn each_backend_receives_the_files_written_with_labels_sample_types_and_auth() {
    require_root();
    // One at a time: a test's never-listened port could be another's receiver.
    let _serial = serial();
    let dir = scratch();
    let out = dir.path().join("profiles");
    let program = compile(dir.path(), "stacks", "stacks", &["-O0"]);
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").expect("token file");
    let (pyroscope_port, grpc_port) = (free_port(), free_port());
    let http = http_receiver(pyroscope_port, Vec::new());
    let grpc = grpc_receiver(grpc_port);
    let ingest = format!("http://127.0.0.1:{pyroscope_port}/ingest");
    let otlp_http = format!("http://127.0.0.1:{pyroscope_port}/v1development/profiles");
    let otlp_grpc = format!("grpc://127.0.0.1:{grpc_port}");
    let output = run_ok(
        heapprofd_pushing(
            &out,
            &[
                "--push",
                &ingest,
                "--push",
                &otlp_http,
                "--push",
                &otlp_grpc,
                "--push-header",
                "X-Scope-OrgID: tenant1",
                "--push-token-file",
            ],
        )
        .arg(&token)
        .arg("--")
        .arg(&program),
    );
    let log = String::from_utf8_lossy(&output.stderr);
    let files = written(&out);
    assert!(!files.is_empty(), "no profile written:\n{log}");
    let file_bytes: Vec<Vec<u8>> = files
        .iter()
        .map(|f| std::fs::read(f).expect("profile"))
        .collect();

    let http = lock(&http).clone();
    let (pyroscope, otlp): (Vec<_>, Vec<_>) =
        http.iter().partition(|r| r.target.starts_with("/ingest"));
    assert_eq!(
        pyroscope.len(),
        files.len(),
        "one /ingest per profile:\n{log}"
    );
    assert_eq!(
        otlp.len(),
        files.len(),
        "one OTLP/HTTP request per profile:\n{log}"
    );
    for (request, bytes) in pyroscope.iter().zip(&file_bytes) {
        assert_eq!(request.query("format").as_deref(), Some("pprof"));
        let name = request.query("name").expect("name=");
        assert!(
            name.starts_with("stacks{pid=") && name.contains(",comm=stacks"),
            "{name}"
        );
        assert_eq!(request.headers["x-scope-orgid"], "tenant1");
        assert_eq!(request.headers["authorization"], "Bearer s3cret");
        let form = request.form();
        assert_eq!(
            &form["profile"], bytes,
            "the pushed pprof is the file's bytes"
        );
        let config: serde_json::Value =
            serde_json::from_slice(&form["sample_type_config"]).expect("JSON config");
        for sample_type in sample_types(&decode_bytes(bytes)) {
            assert!(
                config.get(&sample_type).is_some(),
                "{sample_type} configured"
            );
        }
        assert_eq!(config["alloc_space"]["cumulative"], true);
        assert_eq!(config["alloc_objects"]["cumulative"], true);
        assert_eq!(config["inuse_space"]["units"], "bytes");
        assert!(config["inuse_space"].get("cumulative").is_none());
    }
    let check_otlp = |request: &ExportProfilesServiceRequest, bytes: &[u8]| {
        let dictionary = request.dictionary.as_ref().expect("a dictionary");
        let resource = request.resource_profiles[0]
            .resource
            .as_ref()
            .expect("a resource");
        let attribute = |key: &str| {
            resource
                .attributes
                .iter()
                .find(|a| a.key == key)
                .and_then(|a| a.value.as_ref()?.value.clone())
        };
        assert_eq!(
            attribute("service.name"),
            Some(Value::StringValue("stacks".into()))
        );
        assert!(matches!(attribute("process.pid"), Some(Value::IntValue(pid)) if pid > 0));
        let profiles = &request.resource_profiles[0].scope_profiles[0].profiles;
        let types: Vec<&str> = profiles
            .iter()
            .map(|p| {
                let vt = p.sample_type.as_ref().expect("a sample type");
                dictionary.string_table[vt.type_strindex as usize].as_str()
            })
            .collect();
        let pprof = decode_bytes(bytes);
        assert_eq!(types, sample_types(&pprof));
        assert!(types.starts_with(&[
            "alloc_objects",
            "alloc_space",
            "inuse_objects",
            "inuse_space"
        ]));
        assert_eq!(profiles[0].original_payload_format, "pprof");
        assert_eq!(
            profiles[0].original_payload, bytes,
            "original_payload is the file"
        );
        // The translated values are the pprof's.
        for (i, profile) in profiles.iter().enumerate() {
            let total: i64 = profile.samples.iter().map(|s| s.values[0]).sum();
            let expected: i64 = pprof.sample.iter().map(|s| s.value[i]).sum();
            assert_eq!(total, expected, "{} totals", types[i]);
        }
    };
    for (request, bytes) in otlp.iter().zip(&file_bytes) {
        assert_eq!(request.headers["content-type"], "application/x-protobuf");
        assert_eq!(request.headers["authorization"], "Bearer s3cret");
        let request = ExportProfilesServiceRequest::decode(request.body.as_slice())
            .expect("an ExportProfilesServiceRequest");
        check_otlp(&request, bytes);
    }
    let grpc = lock(&grpc);
    assert_eq!(
        grpc.len(),
        files.len(),
        "one gRPC export per profile:\n{log}"
    );
    for ((auth, request), bytes) in grpc.iter().zip(&file_bytes) {
        assert_eq!(auth.as_deref(), Some("Bearer s3cret"));
        check_otlp(request, bytes);
    }
}

/// A profile's sample type names, in order.
fn sample_types(profile: &heapprof_daemon::pprof::proto::Profile) -> Vec<String> {
    profile
        .sample_type
        .iter()
        .map(|vt| profile.string_table[vt.r#type as usize].clone())
        .collect()
}

fn decode_bytes(gz: &[u8]) -> heapprof_daemon::pprof::proto::Profile {
    let mut bytes = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut bytes)
        .expect("gzip");
    heapprof_daemon::pprof::proto::Profile::decode(bytes.as_slice()).expect("a profile")
}

/// The pprof of every `/ingest` request `taken`.
fn pushed_profiles(taken: &Mutex<Vec<HttpRequest>>) -> Vec<Vec<u8>> {
    lock(taken)
        .iter()
        .map(|request| request.form().remove("profile").expect("a profile part"))
        .collect()
}

#[test]
fn the_spool_delivers_every_profile_exactly_once_after_an_outage() {
    require_root();
    // One at a time: a test's never-listened port could be another's receiver.
    let _serial = serial();
    let dir = scratch();
    let out = dir.path().join("profiles");
    let spool = dir.path().join("spool");
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}/ingest");
    let (mut child, log) = start_heapprofd(
        heapprofd_pushing(
            &out,
            &[
                "--interval",
                "200ms",
                "--push",
                &url,
                "--push-timeout",
                "5s",
                "--push-spool",
            ],
        )
        .arg(&spool)
        .args(["--", "sleep", "3"]),
    );
    // The backend is down while some profiles are written, then comes up.
    std::thread::sleep(Duration::from_millis(1500));
    let taken = http_receiver(port, Vec::new());
    wait_success(&mut child, &log, "heapprofd with an outage");
    let log: Vec<String> = log.try_iter().collect();
    let log = log.join("\n");
    let files: Vec<Vec<u8>> = written(&out)
        .iter()
        .map(|f| std::fs::read(f).expect("profile"))
        .collect();
    assert_eq!(
        pushed_profiles(&taken),
        files,
        "every profile received once, in order:\n{log}"
    );
    let [sent, failed, spooled, dropped, left] = summary(&out, &url);
    assert_eq!((sent, dropped, left), (files.len() as u64, 0, 0), "{log}");
    assert_eq!(spooled, sent);
    assert!(failed > 0, "the outage was seen:\n{log}");
    assert_eq!(
        log.matches(&format!("push to {url} failed")).count(),
        1,
        "one line when the backend fails:\n{log}"
    );
    assert!(log.contains(&format!("push to {url} works again")), "{log}");
    let left_files = std::fs::read_dir(&spool)
        .expect("spool")
        .flat_map(|d| std::fs::read_dir(d.expect("entry").path()).expect("target spool"))
        .count();
    assert_eq!(left_files, 0, "the spool is empty once sent");
}

#[test]
fn the_spool_cap_holds_when_the_backend_never_comes_back() {
    require_root();
    // One at a time: a test's never-listened port could be another's receiver.
    let _serial = serial();
    let dir = scratch();
    let out = dir.path().join("profiles");
    let spool = dir.path().join("spool");
    let url = format!("http://127.0.0.1:{}/ingest", free_port());
    let cap = 4096;
    let output = run_ok(
        heapprofd_pushing(
            &out,
            &[
                "--interval",
                "100ms",
                "--push",
                &url,
                "--push-timeout",
                "1s",
                "--push-spool-size",
                "4KiB",
                "--push-spool",
            ],
        )
        .arg(&spool)
        .args(["--", "sleep", "2"]),
    );
    let log = String::from_utf8_lossy(&output.stderr);
    let files = written(&out);
    let [sent, _failed, spooled, dropped, left] = summary(&out, &url);
    assert_eq!(sent, 0, "{log}");
    assert_eq!(spooled, files.len() as u64, "{log}");
    assert!(dropped > 0, "the cap dropped profiles:\n{log}");
    assert_eq!(
        dropped + left,
        spooled,
        "each profile is kept or counted as dropped"
    );
    let target_dir = std::fs::read_dir(&spool)
        .expect("spool")
        .next()
        .expect("one target's spool")
        .expect("entry")
        .path();
    let kept: Vec<u64> = std::fs::read_dir(&target_dir)
        .expect("target spool")
        .map(|e| e.expect("entry").metadata().expect("metadata").len())
        .collect();
    assert_eq!(kept.len() as u64, left, "{log}");
    assert!(kept.iter().sum::<u64>() <= cap, "the spool holds {kept:?}");
}

#[test]
fn a_backend_refusing_answering_429_503_or_hanging_gets_every_profile_and_delays_none() {
    require_root();
    // One at a time: a test's never-listened port could be another's receiver.
    let _serial = serial();
    let dir = scratch();
    let out = dir.path().join("profiles");
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}/ingest");
    let taken = http_receiver(
        port,
        vec![
            Answer::Status(429),
            Answer::Status(503),
            Answer::Hang(Duration::from_secs(2)),
        ],
    );
    let output = run_ok(
        heapprofd_pushing(
            &out,
            &[
                "--interval",
                "200ms",
                "--push",
                &url,
                "--push-timeout",
                "1s",
            ],
        )
        // Long enough for the answers above and their backoff (~3 s), so that the
        // exit's drain (one push timeout) finds a backend that works.
        .args(["--", "sleep", "4"]),
    );
    let log = String::from_utf8_lossy(&output.stderr);
    let files: Vec<Vec<u8>> = written(&out)
        .iter()
        .map(|f| std::fs::read(f).expect("profile"))
        .collect();
    // Local profiles went on while the pushes were retried: one per interval.
    assert!(files.len() > 3, "{} profiles:\n{log}", files.len());
    assert_eq!(pushed_profiles(&taken), files, "every profile once:\n{log}");
    let [sent, failed, _, dropped, _] = summary(&out, &url);
    assert_eq!((sent, dropped), (files.len() as u64, 0), "{log}");
    assert!(
        failed >= 3,
        "the refusal, 429, 503 and the timeout failed:\n{log}"
    );
    // One line when the pushes start failing, with the reason.
    let failing: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" failed: HTTP "))
        .collect();
    assert_eq!(failing.len(), 1, "{log}");
}

/// A cgroup of the v2 hierarchy for one test, removed when dropped.
struct TestCgroup(PathBuf);

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Its last processes may take a moment to be reaped.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

#[test]
fn with_all_each_process_is_its_own_series() {
    require_root();
    // One at a time: a test's never-listened port could be another's receiver.
    let _serial = serial();
    let dir = scratch();
    let out = dir.path().join("profiles");
    let waiter = compile(dir.path(), "waiter", "waiter", &["-O0"]);
    // --cgroup keeps the machine's other processes out of the profile.
    let cgroup_name = format!("heapprofd-test-push-{}", std::process::id());
    let mount = heapprof_daemon::cgroup::cgroup2_mount().expect("a cgroup v2 hierarchy");
    let cgroup = TestCgroup(mount.join(&cgroup_name));
    std::fs::create_dir(&cgroup.0).expect("creating the test cgroup");
    let port = free_port();
    let taken = http_receiver(port, Vec::new());
    let url = format!("http://127.0.0.1:{port}/ingest");
    let (child, log) = start_heapprofd(
        heapprofd_pushing(
            &out,
            &["--all", "--interval", "1h", "--push", &url, "--cgroup"],
        )
        .arg(format!("/{cgroup_name}")),
    );
    let mut child = KillOnDrop(child);
    // Two processes in the cgroup that allocate, then stay until the final profile
    // (so that their command names and cgroups are read).
    let script = format!(
        "echo $$ > {}/cgroup.procs && exec {} 100 32",
        cgroup.0.display(),
        waiter.display()
    );
    let mut waiters: Vec<Driven> = (0..2)
        .map(|_| Driven::spawn(Command::new("sh").args(["-c", &script])))
        .collect();
    for waiter in &mut waiters {
        waiter.step("done");
    }
    signal(&child.0, libc::SIGINT);
    wait_success(&mut child.0, &log, "heapprofd --all");
    drop(waiters);
    let file = written(&out).pop().expect("a profile");
    let file = decode_bytes(&std::fs::read(file).expect("the profile"));
    let requests = lock(&taken).clone();
    let mut pids = Vec::new();
    let mut samples = 0;
    for request in &requests {
        let name = request.query("name").expect("name=");
        // `SERVICE{pid=...,comm=...}`: the names of processes heapprofd met in the
        // middle of their start may be unknown, their pids never are.
        let labels = name
            .split_once('{')
            .and_then(|(_, rest)| rest.strip_suffix('}'))
            .unwrap_or_else(|| panic!("{name}"));
        let pid = labels
            .split(',')
            .find_map(|l| l.strip_prefix("pid="))
            .expect("a pid label");
        pids.push(pid.to_owned());
        let profile = decode_bytes(&request.form()["profile"]);
        assert_eq!(sample_types(&profile), sample_types(&file));
        samples += profile.sample.len();
    }
    pids.sort();
    pids.dedup();
    assert_eq!(requests.len(), 2, "one series per process: {pids:?}");
    assert_eq!(pids.len(), 2, "{pids:?}");
    assert_eq!(
        samples,
        file.sample.len(),
        "the series hold the profile's samples"
    );
}

#[test]
fn without_o_profiles_are_only_pushed() {
    require_root();
    // One at a time: a test's never-listened port could be another's receiver.
    let _serial = serial();
    let dir = scratch();
    let program = compile(dir.path(), "stacks", "stacks", &["-O0"]);
    let port = free_port();
    let taken = http_receiver(port, Vec::new());
    let child = Command::new(env!("CARGO_BIN_EXE_heapprofd"))
        .current_dir(dir.path())
        .env("RUST_LOG", "info")
        .args(["--push", &format!("http://127.0.0.1:{port}/ingest"), "--"])
        .arg(&program)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("heapprofd starts");
    let pid = child.id();
    let output = child.wait_with_output().expect("heapprofd ends");
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{log}");
    let pushed = pushed_profiles(&taken);
    assert_eq!(pushed.len(), 1, "the final profile:\n{log}");
    assert!(!decode_bytes(&pushed[0]).sample.is_empty());
    assert!(
        !std::env::temp_dir()
            .join(format!("heapprofd-push-{pid}"))
            .exists(),
        "the profiles' way to the push is removed"
    );
    assert!(
        !dir.path().join("heapprofd-profiles").exists(),
        "no local profiles"
    );
}

#[test]
fn over_tls_the_ca_file_is_trusted_and_without_it_the_certificate_is_named() {
    require_root();
    // One at a time: a test's never-listened port could be another's receiver.
    let _serial = serial();
    let dir = scratch();
    let program = compile(dir.path(), "stacks", "stacks", &["-O0"]);
    let ca = TestCa::new();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca.ca_pem).expect("the CA file");
    let (https_port, grpcs_port) = (free_port(), free_port());
    let https = http_receiver_over(https_port, Vec::new(), Some(ca.rustls_server()));
    let grpcs = grpc_receiver_over(grpcs_port, Some(ca.tonic_identity()));
    let ingest = format!("https://127.0.0.1:{https_port}/ingest");
    let otlp_grpcs = format!("grpcs://127.0.0.1:{grpcs_port}");
    let push = [
        "--push",
        &ingest,
        "--push",
        &otlp_grpcs,
        "--push-timeout",
        "1s",
    ];

    // Without the CA the handshakes fail: one line each names the certificate and
    // the flag, and the profiles are written all the same.
    let refused = dir.path().join("refused");
    let output = run_ok(heapprofd_pushing(&refused, &push).arg("--").arg(&program));
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(
        !written(&refused).is_empty(),
        "profiles written locally:\n{log}"
    );
    for url in [&ingest, &otlp_grpcs] {
        let failed: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(&format!("push to {url} failed")))
            .collect();
        assert_eq!(failed.len(), 1, "one line for {url}:\n{log}");
        assert!(
            failed[0].contains("certificate") && failed[0].contains("--push-ca-file"),
            "{}",
            failed[0]
        );
        assert_eq!(
            summary(&refused, url)[0],
            0,
            "nothing sent to {url}:\n{log}"
        );
    }
    assert!(lock(&https).is_empty() && lock(&grpcs).is_empty());

    // With it every profile arrives over TLS.
    let trusted = dir.path().join("trusted");
    let output = run_ok(
        heapprofd_pushing(&trusted, &push)
            .arg("--push-ca-file")
            .arg(&ca_file)
            .arg("--")
            .arg(&program),
    );
    let log = String::from_utf8_lossy(&output.stderr);
    let files: Vec<Vec<u8>> = written(&trusted)
        .iter()
        .map(|f| std::fs::read(f).expect("profile"))
        .collect();
    assert!(!files.is_empty(), "{log}");
    assert_eq!(pushed_profiles(&https), files, "over HTTPS:\n{log}");
    let grpcs: Vec<Vec<u8>> = lock(&grpcs)
        .iter()
        .map(|(_, request)| {
            request.resource_profiles[0].scope_profiles[0].profiles[0]
                .original_payload
                .clone()
        })
        .collect();
    assert_eq!(grpcs, files, "over gRPC with TLS:\n{log}");
}

#[test]
fn with_the_original_payload_off_otlp_carries_the_translated_profile_only() {
    require_root();
    // One at a time: a test's never-listened port could be another's receiver.
    let _serial = serial();
    let dir = scratch();
    let out = dir.path().join("profiles");
    let program = compile(dir.path(), "stacks", "stacks", &["-O0"]);
    let port = free_port();
    let grpc = grpc_receiver(port);
    let url = format!("grpc://127.0.0.1:{port}");
    let output = run_ok(
        heapprofd_pushing(
            &out,
            &["--push", &url, "--push-otlp-original-payload", "off"],
        )
        .arg("--")
        .arg(&program),
    );
    let log = String::from_utf8_lossy(&output.stderr);
    let files = written(&out);
    let grpc = lock(&grpc);
    assert_eq!(grpc.len(), files.len(), "one export per profile:\n{log}");
    for ((_, request), file) in grpc.iter().zip(&files) {
        let pprof = decode_bytes(&std::fs::read(file).expect("profile"));
        let profiles = &request.resource_profiles[0].scope_profiles[0].profiles;
        assert_eq!(profiles.len(), pprof.sample_type.len());
        for (i, profile) in profiles.iter().enumerate() {
            assert!(profile.original_payload.is_empty(), "no original payload");
            assert!(profile.original_payload_format.is_empty());
            let total: i64 = profile.samples.iter().map(|s| s.values[0]).sum();
            let expected: i64 = pprof.sample.iter().map(|s| s.value[i]).sum();
            assert_eq!(total, expected, "the translated values are the pprof's");
        }
    }
}

#[test]
fn parca_write_raw_receives_each_profile_as_written_in_its_series() {
    require_root();
    // One at a time: a test's never-listened port could be another's receiver.
    let _serial = serial();
    let dir = scratch();
    let out = dir.path().join("profiles");
    let program = compile(dir.path(), "stacks", "stacks", &["-O0"]);
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").expect("token file");
    let port = free_port();
    let parca = push_receivers::parca::parca_receiver(port);
    let url = format!("parca+grpc://127.0.0.1:{port}");
    let output = run_ok(
        heapprofd_pushing(&out, &["--push", &url, "--push-token-file"])
            .arg(&token)
            .arg("--")
            .arg(&program),
    );
    let log = String::from_utf8_lossy(&output.stderr);
    let files: Vec<Vec<u8>> = written(&out)
        .iter()
        .map(|f| std::fs::read(f).expect("profile"))
        .collect();
    let parca = lock(&parca);
    assert_eq!(parca.len(), files.len(), "one WriteRaw per profile:\n{log}");
    for ((auth, request), file) in parca.iter().zip(&files) {
        assert_eq!(auth.as_deref(), Some("Bearer s3cret"));
        assert!(!request.normalized);
        assert_eq!(request.series.len(), 1);
        let series = &request.series[0];
        let labels: HashMap<&str, &str> = series
            .labels
            .as_ref()
            .expect("a label set")
            .labels
            .iter()
            .map(|l| (l.name.as_str(), l.value.as_str()))
            .collect();
        assert_eq!(labels["__name__"], "memory");
        assert_eq!(labels["service_name"], "stacks");
        assert_eq!(labels["comm"], "stacks");
        assert!(labels["pid"].parse::<u32>().is_ok(), "{labels:?}");
        assert_eq!(series.samples.len(), 1);
        assert_eq!(&series.samples[0].raw_profile, file, "the file as written");
    }
}

#[test]
fn wrong_push_flags_are_one_clear_line_at_start() {
    let _serial = serial();
    let dir = scratch();
    let no_certificate = dir.path().join("no-certificate.pem");
    std::fs::write(&no_certificate, "not a certificate\n").expect("a file");
    let no_certificate = no_certificate.to_string_lossy().into_owned();
    for (args, expected) in [
        (
            vec![
                "--push",
                "grpcs://h:1",
                "--push-ca-file",
                "/nonexistent/ca.pem",
            ],
            "--push-ca-file /nonexistent/ca.pem: No such file or directory",
        ),
        (
            vec!["--push", "grpcs://h:1", "--push-ca-file", &no_certificate],
            "holds no PEM certificate",
        ),
        (
            vec!["--push", "ftp://host/ingest"],
            "unknown scheme `ftp`; use http(s)://HOST[:PORT]/ingest",
        ),
        (
            vec!["--push", "http://host/"],
            "names no known endpoint; use http(s)://HOST[:PORT]/ingest",
        ),
        (
            vec![
                "--push",
                "grpc://h:1",
                "--push-token-file",
                "/nonexistent/token",
            ],
            "--push-token-file /nonexistent/token: No such file or directory",
        ),
        (
            vec!["--push", "grpc://h:1", "--push-header", "no colon"],
            "write 'NAME: VALUE'",
        ),
    ] {
        let output = heapprofd(&dir.path().join("out"))
            .args(&args)
            .args(["--", "true"])
            .output()
            .expect("heapprofd runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: one line:\n{stderr}");
        assert!(lines[0].contains(expected), "{args:?}: {stderr}");
    }
}
