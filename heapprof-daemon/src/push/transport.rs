//! Sending one upload to one backend: HTTP (Pyroscope's `/ingest`, OTLP/HTTP) with
//! reqwest, OTLP/gRPC with tonic; both over rustls with the system's roots. Each
//! send ends in an [`Outcome`] that says whether to retry.

use std::time::Duration;

use bytes::Bytes;
use opentelemetry_proto::tonic::collector::profiles::v1development::ExportProfilesServiceResponse;
use prost::Message as _;
use thiserror::Error;
use tonic::{
    Code,
    metadata::{MetadataKey, MetadataValue},
    transport::{Channel, ClientTlsConfig, Endpoint},
};

use super::{
    ca::CaFile,
    error_text::chain,
    grpc, otlp,
    parca::{self, WriteRawResponse},
    pyroscope,
    series::Upload,
    target::{Header, Protocol, PushTarget},
};

/// A client that cannot be made.
#[derive(Debug, Error)]
#[error("push to {target}: cannot set up the client: {reason}")]
pub struct TransportError {
    target: String,
    reason: String,
}

/// How one send ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The backend took it.
    Sent,
    /// Not taken for a reason that may pass (unreachable, timed out, 429, 5xx, or
    /// the credentials refused, which an operator can fix at the backend): keep it
    /// and try again later.
    Retry(String),
    /// The backend will never take it (another 4xx, or it does not encode): drop it.
    Rejected(String),
}

/// The client of one push target.
#[derive(Debug)]
pub struct Transport {
    target: PushTarget,
    client: Client,
    timeout: Duration,
    /// Whether `--push-ca-file` is trusted, for the words of a certificate refused.
    with_ca_file: bool,
    /// `--push-otlp-original-payload`.
    original_payload: bool,
}

#[derive(Debug)]
enum Client {
    Http(reqwest::Client),
    Grpc(Channel),
}

impl Transport {
    /// The client of `target`, sends bounded by `timeout`, trusting `ca` besides the
    /// system's roots; OTLP requests carry the pprof in `original_payload` when it
    /// says. gRPC connects on first use, so this needs the runtime it will run on.
    pub fn new(
        target: PushTarget,
        timeout: Duration,
        ca: Option<&CaFile>,
        original_payload: bool,
    ) -> Result<Self, TransportError> {
        let error = |reason: String| TransportError {
            target: target.display.clone(),
            reason,
        };
        let client = match target.protocol {
            Protocol::PyroscopeIngest | Protocol::OtlpHttp => {
                let mut builder = reqwest::Client::builder()
                    .timeout(timeout)
                    .connect_timeout(timeout)
                    .user_agent(concat!("heapprofd/", env!("CARGO_PKG_VERSION")));
                for certificate in ca.map(CaFile::reqwest_certificates).unwrap_or_default() {
                    builder = builder.add_root_certificate(certificate);
                }
                Client::Http(builder.build().map_err(|err| error(chain(&err)))?)
            }
            Protocol::OtlpGrpc | Protocol::ParcaGrpc => {
                let endpoint = Endpoint::from_shared(target.url.to_string())
                    .map_err(|err| error(chain(&err)))?
                    .timeout(timeout)
                    .connect_timeout(timeout);
                let endpoint = if target.url.scheme() == "https" {
                    grpc_tls(endpoint, ca).map_err(|err| error(chain(&err)))?
                } else {
                    endpoint
                };
                Client::Grpc(endpoint.connect_lazy())
            }
        };
        Ok(Transport {
            target,
            client,
            timeout,
            with_ca_file: ca.is_some(),
            original_payload,
        })
    }

    /// Sends `upload` with `headers`.
    pub async fn send(&mut self, upload: &Upload, headers: &[Header]) -> Outcome {
        // The clients have their own timeouts; this one also bounds what they do not
        // cover (a server that accepts and never answers a TLS handshake).
        let timeout = self.timeout;
        let send = self.send_unbounded(upload, headers);
        match tokio::time::timeout(timeout + Duration::from_secs(1), send).await {
            Ok(Outcome::Retry(why)) if why.contains("certificate") => {
                Outcome::Retry(certificate_refused(why, self.with_ca_file))
            }
            Ok(outcome) => outcome,
            Err(_) => Outcome::Retry(format!("no answer within {timeout:?}")),
        }
    }

