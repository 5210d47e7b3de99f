//! Several `relay run` on one PostgreSQL outbox (issue 15), real processes: the relays split
//! the 64 partitions through leases; a relay frozen past its lease cannot record anything
//! after it resumes (fencing, checked on the rows: who marked each and under which epoch);
//! a relay killed with rows waiting has its partitions delivered by another within the
//! configured bound; and 3 producers, 3 relays and 3 consumers under concurrent load apply
//! every event exactly once, each flow a contiguous prefix (the chaos checker's invariants);
//! a relay that takes over a dead relay's partitions while the consumer's database was
//! restored from an older copy sends what the consumer lost of them again, before any later
//! row of theirs.
//! PostgreSQL only: on SQLite one relay serves the outbox.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::background::{RelayDaemon, wait_for};
use harness::checker::{AdvanceRecord, Answer, Files, History, Intent, check, wait_drained};
use harness::db::{self, PgSession};
use harness::proc::{ServerProcess, signal};
use harness::{Backend, Consumer, Producer, Target, Workdir};
use proto::pb;

const DEADLINE: Duration = Duration::from_secs(60);
/// The lease ttl the tests run with: short, so takeovers happen within seconds.
const TTL_MS: u64 = 1500;

/// Returns true (after one loud line) when the suite does not run on PostgreSQL.
fn skipped_without_postgres() -> bool {
    if Backend::current() == Backend::Postgres {
        return false;
    }
    let _ = std::io::Write::write_all(
        &mut std::io::stderr(),
        format!(
            "SKIPPED on {} (PostgreSQL only; runs in the PostgreSQL pass): several relays share an outbox only on PostgreSQL\n",
            Backend::current()
        )
        .as_bytes(),
    );
    true
}

fn url(target: &Target) -> &str {
    match target {
        Target::Postgres(url) => url,
        Target::Sqlite(_) => unreachable!("PostgreSQL only"),
    }
}

/// Runs one read on the producer schema.
fn query<T: Send + 'static>(
    target: &Target,
    sql: &'static str,
    read: impl Fn(&postgres::Row) -> T + Send + 'static,
) -> Vec<T> {
    let session = PgSession::connect(url(target), true).unwrap_or_else(|e| panic!("{e}"));
    session
        .run(move |c| {
            c.batch_execute("SET search_path = ordered_events_producer").map_err(|e| e.to_string())?;
            c.query(sql, &[])
                .map(|rows| rows.iter().map(&read).collect::<Vec<T>>())
                .map_err(|e| e.to_string())
        })
        .and_then(|r| r)
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// Partitions held per owner (live leases only).
fn owners(target: &Target) -> BTreeMap<String, usize> {
    let rows = query(
        target,
        "SELECT owner FROM relay_lease
         WHERE owner IS NOT NULL AND expires_at_us >= (extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
        |r| r.get::<_, String>(0),
    );
    let mut held = BTreeMap::new();
    for owner in rows {
        *held.entry(owner).or_default() += 1;
    }
    held
}

/// `(event_id, accepted, marked_by, marked_epoch, partition)` of every outbox row.
type Marked = (String, bool, Option<String>, Option<i64>, i16);

fn marks(target: &Target) -> Vec<Marked> {
    query(
        target,
        "SELECT event_id, accepted = 1, marked_by, marked_epoch, partition FROM outbox ORDER BY event_id",
        |r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)),
    )
}

/// The relay's `lease` lines so far.
fn lease_lines(daemon: &RelayDaemon) -> Vec<serde_json::Value> {
    std::fs::read_to_string(&daemon.stdout)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["type"] == "lease")
        .collect()
}

/// The relay's instance id, from its first lease line.
fn instance_of(daemon: &RelayDaemon) -> Option<String> {
    lease_lines(daemon).first().and_then(|l| l["instance"].as_str().map(str::to_owned))
}

fn relay_run(
    work: &Workdir,
    name: &str,
    producer_db: &Target,
    consumers: &str,
    extra: &[&str],
) -> RelayDaemon {
    let ttl = TTL_MS.to_string();
    let mut args = vec!["--lease-ttl-ms", ttl.as_str(), "--poll-ms", "20"];
    args.extend_from_slice(extra);
    RelayDaemon::start(
        work.dir.path(),
        name,
        producer_db,
        consumers,
        &args,
        &[("RUST_LOG", "info,relay=debug")],
    )
}

