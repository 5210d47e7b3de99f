//! The consumer's five crash points and a trigger that rejects the effect insert: what each
//! leaves in consumer.db, and that recovery ends with exactly one effect for the event.

use std::time::Duration;

use harness::db;
use harness::proc::START_DEADLINE;
use harness::{Consumer, Workdir, envelope, reference_envelopes};
use proto::crash::CrashPoint;
use proto::pb::{self, ApplyStop, ReceiveOutcome};

use crate::consumer::{effect_rows, outcomes, projection, reference_effects, stop};

const CRASH_AT: &str = proto::crash::ENV;

fn a1() -> pb::EventEnvelope {
    reference_envelopes("A")[0].clone()
}

/// Starts a consumer armed at `point` and checks it says so.
fn start_armed(work: &Workdir, point: CrashPoint, log: &str) -> Consumer {
    let consumer = Consumer::start_on(work.consumer_db(), work.path(log), false, &[(CRASH_AT, point.name())]);
    assert!(consumer.process.log_text().contains("CRASH POINT ARMED"), "{point}: armed point not announced");
    consumer
}

/// Waits for the armed process to die at `point`: exit 73 and the marker in its log.
fn assert_died_at(consumer: &mut Consumer, point: CrashPoint) {
    let status = consumer.process.wait_exit(START_DEADLINE);
    assert_eq!(status.code(), Some(proto::crash::EXIT_CODE), "{point}: {}", consumer.process.log_text());
    assert!(consumer.process.log_text().contains(&point.marker()), "{point}: marker missing");
}

/// Sends `envelopes` on one Receive stream to a consumer that is expected to die: no answer
/// may arrive (the crash points sit before the answer), only a transport error.
async fn receive_into_crash(consumer: &Consumer, envelopes: Vec<pb::EventEnvelope>) {
    let mut client = consumer.client().await;
    let Ok(response) = client.receive(tokio_stream::iter(envelopes)).await else { return };
    let mut answers = response.into_inner();
    match answers.message().await {
        Err(_) => {}
        Ok(answer) => panic!("the dying consumer answered {answer:?}"),
    }
}

fn inbox_states(consumer: &Consumer) -> Vec<(String, String)> {
    db::inbox(&consumer.db).into_iter().map(|r| (r.event_id, r.state)).collect()
}

fn projection_rows(consumer: &Consumer) -> Vec<(String, u64, String, i64)> {
    db::projections(&consumer.db).into_iter().map(|p| (p.flow_id, p.last_seq, p.state, p.held)).collect()
}

/// Recovery ends the same whatever the point: A1 applied once, projection reserved/1/3.
fn assert_recovered(consumer: &Consumer, point: CrashPoint) {
    assert_eq!(effect_rows(consumer), reference_effects("A")[..1], "{point}");
    assert_eq!(projection_rows(consumer), [("A".into(), 1, "reserved".into(), 3)], "{point}");
    assert_eq!(inbox_states(consumer), [("A1".into(), "applied".into())], "{point}");
}

#[tokio::test]
async fn receive_crash_points() {
    for (point, committed) in
        [(CrashPoint::ConsumerReceiveAfterInsert, false), (CrashPoint::ConsumerReceiveAfterCommit, true)]
    {
        let Some(work) = Workdir::for_test() else { return };
        let mut crashing = start_armed(&work, point, "crash.log");
        receive_into_crash(&crashing, vec![a1()]).await;
        assert_died_at(&mut crashing, point);
        let expected: Vec<(String, String)> =
            if committed { vec![("A1".into(), "pending".into())] } else { Vec::new() };
        assert_eq!(inbox_states(&crashing), expected, "{point}: inbox after the crash");
        assert!(db::effects(&crashing.db).is_empty() && db::projections(&crashing.db).is_empty(), "{point}");

        // Recover: the relay redelivers (it never saw an answer), then Apply.
        let consumer = Consumer::start_on(work.consumer_db(), work.path("recovered.log"), false, &[]);
        let redelivered = consumer.receive(vec![a1()]).await;
        let expected = if committed { ReceiveOutcome::Duplicate } else { ReceiveOutcome::Accepted };
        assert_eq!(outcomes(&redelivered), [expected], "{point}");
        let r = consumer.apply("A").await;
        assert_eq!((r.applied, stop(&r)), (1, ApplyStop::Idle), "{point}");
        assert_recovered(&consumer, point);
    }
}

