//! The relay against a consumer that stops answering (SIGSTOP) and a consumer backlog that
//! stays full: every mode reconnects or exits within a bound, every mode ends on SIGTERM
//! within its grace, and nothing is lost: after SIGCONT, `run` delivers everything.

use std::time::{Duration, Instant};

use harness::background::{RelayDaemon, poll, wait_for};
use harness::{Consumer, Producer, Target, Workdir, db, relay};
use proto::pb::AdvanceOutcome;

const EXIT: Duration = Duration::from_secs(30);
/// Debug logs of the relay only: the per-send and per-retry lines the tests wait on.
const RELAY_DEBUG: (&str, &str) = ("RUST_LOG", "info,relay=debug");

async fn commit(producer: &Producer, flow: &str, steps: usize) {
    for r in producer.advance_steps(flow, 0, &vec![1; steps]).await {
        assert_eq!(AdvanceOutcome::try_from(r.outcome), Ok(AdvanceOutcome::Committed), "{r:?}");
    }
}

fn all_accepted(path: &Target) -> Option<()> {
    db::outbox(path).iter().all(|r| r.accepted).then_some(())
}

/// `(accepted, attempts, last_outcome)` of one outbox row.
fn sends(path: &Target, id: &str) -> (bool, u64, Option<String>) {
    let row = db::outbox_row(path, id).unwrap_or_else(|| panic!("no outbox row {id}"));
    (row.accepted, row.attempts, row.last_outcome)
}

fn log_has(daemon: &RelayDaemon, text: &str, times: usize) -> Option<()> {
    (daemon.log_text().matches(text).count() >= times).then_some(())
}

/// A consumer stopped before the relay starts: `once`, `send` and `drain` give up with exit 1
/// and one line once the answer timeout passes; nothing is marked; after SIGCONT, drain
/// delivers everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_shot_modes_give_up_on_a_stopped_consumer() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer = Consumer::start(&work, false, &[]);
    commit(&producer, "A", 2).await;
    let url = consumer.process.url();
    let frozen = consumer.process.freeze();
    for mode in [&["once"][..], &["send", "--event-id", "A2"], &["drain"]] {
        let mut args = mode.to_vec();
        args.extend(["--answer-timeout-ms", "500"]);
        let run = relay(&producer.db, &url, &args, &[]);
        assert_eq!(run.code, Some(1), "{mode:?}: {run:?}");
        let errors: Vec<_> = run.stderr.lines().filter(|l| l.starts_with("relay: error:")).collect();
        assert_eq!(errors.len(), 1, "{mode:?}: {}", run.stderr);
        assert!(errors[0].contains("consumer stopped answering"), "{mode:?}: {}", run.stderr);
        assert!(db::outbox(&producer.db).iter().all(|r| !r.accepted));
    }
    frozen.resume();
    let run = relay(&producer.db, &url, &["drain"], &[]);
    assert_eq!((run.code, run.outcomes()), (Some(0), vec!["ACCEPTED".to_owned(); 2]), "{run:?}");
}

/// SIGTERM ends every one-shot mode while the consumer is stopped, long before the answer
/// timeout (ten minutes here) could: exit 1 with one line saying it was stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_one_shot_modes_whatever_the_consumer_does() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer = Consumer::start(&work, false, &[]);
    commit(&producer, "A", 1).await;
    let url = consumer.process.url();
    let _frozen = consumer.process.freeze();
    for (i, mode) in [&["once"][..], &["send", "--event-id", "A1"], &["drain"]].into_iter().enumerate() {
        let mut args = mode.to_vec();
        args.extend(["--answer-timeout-ms", "600000", "--shutdown-grace-ms", "500"]);
        let daemon =
            RelayDaemon::start_mode(work.dir.path(), &format!("relay-{i}"), &producer.db, &url, &args, &[]);
        // Past opening producer.db, it is on its way to (or stuck at) the consumer.
        wait_for(EXIT, || log_has(&daemon, "producer database open", 1), || daemon.log_text());
        let run = daemon.terminate(EXIT);
        assert_eq!(run.code, Some(1), "{mode:?}: {run:?}");
        assert!(run.stderr.contains("relay: error: stopped by a signal before"), "{mode:?}: {}", run.stderr);
    }
    assert!(!sends(&producer.db, "A1").0);
}

