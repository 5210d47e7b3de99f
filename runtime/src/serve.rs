//! What both gRPC servers share: logging to stderr, the readiness line, health and
//! reflection (v1 and v1alpha), and graceful shutdown on SIGTERM/SIGINT with health turned
//! `NOT_SERVING` before in-flight calls drain.

use std::future::Future;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use tokio::net::TcpListener;
use tonic::transport::Server;
use tonic::transport::server::Router;
use tonic_health::ServingStatus;

/// Log output format on stderr.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Sends `tracing` output to stderr (never stdout, which carries the readiness line and the
/// relay's JSON lines), filtered by `RUST_LOG` (default `info`).
pub fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(false).init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// The exit of a process given its `run` result: 0, or one `<name>: error: …` line on stderr
/// and 1. Only the top-level message is printed: it already names the file and the cause,
/// and the source chain would repeat it.
pub fn exit_code<E: std::fmt::Display>(name: &str, result: Result<(), E>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Prints the bound address as the process's first (and only) stdout line.
pub fn announce(addr: SocketAddr) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{addr}");
    let _ = out.flush();
}

/// Completes on SIGTERM or SIGINT. The handlers are installed when this is called, not when
/// the future is first polled: call it before announcing readiness, so a signal that comes
/// right after the readiness line still shuts down cleanly.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send {
    use tokio::signal::unix::{SignalKind, signal};
    let handlers = (signal(SignalKind::terminate()), signal(SignalKind::interrupt()));
    async move {
        match handlers {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
                    _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
                }
            }
            (Err(e), _) | (_, Err(e)) => {
                tracing::error!(error = %e, "cannot install signal handlers; only the process's death stops it");
                std::future::pending::<()>().await;
            }
        }
    }
}

/// Server limits, authentication and TLS: flags shared by the producer and the consumer
/// (flatten into a binary's clap arguments), each with an `ORDERED_EVENTS_*` twin.
#[derive(Clone, Debug, clap::Args)]
pub struct ServeOptions {
    /// Largest gRPC message a server decodes, in bytes; a larger one is refused with
    /// OUT_OF_RANGE, tonic's code for it (on Receive, that ends the stream).
    #[arg(long, env = "ORDERED_EVENTS_MAX_MESSAGE_BYTES", default_value_t = 1 << 20,
          value_parser = clap::value_parser!(u32).range(1024..=(64 << 20)))]
    pub max_message_bytes: u32,
    /// HTTP/2 streams a client may have open at once on one connection.
    #[arg(long, env = "ORDERED_EVENTS_MAX_CONCURRENT_STREAMS", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_concurrent_streams: u32,
    /// Connections open at once; a connection over the cap is closed as soon as it is
    /// accepted (refusals are logged at most every 10 s).
    #[arg(long, env = "ORDERED_EVENTS_MAX_CONNECTIONS", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
    /// Streams (calls in progress, health Watch and reflection included) open at once over
    /// all connections; a call over the cap is RESOURCE_EXHAUSTED and does not run.
    #[arg(long, env = "ORDERED_EVENTS_MAX_STREAMS", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_streams: u32,
    /// End a stream that carried no message either way for this many milliseconds, with
    /// UNAVAILABLE (0: never); a relay sends a Receive stream's unanswered envelopes again.
    #[arg(long, env = "ORDERED_EVENTS_IDLE_STREAM_TIMEOUT_MS", default_value_t = 300_000)]
    pub idle_stream_timeout_ms: u64,
    /// Close a connection that had no open stream for this many milliseconds (0: never).
    #[arg(long, env = "ORDERED_EVENTS_IDLE_CONNECTION_TIMEOUT_MS", default_value_t = 300_000)]
    pub idle_connection_timeout_ms: u64,
    /// Requests served at once per connection; more wait their turn.
    #[arg(long, env = "ORDERED_EVENTS_CONCURRENCY_LIMIT", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub concurrency_limit: u32,
    /// Deadline for producing a call's response, in milliseconds (CANCELLED after it; a
    /// Receive stream, once open, is not cut). A client's shorter grpc-timeout wins.
    #[arg(long, env = "ORDERED_EVENTS_REQUEST_TIMEOUT_MS", default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub request_timeout_ms: u64,
    /// HTTP/2 keepalive: ping an idle connection this often, in milliseconds (0: never).
    #[arg(long, env = "ORDERED_EVENTS_KEEPALIVE_INTERVAL_MS", default_value_t = 30_000)]
    pub keepalive_interval_ms: u64,
    /// HTTP/2 keepalive: close the connection when a ping is not answered within this many
    /// milliseconds.
    #[arg(long, env = "ORDERED_EVENTS_KEEPALIVE_TIMEOUT_MS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub keepalive_timeout_ms: u64,
    /// After SIGTERM/SIGINT, how long in-flight calls may take to finish, in milliseconds,
    /// before the remaining connections are dropped.
    #[arg(long, env = "ORDERED_EVENTS_SHUTDOWN_GRACE_MS", default_value_t = 10_000)]
    pub shutdown_grace_ms: u64,
    /// Require `authorization: Bearer <token>` (the file's content) on every
    /// ordered_events.v1 call; others get UNAUTHENTICATED. Health and reflection stay open.
    #[arg(long, env = "ORDERED_EVENTS_TOKEN_FILE", value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// Serve TLS with this PEM certificate chain (needs --tls-key).
    #[arg(long, env = "ORDERED_EVENTS_TLS_CERT", value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = "ORDERED_EVENTS_TLS_KEY", value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

