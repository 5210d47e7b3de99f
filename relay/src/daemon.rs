//! `run`: passes for ever until a stop, over one `Receive` stream per reachable `--consumer`
//! (consumer instances on one database), each flow on one stream per pass. Any failure of a
//! link (unreachable, stream error, a consumer that stopped answering) drops that stream and
//! reconnects it in the background after a capped, jittered backoff while the other streams
//! carry its flows, so no failure makes it spin; each change of a link's state and of a
//! flow's state is logged once, not on every retry. Held-back flows are offered again after
//! their own backoff, so a stuck conflict costs one attempt per backoff, not one per poll.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tonic::transport::Channel;

use crate::backoff::Backoff;
use crate::error::RelayError;
use crate::lease::Leases;
use crate::ledger::Ledger;
use crate::output::Report;
use crate::pass::{Caps, PassResult, Source, pass};
use crate::session::Session;
use crate::stop::Stop;
use crate::{Config, Link, RunSettings};

/// First reconnect pause (the cap is `--max-backoff-ms`).
const RECONNECT_FIRST: Duration = Duration::from_millis(100);
/// First pause before a held-back flow's row is offered again, and its cap.
const HELD_RETRY: Duration = Duration::from_millis(500);
const HELD_RETRY_CAP: Duration = Duration::from_secs(60);
/// First pause before a flow deferred by a full backlog is offered again (the cap is
/// `--max-backoff-ms`).
const DEFERRED_RETRY: Duration = Duration::from_millis(50);

/// The link to the consumer as last logged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LinkState {
    Starting,
    Delivering,
    Down(&'static str),
}

/// A flow not offered until `until`.
struct Waiting {
    until: Instant,
    backoff: Backoff,
    /// The answer that put it here (held-back flows), logged again only when it changes.
    outcome: String,
}

/// An idle `Receive` stream is closed (and a new one opened when rows come) after this
/// long: well inside the consumer's default idle-stream timeout (5 minutes), which would
/// otherwise end it and make the next send look like a link failure.
const RENEW_IDLE_STREAM: Duration = Duration::from_secs(60);

/// While no stream is open and a connection is being made, how often `run` looks whether it
/// is.
const CONNECTING_POLL: Duration = Duration::from_millis(20);

/// One `--consumer` and its stream, as `run` keeps it.
struct Outlet {
    link: Link,
    session: Option<Session>,
    /// The link's state as last logged.
    state: LinkState,
    reconnect: Backoff,
    /// No new connection is tried before this.
    retry_at: Instant,
    /// A connection being made in the background (passes go on over the other streams).
    connecting: Option<JoinHandle<Result<Channel, RelayError>>>,
}

impl Outlet {
    fn new(link: Link, settings: RunSettings) -> Outlet {
        Outlet {
            link,
            session: None,
            state: LinkState::Starting,
            reconnect: Backoff::new(RECONNECT_FIRST, settings.max_backoff),
            retry_at: Instant::now(),
            connecting: None,
        }
    }

    /// Between passes, for an outlet with no stream: starts connecting when its backoff is
    /// over, and opens the stream once the connection is made (judging the consumer then:
    /// nothing is in flight on any stream).
    async fn tend(
        &mut self,
        window: usize,
        ledger: &Ledger,
        stop: &Stop,
        max_backoff: Duration,
    ) -> Result<(), RelayError> {
        if self.session.is_some() {
            return Ok(());
        }
        let Some(task) = self.connecting.as_mut() else {
            if Instant::now() >= self.retry_at {
                let link = self.link.clone();
                self.connecting =
                    Some(tokio::spawn(async move { crate::connect::channel(&link, Duration::ZERO).await }));
            }
            return Ok(());
        };
        if !task.is_finished() {
            return Ok(());
        }
        let connected = match task.await {
            Ok(connected) => connected,
            Err(e) => Err(RelayError::Stream(format!("connecting: {e}"))),
        };
        self.connecting = None;
        let opened = match connected {
            Ok(channel) => Session::start(channel, &self.link, window, ledger, stop).await,
            Err(e) => Err(e),
        };
        match opened {
            Ok(session) => self.session = Some(session),
            // A stop came while the consumer was asked: no session, and the run ends.
            Err(RelayError::Interrupted(_)) => {}
            Err(e) if e.is_retried_by_run() => self.down(&e, max_backoff),
            Err(e) => return Err(e),
        }
        Ok(())
    }

