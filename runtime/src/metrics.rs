//! Prometheus metrics: the `--metrics-listen` flag, the counters and histograms the services
//! bump on their hot paths, and the HTTP endpoint that serves `GET /metrics`.
//!
//! The invariant it protects is that measuring costs the measured path next to nothing: a
//! [`Counters`] or [`Histogram`] is a `static` of atomics, so recording an event is one or
//! three relaxed atomic adds, no lock, no allocation and no formatting. Everything else
//! (reading the backlog gauges from the database, building the exposition with the
//! `prometheus-client` encoder) happens per scrape, on the metrics port's own task.
//!
//! The endpoint is hyper 1's HTTP/1 server, already in the dependency tree through tonic
//! (same features, so nothing is compiled twice); it answers `GET /metrics` and 404 to
//! everything else, needs no token (like health) and is off unless `--metrics-listen` is set.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::ConstGauge;
use tokio::net::TcpListener;

/// The metrics flag every process takes (flatten into its clap arguments).
#[derive(Clone, Debug, Default, clap::Args)]
#[command(next_help_heading = "Metrics")]
pub struct MetricsFlags {
    /// Serve Prometheus metrics on `GET http://ADDR/metrics` (no token; port 0 picks a free
    /// port, logged as `metrics serving`). Off when unset.
    #[arg(long, env = "ORDERED_EVENTS_METRICS_LISTEN", value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,
}

/// A counter family with one bounded label: one atomic per label value. Declare it as a
/// `static` and call [`Counters::inc`] with the index of the value.
pub struct Counters<const N: usize> {
    name: &'static str,
    help: &'static str,
    label: &'static str,
    values: [&'static str; N],
    counts: [AtomicU64; N],
}

impl<const N: usize> Counters<N> {
    /// A family `name` (without `_total`, which the exposition adds) whose samples are
    /// labelled `label="values[i]"`.
    pub const fn new(
        name: &'static str,
        help: &'static str,
        label: &'static str,
        values: [&'static str; N],
    ) -> Counters<N> {
        Counters { name, help, label, values, counts: [const { AtomicU64::new(0) }; N] }
    }

    /// Counts one event with label value `values[index]` (an index past the end counts as
    /// the last value, which callers make `"other"` or equivalent).
    pub fn inc(&self, index: usize) {
        self.add(index, 1);
    }

    /// Counts `n` events with label value `values[index]`.
    pub fn add(&self, index: usize, n: u64) {
        self.counts[index.min(N - 1)].fetch_add(n, Ordering::Relaxed);
    }

    /// The current count of `values[index]`.
    pub fn get(&self, index: usize) -> u64 {
        self.counts[index.min(N - 1)].load(Ordering::Relaxed)
    }
}

/// The most buckets a [`Histogram`] may have (the `+Inf` bucket is implicit).
const MAX_BUCKETS: usize = 24;

/// A histogram of integer observations (microseconds, items) with fixed upper bounds,
/// exposed in the base unit (`value / scale`: seconds for microseconds with `scale` 1e6).
/// Observing is three relaxed atomic adds after a scan of at most [`MAX_BUCKETS`] bounds.
pub struct Histogram {
    name: &'static str,
    help: &'static str,
    /// `(label, value)` that tells writers apart, or `None`.
    label: Option<(&'static str, &'static str)>,
    bounds: &'static [u64],
    scale: f64,
    buckets: [AtomicU64; MAX_BUCKETS],
    count: AtomicU64,
    sum: AtomicU64,
}

/// Upper bounds in microseconds, 100 µs to 60 s, for latencies.
pub const LATENCY_BOUNDS_US: &[u64] = &[
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000,
    2_500_000, 5_000_000, 10_000_000, 30_000_000, 60_000_000,
];

/// Upper bounds in items, powers of two up to 4096, for transaction sizes.
pub const SIZE_BOUNDS: &[u64] = &[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096];

impl Histogram {
    /// A latency histogram in seconds; observations are microseconds.
    pub const fn seconds(
        name: &'static str,
        help: &'static str,
        label: Option<(&'static str, &'static str)>,
    ) -> Histogram {
        Histogram::new(name, help, label, LATENCY_BOUNDS_US, 1e6)
    }

