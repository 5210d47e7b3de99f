//! `run`: passes for ever until a stop. Any failure of the link (unreachable, stream error,
//! a consumer that stopped answering) drops the stream and reconnects after a capped,
//! jittered backoff, so no failure makes it spin; each change of the link's state and of a
//! flow's state is logged once, not on every retry. Held-back flows are offered again after
//! their own backoff, so a stuck conflict costs one attempt per backoff, not one per poll.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

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
    // Consumers on one database: start on one chosen by process (so relays spread over
    // them) and move to the next after a link failure.
    let links: Vec<Link> = if config.consumers.len() > 1 {
        config.consumers.iter().map(|url| Link { url: url.clone(), ..config.link.clone() }).collect()
    } else {
        vec![config.link.clone()]
    };
    let mut current = std::process::id() as usize % links.len();
    let mut held: HashMap<String, Waiting> = HashMap::new();
    let mut deferred: HashMap<String, Waiting> = HashMap::new();
    let mut reconnect = Backoff::new(RECONNECT_FIRST, settings.max_backoff);
    // Polling adapts: right after a pass that sent something the next poll comes soon (new
    // rows usually follow), and each idle pass doubles the pause up to `--poll-ms`, so an
    // idle relay costs what it did with a fixed interval and a busy one finds rows sooner.
    let mut idle_poll =
        Backoff::new((settings.poll_interval / 16).max(Duration::from_millis(1)), settings.poll_interval);
    let mut link = LinkState::Starting;
    let mut session: Option<Session> = None;
    let mut progress = Progress { at: Instant::now(), sent: 0 };
    while !stop.requested() {
        if let Some(leases) = &leases {
            // Between passes nothing is in flight: extras over the fair share go back now.
            leases.release_marked(ledger).await;
            report.set_partitions(leases.held());
        }
        progress.maybe_write(report, settings);
        let Some(active) = session.as_mut() else {
            let opened = tokio::select! {
                opened = Session::open(&links[current], config.window, Duration::ZERO, ledger) => opened,
                () = stop.asked() => break,
            };
            match opened {
                Ok(s) => session = Some(s),
                Err(e) if e.is_retried_by_run() => {
                    link_down(&mut link, &e, settings.max_backoff);
                    if e.is_link_failure() {
                        fail_over(&links, &mut current);
                    }
                    pause(reconnect.next_wait(), stop).await;
                }
                Err(e) => return Err(e),
            }
            continue;
        };
        // Leases taken since the last pass (a dead relay's partitions, a share gained by
        // rebalancing) are judged against this consumer before any of their rows is read.
        if let Err(e) = active.judge_new(&links[current], ledger).await {
            if matches!(e, RelayError::HistoryCompacted { .. }) {
                return Err(e);
            }
            link_down(&mut link, &e, settings.max_backoff);
            fail_over(&links, &mut current);
            session = None;
            pause(reconnect.next_wait(), stop).await;
            continue;
        }
        let now = Instant::now();
        let skip: HashSet<String> = held
            .iter()
            .chain(deferred.iter())
            .filter(|(_, w)| w.until > now)
            .map(|(f, _)| f.clone())
            .collect();
        match pass(active, ledger, Source::Unaccepted, &skip, Caps::of(config), report, stop).await {
            Ok(result) => {
                // The stream carried its answers (or had nothing to carry): the link works.
                if link != LinkState::Delivering {
                    tracing::info!(url = %links[current].url, "consumer reachable; delivering");
                    link = LinkState::Delivering;
                }
                reconnect.reset();
                let idle = result.sent == 0;
                note_waiting_flows(result, &skip, &mut held, &mut deferred, settings.max_backoff);
                if !idle {
                    idle_poll.reset();
                }
                if idle {
                    // A consumer restarted on a restored database gives an idle relay no row
                    // to fail on: ask it who it is now and then.
                    if let Err(e) = active.recheck_identity(&links[current], ledger).await {
                        if matches!(e, RelayError::HistoryCompacted { .. }) {
                            // Nothing to retry: the lost rows are gone from the outbox too.
                            return Err(e);
                        }
                        link_down(&mut link, &e, settings.max_backoff);
                        fail_over(&links, &mut current);
                        session = None;
                        pause(reconnect.next_wait(), stop).await;
                        continue;
                    }
                    if active.idle_for() >= RENEW_IDLE_STREAM {
                        tracing::debug!("stream idle; closing it before the consumer's idle timeout does");
                        session = None;
                    }
                    pause(idle_poll.next_wait(), stop).await;
                }
            }
            Err(e) if e.is_retried_by_run() => {
                link_down(&mut link, &e, settings.max_backoff);
                // Another consumer helps only when this one is the problem, not the outbox.
                if e.is_link_failure() {
                    fail_over(&links, &mut current);
                }
                session = None;
                pause(reconnect.next_wait(), stop).await;
            }
            Err(e) => return Err(e),
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
fn link_down(link: &mut LinkState, e: &RelayError, max_backoff: Duration) {
    let kind = match e {
        RelayError::Unreachable { .. } => "consumer unreachable",
        RelayError::Unresponsive(_) => "consumer stopped answering",
        RelayError::Store(_) => "producer database unavailable",
        _ => "consumer stream failed",
    };
    if *link == LinkState::Down(kind) {
        let subject = if matches!(e, RelayError::Store(_)) { "producer database" } else { "consumer" };
        tracing::debug!(error = %e, "{subject} still failing; retrying with backoff");
    } else {
        tracing::warn!(
            error = %e, ?max_backoff,
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

/// After a link failure, the next consumer (when there are several).
fn fail_over(links: &[Link], current: &mut usize) {
    if links.len() > 1 {
        *current = (*current + 1) % links.len();
        tracing::info!(url = %links[*current].url, "failing over to the next consumer");
    }
}

/// Waits `wait`, or less if a stop comes first.
async fn pause(wait: Duration, stop: &Stop) {
    tokio::select! {
        () = tokio::time::sleep(wait) => {}
        () = stop.asked() => {}
    }
}
