//! What `--push` names: the protocol a URL picks, the headers sent with every push,
//! and the bearer token file, all checked at start-up so that a mistake is one line
//! before anything is traced.

use std::path::{Path, PathBuf};

use thiserror::Error;

/// The path of OTLP's HTTP endpoint for profiles (the collector's `otlpreceiver`,
/// OTLP 1.x, profiles still in development).
pub const OTLP_HTTP_PATH: &str = "/v1development/profiles";

/// The path of Pyroscope's ingestion endpoint.
pub const PYROSCOPE_INGEST_PATH: &str = "/ingest";

/// How the URLs can be written, for every error message about one.
const URL_FORMS: &str = "use http(s)://HOST[:PORT]/ingest (Pyroscope), \
     http(s)://HOST[:PORT]/v1development/profiles (OTLP over HTTP), \
     grpc(s)://HOST:PORT (OTLP over gRPC) or parca+grpc(s)://HOST:PORT (Parca's WriteRaw)";

/// A mistake in the push flags, worded with its fix.
#[derive(Debug, Error)]
pub enum TargetError {
    /// The URL does not parse.
    #[error("--push `{url}` is not a URL ({reason}); {URL_FORMS}")]
    BadUrl {
        /// As given.
        url: String,
        /// The parser's words.
        reason: String,
    },
    /// The scheme or path picks no protocol.
    #[error("--push `{url}`: {what}; {URL_FORMS}")]
    UnknownProtocol {
        /// As given.
        url: String,
        /// What is wrong with it.
        what: String,
    },
    /// A `--push-header` is not `NAME: VALUE`, or not a valid header.
    #[error("--push-header `{header}` {what}; write 'NAME: VALUE', e.g. 'X-Scope-OrgID: tenant1'")]
    BadHeader {
        /// As given.
        header: String,
        /// What is wrong with it.
        what: &'static str,
    },
    /// The CA file cannot be read, or holds no usable certificate.
    #[error(
        "--push-ca-file {path}: {what}; give a readable PEM file of the CA certificates that signed the backend's"
    )]
    BadCaFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        what: String,
    },
    /// The token file cannot be read, or holds no token.
    #[error("--push-token-file {path}: {what}; give a readable file holding the bearer token")]
    BadTokenFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        what: String,
    },
}

/// The protocol a push URL picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// Pyroscope's `POST /ingest?format=pprof` (multipart form).
    PyroscopeIngest,
    /// OTLP profiles, `ExportProfilesServiceRequest` as protobuf over HTTP.
    OtlpHttp,
    /// OTLP profiles over gRPC (`ProfilesService/Export`).
    OtlpGrpc,
    /// Parca's `ProfileStoreService/WriteRaw` over gRPC.
    ParcaGrpc,
}

impl Protocol {
    /// Whether it runs over gRPC (tonic) rather than HTTP/1.1 (reqwest).
    pub fn is_grpc(self) -> bool {
        matches!(self, Protocol::OtlpGrpc | Protocol::ParcaGrpc)
    }

    /// How logs and metrics name it.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::PyroscopeIngest => "pyroscope",
            Protocol::OtlpHttp => "otlp-http",
            Protocol::OtlpGrpc => "otlp-grpc",
            Protocol::ParcaGrpc => "parca",
        }
    }
}

/// One `--push` URL, checked.
#[derive(Debug, Clone)]
pub struct PushTarget {
    /// The protocol its scheme and path pick.
    pub protocol: Protocol,
    /// Where to send: for gRPC with the scheme made `http` or `https` (as tonic wants it).
    pub url: reqwest::Url,
    /// How logs and metrics name it: the URL without user, password or query.
    pub display: String,
}

impl PushTarget {
    /// Checks `text` and picks its protocol.
    pub fn parse(text: &str) -> Result<Self, TargetError> {
        let url = reqwest::Url::parse(text.trim()).map_err(|err| TargetError::BadUrl {
            url: text.to_owned(),
            reason: err.to_string(),
        })?;
        let unknown = |what: String| TargetError::UnknownProtocol {
            url: text.to_owned(),
            what,
        };
        if url.host_str().is_none_or(str::is_empty) {
            return Err(unknown("it names no host".into()));
        }
        let path = url.path().trim_end_matches('/');
        let protocol = match url.scheme() {
            "http" | "https" if path.ends_with(PYROSCOPE_INGEST_PATH) => Protocol::PyroscopeIngest,
            "http" | "https" if path.ends_with(OTLP_HTTP_PATH) => Protocol::OtlpHttp,
            "http" | "https" => {
                return Err(unknown(format!(
                    "the path `{}` names no known endpoint",
                    url.path()
                )));
            }
            "grpc" | "grpcs" => Protocol::OtlpGrpc,
            "parca+grpc" | "parca+grpcs" => Protocol::ParcaGrpc,
            other => return Err(unknown(format!("unknown scheme `{other}`"))),
        };
        let mut display = url.clone();
        // Credentials never reach a log line or a metric label.
        let _ = display.set_username("");
        let _ = display.set_password(None);
        display.set_query(None);
        let display = display.to_string();
        let url = if protocol.is_grpc() {
            let scheme = if url.scheme().ends_with("grpcs") {
                "https"
            } else {
                "http"
            };
            let rest = &url.as_str()[url.scheme().len()..];
            reqwest::Url::parse(&format!("{scheme}{rest}")).map_err(|err| TargetError::BadUrl {
                url: text.to_owned(),
                reason: err.to_string(),
            })?
        } else {
            url
        };
        Ok(PushTarget {
            protocol,
            url,
            display,
        })
    }
}