    /// A histogram of item counts (transaction sizes).
    pub const fn items(
        name: &'static str,
        help: &'static str,
        label: Option<(&'static str, &'static str)>,
    ) -> Histogram {
        Histogram::new(name, help, label, SIZE_BOUNDS, 1.0)
    }

    const fn new(
        name: &'static str,
        help: &'static str,
        label: Option<(&'static str, &'static str)>,
        bounds: &'static [u64],
        scale: f64,
    ) -> Histogram {
        assert!(bounds.len() <= MAX_BUCKETS, "too many histogram buckets");
        Histogram {
            name,
            help,
            label,
            bounds,
            scale,
            buckets: [const { AtomicU64::new(0) }; MAX_BUCKETS],
            count: AtomicU64::new(0),
            sum: AtomicU64::new(0),
        }
    }

    /// Records one observation (microseconds or items). Values above the last bound land
    /// only in `+Inf` (the count).
    pub fn observe(&self, value: u64) {
        if let Some(i) = self.bounds.iter().position(|&b| value <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(value, Ordering::Relaxed);
    }

    /// Records the time since `start`, in microseconds.
    pub fn observe_since(&self, start: std::time::Instant) {
        self.observe(start.elapsed().as_micros().min(u64::MAX as u128) as u64);
    }

    /// Observations recorded so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

/// One metric the process exposes from its statics.
pub trait Expose: Sync {
    /// Writes its family (descriptor and samples) into the exposition.
    fn expose(&self, encoder: &mut DescriptorEncoder) -> std::fmt::Result;
    /// The family name, so families that share it (histograms per writer) are described once.
    fn family(&self) -> &'static str;
}

impl<const N: usize> Expose for Counters<N> {
    fn expose(&self, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
        let mut metric = encoder.encode_descriptor(self.name, self.help, None, MetricType::Counter)?;
        for (value, count) in self.values.iter().zip(&self.counts) {
            let labels = [(self.label, *value)];
            let mut sample = metric.encode_family(&labels)?;
            sample.encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(
                &count.load(Ordering::Relaxed),
                None,
            )?;
        }
        Ok(())
    }

    fn family(&self) -> &'static str {
        self.name
    }
}

impl Histogram {
    /// Writes this histogram's samples under an already written descriptor.
    pub(crate) fn expose_samples(
        &self,
        metric: &mut prometheus_client::encoding::MetricEncoder,
    ) -> std::fmt::Result {
        // Per-bucket counts (the encoder accumulates them), each read once; a concurrent
        // observation may put `count` slightly ahead of the buckets, which lands in `+Inf`.
        let mut in_buckets = 0;
        let mut buckets = Vec::with_capacity(self.bounds.len() + 1);
        for (bound, count) in self.bounds.iter().zip(&self.buckets) {
            let count = count.load(Ordering::Relaxed);
            in_buckets += count;
            buckets.push((*bound as f64 / self.scale, count));
        }
        let count = self.count.load(Ordering::Relaxed).max(in_buckets);
        // The encoder writes `f64::MAX` as `le="+Inf"`.
        buckets.push((f64::MAX, count - in_buckets));
        let sum = self.sum.load(Ordering::Relaxed) as f64 / self.scale;
        match self.label {
            Some(label) => {
                let labels = [label];
                metric
                    .encode_family(&labels)?
                    .encode_histogram::<prometheus_client::encoding::NoLabelSet>(sum, count, &buckets, None)
            }
            None => {
                metric.encode_histogram::<prometheus_client::encoding::NoLabelSet>(sum, count, &buckets, None)
            }
        }
    }
}

impl Expose for Histogram {
    fn expose(&self, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
        let mut metric = encoder.encode_descriptor(self.name, self.help, None, MetricType::Histogram)?;
        self.expose_samples(&mut metric)
    }

