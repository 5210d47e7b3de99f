//! The PostgreSQL side of [`crate::measure`]: the same stages, latencies and end-state check,
//! read with this module's own queries from the run's database (producer and consumer
//! schemas side by side), and the CPU time of the server processes that worked for the run.
//! Blocking calls: run them on blocking threads, as the SQLite readers are.

use std::time::{Duration, Instant};

use postgres::{Client, NoTls};

use crate::measure::{Stage, Tables, Verified, percentiles};

const PRODUCER: &str = "ordered_events_producer";
const CONSUMER: &str = "ordered_events_consumer";

fn connect(url: &str) -> anyhow::Result<Client> {
    Ok(Client::connect(url, NoTls)?)
}

fn one(client: &mut Client, sql: &str) -> anyhow::Result<i64> {
    Ok(client.query_one(sql, &[])?.get::<_, Option<i64>>(0).unwrap_or(0))
}

/// Where the consumer schema numbers its effects in apply order: `(table, column)`. Since
/// consumer schema 7 `effect` is a view joining `effect_log` to the inbox, whose maximum or
/// count would join every row at every poll; the table itself has the numbers, indexed.
pub fn apply_order(client: &mut Client) -> anyhow::Result<(&'static str, &'static str)> {
    let keyed: bool =
        client.query_one("SELECT to_regclass($1) IS NOT NULL", &[&format!("{CONSUMER}.effect_log")])?.get(0);
    Ok(if keyed { ("effect_log", "applied") } else { ("effect", "position") })
}

