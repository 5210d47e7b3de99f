//! The scraper of a `--compare-metrics` run: every second, one `GET /metrics` of each
//! process (a plain HTTP/1.0 request read to its end, as a scraper costs the process a whole
//! exposition), counted, until the run's load is done. A failed scrape is counted, never
//! fatal: the figure is what metrics cost the pipeline, and a scrape that fails costs less.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// How often each endpoint is scraped.
const INTERVAL: Duration = Duration::from_secs(1);

/// A running scraper.
pub struct Scraper {
    endpoints: usize,
    ok: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    bytes: Arc<AtomicU64>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Scraper {
    /// Starts scraping `addrs` (host:port each) every second on this runtime.
    pub fn start(addrs: Vec<String>) -> Scraper {
        let (ok, failed, bytes): (Arc<AtomicU64>, Arc<AtomicU64>, Arc<AtomicU64>) = Default::default();
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let counters = (Arc::clone(&ok), Arc::clone(&failed), Arc::clone(&bytes));
        let endpoints = addrs.len();
        let task = tokio::spawn(async move {
            let (ok, failed, bytes) = counters;
            let mut tick = tokio::time::interval(INTERVAL);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stopped.changed() => return,
                }
                for addr in &addrs {
                    match scrape(addr).await {
                        Ok(n) => {
                            ok.fetch_add(1, Ordering::Relaxed);
                            bytes.fetch_add(n as u64, Ordering::Relaxed);
                        }
                        Err(e) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            eprintln!("bench: scrape of {addr} failed: {e}");
                        }
                    }
                }
            }
        });
        Scraper { endpoints, ok, failed, bytes, stop, task }
    }

    /// Stops scraping and says how it went.
    pub async fn stop(self) -> Value {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        let ok = self.ok.load(Ordering::Relaxed);
        json!({
            "endpoints": self.endpoints,
            "interval_s": INTERVAL.as_secs_f64(),
            "scrapes_ok": ok,
            "scrapes_failed": self.failed.load(Ordering::Relaxed),
            "mean_bytes": self.bytes.load(Ordering::Relaxed).checked_div(ok).unwrap_or(0),
        })
    }
}

/// One `GET /metrics` of `addr`: the body's length, or why it failed.
async fn scrape(addr: &str) -> Result<usize, String> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let request = format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n");
        stream.write_all(request.as_bytes()).await.map_err(|e| e.to_string())?;
        let mut answer = Vec::with_capacity(16 * 1024);
        stream.read_to_end(&mut answer).await.map_err(|e| e.to_string())?;
        Ok::<_, String>(answer)
    };
    let answer = tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .map_err(|_| "timed out".to_owned())??;
    let text = String::from_utf8_lossy(&answer);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("no header end")?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return Err(head.lines().next().unwrap_or_default().to_owned());
    }
    Ok(body.len())
}
