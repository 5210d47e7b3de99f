//! The channel to the consumer: TLS when a CA is given, HTTP/2 keepalive so a peer that
//! stops answering is noticed even while the stream is idle, and connection attempts retried
//! (with backoff) until a deadline.

use std::time::{Duration, Instant};

use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::Link;
use crate::backoff::Backoff;
use crate::error::RelayError;

/// One TCP (and TLS) connection attempt may take this long.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// HTTP/2 pings this often, even with no stream open...
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// ...and a ping unanswered this long closes the connection (every stream on it fails).
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// The endpoint for `link`: URL, TLS, timeouts and keepalive.
pub fn endpoint(link: &Link) -> Result<Endpoint, RelayError> {
    let mut endpoint = Endpoint::from_shared(link.url.clone())
        .map_err(|e| unreachable(link, format!("invalid URL: {e}")))?
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true);
    if let Some(ca) = &link.tls_ca {
        let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
        endpoint = endpoint
            .tls_config(tls)
            .map_err(|e| unreachable(link, format!("TLS settings: {}", source_chain(&e))))?;
    }
    Ok(endpoint)
}

/// Connects, retrying with backoff until `deadline` has passed (`Duration::ZERO`: one
/// attempt). Each attempt is bounded by the answer timeout too: a peer that accepts TCP but
/// never speaks HTTP/2 (a stopped process) fails the attempt instead of hanging it.
pub async fn channel(link: &Link, deadline: Duration) -> Result<Channel, RelayError> {
    let endpoint = endpoint(link)?;
    let until = Instant::now() + deadline;
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    loop {
        let failure = match tokio::time::timeout(link.answer_timeout, endpoint.connect()).await {
            Ok(Ok(channel)) => return Ok(channel),
            Ok(Err(e)) => unreachable(link, source_chain(&e)),
            // TCP was accepted but nothing answered: the same failure as a silent stream.
            Err(_) => RelayError::Unresponsive(link.answer_timeout),
        };
        let wait = backoff.next_wait();
        if Instant::now() + wait >= until {
            return Err(failure);
        }
        tracing::debug!(error = %failure, "consumer not reachable yet");
        tokio::time::sleep(wait).await;
    }
}

fn unreachable(link: &Link, reason: String) -> RelayError {
    RelayError::Unreachable { url: link.url.clone(), reason }
}

/// An error with its sources, `: `-separated (tonic's top-level message is often just
/// "transport error").
pub fn source_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        text.push_str(": ");
        text.push_str(&s.to_string());
        cur = s.source();
    }
    text
}