/// `run` with rows in flight to a consumer that stops: the oldest unanswered envelope times
/// out, the failure is logged once while reconnects keep failing with backoff, the unanswered
/// send is counted on its row; after SIGCONT everything is delivered, and SIGTERM exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_mode_reconnects_after_a_stopped_consumer_and_delivers_everything() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer = Consumer::start(&work, false, &[]);
    let daemon = RelayDaemon::start(
        work.dir.path(),
        "relay-run",
        &producer.db,
        &consumer.process.url(),
        &["--poll-ms", "20", "--max-backoff-ms", "200", "--answer-timeout-ms", "500"],
        &[RELAY_DEBUG],
    );
    commit(&producer, "A", 1).await;
    wait_for(EXIT, || all_accepted(&producer.db), || format!("{:?}", db::outbox(&producer.db)));
    let frozen = consumer.process.freeze();
    commit(&producer, "B", 1).await;
    wait_for(EXIT, || log_has(&daemon, "consumer stopped answering", 1), || daemon.log_text());
    // The send that got no answer is counted; the row stays unaccepted.
    assert_eq!(sends(&producer.db, "B1"), (false, 1, Some("NO_ANSWER".to_owned())));
    // Reconnects keep failing while it is stopped: logged at debug, the warning stays single.
    wait_for(EXIT, || log_has(&daemon, "consumer still failing", 3), || daemon.log_text());
    let log = daemon.log_text();
    assert_eq!(log.matches("WARN").count(), 1, "{log}");
    frozen.resume();
    commit(&producer, "C", 2).await;
    wait_for(EXIT, || all_accepted(&producer.db), || format!("{:?}", db::outbox(&producer.db)));
    let run = daemon.terminate(EXIT);
    assert_eq!(run.code, Some(0), "{run:?}");
    assert!(run.outcomes().iter().all(|o| o == "ACCEPTED" || o == "DUPLICATE"), "{:?}", run.outcomes());
    assert!(sends(&producer.db, "B1").1 >= 2);
    assert_eq!(consumer.apply("C").await.applied, 2);
}

/// SIGTERM while rows are in flight to a stopped consumer: `run` waits the shutdown grace
/// for their answers, not the (ten-minute) answer timeout, exits 0, and counts the sends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_run_mode_within_the_grace_with_rows_in_flight() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer = Consumer::start(&work, false, &[]);
    let daemon = RelayDaemon::start(
        work.dir.path(),
        "relay-run",
        &producer.db,
        &consumer.process.url(),
        &["--poll-ms", "20", "--answer-timeout-ms", "600000", "--shutdown-grace-ms", "500"],
        &[RELAY_DEBUG],
    );
    commit(&producer, "A", 1).await;
    wait_for(EXIT, || all_accepted(&producer.db), || format!("{:?}", db::outbox(&producer.db)));
    let _frozen = consumer.process.freeze();
    commit(&producer, "B", 1).await;
    wait_for(EXIT, || log_has(&daemon, "event_id=B1", 1), || daemon.log_text());
    let run = daemon.terminate(EXIT);
    assert_eq!(run.code, Some(0), "{run:?}");
    assert!(run.stderr.contains("shutdown grace over"), "{}", run.stderr);
    assert_eq!(sends(&producer.db, "B1"), (false, 1, Some("NO_ANSWER".to_owned())));
}

