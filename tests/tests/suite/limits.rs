//! Bounded resources over real processes: a flood of connections and idle streams (Receive
//! with the token, health Watch without it) fills the server's caps exactly and no further
//! (the connection over the cap is closed, the stream over the cap is RESOURCE_EXHAUSTED),
//! its resident memory is measured before, at the caps and after each burst, and falls back
//! within a stated bound; idle streams and idle connections are ended by the server.

use std::time::Duration;

use harness::{Consumer, Producer, Workdir};
use proto::pb;
use proto::pb::consumer_client::ConsumerClient;
use tokio::io::AsyncReadExt as _;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Request, Streaming};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

const TOKEN: &str = "flood-token";
/// How long the server may take to free what a burst held (the trim waits 1 s of quiet).
const SETTLE_DEADLINE: Duration = Duration::from_secs(30);
/// The bound this test states for memory after a burst: resident memory at most this many
/// KiB above what the server used before its first burst. (It is a sanity bound: without the
/// caps and the trim, one such burst left the consumer 460 MB larger for ever.)
const AFTER_BURST_SLACK_KB: u64 = 8 * 1024;

/// Resident memory of `pid` in KiB (`VmRSS` of `/proc/PID/status`).
fn rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc/PID/status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

fn with_token<T>(message: T) -> Request<T> {
    let mut request = Request::new(message);
    request.metadata_mut().insert("authorization", format!("Bearer {TOKEN}").parse().expect("ascii header"));
    request
}

async fn channel(url: &str) -> Result<Channel, tonic::transport::Error> {
    Channel::from_shared(url.to_owned()).expect("valid url").connect().await
}

async fn check(channel: &Channel) -> Result<(), tonic::Status> {
    HealthClient::new(channel.clone()).check(HealthCheckRequest { service: String::new() }).await.map(drop)
}

/// A health Watch stream, open once its first answer came.
async fn watch(channel: &Channel) -> Result<Streaming<HealthCheckResponse>, tonic::Status> {
    let mut stream = HealthClient::new(channel.clone())
        .watch(HealthCheckRequest { service: String::new() })
        .await?
        .into_inner();
    stream.message().await?;
    Ok(stream)
}

/// An open Receive stream that sends nothing (its sender is kept), open once the server
/// answered its headers.
struct IdleReceive {
    _send: mpsc::Sender<pb::EventEnvelope>,
    answers: Streaming<pb::ReceiveResult>,
}

async fn idle_receive(channel: &Channel) -> Result<IdleReceive, tonic::Status> {
    let (send, rx) = mpsc::channel(1);
    let answers =
        ConsumerClient::new(channel.clone()).receive(with_token(ReceiverStream::new(rx))).await?.into_inner();
    Ok(IdleReceive { _send: send, answers })
}

/// Everything one burst holds open.
struct Burst {
    channels: Vec<Channel>,
    receives: Vec<IdleReceive>,
    watches: Vec<Streaming<HealthCheckResponse>>,
}

/// Opens `connections` connections with `per_connection` idle Receive streams and as many
/// health Watch streams (no token) on each.
async fn open_burst(url: &str, connections: usize, per_connection: usize) -> Burst {
    let mut burst = Burst { channels: Vec::new(), receives: Vec::new(), watches: Vec::new() };
    for i in 0..connections {
        let channel = channel(url).await.unwrap_or_else(|e| panic!("connection {i}: {e}"));
        for _ in 0..per_connection {
            burst
                .receives
                .push(idle_receive(&channel).await.unwrap_or_else(|e| panic!("Receive on {i}: {e:?}")));
            burst.watches.push(watch(&channel).await.unwrap_or_else(|e| panic!("Watch on {i}: {e:?}")));
        }
        burst.channels.push(channel);
    }
    burst
}

/// Polls `probe` until it holds, or panics after `deadline` with the last value seen.
async fn wait_until<T: std::fmt::Debug>(
    what: &str,
    deadline: Duration,
    mut probe: impl AsyncFnMut() -> (bool, T),
) -> T {
    let mut last = None;
    let done = harness::background::poll_async(deadline, async || {
        let (done, seen) = probe().await;
        if done {
            return Some(seen);
        }
        last = Some(seen);
        None
    })
    .await;
    done.unwrap_or_else(|| panic!("{what}: not within {deadline:?}; last seen {last:?}"))
}

