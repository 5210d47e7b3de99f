//! `once`, `send` and `drain`: one stream, then exit. They give up on a consumer they cannot
//! reach (about 10 s) or that stops answering (the answer timeout) with exit 1, and a stop
//! (SIGTERM/SIGINT) ends them after the shutdown grace at most, with exit 1 too, since they
//! did not finish. `drain` waits out a full consumer backlog while it makes progress.

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use producer::store::OutboxRecord;

use crate::backoff::Backoff;
use crate::decision::backlog_progressed;
use crate::error::RelayError;
use crate::ledger::Ledger;
use crate::output::Report;
use crate::pass::{Caps, HeldBack, Source, pass_one};
use crate::session::Session;
use crate::stop::Stop;
use crate::{Config, DrainSettings, ONE_SHOT_CONNECT_DEADLINE};

/// First pause before rows deferred by a full consumer backlog are offered again, and its cap.
const BACKLOG_RETRY: Duration = Duration::from_millis(50);
const BACKLOG_RETRY_CAP: Duration = Duration::from_secs(2);

/// `once`: the first unaccepted row by `(flow_id, seq)`, if any.
pub async fn once(
    config: &Config,
    ledger: &Ledger,
    report: &mut Report,
    stop: &Stop,
) -> Result<(), RelayError> {
    let row = ledger.unaccepted_after((String::new(), 0), 1).await?.into_iter().next();
    match row {
        Some(row) => deliver_one(config, ledger, row, report, stop, "once").await,
        None => Ok(()),
    }
}

/// `send`: the row of `event_id`, accepted or not.
pub async fn send(
    config: &Config,
    ledger: &Ledger,
    event_id: &str,
    report: &mut Report,
    stop: &Stop,
) -> Result<(), RelayError> {
    let row = ledger
        .row(event_id.to_owned())
        .await?
        .ok_or_else(|| RelayError::UnknownEvent(event_id.to_owned()))?;
    deliver_one(config, ledger, row, report, stop, "send").await
}

async fn deliver_one(
    config: &Config,
    ledger: &Ledger,
    row: OutboxRecord,
    report: &mut Report,
    stop: &Stop,
    mode: &'static str,
) -> Result<(), RelayError> {
    let mut session = open(config, ledger, 1, stop, mode).await?;
    let source = Source::Rows(VecDeque::from([row]));
    let result =
        pass_one(&mut session, ledger, source, &HashSet::new(), Caps::single(config), report, stop).await?;
    warn_held_back(&result.held_back);
    if result.sent == 0 {
        // Only a stop ends a pass before its one row is answered.
        return Err(RelayError::Interrupted(mode));
    }
    Ok(())
}

/// `drain`: passes until one sends nothing. A flow held back in a pass is skipped for the
/// rest of the run; rows deferred by a full consumer backlog are offered again after a
/// backoff, for as long as the backlog makes progress (see
/// [`backlog_progressed`]); `settings.max_stall` without any ends the run with exit 1.
pub async fn drain(
    config: &Config,
    settings: DrainSettings,
    ledger: &Ledger,
    report: &mut Report,
    stop: &Stop,
) -> Result<(), RelayError> {
    if ledger.unaccepted_after((String::new(), 0), 1).await?.is_empty() {
        return Ok(());
    }
    let mut session = open(config, ledger, config.window, stop, "drain").await?;
    let mut skip = HashSet::new();
    let mut backoff = Backoff::new(BACKLOG_RETRY, BACKLOG_RETRY_CAP);
    let mut last_progress: Option<Instant> = None;
    let mut previous_deferred: Option<usize> = None;
    // Repeat until a pass sends nothing: rows committed behind the cursor during a pass are
    // found by the next one.
    loop {
        let result =
            pass_one(&mut session, ledger, Source::Unaccepted, &skip, Caps::of(config), report, stop).await?;
        warn_held_back(&result.held_back);
        skip.extend(result.held_back.into_iter().map(|h| h.flow_id));
        if stop.requested() {
            return Err(RelayError::Interrupted("drain"));
        }
        if result.deferred.is_empty() {
            if last_progress.take().is_some() {
                tracing::info!("consumer backlog has room again");
            }
            if result.sent == 0 {
                return Ok(());
            }
            previous_deferred = None;
            continue;
        }
        let deferred = result.deferred.len();
        let now = Instant::now();
        match last_progress {
            None => {
                tracing::info!(
                    rows = deferred, max_stall = ?settings.max_stall,
                    "consumer backlog full: waiting with backoff while it makes progress"
                );
                last_progress = Some(now);
            }
            Some(_) if backlog_progressed(previous_deferred, deferred, result.accepted) => {
                last_progress = Some(now)
            }
            Some(since) if now.duration_since(since) >= settings.max_stall => {
                return Err(RelayError::BacklogStalled { rows: deferred, waited: now.duration_since(since) });
            }
            Some(_) => {}
        }
        if result.accepted > 0 {
            backoff.reset();
        }
        previous_deferred = Some(deferred);
        let wait = backoff.next_wait();
        tracing::debug!(rows = deferred, ?wait, "deferred rows offered again after a pause");
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = stop.asked() => return Err(RelayError::Interrupted("drain")),
        }
    }
}

/// Opens the one stream of a one-shot mode, unless a stop comes first (see [`Session::start`]).
async fn open(
    config: &Config,
    ledger: &Ledger,
    window: usize,
    stop: &Stop,
    mode: &'static str,
) -> Result<Session, RelayError> {
    Session::open(&config.link, window, ONE_SHOT_CONNECT_DEADLINE, ledger, stop).await.map_err(|e| match e {
        RelayError::Interrupted(_) => RelayError::Interrupted(mode),
        e => e,
    })
}

/// One warning per flow held back (a one-shot run never offers that flow again).
fn warn_held_back(held_back: &[HeldBack]) {
    let mut seen = HashSet::new();
    for h in held_back.iter().filter(|h| seen.insert(h.flow_id.as_str())) {
        tracing::warn!(
            flow_id = %h.flow_id, event_id = %h.event_id, outcome = %h.outcome, detail = %h.detail,
            "flow held back: its row was not accepted; it stays unaccepted for an operator"
        );
    }
}
