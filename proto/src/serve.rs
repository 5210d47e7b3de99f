//! What both gRPC servers share: logging to stderr, the readiness line, health and
//! reflection (v1 and v1alpha), and graceful shutdown on SIGTERM/SIGINT with health turned
//! `NOT_SERVING` before in-flight calls drain.

use std::future::Future;
use std::io::Write as _;
use std::net::SocketAddr;
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

/// Prints the bound address as the process's first (and only) stdout line.
pub fn announce(addr: SocketAddr) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{addr}");
    let _ = out.flush();
}

/// Completes on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
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

/// How long in-flight calls may take to finish after a shutdown signal before the
/// remaining connections are dropped.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Serves `add(router)` on `listener` beside health (for "" and `service_name`) and both
/// reflection versions, until `shutdown` completes. Health goes `NOT_SERVING` first, then
/// in-flight calls get up to `grace` to finish (a client that keeps its connection open
/// cannot hold the process forever).
pub async fn serve<F>(
    listener: TcpListener,
    service_name: &'static str,
    add: impl FnOnce(Router) -> Router,
    shutdown: F,
    grace: Duration,
) -> Result<(), tonic::transport::Error>
where
    F: Future<Output = ()> + Send,
{
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_service_status(service_name, ServingStatus::Serving).await;
    // Advertise only what this server serves (the descriptor set holds both services).
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::pb::FILE_DESCRIPTOR_SET)
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
    let router = Server::builder().add_service(health).add_service(v1).add_service(v1alpha);
    let router = add(router);
    // An incoming stream of our own makes tonic ignore its `tcp_nodelay` default: set it
    // here, or Nagle's algorithm holds small answers back behind delayed ACKs.
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
    let served = router.serve_with_incoming_shutdown(incoming, async move {
        shutdown.await;
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
    tokio::select! {
        result = served => result,
        () = grace_over => {
            tracing::warn!(grace = ?grace, "grace period over; dropping the connections still open");
            Ok(())
        }
    }
}
