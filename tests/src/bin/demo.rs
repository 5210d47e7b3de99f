//! `demo`: the end-to-end story with real processes, told as it happens. It starts a
//! producer and a consumer on free ports with fresh database files, moves events with the
//! relay, shows out-of-order arrival (3, 1, 2), a schema-2 step blocking on a consumer that
//! cannot read it, the consumer restarted with `--support-v2` applying the very same stored
//! events, and the three ledgers at the end. It stops every process it started.
//!
//! Run from the repository root: `cargo build --release --bins && target/release/demo`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use harness::{Consumer, Producer, RelayRun, Target, advance, db, relay};
use proto::pb;

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn say(text: &str) {
    println!("{text}");
}

fn stop_word(r: &pb::ApplyResult) -> String {
    let stop = pb::ApplyStop::try_from(r.stop).map(|s| s.as_str_name()).unwrap_or("?");
    let stop = stop.strip_prefix("APPLY_STOP_").unwrap_or(stop);
    match stop {
        "GAP" => format!("GAP (waiting for seq {})", r.waiting_for_seq),
        "BLOCKED" => {
            let reason = pb::BlockReason::try_from(r.reason).map(|s| s.as_str_name()).unwrap_or("?");
            format!(
                "BLOCKED at {} ({})",
                r.blocked_event_id,
                reason.strip_prefix("BLOCK_REASON_").unwrap_or(reason).to_lowercase()
            )
        }
        other => other.to_owned(),
    }
}

fn describe_apply(r: &pb::ApplyResult) -> String {
    let p = r.projection.clone().unwrap_or_default();
    format!(
        "applied {} {:?} -> {}; projection: state {}, last_seq {}, held {}",
        r.applied,
        r.applied_event_ids,
        stop_word(r),
        p.state,
        p.last_seq,
        p.held
    )
}

fn describe_relay(run: &RelayRun) -> String {
    let sent: Vec<String> = run
        .deliveries()
        .map(|d| {
            format!("{} {}", d["event_id"].as_str().unwrap_or("?"), d["outcome"].as_str().unwrap_or("?"))
        })
        .collect();
    format!("relay exit {}: {}", run.code.map_or("signal".into(), |c| c.to_string()), sent.join(", "))
}

