//! The store's behaviour, run on BOTH backends through [`ProducerStore`] only: SQLite in a
//! temp dir, PostgreSQL in a fresh database per test (skipped loudly when no server is
//! reachable, failed when `ORDERED_EVENTS_REQUIRE_PG=1`).

use std::future::Future;

use proto::pb;
use proto::pg::testing::{TestDb, most_rows_a_scan_read};
use proto::target::DbTarget;

use super::*;

const KIND_PG_VERSION: i32 = PG_KIND.version;
use crate::request::validate;

fn cmd_on(flow: &str, event: &str, expected: u64, kind: &str, schema: u32, amount: i64) -> AdvanceCommand {
    validate(pb::AdvanceRequest {
        flow_id: flow.into(),
        event_id: event.into(),
        expected_seq: expected,
        kind: kind.into(),
        schema,
        amount,
    })
    .unwrap()
}

fn cmd(event: &str, expected: u64, kind: &str, schema: u32, amount: i64) -> AdvanceCommand {
    cmd_on("A", event, expected, kind, schema, amount)
}

/// Where one test's database lives; dropped with the test.
enum Place {
    Sqlite(tempfile::TempDir),
    Postgres(TestDb),
}

impl Place {
    fn target(&self) -> DbTarget {
        match self {
            Place::Sqlite(dir) => DbTarget::Sqlite(dir.path().join("p.db")),
            Place::Postgres(db) => db.url().parse().unwrap(),
        }
    }

    async fn open(&self, max_unaccepted: Option<u64>) -> ProducerStore {
        let role = Role::Server { max_batch: 256, max_unaccepted };
        ProducerStore::open(&self.target(), role, CrashSwitch::default()).await.unwrap()
    }

    /// Runs raw SQL beside the store (a user's trigger, a look at a column the domain types
    /// do not carry); `sqlite` and `pg` are the two dialects of the same statement.
    async fn sql(&self, sqlite: &str, pg: &str) {
        match self {
            Place::Sqlite(dir) => {
                let conn = rusqlite::Connection::open(dir.path().join("p.db")).unwrap();
                conn.execute_batch(sqlite).unwrap();
            }
            Place::Postgres(db) => {
                let client = pg_client(db).await;
                client.batch_execute(pg).await.unwrap_or_else(|e| panic!("{}", proto::pg::describe(&e)));
            }
        }
    }

    /// One text column of one row (`None` for NULL), same query on both.
    async fn text(&self, query: &str) -> Option<String> {
        match self {
            Place::Sqlite(dir) => {
                let conn = rusqlite::Connection::open(dir.path().join("p.db")).unwrap();
                conn.query_row(query, [], |r| r.get(0)).unwrap()
            }
            Place::Postgres(db) => pg_client(db).await.query_one(query, &[]).await.unwrap().get(0),
        }
    }
}

async fn pg_client(db: &TestDb) -> tokio_postgres::Client {
    let mut config: tokio_postgres::Config = db.url().parse().unwrap();
    config.options("-c search_path=ordered_events_producer");
    let (client, conn) = config.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    client
}

/// Runs `test` on SQLite, then on PostgreSQL (when a server is reachable).
async fn on_both<F, Fut>(label: &str, test: F)
where
    F: Fn(Place) -> Fut,
    Fut: Future<Output = ()>,
{
    test(Place::Sqlite(tempfile::tempdir().unwrap())).await;
    if let Some(db) = TestDb::create(label) {
        test(Place::Postgres(db)).await;
    }
}

async fn outcome(store: &ProducerStore, c: AdvanceCommand) -> AdvanceOutcome {
    store.advance(c).await.unwrap().outcome
}

#[tokio::test]
async fn advance_table_of_spec_section_10() {
    on_both("producer_store_table", |place| async move {
        let store = place.open(None).await;
        assert_eq!(outcome(&store, cmd("A1", 0, "reserved", 1, 3)).await, AdvanceOutcome::Committed);
        assert_eq!(outcome(&store, cmd("A2", 1, "confirmed", 1, 3)).await, AdvanceOutcome::Committed);
        assert_eq!(outcome(&store, cmd("A3", 2, "released", 1, 3)).await, AdvanceOutcome::Committed);
        let retry = store.advance(cmd("A1", 0, "reserved", 1, 3)).await.unwrap();
        assert_eq!(retry.outcome, AdvanceOutcome::Existing, "{}", store.backend());
        assert_eq!((retry.flow.seq, retry.flow.state), (3, FlowState::Released));
        assert_eq!(retry.event.unwrap().body, cmd("A1", 0, "reserved", 1, 3).event().canonical_body());
        assert_eq!(outcome(&store, cmd("A1", 0, "reserved", 1, 4)).await, AdvanceOutcome::Conflict);
        assert_eq!(outcome(&store, cmd("A1", 0, "reserved", 2, 3)).await, AdvanceOutcome::Conflict);
        assert_eq!(outcome(&store, cmd_on("B", "A1", 0, "reserved", 1, 3)).await, AdvanceOutcome::Conflict);
        assert_eq!(outcome(&store, cmd("A9", 1, "confirmed", 1, 3)).await, AdvanceOutcome::Stale);
        let (flow, rows) = store.flow("A".into()).await.unwrap();
        assert_eq!(flow, FlowRecord { seq: 3, state: FlowState::Released, amount: 3 });
        assert_eq!(rows.iter().map(|r| r.seq).collect::<Vec<_>>(), [1, 2, 3]);
        // The canonical body is stored byte for byte.
        assert_eq!(rows[1].body, cmd("A2", 1, "confirmed", 1, 3).event().canonical_body());
        assert_eq!(store.flow("nobody".into()).await.unwrap(), (FlowRecord::NEW, Vec::new()));
    })
    .await;
}

#[tokio::test]
async fn illegal_steps_and_amount_changes_write_nothing() {
    on_both("producer_store_illegal", |place| async move {
        let store = place.open(None).await;
        assert!(matches!(
            outcome(&store, cmd("A2", 0, "confirmed", 1, 3)).await,
            AdvanceOutcome::InvalidTransition(_)
        ));
        assert_eq!(store.flow("A".into()).await.unwrap().0, FlowRecord::NEW);
        outcome(&store, cmd("A1", 0, "reserved", 1, 3)).await;
        assert_eq!(
            outcome(&store, cmd("A2", 1, "confirmed", 1, 5)).await,
            AdvanceOutcome::InvalidTransition(TransitionError::AmountChanged { fixed: 3, got: 5 })
        );
        assert!(matches!(
            outcome(&store, cmd("A2", 1, "released", 1, 3)).await,
            AdvanceOutcome::InvalidTransition(_)
        ));
        let (flow, rows) = store.flow("A".into()).await.unwrap();
        assert_eq!((flow.seq, rows.len()), (1, 1));
    })
    .await;
}

/// Calls queued together share one transaction and get exactly the answers they would get
/// one transaction each (later calls see earlier calls' writes).
#[tokio::test]
async fn a_batch_answers_like_sequential_calls() {
    on_both("producer_store_batch", |place| async move {
        let store = place.open(None).await;
        let batch = [
            cmd_on("A", "A1", 0, "reserved", 1, 3),
            cmd_on("A", "A1", 0, "reserved", 1, 3),
            cmd_on("A", "X1", 0, "reserved", 1, 3),
            cmd_on("A", "A2", 1, "confirmed", 1, 3),
            cmd_on("B", "A2", 0, "reserved", 1, 3),
            cmd_on("B", "B1", 0, "released", 1, 3),
        ];
        // Polled in order on this one thread: all are queued before the writer runs.
        let got = futures::future::join_all(batch.into_iter().map(|c| store.advance(c))).await;
        let got: Vec<_> = got.into_iter().map(|r| r.unwrap().outcome).collect();
        assert!(matches!(got[5], AdvanceOutcome::InvalidTransition(_)), "{got:?}");
        assert_eq!(
            got[..5],
            [
                AdvanceOutcome::Committed,
                AdvanceOutcome::Existing,
                AdvanceOutcome::Stale,
                AdvanceOutcome::Committed,
                AdvanceOutcome::Conflict,
            ]
        );
        let (a, a_rows) = store.flow("A".into()).await.unwrap();
        assert_eq!((a.seq, a_rows.len()), (2, 2));
        let (b, b_rows) = store.flow("B".into()).await.unwrap();
        assert_eq!((b.seq, b_rows.len()), (0, 0));
    })
    .await;
}

