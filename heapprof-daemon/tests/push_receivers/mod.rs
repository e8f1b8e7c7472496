//! The receivers tests/push.rs pushes to, built from the official definitions (no
//! backend server can be installed on the test machines): an HTTP/1.1 endpoint
//! (Pyroscope's `/ingest` multipart form, OTLP/HTTP), an OTLP `ProfilesService` from
//! `opentelemetry-proto`'s tonic server trait; each in plain text or over TLS with a
//! certificate of a CA the test makes.
#![allow(dead_code, reason = "each test uses a different subset")]

pub mod parca;

use std::{
    collections::HashMap,
    io::{BufRead as _, BufReader, Read, Write},
    net::TcpListener,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use opentelemetry_proto::tonic::collector::profiles::v1development::{
    ExportProfilesServiceRequest, ExportProfilesServiceResponse,
    profiles_service_server::{ProfilesService, ProfilesServiceServer},
};

/// One request an HTTP receiver took.
#[derive(Debug, Clone)]
pub struct HttpRequest {
    pub target: String,
    pub headers: HashMap<String, String>,
    pub body: Vec<u8>,
}

impl HttpRequest {
    /// The query parameter `name`, percent-decoded.
    pub fn query(&self, name: &str) -> Option<String> {
        let url = reqwest::Url::parse(&format!("http://x{}", self.target)).expect("a target");
        url.query_pairs()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.into_owned())
    }

    /// The multipart form's parts, by name.
    pub fn form(&self) -> HashMap<String, Vec<u8>> {
        let content_type = &self.headers["content-type"];
        let boundary = content_type
            .split("boundary=")
            .nth(1)
            .expect("a multipart boundary");
        let delimiter = format!("--{boundary}");
        let mut parts = HashMap::new();
        for part in split_bytes(&self.body, delimiter.as_bytes()).skip(1) {
            if part.starts_with(b"--") {
                break;
            }
            let head_end = find(part, b"\r\n\r\n").expect("part headers");
            let head = String::from_utf8_lossy(&part[..head_end]);
            let name = head
                .split("name=\"")
                .nth(1)
                .and_then(|rest| rest.split('"').next())
                .expect("a part name")
                .to_owned();
            let content = &part[head_end + 4..];
            let content = content
                .strip_suffix(b"\r\n")
                .expect("CRLF before a boundary");
            parts.insert(name, content.to_vec());
        }
        parts
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn split_bytes<'a>(mut bytes: &'a [u8], delimiter: &'a [u8]) -> impl Iterator<Item = &'a [u8]> {
    std::iter::from_fn(move || {
        if bytes.is_empty() {
            return None;
        }
        match find(bytes, delimiter) {
            Some(at) => {
                let part = &bytes[..at];
                bytes = &bytes[at + delimiter.len()..];
                Some(part)
            }
            None => Some(std::mem::take(&mut bytes)),
        }
    })
}

/// How an HTTP receiver answers its Nth request.
#[derive(Debug, Clone, Copy)]
pub enum Answer {
    Status(u16),
    /// Reads the request and answers nothing for this long.
    Hang(Duration),
}

/// The requests a receiver answered 200.
pub type HttpTaken = Arc<Mutex<Vec<HttpRequest>>>;

/// An HTTP/1.1 receiver on `port`: answers its requests with `script` in turn, then
/// 200, and records the requests it answered 200. Each connection has a thread, so
/// that a hanging answer holds up no other.
pub fn http_receiver(port: u16, script: Vec<Answer>) -> HttpTaken {
    http_receiver_over(port, script, None)
}

/// As [`http_receiver`], over TLS with `tls` when given (HTTPS).
pub fn http_receiver_over(
    port: u16,
    script: Vec<Answer>,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> HttpTaken {
    let listener = TcpListener::bind(("127.0.0.1", port)).expect("receiver port");
    let taken = HttpTaken::default();
    let record = Arc::clone(&taken);
    let script = Arc::new(Mutex::new(script.into_iter()));
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let (record, script, tls) = (Arc::clone(&record), Arc::clone(&script), tls.clone());
            std::thread::spawn(move || match tls {
                None => answer(stream, &record, &script),
                Some(config) => {
                    let Ok(connection) = rustls::ServerConnection::new(config) else {
                        return;
                    };
                    let mut stream = rustls::StreamOwned::new(connection, stream);
                    answer(&mut stream, &record, &script);
                    stream.conn.send_close_notify();
                    let _ = stream.flush();
                }
            });
        }
    });
    taken
}