/// Why the server options cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum OptionsError {
    /// The token file is unreadable or invalid.
    #[error(transparent)]
    Token(#[from] crate::auth::TokenError),
    /// A TLS certificate or key file is unreadable.
    #[error("TLS file {path}: {source}")]
    TlsFile {
        /// The certificate or key file.
        path: String,
        /// Why reading failed.
        source: std::io::Error,
    },
}

/// [`ServeOptions`] with their files read: what `serve` and the services use.
#[derive(Clone, Debug)]
pub struct ServerSettings {
    /// The flags as given.
    pub options: ServeOptions,
    token: Option<std::sync::Arc<str>>,
    tls: Option<tonic::transport::Identity>,
}

impl ServeOptions {
    /// Reads the token and TLS files, failing with a line that names the file.
    pub fn load(self) -> Result<ServerSettings, OptionsError> {
        let token = self.token_file.as_deref().map(crate::auth::read_token).transpose()?;
        let read = |path: &PathBuf| {
            std::fs::read(path)
                .map_err(|source| OptionsError::TlsFile { path: path.display().to_string(), source })
        };
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(tonic::transport::Identity::from_pem(read(cert)?, read(key)?)),
            _ => None,
        };
        Ok(ServerSettings { options: self, token, tls })
    }
}

impl ServerSettings {
    /// The interceptor for the ordered_events.v1 services.
    pub fn require_token(&self) -> crate::auth::RequireToken {
        crate::auth::RequireToken::new(self.token.clone())
    }

    /// The caps and timeouts of [`crate::server_limits`].
    pub fn bounds(&self) -> crate::server_limits::Bounds {
        let opts = &self.options;
        let millis = |ms: u64| (ms > 0).then(|| Duration::from_millis(ms));
        crate::server_limits::Bounds {
            max_connections: opts.max_connections as usize,
            max_streams: opts.max_streams as usize,
            idle_stream: millis(opts.idle_stream_timeout_ms),
            idle_connection: millis(opts.idle_connection_timeout_ms),
        }
    }

    /// The largest decoded message, for the generated servers.
    pub fn max_message_bytes(&self) -> usize {
        self.options.max_message_bytes as usize
    }
}

/// The router `serve` hands to its caller: every service behind the stream cap.
pub type LimitedRouter =
    Router<tower_layer::Stack<crate::server_limits::StreamCapLayer, tower_layer::Identity>>;

/// Serves `add(router)` on `listener` beside health (for "" and `service_name`) and both
/// reflection versions, with the limits, TLS and grace of `settings`, until `shutdown`
/// completes. Health goes `NOT_SERVING` first, then in-flight calls get the grace period to
/// finish (a client that keeps its connection open cannot hold the process forever).
pub async fn serve<F>(
    listener: TcpListener,
    service_name: &'static str,
    add: impl FnOnce(LimitedRouter) -> LimitedRouter,
    shutdown: F,
    settings: &ServerSettings,
) -> Result<(), tonic::transport::Error>
where
    F: Future<Output = ()> + Send,
{
    serve_with_health(listener, service_name, add, shutdown, settings, None).await
}