/// A user's trigger that rejects one call's outbox insert fails that call alone, with its
/// own storage error (not retryable): its flow update rolls back with it, the other calls of
/// the same batch commit, and the backlog counts only what committed.
#[tokio::test]
async fn a_trigger_rejecting_one_outbox_insert_fails_that_call_alone() {
    on_both("producer_store_trigger", |place| async move {
        let store = place.open(None).await;
        place
            .sql(
                "CREATE TRIGGER reject_b BEFORE INSERT ON outbox WHEN NEW.flow_id = 'B'
                 BEGIN SELECT RAISE(ABORT, 'outbox insert rejected'); END;",
                "CREATE FUNCTION reject_b() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN
                   IF NEW.flow_id = 'B' THEN RAISE EXCEPTION 'outbox insert rejected'; END IF;
                   RETURN NEW;
                 END $$;
                 CREATE TRIGGER reject_b BEFORE INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION reject_b();",
            )
            .await;
        let batch = [
            cmd_on("A", "A1", 0, "reserved", 1, 3),
            cmd_on("B", "B1", 0, "reserved", 1, 3),
            cmd_on("C", "C1", 0, "reserved", 1, 3),
        ];
        let got = futures::future::join_all(batch.into_iter().map(|c| store.advance(c))).await;
        assert_eq!(got[0].as_ref().map(|r| &r.outcome), Ok(&AdvanceOutcome::Committed));
        let err = got[1].as_ref().unwrap_err();
        assert!(matches!(err, StoreError::Storage { .. }), "{err:?}");
        assert!(err.to_string().contains("outbox insert rejected"), "{err}");
        assert_eq!(got[2].as_ref().map(|r| &r.outcome), Ok(&AdvanceOutcome::Committed));
        assert_eq!(store.flow("B".into()).await.unwrap(), (FlowRecord::NEW, Vec::new()), "flow moved alone");
        assert_eq!(store.flow("C".into()).await.unwrap().0.seq, 1);
        assert_eq!(place.text("SELECT CAST(unaccepted AS TEXT) FROM backlog").await.as_deref(), Some("2"));
    })
    .await;
}

fn accepted(event_id: &str, answer: DeliveryAnswer, position: u64) -> Recorded {
    Recorded { event_id: event_id.into(), row_id: None, answer, position, fence: None }
}

/// Two producers on one database, many calls at once against a cap: exactly the cap's worth
/// commit, every other call is refused, and the counter says so. On PostgreSQL each batch is
/// decided without locking the counter and checked when it commits; a batch that no longer
/// fits then is rolled back and decided again on the exact count.
#[tokio::test]
async fn concurrent_producers_fill_the_cap_exactly() {
    on_both("producer_store_cap_race", |place| async move {
        let (a, b) = (place.open(Some(25)).await, place.open(Some(25)).await);
        let calls = (0..80).map(|i| {
            let store = if i % 2 == 0 { &a } else { &b };
            let c = cmd_on(&format!("F{i}"), &format!("F{i}-1"), 0, "reserved", 1, 3);
            async move { store.advance(c).await.unwrap().outcome }
        });
        let got = futures::future::join_all(calls).await;
        let committed = got.iter().filter(|o| **o == AdvanceOutcome::Committed).count();
        assert_eq!(committed, 25, "{got:?}");
        let refused = got.iter().filter(|o| matches!(o, AdvanceOutcome::OutboxFull { .. })).count();
        assert_eq!(refused, 55, "{got:?}");
        assert_eq!(backlog(&a).await.unaccepted, 25, "{}", a.backend());
        assert_eq!(a.unaccepted_after((String::new(), 0), 100).await.unwrap().len(), 25);
    })
    .await;
}

/// PostgreSQL: a batch decided without the counter locked (it fit by its read) whose commit
/// finds that another transaction committed first and filled the outbox is rolled back and
/// decided again on the exact count: refused, nothing written.
#[tokio::test]
async fn a_batch_that_no_longer_fits_at_commit_is_decided_again() {
    let Some(db) = TestDb::create("producer_store_cap_at_commit") else { return };
    let place = Place::Postgres(db);
    let store = place.open(Some(3)).await;
    assert_eq!(outcome(&store, cmd("A1", 0, "reserved", 1, 3)).await, AdvanceOutcome::Committed);
    let Place::Postgres(db) = &place else { unreachable!() };
    // Another writer (a second producer, say) holds two more rows' worth, uncommitted.
    let other = pg_client(db).await;
    other.batch_execute("BEGIN; UPDATE backlog SET unaccepted = unaccepted + 2 WHERE id = 1").await.unwrap();
    let call = tokio::spawn({
        let store = store.clone();
        async move { store.advance(cmd_on("B", "B1", 0, "reserved", 1, 3)).await.unwrap().outcome }
    });
    // The call read 1 (it fits: 1 + 1 <= 3), wrote, and waits at the counter's update.
    let watcher = pg_client(db).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let waiting: i64 =
            watcher.query_one("SELECT count(*) FROM pg_locks WHERE NOT granted", &[]).await.unwrap().get(0);
        if waiting > 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the call never waited for the counter");
        tokio::task::yield_now().await;
    }
    other.batch_execute("COMMIT").await.unwrap();
    assert_eq!(call.await.unwrap(), AdvanceOutcome::OutboxFull { unaccepted: 3 });
    assert_eq!(backlog(&store).await.unaccepted, 3);
    assert_eq!(store.flow("B".into()).await.unwrap().0.seq, 0, "nothing of the refused call stays");
}

#[tokio::test]
async fn a_full_outbox_refuses_new_steps_but_still_answers_retries() {
    on_both("producer_store_cap", |place| async move {
        let store = place.open(Some(2)).await;
        assert_eq!(outcome(&store, cmd("A1", 0, "reserved", 1, 3)).await, AdvanceOutcome::Committed);
        assert_eq!(outcome(&store, cmd("A2", 1, "confirmed", 1, 3)).await, AdvanceOutcome::Committed);
        assert_eq!(
            outcome(&store, cmd("A3", 2, "released", 1, 3)).await,
            AdvanceOutcome::OutboxFull { unaccepted: 2 }
        );
        // Retries and rejections are still answered as usual when full.
        assert_eq!(outcome(&store, cmd("A1", 0, "reserved", 1, 3)).await, AdvanceOutcome::Existing);
        assert_eq!(outcome(&store, cmd("A9", 0, "reserved", 1, 3)).await, AdvanceOutcome::Stale);
        assert_eq!(store.flow("A".into()).await.unwrap().0.seq, 2);
        // Once the relay marks a row accepted (twice: counted once), there is room again.
        let answers =
            vec![accepted("A1", DeliveryAnswer::Accepted, 0), accepted("A1", DeliveryAnswer::Duplicate, 0)];
        store.record_deliveries(answers, None).await.unwrap();
        assert_eq!(backlog(&store).await.unaccepted, 1, "{}", store.backend());
        assert_eq!(outcome(&store, cmd("A3", 2, "released", 1, 3)).await, AdvanceOutcome::Committed);
        // Within one batch, the cap counts the calls before it in the same transaction.
        let answers =
            vec![accepted("A2", DeliveryAnswer::Accepted, 0), accepted("A3", DeliveryAnswer::Accepted, 0)];
        store.record_deliveries(answers, None).await.unwrap();
        assert_eq!(backlog(&store).await.unaccepted, 0);
        let batch = ["B", "C", "D"].map(|f| cmd_on(f, &format!("{f}1"), 0, "reserved", 1, 3));
        let got = futures::future::join_all(batch.map(|c| store.advance(c))).await;
        let got: Vec<_> = got.into_iter().map(|r| r.unwrap().outcome).collect();
        assert_eq!(
            got,
            [
                AdvanceOutcome::Committed,
                AdvanceOutcome::Committed,
                AdvanceOutcome::OutboxFull { unaccepted: 2 }
            ]
        );
        assert_eq!(backlog(&store).await.unaccepted, 2);
    })
    .await;
}

async fn backlog(store: &ProducerStore) -> Backlog {
    let read = store.backlog_gauges(|b| {
        vec![runtime::metrics::GaugeSample {
            name: "unaccepted",
            help: "",
            labels: Vec::new(),
            value: b.unaccepted as f64,
        }]
    });
    let samples = tokio::task::spawn_blocking(move || read()).await.unwrap().unwrap();
    Backlog { unaccepted: samples[0].value as u64, oldest_committed_at_us: None }
}