/// Starts a consumer (no auto-apply) on `db`, listening on `listen`: a restarted consumer
/// keeps its address so the running relays find it again (retried while a consumer killed a
/// moment ago still holds it).
fn consumer_at(db: &Target, listen: &str, log: std::path::PathBuf) -> Consumer {
    let args: Vec<String> = ["--db", &db.arg(), "--listen", listen].map(String::from).into();
    let until = Instant::now() + DEADLINE;
    loop {
        match ServerProcess::try_start("consumer", &args, &[], log.clone(), Duration::from_secs(10)) {
            Ok(process) => return Consumer { process, db: db.clone() },
            Err(e) if Instant::now() < until && e.contains("ddress") => continue,
            Err(e) => panic!("{e}"),
        }
    }
}

/// Replaces the (empty) database `to` with a copy of `from`, as a restore from a backup
/// would (nothing may be connected to `from`).
fn copy_database(from: &Target, to: &Target) {
    let name = |t: &Target| {
        url(t).split('?').next().unwrap_or_default().rsplit('/').next().unwrap_or_default().to_owned()
    };
    let admin = Target::Postgres(proto::pg::testing::with_database(url(from), "postgres"));
    db::execute(&admin, &format!("DROP DATABASE {}", name(to)));
    db::execute(&admin, &format!("CREATE DATABASE {} TEMPLATE {}", name(to), name(from)));
}

fn auto_consumer(work: &Workdir, log: &str) -> Consumer {
    let db = work.consumer_db();
    let args: Vec<String> =
        ["--db", &db.arg(), "--listen", "127.0.0.1:0", "--auto-apply"].map(String::from).into();
    Consumer { process: ServerProcess::start("consumer", &args, &[], work.path(log)), db }
}

/// Commits one `reserved` step on each of `flows`, eight calls at a time.
async fn commit_flows(producer: &Producer, flows: &[String]) {
    let url = producer.process.url();
    let mut tasks = Vec::new();
    for chunk in flows.chunks(flows.len().div_ceil(8).max(1)) {
        let chunk = chunk.to_vec();
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let mut client = pb::producer_client::ProducerClient::new(harness::proc::connect(&url).await);
            for flow in chunk {
                let req = harness::advance(&flow, &format!("{flow}1"), 0, "reserved", 1);
                let r = client.advance(req).await.expect("advance").into_inner();
                assert_eq!(
                    pb::AdvanceOutcome::try_from(r.outcome),
                    Ok(pb::AdvanceOutcome::Committed),
                    "{r:?}"
                );
            }
        }));
    }
    for t in tasks {
        t.await.expect("commit task");
    }
}

/// Every outbox row accepted, and applied exactly once (one effect per event).
fn assert_applied_once(work: &Workdir, producer_db: &Target) {
    wait_for(
        DEADLINE,
        || {
            let effects = db::effects(&work.consumer_db());
            (db::outbox(producer_db).iter().all(|r| r.accepted)
                && effects.len() == db::outbox(producer_db).len())
            .then_some(())
        },
        || format!("outbox {:?}", db::outbox(producer_db).iter().filter(|r| !r.accepted).collect::<Vec<_>>()),
    );
    let effects = db::effects(&work.consumer_db());
    let ids: BTreeSet<&str> = effects.iter().map(|e| e.event_id.as_str()).collect();
    assert_eq!(ids.len(), effects.len(), "an event has two effects: {effects:?}");
    let outbox: BTreeSet<String> = db::outbox(producer_db).into_iter().map(|r| r.event_id).collect();
    assert_eq!(ids, outbox.iter().map(String::as_str).collect(), "effects and outbox differ");
}

