//! Faults an operator's machine causes under a running pipeline (producer, `relay run`,
//! `consumer --auto-apply`): a consumer.db whose storage fails and recovers, one deleted under
//! the running consumer, and one restored from an older copy. In every case the consumer says
//! so (health, one log line per state change) and, in the end, every committed event is
//! applied exactly once with no Apply call. A producer.db deleted or replaced under the
//! running producer makes it refuse every Advance, loudly.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use harness::background::{RelayDaemon, wait_for};
use harness::db;
use harness::proc::ServerProcess;
use harness::{Consumer, Producer, Target, Workdir};
use proto::pb::AdvanceOutcome;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

const DEADLINE: Duration = Duration::from_secs(60);

/// Starts `consumer --auto-apply` on `db`, listening on `listen` (a restarted consumer keeps
/// its address so the running relay finds it again).
fn start_consumer(db: &Target, listen: &str, log: PathBuf, env: &[(&str, &str)]) -> Consumer {
    let args: Vec<String> =
        ["--db", &db.arg(), "--listen", listen, "--auto-apply"].iter().map(|s| (*s).to_owned()).collect();
    // The address of a consumer killed a moment ago may still be taken: retry until free.
    let until = Instant::now() + DEADLINE;
    loop {
        match ServerProcess::try_start("consumer", &args, env, log.clone(), Duration::from_secs(10)) {
            Ok(process) => return Consumer { process, db: db.clone() },
            Err(e) if Instant::now() < until && e.contains("ddress") => continue,
            Err(e) => panic!("{e}"),
        }
    }
}

fn relay(work: &Workdir, producer: &Producer, url: &str) -> RelayDaemon {
    RelayDaemon::start(
        work.dir.path(),
        "relay-run",
        &producer.db,
        url,
        &["--poll-ms", "10", "--max-backoff-ms", "200"],
        &[],
    )
}

/// Commits the three steps of each flow `<prefix>0..n`.
async fn commit_flows(producer: &Producer, prefix: &str, n: usize) -> Vec<String> {
    let mut flows = Vec::new();
    for i in 0..n {
        let flow = format!("{prefix}{i}");
        for r in producer.advance_steps(&flow, 0, &[1, 1, 1]).await {
            assert_eq!(AdvanceOutcome::try_from(r.outcome), Ok(AdvanceOutcome::Committed), "{r:?}");
        }
        flows.push(flow);
    }
    flows
}

/// Waits until consumer.db holds exactly the effects of every event in producer.db's outbox
/// (each event id once, in seq order per flow) and every outbox row is accepted.
fn wait_every_event_applied_once(
    producer_db: &Target,
    consumer_db: &Target,
    relay: &RelayDaemon,
    consumer: &Consumer,
) {
    let committed: BTreeSet<String> = db::outbox(producer_db).into_iter().map(|r| r.event_id).collect();
    wait_for(
        DEADLINE,
        || {
            let effects = db::effects(consumer_db);
            let applied: BTreeSet<String> = effects.iter().map(|e| e.event_id.clone()).collect();
            let accepted = db::outbox(producer_db).iter().all(|r| r.accepted);
            (applied == committed && effects.len() == committed.len() && accepted).then_some(())
        },
        || {
            format!(
                "{} committed, {} effects, {} unaccepted; relay log:\n{}\nconsumer log:\n{}",
                committed.len(),
                db::effects(consumer_db).len(),
                db::outbox(producer_db).iter().filter(|r| !r.accepted).count(),
                relay.log_text(),
                consumer.process.log_text()
            )
        },
    );
    for p in db::projections(consumer_db) {
        assert_eq!((p.last_seq, p.state.as_str(), p.held), (3, "released", 0), "{p:?}");
    }
}

async fn health(url: &str, service: &str) -> Option<ServingStatus> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_owned()).ok()?.connect().await.ok()?;
    let answer =
        HealthClient::new(channel).check(HealthCheckRequest { service: service.into() }).await.ok()?;
    ServingStatus::try_from(answer.into_inner().status).ok()
}

/// Polls `service`'s health on `process` until it reports `want`, or panics with what it
/// reported last.
async fn wait_health_of(process: &ServerProcess, service: &str, want: ServingStatus) {
    let url = process.url();
    let mut last = None;
    let reached = harness::background::poll_async(DEADLINE, async || {
        last = health(&url, service).await;
        (last == Some(want)).then_some(())
    })
    .await;
    if reached.is_none() {
        panic!("{service} health never {want:?} (last {last:?}); log:\n{}", process.log_text());
    }
}

/// The consumer's [`wait_health_of`].
async fn wait_health(consumer: &Consumer, want: ServingStatus) {
    wait_health_of(&consumer.process, "ordered_events.v1.Consumer", want).await;
}

/// How the test makes consumer.db's storage fail.
enum Fault {
    /// A small tmpfs holding consumer.db, filled up by a ballast file and emptied again.
    Tmpfs { mount: PathBuf, ballast: PathBuf },
    /// The store's fault hook, armed through the consumer's environment: commits fail while
    /// the flag file exists. Used only where this machine cannot mount a filesystem.
    Hook { flag: PathBuf },
}

impl Fault {
    fn prepare(work: &Workdir) -> Fault {
        let mount = work.path("small-fs");
        std::fs::create_dir_all(&mount).expect("mount point");
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=8m", "tmpfs"])
            .arg(&mount)
            .status()
            .is_ok_and(|s| s.success());
        if mounted {
            Fault::Tmpfs { ballast: mount.join("ballast"), mount }
        } else {
            eprintln!("cannot mount a tmpfs here: using the store's fault hook instead");
            Fault::Hook { flag: work.path("storage-full") }
        }
    }

    fn consumer_db(&self, work: &Workdir) -> Target {
        match self {
            Fault::Tmpfs { mount, .. } => mount.join("consumer.db").into(),
            Fault::Hook { .. } => work.consumer_db(),
        }
    }

