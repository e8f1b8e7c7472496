//! Parca's `ProfileStoreService/WriteRaw` (`parca.profilestore.v1alpha1`, as Parca's
//! `proto/parca/profilestore/v1alpha1/profilestore.proto` defines it): one upload as
//! a `WriteRawRequest` of one series.
//!
//! The messages are written here from that definition (Parca ships no Rust crate).
//! Parca names a profile type by its `__name__` label and each sample type: heapprofd's
//! series are `__name__="memory"` (as Parca names the Go heap profiles it scrapes),
//! so that Parca shows `memory:inuse_space:bytes:space:bytes` and the others. The
//! series' labels go with it; the pprof goes as written (Parca inflates gzip), with
//! `normalized` false: its addresses are the process's, as a scraped pprof's are.

use bytes::Bytes;

use super::series::Upload;

/// The method `WriteRaw`'s path.
pub const WRITE_RAW: &str = "/parca.profilestore.v1alpha1.ProfileStoreService/WriteRaw";

/// The profile type name heapprofd's series carry in `__name__`.
pub const PROFILE_NAME: &str = "memory";

/// `WriteRawRequest`: raw pprof profiles by series.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WriteRawRequest {
    /// Deprecated by Parca (tenants go in headers); left empty.
    #[prost(string, tag = "1")]
    pub tenant: String,
    /// The series and their profiles.
    #[prost(message, repeated, tag = "2")]
    pub series: Vec<RawProfileSeries>,
    /// Whether the addresses are normalized for position-independent code.
    #[prost(bool, tag = "3")]
    pub normalized: bool,
}

/// `WriteRawResponse`: empty.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WriteRawResponse {}

/// `RawProfileSeries`: a label set and its profiles.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RawProfileSeries {
    /// The labels that name the series.
    #[prost(message, optional, tag = "1")]
    pub labels: Option<LabelSet>,
    /// Its profiles.
    #[prost(message, repeated, tag = "2")]
    pub samples: Vec<RawSample>,
}

/// `LabelSet`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LabelSet {
    /// The labels.
    #[prost(message, repeated, tag = "1")]
    pub labels: Vec<Label>,
}

/// `Label`: a name and a value.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Label {
    /// The name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// The value.
    #[prost(string, tag = "2")]
    pub value: String,
}

/// `RawSample`: one pprof profile's bytes (its `executable_info`, field 2, is left
/// out: Parca reads it only when given).
#[derive(Clone, PartialEq, prost::Message)]
pub struct RawSample {
    /// The pprof, gzip'd or not.
    #[prost(bytes = "bytes", tag = "1")]
    pub raw_profile: Bytes,
}

/// The request that pushes `upload`.
pub fn write_raw_request(upload: &Upload) -> WriteRawRequest {
    let mut labels = vec![
        label("__name__", PROFILE_NAME),
        label("service_name", &upload.series.service_name),
    ];
    labels.extend(
        upload
            .series
            .labels
            .iter()
            .map(|(name, value)| label(name, value)),
    );
    WriteRawRequest {
        tenant: String::new(),
        series: vec![RawProfileSeries {
            labels: Some(LabelSet { labels }),
            samples: vec![RawSample {
                raw_profile: upload.pprof_gz.clone(),
            }],
        }],
        normalized: false,
    }
}

fn label(name: &str, value: &str) -> Label {
    Label {
        name: name.to_owned(),
        value: value.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::*;
    use crate::push::series::Series;

    #[test]
    fn the_series_is_named_memory_with_its_labels_and_the_file_as_written() {
        let upload = Upload {
            series: Series {
                service_name: "nginx".into(),
                labels: vec![("pid".into(), "7".into()), ("comm".into(), "nginx".into())],
            },
            time_nanos: 1,
            duration_nanos: 1,
            pprof_gz: Bytes::from_static(b"\x1f\x8bPROFILE"),
        };
        let encoded = write_raw_request(&upload).encode_to_vec();
        let request = WriteRawRequest::decode(encoded.as_slice()).expect("decodes");
        let series = &request.series[0];
        let labels: Vec<(&str, &str)> = series
            .labels
            .as_ref()
            .expect("labels")
            .labels
            .iter()
            .map(|l| (l.name.as_str(), l.value.as_str()))
            .collect();
        assert_eq!(
            labels,
            [
                ("__name__", "memory"),
                ("service_name", "nginx"),
                ("pid", "7"),
                ("comm", "nginx")
            ]
        );
        assert_eq!(series.samples[0].raw_profile, upload.pprof_gz);
        assert!(!request.normalized);
    }
}