/// A full consumer backlog is back-pressure: `drain` waits (and says so) while the consumer
/// makes progress, and finishes with exit 0 once everything fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_waits_on_a_full_backlog_while_it_makes_progress() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer = Consumer::start_with(&work, &["--max-pending", "2"]);
    for flow in ["F1-", "F2-", "F3-", "F4-", "F5-"] {
        commit(&producer, flow, 1).await;
    }
    let daemon = RelayDaemon::start_mode(
        work.dir.path(),
        "relay-drain",
        &producer.db,
        &consumer.process.url(),
        &["drain", "--max-stall-ms", "600000"],
        &[],
    );
    wait_for(EXIT, || log_has(&daemon, "consumer backlog full: waiting", 1), || daemon.log_text());
    // An operator applies now and then; the relay picks up the room each time.
    let mut daemon = daemon;
    let until = Instant::now() + EXIT;
    while daemon.is_running() && Instant::now() < until {
        consumer.apply_all(0).await;
        // A pause between polls of the relay's state, not a guess at how long it takes.
        poll(Duration::from_millis(50), || (!daemon.is_running()).then_some(()));
    }
    let run = daemon.wait(EXIT);
    assert_eq!(run.code, Some(0), "{run:?}");
    let counts = &run.summary()["counts"];
    assert_eq!(counts["ACCEPTED"], 5, "{counts}");
    assert!(counts["BACKLOG_FULL"].as_u64().unwrap_or(0) > 0, "{counts}");
    assert_eq!(run.summary()["left_unaccepted"], 0);
    assert!(all_accepted(&producer.db).is_some());
}

/// No progress at all (nothing accepted, no fewer rows deferred) for `--max-stall-ms` ends
/// `drain` with exit 1 and one line; the deferred rows stay unaccepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_gives_up_loudly_when_a_full_backlog_never_moves() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer = Consumer::start_with(&work, &["--max-pending", "2"]);
    for flow in ["F1-", "F2-", "F3-", "F4-"] {
        commit(&producer, flow, 1).await;
    }
    let run = relay(&producer.db, &consumer.process.url(), &["drain", "--max-stall-ms", "1000"], &[]);
    assert_eq!(run.code, Some(1), "{run:?}");
    let errors: Vec<_> = run.stderr.lines().filter(|l| l.starts_with("relay: error:")).collect();
    assert_eq!(errors.len(), 1, "{}", run.stderr);
    assert!(errors[0].contains("consumer backlog full: 2 rows still deferred"), "{}", run.stderr);
    assert_eq!(db::outbox(&producer.db).iter().filter(|r| r.accepted).count(), 2);
}

/// A consumer from the future (test code only): answers every envelope with one fixed outcome
/// number, as a newer or broken consumer would.
struct AnswersWith(i32);

#[tonic::async_trait]
impl proto::pb::consumer_server::Consumer for AnswersWith {
    type ReceiveStream = std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<proto::pb::ReceiveResult, tonic::Status>> + Send>,
    >;

    async fn receive(
        &self,
        request: tonic::Request<tonic::Streaming<proto::pb::EventEnvelope>>,
    ) -> Result<tonic::Response<Self::ReceiveStream>, tonic::Status> {
        use futures::StreamExt as _;
        let outcome = self.0;
        let answers = request.into_inner().map(move |envelope| {
            envelope.map(|e| proto::pb::ReceiveResult {
                event_id: e.event_id,
                outcome,
                detail: String::new(),
                inbox_position: 0,
            })
        });
        Ok(tonic::Response::new(Box::pin(answers)))
    }

    async fn identify(
        &self,
        _: tonic::Request<proto::pb::IdentifyRequest>,
    ) -> Result<tonic::Response<proto::pb::IdentifyResponse>, tonic::Status> {
        // Like a build from before database identities: the relay goes on without the check.
        Err(tonic::Status::unimplemented("test double"))
    }