    async fn send_unbounded(&mut self, upload: &Upload, headers: &[Header]) -> Outcome {
        match (&mut self.client, self.target.protocol) {
            (Client::Http(client), Protocol::PyroscopeIngest) => {
                let request = pyroscope::ingest_request(upload);
                let builder = client
                    .post(self.target.url.clone())
                    .query(&request.query)
                    .header(reqwest::header::CONTENT_TYPE, request.content_type)
                    .body(request.body);
                http(builder, headers).await
            }
            (Client::Http(client), _) => {
                let built = {
                    let _turn = crate::memory_peaks::one_at_a_time();
                    otlp::export_request(upload, self.original_payload)
                };
                let body = match built {
                    Ok(body) => body,
                    Err(err) => return Outcome::Rejected(err.to_string()),
                };
                let builder = client
                    .post(self.target.url.clone())
                    .header(reqwest::header::CONTENT_TYPE, "application/x-protobuf")
                    .body(body);
                http(builder, headers).await
            }
            (Client::Grpc(channel), Protocol::ParcaGrpc) => {
                let body = Bytes::from(parca::write_raw_request(upload).encode_to_vec());
                let request = grpc_request(body, headers);
                match grpc::call::<WriteRawResponse>(channel, parca::WRITE_RAW, request).await {
                    Ok(_) => Outcome::Sent,
                    Err(status) => grpc_outcome(&status),
                }
            }
            (Client::Grpc(channel), _) => {
                let built = {
                    let _turn = crate::memory_peaks::one_at_a_time();
                    otlp::export_request(upload, self.original_payload)
                };
                let body = match built {
                    Ok(body) => Bytes::from(body),
                    Err(err) => return Outcome::Rejected(err.to_string()),
                };
                let request = grpc_request(body, headers);
                let answer: Result<ExportProfilesServiceResponse, _> =
                    grpc::call(channel, grpc::OTLP_EXPORT, request).await;
                match answer {
                    Ok(response) => match response.partial_success {
                        Some(partial) if partial.rejected_profiles > 0 => {
                            Outcome::Rejected(format!(
                                "{} profiles rejected: {}",
                                partial.rejected_profiles, partial.error_message
                            ))
                        }
                        _ => Outcome::Sent,
                    },
                    Err(status) => grpc_outcome(&status),
                }
            }
        }
    }
}

/// A gRPC request of the encoded `body`, `headers` as its metadata.
fn grpc_request(body: Bytes, headers: &[Header]) -> tonic::Request<Bytes> {
    let mut request = tonic::Request::new(body);
    for header in headers {
        if let (Ok(key), Ok(value)) = (
            MetadataKey::from_bytes(header.name.as_bytes()),
            MetadataValue::try_from(header.value.as_str()),
        ) {
            request.metadata_mut().insert(key, value);
        }
    }
    request
}

async fn http(mut builder: reqwest::RequestBuilder, headers: &[Header]) -> Outcome {
    for header in headers {
        builder = builder.header(header.name.as_str(), header.value.as_str());
    }
    match builder.send().await {
        Ok(response) => {
            let status = response.status();
            if status.is_success() {
                return Outcome::Sent;
            }
            let body = response.text().await.unwrap_or_default();
            http_outcome(status, &body)
        }
        // Without the URL: the log line names the target already, and the query
        // would repeat the whole series name.
        Err(err) if err.is_timeout() => {
            Outcome::Retry(format!("timed out: {}", chain(&err.without_url())))
        }
        Err(err) => Outcome::Retry(chain(&err.without_url())),
    }
}

