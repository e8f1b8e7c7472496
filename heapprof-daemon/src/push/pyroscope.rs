//! Pyroscope's `POST /ingest?name=...&format=pprof`: the query and the multipart body
//! of one upload.
//!
//! As Grafana Pyroscope 1.x reads it (`pkg/og/convert/pprof`, `tree.SampleTypeConfig`):
//! the form part `profile` holds the pprof (gzip'd is fine), the part
//! `sample_type_config` a JSON object keyed by sample type with `units`,
//! `aggregation` and `cumulative`. The application name and the labels go in `name=`
//! as `app{key=value,...}`.

use std::fmt::Write as _;

use super::series::Upload;

/// Boundary of the multipart body: a fixed string that cannot occur in the JSON part
/// and is vanishingly unlikely in a gzip stream; each upload is checked for it anyway.
const BOUNDARY_STEM: &str = "heapprofd-pprof-boundary";

/// heapprofd's sample types as Pyroscope should read them: those counted since
/// tracing began are cumulative (allocated, temporary); the others are a level
/// (in use, in use at the peak), averaged over a time range, never summed.
pub const SAMPLE_TYPE_CONFIG: &str = concat!(
    r#"{"alloc_objects":{"units":"objects","aggregation":"sum","cumulative":true},"#,
    r#""alloc_space":{"units":"bytes","aggregation":"sum","cumulative":true},"#,
    r#""temp_objects":{"units":"objects","aggregation":"sum","cumulative":true},"#,
    r#""temp_space":{"units":"bytes","aggregation":"sum","cumulative":true},"#,
    r#""alloc_requested_space":{"units":"bytes","aggregation":"sum","cumulative":true},"#,
    r#""inuse_objects":{"units":"objects","aggregation":"average"},"#,
    r#""inuse_space":{"units":"bytes","aggregation":"average"},"#,
    r#""inuse_requested_space":{"units":"bytes","aggregation":"average"},"#,
    r#""peak_inuse_objects":{"units":"objects","aggregation":"average"},"#,
    r#""peak_inuse_space":{"units":"bytes","aggregation":"average"}}"#,
);

/// One `/ingest` request.
#[derive(Debug)]
pub struct IngestRequest {
    /// The query's `(name, value)` pairs.
    pub query: Vec<(&'static str, String)>,
    /// `multipart/form-data; boundary=...`.
    pub content_type: String,
    /// The form.
    pub body: Vec<u8>,
}

/// The request that pushes `upload`.
pub fn ingest_request(upload: &Upload) -> IngestRequest {
    let from = upload.time_nanos / 1_000_000_000;
    let until = (upload.time_nanos + upload.duration_nanos.max(0)) / 1_000_000_000;
    let query = vec![
        ("name", application_name(upload)),
        ("format", "pprof".to_owned()),
        ("from", from.to_string()),
        ("until", until.max(from).to_string()),
        ("spyName", "heapprofd".to_owned()),
    ];
    let mut boundary = BOUNDARY_STEM.to_owned();
    while contains(&upload.pprof_gz, boundary.as_bytes()) {
        boundary.push('x');
    }
    let mut body = Vec::with_capacity(upload.pprof_gz.len() + 1024);
    part(
        &mut body,
        &boundary,
        "profile",
        "profile.pprof",
        &upload.pprof_gz,
    );
    part(
        &mut body,
        &boundary,
        "sample_type_config",
        "sample_type_config.json",
        SAMPLE_TYPE_CONFIG.as_bytes(),
    );
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    IngestRequest {
        query,
        content_type: format!("multipart/form-data; boundary={boundary}"),
        body,
    }
}

/// `service{label=value,...}`: what Pyroscope parses into `service_name` and labels.
pub fn application_name(upload: &Upload) -> String {
    let mut name = clean(&upload.series.service_name);
    name.push('{');
    for (i, (key, value)) in upload.series.labels.iter().enumerate() {
        if i > 0 {
            name.push(',');
        }
        let _ = write!(name, "{}={}", clean(key), clean(value));
    }
    name.push('}');
    name
}

/// `text` with the characters the `app{k=v}` syntax reserves (and white space)
/// replaced by `_`: a cgroup path keeps its slashes.
fn clean(text: &str) -> String {
    text.chars()
        .map(|c| match c {
            '{' | '}' | ',' | '=' | '"' | '\'' => '_',
            c if c.is_whitespace() || c.is_control() => '_',
            c => c,
        })
        .collect()
}

fn part(body: &mut Vec<u8>, boundary: &str, name: &str, file_name: &str, content: &[u8]) {
    body.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{file_name}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend_from_slice(content);
    body.extend_from_slice(b"\r\n");
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::push::series::Series;

    fn upload() -> Upload {
        Upload {
            series: Series {
                service_name: "my app".into(),
                labels: vec![
                    ("pid".into(), "7".into()),
                    ("cgroup".into(), "/system.slice/a,b.service".into()),
                ],
            },
            time_nanos: 20_000_000_000,
            duration_nanos: 10_000_000_000,
            pprof_gz: bytes::Bytes::from_static(b"\x1f\x8bPROFILE"),
        }
    }

    #[test]
    fn the_name_carries_the_service_and_the_labels() {
        assert_eq!(
            application_name(&upload()),
            "my_app{pid=7,cgroup=/system.slice/a_b.service}"
        );
    }

    #[test]
    fn the_form_holds_the_profile_and_the_sample_type_config() {
        let request = ingest_request(&upload());
        let query: std::collections::HashMap<_, _> = request.query.into_iter().collect();
        assert_eq!(query["format"], "pprof");
        assert_eq!(query["from"], "20");
        assert_eq!(query["until"], "30");
        let body = String::from_utf8_lossy(&request.body);
        assert!(request.content_type.ends_with(BOUNDARY_STEM));
        let profile_part: &[u8] = b"name=\"profile\"; filename=\"profile.pprof\"\r\nContent-Type: application/octet-stream\r\n\r\n\x1f\x8bPROFILE\r\n";
        assert!(contains(&request.body, profile_part), "{body}");
        assert!(body.contains("name=\"sample_type_config\""));
        assert!(body.ends_with(&format!("--{BOUNDARY_STEM}--\r\n")));
        let config: serde_json::Value =
            serde_json::from_str(SAMPLE_TYPE_CONFIG).expect("valid JSON");
        assert_eq!(config["alloc_space"]["cumulative"], true);
        assert!(config["inuse_space"].get("cumulative").is_none());
    }
}