    async fn apply(
        &self,
        _: tonic::Request<proto::pb::ApplyRequest>,
    ) -> Result<tonic::Response<proto::pb::ApplyResult>, tonic::Status> {
        Err(tonic::Status::unimplemented("test double"))
    }

    async fn apply_all(
        &self,
        _: tonic::Request<proto::pb::ApplyAllRequest>,
    ) -> Result<tonic::Response<proto::pb::ApplyAllResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("test double"))
    }

    async fn get_flow(
        &self,
        _: tonic::Request<proto::pb::GetFlowRequest>,
    ) -> Result<tonic::Response<proto::pb::ConsumerFlow>, tonic::Status> {
        Err(tonic::Status::unimplemented("test double"))
    }

    async fn list_stuck(
        &self,
        _: tonic::Request<proto::pb::ListStuckRequest>,
    ) -> Result<tonic::Response<proto::pb::ListStuckResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("test double"))
    }
}

/// An answer the relay does not understand (an unknown number, or UNSPECIFIED) leaves the
/// row unaccepted, holds its flow back, and shows in the summary and the exit code (4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_not_understood_fail_the_exit_code() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    commit(&producer, "A", 2).await;
    commit(&producer, "B", 1).await;
    for (outcome, word) in [(99, "UNKNOWN_99"), (0, "UNSPECIFIED")] {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(proto::pb::consumer_server::ConsumerServer::new(AnswersWith(outcome)))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let (db_path, url2) = (producer.db.clone(), url.clone());
        let run =
            tokio::task::spawn_blocking(move || relay(&db_path, &url2, &["drain", "--window", "1"], &[]))
                .await
                .expect("relay thread");
        server.abort();
        assert_eq!(run.code, Some(4), "{run:?}");
        // A2 is never sent: A is held back after A1's answer.
        assert_eq!(run.outcomes(), [word, word], "{run:?}");
        assert_eq!(run.summary()["left_unaccepted"], 2);
        assert_eq!(run.summary()["counts"][word], 2);
        assert_eq!(sends(&producer.db, "A1").2.as_deref(), Some(word));
        assert!(db::outbox(&producer.db).iter().all(|r| !r.accepted));
        assert!(run.stderr.contains("flow held back"), "{}", run.stderr);
    }
}

/// A consumer built before inbox probes (test code only): it identifies its database and its
/// highest inbox position but leaves `probes_held` empty; it accepts every envelope at the
/// next position. `highest` is what a restore sets back.
#[derive(Clone, Default)]
struct WithoutProbes {
    highest: std::sync::Arc<std::sync::atomic::AtomicU64>,
    received: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

#[tonic::async_trait]
impl proto::pb::consumer_server::Consumer for WithoutProbes {
    type ReceiveStream = std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<proto::pb::ReceiveResult, tonic::Status>> + Send>,
    >;

    async fn receive(
        &self,
        request: tonic::Request<tonic::Streaming<proto::pb::EventEnvelope>>,
    ) -> Result<tonic::Response<Self::ReceiveStream>, tonic::Status> {
        use futures::StreamExt as _;
        let me = self.clone();
        let answers = request.into_inner().map(move |envelope| {
            envelope.map(|e| {
                let position = me.highest.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                me.received.lock().expect("test double's lock").push(e.event_id.clone());
                proto::pb::ReceiveResult {
                    event_id: e.event_id,
                    outcome: proto::pb::ReceiveOutcome::Accepted as i32,
                    detail: String::new(),
                    inbox_position: position,
                }
            })
        });
        Ok(tonic::Response::new(Box::pin(answers)))
    }

    async fn identify(
        &self,
        _: tonic::Request<proto::pb::IdentifyRequest>,
    ) -> Result<tonic::Response<proto::pb::IdentifyResponse>, tonic::Status> {
        Ok(tonic::Response::new(proto::pb::IdentifyResponse {
            database_id: "an-older-build".into(),
            highest_inbox_position: self.highest.load(std::sync::atomic::Ordering::SeqCst),
            probes_held: Vec::new(),
        }))
    }