/// The consumer at its default caps (256 connections, 1024 streams), with a token: three
/// bursts of 256 connections × (2 idle Receive + 2 unauthenticated Watch) streams. Each
/// burst fills both caps exactly; one more connection is closed and one more call on an open
/// connection is RESOURCE_EXHAUSTED; once the burst is gone, new calls work again and the
/// server's memory falls back within the stated bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_fills_the_caps_exactly_and_memory_returns() {
    let Some(work) = Workdir::for_test() else { return };
    let token_file = work.path("token");
    std::fs::write(&token_file, TOKEN).expect("write token");
    let consumer = Consumer::start_with(&work, &["--token-file", &token_file.display().to_string()]);
    let pid = consumer.process.pid().expect("running");
    let url = consumer.process.url();
    let (max_connections, max_streams, per_connection) = (256, 1024, 2);
    assert_eq!(max_connections * per_connection * 2, max_streams, "the burst is sized to fill both caps");
    let before = rss_kb(pid);
    let mut figures = Vec::new();
    for round in 1..=3 {
        let burst = open_burst(&url, max_connections, per_connection).await;
        let at_caps = rss_kb(pid);
        // The stream cap: every further call is refused, whatever its service or token.
        let first = &burst.channels[0];
        let refused = check(first).await.expect_err("a call over --max-streams");
        assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
        let refused = idle_receive(first).await.err().expect("a Receive over --max-streams");
        assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
        // The connection cap: one more connection is closed before it serves anything.
        let extra = match channel(&url).await {
            Ok(extra) => check(&extra).await.expect_err("a call on a connection over --max-connections"),
            Err(_) => tonic::Status::unavailable("connect failed"),
        };
        assert_ne!(extra.code(), Code::ResourceExhausted, "the connection itself is refused: {extra:?}");
        wait_until("the refusal is logged", SETTLE_DEADLINE, async || {
            let log = consumer.process.log_text();
            (log.contains("connection refused: the server is at --max-connections"), ())
        })
        .await;
        // Every stream of the burst is still open and answered its first message.
        assert_eq!(burst.receives.len() + burst.watches.len(), max_streams);
        drop(burst);
        // The permits come back with the connections: a new connection serves a call.
        let _ = wait_until("a new connection serves after the burst", SETTLE_DEADLINE, async || {
            let result = match channel(&url).await {
                Ok(c) => check(&c).await.map_err(|s| s.code()),
                Err(_) => Err(Code::Unavailable),
            };
            (result.is_ok(), result)
        })
        .await;
        let after = wait_until("memory returns after the burst", SETTLE_DEADLINE, async || {
            let rss = rss_kb(pid);
            (rss <= before + AFTER_BURST_SLACK_KB, rss)
        })
        .await;
        figures.push((round, at_caps, after));
    }
    // The figures the README states (shown with --nocapture).
    for (round, at_caps, after) in &figures {
        println!(
            "consumer RSS: before {before} KiB, burst {round}: at caps {at_caps} KiB, after {after} KiB"
        );
    }
}

/// A stream without a message either way is ended UNAVAILABLE after the idle timeout (a
/// Receive stream and a health Watch alike), and a connection without a stream is closed;
/// both give their permits back.
#[tokio::test]
async fn idle_streams_and_connections_are_ended() {
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start_with(
        &work,
        &[
            "--max-streams",
            "2",
            "--max-connections",
            "2",
            "--idle-stream-timeout-ms",
            "300",
            "--idle-connection-timeout-ms",
            "300",
        ],
    );
    let url = consumer.process.url();
    // A TCP connection that never speaks is closed by the server (after its HTTP/2
    // SETTINGS frame, which it sends first).
    let mut silent = tokio::net::TcpStream::connect(&consumer.process.addr).await.expect("tcp connect");
    let mut seen = Vec::new();
    tokio::time::timeout(SETTLE_DEADLINE, silent.read_to_end(&mut seen))
        .await
        .expect("the server closes an idle connection")
        .ok();
    assert!(seen.len() < 1024, "only the server's preface came: {} bytes", seen.len());

    let c = channel(&url).await.expect("connect");
    let mut receive = idle_receive(&c).await.expect("Receive opens");
    let mut watching = watch(&c).await.expect("Watch opens");
    // Both permits are held: a third call is refused.
    assert_eq!(check(&c).await.expect_err("over the cap").code(), Code::ResourceExhausted);
    let ended = tokio::time::timeout(SETTLE_DEADLINE, receive.answers.message())
        .await
        .expect("the idle Receive stream is ended")
        .expect_err("ended with a status");
    assert_eq!(ended.code(), Code::Unavailable, "{ended:?}");
    assert!(ended.message().contains("idle"), "{ended:?}");
    let ended = tokio::time::timeout(SETTLE_DEADLINE, watching.message())
        .await
        .expect("the idle Watch stream is ended")
        .expect_err("ended with a status");
    assert_eq!(ended.code(), Code::Unavailable, "{ended:?}");
    // The permits came back: two calls run again.
    check(&c).await.expect("a call after the idle streams ended");
    let _again = idle_receive(&c).await.expect("a new Receive after the idle streams ended");
    // The Receive stream that was ended read nothing and stored nothing.
    assert!(consumer.list_stuck(0).await.flows.is_empty());
}

/// The producer has the same caps: with `--max-connections 1` a second connection is closed,
/// with `--max-streams 3` a fourth call is RESOURCE_EXHAUSTED while three Watch streams are
/// open, and Advance works once they are gone.
#[tokio::test]
async fn the_producer_caps_connections_and_streams() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start_with(&work, &["--max-connections", "1", "--max-streams", "3"]);
    let url = producer.process.url();
    let c = channel(&url).await.expect("connect");
    let watches = [
        watch(&c).await.expect("watch 1"),
        watch(&c).await.expect("watch 2"),
        watch(&c).await.expect("watch 3"),
    ];
    let mut client = pb::producer_client::ProducerClient::new(c.clone());
    let refused =
        client.advance(harness::advance("P", "P1", 0, "reserved", 1)).await.expect_err("over the cap");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    let second = match channel(&url).await {
        Ok(extra) => check(&extra).await.expect_err("a second connection over --max-connections 1"),
        Err(_) => tonic::Status::unavailable("connect failed"),
    };
    assert_ne!(second.code(), Code::ResourceExhausted, "{second:?}");
    drop(watches);
    let answer = wait_until("Advance runs once the streams are gone", SETTLE_DEADLINE, async || {
        let r = client.advance(harness::advance("P", "P1", 0, "reserved", 1)).await.map(|r| r.into_inner());
        (r.is_ok(), r.map_err(|s| s.code()))
    })
    .await
    .expect("answered");
    assert!(
        [pb::AdvanceOutcome::Committed as i32, pb::AdvanceOutcome::Existing as i32].contains(&answer.outcome),
        "{answer:?}"
    );
    // The refused Advance changed nothing: the flow is at seq 1 exactly.
    assert_eq!(answer.seq, 1);
}
