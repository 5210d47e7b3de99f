//! Bounded resources for a gRPC server, whoever the peers are: a cap on open connections
//! (a connection over it is closed at once), a cap on open streams across all connections
//! (a call over it is `RESOURCE_EXHAUSTED`; health and reflection count too), an idle-stream
//! timeout (no message either way), an idle-connection timeout (no open stream), and freed
//! memory handed back to the kernel after a burst. Nothing here reads a message: it protects
//! the process's memory, not the protocol.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http_body::Frame;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tonic::Status;
use tonic::transport::server::{Connected, TcpConnectInfo, TcpIncoming};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The caps and timeouts (from the server flags).
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// Open connections at most.
    pub max_connections: usize,
    /// Open streams (calls in progress) at most, over all connections.
    pub max_streams: usize,
    /// End a stream after this long without a message either way (`None`: never).
    pub idle_stream: Option<Duration>,
    /// Close a connection after this long without an open stream (`None`: never).
    pub idle_connection: Option<Duration>,
}

/// A server's shared counters: the permits, the refusal logs and the trimmer.
#[derive(Clone)]
pub struct Limits {
    bounds: Bounds,
    connections: Arc<Semaphore>,
    streams: Arc<Semaphore>,
    refused_connections: Arc<RefusalLog>,
    refused_streams: Arc<RefusalLog>,
    trim: Arc<Trimmer>,
}

impl Limits {
    /// Fresh counters for `bounds`.
    pub fn new(bounds: Bounds) -> Limits {
        Limits {
            bounds,
            connections: Arc::new(Semaphore::new(bounds.max_connections)),
            streams: Arc::new(Semaphore::new(bounds.max_streams)),
            refused_connections: Arc::new(RefusalLog::new(
                "connection refused: the server is at --max-connections",
            )),
            refused_streams: Arc::new(RefusalLog::new(
                "call refused with RESOURCE_EXHAUSTED: the server is at --max-streams",
            )),
            trim: Arc::new(Trimmer::default()),
        }
    }

    /// Accepted connections, each holding a connection permit until it closes; a connection
    /// over the cap is closed at once (the client sees the connection reset or closed).
    pub fn limit_connections(
        &self,
        incoming: TcpIncoming,
    ) -> impl tokio_stream::Stream<Item = std::io::Result<LimitedConnection>> + use<> {
        use tokio_stream::StreamExt as _;
        let limits = self.clone();
        incoming.filter_map(move |accepted| match accepted {
            Err(e) => Some(Err(e)),
            Ok(tcp) => match Arc::clone(&limits.connections).try_acquire_owned() {
                Ok(permit) => Some(Ok(LimitedConnection::new(tcp, permit, &limits))),
                Err(_) => {
                    limits.refused_connections.record(limits.bounds.max_connections);
                    None
                }
            },
        })
    }

    /// The tower layer that caps streams and times idle ones out.
    pub fn stream_layer(&self) -> StreamCapLayer {
        StreamCapLayer { limits: self.clone() }
    }

    /// Returns freed memory to the kernel after each burst, until the returned task is
    /// aborted.
    pub fn spawn_trimmer(&self) -> tokio::task::JoinHandle<()> {
        let trim = Arc::clone(&self.trim);
        tokio::spawn(async move { trim.run().await })
    }
}

/// Logs refusals at most once per [`REFUSAL_LOG_EVERY`], with how many there were, so a
/// flood cannot flood the log.
struct RefusalLog {
    what: &'static str,
    last: Mutex<Option<std::time::Instant>>,
    since_last: AtomicU64,
}

/// The shortest interval between two refusal lines of one kind.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);

impl RefusalLog {
    fn new(what: &'static str) -> RefusalLog {
        RefusalLog { what, last: Mutex::new(None), since_last: AtomicU64::new(0) }
    }

    fn record(&self, cap: usize) {
        let refused = self.since_last.fetch_add(1, Ordering::Relaxed) + 1;
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        if last.is_none_or(|at| now.duration_since(at) >= REFUSAL_LOG_EVERY) {
            *last = Some(now);
            self.since_last.store(0, Ordering::Relaxed);
            tracing::warn!(cap, refused, "{} (logged at most every 10 s)", self.what);
        }
    }
}

