//! The producer over gRPC: the §10 Advance rows and its three crash points.

use harness::db;
use harness::{Producer, Workdir, advance};
use proto::crash::CrashPoint;
use proto::pb::AdvanceOutcome;

fn outcome(r: &proto::pb::AdvanceResponse) -> AdvanceOutcome {
    AdvanceOutcome::try_from(r.outcome).expect("known outcome")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advance_table() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    for (id, seq, kind) in [("A1", 0, "reserved"), ("A2", 1, "confirmed"), ("A3", 2, "released")] {
        let r = producer.advance(advance("A", id, seq, kind, 1)).await;
        assert_eq!(outcome(&r), AdvanceOutcome::Committed, "{id}: {r:?}");
        assert_eq!(r.seq, seq + 1);
    }
    let retry = producer.advance(advance("A", "A1", 0, "reserved", 1)).await;
    assert_eq!(outcome(&retry), AdvanceOutcome::Existing);
    assert_eq!((retry.seq, retry.state.as_str()), (3, "released"));
    let changed_amount = proto::pb::AdvanceRequest { amount: 4, ..advance("A", "A1", 0, "reserved", 1) };
    assert_eq!(outcome(&producer.advance(changed_amount).await), AdvanceOutcome::Conflict);
    assert_eq!(
        outcome(&producer.advance(advance("B", "A1", 0, "reserved", 1)).await),
        AdvanceOutcome::Conflict
    );
    assert_eq!(
        outcome(&producer.advance(advance("A", "A1", 0, "reserved", 2)).await),
        AdvanceOutcome::Conflict
    );
    let stale = producer.advance(advance("A", "A4", 1, "confirmed", 1)).await;
    assert_eq!(outcome(&stale), AdvanceOutcome::Stale);
    assert!(stale.event.is_none());
    let skip = producer.advance(advance("C", "C2", 0, "confirmed", 1)).await;
    assert_eq!(outcome(&skip), AdvanceOutcome::InvalidTransition);
    assert_eq!((skip.seq, skip.state.as_str()), (0, "new"));
    // Only the three committed steps left rows.
    let rows = db::outbox(&producer.db);
    assert_eq!(rows.iter().map(|r| r.event_id.as_str()).collect::<Vec<_>>(), ["A1", "A2", "A3"]);
    assert!(rows.iter().all(|r| !r.accepted));
    assert_eq!(db::flows(&producer.db).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_2_emits_units_and_get_flow_shows_the_outbox() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    producer.advance(advance("S", "S1", 0, "reserved", 1)).await;
    let r = producer.advance(advance("S", "S2", 1, "confirmed", 2)).await;
    assert_eq!(
        r.event.expect("stored event").body,
        r#"{"event_id":"S2","flow_id":"S","kind":"confirmed","payload":{"units":3},"schema":2,"seq":2}"#
    );
    let mut client = producer.client().await;
    let flow = client
        .get_flow(proto::pb::GetFlowRequest { flow_id: "S".into() })
        .await
        .expect("GetFlow")
        .into_inner();
    assert_eq!((flow.seq, flow.state.as_str(), flow.amount), (2, "confirmed", 3));
    assert_eq!(flow.outbox.len(), 2);
    assert_eq!(flow.outbox[1].schema, 2);
    assert!(!flow.outbox[0].accepted);
    let unknown = client
        .get_flow(proto::pb::GetFlowRequest { flow_id: "nope".into() })
        .await
        .expect("GetFlow")
        .into_inner();
    assert_eq!((unknown.seq, unknown.state.as_str(), unknown.outbox.len()), (0, "new", 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_invalid_argument_and_write_nothing() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let mut client = producer.client().await;
    let base = advance("A", "A1", 0, "reserved", 1);
    let cases = [
        ("flow_id", proto::pb::AdvanceRequest { flow_id: String::new(), ..base.clone() }),
        ("event_id", proto::pb::AdvanceRequest { event_id: "x".repeat(129), ..base.clone() }),
        ("kind", proto::pb::AdvanceRequest { kind: "teleported".into(), ..base.clone() }),
        ("schema", proto::pb::AdvanceRequest { schema: 3, ..base.clone() }),
        ("amount", proto::pb::AdvanceRequest { amount: 0, ..base.clone() }),
    ];
    for (field, req) in cases {
        let status = client.advance(req).await.expect_err(field);
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{field}");
        assert!(status.message().starts_with(field), "{field}: {}", status.message());
    }
    assert!(db::outbox(&producer.db).is_empty());
    assert!(db::flows(&producer.db).is_empty());
}

/// Crash before commit leaves neither the flow nor the outbox row; after commit leaves
/// both, and the retry answers EXISTING.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_points() {
    for (point, committed) in [
        (CrashPoint::ProducerAfterFlowUpdate, false),
        (CrashPoint::ProducerAfterOutboxInsert, false),
        (CrashPoint::ProducerAfterCommit, true),
    ] {
        let Some(work) = Workdir::for_test() else { return };
        let mut crashing = Producer::start_armed(work.producer_db(), work.path("producer.log"), point);
        assert!(
            crashing.process.log_text().contains("CRASH POINT ARMED"),
            "{point}: armed point not announced"
        );
        let mut client = crashing.client().await;
        let err = client.advance(advance("A", "A1", 0, "reserved", 1)).await.expect_err("the process dies");
        assert_ne!(err.code(), tonic::Code::Ok);
        crashing.process.wait_crash(point).unwrap_or_else(|e| panic!("{e}"));
        let flows = db::flows(&crashing.db);
        let rows = db::outbox(&crashing.db);
        assert_eq!(flows.len(), usize::from(committed), "{point}: flow rows {flows:?}");
        assert_eq!(rows.len(), usize::from(committed), "{point}: outbox rows {rows:?}");
        // Recover: restart without the crash point and retry the same Advance.
        let producer = Producer::start_on(crashing.db.clone(), work.path("producer2.log"), &[]);
        let retry = producer.advance(advance("A", "A1", 0, "reserved", 1)).await;
        let expected = if committed { AdvanceOutcome::Existing } else { AdvanceOutcome::Committed };
        assert_eq!(outcome(&retry), expected, "{point}");
        assert_eq!(db::outbox(&producer.db).len(), 1, "{point}");
    }
}

/// An EXISTING answer writes nothing, so it never reaches a crash point.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn existing_does_not_fire_a_crash_point() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    producer.advance(advance("A", "A1", 0, "reserved", 1)).await;
    drop(producer);
    let armed =
        Producer::start_armed(work.producer_db(), work.path("p2.log"), CrashPoint::ProducerAfterCommit);
    let retry = armed.advance(advance("A", "A1", 0, "reserved", 1)).await;
    assert_eq!(outcome(&retry), AdvanceOutcome::Existing);
    let stale = armed.advance(advance("A", "A9", 0, "reserved", 1)).await;
    assert_eq!(outcome(&stale), AdvanceOutcome::Stale);
    // Still alive: answers another call.
    assert_eq!(outcome(&armed.advance(advance("A", "A1", 0, "reserved", 1)).await), AdvanceOutcome::Existing);
}
