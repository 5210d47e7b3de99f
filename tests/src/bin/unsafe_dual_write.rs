//! Negative control (test code only, never in the services): the unsafe dual write. It
//! commits the flow's state change in one transaction and dies (`_exit(81)`) before writing
//! the outbox row in a second one, so the state moves while no event exists to relay.
//!
//! Usage: unsafe_dual_write PRODUCER_DB FLOW_ID (a producer.db path, or the producer's
//! PostgreSQL database URL)

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(db), Some(flow)) = (args.next(), args.next()) else {
        anyhow::bail!("usage: unsafe_dual_write PRODUCER_DB FLOW_ID");
    };
    if db.starts_with("postgres://") || db.starts_with("postgresql://") {
        let mut config: postgres::Config = db.parse()?;
        config.options("-c synchronous_commit=on");
        let mut client = config.connect(postgres::NoTls)?;
        client.execute(
            "INSERT INTO ordered_events_producer.flow(flow_id, seq, state, amount) VALUES ($1, 1, 'reserved', 3)",
            &[&flow],
        )?;
    } else {
        let conn = rusqlite::Connection::open(db)?;
        conn.execute_batch("PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;")?;
        conn.execute("INSERT INTO flow(flow_id, seq, state, amount) VALUES (?1, 1, 'reserved', 3)", [&flow])?;
    }
    // The state change is committed (autocommit); the outbox write would come next.
    eprintln!("unsafe_dual_write: flow committed, dying before the outbox write");
    // _exit has no safe wrapper: std::process::exit would run destructors and flush.
    #[allow(unsafe_code)]
    // SAFETY: _exit ends the process at once, which is the point of this control.
    unsafe {
        libc::_exit(81)
    };
}