/// Hands freed heap memory back to the kernel after a burst: glibc keeps it for reuse (and
/// `db.rs` raises its trim threshold so the writer's per-commit buffers stay mapped), so
/// the memory of 25 000 closed streams would otherwise stay resident for ever. A burst is
/// over when the open streams and connections fell to a quarter of their peak since the last
/// trim (a peak of at least [`TRIM_MIN_PEAK`]) and stayed there for [`TRIM_QUIET`].
#[derive(Default)]
struct Trimmer {
    open: AtomicUsize,
    peak: AtomicUsize,
    wake: Notify,
}

/// Bursts smaller than this are not worth a trim.
const TRIM_MIN_PEAK: usize = 64;
/// How long the load must stay down before a trim.
const TRIM_QUIET: Duration = Duration::from_secs(1);

impl Trimmer {
    fn opened(&self) {
        let open = self.open.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak.fetch_max(open, Ordering::Relaxed);
    }

    fn closed(&self) {
        let open = self.open.fetch_sub(1, Ordering::Relaxed) - 1;
        let peak = self.peak.load(Ordering::Relaxed);
        if peak >= TRIM_MIN_PEAK && open * 4 <= peak {
            self.wake.notify_one();
        }
    }

    async fn run(&self) {
        loop {
            self.wake.notified().await;
            tokio::time::sleep(TRIM_QUIET).await;
            let open = self.open.load(Ordering::Relaxed);
            if open * 4 > self.peak.load(Ordering::Relaxed) {
                // A new burst began meanwhile; its end will wake us again.
                continue;
            }
            self.peak.store(open, Ordering::Relaxed);
            let released = crate::alloc::release_free_memory();
            tracing::debug!(open, released, "burst over: freed memory returned to the kernel");
        }
    }
}

/// What one connection shares with the streams opened on it: how many are open, since when
/// none is, and the waker of its reader (woken when the last stream closes, so the idle
/// timer starts even though no byte arrives).
#[derive(Debug)]
pub struct ConnectionState {
    open_streams: AtomicUsize,
    idle_since: Mutex<Instant>,
    reader: Mutex<Option<Waker>>,
}

impl ConnectionState {
    fn stream_opened(&self) {
        self.open_streams.fetch_add(1, Ordering::AcqRel);
    }

    fn stream_closed(&self) {
        if self.open_streams.fetch_sub(1, Ordering::AcqRel) == 1 {
            *self.idle_since.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
            if let Some(waker) = self.reader.lock().unwrap_or_else(|p| p.into_inner()).take() {
                waker.wake();
            }
        }
    }
}

/// The connection info of a [`LimitedConnection`]: the TCP addresses (also put into each
/// request, as tonic does for a plain `TcpStream`) and the connection's shared state.
#[derive(Clone, Debug)]
pub struct ConnectionInfo {
    /// The TCP addresses.
    pub tcp: TcpConnectInfo,
    /// The connection's shared state (open streams, idle timer).
    pub state: Arc<ConnectionState>,
}

/// An accepted TCP connection that holds its connection permit until it is dropped, and
/// reads end-of-file once it has had no open stream for the idle timeout (hyper then closes
/// it).
pub struct LimitedConnection {
    tcp: TcpStream,
    info: ConnectionInfo,
    idle_timeout: Option<Duration>,
    idle_timer: Pin<Box<Sleep>>,
    closed_for_idle: bool,
    trim: Arc<Trimmer>,
    _permit: OwnedSemaphorePermit,
}

impl LimitedConnection {
    fn new(tcp: TcpStream, permit: OwnedSemaphorePermit, limits: &Limits) -> LimitedConnection {
        let tcp_info = tcp.connect_info();
        let now = Instant::now();
        let state = Arc::new(ConnectionState {
            open_streams: AtomicUsize::new(0),
            idle_since: Mutex::new(now),
            reader: Mutex::new(None),
        });
        limits.trim.opened();
        LimitedConnection {
            tcp,
            info: ConnectionInfo { tcp: tcp_info, state },
            idle_timeout: limits.bounds.idle_connection,
            idle_timer: Box::pin(tokio::time::sleep_until(now)),
            closed_for_idle: false,
            trim: Arc::clone(&limits.trim),
            _permit: permit,
        }
    }

