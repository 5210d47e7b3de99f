//! Reading a process's Prometheus endpoint the way a scraper does: its address from the
//! `metrics serving` log line, `GET /metrics` over a real HTTP/1.1 client (hyper), and the
//! body parsed by a Prometheus text-format parser (`prometheus-parse`), so tests assert
//! values, not substrings.

use std::time::Duration;

use http_body_util::{BodyExt as _, Empty};
use prometheus_parse::{Scrape, Value};

/// The address a process logged as `metrics serving addr=HOST:PORT`, once it has.
pub fn metrics_addr(log: &str) -> Option<String> {
    let line = log.lines().find(|l| l.contains("metrics serving"))?;
    let addr = line.split("addr=").nth(1)?.split_whitespace().next()?;
    Some(addr.to_owned())
}

/// One HTTP GET of `path` on `addr`: the status, the content type and the body.
pub async fn get(addr: &str, path: &str) -> (u16, String, String) {
    let stream = tokio::time::timeout(Duration::from_secs(10), tokio::net::TcpStream::connect(addr))
        .await
        .expect("metrics connect timed out")
        .expect("connect to the metrics port");
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .expect("HTTP handshake");
    tokio::spawn(connection);
    let request = hyper::Request::get(path)
        .header(hyper::header::HOST, addr)
        .body(Empty::<bytes::Bytes>::new())
        .expect("request");
    let response = tokio::time::timeout(Duration::from_secs(10), sender.send_request(request))
        .await
        .expect("metrics answer timed out")
        .expect("metrics answer");
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = response.into_body().collect().await.expect("metrics body").to_bytes();
    (status, content_type, String::from_utf8(body.to_vec()).expect("UTF-8 exposition"))
}

/// A parsed scrape and its text.
pub struct Metrics {
    /// The exposition as served.
    pub text: String,
    /// The parsed samples.
    pub scrape: Scrape,
}

impl Metrics {
    /// Scrapes `http://addr/metrics` (panics unless it answers 200 with a parseable body).
    pub async fn scrape(addr: &str) -> Metrics {
        let (status, _, text) = get(addr, "/metrics").await;
        assert_eq!(status, 200, "{text}");
        let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("Prometheus text format");
        Metrics { text, scrape }
    }

    /// The value of the sample `name` whose labels include `labels` (counters, gauges,
    /// untyped, and a histogram's `_sum`/`_count`), or `None` if there is none.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.scrape
            .samples
            .iter()
            .filter(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .find_map(|s| match s.value {
                Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => Some(v),
                _ => None,
            })
    }

    /// Like [`Metrics::value`], panicking with the scrape when the sample is missing.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.value(name, labels).unwrap_or_else(|| panic!("no sample {name}{labels:?} in:\n{}", self.text))
    }

    /// Saves the text as `<dir>/<name>.prom` when `ORDERED_EVENTS_SCRAPES_DIR` names a
    /// directory (CI checks the files with `promtool check metrics`).
    pub fn save(&self, name: &str) {
        if let Some(dir) = std::env::var_os("ORDERED_EVENTS_SCRAPES_DIR") {
            let dir = std::path::PathBuf::from(dir);
            std::fs::create_dir_all(&dir).expect("scrapes dir");
            std::fs::write(dir.join(format!("{name}.prom")), &self.text).expect("save scrape");
        }
    }
}