    fn producer_db(&self, work: &Workdir) -> Target {
        match self {
            Fault::Tmpfs { mount, .. } => mount.join("producer.db").into(),
            Fault::Hook { .. } => work.producer_db(),
        }
    }

    /// The environment of the process whose commits are to fail.
    fn env(&self) -> Vec<(&'static str, &str)> {
        match self {
            Fault::Tmpfs { .. } => Vec::new(),
            Fault::Hook { flag } => {
                vec![("ORDERED_EVENTS_FAULT_COMMIT_FAILS_WHILE", flag.to_str().expect("a UTF-8 temp path"))]
            }
        }
    }

    /// `log` has `line`: exactly once with the hook (one cause, however often the process
    /// retried); at least once on the tmpfs, where the failing write may change its words.
    fn assert_said_once(&self, log: &str, line: &str) {
        let said = log.matches(line).count();
        match self {
            Fault::Hook { .. } => assert_eq!(said, 1, "{log}"),
            Fault::Tmpfs { .. } => assert!(said >= 1, "{log}"),
        }
    }

    /// Storage starts failing: the tmpfs is filled to its last byte.
    fn start(&self) {
        match self {
            Fault::Tmpfs { ballast, .. } => {
                use std::io::Write;
                let mut file = std::fs::File::create(ballast).expect("ballast file");
                let block = vec![0u8; 64 * 1024];
                while file.write_all(&block).is_ok() {}
                while file.write_all(&block[..512]).is_ok() {}
                while file.write_all(&block[..1]).is_ok() {}
            }
            Fault::Hook { flag } => std::fs::write(flag, b"full").expect("fault flag"),
        }
    }

    /// Storage recovers.
    fn stop(&self) {
        let path = match self {
            Fault::Tmpfs { ballast, .. } => ballast,
            Fault::Hook { flag } => flag,
        };
        std::fs::remove_file(path).expect("remove the fault");
    }
}

impl Drop for Fault {
    fn drop(&mut self) {
        if let Fault::Tmpfs { mount, .. } = self {
            let _ = Command::new("umount").arg("-l").arg(mount).status();
        }
    }
}

/// consumer.db's storage fills up under load and then has room again: the consumer logs the
/// failing commits once, reports NOT_SERVING, returns to SERVING once it can commit, and
/// auto-apply applies everything the outage left, with no ApplyAll; every event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_whose_storage_fills_up_reports_it_and_recovers_without_losing_an_event() {
    harness::sqlite_only!(
        "fills the file system under consumer.db (a small tmpfs, or the SQLite store's commit-failure hook)"
    );
    let Some(work) = Workdir::for_test() else { return };
    let fault = Fault::prepare(&work);
    let consumer_db = fault.consumer_db(&work);
    let env = fault.env();
    let producer = Producer::start(&work, &[]);
    let consumer = start_consumer(&consumer_db, "127.0.0.1:0", work.path("consumer.log"), &env);
    let daemon = relay(&work, &producer, &consumer.process.url());
    commit_flows(&producer, "before", 10).await;
    wait_every_event_applied_once(&producer.db, &consumer_db, &daemon, &consumer);
    wait_health(&consumer, ServingStatus::Serving).await;

    fault.start();
    let during = tokio::spawn({
        let url = producer.process.url();
        async move {
            let mut client =
                proto::pb::producer_client::ProducerClient::new(harness::proc::connect(&url).await);
            for i in 0..40 {
                for (seq, kind) in ["reserved", "confirmed", "released"].iter().enumerate() {
                    let flow = format!("during{i}");
                    let req = harness::advance(&flow, &format!("{flow}-{}", seq + 1), seq as u64, kind, 1);
                    client.advance(req).await.expect("Advance");
                }
            }
        }
    });
    wait_health(&consumer, ServingStatus::NotServing).await;
    during.await.expect("advances during the fault");
    let log = consumer.process.log_text();
    fault.assert_said_once(&log, "consumer database cannot commit");

    fault.stop();
    wait_health(&consumer, ServingStatus::Serving).await;
    wait_every_event_applied_once(&producer.db, &consumer_db, &daemon, &consumer);
    let log = consumer.process.log_text();
    assert!(log.contains("consumer database commits again: health SERVING"), "{log}");
    assert_eq!(db::effects(&consumer_db).len(), 150);
}

/// producer.db's storage fills up and then has room again: every `Advance` meanwhile is
/// answered `INTERNAL` naming the full disk, with nothing of it written; the producer logs
/// the failing commits once per cause and reports `NOT_SERVING`, and returns to `SERVING` by
/// itself once it can commit (its probe writes a row: no caller has to try first). The
/// refused step then commits, and every event is delivered and applied once. Before, health
/// stayed `SERVING` throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_whose_storage_fills_up_reports_it_in_health_and_recovers() {
    harness::sqlite_only!(
        "fills the file system under producer.db (a small tmpfs, or the SQLite store's commit-failure hook)"
    );
    let Some(work) = Workdir::for_test() else { return };
    let fault = Fault::prepare(&work);
    let producer_db = fault.producer_db(&work);
    let env = fault.env();
    let producer = Producer::start_on(producer_db.clone(), work.path("producer.log"), &env);
    let consumer = start_consumer(&work.consumer_db(), "127.0.0.1:0", work.path("consumer.log"), &[]);
    let daemon = relay(&work, &producer, &consumer.process.url());
    commit_flows(&producer, "before", 5).await;
    wait_every_event_applied_once(&producer.db, &consumer.db, &daemon, &consumer);
    let service = "ordered_events.v1.Producer";
    wait_health_of(&producer.process, service, ServingStatus::Serving).await;

    // Whole flows until a step is refused (at once with the hook; on the tmpfs, once the
    // WAL must grow).
    fault.start();
    let mut client = producer.client().await;
    let mut refused = None;
    'flows: for i in 0..2000 {
        let flow = format!("during{i}");
        for (seq, kind) in ["reserved", "confirmed", "released"].iter().enumerate() {
            let req = harness::advance(&flow, &format!("{flow}-{}", seq + 1), seq as u64, kind, 1);
            match client.advance(req.clone()).await {
                Ok(answer) => {
                    let outcome = AdvanceOutcome::try_from(answer.into_inner().outcome);
                    assert_eq!(outcome, Ok(AdvanceOutcome::Committed), "{flow} seq {seq}");
                }
                Err(status) => {
                    assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
                    assert!(status.message().contains("disk is full"), "{status:?}");
                    refused = Some((flow, seq, req));
                    break 'flows;
                }
            }
        }
    }
    let (flow, seq, req) = refused.expect("a step refused while the file system is full");
    wait_health_of(&producer.process, service, ServingStatus::NotServing).await;
    let log = producer.process.log_text();
    fault.assert_said_once(&log, "producer database cannot commit");

    // Room again: health returns with no call made, and the refused step commits.
    fault.stop();
    wait_health_of(&producer.process, service, ServingStatus::Serving).await;
    let log = producer.process.log_text();
    assert!(log.contains("producer database commits again: health SERVING"), "{log}");
    assert!(!db::outbox(&producer.db).iter().any(|r| r.event_id == req.event_id), "{flow} seq {seq} written");
    let answer = client.advance(req).await.expect("the refused step, after the fault").into_inner();
    assert_eq!(AdvanceOutcome::try_from(answer.outcome), Ok(AdvanceOutcome::Committed), "{answer:?}");
    for r in producer.advance_steps(&flow, seq + 1, &vec![1; 2 - seq]).await {
        assert_eq!(AdvanceOutcome::try_from(r.outcome), Ok(AdvanceOutcome::Committed), "{r:?}");
    }
    wait_every_event_applied_once(&producer.db, &consumer.db, &daemon, &consumer);
}

