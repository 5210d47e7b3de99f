//! TLS to PostgreSQL: the services take libpq's `sslmode` and `sslrootcert` in their URL.
//! With the server's own certificate (Debian's snakeoil, issued to `localhost`), every session
//! of producer, consumer and relay is encrypted and the pipeline delivers; a certificate that
//! does not verify stops a process at start-up in one line that says why, having written
//! nothing.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use harness::background::{RelayDaemon, wait_for};
use harness::db::PgSession;
use harness::proc::{ServerProcess, bin_path, server_args};
use harness::{Consumer, Producer, Target, Workdir, db};
use proto::pb::AdvanceOutcome;

/// The certificate Debian's PostgreSQL serves by default (CN and SAN `localhost`).
const SNAKEOIL: &str = "/etc/ssl/certs/ssl-cert-snakeoil.pem";
const DEADLINE: Duration = Duration::from_secs(60);

/// `target`'s URL with `params` added and its host replaced by `host`.
fn with_tls(target: &Target, host: &str, params: &str) -> Target {
    let url = target.arg().replacen("@127.0.0.1:", &format!("@{host}:"), 1);
    let sep = if url.contains('?') { '&' } else { '?' };
    Target::Postgres(format!("{url}{sep}{params}"))
}

/// True when the server offers TLS with the snakeoil certificate; otherwise says loudly why
/// the test cannot run here (and fails under `ORDERED_EVENTS_REQUIRE_PG=1`, as CI sets).
fn server_offers_tls(target: &Target) -> bool {
    let session = PgSession::connect(&target.arg(), true).expect("connect to the test database");
    let ssl: String = session.run(|c| c.query_one("SHOW ssl", &[]).map(|r| r.get(0))).unwrap().unwrap();
    let ready = ssl == "on" && Path::new(SNAKEOIL).is_file();
    if !ready {
        let why = format!("the PostgreSQL server has ssl={ssl} or {SNAKEOIL} is missing");
        assert!(std::env::var("ORDERED_EVENTS_REQUIRE_PG").as_deref() != Ok("1"), "{why}");
        eprintln!("SKIPPED: {why}");
    }
    ready
}

#[tokio::test]
async fn every_session_is_encrypted_when_the_urls_ask_for_tls() {
    harness::postgres_only!("TLS to a PostgreSQL server");
    let Some(work) = Workdir::for_test() else { return };
    if !server_offers_tls(&work.producer_db()) {
        return;
    }
    // One mode per process: unverified, full verification by name, chain only.
    let producer_db = with_tls(&work.producer_db(), "127.0.0.1", "sslmode=require");
    let consumer_db =
        with_tls(&work.consumer_db(), "localhost", &format!("sslmode=verify-full&sslrootcert={SNAKEOIL}"));
    let relay_db =
        with_tls(&work.producer_db(), "127.0.0.1", &format!("sslmode=verify-ca&sslrootcert={SNAKEOIL}"));
    let producer = Producer::start_on(producer_db, work.path("producer.log"), &[]);
    let consumer = Consumer {
        process: ServerProcess::start(
            "consumer",
            &server_args(&consumer_db, &["--auto-apply"]),
            &[],
            work.path("consumer.log"),
        ),
        db: consumer_db,
    };
    let relay = RelayDaemon::start(
        work.dir.path(),
        "relay",
        &relay_db,
        &consumer.process.url(),
        &["--poll-ms", "10"],
        &[],
    );
    for r in producer.advance_steps("tls-flow", 0, &[1, 1, 1]).await {
        assert_eq!(AdvanceOutcome::try_from(r.outcome), Ok(AdvanceOutcome::Committed), "{r:?}");
    }
    let plain = work.consumer_db();
    wait_for(
        DEADLINE,
        || (db::open_ro(&plain).snapshot(db::count_effects).unwrap_or(0) == 3).then_some(()),
        || format!("the three steps were not applied over TLS; relay log:\n{}", relay.log_text()),
    );
    for (name, log) in [("producer", producer.process.log_text()), ("consumer", consumer.process.log_text())]
    {
        let open = log.lines().find(|l| l.contains("database open")).unwrap_or_default().to_owned();
        assert!(open.contains("tls=TLSv1."), "{name} did not log an encrypted session: {open}");
    }
    // The server's view: every session of the three services on this database is encrypted.
    let Target::Postgres(url) = work.producer_db() else { unreachable!() };
    let session = PgSession::connect(&url, true).unwrap();
    let rows: Vec<(String, bool)> = session
        .run(|c| {
            c.query(
                "SELECT a.application_name, s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
                 WHERE a.datname = current_database() AND a.application_name LIKE 'ordered-events-%'
                   AND a.application_name <> 'ordered-events-harness'",
                &[],
            )
            .map(|rows| rows.iter().map(|r| (r.get(0), r.get(1))).collect())
        })
        .unwrap()
        .unwrap();
    assert!(rows.len() >= 3, "expected the services' sessions, saw {rows:?}");
    assert!(rows.iter().all(|(_, ssl)| *ssl), "a service session is not encrypted: {rows:?}");
    drop(relay);
}

#[test]
fn a_certificate_that_does_not_verify_stops_the_process_in_one_line_and_writes_nothing() {
    harness::postgres_only!("TLS to a PostgreSQL server");
    let Some(work) = Workdir::for_test() else { return };
    if !server_offers_tls(&work.producer_db()) {
        return;
    }
    // The certificate names localhost, not 127.0.0.1; and a CA file that does not exist.
    let cases = [
        (
            format!("sslmode=verify-full&sslrootcert={SNAKEOIL}"),
            "certificate not valid for name \"127.0.0.1\"",
        ),
        (
            "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem".to_owned(),
            "sslrootcert=/nonexistent/ca.pem: cannot read it",
        ),
    ];
    for (params, expected) in cases {
        let target = with_tls(&work.producer_db(), "127.0.0.1", &params);
        let out = Command::new(bin_path("producer"))
            .args(server_args(&target, &[]))
            .output()
            .expect("run the producer");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{params}: {stderr}");
        let last = stderr.lines().last().unwrap_or_default();
        assert!(last.starts_with("producer: error:") && last.contains(expected), "{params}: {stderr}");
    }
    // Nothing was created: the schema does not exist.
    let Target::Postgres(url) = work.producer_db() else { unreachable!() };
    let session = PgSession::connect(&url, true).unwrap();
    let exists: bool = session
        .run(|c| {
            c.query_one("SELECT to_regnamespace('ordered_events_producer') IS NOT NULL", &[])
                .map(|r| r.get(0))
        })
        .unwrap()
        .unwrap();
    assert!(!exists, "a refused process created its schema");
}