fn fresh_dir() -> anyhow::Result<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/demo");
    std::fs::create_dir_all(&root)?;
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs();
    let dir = root.join(format!("run-{stamp}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir.canonicalize()?)
}

async fn run() -> anyhow::Result<()> {
    let dir = fresh_dir()?;
    // The demo shows the embedded default: two SQLite files it leaves behind to look at.
    let producer_db: Target = dir.join("producer.db").into();
    let consumer_db: Target = dir.join("consumer.db").into();
    say("ordered-events demo: every flow's steps applied exactly once and in order.\n");
    let producer = Producer::start_on(producer_db.clone(), dir.join("producer.log"), &[]);
    let mut consumer = Consumer::start_on(consumer_db.clone(), dir.join("consumer.log"), false, &[]);
    say(&format!(
        "Started producer on {} and consumer on {} (v2 decoder off), fresh files in {}.",
        producer.process.addr,
        consumer.process.addr,
        dir.display()
    ));

    say("\n1. Out-of-order arrival");
    for (i, kind) in ["reserved", "confirmed", "released"].iter().enumerate() {
        let r = producer.advance(advance("order-1", &format!("order-1:{}", i + 1), i as u64, kind, 1)).await;
        say(&format!(
            "   producer: Advance order-1 -> {kind}: {} (seq {}), state change and outbox row in one transaction",
            pb::AdvanceOutcome::try_from(r.outcome).map(|o| o.as_str_name()).unwrap_or("?"),
            r.seq
        ));
    }
    say("   The network reorders: the relay delivers seq 3 first, then 1, then 2, applying after each.");
    for seq in [3, 1, 2] {
        let run = relay(
            &producer_db,
            &consumer.process.url(),
            &["send", "--event-id", &format!("order-1:{seq}")],
            &[],
        );
        anyhow::ensure!(run.code == Some(0), "relay failed: {}", run.stderr);
        let applied = consumer.apply("order-1").await;
        say(&format!("   seq {seq} arrives: {}. Apply: {}", describe_relay(&run), describe_apply(&applied)));
    }
    say("   Seq 3 waited in the inbox (accepted, not applied) until 1 and 2 made it the next step.");

    say("\n2. A schema upgrade the consumer cannot read yet");
    for (i, (kind, schema)) in [("reserved", 1), ("confirmed", 2), ("released", 2)].iter().enumerate() {
        let r = producer
            .advance(advance("order-2", &format!("order-2:{}", i + 1), i as u64, kind, *schema))
            .await;
        let body = r.event.map(|e| e.body).unwrap_or_default();
        say(&format!("   producer: order-2 step {} in schema {schema}: {body}", i + 1));
    }
    let run = relay(&producer_db, &consumer.process.url(), &["drain"], &[]);
    say(&format!("   {}", describe_relay(&run)));
    say("   The consumer stored all three verbatim, including the schema-2 ones it cannot decode.");
    let blocked = consumer.apply("order-2").await;
    say(&format!("   Apply: {}", describe_apply(&blocked)));
    let before = db::inbox(&consumer_db);
    for row in before.iter().filter(|r| r.flow_id == "order-2") {
        say(&format!(
            "   inbox {} seq {}: {}{}",
            row.event_id,
            row.seq,
            row.state,
            row.reason.as_ref().map(|r| format!(" ({r})")).unwrap_or_default()
        ));
    }

    say("\n3. Restart the consumer with the v2 decoder (--support-v2), same database file");
    consumer.process.terminate(harness::proc::START_DEADLINE);
    let upgraded = Consumer::start_on(consumer_db.clone(), dir.join("consumer-v2.log"), true, &[]);
    say(&format!("   consumer restarted on {} with --support-v2", upgraded.process.addr));
    let unblocked = upgraded.apply("order-2").await;
    say(&format!("   Apply: {}", describe_apply(&unblocked)));
    let after = db::inbox(&consumer_db);
    let unchanged = before.len() == after.len()
        && before
            .iter()
            .zip(&after)
            .all(|(a, b)| (&a.event_id, a.seq, &a.body) == (&b.event_id, b.seq, &b.body));
    say(&format!(
        "   Stored events unchanged (same ids, seqs and bodies, byte for byte): {}",
        if unchanged { "yes" } else { "NO" }
    ));
    anyhow::ensure!(unchanged, "stored events changed across the restart");

    say("\n4. The three ledgers");
    let outbox = db::outbox(&producer_db);
    let inbox = db::inbox(&consumer_db);
    let effects = db::effects(&consumer_db);
    say(&format!("   committed (producer.db outbox): {} events", outbox.len()));
    say(&format!(
        "   accepted  (outbox accepted=1 / consumer inbox rows): {} / {}",
        outbox.iter().filter(|r| r.accepted).count(),
        inbox.len()
    ));
    say(&format!("   applied   (consumer effects): {}", effects.len()));
    for p in db::projections(&consumer_db) {
        say(&format!(
            "   projection {}: state {}, last_seq {}, held {}",
            p.flow_id, p.state, p.last_seq, p.held
        ));
    }
    for e in &effects {
        say(&format!("   effect {} seq {} {} held {}", e.event_id, e.seq, e.kind, e.held));
    }
    anyhow::ensure!(effects.len() == 6 && outbox.iter().all(|r| r.accepted), "the pipeline did not complete");

    drop(upgraded);
    drop(producer);
    say(&format!(
        "\nAll processes stopped. The database files stay in {} (producer.db, consumer.db; logs beside them).",
        dir.display()
    ));
    Ok(())
}