/// producer.db's file system is full when `relay run` must record the consumer's answers:
/// the relay says so once and waits (its rows stay unaccepted, nothing is lost) instead of
/// exiting, and records them once there is room. Before, it exited at the first failed
/// mark (`relay: error: … database or disk is full`) and delivered nothing more until
/// restarted by hand. Needs a tmpfs: the commit-failure hook is the producer's, and the
/// relay's writes are its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_producer_database_fills_up_waits_and_then_records_its_answers() {
    harness::sqlite_only!("fills the file system under producer.db (a small tmpfs)");
    let Some(work) = Workdir::for_test() else { return };
    let fault = Fault::prepare(&work);
    if let Fault::Hook { .. } = fault {
        eprintln!(
            "SKIPPED: no tmpfs can be mounted here, and only a real full disk fails the relay's writes"
        );
        return;
    }
    let producer = Producer::start_on(fault.producer_db(&work), work.path("producer.log"), &[]);
    // Committed before the relay starts, so every answer comes after the disk is full.
    commit_flows(&producer, "early", 20).await;
    fault.start();
    let consumer = start_consumer(&work.consumer_db(), "127.0.0.1:0", work.path("consumer.log"), &[]);
    let mut daemon = relay(&work, &producer, &consumer.process.url());
    wait_for(
        DEADLINE,
        || daemon.log_text().contains("database or disk is full").then_some(()),
        || format!("the relay never met the full disk; its log:\n{}", daemon.log_text()),
    );
    // It goes on sending (after its backoff) what it could not record: the consumer stores
    // and applies every event, and the relay is still there.
    wait_for(
        DEADLINE,
        || (db::effects(&consumer.db).len() == 60).then_some(()),
        || format!("{} effects; relay log:\n{}", db::effects(&consumer.db).len(), daemon.log_text()),
    );
    assert!(daemon.is_running(), "the relay exited on a full disk:\n{}", daemon.log_text());
    let log = daemon.log_text();
    assert!(log.contains("producer database unavailable"), "{log}");
    assert!(!log.contains("relay: error"), "{log}");
    assert!(db::outbox(&producer.db).iter().any(|r| !r.accepted), "no mark failed");

    fault.stop();
    wait_every_event_applied_once(&producer.db, &consumer.db, &daemon, &consumer);
    assert!(daemon.is_running(), "{}", daemon.log_text());
}

/// consumer.db deleted under a running consumer: it stops accepting and says why instead of
/// writing to the unlinked file; restarted, it refuses to create a fresh database beside the
/// old one's -wal/-shm; once the operator removes them, it creates one, and the relay, seeing
/// another database id, sends everything again: in the end the new database holds every
/// committed event applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_database_deleted_under_the_consumer_is_refilled_by_the_relay() {
    harness::sqlite_only!("deletes consumer.db and its -wal/-shm sidecars under the running consumer");
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer_db = work.consumer_db();
    let mut consumer = start_consumer(&consumer_db, "127.0.0.1:0", work.path("consumer.log"), &[]);
    let addr = consumer.process.addr.clone();
    let daemon = relay(&work, &producer, &consumer.process.url());
    commit_flows(&producer, "old", 10).await;
    wait_every_event_applied_once(&producer.db, &consumer_db, &daemon, &consumer);

    // Only the database file goes; its -wal and -shm stay, as after a careless `rm`.
    std::fs::remove_file(consumer_db.file()).expect("delete consumer.db");
    commit_flows(&producer, "new", 5).await;
    wait_for(
        DEADLINE,
        || consumer.process.log_text().contains("was deleted under this running consumer").then_some(()),
        || consumer.process.log_text(),
    );
    wait_health(&consumer, ServingStatus::NotServing).await;
    assert!(!consumer_db.file().exists(), "nothing may recreate the file under the running consumer");
    consumer.process.kill();

    // A restart refuses to build a fresh database beside the old one's leftovers.
    let args: Vec<String> =
        ["--db", &consumer_db.arg(), "--listen", &addr].iter().map(|s| (*s).to_owned()).collect();
    let refused =
        ServerProcess::try_start("consumer", &args, &[], work.path("consumer-refused.log"), DEADLINE)
            .err()
            .expect("a consumer must not start on a deleted database's leftovers");
    assert!(refused.contains("remain: it was deleted or moved"), "{refused}");
    assert!(!consumer_db.file().exists(), "the refusing consumer created nothing");

    // The operator starts fresh deliberately; the relay sees another database and re-sends.
    for suffix in ["-wal", "-shm"] {
        let mut name = consumer_db.file().as_os_str().to_owned();
        name.push(suffix);
        let _ = std::fs::remove_file(PathBuf::from(name));
    }
    let consumer = start_consumer(&consumer_db, &addr, work.path("consumer-2.log"), &[]);
    wait_every_event_applied_once(&producer.db, &consumer_db, &daemon, &consumer);
    assert_eq!(db::effects(&consumer_db).len(), 45);
    let relay_log = daemon.log_text();
    assert!(relay_log.contains("CONSUMER DATABASE REPLACED"), "{relay_log}");
    assert!(relay_log.contains("rows=30"), "{relay_log}");
}