#[tokio::test]
async fn deliveries_are_recorded_and_only_holding_answers_mark() {
    on_both("producer_store_record", |place| async move {
        let store = place.open(None).await;
        outcome(&store, cmd("A1", 0, "reserved", 1, 3)).await;
        outcome(&store, cmd("A2", 1, "confirmed", 1, 3)).await;
        let where_ = async |id: &str| {
            // Both name the consumer database by a key into `consumer_database`.
            let by = "(SELECT database_id FROM consumer_database c WHERE c.id = accepted_by)";
            place
                .text(&format!(
                    "SELECT coalesce({by}, '-') || '@' || coalesce(CAST(accepted_position AS TEXT), '-')
                     FROM outbox WHERE event_id = '{id}'"
                ))
                .await
                .unwrap()
        };
        let c1 = Some("c1".to_owned());
        // A conflict counts a send and marks nothing; an unknown event id is no error.
        store
            .record_deliveries(
                vec![
                    accepted("A1", DeliveryAnswer::IdConflict, 4),
                    accepted("nope", DeliveryAnswer::Accepted, 5),
                ],
                c1.clone(),
            )
            .await
            .unwrap();
        assert_eq!(store.unaccepted_after((String::new(), 0), 10).await.unwrap().len(), 2);
        assert_eq!(where_("A1").await, "-@-");
        store
            .record_deliveries(
                vec![
                    accepted("A1", DeliveryAnswer::Accepted, 7),
                    accepted("A1", DeliveryAnswer::Duplicate, 0),
                ],
                c1.clone(),
            )
            .await
            .unwrap();
        let row = store.outbox_row("A1".into()).await.unwrap().unwrap();
        assert!(row.accepted);
        assert_eq!((row.attempts, row.last_outcome.as_deref()), (3, Some("DUPLICATE")));
        // A later answer without a position keeps what was recorded.
        assert_eq!(where_("A1").await, "c1@7");
        let left = store.unaccepted_after((String::new(), 0), 10).await.unwrap();
        assert_eq!(left.iter().map(|r| r.event_id.as_str()).collect::<Vec<_>>(), ["A2"]);
        assert_eq!(backlog(&store).await.unaccepted, 1, "{}", store.backend());
        // An unanswered send is counted and leaves the row unaccepted.
        store.record_unanswered(vec!["A2".into(), "A2".into(), "nope".into()]).await.unwrap();
        let row = store.outbox_row("A2".into()).await.unwrap().unwrap();
        assert_eq!((row.accepted, row.attempts, row.last_outcome.as_deref()), (false, 2, Some(NO_ANSWER)));
        assert!(store.outbox_row("nope".into()).await.unwrap().is_none());
    })
    .await;
}

#[tokio::test]
async fn rows_a_consumer_lost_are_unmarked_and_counted_again() {
    on_both("producer_store_lost", |place| async move {
        let store = place.open(None).await;
        for (i, (id, kind)) in
            [("A1", "reserved"), ("A2", "confirmed"), ("A3", "released")].iter().enumerate()
        {
            outcome(&store, cmd(id, i as u64, kind, 1, 3)).await;
        }
        outcome(&store, cmd_on("B", "B1", 0, "reserved", 1, 3)).await;
        let c1 = Some("c1".to_owned());
        let answers = vec![
            accepted("A1", DeliveryAnswer::Accepted, 1),
            accepted("A2", DeliveryAnswer::Accepted, 2),
            accepted("A3", DeliveryAnswer::Accepted, 3),
        ];
        store.record_deliveries(answers, c1.clone()).await.unwrap();
        // Nothing lost: nothing changes.
        let none = store.resend_lost("c1".into(), Lost::Beyond(3)).await.unwrap();
        assert_eq!(none, LostRows { highest_recorded: 3, ..LostRows::default() });
        assert_eq!(backlog(&store).await.unaccepted, 1, "{}", store.backend());
        store
            .record_deliveries(vec![accepted("B1", DeliveryAnswer::Accepted, 1)], Some("c0".into()))
            .await
            .unwrap();
        assert_eq!(backlog(&store).await.unaccepted, 0);
        // c1 restored to position 1, B1 held by another database: A2, A3 and B1 are lost.
        let lost = store.resend_lost("c1".into(), Lost::Beyond(1)).await.unwrap();
        assert_eq!((lost.other_database, lost.beyond_history, lost.highest_recorded), (1, 2, 3));
        assert_eq!(lost.sample, ["A2", "A3", "B1"]);
        assert_eq!(backlog(&store).await.unaccepted, 3);
        let again = store.unaccepted_after((String::new(), 0), 10).await.unwrap();
        assert_eq!(again.iter().map(|r| r.event_id.as_str()).collect::<Vec<_>>(), ["A2", "A3", "B1"]);
        assert_eq!(again[0].last_outcome.as_deref(), Some(LOST_BY_CONSUMER));
        // Paging continues after a cursor in (flow_id, seq) order.
        let page = store.unaccepted_after(("A".into(), 2), 10).await.unwrap();
        assert_eq!(page.iter().map(|r| r.event_id.as_str()).collect::<Vec<_>>(), ["A3", "B1"]);
        assert_eq!(
            store.resend_lost("c1".into(), Lost::Beyond(1)).await.unwrap(),
            LostRows { highest_recorded: 1, ..LostRows::default() }
        );
    })
    .await;
}

/// Probes: the accepted rows of one consumer database page down by position (ties by event
/// id), and exactly the probed rows still recorded at the probed position are unmarked.
#[tokio::test]
async fn rows_a_consumer_no_longer_holds_by_probe_are_unmarked_exactly() {
    on_both("producer_store_probed", |place| async move {
        let store = place.open(None).await;
        assert_eq!(store.recorded_consumer_db().await.unwrap(), None);
        for (i, (id, kind)) in
            [("A1", "reserved"), ("A2", "confirmed"), ("A3", "released")].iter().enumerate()
        {
            outcome(&store, cmd(id, i as u64, kind, 1, 3)).await;
        }
        for flow in ["B", "C", "D"] {
            outcome(&store, cmd_on(flow, &format!("{flow}1"), 0, "reserved", 1, 3)).await;
        }
        let answers = vec![
            accepted("A1", DeliveryAnswer::Accepted, 1),
            accepted("A2", DeliveryAnswer::Accepted, 2),
            accepted("A3", DeliveryAnswer::Accepted, 3),
            // The same position twice (a restored consumer gave it to another event since).
            accepted("D1", DeliveryAnswer::Accepted, 3),
            accepted("B1", DeliveryAnswer::Accepted, 4),
        ];
        store.record_deliveries(answers, Some("c1".into())).await.unwrap();
        assert_eq!(store.recorded_consumer_db().await.unwrap().as_deref(), Some("c1"));
        let page = |below: Option<(u64, &str)>| {
            let store = store.clone();
            let below = below.map(|(p, id)| (p, id.to_owned()));
            async move { store.accepted_page("c1".into(), below, 2, None).await.unwrap() }
        };
        let ids = |rows: Vec<(u64, String)>| {
            rows.into_iter().map(|(p, id)| format!("{p}:{id}")).collect::<Vec<_>>()
        };
        assert_eq!(ids(page(None).await), ["4:B1", "3:D1"]);
        assert_eq!(ids(page(Some((3, "D1"))).await), ["3:A3", "2:A2"]);
        assert_eq!(ids(page(Some((2, "A2"))).await), ["1:A1"]);
        assert!(page(Some((1, "A1"))).await.is_empty());
        assert!(store.accepted_page("c9".into(), None, 2, None).await.unwrap().is_empty());

        // A3 lost; X9 was never recorded; A1 is recorded at 1, not 2: only A3 is unmarked.
        let probed = vec![(3, "A3".to_owned()), (4, "X9".to_owned()), (2, "A1".to_owned())];
        let lost = store.resend_lost("c1".into(), Lost::Probed(probed)).await.unwrap();
        assert_eq!((lost.other_database, lost.beyond_history, lost.compacted), (0, 1, 0), "{lost:?}");
        assert_eq!(lost.sample, ["A3"]);
        assert_eq!(backlog(&store).await.unaccepted, 2, "{}", store.backend());
        let again = store.unaccepted_after((String::new(), 0), 10).await.unwrap();
        assert_eq!(again.iter().map(|r| r.event_id.as_str()).collect::<Vec<_>>(), ["A3", "C1"]);
        assert_eq!(again[0].last_outcome.as_deref(), Some(LOST_BY_CONSUMER));
        // Probed again: no longer recorded accepted, so nothing changes.
        let lost = store.resend_lost("c1".into(), Lost::Probed(vec![(3, "A3".to_owned())])).await.unwrap();
        assert_eq!(lost.beyond_history, 0, "{lost:?}");
        // Positions above the highest judge nothing when probes judge (only other databases).
        store
            .record_deliveries(vec![accepted("C1", DeliveryAnswer::Accepted, 1)], Some("c0".into()))
            .await
            .unwrap();
        let lost = store.resend_lost("c1".into(), Lost::Probed(Vec::new())).await.unwrap();
        assert_eq!((lost.other_database, lost.beyond_history), (1, 0), "{lost:?}");
        assert_eq!(lost.sample, ["C1"]);
        let again = store.unaccepted_after((String::new(), 0), 10).await.unwrap();
        assert_eq!(again.iter().map(|r| r.event_id.as_str()).collect::<Vec<_>>(), ["A3", "C1"]);
    })
    .await;
}

