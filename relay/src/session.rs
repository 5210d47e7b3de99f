//! One open `Receive` stream: [`Session::open`] is the one place a stream to the consumer is
//! opened (connect, then open the call, bounded by the answer timeout), so whatever must
//! happen before the first envelope is sent belongs there.

use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::pb;
use proto::pb::consumer_client::ConsumerClient;
use runtime::auth::SendToken;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use tonic::transport::Channel;

use crate::Link;
use crate::error::RelayError;
use crate::identity::Judged;
use crate::ledger::Ledger;
use crate::stop::Stop;

/// One open `Receive` stream: envelopes go out through `outbound`, answers come back in
/// order on `answers`.
pub struct Session {
    outbound: mpsc::Sender<pb::EventEnvelope>,
    answers: tonic::Streaming<pb::ReceiveResult>,
    /// The connection, for identity checks while idle.
    channel: Channel,
    /// When the consumer's identity was last checked.
    identified_at: Instant,
    /// When an envelope was last handed to the stream (or the stream opened).
    last_sent: Instant,
    /// Under leases: the leases judged against this stream's consumer; only their rows are
    /// sent on it.
    judged: Judged,
    /// The consumer's database (`None`: it cannot say), recorded on the rows it accepts.
    consumer_db: Option<Arc<str>>,
}

impl Session {
    /// Connects to the consumer (retrying until `connect_deadline`) and opens a `Receive`
    /// stream on the connection ([`Session::start`]). A `stop` ends it as there.
    pub async fn open(
        link: &Link,
        window: usize,
        connect_deadline: Duration,
        ledger: &Ledger,
        stop: &Stop,
    ) -> Result<Session, RelayError> {
        let channel = tokio::select! {
            biased;
            () = stop.asked() => return Err(RelayError::Interrupted("connecting")),
            channel = crate::connect::channel(link, connect_deadline) => channel?,
        };
        Session::start(channel, link, window, ledger, stop).await
    }

    /// Opens a `Receive` stream with room for `window` envelopes on `channel`. The consumer
    /// has `link.answer_timeout` to answer the opening; a stopped consumer fails it instead of
    /// hanging it. Before the stream opens, the consumer's database identity is checked
    /// against what producer.db recorded as accepted ([`crate::identity`]): what it lost is
    /// sent again. `run` calls it between passes only (no mark of another stream in flight).
    /// A `stop` ends the waits on the consumer with [`RelayError::Interrupted`], never the
    /// judgement's write ([`crate::identity::judge`]).
    pub async fn start(
        channel: Channel,
        link: &Link,
        window: usize,
        ledger: &Ledger,
        stop: &Stop,
    ) -> Result<Session, RelayError> {
        let mut judged = Judged::default();
        let consumer_db = crate::identity::judge(channel.clone(), ledger, link, &mut judged, stop).await?;
        let (outbound, rx) = mpsc::channel(window.max(1));
        let mut client =
            ConsumerClient::with_interceptor(channel.clone(), SendToken::new(link.token.as_deref()));
        let opened = tokio::select! {
            biased;
            () = stop.asked() => return Err(RelayError::Interrupted("opening the stream")),
            opened = tokio::time::timeout(link.answer_timeout, client.receive(ReceiverStream::new(rx))) => opened,
        }
        .map_err(|_| RelayError::Unresponsive(link.answer_timeout))?;
        let answers = opened.map_err(|s| RelayError::Stream(s.to_string()))?.into_inner();
        Ok(Session {
            outbound,
            answers,
            channel,
            identified_at: Instant::now(),
            last_sent: Instant::now(),
            judged,
            consumer_db: consumer_db.map(Arc::from),
        })
    }

    /// The consumer database this stream's consumer answered for (`None`: it cannot say).
    pub fn consumer_db(&self) -> Option<Arc<str>> {
        self.consumer_db.clone()
    }

    /// The leases judged against this stream's consumer (see [`crate::identity`]).
    pub fn judged(&self) -> &Judged {
        &self.judged
    }

    /// Between passes (`run` under leases): judges the leases taken since the last judgement
    /// (a dead relay's partitions taken over, a share gained by rebalancing) against the
    /// consumer, so their rows are sent on this stream only once what it lacks of them was
    /// sent again. Asks the consumer nothing when no lease is new.
    pub async fn judge_new(&mut self, link: &Link, ledger: &Ledger, stop: &Stop) -> Result<(), RelayError> {
        if ledger.unjudged(&mut self.judged).is_none_or(|new| new.is_empty()) {
            return Ok(());
        }
        self.identified_at = Instant::now();
        self.consumer_db = crate::identity::judge(self.channel.clone(), ledger, link, &mut self.judged, stop)
            .await?
            .map(Arc::from);
        Ok(())
    }

    /// While idle (`run`): checks the consumer's identity again, at most once per
    /// [`crate::identity::IDLE_RECHECK`], so a consumer restarted on a restored or recreated
    /// database is noticed even when no row is left to send (the stream would only fail on
    /// the next send).
    pub async fn recheck_identity(
        &mut self,
        link: &Link,
        ledger: &Ledger,
        stop: &Stop,
    ) -> Result<(), RelayError> {
        if self.identified_at.elapsed() < crate::identity::IDLE_RECHECK {
            return Ok(());
        }
        self.identified_at = Instant::now();
        // Every lease is judged again against whatever database answers now.
        self.judged = Judged::default();
        self.consumer_db = crate::identity::judge(self.channel.clone(), ledger, link, &mut self.judged, stop)
            .await?
            .map(Arc::from);
        Ok(())
    }

    /// Hands one envelope to the stream (never blocks while fewer than `window` are in flight).
    pub async fn send(&mut self, envelope: pb::EventEnvelope) -> Result<(), RelayError> {
        self.last_sent = Instant::now();
        self.outbound.send(envelope).await.map_err(|_| RelayError::Stream("the stream closed".into()))
    }

    /// How long the stream has carried nothing. The consumer ends a stream idle for longer
    /// than its `--idle-stream-timeout-ms`, so `run` renews an idle one before that happens
    /// instead of finding it ended (and warning) on the next send.
    pub fn idle_for(&self) -> std::time::Duration {
        self.last_sent.elapsed()
    }

    /// The next answer. Cancel-safe (`Streaming::message` keeps a partial message buffered),
    /// so it can race against timers.
    pub async fn answer(&mut self) -> Result<pb::ReceiveResult, RelayError> {
        Self::read(self.answers.message().await)
    }

    /// The next answer if it has already arrived, without waiting.
    pub fn answer_now(&mut self) -> Option<Result<pb::ReceiveResult, RelayError>> {
        futures::FutureExt::now_or_never(self.answers.message()).map(Self::read)
    }

    fn read(
        message: Result<Option<pb::ReceiveResult>, tonic::Status>,
    ) -> Result<pb::ReceiveResult, RelayError> {
        match message {
            Ok(Some(answer)) => Ok(answer),
            Ok(None) => Err(RelayError::Stream("the consumer ended the stream early".into())),
            Err(status) => Err(RelayError::Stream(status.to_string())),
        }
    }
}