    /// True once the connection has had no stream for the idle timeout; otherwise arms the
    /// timer (and the reader's waker) for when that would be.
    fn idle_expired(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(timeout) = self.idle_timeout else { return false };
        let state = &self.info.state;
        {
            let mut reader = state.reader.lock().unwrap_or_else(|p| p.into_inner());
            if !reader.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                *reader = Some(cx.waker().clone());
            }
        }
        if state.open_streams.load(Ordering::Acquire) > 0 {
            return false;
        }
        let deadline = *state.idle_since.lock().unwrap_or_else(|p| p.into_inner()) + timeout;
        if self.idle_timer.deadline() != deadline {
            self.idle_timer.as_mut().reset(deadline);
        }
        self.idle_timer.as_mut().poll(cx).is_ready()
    }
}

impl Drop for LimitedConnection {
    fn drop(&mut self) {
        self.trim.closed();
    }
}

impl Connected for LimitedConnection {
    type ConnectInfo = ConnectionInfo;

    fn connect_info(&self) -> ConnectionInfo {
        self.info.clone()
    }
}

impl AsyncRead for LimitedConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.closed_for_idle {
            return Poll::Ready(Ok(()));
        }
        if self.idle_expired(cx) {
            tracing::debug!(peer = ?self.info.tcp.remote_addr(), "closing a connection without streams for the idle timeout");
            self.closed_for_idle = true;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for LimitedConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
}

/// Tower layer: see [`StreamCap`].
#[derive(Clone)]
pub struct StreamCapLayer {
    limits: Limits,
}

impl<S> tower_layer::Layer<S> for StreamCapLayer {
    type Service = StreamCap<S>;

    fn layer(&self, inner: S) -> StreamCap<S> {
        StreamCap { inner, limits: self.limits.clone() }
    }
}

/// Gives every call a stream permit held until its response body is done (or dropped), and
/// answers a call over the cap `RESOURCE_EXHAUSTED` without running it. With an idle-stream
/// timeout, a stream with no message either way for that long is ended: its response gets
/// `UNAVAILABLE` trailers and its request body an error, so the handler stops reading.
#[derive(Clone)]
pub struct StreamCap<S> {
    inner: S,
    limits: Limits,
}

/// One open stream: returns its permit and counts it closed on its connection when dropped.
struct StreamGuard {
    connection: Option<Arc<ConnectionState>>,
    trim: Arc<Trimmer>,
    _permit: OwnedSemaphorePermit,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if let Some(connection) = &self.connection {
            connection.stream_closed();
        }
        self.trim.closed();
    }
}