#[tokio::test]
async fn the_relay_refuses_a_database_the_producer_has_not_created() {
    let dir = tempfile::tempdir().unwrap();
    let missing = DbTarget::Sqlite(dir.path().join("none.db"));
    let err = ProducerStore::open(&missing, Role::Relay, CrashSwitch::default()).await.err().unwrap();
    assert!(err.to_string().contains("none.db"), "{err}");
    let Some(db) = TestDb::create("producer_store_relay_open") else { return };
    let target: DbTarget = db.url().parse().unwrap();
    let err = ProducerStore::open(&target, Role::Relay, CrashSwitch::default()).await.err().unwrap();
    assert!(err.to_string().contains("has not been created by the producer"), "{err}");
    assert!(!err.to_string().contains('\n'), "one line: {err}");
    let server = Place::Postgres(db);
    let producer = server.open(None).await;
    let relay = ProducerStore::open(&server.target(), Role::Relay, CrashSwitch::default()).await.unwrap();
    assert_eq!(relay.database_id().await.unwrap(), producer.database_id().await.unwrap());
    assert!(matches!(relay.advance(cmd("A1", 0, "reserved", 1, 3)).await, Err(StoreError::NotSupported(_))));
}

#[test]
fn every_wire_answer_has_its_own_delivery_answer_and_only_two_mark() {
    use pb::ReceiveOutcome as W;
    let table = [
        (W::Accepted, DeliveryAnswer::Accepted, "ACCEPTED", true),
        (W::Duplicate, DeliveryAnswer::Duplicate, "DUPLICATE", true),
        (W::IdConflict, DeliveryAnswer::IdConflict, "ID_CONFLICT", false),
        (W::SequenceConflict, DeliveryAnswer::SequenceConflict, "SEQUENCE_CONFLICT", false),
        (W::Rejected, DeliveryAnswer::Rejected, "REJECTED", false),
        (W::BacklogFull, DeliveryAnswer::BacklogFull, "BACKLOG_FULL", false),
        (W::Unspecified, DeliveryAnswer::Unspecified, "UNSPECIFIED", false),
    ];
    for (wire, answer, word, holds) in table {
        assert_eq!(DeliveryAnswer::from_wire(wire as i32), answer);
        assert_eq!(answer.word(), word);
        // The stored word is the wire name without its prefix: no second spelling.
        assert_eq!(Some(word), wire.as_str_name().strip_prefix("RECEIVE_OUTCOME_"));
        assert_eq!(answer.holds_event(), holds, "{word}");
    }
    assert_eq!(DeliveryAnswer::from_wire(17), DeliveryAnswer::Unknown(17));
    assert_eq!(DeliveryAnswer::Unknown(17).word(), "UNKNOWN_17");
    assert!(!DeliveryAnswer::Unknown(17).holds_event());
}

/// The pure decision: the order of SPEC §5's checks (history first, then seq, then the step,
/// then the cap).
#[test]
fn decide_checks_history_then_seq_then_step_then_cap() {
    let reserved = FlowRecord { seq: 1, state: FlowState::Reserved, amount: 3 };
    let a1 = match decide(&FlowRecord::NEW, None, &cmd("A1", 0, "reserved", 1, 3), Some((0, 1))) {
        Decision::Write { flow, event } => {
            assert_eq!(flow, reserved);
            event
        }
        other => panic!("{other:?}"),
    };
    let reply = |d: Decision| d.into_reply().outcome;
    // History wins over a full outbox, a stale seq and an illegal step.
    assert_eq!(
        reply(decide(&reserved, Some(&a1), &cmd("A1", 0, "reserved", 1, 3), Some((9, 1)))),
        AdvanceOutcome::Existing
    );
    assert_eq!(
        reply(decide(&reserved, Some(&a1), &cmd("A1", 0, "reserved", 1, 4), None)),
        AdvanceOutcome::Conflict
    );
    assert_eq!(
        reply(decide(&reserved, None, &cmd("A9", 0, "reserved", 1, 3), Some((9, 1)))),
        AdvanceOutcome::Stale
    );
    assert!(matches!(
        reply(decide(&reserved, None, &cmd("A9", 1, "released", 1, 3), Some((9, 1)))),
        AdvanceOutcome::InvalidTransition(_)
    ));
    assert_eq!(
        reply(decide(&reserved, None, &cmd("A2", 1, "confirmed", 1, 3), Some((1, 1)))),
        AdvanceOutcome::OutboxFull { unaccepted: 1 }
    );
    assert_eq!(
        reply(decide(&reserved, None, &cmd("A2", 1, "confirmed", 1, 3), Some((0, 1)))),
        AdvanceOutcome::Committed
    );
}

/// Two producers on one PostgreSQL schema (each with its own writer and connection) racing
/// on one flow: the compare-and-set writes decide, never in-process state. Six different
/// event ids at `expected_seq = 0` give one COMMITTED and five STALE; the same event id on
/// both gives one COMMITTED and one EXISTING; one outbox row per step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_producers_on_one_schema_commit_each_step_once() {
    let Some(db) = TestDb::create("producer_store_two_writers") else { return };
    let place = Place::Postgres(db);
    let (one, two) = (place.open(None).await, place.open(None).await);
    for round in 0..5 {
        let flow = format!("R{round}");
        let calls = (0..6).map(|i| {
            let store = if i % 2 == 0 { one.clone() } else { two.clone() };
            let c = cmd_on(&flow, &format!("{flow}-{i}"), 0, "reserved", 1, 3);
            tokio::spawn(async move { store.advance(c).await })
        });
        let mut got = Vec::new();
        for call in calls.collect::<Vec<_>>() {
            got.push(call.await.unwrap().unwrap().outcome);
        }
        let committed = got.iter().filter(|o| **o == AdvanceOutcome::Committed).count();
        let stale = got.iter().filter(|o| **o == AdvanceOutcome::Stale).count();
        assert_eq!((committed, stale), (1, 5), "{got:?}");
        let same = cmd_on(&flow, &format!("{flow}-step2"), 1, "confirmed", 1, 3);
        let (a, b) = tokio::join!(
            tokio::spawn({
                let (store, c) = (one.clone(), same.clone());
                async move { store.advance(c).await }
            }),
            tokio::spawn({
                let (store, c) = (two.clone(), same.clone());
                async move { store.advance(c).await }
            }),
        );
        let mut pair = [a.unwrap().unwrap().outcome, b.unwrap().unwrap().outcome];
        pair.sort_by_key(|o| o != &AdvanceOutcome::Committed);
        assert_eq!(pair, [AdvanceOutcome::Committed, AdvanceOutcome::Existing]);
        let (state, rows) = one.flow(flow.clone()).await.unwrap();
        assert_eq!((state.seq, rows.len()), (2, 2));
    }
    assert_eq!(place.text("SELECT CAST(unaccepted AS TEXT) FROM backlog").await.as_deref(), Some("10"));
}

/// Back from version 6 to 4's shape on PostgreSQL, rows kept: no compaction on acceptance,
/// and each accepted row names its consumer database by the id again (the tests of older
/// upgrades start from there).
const PG_BACK_TO_4: &str = "
    ALTER TABLE backlog DROP COLUMN compact_on_accept_until_us, DROP COLUMN compacted_rows,
        DROP COLUMN compacted_bytes;
    CREATE FUNCTION pg_temp.database_of(k BIGINT) RETURNS TEXT LANGUAGE sql
        AS 'SELECT database_id FROM consumer_database WHERE id = k';
    DROP INDEX outbox_accepted_by;
    ALTER TABLE outbox ALTER COLUMN accepted_by TYPE TEXT USING pg_temp.database_of(accepted_by);
    DROP FUNCTION consumer_key(text);
    DROP TABLE consumer_database;
    CREATE INDEX outbox_accepted_by ON outbox(accepted_by, accepted_position) WHERE accepted = 1;
    UPDATE meta SET schema_version = 4;";

