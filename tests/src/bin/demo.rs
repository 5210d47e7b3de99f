//! `demo`: the end-to-end story with real processes, told as it happens. It starts a
//! producer and a consumer on free ports with fresh database files, moves events with the
//! relay, shows out-of-order arrival (3, 1, 2), a schema-2 step blocking on a consumer that
//! cannot read it, the consumer restarted with `--support-v2` applying the very same stored
//! events, and the three ledgers at the end. It stops every process it started.
//!
//! `demo --backend postgres` tells the same story on a fresh PostgreSQL database (on the
//! server `ORDERED_EVENTS_TEST_PG_URL` names, default the local one; dropped at the end), and
//! its third act is the upgrade with no downtime: a v1-only consumer and a `--support-v2`
//! consumer serve one database side by side, the old one reports the schema-2 steps BLOCKED
//! and the new one applies them, in order, once; then the old one is stopped.
//!
//! Run from the repository root: `cargo build --release --bins && target/release/demo`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use harness::{Backend, Consumer, Producer, RelayRun, Target, advance, db, relay};
use proto::pb;

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let backend = match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        [] => Backend::Sqlite,
        ["--backend", name] => match name.parse() {
            Ok(backend) => backend,
            Err(e) => {
                eprintln!("demo: --backend: {e}");
                return ExitCode::from(2);
            }
        },
        _ => {
            eprintln!("usage: demo [--backend sqlite|postgres]");
            return ExitCode::from(2);
        }
    };
    match run(backend).await {
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

async fn run(backend: Backend) -> anyhow::Result<()> {
    let dir = fresh_dir()?;
    // By default the demo shows the embedded default: two SQLite files it leaves behind to
    // look at. On PostgreSQL both stores live in one fresh database (their own schemas).
    let pg = match backend {
        Backend::Sqlite => None,
        Backend::Postgres => Some(
            proto::pg::testing::TestDb::create("demo")
                .ok_or_else(|| anyhow::anyhow!("no PostgreSQL server answers (see the line above)"))?,
        ),
    };
    let (producer_db, consumer_db): (Target, Target) = match &pg {
        None => (dir.join("producer.db").into(), dir.join("consumer.db").into()),
        Some(db) => (Target::Postgres(db.url().to_owned()), Target::Postgres(db.url().to_owned())),
    };
    say("ordered-events demo: every flow's steps applied exactly once and in order.\n");
    let producer = Producer::start_on(producer_db.clone(), dir.join("producer.log"), &[]);
    let mut consumer = Consumer::start_on(consumer_db.clone(), dir.join("consumer.log"), false, &[]);
    let place = match &pg {
        None => format!("fresh files in {}", dir.display()),
        Some(db) => format!("fresh PostgreSQL database {} (logs in {})", db.name(), dir.display()),
    };
    say(&format!(
        "Started producer on {} and consumer on {} (v2 decoder off), {place}.",
        producer.process.addr, consumer.process.addr,
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

    let upgraded = if pg.is_some() {
        rolling_upgrade(&producer, consumer, &producer_db, &consumer_db, &dir).await?
    } else {
        say("\n3. Restart the consumer with the v2 decoder (--support-v2), same database file");
        consumer.process.terminate(harness::proc::START_DEADLINE);
        let upgraded = Consumer::start_on(consumer_db.clone(), dir.join("consumer-v2.log"), true, &[]);
        say(&format!("   consumer restarted on {} with --support-v2", upgraded.process.addr));
        let unblocked = upgraded.apply("order-2").await;
        say(&format!("   Apply: {}", describe_apply(&unblocked)));
        upgraded
    };
    let after = db::inbox(&consumer_db);
    // Every row stored before the upgrade is still there, byte for byte (act 3 on PostgreSQL
    // adds order-3's rows after them).
    let unchanged = after.len() >= before.len()
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
    say(&format!("   committed (producer outbox): {} events", outbox.len()));
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
    let expected = if pg.is_some() { 9 } else { 6 };
    anyhow::ensure!(
        effects.len() == expected && outbox.iter().all(|r| r.accepted),
        "the pipeline did not complete"
    );

    drop(upgraded);
    drop(producer);
    match pg {
        None => say(&format!(
            "\nAll processes stopped. The database files stay in {} (producer.db, consumer.db; logs beside them).",
            dir.display()
        )),
        Some(db) => {
            let name = db.name().to_owned();
            drop(db);
            say(&format!(
                "\nAll processes stopped; database {name} dropped. Logs stay in {}.",
                dir.display()
            ));
        }
    }
    Ok(())
}

/// Act 3 on PostgreSQL: the upgrade with no downtime. A `--support-v2` consumer starts beside
/// the running v1-only one, on the same database; both serve. The old one reports the
/// schema-2 steps BLOCKED, the new one applies them in order, once; a new schema-2 flow
/// delivered to the OLD instance is stored there and applied by the new one; then the old
/// instance is stopped. Returns the new instance.
async fn rolling_upgrade(
    producer: &Producer,
    mut old: Consumer,
    producer_db: &Target,
    consumer_db: &Target,
    dir: &Path,
) -> anyhow::Result<Consumer> {
    say("\n3. Upgrade with no downtime: a --support-v2 consumer beside the v1-only one, one database");
    let new = Consumer::start_on(consumer_db.clone(), dir.join("consumer-v2.log"), true, &[]);
    say(&format!(
        "   old consumer on {} (v1 only) and new consumer on {} (--support-v2) both serving",
        old.process.addr, new.process.addr
    ));
    let still_blocked = old.apply("order-2").await;
    say(&format!("   Apply on the old one: {}", describe_apply(&still_blocked)));
    anyhow::ensure!(
        still_blocked.stop == pb::ApplyStop::Blocked as i32 && still_blocked.applied == 0,
        "the v1-only consumer must report order-2 blocked"
    );
    let unblocked = new.apply("order-2").await;
    say(&format!("   Apply on the new one: {}", describe_apply(&unblocked)));
    anyhow::ensure!(
        unblocked.applied_event_ids == ["order-2:2", "order-2:3"],
        "the new consumer must apply order-2's schema-2 steps in order"
    );
    say("   While both serve, a new schema-2 flow arrives through the OLD instance:");
    for (i, (kind, schema)) in [("reserved", 2), ("confirmed", 2), ("released", 2)].iter().enumerate() {
        producer.advance(advance("order-3", &format!("order-3:{}", i + 1), i as u64, kind, *schema)).await;
    }
    let run = relay(producer_db, &old.process.url(), &["drain"], &[]);
    anyhow::ensure!(run.code == Some(0), "relay failed: {}", run.stderr);
    say(&format!("   {}", describe_relay(&run)));
    let old_says = old.apply("order-3").await;
    say(&format!("   Apply on the old one: {}", describe_apply(&old_says)));
    let new_says = new.apply("order-3").await;
    say(&format!("   Apply on the new one: {}", describe_apply(&new_says)));
    anyhow::ensure!(
        old_says.applied == 0 && new_says.applied_event_ids == ["order-3:1", "order-3:2", "order-3:3"],
        "order-3 must be blocked on the old instance and applied, in order, by the new one"
    );
    let again = new.apply("order-3").await;
    anyhow::ensure!(again.applied == 0, "an applied step must not be applied twice");
    old.process.terminate(harness::proc::START_DEADLINE);
    say("   Old instance stopped: the new one served throughout, every step applied once.");
    Ok(new)
}