/// consumer.db restored from an older copy (taken while the consumer was stopped): the
/// relay sees a history that ends before positions it recorded, says so in one loud line,
/// and sends the lost rows again; every committed event ends applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_database_restored_from_an_older_copy_gets_the_lost_rows_again() {
    harness::sqlite_only!("copies consumer.db and its sidecars back over the live files");
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer_db = work.consumer_db();
    let mut consumer = start_consumer(&consumer_db, "127.0.0.1:0", work.path("consumer.log"), &[]);
    let addr = consumer.process.addr.clone();
    let daemon = relay(&work, &producer, &consumer.process.url());
    commit_flows(&producer, "kept", 10).await;
    wait_every_event_applied_once(&producer.db, &consumer_db, &daemon, &consumer);

    // The backup: the whole file set, taken while the consumer is stopped.
    assert_eq!(consumer.process.terminate(DEADLINE).code(), Some(0));
    let backup = work.path("backup");
    std::fs::create_dir_all(&backup).expect("backup dir");
    let files = |dir: &Path| -> Vec<PathBuf> {
        ["consumer.db", "consumer.db-wal", "consumer.db-shm"].iter().map(|f| dir.join(f)).collect()
    };
    let live_dir = consumer_db.file().parent().expect("consumer.db has a directory").to_owned();
    for (live, copy) in files(&live_dir).iter().zip(files(&backup)) {
        if live.exists() {
            std::fs::copy(live, copy).expect("back up");
        }
    }
    let mut consumer = start_consumer(&consumer_db, &addr, work.path("consumer-2.log"), &[]);
    commit_flows(&producer, "lost", 10).await;
    wait_every_event_applied_once(&producer.db, &consumer_db, &daemon, &consumer);
    assert_eq!(consumer.process.terminate(DEADLINE).code(), Some(0));

    // Restore: the live file set is replaced by the older copy.
    for (live, copy) in files(&live_dir).iter().zip(files(&backup)) {
        let _ = std::fs::remove_file(live);
        if copy.exists() {
            std::fs::copy(copy, live).expect("restore");
        }
    }
    let consumer = start_consumer(&consumer_db, &addr, work.path("consumer-3.log"), &[]);
    wait_every_event_applied_once(&producer.db, &consumer_db, &daemon, &consumer);
    assert_eq!(db::effects(&consumer_db).len(), 60);
    let relay_log = daemon.log_text();
    assert!(relay_log.contains("CONSUMER DATABASE RESTORED FROM AN OLDER COPY"), "{relay_log}");
    assert!(relay_log.contains("rows=30"), "{relay_log}");
}

/// The server's maintenance database beside a test database, and the test database's name:
/// statements about a database (refusing connections, ending sessions) run from there.
fn pg_admin(target: &Target) -> (Target, String) {
    let Target::Postgres(url) = target else { panic!("{target} is not a PostgreSQL database") };
    let path = url.split('?').next().unwrap_or(url);
    let name = path.rsplit('/').next().unwrap_or_default().to_owned();
    (Target::Postgres(proto::pg::testing::with_database(url, "postgres")), name)
}

/// Ends every session on the database `name` (run from the maintenance database).
fn terminate_sessions(admin: &Target, name: &str) {
    db::execute(
        admin,
        &format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = '{name}' AND pid <> pg_backend_pid()"
        ),
    );
}

/// The consumer's PostgreSQL database goes away under load (every session ended, new ones
/// refused, as when the server restarts or a failover is under way) and comes back: the
/// consumer says so once per cause, reports NOT_SERVING, returns to SERVING by itself, and
/// auto-apply applies everything the outage left; every event once, no Apply call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_whose_postgres_database_goes_away_reports_it_and_recovers_without_losing_an_event() {
    harness::postgres_only!("ends the consumer's PostgreSQL sessions and refuses new ones");
    let Some(mut work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    // A database of its own, so only the consumer loses its server.
    let consumer_db = work.other_db("consumer");
    let (admin, name) = pg_admin(&consumer_db);
    let consumer = start_consumer(&consumer_db, "127.0.0.1:0", work.path("consumer.log"), &[]);
    let daemon = relay(&work, &producer, &consumer.process.url());
    commit_flows(&producer, "before", 10).await;
    wait_every_event_applied_once(&producer.db, &consumer_db, &daemon, &consumer);
    wait_health(&consumer, ServingStatus::Serving).await;

    db::execute(&admin, &format!("ALTER DATABASE {name} WITH ALLOW_CONNECTIONS false"));
    terminate_sessions(&admin, &name);
    commit_flows(&producer, "during", 40).await;
    wait_health(&consumer, ServingStatus::NotServing).await;
    let log = consumer.process.log_text();
    assert!(log.contains("consumer database cannot commit"), "{log}");
    assert!(log.contains("not currently accepting connections"), "{log}");

    db::execute(&admin, &format!("ALTER DATABASE {name} WITH ALLOW_CONNECTIONS true"));
    wait_health(&consumer, ServingStatus::Serving).await;
    wait_every_event_applied_once(&producer.db, &consumer_db, &daemon, &consumer);
    let log = consumer.process.log_text();
    assert!(log.contains("consumer database commits again: health SERVING"), "{log}");
    assert_eq!(db::effects(&consumer_db).len(), 150);
}