/// When a stream last carried a message, and whether it was ended for idleness (shared by
/// its request and response bodies).
struct Activity {
    origin: Instant,
    last_ms: AtomicU64,
    ended: AtomicBool,
    reader: Mutex<Option<Waker>>,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            origin: Instant::now(),
            last_ms: AtomicU64::new(0),
            ended: AtomicBool::new(false),
            reader: Mutex::new(None),
        }
    }

    fn touch(&self) {
        self.last_ms.store(self.origin.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn idle_deadline(&self, timeout: Duration) -> Instant {
        self.origin + Duration::from_millis(self.last_ms.load(Ordering::Relaxed)) + timeout
    }

    fn end(&self) {
        self.ended.store(true, Ordering::Release);
        if let Some(waker) = self.reader.lock().unwrap_or_else(|p| p.into_inner()).take() {
            waker.wake();
        }
    }
}

type ResponseFuture<E> =
    Pin<Box<dyn std::future::Future<Output = Result<http::Response<tonic::body::Body>, E>> + Send>>;

impl<S, B> tower_service::Service<http::Request<tonic::body::Body>> for StreamCap<S>
where
    S: tower_service::Service<http::Request<tonic::body::Body>, Response = http::Response<B>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<tonic::body::Body>) -> Self::Future {
        let Ok(permit) = Arc::clone(&self.limits.streams).try_acquire_owned() else {
            self.limits.refused_streams.record(self.limits.bounds.max_streams);
            let status = Status::resource_exhausted(format!(
                "the server has {} streams open, its cap (--max-streams); retry later",
                self.limits.bounds.max_streams
            ));
            return Box::pin(std::future::ready(Ok(status.into_http())));
        };
        // Counted here, synchronously, so a connection's idle timer never sees a stream that
        // hyper has read but not yet handed over.
        let connection = request.extensions().get::<ConnectionInfo>().map(|info| Arc::clone(&info.state));
        if let Some(info) = request.extensions().get::<ConnectionInfo>().map(|info| info.tcp.clone()) {
            request.extensions_mut().insert(info);
        }
        if let Some(connection) = &connection {
            connection.stream_opened();
        }
        self.limits.trim.opened();
        let guard = StreamGuard { connection, trim: Arc::clone(&self.limits.trim), _permit: permit };
        let idle = self.limits.bounds.idle_stream;
        let activity = Arc::new(Activity::new());
        let request = match idle {
            None => request,
            Some(_) => request.map(|body| {
                tonic::body::Body::new(WatchedRequest { inner: body, activity: Arc::clone(&activity) })
            }),
        };
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await?;
            Ok(response.map(|body| {
                tonic::body::Body::new(GuardedResponse {
                    inner: Some(tonic::body::Body::new(body)),
                    guard: Some(guard),
                    idle: idle.map(|timeout| IdleTimer {
                        timeout,
                        timer: Box::pin(tokio::time::sleep(timeout)),
                        activity,
                    }),
                })
            }))
        })
    }
}

/// A request body that marks its stream active on each frame, and fails once the stream was
/// ended for idleness.
struct WatchedRequest {
    inner: tonic::body::Body,
    activity: Arc<Activity>,
}

impl http_body::Body for WatchedRequest {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.activity.ended.load(Ordering::Acquire) {
            return Poll::Ready(Some(Err(Box::new(idle_status()))));
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                self.activity.touch();
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
            Poll::Pending => {
                *self.activity.reader.lock().unwrap_or_else(|p| p.into_inner()) = Some(cx.waker().clone());
                // Ended between the check above and the waker's registration.
                if self.activity.ended.load(Ordering::Acquire) {
                    return Poll::Ready(Some(Err(Box::new(idle_status()))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

struct IdleTimer {
    timeout: Duration,
    timer: Pin<Box<Sleep>>,
    activity: Arc<Activity>,
}

/// A response body that holds its stream's permit until it is done, and ends the stream
/// with `UNAVAILABLE` trailers once no message went either way for the idle timeout.
struct GuardedResponse {
    inner: Option<tonic::body::Body>,
    guard: Option<StreamGuard>,
    idle: Option<IdleTimer>,
}

fn idle_status() -> Status {
    Status::unavailable("stream idle for longer than the server's --idle-stream-timeout-ms; open a new one")
}

impl http_body::Body for GuardedResponse {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let Some(inner) = this.inner.as_mut() else { return Poll::Ready(None) };
        match Pin::new(inner).poll_frame(cx) {
            Poll::Ready(None) => {
                this.inner = None;
                this.guard = None;
                Poll::Ready(None)
            }
            Poll::Ready(Some(frame)) => {
                if let Some(idle) = &this.idle {
                    idle.activity.touch();
                }
                Poll::Ready(Some(frame.map_err(Into::into)))
            }
            Poll::Pending => {
                let Some(idle) = this.idle.as_mut() else { return Poll::Pending };
                let deadline = idle.activity.idle_deadline(idle.timeout);
                if idle.timer.deadline() != deadline {
                    idle.timer.as_mut().reset(deadline);
                }
                if idle.timer.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                tracing::debug!(timeout = ?idle.timeout, "ending an idle stream");
                idle.activity.end();
                this.inner = None;
                this.guard = None;
                let mut trailers = http::HeaderMap::new();
                // Our own ASCII message: it always makes a valid header.
                let _ = idle_status().add_header(&mut trailers);
                Poll::Ready(Some(Ok(Frame::trailers(trailers))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(|b| b.is_end_stream())
    }
}