/// Version 1 to 2 in place: rows written before the upgrade get the partition the producer
/// computes ([`proto::partition::flow_partition`]), by the same function in SQL, and the
/// SQL function agrees with the Rust one on ids of every shape.
#[tokio::test]
async fn the_upgrade_to_version_2_computes_every_rows_partition_as_the_producer_does() {
    let Some(db) = TestDb::create("producer_store_upgrade_2") else { return };
    let place = Place::Postgres(db);
    let flows = ["A", "B", "flow-1", "x~y", "a-much-longer-flow-identifier-0123456789"];
    {
        let store = place.open(None).await;
        for (i, flow) in flows.iter().enumerate() {
            let c = cmd_on(flow, &format!("e{i}"), 0, "reserved", 1, 3);
            assert_eq!(outcome(&store, c).await, AdvanceOutcome::Committed);
        }
    }
    // Back to version 1's shape, rows kept.
    place.sql("", PG_BACK_TO_4).await;
    place
        .sql(
            "",
            "DROP TABLE relay_lease; DROP TABLE relay_instance; DROP FUNCTION flow_partition(text);
             ALTER TABLE outbox DROP COLUMN partition, DROP COLUMN marked_by, DROP COLUMN marked_epoch;
             DROP INDEX outbox_compactable;
             ALTER TABLE outbox DROP CONSTRAINT outbox_body_or_digest, DROP COLUMN body_sha256;
             ALTER TABLE outbox ALTER COLUMN body SET NOT NULL;
             ALTER TABLE outbox ADD FOREIGN KEY (flow_id) REFERENCES flow(flow_id);
             UPDATE meta SET schema_version = 1;",
        )
        .await;
    let store = place.open(None).await;
    let Place::Postgres(db) = &place else { unreachable!() };
    let client = pg_client(db).await;
    let version: i32 = client.query_one("SELECT schema_version FROM meta", &[]).await.unwrap().get(0);
    // Every step up to the current one ran (2 is this test's; 3 adds the tombstones, 4 drops
    // the outbox's foreign key).
    assert_eq!(version, KIND_PG_VERSION);
    let rows = client.query("SELECT flow_id, partition FROM outbox", &[]).await.unwrap();
    assert_eq!(rows.len(), flows.len());
    for row in rows {
        let (flow, partition): (String, i16) = (row.get(0), row.get(1));
        assert_eq!(partition as u16, proto::partition::flow_partition(&flow), "{flow}");
    }
    let odd = ["", "x y", "\u{fc}n\u{ef}code"].map(String::from);
    for flow in flows.iter().map(|f| f.to_string()).chain(odd).chain((0..500).map(|i| format!("flow-{i}"))) {
        let sql: i16 = client.query_one("SELECT flow_partition($1)", &[&flow]).await.unwrap().get(0);
        assert_eq!(sql as u16, proto::partition::flow_partition(&flow), "{flow:?}");
    }
    // A row written after the upgrade carries its partition too.
    assert_eq!(
        outcome(&store, cmd_on("late", "late1", 0, "reserved", 1, 3)).await,
        AdvanceOutcome::Committed
    );
    let late: i16 =
        client.query_one("SELECT partition FROM outbox WHERE event_id = 'late1'", &[]).await.unwrap().get(0);
    assert_eq!(late as u16, proto::partition::flow_partition("late"));
}

/// The fence: a mark under a lease another relay has since taken lands on no row, and the
/// store says which partition refused it; the new owner's mark lands.
#[tokio::test]
async fn a_mark_under_a_lost_lease_lands_nowhere() {
    let Some(db) = TestDb::create("producer_store_fence") else { return };
    let place = Place::Postgres(db);
    let store = place.open(None).await;
    assert_eq!(outcome(&store, cmd("A1", 0, "reserved", 1, 3)).await, AdvanceOutcome::Committed);
    assert_eq!(outcome(&store, cmd("A2", 1, "confirmed", 1, 3)).await, AdvanceOutcome::Committed);
    let p = proto::partition::flow_partition("A");
    // r1 takes it with a lease that expires at once; r2 takes it over.
    let r1 = store.lease_acquire("r1", 0, vec![p]).await.unwrap();
    assert_eq!(r1, [(p, 1)]);
    let r2 = store.lease_acquire("r2", 60_000_000, vec![p]).await.unwrap();
    assert_eq!(r2, [(p, 2)]);
    assert!(store.lease_acquire("r3", 60_000_000, vec![p]).await.unwrap().is_empty(), "held by r2");
    let fenced = |owner: &str, epoch| {
        let fence = Fence { owner: owner.into(), partition: p, epoch };
        move |id: &str| Recorded { fence: Some(fence.clone()), ..accepted(id, DeliveryAnswer::Accepted, 0) }
    };
    let late = store.record_deliveries(vec![fenced("r1", 1)("A1")], None).await.unwrap();
    assert_eq!(late, [p]);
    assert_eq!(store.unaccepted_in((String::new(), 0), 10, vec![p]).await.unwrap().len(), 2);
    let on_time = store.record_deliveries(vec![fenced("r2", 2)("A1")], None).await.unwrap();
    assert!(on_time.is_empty());
    let left = store.unaccepted_in((String::new(), 0), 10, vec![p]).await.unwrap();
    assert_eq!(left.iter().map(|r| r.event_id.as_str()).collect::<Vec<_>>(), ["A2"]);
    assert!(store.unaccepted_in((String::new(), 0), 10, vec![(p + 1) % 64]).await.unwrap().is_empty());
    let Place::Postgres(db) = &place else { unreachable!() };
    let client = pg_client(db).await;
    let row = client
        .query_one("SELECT marked_by, marked_epoch FROM outbox WHERE event_id = 'A1'", &[])
        .await
        .unwrap();
    assert_eq!((row.get::<_, Option<String>>(0), row.get::<_, Option<i64>>(1)), (Some("r2".into()), Some(2)));
    let backlog: i64 = client.query_one("SELECT unaccepted FROM backlog", &[]).await.unwrap().get(0);
    assert_eq!(backlog, 1);
    // A heartbeat renews what r2 still holds and not what r1 lost; a release frees it.
    let view = store.lease_heartbeat("r1", 60_000_000, vec![(p, 1)]).await.unwrap();
    assert!(view.renewed.is_empty());
    let view = store.lease_heartbeat("r2", 60_000_000, vec![(p, 2)]).await.unwrap();
    assert_eq!((view.renewed.as_slice(), view.leases.len(), view.live_relays), (&[(p, 2)][..], 64, 2));
    assert!(!view.leases[p as usize].free);
    assert_eq!(store.lease_release("r2", vec![(p, 2)], true).await.unwrap(), [p]);
    let view = store.lease_heartbeat("r1", 60_000_000, Vec::new()).await.unwrap();
    assert!(view.leases[p as usize].free);
    assert_eq!(view.live_relays, 1);
}

/// Retention: compaction reduces accepted rows older than the cutoff to tombstones in bounded
/// batches (never an unaccepted row), answers stay exact against them, and rows a consumer
/// lost that are compacted are never unmarked (they cannot be sent again).
#[tokio::test]
async fn compaction_keeps_answers_exact_and_never_resends_a_tombstone() {
    on_both("producer_store_compact", |place| async move {
        let store = place.open(None).await;
        for (i, (id, kind)) in
            [("A1", "reserved"), ("A2", "confirmed"), ("A3", "released")].iter().enumerate()
        {
            assert_eq!(outcome(&store, cmd(id, i as u64, kind, 1, 3)).await, AdvanceOutcome::Committed);
        }
        outcome(&store, cmd_on("B", "B1", 0, "reserved", 1, 3)).await;
        let (_, rows) = store.flow("A".into()).await.unwrap();
        let bodies: Vec<String> = rows.iter().map(|r| r.body.clone()).collect();
        let answers = vec![
            accepted("A1", DeliveryAnswer::Accepted, 1),
            accepted("A2", DeliveryAnswer::Accepted, 2),
            accepted("A3", DeliveryAnswer::Accepted, 3),
        ];
        store.record_deliveries(answers, Some("c1".into())).await.unwrap();
        // A cutoff before the rows were accepted compacts nothing.
        assert_eq!(store.compact(0, 2, 0, false).await.unwrap().compacted, 0);
        let report = store.compact(runtime::now_us(), 2, 0, false).await.unwrap();
        assert_eq!((report.compacted, report.batches), (3, 2), "{report:?}");
        assert_eq!(report.body_bytes, bodies.iter().map(|b| b.len() as u64).sum::<u64>());
        let (_, rows) = store.flow("A".into()).await.unwrap();
        for (row, body) in rows.iter().zip(&bodies) {
            assert!(row.compacted && row.body.is_empty() && row.accepted, "{row:?}");
            assert_eq!(row.body_sha256, Some(runtime::retention::body_digest(body.as_bytes())));
        }
        let (_, b) = store.flow("B".into()).await.unwrap();
        assert!(!b[0].compacted && !b[0].body.is_empty(), "an unaccepted row is never compacted");
        assert_eq!(store.compact(runtime::now_us(), 2, 0, false).await.unwrap().compacted, 0);
        // EXISTING rebuilds the very body; CONFLICT shows the tombstone.
        let retry = store.advance(cmd("A2", 1, "confirmed", 1, 3)).await.unwrap();
        assert_eq!(retry.outcome, AdvanceOutcome::Existing);
        let event = retry.event.unwrap();
        assert_eq!((event.body.as_str(), event.compacted), (bodies[1].as_str(), false));
        let changed = store.advance(cmd("A2", 1, "confirmed", 2, 3)).await.unwrap();
        assert_eq!(changed.outcome, AdvanceOutcome::Conflict);
        assert!(changed.event.unwrap().compacted);
        // Probes say the consumer lost A2, a tombstone: nothing unmarked.
        let lost = store.resend_lost("c1".into(), Lost::Probed(vec![(2, "A2".to_owned())])).await.unwrap();
        assert_eq!((lost.beyond_history, lost.compacted), (1, 1), "{lost:?}");
        assert_eq!(lost.compacted_sample, ["A2"]);
        assert_eq!(backlog(&store).await.unaccepted, 1);
        // The consumer restored to position 1 lost A2 and A3, both tombstones: nothing unmarked.
        let lost = store.resend_lost("c1".into(), Lost::Beyond(1)).await.unwrap();
        assert_eq!((lost.beyond_history, lost.compacted), (2, 2), "{lost:?}");
        assert_eq!(lost.compacted_sample, ["A2", "A3"]);
        assert_eq!(backlog(&store).await.unaccepted, 1);
        let unaccepted = store.unaccepted_after((String::new(), 0), 10).await.unwrap();
        assert_eq!(unaccepted.iter().map(|r| r.event_id.as_str()).collect::<Vec<_>>(), ["B1"]);
    })
    .await;
}