/// `endpoint` over TLS: the system's roots and `ca`. A machine without system roots
/// (a bare container) still trusts `ca`: tonic refuses native roots it cannot find.
fn grpc_tls(endpoint: Endpoint, ca: Option<&CaFile>) -> Result<Endpoint, tonic::transport::Error> {
    let config = || match ca {
        Some(ca) => ClientTlsConfig::new().ca_certificate(ca.tonic_certificate()),
        None => ClientTlsConfig::new(),
    };
    match endpoint.clone().tls_config(config().with_native_roots()) {
        Ok(endpoint) => Ok(endpoint),
        Err(_) if ca.is_some() => endpoint.tls_config(config()),
        Err(err) => Err(err),
    }
}

/// What a backend's HTTP answer other than 2xx means for the upload.
fn http_outcome(status: reqwest::StatusCode, body: &str) -> Outcome {
    let why = format!("HTTP {status}{}", reason(body));
    match status.as_u16() {
        401 | 403 => Outcome::Retry(format!(
            "{why}: the credentials were refused; check --push-header or --push-token-file"
        )),
        408 | 429 => Outcome::Retry(why),
        code if code >= 500 => Outcome::Retry(why),
        _ => Outcome::Rejected(why),
    }
}

/// `why` a TLS handshake failed on the backend's certificate, with the fix.
fn certificate_refused(why: String, with_ca_file: bool) -> String {
    if with_ca_file {
        format!(
            "{why}: the backend's certificate is not signed by --push-ca-file's CA nor a system root"
        )
    } else {
        format!(
            "{why}: the backend's certificate is not signed by a system root; give its CA with --push-ca-file"
        )
    }
}

fn grpc_outcome(status: &tonic::Status) -> Outcome {
    // A transport error's cause (refused, a certificate) is its innermost source.
    let mut message = status.message().to_owned();
    let mut innermost = std::error::Error::source(status);
    while let Some(next) = innermost.and_then(std::error::Error::source) {
        innermost = Some(next);
    }
    if let Some(cause) = innermost.map(ToString::to_string)
        && !message.contains(&cause)
    {
        message = if message.is_empty() {
            cause
        } else {
            format!("{message}: {cause}")
        };
    }
    let why = format!("gRPC {:?}{}", status.code(), reason(&message));
    match status.code() {
        Code::Unauthenticated | Code::PermissionDenied => Outcome::Retry(format!(
            "{why}: the credentials were refused; check --push-header or --push-token-file"
        )),
        Code::InvalidArgument
        | Code::NotFound
        | Code::AlreadyExists
        | Code::FailedPrecondition
        | Code::OutOfRange
        | Code::Unimplemented => Outcome::Rejected(why),
        _ => Outcome::Retry(why),
    }
}

/// `: FIRST LINE` of a backend's answer, when it says something.
fn reason(text: &str) -> String {
    match text.lines().map(str::trim).find(|l| !l.is_empty()) {
        Some(line) => format!(": {}", line.chars().take(200).collect::<String>()),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_say_whether_to_retry_and_a_refusal_names_its_fix() {
        let status = |code| reqwest::StatusCode::from_u16(code).expect("a status");
        let Outcome::Retry(why) = http_outcome(status(401), "invalid token\n") else {
            panic!("a refusal is retried")
        };
        assert_eq!(
            why,
            "HTTP 401 Unauthorized: invalid token: the credentials were refused; \
             check --push-header or --push-token-file"
        );
        assert!(matches!(http_outcome(status(429), ""), Outcome::Retry(_)));
        assert!(matches!(http_outcome(status(503), ""), Outcome::Retry(_)));
        assert_eq!(
            http_outcome(status(400), "bad profile"),
            Outcome::Rejected("HTTP 400 Bad Request: bad profile".into())
        );
        let unavailable = tonic::Status::unavailable("down");
        assert!(matches!(grpc_outcome(&unavailable), Outcome::Retry(_)));
        let refused = tonic::Status::unauthenticated("no token");
        assert!(
            matches!(grpc_outcome(&refused), Outcome::Retry(why) if why.contains("--push-token-file"))
        );
        let invalid = tonic::Status::invalid_argument("bad");
        assert!(matches!(grpc_outcome(&invalid), Outcome::Rejected(_)));
    }
}