#[tokio::test]
async fn apply_crash_points() {
    for (point, committed) in [
        (CrashPoint::ConsumerApplyAfterProjection, false),
        (CrashPoint::ConsumerApplyAfterEffect, false),
        (CrashPoint::ConsumerApplyAfterCommit, true),
    ] {
        let Some(work) = Workdir::for_test() else { return };
        let mut crashing = start_armed(&work, point, "crash.log");
        // Receiving writes, but not on the apply path: the process survives it.
        assert_eq!(outcomes(&crashing.receive(vec![a1()]).await), [ReceiveOutcome::Accepted], "{point}");
        let mut client = crashing.client().await;
        let err = client
            .apply(pb::ApplyRequest { flow_id: "A".into(), max_steps: 0 })
            .await
            .expect_err("the process dies inside Apply");
        assert_ne!(err.code(), tonic::Code::Ok);
        assert_died_at(&mut crashing, point);
        if committed {
            assert_eq!(projection_rows(&crashing), [("A".into(), 1, "reserved".into(), 3)], "{point}");
            assert_eq!(effect_rows(&crashing), reference_effects("A")[..1], "{point}");
            assert_eq!(inbox_states(&crashing), [("A1".into(), "applied".into())], "{point}");
        } else {
            assert!(projection_rows(&crashing).is_empty(), "{point}: projection survived a rollback");
            assert!(effect_rows(&crashing).is_empty(), "{point}: effect survived a rollback");
            assert_eq!(inbox_states(&crashing), [("A1".into(), "pending".into())], "{point}");
        }

        let consumer = Consumer::start_on(work.consumer_db(), work.path("recovered.log"), false, &[]);
        let r = consumer.apply("A").await;
        assert_eq!((r.applied, stop(&r)), (if committed { 0 } else { 1 }, ApplyStop::Idle), "{point}");
        assert_eq!(projection(&r), (1, "reserved".into(), 3), "{point}");
        assert_recovered(&consumer, point);
    }
}