/// `relay accept-lost`: the compacted rows a consumer lost stay accepted for good
/// (LOST_ACCEPTED, naming no consumer database, so no relay judges them lost again); the
/// lost rows that still have a body are unaccepted again and sent again; one transaction.
#[tokio::test]
async fn accepting_a_loss_keeps_the_compacted_rows_accepted_and_resends_the_rest() {
    on_both("producer_store_accept_lost", |place| async move {
        let store = place.open(None).await;
        for (i, (id, kind)) in
            [("A1", "reserved"), ("A2", "confirmed"), ("A3", "released")].iter().enumerate()
        {
            assert_eq!(outcome(&store, cmd(id, i as u64, kind, 1, 3)).await, AdvanceOutcome::Committed);
        }
        let answers = (1..=3).map(|n| accepted(&format!("A{n}"), DeliveryAnswer::Accepted, n)).collect();
        store.record_deliveries(answers, Some("c1".into())).await.unwrap();
        assert_eq!(store.compact(runtime::now_us(), 10, 0, false).await.unwrap().compacted, 3);
        // C1 is accepted after the compaction: it keeps its body.
        outcome(&store, cmd_on("C", "C1", 0, "reserved", 1, 3)).await;
        store
            .record_deliveries(vec![accepted("C1", DeliveryAnswer::Accepted, 4)], Some("c1".into()))
            .await
            .unwrap();
        assert_eq!(backlog(&store).await.unaccepted, 0);
        // The consumer was restored to position 1: it lacks A2, A3 (tombstones) and C1.
        let probed = vec![(4, "C1".to_owned()), (3, "A3".to_owned()), (2, "A2".to_owned())];
        let refused = store.resend_lost("c1".into(), Lost::Probed(probed.clone())).await.unwrap();
        assert_eq!((refused.beyond_history, refused.compacted, refused.loss_accepted), (3, 2, 0));
        assert_eq!(backlog(&store).await.unaccepted, 0, "a refusal unmarks nothing");

        let done = store.accept_lost("c1".into(), Lost::Probed(probed.clone())).await.unwrap();
        assert_eq!((done.beyond_history, done.compacted, done.loss_accepted), (3, 2, 2), "{done:?}");
        assert_eq!(done.compacted_sample, ["A2", "A3"]);
        let (_, a) = store.flow("A".into()).await.unwrap();
        for row in &a[1..] {
            assert!(row.accepted && row.compacted, "{row:?}");
            assert_eq!(row.last_outcome.as_deref(), Some(LOST_ACCEPTED), "{row:?}");
        }
        assert_eq!(a[0].last_outcome.as_deref(), Some("ACCEPTED"), "A1 was not lost: {:?}", a[0]);
        let (_, c) = store.flow("C".into()).await.unwrap();
        assert!(!c[0].accepted && !c[0].compacted, "{:?}", c[0]);
        assert_eq!(c[0].last_outcome.as_deref(), Some(LOST_BY_CONSUMER));
        assert_eq!(backlog(&store).await.unaccepted, 1);
        let unaccepted = store.unaccepted_after((String::new(), 0), 10).await.unwrap();
        assert_eq!(unaccepted.iter().map(|r| r.event_id.as_str()).collect::<Vec<_>>(), ["C1"]);
        // Judged again, nothing is lost any more: no relay stops on them again.
        let again = store.resend_lost("c1".into(), Lost::Probed(probed)).await.unwrap();
        assert_eq!((again.beyond_history, again.compacted), (0, 0), "{again:?}");
        assert_eq!(store.recorded_consumer_db().await.unwrap().as_deref(), Some("c1"));
    })
    .await;
}

/// Version 2 to 3 (and on) on PostgreSQL in place: rows keep their bodies, and compact afterwards.
#[tokio::test]
async fn the_upgrade_to_version_3_keeps_every_body_and_compacts_afterwards() {
    let Some(db) = TestDb::create("producer_store_upgrade_3") else { return };
    let place = Place::Postgres(db);
    {
        let store = place.open(None).await;
        outcome(&store, cmd("A1", 0, "reserved", 1, 3)).await;
        store.record_deliveries(vec![accepted("A1", DeliveryAnswer::Accepted, 1)], None).await.unwrap();
    }
    // Back to version 2's shape, rows kept. The foreign key is added unnamed, as versions 1-3
    // declared it: the name PostgreSQL gives it is the one version 4 drops.
    place.sql("", PG_BACK_TO_4).await;
    place
        .sql(
            "",
            "DROP INDEX outbox_compactable;
             ALTER TABLE outbox DROP CONSTRAINT outbox_body_or_digest;
             ALTER TABLE outbox DROP COLUMN body_sha256;
             ALTER TABLE outbox ALTER COLUMN body SET NOT NULL;
             ALTER TABLE outbox RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold,
                                       autovacuum_vacuum_insert_scale_factor);
             ALTER TABLE outbox ADD FOREIGN KEY (flow_id) REFERENCES flow(flow_id);
             UPDATE meta SET schema_version = 2;",
        )
        .await;
    let store = place.open(None).await;
    let version = KIND_PG_VERSION.to_string();
    assert_eq!(place.text("SELECT CAST(schema_version AS TEXT) FROM meta").await, Some(version));
    let keys = "SELECT CAST(count(*) AS TEXT) FROM pg_constraint WHERE conname = 'outbox_flow_id_fkey'";
    assert_eq!(place.text(keys).await.as_deref(), Some("0"), "version 4 drops the key");
    let (_, rows) = store.flow("A".into()).await.unwrap();
    assert!(!rows[0].compacted && rows[0].body.contains("\"A1\""), "{rows:?}");
    let body = rows[0].body.clone();
    assert_eq!(store.compact(runtime::now_us(), 10, 0, false).await.unwrap().compacted, 1);
    let (_, rows) = store.flow("A".into()).await.unwrap();
    assert_eq!(rows[0].body_sha256, Some(runtime::retention::body_digest(body.as_bytes())));
    assert_eq!(
        place.text("SELECT reloptions::text FROM pg_class WHERE relname = 'outbox'").await.as_deref(),
        Some(
            "{autovacuum_vacuum_scale_factor=0.02,autovacuum_vacuum_threshold=1000,autovacuum_vacuum_insert_scale_factor=0.02}"
        )
    );
}