    fn family(&self) -> &'static str {
        self.name
    }
}

/// Several histograms of one family told apart by their label (one per writer).
pub struct HistogramFamily(pub &'static [&'static Histogram]);

impl Expose for HistogramFamily {
    fn expose(&self, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
        let Some(first) = self.0.first() else { return Ok(()) };
        let mut metric = encoder.encode_descriptor(first.name, first.help, None, MetricType::Histogram)?;
        for histogram in self.0 {
            histogram.expose_samples(&mut metric)?;
        }
        Ok(())
    }

    fn family(&self) -> &'static str {
        self.0.first().map_or("", |h| h.name)
    }
}

/// One gauge sample read at scrape time (from the database's exact counts).
#[derive(Clone, Debug)]
pub struct GaugeSample {
    /// Family name, in base units (`_seconds`, no `_total`).
    pub name: &'static str,
    /// Help text of the family.
    pub help: &'static str,
    /// Bounded labels (reason names, never flow or event ids).
    pub labels: Vec<(&'static str, &'static str)>,
    /// The value.
    pub value: f64,
}

/// A connection pool's state at scrape time (deadpool's `Status`, without the dependency).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStatus {
    /// Connections the pool may open.
    pub max: usize,
    /// Connections open now.
    pub size: usize,
    /// Open connections idle in the pool.
    pub available: usize,
    /// Callers waiting for a connection.
    pub waiting: usize,
}

impl PoolStatus {
    /// The gauges of pool `pool` (a fixed name: `producer`, `consumer`, `relay`):
    /// `ordered_events_pg_pool_connections{pool,state="in_use"|"idle"}`,
    /// `…_max_connections{pool}` and `…_waiting{pool}`.
    pub fn gauges(self, pool: &'static str) -> Vec<GaugeSample> {
        let in_use = self.size.saturating_sub(self.available);
        let connections = "ordered_events_pg_pool_connections";
        let connections_help = "PostgreSQL pool connections open, in use by a caller or idle.";
        vec![
            GaugeSample {
                name: connections,
                help: connections_help,
                labels: vec![("pool", pool), ("state", "in_use")],
                value: in_use as f64,
            },
            GaugeSample {
                name: connections,
                help: connections_help,
                labels: vec![("pool", pool), ("state", "idle")],
                value: self.available as f64,
            },
            GaugeSample {
                name: "ordered_events_pg_pool_max_connections",
                help: "The most connections the PostgreSQL pool opens.",
                labels: vec![("pool", pool)],
                value: self.max as f64,
            },
            GaugeSample {
                name: "ordered_events_pg_pool_waiting",
                help: "Callers waiting for a PostgreSQL pool connection.",
                labels: vec![("pool", pool)],
                value: self.waiting as f64,
            },
        ]
    }
}

/// Reads the gauges at scrape time. It runs on a blocking thread (it may read SQLite);
/// an error is logged and the gauges are left out of that scrape, the counters still served.
pub type GaugeReader = Arc<dyn Fn() -> Result<Vec<GaugeSample>, String> + Send + Sync>;

/// A [`GaugeReader`] over `db` through a read-only connection of the scrape's own, opened at
/// the first scrape (never the writer's connection or lock) and kept for the next ones.
pub fn gauges_from_db<F, E>(db: std::path::PathBuf, read: F) -> GaugeReader
where
    F: Fn(&rusqlite::Connection) -> Result<Vec<GaugeSample>, E> + Send + Sync + 'static,
    E: std::fmt::Display,
{
    let conn: std::sync::Mutex<Option<rusqlite::Connection>> = std::sync::Mutex::new(None);
    Arc::new(move || {
        let mut conn = crate::blocking::lock(&conn);
        if conn.is_none() {
            let flags = rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY;
            let opened = rusqlite::Connection::open_with_flags(&db, flags)
                .map_err(|e| format!("{}: {e}", db.display()))?;
            *conn = Some(opened);
        }
        let Some(conn) = conn.as_ref() else { return Ok(Vec::new()) };
        read(conn).map_err(|e| e.to_string())
    })
}

