//! The 22 named scenarios of SPEC §10, each run against fresh processes and judged here
//! against the spec (the experiment runner freezes the same observations in results.json).

use serde_json::{Value, json};

/// Runs a named scenario on the selected backend; `None` (after the SKIPPED line) when that
/// backend is PostgreSQL and no server answers.
async fn run(name: &str) -> Option<Value> {
    if !harness::backend::ready() {
        return None;
    }
    Some(harness::scenarios::run(name).await)
}

fn effects_kinds(consumer: &Value) -> Vec<String> {
    consumer["effects"]
        .as_array()
        .expect("effects")
        .iter()
        .map(|e| e["kind"].as_str().unwrap_or_default().to_owned())
        .collect()
}

fn states(consumer: &Value) -> Vec<(String, Value)> {
    consumer["inbox"]
        .as_array()
        .expect("inbox")
        .iter()
        .map(|r| (r["state"].as_str().unwrap_or_default().to_owned(), r["reason"].clone()))
        .collect()
}

fn one_projection(consumer: &Value) -> (u64, String, i64) {
    let p = &consumer["projection"][0];
    (
        p["last_seq"].as_u64().unwrap_or(0),
        p["state"].as_str().unwrap_or_default().to_owned(),
        p["held"].as_i64().unwrap_or(-1),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsafe_dual_write_moves_state_without_an_event() {
    let Some(r) = run("unsafe_dual_write").await else { return };
    assert_eq!(r["exit_code"], 81);
    assert_eq!(r["producer"]["flows"].as_array().map(Vec::len), Some(1));
    assert_eq!(r["producer"]["flows"][0]["state"], "reserved");
    assert_eq!(r["producer"]["outbox"], json!([]));
    assert_eq!(r["relay"]["idle"], true);
    assert_eq!(r["relay"]["exit_code"], 0);
    assert_eq!(r["consumer"]["inbox"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advance_crash_points() {
    let Some(r) = run("advance_crash_points").await else { return };
    for (p, committed) in r.as_array().expect("points").iter().zip([false, false, true]) {
        assert_eq!(p["exit_code"], 73, "{p}");
        assert_eq!(p["marker"], true, "{p}");
        assert_eq!(p["call_failed"], true, "{p}");
        let rows = usize::from(committed);
        assert_eq!(p["before_recovery"]["flows"].as_array().map(Vec::len), Some(rows), "{p}");
        assert_eq!(p["before_recovery"]["outbox"].as_array().map(Vec::len), Some(rows), "{p}");
        assert_eq!(p["retry"], if committed { "EXISTING" } else { "COMMITTED" }, "{p}");
        assert_eq!(p["after_recovery"]["outbox"].as_array().map(Vec::len), Some(1), "{p}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advance_idempotency() {
    let Some(r) = run("advance_idempotency").await else { return };
    assert_eq!(r["steps"], json!(["COMMITTED", "COMMITTED", "COMMITTED"]));
    assert_eq!(r["retry_step_1_after_step_3"], json!({"outcome": "EXISTING", "seq": 3, "state": "released"}));
    assert_eq!(r["same_id_changed_amount"], "CONFLICT");
    assert_eq!(r["same_id_changed_flow"], "CONFLICT");
    assert_eq!(r["same_id_changed_schema"], "CONFLICT");
    assert_eq!(r["new_id_old_expected_seq"]["outcome"], "STALE");
    assert_eq!(r["skipped_step"], "INVALID_TRANSITION");
    assert_eq!(r["producer"]["outbox"].as_array().map(Vec::len), Some(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_order_3_1_2() {
    let Some(r) = run("out_of_order_3_1_2").await else { return };
    let stages = r["stages"].as_array().expect("stages");
    let summary: Vec<_> = stages
        .iter()
        .map(|s| (s["apply"]["applied"].clone(), s["apply"]["stop"].clone(), s["applied_prefix"].clone()))
        .collect();
    assert_eq!(
        summary,
        [
            (json!(0), json!("GAP"), json!([])),
            (json!(1), json!("GAP"), json!([1])),
            (json!(2), json!("IDLE"), json!([1, 2, 3])),
        ]
    );
    assert_eq!(stages[1]["apply"]["waiting_for_seq"], 2);
    assert_eq!(one_projection(&r["consumer"]), (3, "released".into(), 0));
    assert_eq!(effects_kinds(&r["consumer"]), ["reserved", "confirmed", "released"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_is_not_applied() {
    let Some(r) = run("accepted_is_not_applied").await else { return };
    assert!(r["producer"]["outbox"].as_array().expect("outbox").iter().all(|o| o["accepted"] == true));
    assert_eq!(r["producer"]["outbox"].as_array().map(Vec::len), Some(3));
    assert!(states(&r["consumer"]).iter().all(|(s, _)| s == "pending"));
    assert_eq!(r["consumer"]["inbox"].as_array().map(Vec::len), Some(3));
    assert_eq!(r["consumer"]["projection"], json!([]));
    assert_eq!(r["consumer"]["effects"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_v2_blocks() {
    let Some(r) = run("schema_v2_blocks").await else { return };
    assert_eq!(r["apply"]["applied"], 1);
    assert_eq!(r["apply"]["stop"], "BLOCKED");
    assert_eq!(r["apply"]["reason"], "UNSUPPORTED_SCHEMA");
    assert_eq!(r["apply"]["blocked_event_id"], "A2");
    assert_eq!(
        states(&r["consumer"]),
        [
            ("applied".into(), Value::Null),
            ("blocked".into(), json!("unsupported_schema")),
            ("pending".into(), Value::Null)
        ]
    );
    assert_eq!(one_projection(&r["consumer"]).0, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_v2_unblocks() {
    let Some(r) = run("schema_v2_unblocks").await else { return };
    assert_eq!(r["before_restart"]["apply"]["stop"], "BLOCKED");
    let after = &r["apply_after_restart_with_v2"];
    assert_eq!(after["applied"], 2);
    assert_eq!(after["applied_event_ids"], json!(["A2", "A3"]));
    assert_eq!(after["stop"], "IDLE");
    assert_eq!(r["ids_seqs_bodies_unchanged"], true);
    assert_eq!(one_projection(&r["consumer"]), (3, "released".into(), 0));
    assert!(states(&r["consumer"]).iter().all(|(s, reason)| s == "applied" && reason.is_null()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flow_isolation() {
    let Some(r) = run("flow_isolation").await else { return };
    let results = r["apply_all"].as_array().expect("results");
    assert_eq!(results.len(), 2);
    assert_eq!((results[0]["flow_id"].clone(), results[0]["stop"].clone()), (json!("A"), json!("GAP")));
    assert_eq!(results[0]["projection"], json!({"last_seq": 1, "state": "reserved", "held": 3}));
    assert_eq!((results[1]["flow_id"].clone(), results[1]["stop"].clone()), (json!("B"), json!("IDLE")));
    assert_eq!(results[1]["projection"], json!({"last_seq": 3, "state": "released", "held": 0}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_of_line_default_relay() {
    let Some(r) = run("head_of_line_default_relay").await else { return };
    assert_eq!(r["planted_conflicting_a1"], json!(["ACCEPTED"]));
    for run in r["once_runs"].as_array().expect("runs") {
        assert_eq!(run["outcomes"], json!(["ID_CONFLICT"]));
        assert_eq!(run["exit_code"], 3);
    }
    assert_eq!(r["b1_delivered"], false);
    assert!(r["producer"]["outbox"].as_array().expect("outbox").iter().all(|o| o["accepted"] == false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_event_relay() {
    let Some(r) = run("explicit_event_relay").await else { return };
    assert_eq!(r["b1_delivered_by_once"], false);
    assert_eq!(r["send_b1"]["outcomes"], json!(["ACCEPTED"]));
    assert_eq!(r["send_b1"]["exit_code"], 0);
    assert_eq!(r["apply_b"]["applied"], 1);
    assert_eq!(r["apply_b"]["projection"]["state"], "reserved");
    let outbox = r["producer"]["outbox"].as_array().expect("outbox");
    assert_eq!(
        outbox.iter().map(|o| (o["event_id"].clone(), o["accepted"].clone())).collect::<Vec<_>>(),
        [(json!("A1"), json!(false)), (json!("B1"), json!(true))]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn id_only_consumer_does_the_business_backwards() {
    let Some(r) = run("id_only_consumer").await else { return };
    assert_eq!(r["id_only"], json!({"state": "confirmed", "last_seq": 2, "held": 3}));
    assert_eq!(one_projection(&r["ordered_consumer"]), (3, "released".into(), 0));
    assert_eq!(effects_kinds(&r["ordered_consumer"]), ["reserved", "confirmed", "released"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permutations_converge() {
    let Some(r) = run("permutations_converge").await else { return };
    assert_eq!(r["permutations"], 6);
    assert_eq!(r["all_equal"], true);
    assert_eq!(r["final"]["projection"], json!([3, "released", 0]));
    assert_eq!(r["final"]["effects"], json!([[1, "reserved", 3], [2, "confirmed", 3], [3, "released", 0]]));
    // Each flow: three fresh arrivals and one duplicate.
    assert_eq!(r["receive_answers"], json!({"ACCEPTED": 18, "DUPLICATE": 6}));
}

fn exactly_one_reserved_effect(consumer: &Value) {
    assert_eq!(effects_kinds(consumer), ["reserved"], "{consumer}");
    assert_eq!(one_projection(consumer), (1, "reserved".into(), 3), "{consumer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receive_crash_points() {
    let Some(r) = run("receive_crash_points").await else { return };
    let points = r.as_array().expect("points");
    for (p, (visible, redelivered)) in points.iter().zip([(0usize, "ACCEPTED"), (1, "DUPLICATE")]) {
        assert_eq!((p["exit_code"].clone(), p["marker"].clone()), (json!(73), json!(true)), "{p}");
        assert_eq!(p["before_recovery"]["consumer"]["inbox"].as_array().map(Vec::len), Some(visible), "{p}");
        assert!(p["before_recovery"]["producer"]["outbox"][0]["accepted"] == false, "{p}");
        assert_eq!(p["redelivery"]["outcomes"], json!([redelivered]), "{p}");
        exactly_one_reserved_effect(&p["after_recovery"]["consumer"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_crash_points() {
    let Some(r) = run("relay_crash_points").await else { return };
    let points = r.as_array().expect("points");
    let after_mark = &points[0];
    assert_eq!((after_mark["exit_code"].clone(), after_mark["marker"].clone()), (json!(73), json!(true)));
    assert_eq!(after_mark["before_recovery"]["producer"]["outbox"][0]["accepted"], false);
    assert_eq!(after_mark["before_recovery"]["consumer"]["inbox"][0]["state"], "pending");
    assert_eq!(after_mark["rerun"]["outcomes"], json!(["DUPLICATE"]));
    let after_commit = &points[1];
    assert_eq!((after_commit["exit_code"].clone(), after_commit["marker"].clone()), (json!(73), json!(true)));
    assert_eq!(after_commit["before_recovery"]["producer"]["outbox"][0]["accepted"], true);
    assert_eq!(after_commit["rerun"]["idle"], true);
    for p in points {
        exactly_one_reserved_effect(&p["after_recovery"]["consumer"]);
        assert_eq!(p["after_recovery"]["producer"]["outbox"][0]["accepted"], true);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_crash_points() {
    let Some(r) = run("apply_crash_points").await else { return };
    for (p, committed) in r.as_array().expect("points").iter().zip([false, false, true]) {
        assert_eq!((p["exit_code"].clone(), p["marker"].clone()), (json!(73), json!(true)), "{p}");
        assert_eq!(p["delivery"]["outcomes"], json!(["ACCEPTED"]), "{p}");
        let before = &p["before_recovery"];
        if committed {
            exactly_one_reserved_effect(before);
            assert_eq!(before["inbox"][0]["state"], "applied");
            assert_eq!(p["apply_after_restart"]["applied"], 0);
        } else {
            assert_eq!(before["projection"], json!([]), "{p}");
            assert_eq!(before["effects"], json!([]), "{p}");
            assert_eq!(before["inbox"][0]["state"], "pending", "{p}");
            assert_eq!(p["apply_after_restart"]["applied"], 1);
        }
        exactly_one_reserved_effect(&p["after_recovery"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_trigger_leaves_no_flow_change() {
    let Some(r) = run("outbox_trigger").await else { return };
    assert_eq!(r["error"]["mentions_trigger"], true, "{r}");
    assert_eq!(r["with_trigger"]["flows"], json!([]));
    assert_eq!(r["with_trigger"]["outbox"], json!([]));
    assert_eq!(r["retry_without_trigger"], "COMMITTED");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effect_trigger_leaves_no_projection_change() {
    let Some(r) = run("effect_trigger").await else { return };
    assert_eq!(r["error"]["mentions_trigger"], true, "{r}");
    assert_eq!(r["with_trigger"]["projection"], json!([]));
    assert_eq!(r["with_trigger"]["effects"], json!([]));
    assert_eq!(r["with_trigger"]["inbox"][0]["state"], "pending");
    assert_eq!(r["apply_without_trigger"]["applied"], 1);
    exactly_one_reserved_effect(&r["consumer"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_same_advance() {
    let Some(r) = run("race_same_advance").await else { return };
    assert_eq!(r["answers"], json!({"ADVANCE_OUTCOME_COMMITTED": 1, "ADVANCE_OUTCOME_EXISTING": 5}));
    assert_eq!(r["producer"]["outbox"].as_array().map(Vec::len), Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_stale() {
    let Some(r) = run("race_stale").await else { return };
    assert_eq!(r["answers"], json!({"ADVANCE_OUTCOME_COMMITTED": 1, "ADVANCE_OUTCOME_STALE": 5}));
    assert_eq!(r["outbox_rows"], 1);
    assert_eq!(r["flows"][0]["seq"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_receive() {
    let Some(r) = run("race_receive").await else { return };
    assert_eq!(r["answers"], json!({"RECEIVE_OUTCOME_ACCEPTED": 1, "RECEIVE_OUTCOME_DUPLICATE": 5}));
    assert_eq!(r["consumer"]["inbox"].as_array().map(Vec::len), Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_apply() {
    let Some(r) = run("race_apply").await else { return };
    assert_eq!(r["errors"], 0);
    assert_eq!(r["applied_total"], 3);
    assert_eq!(r["applied_ids"], json!(["A1", "A2", "A3"]));
    assert_eq!(effects_kinds(&r["consumer"]), ["reserved", "confirmed", "released"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_relays() {
    let Some(r) = run("race_relays").await else { return };
    assert_eq!(r["answers_within_allowed_set"], true);
    assert_eq!(r["accepted_total"], 30);
    assert_eq!(r["inbox_rows"], 30);
    assert_eq!(r["outbox_all_accepted"], true);
    assert_eq!(r["exit_codes"], json!({"0": 6}));
}