/// Version 4 to 5 on PostgreSQL in place: the consumer database ids the accepted rows named
/// become keys into `consumer_database`, every row keeps its database and position, and the
/// reads and marks that name a database by its id go on as before.
#[tokio::test]
async fn the_upgrade_to_version_5_keys_the_consumer_databases_and_keeps_every_position() {
    let Some(db) = TestDb::create("producer_store_upgrade_5") else { return };
    let place = Place::Postgres(db);
    let named = "SELECT string_agg(event_id || ' ' || coalesce(CAST(accepted_by AS TEXT), '-') || '@'
                     || coalesce(CAST(accepted_position AS TEXT), '-'), ', ' ORDER BY event_id) FROM outbox";
    {
        let store = place.open(None).await;
        for (i, flow) in ["A", "B", "C"].iter().enumerate() {
            outcome(&store, cmd_on(flow, &format!("{flow}1"), 0, "reserved", 1, 3)).await;
            let consumer = ["c-old", "c-new", "c-new"][i];
            let answer = accepted(&format!("{flow}1"), DeliveryAnswer::Accepted, 10 + i as u64);
            store.record_deliveries(vec![answer], Some(consumer.into())).await.unwrap();
        }
        outcome(&store, cmd_on("D", "D1", 0, "reserved", 1, 3)).await;
    }
    place.sql("", PG_BACK_TO_4).await;
    assert_eq!(place.text(named).await.as_deref(), Some("A1 c-old@10, B1 c-new@11, C1 c-new@12, D1 -@-"));
    let store = place.open(None).await;
    let version = place.text("SELECT CAST(schema_version AS TEXT) FROM meta").await;
    assert_eq!(version, Some(KIND_PG_VERSION.to_string()));
    let keyed = "SELECT string_agg(o.event_id || ' ' || coalesce(c.database_id, '-') || '@'
                     || coalesce(CAST(o.accepted_position AS TEXT), '-'), ', ' ORDER BY o.event_id)
                 FROM outbox o LEFT JOIN consumer_database c ON c.id = o.accepted_by";
    assert_eq!(place.text(keyed).await.as_deref(), Some("A1 c-old@10, B1 c-new@11, C1 c-new@12, D1 -@-"));
    assert_eq!(
        place
            .text("SELECT data_type FROM information_schema.columns WHERE column_name = 'accepted_by'")
            .await,
        Some("bigint".into())
    );
    // The reads by id: the database of the last key (keys follow the ids' order at the
    // upgrade: the one version 4 read, the largest id), and a database's rows by position.
    assert_eq!(store.recorded_consumer_db().await.unwrap().as_deref(), Some("c-old"));
    let page = store.accepted_page("c-new".into(), None, 10, None).await.unwrap();
    assert_eq!(page, [(12, "C1".to_owned()), (11, "B1".to_owned())]);
    // A mark for a database no row named yet adds its key.
    store
        .record_deliveries(vec![accepted("D1", DeliveryAnswer::Accepted, 3)], Some("c-3".into()))
        .await
        .unwrap();
    assert_eq!(place.text(keyed).await.as_deref(), Some("A1 c-old@10, B1 c-new@11, C1 c-new@12, D1 c-3@3"));
    assert_eq!(
        place.text("SELECT CAST(count(*) AS TEXT) FROM consumer_database").await.as_deref(),
        Some("3")
    );
}

/// PostgreSQL at retention 0: while a serving producer's pass asks for it, a relay's mark
/// drops each newly accepted row's body for its digest in the same statement, and the next
/// pass reports those rows once; without the request (or once it lapsed) a mark keeps the
/// body for the passes. An `Advance` retry of a row compacted so is still `EXISTING`.
#[tokio::test]
async fn marks_compact_while_a_producer_at_retention_0_asks_and_passes_report_them() {
    let Some(db) = TestDb::create("producer_store_compact_on_accept") else { return };
    let place = Place::Postgres(db);
    let store = place.open(None).await;
    for flow in ["A", "B", "C", "D"] {
        assert_eq!(
            outcome(&store, cmd_on(flow, &format!("{flow}1"), 0, "reserved", 1, 3)).await,
            AdvanceOutcome::Committed
        );
    }
    let shown =
        "SELECT string_agg(event_id || ':' || CASE WHEN body IS NULL THEN 'tombstone' ELSE 'body' END,
                     ' ' ORDER BY event_id) FROM outbox";
    let bytes: i64 = {
        let b = place.text("SELECT CAST(sum(octet_length(convert_to(body, 'UTF8'))) AS TEXT) FROM outbox WHERE event_id IN ('A1', 'B1')").await;
        b.unwrap().parse().unwrap()
    };
    let digests = place
        .text("SELECT string_agg(encode(sha256(convert_to(body, 'UTF8')), 'hex'), ' ' ORDER BY event_id) FROM outbox")
        .await;
    // Nothing accepted yet: the pass compacts nothing, and asks relays to compact from now on.
    let first = store.compact(runtime::now_us(), 10, 0, true).await.unwrap();
    assert_eq!((first.compacted, first.when_finished), (0, 0));
    let answers =
        vec![accepted("A1", DeliveryAnswer::Accepted, 1), accepted("B1", DeliveryAnswer::Duplicate, 2)];
    store.record_deliveries(answers, Some("c".into())).await.unwrap();
    assert_eq!(place.text(shown).await.as_deref(), Some("A1:tombstone B1:tombstone C1:body D1:body"));
    let kept = place
        .text(
            "SELECT string_agg(encode(coalesce(body_sha256, sha256(convert_to(body, 'UTF8'))), 'hex'), ' '
             ORDER BY event_id) FROM outbox",
        )
        .await;
    assert_eq!(kept, digests, "the digest of the body each tombstone had");
    // The next pass of any producer reports them, once.
    let report = store.compact(0, 10, 0, false).await.unwrap();
    assert_eq!((report.compacted, report.when_finished, report.body_bytes), (2, 2, bytes as u64));
    assert_eq!(store.compact(0, 10, 0, false).await.unwrap().compacted, 0);
    // The request lapses (as when the last producer at 0 stopped): marks keep the body.
    place.sql("", "UPDATE backlog SET compact_on_accept_until_us = 0").await;
    store
        .record_deliveries(vec![accepted("C1", DeliveryAnswer::Accepted, 3)], Some("c".into()))
        .await
        .unwrap();
    assert_eq!(place.text(shown).await.as_deref(), Some("A1:tombstone B1:tombstone C1:body D1:body"));
    assert_eq!(store.compact(0, 10, 0, false).await.unwrap().compacted, 0);
    // Exact answers against a row compacted on acceptance.
    assert_eq!(outcome(&store, cmd_on("A", "A1", 0, "reserved", 1, 3)).await, AdvanceOutcome::Existing);
    assert_eq!(outcome(&store, cmd_on("A", "A1", 0, "reserved", 1, 4)).await, AdvanceOutcome::Conflict);
    assert_eq!(place.text("SELECT CAST(unaccepted AS TEXT) FROM backlog").await.as_deref(), Some("1"));
}

/// PostgreSQL: relays whose first marks for a consumer database run at once give it one key,
/// and every row they mark names it (none is left without its database).
#[tokio::test]
async fn relays_marking_for_a_new_consumer_database_at_once_record_one_key() {
    let Some(db) = TestDb::create("producer_store_key_race") else { return };
    let place = Place::Postgres(db);
    let stores = futures::future::join_all((0..4).map(|_| place.open(None))).await;
    for i in 0..40 {
        let c = cmd_on(&format!("F{i}"), &format!("F{i}-1"), 0, "reserved", 1, 3);
        assert_eq!(outcome(&stores[0], c).await, AdvanceOutcome::Committed);
    }
    let marks = stores.iter().enumerate().map(|(s, store)| {
        let answers = (s * 10..s * 10 + 10)
            .map(|i| accepted(&format!("F{i}-1"), DeliveryAnswer::Accepted, i as u64 + 1))
            .collect();
        store.record_deliveries(answers, Some("c-race".into()))
    });
    for marked in futures::future::join_all(marks).await {
        marked.unwrap();
    }
    assert_eq!(
        place.text("SELECT CAST(count(*) AS TEXT) FROM consumer_database").await.as_deref(),
        Some("1")
    );
    let named = "SELECT CAST(count(*) AS TEXT) FROM outbox
                 WHERE accepted = 1 AND accepted_by = (SELECT id FROM consumer_database WHERE database_id = 'c-race')";
    assert_eq!(place.text(named).await.as_deref(), Some("40"));
}