/// The producer's PostgreSQL database goes away (every session ended, new ones refused) and
/// comes back: `Advance` is answered `UNAVAILABLE` meanwhile, and the producer says so once,
/// turns health `NOT_SERVING`, and returns to `SERVING` by itself (its probe), after which
/// the same call commits. Before, health stayed `SERVING` throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_whose_postgres_database_goes_away_reports_it_in_health_and_recovers() {
    harness::postgres_only!("ends the producer's PostgreSQL sessions and refuses new ones");
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let (admin, name) = pg_admin(&producer.db);
    let first = producer.advance(harness::advance("A", "A1", 0, "reserved", 1)).await;
    assert_eq!(AdvanceOutcome::try_from(first.outcome), Ok(AdvanceOutcome::Committed), "{first:?}");
    wait_health_of(&producer.process, "ordered_events.v1.Producer", ServingStatus::Serving).await;

    db::execute(&admin, &format!("ALTER DATABASE {name} WITH ALLOW_CONNECTIONS false"));
    terminate_sessions(&admin, &name);
    let step = || harness::advance("A", "A2", 1, "confirmed", 1);
    let refused =
        producer.client().await.advance(step()).await.expect_err("an Advance while the server is gone");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    wait_health_of(&producer.process, "ordered_events.v1.Producer", ServingStatus::NotServing).await;
    let log = producer.process.log_text();
    assert!(log.contains("producer database cannot commit"), "{log}");

    db::execute(&admin, &format!("ALTER DATABASE {name} WITH ALLOW_CONNECTIONS true"));
    wait_health_of(&producer.process, "ordered_events.v1.Producer", ServingStatus::Serving).await;
    let log = producer.process.log_text();
    assert!(log.contains("producer database commits again: health SERVING"), "{log}");
    // The same call commits now; a pooled connection the outage closed may still answer it
    // UNAVAILABLE first (retryable), never anything else.
    let mut unavailable = 0;
    let again = loop {
        match producer.client().await.advance(step()).await {
            Ok(answer) => break answer.into_inner(),
            Err(status) if status.code() == tonic::Code::Unavailable && unavailable < 8 => unavailable += 1,
            Err(status) => panic!("after {unavailable} UNAVAILABLE answers: {status:?}"),
        }
    };
    assert_eq!(AdvanceOutcome::try_from(again.outcome), Ok(AdvanceOutcome::Committed), "{again:?}");
}

/// How many lines of `log` say that `who`'s database cannot commit because it is read-only
/// (the test's ending of sessions may be said first, as a cause of its own).
fn said_read_only(log: &str, who: &str) -> usize {
    let cannot = format!("{who} database cannot commit");
    log.lines().filter(|l| l.contains(&cannot) && l.contains("the server takes no writes")).count()
}

/// The consumer's and then the producer's PostgreSQL databases turn read-only under a running
/// pipeline (as when their address leads to a standby after a failover: every new session is
/// read-only) and then take writes again, without any session being ended. While read-only,
/// each process says so once, naming the cause, and reports `NOT_SERVING`; `Advance` is
/// answered `UNAVAILABLE` (the caller did nothing wrong and may retry), never `INTERNAL`; the
/// relay waits, and cannot record answers in the read-only producer database. Afterwards
/// each returns to `SERVING` by itself (their probes open new sessions instead of asking the
/// read-only ones again), the relay records what it could not, the refused call commits, and
/// every committed event is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn databases_that_turn_read_only_under_the_pipeline_are_reported_and_then_written_again() {
    harness::postgres_only!("makes the producer's and the consumer's PostgreSQL databases read-only");
    let Some(mut work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let (admin, producer_name) = pg_admin(&producer.db);
    let consumer_db = work.other_db("consumer");
    let (_, consumer_name) = pg_admin(&consumer_db);
    let consumer = start_consumer(&consumer_db, "127.0.0.1:0", work.path("consumer.log"), &[]);
    let daemon = relay(&work, &producer, &consumer.process.url());
    commit_flows(&producer, "before", 5).await;
    wait_every_event_applied_once(&producer.db, &consumer_db, &daemon, &consumer);
    wait_health(&consumer, ServingStatus::Serving).await;
    let read_only = |name: &str| {
        db::execute(&admin, &format!("ALTER DATABASE {name} SET default_transaction_read_only = on"));
        terminate_sessions(&admin, name);
    };

    // The consumer's database first: what the relay delivers cannot be stored.
    read_only(&consumer_name);
    commit_flows(&producer, "during", 10).await;
    wait_health(&consumer, ServingStatus::NotServing).await;
    let log = consumer.process.log_text();
    assert_eq!(said_read_only(&log, "consumer"), 1, "{log}");

    // Then the producer's: every Advance is refused as unavailable.
    read_only(&producer_name);
    let step = || harness::advance("late", "late-1", 0, "reserved", 1);
    for _ in 0..3 {
        let refused = producer.client().await.advance(step()).await.expect_err("an Advance while read-only");
        assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    }
    wait_health_of(&producer.process, "ordered_events.v1.Producer", ServingStatus::NotServing).await;
    let log = producer.process.log_text();
    assert_eq!(said_read_only(&log, "producer"), 1, "{log}");

    // The consumer's database writable again (its read-only sessions left as they are): it
    // stores and applies what was committed meanwhile, and the relay cannot record that in
    // the read-only producer database: those rows stay unaccepted, to be marked later.
    let writable = |name: &str| {
        db::execute(&admin, &format!("ALTER DATABASE {name} RESET default_transaction_read_only"));
    };
    writable(&consumer_name);
    wait_health(&consumer, ServingStatus::Serving).await;
    wait_for(
        DEADLINE,
        || (db::effects(&consumer_db).len() == 3 * 15).then_some(()),
        || format!("effects {}; relay log:\n{}", db::effects(&consumer_db).len(), daemon.log_text()),
    );
    let unaccepted = db::outbox(&producer.db).iter().filter(|r| !r.accepted).count();
    assert_eq!(unaccepted, 3 * 10, "the 'during' rows stay unaccepted while producer.db is read-only");

    // Then the producer's: it serves again by itself, and the relay records the answers.
    writable(&producer_name);
    wait_health_of(&producer.process, "ordered_events.v1.Producer", ServingStatus::Serving).await;
    let mut unavailable = 0;
    let again = loop {
        match producer.client().await.advance(step()).await {
            Ok(answer) => break answer.into_inner(),
            Err(status) if status.code() == tonic::Code::Unavailable && unavailable < 8 => unavailable += 1,
            Err(status) => panic!("after {unavailable} UNAVAILABLE answers: {status:?}"),
        }
    };
    assert_eq!(AdvanceOutcome::try_from(again.outcome), Ok(AdvanceOutcome::Committed), "{again:?}");
    for r in producer.advance_steps("late", 1, &[1, 1]).await {
        assert_eq!(AdvanceOutcome::try_from(r.outcome), Ok(AdvanceOutcome::Committed), "{r:?}");
    }
    wait_every_event_applied_once(&producer.db, &consumer_db, &daemon, &consumer);
    assert_eq!(db::effects(&consumer_db).len(), 3 * 16);
    let log = consumer.process.log_text();
    assert!(log.contains("consumer database commits again: health SERVING"), "{log}");
}

