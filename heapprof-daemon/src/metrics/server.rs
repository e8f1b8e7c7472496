//! The HTTP endpoint: a minimal HTTP/1.1 server on tokio that answers `GET /metrics`.
//!
//! Hand-rolled rather than a web framework: it answers one kind of request, closes
//! every connection after its response, and runs on the daemon's single-threaded
//! runtime between profiles (a scrape during a profile write waits for it, so it
//! never sees half of an interval's figures).

use std::{io, net::SocketAddr, sync::Arc, time::Duration};

use prometheus_client::registry::Registry;
use thiserror::Error;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
    sync::Semaphore,
};

/// The OpenMetrics text format's content type: what prometheus-client encodes.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Largest request head read; a scraper's is a few hundred bytes.
const MAX_HEAD: usize = 8192;
/// Connections served at once; more are closed at once.
const MAX_CONNECTIONS: usize = 16;
/// Time a connection may take from accept to the end of the response.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the metrics endpoint could not be opened.
#[derive(Debug, Error)]
pub enum ServeError {
    /// The address could not be bound (in use, not local, no permission).
    // (The cause is in the message, before the fix, so it is not a `source`: the
    // one-line report would repeat it.)
    #[error(
        "cannot serve metrics on {addr}: {error}; choose another address or port \
         (--metrics {ip}:PORT), or stop the program listening there (ss -ltnp 'sport = :{port}')",
        ip = addr.ip(),
        port = addr.port()
    )]
    Bind {
        /// The `--metrics` address.
        addr: SocketAddr,
        /// What the kernel said.
        error: io::Error,
    },
    /// The listening socket could not be handed to the runtime.
    #[error("cannot serve metrics on {addr}: {error}")]
    Register {
        /// The `--metrics` address.
        addr: SocketAddr,
        /// What went wrong.
        error: io::Error,
    },
}

/// A bound metrics endpoint, not yet serving.
#[derive(Debug)]
pub struct Endpoint {
    listener: TcpListener,
}

impl Endpoint {
    /// Binds `addr`. Must be called within the tokio runtime.
    pub fn bind(addr: SocketAddr) -> Result<Self, ServeError> {
        let listener =
            std::net::TcpListener::bind(addr).map_err(|error| ServeError::Bind { addr, error })?;
        let register = |error| ServeError::Register { addr, error };
        listener.set_nonblocking(true).map_err(register)?;
        let listener = TcpListener::from_std(listener).map_err(register)?;
        Ok(Self { listener })
    }

    /// The address bound (the port chosen when `--metrics` gave port 0).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves `registry` on a task of the current runtime until the runtime ends.
    pub fn spawn(self, registry: Arc<Registry>) {
        tokio::spawn(accept_loop(self.listener, registry));
    }
}

async fn accept_loop(listener: TcpListener, registry: Arc<Registry>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(err) => {
                // Out of descriptors, usually: wait instead of spinning.
                log::debug!("metrics: cannot accept a connection: {err}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            continue; // Dropping the stream closes it.
        };
        let registry = Arc::clone(&registry);
        tokio::spawn(async move {
            let _slot = slot;
            match tokio::time::timeout(CONNECTION_TIMEOUT, serve(stream, &registry)).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => log::debug!("metrics: connection failed: {err}"),
                Err(_) => log::debug!("metrics: connection timed out"),
            }
        });
    }
}

/// Reads one request, writes its response and closes the connection.
async fn serve(mut stream: TcpStream, registry: &Registry) -> io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let mut buffer = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() <= MAX_HEAD {
        let read = stream.read(&mut buffer).await?;
        if read == 0 {
            break;
        }
        head.extend_from_slice(&buffer[..read]);
    }
    let response = respond(&head, registry);
    stream.write_all(&response).await?;
    stream.shutdown().await
}