/// Answers that write nothing (DUPLICATE, ID_CONFLICT, REJECTED) never reach a receive crash
/// point, and blocking a row is not the apply path.
// Multi-threaded so client connections keep running while `terminate` waits for the exit.
#[tokio::test(flavor = "multi_thread")]
async fn answers_without_a_write_do_not_fire_crash_points() {
    let Some(work) = Workdir::for_test() else { return };
    let mut first = Consumer::start(&work, false, &[]);
    assert_eq!(outcomes(&first.receive(vec![a1()]).await), [ReceiveOutcome::Accepted]);
    first.process.terminate(Duration::from_secs(30));
    for (i, point) in [CrashPoint::ConsumerReceiveAfterInsert, CrashPoint::ConsumerReceiveAfterCommit]
        .into_iter()
        .enumerate()
    {
        let armed = start_armed(&work, point, &format!("armed-{i}.log"));
        let conflicting = pb::EventEnvelope { payload_json: r#"{"amount":4}"#.into(), ..a1() };
        let rejected = pb::EventEnvelope { seq: 0, ..a1() };
        let answers = armed.receive(vec![a1(), conflicting, rejected]).await;
        assert_eq!(
            outcomes(&answers),
            [ReceiveOutcome::Duplicate, ReceiveOutcome::IdConflict, ReceiveOutcome::Rejected],
            "{point}"
        );
        // Still alive and answering.
        assert_eq!(armed.get_flow("A").await.inbox.len(), 1, "{point}");
        assert!(!armed.process.log_text().contains(&point.marker()), "{point}");
    }
    let armed = start_armed(&work, CrashPoint::ConsumerApplyAfterProjection, "armed-apply.log");
    assert_eq!(
        outcomes(&armed.receive(vec![envelope("B", 1, "reserved", 2, r#"{"units":3}"#)]).await),
        [ReceiveOutcome::Accepted]
    );
    let r = armed.apply("B").await;
    assert_eq!(stop(&r), ApplyStop::Blocked);
    let idle = armed.apply("nothing-here").await;
    assert_eq!(stop(&idle), ApplyStop::Idle);
    assert_eq!(armed.get_flow("B").await.inbox[0].state, "blocked");
}

/// A test trigger failing every effect insert of flow A.
const REJECT_EFFECT_OF_A: db::Trigger = db::Trigger {
    name: "reject_effect",
    store: db::Store::Consumer,
    table: "effect",
    when: Some("NEW.flow_id = 'A'"),
    message: "effect insert rejected by the test trigger",
    stored: Some(db::StoredRows {
        table: "effect_log",
        sqlite_when: Some("(SELECT flow_id FROM inbox WHERE rowid = NEW.position) = 'A'"),
        pg_when: Some(
            "(SELECT flow_id FROM ordered_events_consumer.inbox WHERE position = NEW.position) = 'A'",
        ),
    }),
};

/// A trigger that rejects the effect insert: Apply answers an error status, and projection,
/// effect and inbox mark all roll back; other flows in ApplyAll go on. Without the trigger
/// the same rows apply.
// Multi-threaded so client connections keep running while `terminate` waits for the exit.
#[tokio::test(flavor = "multi_thread")]
async fn effect_trigger_rolls_the_whole_step_back() {
    let Some(work) = Workdir::for_test() else { return };
    let mut consumer = Consumer::start(&work, false, &[]);
    assert_eq!(
        outcomes(&consumer.receive(vec![a1(), reference_envelopes("B")[0].clone()]).await),
        [ReceiveOutcome::Accepted, ReceiveOutcome::Accepted]
    );
    consumer.process.terminate(Duration::from_secs(30));
    REJECT_EFFECT_OF_A.install(&work.consumer_db());

    let mut consumer = Consumer::start_on(work.consumer_db(), work.path("trigger.log"), false, &[]);
    let mut client = consumer.client().await;
    let status = client
        .apply(pb::ApplyRequest { flow_id: "A".into(), max_steps: 0 })
        .await
        .expect_err("the step must fail, not be reported as applied");
    assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
    assert!(status.message().contains("effect insert rejected by the test trigger"), "{}", status.message());
    assert!(projection_rows(&consumer).is_empty(), "projection changed without its effect");
    assert!(effect_rows(&consumer).is_empty());
    let inbox = db::inbox(&consumer.db);
    assert_eq!(
        (inbox[0].event_id.as_str(), inbox[0].state.as_str(), inbox[0].reason.as_deref()),
        ("A1", "pending", None)
    );

    let all = consumer.apply_all(0).await;
    let a = &all.results[0];
    assert_eq!((a.flow_id.as_str(), a.applied), ("A", 0));
    assert!(a.error.contains("effect insert rejected by the test trigger"), "{a:?}");
    let b = &all.results[1];
    assert_eq!((b.flow_id.as_str(), b.applied, stop(b), b.error.as_str()), ("B", 1, ApplyStop::Idle, ""));
    assert_eq!(projection_rows(&consumer), [("B".into(), 1, "reserved".into(), 3)]);

    consumer.process.terminate(Duration::from_secs(30));
    REJECT_EFFECT_OF_A.remove(&work.consumer_db());
    let consumer = Consumer::start_on(work.consumer_db(), work.path("no-trigger.log"), false, &[]);
    let r = consumer.apply("A").await;
    assert_eq!((r.applied, stop(&r), projection(&r)), (1, ApplyStop::Idle, (1, "reserved".into(), 3)));
    let effects: Vec<_> = effect_rows(&consumer).into_iter().map(|e| e.0).collect();
    assert_eq!(effects, ["B1", "A1"]);
}
