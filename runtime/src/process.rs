//! The life of a server process around its service: start-up (logging, allocation settings,
//! the async runtime), binding and the readiness line, running until SIGTERM/SIGINT, and one
//! exit path that prints one error line. The producer's and consumer's `main` are this plus
//! their flags.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::ExitCode;

use tokio::net::TcpListener;
use tonic::body::Body;
use tonic::codegen::Service;
use tonic::codegen::http;
use tonic::server::NamedService;
use tonic::service::interceptor::InterceptedService;

use crate::serve::{
    LogFormat, ServeOptions, ServerSettings, announce, exit_code, init_tracing, shutdown_signal,
};

/// The flags every server takes beside its own (flatten into its clap arguments): the log
/// format and the [`ServeOptions`], each with an `ORDERED_EVENTS_*` twin.
#[derive(Clone, Debug, clap::Args)]
#[command(next_help_heading = "Server options")]
pub struct ServerFlags {
    /// Log format on stderr.
    #[arg(long, env = "ORDERED_EVENTS_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Limits, authentication and TLS.
    #[command(flatten)]
    pub serve: ServeOptions,
}

/// Why a service could not start: its database, or the writer thread that owns its writes.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The database could not be opened or is not this service's.
    #[error(transparent)]
    Db(#[from] proto::db::DbError),
    /// The PostgreSQL database could not be opened or is not this service's.
    #[error(transparent)]
    Pg(#[from] proto::pg::PgError),
    /// The operating system refused a thread.
    #[error("cannot start the writer thread: {0}")]
    Writer(#[from] std::io::Error),
    /// The database's identity record could not be read.
    #[error("cannot read the database identity: {0}")]
    Identity(String),
}

/// Why a server stopped with an error after its service opened.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address asked for.
        addr: SocketAddr,
        /// Why binding failed.
        source: std::io::Error,
    },
    /// The gRPC server failed (TLS set-up, the listener).
    #[error(transparent)]
    Transport(#[from] tonic::transport::Error),
}

/// Completes when the process is asked to stop (SIGTERM or SIGINT).
pub type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A binary's whole `main` after flag parsing: logs to stderr in `log_format`, applies the
/// allocation settings before any database is opened, runs `run` to completion on a
/// current-thread runtime, and turns its result into the exit code (0, or one
/// `<name>: error: …` line and 1).
pub fn process_main<E, F>(name: &str, log_format: LogFormat, run: F) -> ExitCode
where
    E: std::fmt::Display,
    F: Future<Output = Result<(), E>>,
{
    init_tracing(log_format);
    crate::alloc::tune_allocation();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => return exit_code(name, Err(format!("cannot start the async runtime: {e}"))),
    };
    exit_code(name, runtime.block_on(run))
}

/// Serves one `ordered_events.v1` service (a generated server, its limits set) behind the
/// bearer-token check of `settings`, beside health and reflection, until `shutdown` and the
/// drain complete (see [`crate::serve::serve`]).
pub async fn serve_authenticated<S>(
    listener: TcpListener,
    service: S,
    shutdown: impl Future<Output = ()> + Send,
    settings: &ServerSettings,
    storage: Option<tokio::sync::watch::Receiver<bool>>,
) -> Result<(), tonic::transport::Error>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let guarded = InterceptedService::new(service, settings.require_token());
    crate::serve::serve_with_health(
        listener,
        S::NAME,
        |r| r.add_service(guarded),
        shutdown,
        settings,
        storage,
    )
    .await
}

/// Binds `listen`, installs the signal handlers, prints the bound address as the first
/// stdout line and runs `serve_on(listener, shutdown)` until it returns (after SIGTERM or
/// SIGINT and the drain). Logs `<name> serving` and `<name> stopped` around it.
pub async fn run_server<F, Fut>(name: &str, listen: SocketAddr, serve_on: F) -> Result<(), ServeError>
where
    F: FnOnce(TcpListener, Shutdown) -> Fut,
    Fut: Future<Output = Result<(), tonic::transport::Error>>,
{
    let listen_error = |source| ServeError::Listen { addr: listen, source };
    let listener = TcpListener::bind(listen).await.map_err(listen_error)?;
    let addr = listener.local_addr().map_err(listen_error)?;
    // Installed before the readiness line, so a signal right after it still stops cleanly.
    let shutdown = Box::pin(shutdown_signal());
    announce(addr);
    tracing::info!(%addr, "{name} serving");
    serve_on(listener, shutdown).await?;
    tracing::info!("{name} stopped");
    Ok(())
}