/// A relay frozen (SIGSTOP) with answers not yet recorded, past its lease: a second relay
/// takes every partition over and delivers the rows again; after SIGCONT the first relay's
/// late marks land nowhere (no row gains its mark under the epochs it lost), it says so
/// loudly, and it later works again under new epochs. Nothing is lost; each event is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_relay_cannot_mark_after_its_partitions_were_taken_over() {
    if skipped_without_postgres() {
        return;
    }
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer = auto_consumer(&work, "consumer.log");
    let consumer_url = consumer.process.url();
    // Rows wait before the relay starts; it then sends them all at once (the window holds
    // them) and records the answers only when every one has come (or after 5 s): the freeze
    // below lands between its sends and its marks.
    let flows: Vec<String> = (0..3000).map(|i| format!("F{i}")).collect();
    commit_flows(&producer, &flows).await;
    let mut a = relay_run(
        &work,
        "relay-a",
        &producer.db,
        &consumer_url,
        &[
            "--window",
            "4096",
            "--mark-batch",
            "4096",
            "--mark-delay-ms",
            "5000",
            "--answer-timeout-ms",
            "600000",
        ],
    );
    wait_for(DEADLINE, || a.log_text().contains("relay::pass: sent").then_some(()), || a.log_text());
    let pid = a.pid().expect("relay a runs");
    signal(pid, libc::SIGSTOP);
    let a_id = instance_of(&a).expect("relay a wrote its lease line");
    let before: Vec<Marked> = marks(&producer.db);
    let marked_by_a_before: BTreeSet<String> =
        before.iter().filter(|m| m.2.as_deref() == Some(a_id.as_str())).map(|m| m.0.clone()).collect();
    assert!(before.iter().any(|m| !m.1), "the freeze came after every mark");
    // B takes everything over once A's leases expire, and delivers every row.
    let b = relay_run(&work, "relay-b", &producer.db, &consumer_url, &[]);
    wait_for(
        DEADLINE,
        || {
            let b_id = instance_of(&b)?;
            (owners(&producer.db).get(&b_id) == Some(&64)).then_some(())
        },
        || format!("{:?}; b: {}", owners(&producer.db), b.log_text()),
    );
    wait_for(DEADLINE, || db::outbox(&producer.db).iter().all(|r| r.accepted).then_some(()), || b.log_text());
    signal(pid, libc::SIGCONT);
    // A resumes: its answers are late; the fence (or its heartbeat first) keeps them out.
    wait_for(
        DEADLINE,
        || {
            let log = a.log_text();
            (log.contains("LEASE LOST")
                && (log.contains("refused by the fence") || log.contains("are not recorded")))
            .then_some(())
        },
        || a.log_text(),
    );
    // Which guard kept the late answers out (both must): the database's fence, or the
    // relay's own view after its heartbeat found the leases gone first.
    let path = if a.log_text().contains("refused by the fence") {
        "the fence in the mark statement"
    } else {
        "the relay's lease view"
    };
    let _ = std::io::Write::write_all(
        &mut std::io::stderr(),
        format!("late answers kept out by {path}\n").as_bytes(),
    );
    // The epochs A lost: everything it took before the freeze (all at epoch 1 on a fresh
    // database). No row gained a mark by A under them.
    let after = marks(&producer.db);
    let late: Vec<&Marked> = after
        .iter()
        .filter(|m| {
            m.2.as_deref() == Some(a_id.as_str()) && m.3 == Some(1) && !marked_by_a_before.contains(&m.0)
        })
        .collect();
    assert!(late.is_empty(), "marks by the frozen relay landed after the takeover: {late:?}");
    // A works again under new epochs once B hands back its share; new rows are delivered.
    let more: Vec<String> = (0..40).map(|i| format!("G{i}")).collect();
    commit_flows(&producer, &more).await;
    assert_applied_once(&work, &producer.db);
    wait_for(
        DEADLINE,
        || {
            let held = owners(&producer.db);
            (held.get(&a_id).is_some_and(|n| *n > 0) && held.values().sum::<usize>() == 64).then_some(())
        },
        || format!("{:?}; a: {}", owners(&producer.db), a.log_text()),
    );
    let lost = lease_lines(&a).into_iter().filter(|l| l["event"] == "lost").count();
    assert!(lost >= 1, "relay a wrote no lease lost line");
    a.kill();
}

