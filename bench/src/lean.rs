//! The load's default gRPC client: a unary `Advance` as one HTTP/2 stream on a shared `h2`
//! connection — the request's headers, one length-prefixed message, the response's message
//! and its `grpc-status` trailer — without tonic's per-call layers (its channel's buffer
//! task and queue, hyper's task per request, the streaming encoder and decoder).
//!
//! Why: the benchmark's clients share the machine's cores with the services they measure.
//! With tonic's client they took ~15–18 µs of CPU per call on the 2-core machine (`perf`:
//! copies, allocation, task hand-offs), a fifth of the CPU the run had, and, on one
//! current-thread runtime, they answer a batch of committed calls one after another before
//! the next calls reach the producer. `--client tonic` keeps the generated client for
//! comparison. What the services see is the same: an HTTP/2 POST to
//! `/ordered_events.v1.Producer/Advance` with `content-type: application/grpc` and
//! `te: trailers`, over plain TCP (the benchmark starts the services without TLS or tokens).
//! A broken connection is not reopened: its calls fail, are retried like any failed call,
//! and the run reports them.

use anyhow::Context as _;
use bytes::{Buf as _, BufMut as _, Bytes, BytesMut};
use http::header::{CONTENT_TYPE, TE};
use prost::Message as _;
use proto::pb;

const PATH: &str = "/ordered_events.v1.Producer/Advance";

/// One HTTP/2 connection to a producer; clones share it (each call is its own stream).
#[derive(Clone)]
pub struct Connection {
    send: h2::client::SendRequest<Bytes>,
    uri: http::Uri,
}

impl Connection {
    /// Connects to `url` (`http://host:port`) and completes the HTTP/2 handshake; the
    /// connection's I/O runs on a task of its own.
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        let uri: http::Uri =
            format!("{url}{PATH}").parse().with_context(|| format!("producer url {url:?}"))?;
        anyhow::ensure!(uri.scheme_str() == Some("http"), "the lean client speaks plain http, not {url:?}");
        let authority = uri.authority().with_context(|| format!("producer url {url:?} has no host:port"))?;
        let tcp = tokio::net::TcpStream::connect(authority.as_str())
            .await
            .with_context(|| format!("connecting to {authority}"))?;
        tcp.set_nodelay(true)?;
        let (send, connection) = h2::client::handshake(tcp).await.context("HTTP/2 handshake")?;
        tokio::spawn(async move {
            // Ends when every handle is dropped or the peer goes; a call in flight then fails.
            let _ = connection.await;
        });
        Ok(Self { send, uri })
    }

    /// One unary `Advance`: its answer, or why there is none (transport, HTTP or gRPC status).
    pub async fn advance(&self, req: &pb::AdvanceRequest) -> Result<pb::AdvanceResponse, String> {
        self.call(req).await.map_err(|e| format!("{e:#}"))
    }

    async fn call(&self, req: &pb::AdvanceRequest) -> anyhow::Result<pb::AdvanceResponse> {
        let mut send = self.send.clone().ready().await?;
        let request = http::Request::post(self.uri.clone())
            .header(CONTENT_TYPE, "application/grpc")
            .header(TE, "trailers")
            .body(())?;
        let (response, mut stream) = send.send_request(request, false)?;
        let len = req.encoded_len();
        let mut frame = BytesMut::with_capacity(5 + len);
        frame.put_u8(0); // not compressed
        frame.put_u32(u32::try_from(len)?);
        req.encode(&mut frame)?;
        stream.send_data(frame.freeze(), true)?;

        let (head, mut body) = response.await?.into_parts();
        anyhow::ensure!(head.status == http::StatusCode::OK, "HTTP status {}", head.status);
        // A call that fails before any message is answered with its status in the headers.
        grpc_status(&head.headers)?;
        let mut message = BytesMut::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk?;
            let _ = body.flow_control().release_capacity(chunk.len());
            message.extend_from_slice(&chunk);
        }
        let trailers = body.trailers().await?.context("the response ended without trailers")?;
        grpc_status(&trailers)?;
        anyhow::ensure!(message.len() >= 5, "the response holds no message ({} bytes)", message.len());
        let (compressed, declared) = (message.get_u8(), message.get_u32() as usize);
        anyhow::ensure!(compressed == 0, "the response message is compressed");
        anyhow::ensure!(
            declared == message.len(),
            "the response message declares {declared} bytes and holds {}",
            message.len()
        );
        Ok(pb::AdvanceResponse::decode(message)?)
    }
}

/// `Ok` when `headers` carry no `grpc-status` or status 0; otherwise the status and message.
fn grpc_status(headers: &http::HeaderMap) -> anyhow::Result<()> {
    match headers.get("grpc-status").map(|v| v.to_str().unwrap_or("?")) {
        None | Some("0") => Ok(()),
        Some(code) => {
            let message = headers.get("grpc-message").and_then(|v| v.to_str().ok()).unwrap_or("");
            anyhow::bail!("gRPC status {code}: {message}")
        }
    }
}