    async fn apply(
        &self,
        _: tonic::Request<proto::pb::ApplyRequest>,
    ) -> Result<tonic::Response<proto::pb::ApplyResult>, tonic::Status> {
        Err(tonic::Status::unimplemented("test double"))
    }

    async fn apply_all(
        &self,
        _: tonic::Request<proto::pb::ApplyAllRequest>,
    ) -> Result<tonic::Response<proto::pb::ApplyAllResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("test double"))
    }

    async fn get_flow(
        &self,
        _: tonic::Request<proto::pb::GetFlowRequest>,
    ) -> Result<tonic::Response<proto::pb::ConsumerFlow>, tonic::Status> {
        Err(tonic::Status::unimplemented("test double"))
    }

    async fn list_stuck(
        &self,
        _: tonic::Request<proto::pb::ListStuckRequest>,
    ) -> Result<tonic::Response<proto::pb::ListStuckResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("test double"))
    }
}

/// A consumer that answers no probes (an older build) is judged as before probes existed, by
/// its highest inbox position, with a warning: restored to position 1, it gets the two rows
/// recorded above it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_without_probe_answers_is_judged_by_its_highest_position() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer = WithoutProbes::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(proto::pb::consumer_server::ConsumerServer::new(consumer.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let drain = |url: String, db: Target| {
        tokio::task::spawn_blocking(move || relay(&db, &url, &["drain", "--window", "1"], &[]))
    };
    commit(&producer, "A", 3).await;
    let first = drain(url.clone(), producer.db.clone()).await.expect("relay thread");
    assert_eq!(first.code, Some(0), "{first:?}");
    // Nothing was recorded before: nothing to probe, no warning.
    assert!(!first.stderr.contains("does not answer inbox probes"), "{}", first.stderr);
    assert_eq!(consumer.received.lock().expect("lock").clone(), ["A1", "A2", "A3"]);

    // Restored to position 1 (A2 and A3 lost), with new work waiting.
    consumer.highest.store(1, std::sync::atomic::Ordering::SeqCst);
    commit(&producer, "B", 1).await;
    let second = drain(url, producer.db.clone()).await.expect("relay thread");
    server.abort();
    assert_eq!(second.code, Some(0), "{second:?}");
    assert!(second.stderr.contains("does not answer inbox probes"), "{}", second.stderr);
    let loud: Vec<&str> = second
        .stderr
        .lines()
        .filter(|l| l.contains("CONSUMER DATABASE RESTORED FROM AN OLDER COPY"))
        .collect();
    assert_eq!(loud.len(), 1, "{}", second.stderr);
    assert!(loud[0].contains("rows=2"), "{}", second.stderr);
    let mut again = consumer.received.lock().expect("lock")[3..].to_vec();
    again.sort();
    assert_eq!(again, ["A2", "A3", "B1"]);
    assert!(all_accepted(&producer.db).is_some());
}

/// SQLite: another connection holds `path`'s write lock now (a `BEGIN IMMEDIATE` that does not
/// wait fails with `SQLITE_BUSY`). PostgreSQL: a session of the database sleeps in
/// [`SLOW_UNMARK`]'s trigger.
fn unmark_in_progress(target: &Target) -> Option<()> {
    match target {
        Target::Sqlite(path) => {
            let conn = rusqlite::Connection::open(path).ok()?;
            conn.busy_timeout(Duration::ZERO).ok()?;
            match conn.execute_batch("BEGIN IMMEDIATE; ROLLBACK;") {
                Err(rusqlite::Error::SqliteFailure(e, _)) if e.code == rusqlite::ErrorCode::DatabaseBusy => {
                    Some(())
                }
                _ => None,
            }
        }
        Target::Postgres(url) => {
            let session = db::PgSession::connect(url, true).ok()?;
            let sleeping = session
                .run(|client| {
                    client
                        .query_one(
                            "SELECT count(*) FROM pg_stat_activity
                             WHERE datname = current_database() AND wait_event = 'PgSleep'",
                            &[],
                        )
                        .map(|row| row.get::<_, i64>(0))
                })
                .ok()?
                .ok()?;
            (sleeping > 0).then_some(())
        }
    }
}