/// The producer's PostgreSQL sessions are ended again and again while clients advance flows
/// (a server restart or a connection-killing proxy): each Advance is answered COMMITTED, or
/// UNAVAILABLE and then retried to COMMITTED/EXISTING; the relay reconnects on its own, and
/// every committed event ends applied once: nothing a client was told is committed is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_and_relay_sessions_killed_under_load_lose_nothing() {
    harness::postgres_only!("ends the producer's and relay's PostgreSQL sessions under load");
    let Some(mut work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let (admin, name) = pg_admin(&producer.db);
    let consumer_db = work.other_db("consumer");
    let consumer = start_consumer(&consumer_db, "127.0.0.1:0", work.path("consumer.log"), &[]);
    let daemon = relay(&work, &producer, &consumer.process.url());
    // Everything is up (the relay's start-up is not what this test ends sessions under).
    commit_flows(&producer, "warm", 1).await;
    wait_every_event_applied_once(&producer.db, &consumer_db, &daemon, &consumer);

    let clients: Vec<_> = (0..4)
        .map(|c| {
            let url = producer.process.url();
            tokio::spawn(async move {
                let mut client =
                    proto::pb::producer_client::ProducerClient::new(harness::proc::connect(&url).await);
                let mut unavailable = 0u32;
                for i in 0..25 {
                    let flow = format!("c{c}f{i}");
                    for (seq, kind) in ["reserved", "confirmed", "released"].iter().enumerate() {
                        let req =
                            harness::advance(&flow, &format!("{flow}-{}", seq + 1), seq as u64, kind, 1);
                        let deadline = Instant::now() + DEADLINE;
                        loop {
                            match client.advance(req.clone()).await {
                                Ok(answer) => {
                                    let outcome = AdvanceOutcome::try_from(answer.into_inner().outcome);
                                    assert!(
                                        matches!(
                                            outcome,
                                            Ok(AdvanceOutcome::Committed | AdvanceOutcome::Existing)
                                        ),
                                        "{flow} seq {seq}: {outcome:?}"
                                    );
                                    break;
                                }
                                Err(status) if status.code() == tonic::Code::Unavailable => {
                                    assert!(
                                        Instant::now() < deadline,
                                        "{flow}: unavailable for a minute: {status}"
                                    );
                                    unavailable += 1;
                                }
                                Err(status) => panic!("{flow} seq {seq}: {status}"),
                            }
                        }
                    }
                }
                unavailable
            })
        })
        .collect();
    // End the producer's and the relay's sessions until the clients are done (each round
    // waits for the clients to have moved on: a predicate, not a sleep).
    let mut rounds = 0;
    while clients.iter().any(|c| !c.is_finished()) {
        let before = db::outbox(&producer.db).len();
        terminate_sessions(&admin, &name);
        rounds += 1;
        let moved = harness::background::poll(DEADLINE, || {
            (db::outbox(&producer.db).len() > before + 10 || clients.iter().all(|c| c.is_finished()))
                .then_some(())
        });
        assert!(
            moved.is_some(),
            "no progress after ending the sessions; log:\n{}",
            producer.process.log_text()
        );
    }
    let mut unavailable = 0;
    for c in clients {
        unavailable += c.await.expect("client");
    }
    eprintln!(
        "{rounds} rounds of ended sessions; {unavailable} Advance calls answered UNAVAILABLE and retried"
    );
    assert!(rounds >= 2, "the sessions were ended only {rounds} times");
    assert_eq!(db::outbox(&producer.db).len(), 303);
    wait_every_event_applied_once(&producer.db, &consumer_db, &daemon, &consumer);
    assert_eq!(db::effects(&consumer_db).len(), 303);
}