/// The response to a request whose head (request line and headers) is `head`.
fn respond(head: &[u8], registry: &Registry) -> Vec<u8> {
    if head.len() > MAX_HEAD {
        return response(
            "431 Request Header Fields Too Large",
            "text/plain",
            b"",
            true,
        );
    }
    let text = String::from_utf8_lossy(head);
    let mut parts = text.lines().next().unwrap_or("").split_whitespace();
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next())
    else {
        return response("400 Bad Request", "text/plain", b"bad request\n", true);
    };
    if !version.starts_with("HTTP/1.") {
        return response("400 Bad Request", "text/plain", b"bad request\n", true);
    }
    let with_body = match method {
        "GET" => true,
        "HEAD" => false,
        _ => {
            return response(
                "405 Method Not Allowed\r\nAllow: GET, HEAD",
                "text/plain",
                b"only GET and HEAD\n",
                true,
            );
        }
    };
    let path = target.split('?').next().unwrap_or(target);
    match path {
        "/metrics" => {
            let mut body = String::new();
            match prometheus_client::encoding::text::encode(&mut body, registry) {
                Ok(()) => response("200 OK", CONTENT_TYPE, body.as_bytes(), with_body),
                Err(_) => response(
                    "500 Internal Server Error",
                    "text/plain",
                    b"cannot encode the metrics\n",
                    with_body,
                ),
            }
        }
        "/" => response(
            "200 OK",
            "text/plain; charset=utf-8",
            b"heapprofd: metrics at /metrics\n",
            with_body,
        ),
        _ => response(
            "404 Not Found",
            "text/plain",
            b"not found; metrics are at /metrics\n",
            with_body,
        ),
    }
}

/// A whole response; the connection closes after it. `status` may carry header
/// lines after it (`405 Method Not Allowed\r\nAllow: GET, HEAD`).
fn response(status: &str, content_type: &str, body: &[u8], with_body: bool) -> Vec<u8> {
    let mut bytes = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if with_body {
        bytes.extend_from_slice(body);
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(request: &str) -> String {
        let (_, registry) = crate::metrics::new(crate::metrics::Settings {
            active_only: false,
            top: 1,
            capacities: Vec::new(),
            kernel_memory: Vec::new(),
            push: None,
        });
        String::from_utf8(respond(request.as_bytes(), &registry)).expect("text")
    }

    #[test]
    fn metrics_are_served_with_the_openmetrics_type() {
        let reply = answer("GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n");
        assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
        assert!(reply.contains(&format!("Content-Type: {CONTENT_TYPE}\r\n")));
        let (head, body) = reply.split_once("\r\n\r\n").expect("head and body");
        assert!(head.contains(&format!("Content-Length: {}\r\n", body.len())));
        assert!(
            body.contains("# TYPE heapprofd_inuse_bytes gauge\n"),
            "{body}"
        );
        assert!(body.ends_with("# EOF\n"));
        // A query string is ignored; HEAD has the head only.
        assert!(answer("GET /metrics?x=1 HTTP/1.0\r\n\r\n").starts_with("HTTP/1.1 200"));
        let head = answer("HEAD /metrics HTTP/1.1\r\n\r\n");
        assert!(
            head.starts_with("HTTP/1.1 200") && head.ends_with("\r\n\r\n"),
            "{head}"
        );
    }

    #[test]
    fn other_requests_are_refused() {
        assert!(answer("GET /other HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        let post = answer("POST /metrics HTTP/1.1\r\n\r\n");
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        assert!(post.contains("\r\nAllow: GET, HEAD\r\n"), "{post}");
        assert!(answer("garbage\r\n\r\n").starts_with("HTTP/1.1 400"));
        assert!(answer("GET / SPDY/3\r\n\r\n").starts_with("HTTP/1.1 400"));
        let long = format!(
            "GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n",
            "a".repeat(MAX_HEAD)
        );
        assert!(answer(&long).starts_with("HTTP/1.1 431"));
    }

    #[tokio::test]
    async fn a_port_in_use_is_a_clear_error() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        let addr = taken.local_addr().expect("its address");
        let err = Endpoint::bind(addr).expect_err("the port is taken");
        let message = err.to_string();
        assert!(
            message.starts_with(&format!("cannot serve metrics on {addr}: "))
                && message.contains("--metrics 127.0.0.1:PORT"),
            "{message}"
        );
    }
}