/// PostgreSQL, on a history of one consumer database, most of it compacted and analyzed, under
/// either plan the server may cache for a prepared statement: a compaction batch reads the
/// rows it compacts and no others, and the count of rows other databases accepted (which a
/// relay reads at each judgement of its consumer, every second while idle) reads no row.
/// Left to choose, the planner once walked `outbox_accepted_by` past every compacted row for
/// each batch (a pass over 300 000 rows after 600 000 compacted ones took 95 s instead of
/// 5.6), or built a bitmap of every row still to compact (this test's generic plan, before
/// the order); the count read every accepted row (`accepted_by <> $1`: 6 000 here).
#[tokio::test]
async fn postgres_compaction_and_the_lost_rows_count_read_only_their_own_rows() {
    let Some(db) = TestDb::create("producer_compact_reads") else { return };
    let client = pg_client(&db).await;
    let place = Place::Postgres(db);
    drop(place.open(None).await);
    let body = "'{\"amount\":1,\"flow_id\":\"' || f || '\",\"seq\":' || s || '}'";
    place
        .sql(
            "",
            &format!(
                "INSERT INTO consumer_database(database_id) VALUES ('c');
                 INSERT INTO outbox(event_id, flow_id, seq, kind, schema, body, accepted, attempts,
                                    last_outcome, committed_at_us, accepted_at_us, accepted_by,
                                    accepted_position, partition)
                 SELECT f || '-' || s, f, s, 'reserved', 1, {body}, 1, 1, 'ACCEPTED', g, g * 3 + s, 1,
                        g * 3 + s, g % 64
                 FROM generate_series(1, 2000) g, generate_series(1, 3) s,
                      LATERAL (SELECT 'flow' || lpad(g::text, 7, '0') AS f) n;
                 UPDATE outbox SET body_sha256 = sha256(convert_to(body, 'UTF8')), body = NULL
                 WHERE accepted_position < 4000;"
            ),
        )
        .await;
    place.sql("", "VACUUM ANALYZE outbox").await;
    for plan in ["force_custom_plan", "force_generic_plan"] {
        let read = most_rows_a_scan_read(&client, pg::COMPACT_SQL, "(9000000000, 100)", plan).await;
        assert!(read <= 100, "{plan}: one scan read {read} rows for a batch of 100");
        for partitions in ["NULL", "'{1,2}'"] {
            let arguments = format!("(1, {partitions})");
            let read = most_rows_a_scan_read(&client, pg::OTHER_DATABASES_SQL, &arguments, plan).await;
            assert_eq!(
                read, 0,
                "{plan}, partitions {partitions}: the other databases' count read {read} rows"
            );
        }
    }
}

/// PostgreSQL: lost rows that a compaction reduced to tombstones between the lost-rows reads
/// and the unmark (here a trigger compacts each row as it is unmarked) make the whole unmark
/// roll back, and the answer counts them with their first ids, from the one row the unmark
/// statements answer (rows lost by position and by probe alike).
#[tokio::test]
async fn a_postgres_unmark_that_meets_rows_compacted_meanwhile_changes_nothing() {
    let Some(db) = TestDb::create("producer_unmark_compacted") else { return };
    let place = Place::Postgres(db);
    let store = place.open(None).await;
    for (i, (id, kind)) in
        [("A1", "reserved"), ("A2", "confirmed"), ("A3", "released")].into_iter().enumerate()
    {
        outcome(&store, cmd(id, i as u64, kind, 1, 3)).await;
    }
    let answers = (1..=3).map(|i| accepted(&format!("A{i}"), DeliveryAnswer::Accepted, i)).collect();
    store.record_deliveries(answers, Some("c1".into())).await.unwrap();
    place
        .sql(
            "",
            "CREATE FUNCTION compact_on_unmark() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 NEW.body_sha256 := sha256(convert_to(OLD.body, 'UTF8'));
                 NEW.body := NULL;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER compact_on_unmark BEFORE UPDATE ON outbox FOR EACH ROW
             WHEN (OLD.accepted = 1 AND NEW.accepted = 0) EXECUTE FUNCTION compact_on_unmark();",
        )
        .await;
    // A3 lost by position (beyond 2), A1 by probe.
    let lost = store.resend_lost("c1".into(), Lost::Probed(vec![(1, "A1".into())])).await.unwrap();
    assert_eq!((lost.compacted, lost.compacted_sample.clone()), (1, vec!["A1".to_owned()]), "{lost:?}");
    let lost = store.resend_lost("c1".into(), Lost::Beyond(2)).await.unwrap();
    assert_eq!((lost.compacted, lost.compacted_sample.clone()), (1, vec!["A3".to_owned()]), "{lost:?}");
    let state = "SELECT string_agg(event_id || ':' || accepted || ':' || (body IS NULL), ' ' ORDER BY event_id) FROM outbox";
    assert_eq!(place.text(state).await.as_deref(), Some("A1:1:false A2:1:false A3:1:false"));
    assert_eq!(backlog(&store).await.unaccepted, 0);
}

/// SQLite: a pass walks past any number of rows not yet accepted (more than one transaction
/// looks at) to the finished rows after them, and ends at the first row committed after the
/// cutoff instead of reading every younger body: two rows committed after it are left whole
/// even though their acceptance times say otherwise (a clock set back between commit and
/// mark; before, the pass read on to the end and compacted them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_pass_walks_past_unaccepted_rows_and_ends_at_the_cutoff() {
    let place = Place::Sqlite(tempfile::tempdir().unwrap());
    let store = place.open(None).await;
    let advance_all = |flows: Vec<String>| {
        let store = &store;
        async move {
            let steps =
                flows.iter().map(|f| store.advance(cmd_on(f, &format!("{f}-1"), 0, "reserved", 1, 3)));
            for r in futures::future::join_all(steps).await {
                assert_eq!(r.unwrap().outcome, AdvanceOutcome::Committed);
            }
            flows.iter().map(|f| accepted(&format!("{f}-1"), DeliveryAnswer::Accepted, 0)).collect::<Vec<_>>()
        }
    };
    let waiting = runtime::retention::COMPACT_EXAMINE + 100;
    advance_all((0..waiting).map(|i| format!("waiting-{i:05}")).collect()).await;
    let finished = advance_all((0..10).map(|i| format!("finished-{i:02}")).collect()).await;
    store.record_deliveries(finished, None).await.unwrap();
    let cutoff = runtime::now_us();
    let later = advance_all(vec!["later-1".into(), "later-2".into()]).await;
    store.record_deliveries(later, None).await.unwrap();
    place.sql("UPDATE outbox SET accepted_at_us = 1 WHERE flow_id LIKE 'later-%'", "").await;
    let report = store.compact(cutoff, runtime::retention::COMPACT_BATCH, 0, false).await.unwrap();
    assert_eq!((report.compacted, report.batches), (10, 1), "{report:?}");
    let left =
        "SELECT group_concat(flow_id, ' ') FROM (SELECT flow_id FROM outbox JOIN outbox_body USING (id)
                WHERE flow_id NOT LIKE 'waiting-%' ORDER BY flow_id)";
    assert_eq!(place.text(left).await.as_deref(), Some("later-1 later-2"));
    let waiting_left = "SELECT CAST(count(*) AS TEXT) FROM outbox JOIN outbox_body USING (id)
                        WHERE flow_id LIKE 'waiting-%'";
    assert_eq!(place.text(waiting_left).await, Some(waiting.to_string()));
}

/// SQLite: a pass gives the pages the deleted bodies freed back to the file system (a new
/// file has `auto_vacuum = INCREMENTAL`), and the file shrinks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_pass_gives_the_freed_pages_back() {
    let place = Place::Sqlite(tempfile::tempdir().unwrap());
    let store = place.open(None).await;
    let ids: Vec<String> = (0..3000).map(|i| format!("a-long-enough-flow-identifier-{i:05}")).collect();
    let steps = ids.iter().map(|f| store.advance(cmd_on(f, &format!("{f}-1"), 0, "reserved", 1, 3)));
    for r in futures::future::join_all(steps).await {
        assert_eq!(r.unwrap().outcome, AdvanceOutcome::Committed);
    }
    let answers =
        ids.iter().map(|f| accepted(&format!("{f}-1"), DeliveryAnswer::Accepted, 0)).collect::<Vec<_>>();
    store.record_deliveries(answers, None).await.unwrap();
    let report = store.compact(runtime::now_us(), runtime::retention::COMPACT_BATCH, 0, false).await.unwrap();
    assert_eq!((report.compacted, report.batches), (3000, 6), "{report:?}");
    assert!(report.pages_freed.unwrap() > 20, "{report:?}");
    assert!(report.file_bytes_after.unwrap() < report.file_bytes_before.unwrap(), "{report:?}");
}

/// A failure of the file itself (here SQLite's `SQLITE_READONLY`) is an outage `relay run`
/// waits out; a failure of the work (a constraint) is not. Classified by the error's code,
/// not its text.
#[test]
fn storage_outages_are_told_from_failed_work_by_the_error_code() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    rusqlite::Connection::open(&path).unwrap().execute_batch("CREATE TABLE t(x INTEGER NOT NULL)").unwrap();
    let read_only =
        rusqlite::Connection::open_with_flags(&path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let refused = StoreError::from(read_only.execute_batch("INSERT INTO t(x) VALUES (1)").unwrap_err());
    assert!(refused.is_storage_outage(), "{refused:?}");
    let writable = rusqlite::Connection::open(&path).unwrap();
    let failed = StoreError::from(writable.execute_batch("INSERT INTO t(x) VALUES (NULL)").unwrap_err());
    assert!(matches!(failed, StoreError::Storage { .. }) && !failed.is_storage_outage(), "{failed:?}");
}