/// The consumer's schema dropped under the running consumer (an operator's mistake): it stops
/// accepting and says why, and does not recreate the schema under itself; restarted, it
/// creates a fresh one, and the relay, seeing another database, sends everything again: in the
/// end the new schema holds every committed event applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_schema_dropped_under_the_consumer_is_refilled_by_the_relay() {
    harness::postgres_only!("drops the consumer's schema under the running consumer");
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer_db = work.consumer_db();
    let mut consumer = start_consumer(&consumer_db, "127.0.0.1:0", work.path("consumer.log"), &[]);
    let addr = consumer.process.addr.clone();
    let daemon = relay(&work, &producer, &consumer.process.url());
    commit_flows(&producer, "old", 10).await;
    wait_every_event_applied_once(&producer.db, &consumer_db, &daemon, &consumer);

    let schema = db::Store::Consumer.pg_schema();
    db::execute(&consumer_db, &format!("DROP SCHEMA {schema} CASCADE"));
    commit_flows(&producer, "new", 5).await;
    wait_health(&consumer, ServingStatus::NotServing).await;
    let log = consumer.process.log_text();
    assert!(log.contains("consumer database cannot commit"), "{log}");
    assert!(log.contains("does not exist"), "{log}");
    let schema_back = || {
        let Ok(db::Session::Postgres(session)) = db::try_open_ro(&consumer_db) else {
            panic!("open {consumer_db}")
        };
        let sql = format!("SELECT count(*) FROM information_schema.schemata WHERE schema_name = '{schema}'");
        session
            .run(move |client| {
                client.query_one(&sql, &[]).map(|r| r.get::<_, i64>(0)).map_err(|e| e.to_string())
            })
            .expect("session")
            .expect("query")
    };
    assert_eq!(schema_back(), 0, "nothing may recreate the schema under the running consumer");
    consumer.process.kill();

    let consumer = start_consumer(&consumer_db, &addr, work.path("consumer-2.log"), &[]);
    wait_every_event_applied_once(&producer.db, &consumer_db, &daemon, &consumer);
    assert_eq!(db::effects(&consumer_db).len(), 45);
    let relay_log = daemon.log_text();
    assert!(relay_log.contains("CONSUMER DATABASE REPLACED"), "{relay_log}");
    assert!(relay_log.contains("rows=30"), "{relay_log}");
}

/// A copy of the consumer's database taken while the consumer is stopped, and its restore
/// over the live one: the SQLite file set, or a PostgreSQL database made from it as a template
/// (the restored consumer then runs on that copy).
struct Backup {
    live: Target,
    copy: Target,
}

impl Backup {
    /// Copies `live` into `copy` (an empty database of the same backend; nothing may be
    /// connected to `live`).
    fn take(live: &Target, copy: Target) -> Backup {
        match (live, &copy) {
            (Target::Sqlite(from), Target::Sqlite(to)) => {
                for suffix in ["", "-wal", "-shm"] {
                    let (from, to) = (sidecar(from, suffix), sidecar(to, suffix));
                    if from.exists() {
                        std::fs::copy(&from, &to).expect("back up");
                    }
                }
            }
            (Target::Postgres(_), Target::Postgres(_)) => {
                let (admin, from) = pg_admin(live);
                let (_, to) = pg_admin(&copy);
                db::execute(&admin, &format!("DROP DATABASE {to}"));
                db::execute(&admin, &format!("CREATE DATABASE {to} TEMPLATE {from}"));
            }
            _ => panic!("one backend per test"),
        }
        Backup { live: live.clone(), copy }
    }

    /// The database a consumer restored from the copy runs on: on SQLite the live file set,
    /// replaced by the copy; on PostgreSQL the copy itself.
    fn restore(self) -> Target {
        match (&self.live, &self.copy) {
            (Target::Sqlite(live), Target::Sqlite(copy)) => {
                for suffix in ["", "-wal", "-shm"] {
                    let (live, copy) = (sidecar(live, suffix), sidecar(copy, suffix));
                    let _ = std::fs::remove_file(&live);
                    if copy.exists() {
                        std::fs::copy(&copy, &live).expect("restore");
                    }
                }
                self.live
            }
            _ => self.copy,
        }
    }
}