/// A relay killed (SIGKILL) while rows of its partitions wait: the other relay takes them
/// over and delivers every row within the configured bound (ttl + ttl/3, plus the time to
/// deliver); each event is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_relays_partitions_are_delivered_by_another_within_the_bound() {
    if skipped_without_postgres() {
        return;
    }
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer = auto_consumer(&work, "consumer.log");
    let consumer_url = consumer.process.url();
    let mut a = relay_run(&work, "relay-a", &producer.db, &consumer_url, &[]);
    wait_for(
        DEADLINE,
        || (owners(&producer.db).values().sum::<usize>() == 64).then_some(()),
        || a.log_text(),
    );
    let b = relay_run(&work, "relay-b", &producer.db, &consumer_url, &[]);
    // They split the partitions: 32 each.
    wait_for(
        DEADLINE,
        || {
            let held = owners(&producer.db);
            (held.len() == 2 && held.values().all(|n| *n == 32)).then_some(())
        },
        || format!("{:?}", owners(&producer.db)),
    );
    let a_id = instance_of(&a).expect("relay a wrote its lease line");
    a.kill();
    let flows: Vec<String> = (0..64).map(|i| format!("K{i}")).collect();
    commit_flows(&producer, &flows).await;
    let waiting = marks(&producer.db);
    let a_partitions: BTreeSet<i16> = query(&producer.db, "SELECT partition, owner FROM relay_lease", |r| {
        (r.get::<_, i16>(0), r.get::<_, Option<String>>(1))
    })
    .into_iter()
    .filter(|(_, o)| o.as_deref() == Some(a_id.as_str()))
    .map(|(p, _)| p)
    .collect();
    assert!(
        waiting.iter().any(|m| !m.1 && a_partitions.contains(&m.4)),
        "rows of the killed relay's partitions wait: {waiting:?}"
    );
    // The bound: the lease expires ttl after its last renewal, and B's heartbeat (every
    // ttl/3) takes it; delivering the rows then takes moments. 5 s of slack for a loaded host.
    let bound = Duration::from_millis(TTL_MS + TTL_MS / 3) + Duration::from_secs(5);
    wait_for(
        bound,
        || db::outbox(&producer.db).iter().all(|r| r.accepted).then_some(()),
        || format!("{:?}; b: {}", owners(&producer.db), b.log_text()),
    );
    let b_id = instance_of(&b).expect("relay b wrote its lease line");
    assert_eq!(owners(&producer.db).get(&b_id), Some(&64), "b holds every partition");
    assert!(marks(&producer.db).iter().all(|m| m.2.as_deref() == Some(b_id.as_str())), "b marked every row");
    // GetFlow says where a flow lives and who holds it.
    let flow =
        producer.client().await.get_flow(pb::GetFlowRequest { flow_id: "K7".into() }).await.expect("GetFlow");
    let flow = flow.into_inner();
    assert_eq!(flow.partition, Some(u32::from(proto::partition::flow_partition("K7"))));
    assert_eq!(flow.lease_owner, b_id);
    assert!(flow.lease_epoch >= 2, "{flow:?}");
    assert_applied_once(&work, &producer.db);
}

/// The answer a client records.
fn answer_of(resp: &pb::AdvanceResponse) -> Answer {
    let body = resp.event.as_ref().map(|e| e.body.clone()).unwrap_or_default();
    match pb::AdvanceOutcome::try_from(resp.outcome) {
        Ok(pb::AdvanceOutcome::Committed) => Answer::Committed { body },
        Ok(pb::AdvanceOutcome::Existing) => Answer::Existing { body },
        Ok(pb::AdvanceOutcome::Conflict) => Answer::Conflict { body },
        Ok(pb::AdvanceOutcome::Stale) => Answer::Stale,
        Ok(pb::AdvanceOutcome::InvalidTransition) => Answer::InvalidTransition,
        other => Answer::Other { what: format!("outcome {other:?}: {}", resp.detail) },
    }
}