/// What one process exposes: its static families and its scrape-time gauges.
#[derive(Clone)]
pub struct Exposition {
    statics: &'static [&'static dyn Expose],
    gauges: Option<GaugeReader>,
}

impl Exposition {
    /// The static families and, if any, the gauge reader.
    pub fn new(statics: &'static [&'static dyn Expose], gauges: Option<GaugeReader>) -> Exposition {
        Exposition { statics, gauges }
    }

    /// The OpenMetrics text of everything, reading the gauges (blocking: call it off the
    /// async runtime's threads).
    pub fn render(&self) -> String {
        let gauges = match &self.gauges {
            Some(read) => read().unwrap_or_else(|e| {
                tracing::warn!(error = %e, "metrics: cannot read the gauges; left out of this scrape");
                Vec::new()
            }),
            None => Vec::new(),
        };
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(Snapshot { statics: self.statics, gauges }));
        let mut out = String::with_capacity(8192);
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &registry) {
            tracing::warn!(error = %e, "metrics: encoding failed");
        }
        out
    }
}

/// One scrape's view: the statics (read as they are encoded) and the gauges already read.
struct Snapshot {
    statics: &'static [&'static dyn Expose],
    gauges: Vec<GaugeSample>,
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot").field("gauges", &self.gauges.len()).finish_non_exhaustive()
    }
}

impl prometheus_client::collector::Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        for family in self.statics {
            family.expose(&mut encoder)?;
        }
        // Gauges of one family are consecutive samples under one descriptor.
        let gauges = &self.gauges;
        let mut i = 0;
        while i < gauges.len() {
            let first = &gauges[i];
            let mut metric = encoder.encode_descriptor(first.name, first.help, None, MetricType::Gauge)?;
            while i < gauges.len() && gauges[i].name == first.name {
                if gauges[i].labels.is_empty() {
                    metric.encode_gauge(&gauges[i].value)?;
                } else {
                    ConstGauge::new(gauges[i].value).encode(metric.encode_family(&gauges[i].labels)?)?;
                }
                i += 1;
            }
        }
        Ok(())
    }
}

/// The content type of [`Exposition::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of [`classic_text`]'s text.
pub const CLASSIC_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The same exposition in the classic Prometheus text format (0.0.4), for scrapers that do
/// not ask for OpenMetrics (curl, `promtool check metrics`, older Prometheus): a counter
/// family is described under its sample name (`…_total`), and there is no `# EOF`. Nothing
/// else differs for what this crate exposes (no units, no exemplars, no created stamps).
pub fn classic_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len() + 16 * counters.len());
    for line in openmetrics.lines() {
        if line == "# EOF" {
            continue;
        }
        let described = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters.contains(name).then(|| format!("{prefix}{name}_total {tail}"))
        });
        match described {
            Some(renamed) => out.push_str(&renamed),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Binds `listen` and serves `GET /metrics` from `exposition` on a task of the current
/// runtime until the process exits; logs `metrics serving` with the bound address. Returns
/// that address.
pub async fn serve(listen: SocketAddr, exposition: Exposition) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, "metrics serving");
    tokio::spawn(accept_loop(listener, exposition));
    Ok(addr)
}

/// Starts the endpoint if `flags` ask for it. A bind failure is the caller's error.
pub async fn serve_if_asked(
    flags: &MetricsFlags,
    exposition: Exposition,
) -> Result<Option<SocketAddr>, MetricsListenError> {
    match flags.metrics_listen {
        None => Ok(None),
        Some(addr) => {
            serve(addr, exposition).await.map(Some).map_err(|source| MetricsListenError { addr, source })
        }
    }
}