/// `file` with `suffix` appended to its name (`-wal`, `-shm`).
fn sidecar(file: &Path, suffix: &str) -> PathBuf {
    let mut name = file.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// Commits one `reserved` step on each flow `<prefix>0..n` over one client; returns the event
/// ids.
async fn commit_singles(producer: &Producer, prefix: &str, n: usize) -> Vec<String> {
    let mut client = producer.client().await;
    let mut ids = Vec::new();
    for i in 0..n {
        let flow = format!("{prefix}{i}");
        let event = format!("{flow}-1");
        let r = client.advance(harness::advance(&flow, &event, 0, "reserved", 1)).await.expect("advance");
        assert_eq!(AdvanceOutcome::try_from(r.into_inner().outcome), Ok(AdvanceOutcome::Committed));
        ids.push(event);
    }
    ids
}

/// One `relay drain` from `producer` to `consumer` (its judgement logged: `probes=`, `asks=`);
/// it must end with every row accepted.
fn drain(producer: &Producer, consumer: &Consumer) -> harness::proc::RelayRun {
    let env = [("RUST_LOG", "info,relay::identity=debug")];
    let run = harness::proc::relay(&producer.db, &consumer.process.url(), &["drain"], &env);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(db::outbox(&producer.db).iter().all(|r| r.accepted), "{}", run.stderr);
    run
}

/// The probes and asks of the run's one judgement (its `consumer identified` line).
fn judgement(run: &harness::proc::RelayRun) -> (&str, &str) {
    let mut lines = run.stderr.lines().filter(|l| l.contains("consumer identified"));
    let line = lines.next().unwrap_or_else(|| panic!("no judgement: {}", run.stderr));
    assert!(lines.next().is_none(), "one judgement: {}", run.stderr);
    let field = |name: &str| line.split_whitespace().find(|w| w.starts_with(name)).unwrap_or_default();
    (field("probes="), field("asks="))
}

/// Two producers (X and Y) feed one consumer, whose database is restored from an older copy
/// after it accepted more of Y. Then X delivers first: its new events take the positions the
/// copy reused, above the ones Y's relay recorded for its lost rows, so the consumer's highest
/// position no longer tells that anything is lost. Y's relay probes the positions it recorded
/// (more than one page of them), finds other events there, says so in the loud line and sends
/// every lost row again: the consumer ends up holding every event of both producers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_consumer_whose_reused_positions_another_producer_filled_first_gets_the_lost_rows_again() {
    let Some(mut work) = Workdir::for_test() else { return };
    let x = Producer::start(&work, &[]);
    let y = Producer::start_on(work.other_db("producer_y.db"), work.path("producer-y.log"), &[]);
    let live = work.other_db("consumer.db");
    let backup_db = work.other_db("backup.db");
    let start = |db: &Target, log: &str| Consumer::start_on(db.clone(), work.path(log), false, &[]);
    let mut consumer = start(&live, "consumer-1.log");
    let mut x_ids = commit_singles(&x, "X", 5).await;
    drain(&x, &consumer);
    let mut y_ids = commit_singles(&y, "Y", 5).await;
    drain(&y, &consumer);

    // The backup (positions 1..=10), taken while the consumer is stopped.
    assert_eq!(consumer.process.terminate(DEADLINE).code(), Some(0));
    let backup = Backup::take(&live, backup_db);
    let mut consumer = start(&live, "consumer-2.log");
    // Y's rows accepted after the backup: more than one page of probes (256).
    let lost = commit_singles(&y, "L", 300).await;
    drain(&y, &consumer);
    y_ids.extend(lost.iter().cloned());
    assert_eq!(consumer.process.terminate(DEADLINE).code(), Some(0));

    // Restored; X delivers first, into the reused positions (above Y's lost ones).
    let restored = backup.restore();
    let consumer = start(&restored, "consumer-3.log");
    let held =
        |target: &Target| -> BTreeSet<String> { db::inbox(target).into_iter().map(|r| r.event_id).collect() };
    assert!(lost.iter().all(|id| !held(&restored).contains(id)), "the copy predates the lost rows");
    x_ids.extend(commit_singles(&x, "Z", 400).await);
    let x_run = drain(&x, &consumer);
    assert!(!x_run.stderr.contains("CONSUMER DATABASE RESTORED"), "X lost nothing: {}", x_run.stderr);
    // Nothing lost: one Identify, one page (X's five rows).
    assert_eq!(judgement(&x_run), ("probes=5", "asks=1"), "{}", x_run.stderr);
    let highest = db::inbox(&restored).iter().map(|r| r.rowid).max().unwrap_or(0);
    let recorded_y = db::highest_recorded_position(&y.db);
    assert!(
        highest as u64 > recorded_y,
        "the consumer's history passed Y's recorded positions: {highest} {recorded_y}"
    );

    // Y has new work (a one-shot drain with nothing to send asks the consumer nothing).
    y_ids.extend(commit_singles(&y, "N", 1).await);
    let y_run = drain(&y, &consumer);
    let inbox = held(&restored);
    let missing: Vec<&String> = y_ids.iter().chain(&x_ids).filter(|id| !inbox.contains(*id)).collect();
    assert!(missing.is_empty(), "the consumer lacks {} events, first {:?}", missing.len(), missing.first());
    assert_eq!(inbox.len(), x_ids.len() + y_ids.len());
    let loud: Vec<&str> = y_run
        .stderr
        .lines()
        .filter(|l| l.contains("CONSUMER DATABASE RESTORED FROM AN OLDER COPY"))
        .collect();
    assert_eq!(loud.len(), 1, "{}", y_run.stderr);
    assert!(loud[0].contains(&format!("rows={}", lost.len())), "{}", y_run.stderr);
    // 305 rows recorded: a first page all lost, a second (the other 49) partly: two asks.
    assert_eq!(judgement(&y_run), ("probes=305", "asks=2"), "{}", y_run.stderr);
    // Judged again, nothing is lost any more.
    y_ids.extend(commit_singles(&y, "M", 1).await);
    let again = drain(&y, &consumer);
    assert!(!again.stderr.contains("CONSUMER DATABASE RESTORED"), "{}", again.stderr);
    assert_eq!(judgement(&again), ("probes=256", "asks=1"), "{}", again.stderr);
    assert_eq!(held(&restored).len(), x_ids.len() + y_ids.len());
}

/// producer.db deleted, or replaced by another file, under the running producer: every
/// `Advance` is refused with `INTERNAL` naming the cause and nothing is written, one loud line
/// says so, and health turns `NOT_SERVING`. Before, the producer answered `COMMITTED` into the
/// unlinked file: each such event was gone with the process (nothing else can open that
/// file, and a restart refuses a deleted database's leftovers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_database_deleted_or_replaced_under_the_producer_refuses_every_advance() {
    harness::sqlite_only!("deletes and replaces producer.db under the running producer");
    let Some(work) = Workdir::for_test() else { return };
    for (i, how) in ["was deleted", "was replaced by another file"].into_iter().enumerate() {
        let file = work.path(&format!("producer-{i}.db"));
        let producer =
            Producer::start_on(Target::Sqlite(file.clone()), work.path(&format!("producer-{i}.log")), &[]);
        let first = producer.advance(harness::advance("A", "A1", 0, "reserved", 1)).await;
        assert_eq!(AdvanceOutcome::try_from(first.outcome), Ok(AdvanceOutcome::Committed), "{first:?}");
        if i == 0 {
            std::fs::remove_file(&file).expect("delete producer.db");
        } else {
            // Another file at the path: a copy, renamed over it (a new inode).
            let copy = work.path("producer-copy.db");
            std::fs::copy(&file, &copy).expect("copy producer.db");
            std::fs::rename(&copy, &file).expect("replace producer.db");
        }
        for (flow, expected_seq, kind) in [("A", 1, "confirmed"), ("B", 0, "reserved")] {
            let req = harness::advance(flow, &format!("{flow}{}", expected_seq + 1), expected_seq, kind, 1);
            let refused =
                producer.client().await.advance(req).await.expect_err("an Advance after the file went");
            assert_eq!(refused.code(), tonic::Code::Internal, "{how}: {refused:?}");
            assert!(refused.message().contains(&format!("{how} under this running producer")), "{refused:?}");
        }
        wait_health_of(&producer.process, "ordered_events.v1.Producer", ServingStatus::NotServing).await;
        let log = producer.process.log_text();
        assert_eq!(log.matches("PRODUCER DATABASE GONE").count(), 1, "{log}");
        if i == 1 {
            // Nothing refused was written to the file now at the path either.
            let rows: Vec<String> =
                db::outbox(&Target::Sqlite(file)).into_iter().map(|r| r.event_id).collect();
            assert!(!rows.iter().any(|id| id == "A2" || id == "B1"), "{rows:?}");
        }
    }
}