/// 3 producers, 3 relays and 3 consumers (auto-apply) on one database under concurrent
/// load, each step sent to two producers at once: the checker's invariants hold (every
/// committed event applied exactly once, every flow a contiguous prefix, nothing refused
/// applied, pending work drained, the backlog counters exact).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_of_each_on_one_database_apply_every_event_once_in_order() {
    if skipped_without_postgres() {
        return;
    }
    let Some(work) = Workdir::for_test() else { return };
    let producers: Vec<Producer> = (0..3)
        .map(|i| Producer::start_on(work.producer_db(), work.path(&format!("producer-{i}.log")), &[]))
        .collect();
    let consumers: Vec<Consumer> =
        (0..3).map(|i| auto_consumer(&work, &format!("consumer-{i}.log"))).collect();
    let _relays: Vec<RelayDaemon> = (0..3)
        .map(|i| {
            relay_run(&work, &format!("relay-{i}"), &work.producer_db(), &consumers[i].process.url(), &[])
        })
        .collect();
    // The three split the partitions before the load starts: every one held, none holding
    // more than its fair share (ceil(64 / 3) = 22).
    wait_for(
        DEADLINE,
        || {
            let held = owners(&work.producer_db());
            (held.len() == 3 && held.values().sum::<usize>() == 64 && held.values().all(|n| *n <= 22))
                .then_some(())
        },
        || format!("{:?}", owners(&work.producer_db())),
    );
    let history = Arc::new(std::sync::Mutex::new(History::default()));
    let urls: Vec<String> = producers.iter().map(|p| p.process.url()).collect();
    let mut tasks = Vec::new();
    for worker in 0..6usize {
        let urls = urls.clone();
        let history = history.clone();
        tasks.push(tokio::spawn(async move {
            let mut clients = Vec::new();
            for url in &urls {
                clients.push(pb::producer_client::ProducerClient::new(harness::proc::connect(url).await));
            }
            for n in 0..15usize {
                let flow = format!("w{worker}f{n}");
                for (s, kind) in ["reserved", "confirmed", "released"].iter().enumerate() {
                    let req = pb::AdvanceRequest {
                        flow_id: flow.clone(),
                        event_id: format!("{flow}-{}", s + 1),
                        expected_seq: s as u64,
                        kind: (*kind).into(),
                        schema: 1,
                        amount: 5,
                    };
                    // The same step on two producers at once: one commits, the other answers EXISTING.
                    let (i, j) = ((worker + n + s) % 3, (worker + n + s + 1) % 3);
                    let (mut ci, mut cj) = (clients[i].clone(), clients[j].clone());
                    let (ri, rj) = tokio::join!(ci.advance(req.clone()), cj.advance(req.clone()));
                    let mut h = history.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    for r in [ri, rj] {
                        let answer = match r {
                            Ok(resp) => answer_of(resp.get_ref()),
                            Err(status) => Answer::Unknown { error: status.to_string() },
                        };
                        h.advances.push(AdvanceRecord {
                            flow_id: req.flow_id.clone(),
                            event_id: req.event_id.clone(),
                            expected_seq: req.expected_seq,
                            kind: req.kind.clone(),
                            schema: req.schema,
                            amount: req.amount,
                            intent: Intent::Step,
                            answer,
                        });
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("load task");
    }
    let files = Files { producer_db: work.producer_db(), consumer_db: work.consumer_db() };
    let drain = wait_drained(&files, DEADLINE);
    let history = history.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    let verdict = check(&files, &history, &drain);
    assert!(verdict.ok(), "{}", verdict.summary_lines().join("\n"));
    assert_eq!(verdict.committed_events, 6 * 15 * 3);
    assert_eq!(verdict.effects, 6 * 15 * 3);
    // The three relays shared the work: each marked rows.
    let markers: BTreeSet<String> = marks(&work.producer_db()).into_iter().filter_map(|m| m.2).collect();
    assert_eq!(markers.len(), 3, "marked by {markers:?}");
}

/// `--consumer` twice (two consumer instances on one database): `run` keeps a stream to each
/// and spreads the flows over them, so both receive; when one dies, the relay says so once,
/// its flows go to the other stream, and everything committed since arrives. Every event is
/// accepted exactly once in the consumer database. Both backends (several consumers share a
/// SQLite file too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_spreads_flows_over_several_consumers_and_fails_over_when_one_dies() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let mut consumers: Vec<Consumer> = (0..2)
        .map(|i| {
            let db = work.consumer_db();
            let args: Vec<String> =
                ["--db", &db.arg(), "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"]
                    .map(String::from)
                    .into();
            let log = work.path(&format!("consumer-{i}.log"));
            Consumer { process: ServerProcess::start("consumer", &args, &[], log), db }
        })
        .collect();
    let urls: Vec<String> = consumers.iter().map(|c| c.process.url()).collect();
    let relay = RelayDaemon::start_command(
        std::process::Command::new(harness::bin_path("relay")),
        work.dir.path(),
        "relay",
        &producer.db,
        &urls[0],
        &["--consumer", &urls[1], "run", "--delivery-lines", "--poll-ms", "20"],
        &[],
    );
    let first: Vec<String> = (0..40).map(|i| format!("A{i}")).collect();
    commit_flows(&producer, &first).await;
    wait_for(
        DEADLINE,
        || db::outbox(&producer.db).iter().all(|r| r.accepted).then_some(()),
        || relay.log_text(),
    );
    let log = relay.log_text();
    for url in &urls {
        assert!(log.contains(&format!("delivering url={url}")), "{log}");
    }
    // Both consumers received part of the flows.
    for c in &consumers {
        let addr = harness::scrape::metrics_addr(&c.process.log_text()).expect("metrics serving line");
        let m = harness::scrape::Metrics::scrape(&addr).await;
        let accepted = m.get("ordered_events_consumer_receive_total", &[("outcome", "accepted")]);
        assert!(accepted > 0.0, "{} received nothing: {}", c.process.url(), m.text);
    }
    consumers[0].process.kill();
    let more: Vec<String> = (0..40).map(|i| format!("M{i}")).collect();
    commit_flows(&producer, &more).await;
    wait_for(
        DEADLINE,
        || db::outbox(&producer.db).iter().all(|r| r.accepted).then_some(()),
        || relay.log_text(),
    );
    let log = relay.log_text();
    assert_eq!(
        log.matches("failing over: the flows of the dropped stream go to the other consumers").count(),
        1,
        "{log}"
    );
    let down =
        log.lines().filter(|l| l.contains(" WARN ") && l.contains(&format!("url={}", urls[0]))).count();
    assert!(down >= 1, "the dropped link was not reported: {log}");
    assert!(
        log.lines().filter(|l| l.contains(" WARN ")).all(|l| l.contains(&format!("url={}", urls[0]))),
        "a warning about the live consumer: {log}"
    );
    // Every event accepted exactly once in the consumer database.
    let inbox = db::inbox(&work.consumer_db());
    let ids: BTreeSet<&str> = inbox.iter().map(|r| r.event_id.as_str()).collect();
    assert_eq!((inbox.len(), ids.len()), (80, 80));
    // GetFlow names the flow's partition on PostgreSQL only (SQLite's answer is unchanged).
    let flow =
        producer.client().await.get_flow(pb::GetFlowRequest { flow_id: "A1".into() }).await.expect("GetFlow");
    let expected =
        (work.backend() == Backend::Postgres).then(|| u32::from(proto::partition::flow_partition("A1")));
    assert_eq!(flow.into_inner().partition, expected);
}

/// The partitions whose live lease `owner` holds.
fn partitions_of(target: &Target, owner: &str) -> BTreeSet<u16> {
    let owner = owner.to_owned();
    query(target, "SELECT partition, owner FROM relay_lease", |r| {
        (r.get::<_, i16>(0), r.get::<_, Option<String>>(1))
    })
    .into_iter()
    .filter(|(_, o)| o.as_deref() == Some(owner.as_str()))
    .filter_map(|(p, _)| u16::try_from(p).ok())
    .collect()
}

/// Two relays (each with its own consumer instance on one consumer database) split the
/// partitions. Rows of relay a's partitions are accepted after a backup of the consumer
/// database; then both consumers stop, the flows get a second step, and only b's consumer
/// comes back, on the older copy (a's stays down, so a never asks it anything). b judges its
/// own partitions (nothing lost there) and delivers. Then a is killed and b takes its
/// partitions over: before sending any row of them it must ask the consumer what it lacks of
/// them, say so loudly and send the lost first steps again, before their second steps. Sent
/// the other way round, the second steps would raise the copy's history past the lost rows'
/// positions and hide the loss for good. Every event arrives, in seq order per flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_taking_over_partitions_resends_what_a_restored_consumer_lost_of_them_first() {
    if skipped_without_postgres() {
        return;
    }
    let Some(mut work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer_db = work.other_db("consumer");
    let backup = work.other_db("backup");
    let mut c1 = consumer_at(&consumer_db, "127.0.0.1:0", work.path("consumer-1.log"));
    let mut c2 = consumer_at(&consumer_db, "127.0.0.1:0", work.path("consumer-2.log"));
    let (addr1, addr2) = (c1.process.addr.clone(), c2.process.addr.clone());
    let mut a = relay_run(&work, "relay-a", &producer.db, &c2.process.url(), &[]);
    wait_for(
        DEADLINE,
        || (owners(&producer.db).values().sum::<usize>() == 64).then_some(()),
        || a.log_text(),
    );
    let b = relay_run(&work, "relay-b", &producer.db, &c1.process.url(), &[]);
    wait_for(
        DEADLINE,
        || {
            let held = owners(&producer.db);
            (held.len() == 2 && held.values().all(|n| *n == 32)).then_some(())
        },
        || format!("{:?}", owners(&producer.db)),
    );
    let (a_id, b_id) = (instance_of(&a).expect("a's lease line"), instance_of(&b).expect("b's lease line"));
    let all_accepted = || db::outbox(&producer.db).iter().all(|r| r.accepted).then_some(());

    // The backup holds the K flows (positions 1..=64).
    let kept: Vec<String> = (0..64).map(|i| format!("K{i}")).collect();
    commit_flows(&producer, &kept).await;
    wait_for(DEADLINE, all_accepted, || b.log_text());
    assert_eq!(c1.process.terminate(DEADLINE).code(), Some(0));
    assert_eq!(c2.process.terminate(DEADLINE).code(), Some(0));
    copy_database(&consumer_db, &backup);
    let mut c1 = consumer_at(&consumer_db, &addr1, work.path("consumer-1b.log"));
    let mut c2 = consumer_at(&consumer_db, &addr2, work.path("consumer-2b.log"));
    // The L flows live in a's partitions; a accepts them after the backup.
    let a_partitions = partitions_of(&producer.db, &a_id);
    let lost: Vec<String> = (0..)
        .map(|i| format!("L{i}"))
        .filter(|f| a_partitions.contains(&proto::partition::flow_partition(f)))
        .take(40)
        .collect();
    commit_flows(&producer, &lost).await;
    wait_for(DEADLINE, all_accepted, || format!("a: {}\nb: {}", a.log_text(), b.log_text()));
    assert!(
        marks(&producer.db)
            .iter()
            .filter(|m| m.0.starts_with('L'))
            .all(|m| m.2.as_deref() == Some(a_id.as_str())),
        "a accepted every L row: {:?}",
        marks(&producer.db)
    );

    // Both consumers stop; each L flow gets its second step meanwhile. Only b's consumer
    // comes back, on the older copy.
    assert_eq!(c1.process.terminate(DEADLINE).code(), Some(0));
    assert_eq!(c2.process.terminate(DEADLINE).code(), Some(0));
    for flow in &lost {
        let r = producer.advance_steps(flow, 1, &[1]).await;
        assert_eq!(pb::AdvanceOutcome::try_from(r[0].outcome), Ok(pb::AdvanceOutcome::Committed), "{r:?}");
    }
    let seen = b.log_text().len();
    let restored = consumer_at(&backup, &addr1, work.path("consumer-restored.log"));
    // b identifies the copy (its history ends at the K flows) and judges its own partitions.
    wait_for(
        DEADLINE,
        || b.log_text()[seen..].contains("highest_inbox_position=64 partitions_judged=32").then_some(()),
        || b.log_text(),
    );
    let restored_line = "CONSUMER DATABASE RESTORED FROM AN OLDER COPY";
    assert!(!b.log_text().contains(restored_line), "b's own partitions lost nothing: {}", b.log_text());
    assert!(marks(&producer.db).iter().any(|m| !m.1), "the second steps wait for a relay");

    // a dies; b takes its partitions over.
    a.kill();
    wait_for(
        DEADLINE,
        || {
            let inbox: BTreeSet<String> = db::inbox(&backup).into_iter().map(|r| r.event_id).collect();
            let outbox: BTreeSet<String> = db::outbox(&producer.db).into_iter().map(|r| r.event_id).collect();
            (all_accepted().is_some() && inbox == outbox).then_some(())
        },
        || format!("{:?}; b: {}", owners(&producer.db), b.log_text()),
    );
    assert_eq!(owners(&producer.db).get(&b_id), Some(&64), "b holds every partition");
    let log = b.log_text();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains(restored_line)).collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(lines[0].contains(&format!("rows={}", lost.len())), "{log}");
    // Per-flow delivery order: in the restored inbox each L flow's step 1 arrived before its
    // step 2.
    let inbox = db::inbox(&backup);
    for flow in &lost {
        let at = |seq: u64| inbox.iter().find(|r| &r.flow_id == flow && r.seq == seq).map(|r| r.rowid);
        assert!(at(1).is_some() && at(1) < at(2), "flow {flow} arrived out of order: {:?}", (at(1), at(2)));
    }
    assert_eq!(inbox.len(), 64 + 2 * lost.len());
    drop(restored);
}