/// A trigger that makes the relay's unmark of row `A1` take a while (seconds): on SQLite a
/// cross join of a 10 000-row table counted, on PostgreSQL `pg_sleep(3)`.
fn slow_unmark_sql(target: &Target) -> String {
    const WHEN: &str = "OLD.accepted = 1 AND NEW.accepted = 0 AND NEW.event_id = 'A1'";
    match target {
        Target::Sqlite(_) => format!(
            "CREATE TABLE slow_rows(x INTEGER);
             WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n WHERE x < 10000)
             INSERT INTO slow_rows SELECT x FROM n;
             CREATE TRIGGER slow_unmark AFTER UPDATE OF accepted ON outbox WHEN {WHEN}
             BEGIN SELECT count(*) FROM slow_rows a, slow_rows b; END;"
        ),
        Target::Postgres(_) => {
            let schema = db::Store::Producer.pg_schema();
            format!(
                "CREATE FUNCTION {schema}.slow_unmark() RETURNS trigger LANGUAGE plpgsql AS $body$
                 BEGIN
                     IF {WHEN} THEN PERFORM pg_sleep(3); END IF;
                     RETURN NEW;
                 END $body$;
                 CREATE TRIGGER slow_unmark AFTER UPDATE ON {schema}.outbox
                     FOR EACH ROW EXECUTE FUNCTION {schema}.slow_unmark();"
            )
        }
    }
}

/// SIGTERM while `run` marks unaccepted the rows a replaced consumer database lacks: the stop
/// ends the waits on the consumer, never that producer.db transaction once it began, so the
/// rows change together with their loud line and the run exits 0. (Before, the stop dropped
/// the judgement while SQLite went on and committed the unmark: the rows were unaccepted with
/// no line saying why, and no later judgement could say it, the rows being unaccepted by then.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_the_unmark_of_a_replaced_consumer_database_lets_it_finish_and_say_so() {
    let Some(mut work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer = Consumer::start(&work, false, &[]);
    commit(&producer, "A", 3).await;
    let first = relay(&producer.db, &consumer.process.url(), &["drain"], &[]);
    assert_eq!((first.code, first.outcomes()), (Some(0), vec!["ACCEPTED".to_owned(); 3]), "{first:?}");
    let producer_db = producer.db.clone();
    // Nothing else writes producer.db from here on: only the relay can hold its write lock.
    drop(producer);
    drop(consumer);
    let replaced_db = work.other_db("consumer-2.db");
    let replaced = Consumer::start_on(replaced_db, work.path("consumer-2.log"), false, &[]);
    db::execute(&producer_db, &slow_unmark_sql(&producer_db));

    let daemon = RelayDaemon::start(
        work.dir.path(),
        "relay-run",
        &producer_db,
        &replaced.process.url(),
        &["--poll-ms", "20"],
        &[],
    );
    wait_for(EXIT, || unmark_in_progress(&producer_db), || daemon.log_text());
    let run = daemon.terminate(EXIT);
    assert_eq!(run.code, Some(0), "{run:?}");
    for id in ["A1", "A2", "A3"] {
        assert_eq!(sends(&producer_db, id), (false, 1, Some("LOST_BY_CONSUMER".to_owned())), "{id}");
    }
    let loud: Vec<&str> = run.stderr.lines().filter(|l| l.contains("CONSUMER DATABASE REPLACED")).collect();
    assert_eq!(loud.len(), 1, "{}", run.stderr);
    assert!(loud[0].contains("rows=3"), "{}", run.stderr);
}