/// Reads one request from `stream` and answers it as the script says.
fn answer<S: Read + Write>(
    mut stream: S,
    record: &Mutex<Vec<HttpRequest>>,
    script: &Mutex<std::vec::IntoIter<Answer>>,
) {
    let Some(request) = read_request(&mut stream) else {
        return;
    };
    let answer = lock(script).next().unwrap_or(Answer::Status(200));
    match answer {
        Answer::Hang(time) => std::thread::sleep(time),
        Answer::Status(code) => {
            let _ = write!(
                stream,
                "HTTP/1.1 {code} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
            let _ = stream.flush();
            if code == 200 {
                lock(record).push(request);
            }
        }
    }
}

fn read_request<S: Read>(stream: &mut S) -> Option<HttpRequest> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let target = line.split_whitespace().nth(1)?.to_owned();
    let mut headers = HashMap::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).ok()?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (name, value) = line.split_once(':')?;
        headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_owned());
    }
    let length: usize = headers.get("content-length")?.parse().ok()?;
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some(HttpRequest {
        target,
        headers,
        body,
    })
}

/// The OTLP gRPC receiver's record: each request with its `authorization` metadata.
pub type GrpcTaken = Arc<Mutex<Vec<(Option<String>, ExportProfilesServiceRequest)>>>;

struct Collector(GrpcTaken);

#[tonic::async_trait]
impl ProfilesService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportProfilesServiceRequest>,
    ) -> Result<tonic::Response<ExportProfilesServiceResponse>, tonic::Status> {
        let auth = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        lock(&self.0).push((auth, request.into_inner()));
        Ok(tonic::Response::new(
            ExportProfilesServiceResponse::default(),
        ))
    }
}

/// An OTLP `ProfilesService` on `port`, on a runtime of its own.
pub fn grpc_receiver(port: u16) -> GrpcTaken {
    grpc_receiver_over(port, None)
}

/// As [`grpc_receiver`], over TLS with `identity` when given.
pub fn grpc_receiver_over(port: u16, identity: Option<tonic::transport::Identity>) -> GrpcTaken {
    let taken = GrpcTaken::default();
    let service = ProfilesServiceServer::new(Collector(Arc::clone(&taken)));
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(async move {
            let mut server = tonic::transport::Server::builder();
            if let Some(identity) = identity {
                server = server
                    .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
                    .expect("the receiver's TLS");
            }
            // (A push before it listens is refused and retried.)
            server
                .add_service(service)
                .serve(([127, 0, 0, 1], port).into())
                .await
                .expect("the gRPC receiver runs");
        });
    });
    taken
}

pub fn lock<T>(taken: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    taken.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A CA made for one test, and a server certificate it signed for 127.0.0.1 and
/// localhost: what an operator's private CA is.
pub struct TestCa {
    /// The CA's certificate, PEM: what `--push-ca-file` gets.
    pub ca_pem: String,
    server_pem: String,
    server_der: rustls::pki_types::CertificateDer<'static>,
    key_pem: String,
    key_der: Vec<u8>,
}

impl TestCa {
    pub fn new() -> Self {
        let ca_key = rcgen::KeyPair::generate().expect("a CA key");
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "heapprofd test CA");
        ca_params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).expect("the CA");
        let key = rcgen::KeyPair::generate().expect("a server key");
        let params = rcgen::CertificateParams::new(vec!["127.0.0.1".into(), "localhost".into()])
            .expect("server parameters");
        let server = params.signed_by(&key, &ca).expect("the server certificate");
        TestCa {
            ca_pem: ca.pem(),
            server_pem: server.pem(),
            server_der: server.der().clone(),
            key_pem: key.serialize_pem(),
            key_der: key.serialize_der(),
        }
    }

    /// The HTTPS receiver's configuration.
    pub fn rustls_server(&self) -> Arc<rustls::ServerConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let key = rustls::pki_types::PrivateKeyDer::Pkcs8(self.key_der.clone().into());
        Arc::new(
            rustls::ServerConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .expect("TLS versions")
                .with_no_client_auth()
                .with_single_cert(vec![self.server_der.clone()], key)
                .expect("the server certificate"),
        )
    }

    /// The gRPC receiver's identity.
    pub fn tonic_identity(&self) -> tonic::transport::Identity {
        tonic::transport::Identity::from_pem(&self.server_pem, &self.key_pem)
    }
}