/// The metrics address could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen for metrics on {addr}: {source}")]
pub struct MetricsListenError {
    /// The address asked for.
    pub addr: SocketAddr,
    /// Why binding failed.
    pub source: std::io::Error,
}

async fn accept_loop(listener: TcpListener, exposition: Exposition) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors and the like: the scraper retries, the service goes on.
                tracing::warn!(error = %e, "metrics: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let exposition = exposition.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| respond(request, exposition.clone()));
            let io = hyper_util::rt::TokioIo::new(stream);
            // A scraper that hangs up mid-answer is its own business.
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
        });
    }
}

async fn respond(
    request: hyper::Request<hyper::body::Incoming>,
    exposition: Exposition,
) -> Result<hyper::Response<http_body_util::Full<bytes::Bytes>>, std::convert::Infallible> {
    use hyper::{Method, StatusCode, header};
    let text = |status, body: &'static str| {
        let mut response =
            hyper::Response::new(http_body_util::Full::new(bytes::Bytes::from_static(body.as_bytes())));
        *response.status_mut() = status;
        response
    };
    if request.uri().path() != "/metrics" {
        return Ok(text(StatusCode::NOT_FOUND, "not found: only /metrics is served here\n"));
    }
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return Ok(text(StatusCode::METHOD_NOT_ALLOWED, "only GET /metrics\n"));
    }
    // Prometheus asks for OpenMetrics in its Accept header; everyone else gets the classic
    // format, which every Prometheus-format reader understands.
    let openmetrics = request
        .headers()
        .get_all(header::ACCEPT)
        .iter()
        .any(|v| v.to_str().is_ok_and(|v| v.contains("application/openmetrics-text")));
    let rendered = match tokio::task::spawn_blocking(move || exposition.render()).await {
        Ok(rendered) => rendered,
        Err(_) => return Ok(text(StatusCode::INTERNAL_SERVER_ERROR, "metrics rendering failed\n")),
    };
    let (body, content_type) =
        if openmetrics { (rendered, CONTENT_TYPE) } else { (classic_text(&rendered), CLASSIC_CONTENT_TYPE) };
    let mut response = hyper::Response::new(http_body_util::Full::new(bytes::Bytes::from(body)));
    response.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static(content_type));
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    static OUTCOMES: Counters<2> =
        Counters::new("test_outcomes", "Test outcomes.", "outcome", ["ok", "other"]);
    static LATENCY: Histogram = Histogram::seconds("test_latency_seconds", "Test latency.", None);

    #[test]
    fn counters_and_histograms_render_in_base_units() {
        OUTCOMES.inc(0);
        OUTCOMES.add(7, 2);
        LATENCY.observe(150);
        LATENCY.observe(2_000_000);
        static FAMILIES: [&dyn Expose; 2] = [&OUTCOMES, &LATENCY];
        let text = Exposition::new(&FAMILIES, None).render();
        assert!(text.contains("test_outcomes_total{outcome=\"ok\"} 1\n"), "{text}");
        assert!(text.contains("test_outcomes_total{outcome=\"other\"} 2\n"), "{text}");
        assert!(text.contains("test_latency_seconds_bucket{le=\"0.00025\"} 1\n"), "{text}");
        assert!(text.contains("test_latency_seconds_bucket{le=\"+Inf\"} 2\n"), "{text}");
        assert!(text.contains("test_latency_seconds_count 2\n"), "{text}");
        assert!(text.ends_with("# EOF\n"));
        let classic = classic_text(&text);
        assert!(classic.contains("# TYPE test_outcomes_total counter\n"), "{classic}");
        assert!(classic.contains("# HELP test_outcomes_total Test outcomes.\n"), "{classic}");
        assert!(classic.contains("# TYPE test_latency_seconds histogram\n"), "{classic}");
        assert!(!classic.contains("# EOF"), "{classic}");
    }
}