/// A header sent with every push, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Its name, lower case (as HTTP/2 and gRPC metadata want it).
    pub name: String,
    /// Its value.
    pub value: String,
}

impl Header {
    /// Parses `NAME: VALUE`.
    pub fn parse(text: &str) -> Result<Self, TargetError> {
        let bad = |what| TargetError::BadHeader {
            header: text.to_owned(),
            what,
        };
        let (name, value) = text.split_once(':').ok_or_else(|| bad("has no `:`"))?;
        let (name, value) = (name.trim(), value.trim());
        if name.is_empty() {
            return Err(bad("has no name"));
        }
        if reqwest::header::HeaderName::from_bytes(name.as_bytes()).is_err() {
            return Err(bad("has a name that is not a valid header name"));
        }
        if reqwest::header::HeaderValue::from_str(value).is_err() {
            return Err(bad("has a value with characters a header cannot carry"));
        }
        Ok(Header {
            name: name.to_ascii_lowercase(),
            value: value.to_owned(),
        })
    }
}

/// Reads the bearer token in `path`: its content, surrounding white space removed.
pub fn read_token(path: &Path) -> Result<String, TargetError> {
    let bad = |what: String| TargetError::BadTokenFile {
        path: path.to_owned(),
        what,
    };
    let text = std::fs::read_to_string(path).map_err(|err| bad(err.to_string()))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(bad("it is empty".into()));
    }
    if reqwest::header::HeaderValue::from_str(&format!("Bearer {token}")).is_err() {
        return Err(bad(
            "it holds characters a header cannot carry (one token, on one line)".into(),
        ));
    }
    Ok(token.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_url_picks_the_protocol() {
        let parse = |url: &str| PushTarget::parse(url).map(|t| t.protocol);
        assert_eq!(
            parse("http://localhost:4040/ingest").ok(),
            Some(Protocol::PyroscopeIngest)
        );
        assert_eq!(
            parse("https://profiles.example/pyroscope/ingest/").ok(),
            Some(Protocol::PyroscopeIngest)
        );
        assert_eq!(
            parse("http://collector:4318/v1development/profiles").ok(),
            Some(Protocol::OtlpHttp)
        );
        assert_eq!(
            parse("grpc://collector:4317").ok(),
            Some(Protocol::OtlpGrpc)
        );
        let parca = PushTarget::parse("parca+grpcs://parca:7070").expect("valid");
        assert_eq!(parca.protocol, Protocol::ParcaGrpc);
        assert_eq!(parca.url.as_str(), "https://parca:7070/");
        assert_eq!(parca.display, "parca+grpcs://parca:7070");
        let grpcs = PushTarget::parse("grpcs://collector:4317").expect("valid");
        assert_eq!(grpcs.url.scheme(), "https");
        assert_eq!(grpcs.url.port(), Some(4317));
        for bad in [
            "ftp://host/ingest",
            "http://host/",
            "localhost:4040",
            "http:///ingest",
        ] {
            let err = PushTarget::parse(bad).expect_err(bad).to_string();
            assert!(err.contains("use http(s)://HOST"), "{err}");
        }
    }

    #[test]
    fn credentials_stay_out_of_the_display_name() {
        let target = PushTarget::parse("https://user:secret@host/ingest?x=1").expect("valid");
        assert_eq!(target.display, "https://host/ingest");
    }

    #[test]
    fn headers_parse_and_bad_ones_say_how_to_write_them() {
        assert_eq!(
            Header::parse("X-Scope-OrgID:  tenant1 ").expect("valid"),
            Header {
                name: "x-scope-orgid".into(),
                value: "tenant1".into()
            }
        );
        for bad in ["no colon", ": value", "bad name: v", "x: a\nb"] {
            let err = Header::parse(bad).expect_err(bad).to_string();
            assert!(err.contains("'NAME: VALUE'"), "{err}");
        }
    }

    #[test]
    fn token_files_are_read_and_bad_ones_named() {
        let dir = std::env::temp_dir().join(format!("heapprofd-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let file = dir.join("token");
        std::fs::write(&file, "abc.def\n").expect("write");
        assert_eq!(read_token(&file).expect("readable"), "abc.def");
        std::fs::write(&file, "  \n").expect("write");
        assert!(read_token(&file).is_err());
        let missing = read_token(&dir.join("missing")).expect_err("missing");
        assert!(missing.to_string().contains("--push-token-file"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