    /// The stream failed (or could not be opened): dropped, the failure logged once per
    /// change of kind, and a new connection tried after the backoff.
    fn down(&mut self, e: &RelayError, max_backoff: Duration) {
        link_down(&mut self.state, &self.link.url, e, max_backoff);
        self.session = None;
        self.retry_at = Instant::now() + self.reconnect.next_wait();
    }

    /// The stream carried its answers (or had nothing to carry): the link works.
    fn delivering(&mut self) {
        if self.state != LinkState::Delivering {
            tracing::info!(url = %self.link.url, "consumer reachable; delivering");
            self.state = LinkState::Delivering;
        }
        self.reconnect.reset();
    }
}

/// Runs passes until `stop`; in-flight answers are recorded first (within the grace).
pub async fn run(
    config: &Config,
    settings: RunSettings,
    ledger: &Ledger,
    report: &mut Report,
    stop: &Stop,
) -> Result<(), RelayError> {
    // On PostgreSQL several relays share the outbox: this one works on the partitions its
    // leases hold, kept by a heartbeat task; on SQLite it serves the whole outbox alone.
    let leases = ledger.has_leases().then(|| Leases::new(settings.lease_ttl));
    let leased_ledger;
    let mut keeper = None;
    let ledger = match &leases {
        Some(leases) => {
            tracing::info!(
                instance = leases.instance(), ttl = ?settings.lease_ttl,
                "sharing the outbox with other relays through partition leases"
            );
            let _ = crate::lease::CURRENT.set(leases.clone());
            leased_ledger = ledger.clone().with_leases(leases.clone());
            keeper = Some(tokio::spawn(leases.clone().keep(ledger.clone(), stop.clone())));
            &leased_ledger
        }
        None => ledger,
    };
    // Consumers on one database: one stream to each reachable one at once.
    let mut outlets: Vec<Outlet> = if config.consumers.len() > 1 {
        config
            .consumers
            .iter()
            .map(|url| Outlet::new(Link { url: url.clone(), ..config.link.clone() }, settings))
            .collect()
    } else {
        vec![Outlet::new(config.link.clone(), settings)]
    };
    let mut held: HashMap<String, Waiting> = HashMap::new();
    let mut deferred: HashMap<String, Waiting> = HashMap::new();
    // Polling adapts: right after a pass that sent something the next poll comes soon (new
    // rows usually follow), and each idle pass doubles the pause up to `--poll-ms`, so an
    // idle relay costs what it did with a fixed interval and a busy one finds rows sooner.
    let mut idle_poll =
        Backoff::new((settings.poll_interval / 16).max(Duration::from_millis(1)), settings.poll_interval);
    let mut progress = Progress { at: Instant::now(), sent: 0 };
    'passes: while !stop.requested() {
        if let Some(leases) = &leases {
            // Between passes nothing is in flight: extras over the fair share go back now.
            leases.release_marked(ledger).await;
            report.set_partitions(leases.held());
        }
        progress.maybe_write(report, settings);
        for outlet in &mut outlets {
            outlet.tend(config.window, ledger, stop, settings.max_backoff).await?;
        }
        // Leases taken since the last pass (a dead relay's partitions, a share gained by
        // rebalancing) are judged against each consumer before any of their rows is read.
        for i in 0..outlets.len() {
            let outlet = &mut outlets[i];
            let Some(session) = outlet.session.as_mut() else { continue };
            match session.judge_new(&outlet.link, ledger, stop).await {
                Ok(()) => {}
                // A stop came while the consumer was asked: the run ends.
                Err(RelayError::Interrupted(_)) => continue 'passes,
                // Nothing to retry (the lost rows are gone from the outbox too, say).
                Err(e) if !e.is_retried_by_run() => return Err(e),
                Err(e) => {
                    outlet.down(&e, settings.max_backoff);
                    failed_over(&outlets);
                }
            }
        }
        let live: Vec<usize> = (0..outlets.len()).filter(|i| outlets[*i].session.is_some()).collect();
        if live.is_empty() {
            // Nothing to send on: wait for a connection being made, or the next try.
            let wait = if outlets.iter().any(|o| o.connecting.is_some()) {
                CONNECTING_POLL
            } else {
                let next = outlets.iter().map(|o| o.retry_at).min().unwrap_or_else(Instant::now);
                next.saturating_duration_since(Instant::now())
            };
            pause(wait, stop).await;
            continue;
        }
        let now = Instant::now();
        let skip: HashSet<String> = held
            .iter()
            .chain(deferred.iter())
            .filter(|(_, w)| w.until > now)
            .map(|(f, _)| f.clone())
            .collect();
        let mut sessions: Vec<&mut Session> = outlets.iter_mut().filter_map(|o| o.session.as_mut()).collect();
        let passed =
            pass(&mut sessions, ledger, Source::Unaccepted, &skip, Caps::of(config), report, stop).await;
        drop(sessions);
        let mut result = match passed {
            Ok(result) => result,
            Err(e) if e.is_retried_by_run() => {
                // producer.db failed: every stream is dropped (what was in flight is sent
                // again) and reopened after its backoff.
                for i in &live {
                    outlets[*i].down(&e, settings.max_backoff);
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        let broken = std::mem::take(&mut result.broken);
        for (n, i) in live.iter().enumerate() {
            match broken.iter().find(|(b, _)| *b == n) {
                Some((_, e)) => {
                    outlets[*i].down(e, settings.max_backoff);
                    failed_over(&outlets);
                }
                None => outlets[*i].delivering(),
            }
        }
        let idle = result.sent == 0;
        note_waiting_flows(result, &skip, &mut held, &mut deferred, settings.max_backoff);
        if !idle || !broken.is_empty() {
            idle_poll.reset();
            continue;
        }
        for i in 0..outlets.len() {
            let outlet = &mut outlets[i];
            let Some(session) = outlet.session.as_mut() else { continue };
            // A consumer restarted on a restored database gives an idle relay no row to fail
            // on: ask it who it is now and then.
            if let Err(e) = session.recheck_identity(&outlet.link, ledger, stop).await {
                if matches!(e, RelayError::Interrupted(_)) {
                    continue 'passes;
                }
                if matches!(e, RelayError::HistoryCompacted { .. }) {
                    // Nothing to retry: the lost rows are gone from the outbox too.
                    return Err(e);
                }
                outlet.down(&e, settings.max_backoff);
                failed_over(&outlets);
                continue;
            }
            if session.idle_for() >= RENEW_IDLE_STREAM {
                tracing::debug!(url = %outlet.link.url, "stream idle; closing it before the consumer's idle timeout does");
                outlet.session = None;
            }
        }
        if outlets.iter().any(|o| o.session.is_some()) {
            pause(idle_poll.next_wait(), stop).await;
        }
    }
    for outlet in &outlets {
        if let Some(task) = &outlet.connecting {
            task.abort();
        }
    }
    if let Some(leases) = &leases {
        // The heartbeat ends first (it sees the stop), so no beat takes a lease after the
        // release; a beat stuck on the database is not waited for long.
        if let Some(keeper) = keeper {
            let _ = tokio::time::timeout(Duration::from_secs(2), keeper).await;
        }
        leases.retire(ledger).await;
        report.set_partitions(0);
    }
    tracing::info!(sent = report.sent(), "relay stopped");
    Ok(())
}

/// When `run` last wrote its `progress` line and how many answers it had counted then.
struct Progress {
    at: Instant,
    sent: u64,
}

impl Progress {
    /// Writes a `progress` line (without per-delivery lines) once the interval has passed,
    /// if anything was answered since the last one: an idle relay stays quiet.
    fn maybe_write(&mut self, report: &mut Report, settings: RunSettings) {
        if settings.delivery_lines || self.at.elapsed() < settings.summary_interval {
            return;
        }
        self.at = Instant::now();
        if report.sent() != self.sent {
            self.sent = report.sent();
            report.progress("run");
        }
    }
}

/// Logs a link failure (or a producer database that went away) once per change of kind; the
/// retries after it log at debug only.
fn link_down(link: &mut LinkState, url: &str, e: &RelayError, max_backoff: Duration) {
    let kind = match e {
        RelayError::Unreachable { .. } => "consumer unreachable",
        RelayError::Unresponsive(_) => "consumer stopped answering",
        RelayError::Store(_) => "producer database unavailable",
        _ => "consumer stream failed",
    };
    if *link == LinkState::Down(kind) {
        let subject = if matches!(e, RelayError::Store(_)) { "producer database" } else { "consumer" };
        tracing::debug!(url = %url, error = %e, "{subject} still failing; retrying with backoff");
    } else {
        tracing::warn!(
            url = %url, error = %e, ?max_backoff,
            "{kind}: stream dropped, unanswered rows stay unaccepted and will be resent; retrying with backoff"
        );
        *link = LinkState::Down(kind);
    }
}

/// Updates the flows waiting after a pass, logging each state change once: a flow newly held
/// back (or held back by a different answer), a held-back flow that went through again, and
/// the consumer's backlog turning full or having room again.
fn note_waiting_flows(
    result: PassResult,
    offered_all_but: &HashSet<String>,
    held: &mut HashMap<String, Waiting>,
    deferred: &mut HashMap<String, Waiting>,
    max_backoff: Duration,
) {
    let now = Instant::now();
    let held_now: HashSet<&str> = result.held_back.iter().map(|h| h.flow_id.as_str()).collect();
    let deferred_now: HashSet<&str> = result.deferred.iter().map(String::as_str).collect();
    for h in &result.held_back {
        let w = held.entry(h.flow_id.clone()).or_insert_with(|| Waiting {
            until: now,
            backoff: Backoff::new(HELD_RETRY, HELD_RETRY_CAP),
            outcome: String::new(),
        });
        if w.outcome != h.outcome {
            tracing::warn!(
                flow_id = %h.flow_id, event_id = %h.event_id, outcome = %h.outcome, detail = %h.detail,
                "flow held back: its row was not accepted; it stays unaccepted for an operator and is offered again with backoff"
            );
            w.outcome.clone_from(&h.outcome);
        }
        w.until = now + w.backoff.next_wait();
    }
    // A held-back flow offered in this pass and not held back again went through.
    held.retain(|flow, _| {
        let released = !offered_all_but.contains(flow) && !held_now.contains(flow.as_str());
        if released {
            tracing::info!(flow_id = %flow, "flow no longer held back");
        }
        !released
    });
    let was_full = !deferred.is_empty();
    for flow in &result.deferred {
        let w = deferred.entry(flow.clone()).or_insert_with(|| Waiting {
            until: now,
            backoff: Backoff::new(DEFERRED_RETRY, max_backoff),
            outcome: String::new(),
        });
        w.until = now + w.backoff.next_wait();
    }
    deferred.retain(|flow, _| offered_all_but.contains(flow) || deferred_now.contains(flow.as_str()));
    match (was_full, deferred.is_empty()) {
        (false, false) => {
            tracing::info!(flows = deferred.len(), "consumer backlog full: flows deferred with backoff")
        }
        (true, true) => tracing::info!("consumer backlog has room again"),
        _ => {}
    }
}

/// After a stream was dropped, with several consumers: says where its flows go now (once per
/// failure; the link's own state change was logged by `link_down`).
fn failed_over(outlets: &[Outlet]) {
    if outlets.len() < 2 {
        return;
    }
    let live: Vec<&str> =
        outlets.iter().filter(|o| o.session.is_some()).map(|o| o.link.url.as_str()).collect();
    if live.is_empty() {
        tracing::info!("no consumer reachable; retrying each with backoff");
    } else {
        tracing::info!(to = ?live, "failing over: the flows of the dropped stream go to the other consumers");
    }
}

/// Waits `wait`, or less if a stop comes first.
async fn pause(wait: Duration, stop: &Stop) {
    tokio::select! {
        () = tokio::time::sleep(wait) => {}
        () = stop.asked() => {}
    }
}