/// Waits until `events` effects exist and no outbox row is unaccepted. Polls with a deadline.
pub fn wait_until_applied(url: &str, events: u64, deadline: Duration) -> anyhow::Result<()> {
    let mut client = connect(url)?;
    let until = Instant::now() + deadline;
    let mut pause = Duration::from_millis(1);
    let (effects, order) = apply_order(&mut client)?;
    loop {
        // Apply-order numbers come from an identity column: their maximum is at least the
        // count, so the count is taken only once the maximum says it can be complete.
        let top = one(&mut client, &format!("SELECT max({order}) FROM {CONSUMER}.{effects}"))? as u64;
        let applied = if top >= events {
            one(&mut client, &format!("SELECT count(*) FROM {CONSUMER}.{effects}"))? as u64
        } else {
            0
        };
        let unaccepted = if applied >= events {
            Some(one(&mut client, &format!("SELECT count(*) FROM {PRODUCER}.outbox WHERE accepted = 0"))?)
        } else {
            None
        };
        if unaccepted == Some(0) {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < until,
            "the pipeline did not finish within {deadline:?}: {applied} of {events} applied, {unaccepted:?} outbox rows unaccepted"
        );
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

fn stage(client: &mut Client, table: &str, column: &str) -> anyhow::Result<Stage> {
    let row = client
        .query_one(&format!("SELECT count({column}), min({column}), max({column}) FROM {table}"), &[])?;
    let (events, first_us, last_us): (i64, Option<i64>, Option<i64>) = (row.get(0), row.get(1), row.get(2));
    let (first_us, last_us) = (first_us.unwrap_or(0), last_us.unwrap_or(0));
    let span = (last_us - first_us).max(1) as f64 / 1e6;
    Ok(Stage { events: events as u64, first_us, last_us, events_per_s: events as f64 / span })
}

/// Reads stages, latencies and the end state of one run.
pub fn read_tables(url: &str, flows: u64) -> anyhow::Result<Tables> {
    let mut client = connect(url)?;
    let mut deltas = |expr: &str| -> anyhow::Result<Vec<i64>> {
        let rows = client.query(
            &format!(
                "SELECT {expr} FROM {CONSUMER}.inbox i JOIN {PRODUCER}.outbox o ON o.event_id = i.event_id
                 WHERE i.applied_at_us IS NOT NULL"
            ),
            &[],
        )?;
        Ok(rows.iter().map(|r| r.get::<_, i64>(0)).collect())
    };
    let commit_to_applied = percentiles(deltas("i.applied_at_us - o.committed_at_us")?);
    let commit_to_received = percentiles(deltas("i.received_at_us - o.committed_at_us")?);
    let flows_released = one(
        &mut client,
        &format!("SELECT count(*) FROM {CONSUMER}.projection WHERE state = 'released' AND last_seq = 3"),
    )? as u64;
    let effects = one(&mut client, &format!("SELECT count(*) FROM {CONSUMER}.effect"))? as u64;
    let inbox_unapplied =
        one(&mut client, &format!("SELECT count(*) FROM {CONSUMER}.inbox WHERE state <> 'applied'"))? as u64;
    let outbox_unaccepted =
        one(&mut client, &format!("SELECT count(*) FROM {PRODUCER}.outbox WHERE accepted = 0"))? as u64;
    let per_flow_ok = one(
        &mut client,
        &format!(
            "SELECT count(*) FROM (
                 SELECT flow_id, string_agg(kind, ',' ORDER BY seq) AS kinds, count(*) AS n
                 FROM {CONSUMER}.effect GROUP BY flow_id) f
             WHERE n = 3 AND kinds = 'reserved,confirmed,released'"
        ),
    )? as u64;
    Ok(Tables {
        committed: stage(&mut client, &format!("{PRODUCER}.outbox"), "committed_at_us")?,
        received: stage(&mut client, &format!("{CONSUMER}.inbox"), "received_at_us")?,
        marked_accepted: stage(&mut client, &format!("{PRODUCER}.outbox"), "accepted_at_us")?,
        applied: stage(&mut client, &format!("{CONSUMER}.inbox"), "applied_at_us")?,
        commit_to_applied,
        commit_to_received,
        verified: Verified {
            ok: flows_released == flows
                && per_flow_ok == flows
                && effects == flows * 3
                && inbox_unapplied == 0
                && outbox_unaccepted == 0,
            flows_released,
            effects,
            inbox_unapplied,
            outbox_unaccepted,
        },
    })
}

/// The server's durability settings as a fresh session of the run's database sees them (the
/// services force `synchronous_commit=on` on their own sessions and log it).
pub fn server_settings(url: &str) -> anyhow::Result<serde_json::Value> {
    let mut client = connect(url)?;
    let row = client.query_one(
        "SELECT current_setting('server_version'), current_setting('fsync'),
                current_setting('synchronous_commit'), current_setting('full_page_writes'),
                current_setting('wal_sync_method'), current_setting('shared_buffers')",
        &[],
    )?;
    Ok(serde_json::json!({
        "server_version": row.get::<_, String>(0),
        "fsync": row.get::<_, String>(1),
        "synchronous_commit_default": row.get::<_, String>(2),
        "full_page_writes": row.get::<_, String>(3),
        "wal_sync_method": row.get::<_, String>(4),
        "shared_buffers": row.get::<_, String>(5),
    }))
}

/// The server processes that work for a run on database `name`: its client backends and the
/// server's own background processes (WAL writer, checkpointer, background writer, …), as
/// pid → CPU seconds so far. Taken at the start and the end of the run; the difference is the
/// server's CPU for the run (a backend that started and ended between the two readings is
/// missed, which the services' long-lived pools make rare).
pub fn server_cpu(url: &str, name: &str) -> anyhow::Result<std::collections::BTreeMap<u32, f64>> {
    let mut client = connect(url)?;
    let rows = client.query(
        "SELECT pid FROM pg_stat_activity
         WHERE (datname = $1 AND pid <> pg_backend_pid()) OR backend_type <> 'client backend'",
        &[&name],
    )?;
    Ok(rows
        .iter()
        .map(|r| {
            let pid = r.get::<_, i32>(0) as u32;
            (pid, crate::pipeline::proc_stats(&pid.to_string()).cpu_seconds)
        })
        .collect())
}

/// CPU seconds the server spent between two [`server_cpu`] readings.
pub fn server_cpu_between(
    before: &std::collections::BTreeMap<u32, f64>,
    after: &std::collections::BTreeMap<u32, f64>,
) -> f64 {
    after.iter().map(|(pid, cpu)| (cpu - before.get(pid).copied().unwrap_or(0.0)).max(0.0)).sum()
}