/// [`serve`], with health following `storage` (`true`: `SERVING`, `false`: `NOT_SERVING`)
/// until shutdown, which turns it `NOT_SERVING` for good.
pub async fn serve_with_health<F>(
    listener: TcpListener,
    service_name: &'static str,
    add: impl FnOnce(LimitedRouter) -> LimitedRouter,
    shutdown: F,
    settings: &ServerSettings,
    storage: Option<tokio::sync::watch::Receiver<bool>>,
) -> Result<(), tonic::transport::Error>
where
    F: Future<Output = ()> + Send,
{
    let opts = &settings.options;
    let grace = Duration::from_millis(opts.shutdown_grace_ms);
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_service_status(service_name, ServingStatus::Serving).await;
    let follower =
        storage.map(|storage| tokio::spawn(follow_storage(reporter.clone(), service_name, storage)));
    // Advertise only what this server serves (the descriptor set holds both services).
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(proto::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .with_service_name(service_name)
            .with_service_name("grpc.health.v1.Health")
    };
    // The descriptor sets are compiled into the binary; a failure here is a build defect.
    let v1 = reflection()
        .with_service_name("grpc.reflection.v1.ServerReflection")
        .build_v1()
        .expect("the compiled-in descriptor sets are valid");
    let v1alpha = reflection()
        .with_service_name("grpc.reflection.v1alpha.ServerReflection")
        .build_v1alpha()
        .expect("the compiled-in descriptor sets are valid");
    let keepalive =
        (opts.keepalive_interval_ms > 0).then(|| Duration::from_millis(opts.keepalive_interval_ms));
    let limits = crate::server_limits::Limits::new(settings.bounds());
    let mut builder = Server::builder()
        .max_concurrent_streams(opts.max_concurrent_streams)
        .concurrency_limit_per_connection(opts.concurrency_limit as usize)
        .timeout(Duration::from_millis(opts.request_timeout_ms))
        .http2_keepalive_interval(keepalive)
        .http2_keepalive_timeout(Some(Duration::from_millis(opts.keepalive_timeout_ms)));
    if let Some(identity) = &settings.tls {
        builder = builder.tls_config(tonic::transport::ServerTlsConfig::new().identity(identity.clone()))?;
    }
    let router =
        builder.layer(limits.stream_layer()).add_service(health).add_service(v1).add_service(v1alpha);
    let router = add(router);
    // An incoming stream of our own makes tonic ignore its `tcp_nodelay` default: set it
    // here, or Nagle's algorithm holds small answers back behind delayed ACKs.
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let incoming = limits.limit_connections(incoming);
    let trimmer = limits.spawn_trimmer();
    let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
    let served = router.serve_with_incoming_shutdown(incoming, async move {
        shutdown.await;
        if let Some(follower) = follower {
            follower.abort();
        }
        reporter.set_service_status("", ServingStatus::NotServing).await;
        reporter.set_service_status(service_name, ServingStatus::NotServing).await;
        tracing::info!(grace = ?grace, "health NOT_SERVING; draining in-flight calls");
        let _ = stopping_tx.send(());
    });
    let grace_over = async move {
        if stopping_rx.await.is_ok() {
            tokio::time::sleep(grace).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    let result = tokio::select! {
        result = served => result,
        () = grace_over => {
            tracing::warn!(grace = ?grace, "grace period over; dropping the connections still open");
            Ok(())
        }
    };
    trimmer.abort();
    result
}

/// Sets health (for "" and `service_name`) from each change of `storage`.
async fn follow_storage(
    reporter: tonic_health::server::HealthReporter,
    service_name: &'static str,
    mut storage: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let status =
            if *storage.borrow_and_update() { ServingStatus::Serving } else { ServingStatus::NotServing };
        reporter.set_service_status("", status).await;
        reporter.set_service_status(service_name, status).await;
        if storage.changed().await.is_err() {
            return;
        }
    }
}
