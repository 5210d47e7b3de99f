//! The chaos run: producer, consumer and two `relay run`s as real processes under
//! load from concurrent Advance clients, SIGKILLed on a seeded schedule paced by the
//! committed count and restarted; then, once the faults stop and everything drains, the
//! independent [`checker`](crate::checker) judges the files and the recorded answers, and
//! the run fails if it broke an invariant or did not reach its coverage floors.

pub mod cluster;
pub mod load;
pub mod schedule;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::background::poll;
use crate::checker::{self, Drain, Files, Observed, Verdict};
use crate::db;
use cluster::{Cluster, ProcessOptions};
use load::{LoadOptions, Progress};
use schedule::{KillStep, Quota, Victim};

/// Minimums a run must reach, or it fails as under-exercised.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Floors {
    /// SIGKILLs over all processes.
    pub kills_total: u64,
    /// Per kind of process: producer, consumer, relay.
    pub kills_per_kind: u64,
    /// Events committed.
    pub committed_events: u64,
    /// Flows started.
    pub flows: u64,
    /// The most flows in progress at once.
    pub in_progress: u64,
    /// Duplicate deliveries (DUPLICATE answers to relays or to the injector).
    pub duplicates: u64,
    /// Inbox rows that arrived after a larger seq of their flow.
    pub out_of_order: u64,
}

/// Everything a chaos run does.
#[derive(Clone, Debug)]
pub struct ChaosConfig {
    /// The profile's name.
    pub profile: &'static str,
    /// The seed of the schedule and the load.
    pub seed: u64,
    /// Concurrent Advance clients (each has one flow in progress at a time).
    pub clients: usize,
    /// Flows to run at least (`None`: until `duration` passes).
    pub flows: Option<u64>,
    /// How long the load and the faults go on (`None`: until the flows and the schedule's
    /// blocks are done).
    pub duration: Option<Duration>,
    /// One block of the kill schedule, and how many blocks (`None`: as many as `duration`
    /// allows).
    pub quota: Quota,
    /// Blocks of the schedule (`None`: as many as `duration` allows).
    pub blocks: Option<u64>,
    /// The coverage floors.
    pub floors: Floors,
    /// Let the consumer apply by itself (`consumer --auto-apply`) instead of the driver's
    /// applier task (an `ApplyAll` loop).
    pub auto_apply: bool,
    /// `relay run` flags.
    pub relay_args: Vec<String>,
    /// `--retention` of the producers and consumers (`None`: their default, 7 days, which
    /// never compacts within a run). The profiles compact at once (`0`), so every kill may
    /// strike a compaction pass and the checker reads tombstones.
    pub retention: Option<String>,
    /// Committed-but-unapplied events beyond which no new flow starts.
    pub max_backlog: u64,
    /// Percent of steps preceded by a decoy request.
    pub decoy_percent: u64,
    /// Percent of steps sent with schema 2.
    pub schema2_percent: u64,
    /// Whether the injector runs (early, reordered, duplicate and forged deliveries), and
    /// how often (one batch per this many committed events).
    pub inject: bool,
    /// One injected batch per this many committed events.
    pub inject_every: u64,
    /// The load and the faults must be done within this; the drain within `drain`.
    pub budget: Duration,
    /// How long the drain may take.
    pub drain: Duration,
    /// How long any single wait for progress may take before it is reported as a hang.
    pub hang: Duration,
}

impl ChaosConfig {
    /// A named profile: `ci` (the CI floors in about 5 minutes on 2 cores), `soak`
    /// (10 minutes of faults per seed, for running outside CI) or `smoke` (a few seconds, for
    /// the test suite).
    pub fn profile(name: &str, seed: u64) -> Option<ChaosConfig> {
        let ci = ChaosConfig {
            profile: "ci",
            seed,
            clients: 24,
            flows: Some(3_400),
            duration: None,
            quota: Quota {
                producer: 50,
                consumer: 50,
                relay_each: 30,
                instances: 1,
                relays: 2,
                double_percent: 20,
                start: 150,
                span: 9_400,
            },
            blocks: Some(1),
            floors: Floors {
                kills_total: 150,
                kills_per_kind: 30,
                committed_events: 10_000,
                flows: 3_400,
                in_progress: 16,
                duplicates: 500,
                out_of_order: 50,
            },
            auto_apply: true,
            relay_args: ["--max-backoff-ms", "1000", "--poll-ms", "20"].map(String::from).to_vec(),
            retention: Some("0".into()),
            max_backlog: 1_500,
            decoy_percent: 15,
            schema2_percent: 20,
            inject: true,
            inject_every: 40,
            budget: Duration::from_secs(300),
            drain: Duration::from_secs(120),
            hang: Duration::from_secs(60),
        };
        match name {
            "ci" => Some(ci),
            // A few seconds of the same machinery, for the test suite.
            "smoke" => Some(ChaosConfig {
                profile: "smoke",
                clients: 16,
                flows: Some(300),
                quota: Quota {
                    producer: 4,
                    consumer: 4,
                    relay_each: 2,
                    instances: 1,
                    relays: 2,
                    double_percent: 25,
                    start: 60,
                    span: 700,
                },
                floors: Floors {
                    kills_total: 12,
                    kills_per_kind: 4,
                    committed_events: 900,
                    flows: 300,
                    in_progress: 16,
                    duplicates: 1,
                    out_of_order: 0,
                },
                budget: Duration::from_secs(120),
                drain: Duration::from_secs(60),
                hang: Duration::from_secs(30),
                ..ci
            }),
            // Three producers, three consumers and three relays on one PostgreSQL database:
            // the CI floors, the kills spread over every instance.
            "multi" => Some(ChaosConfig {
                profile: "multi",
                quota: Quota { relay_each: 20, instances: 3, relays: 3, ..ci.quota },
                ..ci
            }),
            "soak" => Some(ChaosConfig {
                profile: "soak",
                clients: 32,
                flows: None,
                duration: Some(Duration::from_secs(600)),
                blocks: None,
                budget: Duration::from_secs(660),
                ..ci
            }),
            _ => None,
        }
    }
}

/// One SIGKILL.
#[derive(Clone, Debug, Serialize)]
pub struct KillRecord {
    /// The schedule step.
    pub step: usize,
    /// The process killed.
    pub victim: Victim,
    /// Its pid.
    pub pid: u32,
    /// The schedule's threshold for the step.
    pub threshold: u64,
    /// The committed count when the kill happened.
    pub at_committed: u64,
    /// Milliseconds since the run started.
    pub at_ms: u64,
}

/// What a run did and what the checker said.
#[derive(Clone, Debug, Serialize)]
pub struct ChaosReport {
    /// The profile's name.
    pub profile: &'static str,
    /// The run's seed.
    pub seed: u64,
    /// `--retention` of producers and consumers (`None`: their default).
    pub retention: Option<String>,
    /// Wall time of the whole run.
    pub seconds: f64,
    /// Wall time of the load and faults.
    pub load_seconds: f64,
    /// Wall time of the drain (None: it timed out).
    pub drain_seconds: Option<f64>,
    /// SIGKILLs per kind of process.
    pub kills_per_kind: BTreeMap<&'static str, u64>,
    /// SIGKILLs over all processes.
    pub kills_total: u64,
    /// Schedule steps that killed two processes at once.
    pub double_kill_steps: u64,
    /// Events committed.
    pub committed_events: u64,
    /// Flows started.
    pub flows: u64,
    /// The most flows in progress at once.
    pub max_in_progress: u64,
    /// Advance calls with an ambiguous outcome (retried with the same event id).
    pub unknown_calls: u64,
    /// Advance calls made.
    pub advance_calls: u64,
    /// The relays' delivery outcomes, counted by word.
    pub relay_answers: BTreeMap<String, u64>,
    /// Relay stdout lines cut off by a kill.
    pub relay_truncated_lines: u64,
    /// Deliveries the injector sent.
    pub injected: u64,
    /// Deliveries the injector sent twice.
    pub injected_duplicates: u64,
    /// Forged deliveries sent.
    pub forged: u64,
    /// DUPLICATE answers seen.
    pub duplicates: u64,
    /// Redeliveries and late arrivals read from the files.
    pub observed: Observed,
    /// Consumer restarts that could not take the old address back (relays were moved).
    pub consumer_moves: u64,
    /// A hash of the schedule steps that ran (thresholds and victims): the same seed and the
    /// same number of kills give the same fingerprint.
    pub schedule_fingerprint: String,
    /// The checker's verdict.
    pub verdict: Verdict,
    /// The floors not reached.
    pub unmet_floors: Vec<String>,
    /// What stopped the run early (a hang, a failed start), if anything.
    pub fatal: Option<String>,
    /// Every SIGKILL made.
    pub kills: Vec<KillRecord>,
}

impl ChaosReport {
    /// True when no invariant broke, every floor was met and nothing hung.
    pub fn passed(&self) -> bool {
        self.verdict.ok() && self.unmet_floors.is_empty() && self.fatal.is_none()
    }

    /// The human summary (one fact per line).
    pub fn summary(&self) -> String {
        let mut out = vec![
            format!("chaos: profile {} seed {}", self.profile, self.seed),
            format!(
                "chaos: {:.0}s in all ({:.0}s load and faults, drain {})",
                self.seconds,
                self.load_seconds,
                self.drain_seconds.map_or("timed out".into(), |d| format!("{d:.1}s"))
            ),
            format!(
                "chaos: kills {} (producer {}, consumer {}, relay {}; {} double-kill steps)",
                self.kills_total,
                self.kills_per_kind.get("producer").unwrap_or(&0),
                self.kills_per_kind.get("consumer").unwrap_or(&0),
                self.kills_per_kind.get("relay").unwrap_or(&0),
                self.double_kill_steps
            ),
            format!(
                "chaos: committed events {} over {} flows, max {} flows in progress; {} Advance calls, {} ambiguous (retried)",
                self.committed_events,
                self.flows,
                self.max_in_progress,
                self.advance_calls,
                self.unknown_calls
            ),
            format!(
                "chaos: duplicates {} (relay DUPLICATE answers {}, injected duplicates {}); outbox rows resent {} ({} extra sends)",
                self.duplicates,
                self.relay_answers.get("DUPLICATE").unwrap_or(&0),
                self.injected_duplicates,
                self.observed.rows_resent,
                self.observed.extra_sends
            ),
            format!(
                "chaos: out-of-order arrivals {} in {} flows; injected {} envelopes, forged {} (all must be refused)",
                self.observed.out_of_order_arrivals,
                self.observed.out_of_order_flows,
                self.injected,
                self.forged
            ),
            format!(
                "chaos: tombstones in the final files (retention {}): {} outbox rows, {} inbox rows",
                self.retention.as_deref().unwrap_or("default"),
                self.observed.compacted_outbox,
                self.observed.compacted_inbox
            ),
            format!(
                "chaos: relay answers {:?} ({} lines cut by a kill)",
                self.relay_answers, self.relay_truncated_lines
            ),
            format!(
                "chaos: schedule fingerprint {} over {} kills (the same seed replays the same schedule)",
                self.schedule_fingerprint, self.kills_total
            ),
        ];
        out.extend(self.verdict.summary_lines().into_iter().map(|l| format!("chaos: checker {l}")));
        if self.unmet_floors.is_empty() {
            out.push("chaos: floors reached".into());
        } else {
            out.extend(self.unmet_floors.iter().map(|f| format!("chaos: FLOOR NOT MET: {f}")));
        }
        if let Some(f) = &self.fatal {
            out.push(format!("chaos: FATAL: {f}"));
        }
        out.push(format!("chaos: verdict {}", if self.passed() { "PASS" } else { "FAIL" }));
        out.join("\n")
    }
}

/// The report of a run that could not get going: nothing observed, the reason recorded.
fn failed_early(cfg: &ChaosConfig, progress: &Progress, started: Instant, why: String) -> ChaosReport {
    progress.fail(why);
    report(cfg, progress, None, Vec::new(), started, 0.0, None, Verdict::default(), Observed::default())
}

/// Runs the chaos test on the databases `files` (fresh ones), with every process's log and
/// the history in `dir`.
pub fn run(cfg: &ChaosConfig, dir: &Path, files: Files) -> ChaosReport {
    let started = Instant::now();
    let progress = Arc::new(Progress::default());
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => return failed_early(cfg, &progress, started, format!("tokio runtime: {e}")),
    };
    let opts = ProcessOptions {
        auto_apply: cfg.auto_apply,
        relay_args: cfg.relay_args.clone(),
        retention: cfg.retention.clone(),
        start_deadline: cfg.hang,
        instances: cfg.quota.instances,
        relays: cfg.quota.relays,
    };
    let mut cluster = match Cluster::start(dir, files, opts) {
        Ok(c) => c,
        Err(e) => return failed_early(cfg, &progress, started, format!("start-up: {e}")),
    };
    let files = cluster.files.clone();

    // Observers and load.
    let monitor = {
        let progress = Arc::clone(&progress);
        let db = files.consumer_db.clone();
        std::thread::spawn(move || load::monitor(&db, &progress))
    };
    let load_opts = LoadOptions {
        seed: cfg.seed,
        flows: cfg.flows,
        max_backlog: cfg.max_backlog,
        decoy_percent: cfg.decoy_percent,
        schema2_percent: cfg.schema2_percent,
        inject_every: cfg.inject_every,
        hang: cfg.hang,
    };
    let next_flow = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    for i in 0..cfg.clients {
        let (progress, opts, next_flow) = (Arc::clone(&progress), load_opts.clone(), Arc::clone(&next_flow));
        // Clients are spread over the producer instances.
        let ep = cluster.producer_ep(i);
        let flows = cfg.flows;
        clients.push(runtime.spawn(async move {
            let more = |n: u64| {
                let wanted = flows.is_some_and(|f| n < f);
                wanted || !progress.faults_done.load(Ordering::SeqCst)
            };
            load::client(&next_flow, ep, &progress, &opts, more).await;
        }));
    }
    let applier = (!cfg.auto_apply).then(|| {
        let (progress, ep) = (Arc::clone(&progress), cluster.consumer_ep(0));
        runtime.spawn(async move { load::applier(ep, &progress).await })
    });
    let injector = cfg.inject.then(|| {
        let (progress, ep, opts, files) =
            (Arc::clone(&progress), cluster.consumer_ep(1), load_opts.clone(), files.clone());
        runtime.spawn(async move { load::injector(&files, ep, &progress, &opts).await })
    });

    // Faults, on this thread.
    let kills = supervise(cfg, &mut cluster, &progress, started);
    progress.faults_done.store(true, Ordering::SeqCst);
    if cfg.flows.is_none() || progress.failed() {
        progress.stop_load.store(true, Ordering::SeqCst);
    }
    progress.changed.notify_waiters();
    let until = started + cfg.budget;
    for c in clients {
        let left = until.saturating_duration_since(Instant::now()).max(cfg.hang);
        if runtime.block_on(async { tokio::time::timeout(left, c).await }).is_err() {
            progress
                .fail(format!("the Advance clients did not finish within the budget of {:?}", cfg.budget));
        }
    }
    progress.stop_load.store(true, Ordering::SeqCst);
    progress.changed.notify_waiters();
    if let Some(i) = injector {
        let _ = runtime.block_on(async { tokio::time::timeout(cfg.hang, i).await });
    }
    let load_seconds = started.elapsed().as_secs_f64();
    eprintln!("chaos: load and faults done after {load_seconds:.0}s; draining");

    // Drain (I6), then stop everything and judge.
    let drain = checker::wait_drained(&files, cfg.drain);
    progress.stop_all.store(true, Ordering::SeqCst);
    progress.changed.notify_waiters();
    if let Some(a) = applier {
        let _ = runtime.block_on(async { tokio::time::timeout(cfg.hang, a).await });
    }
    let _ = monitor.join();
    cluster.stop();
    drop(runtime);
    let history = std::mem::take(&mut *progress.history.lock().unwrap_or_else(|p| p.into_inner()));
    let verdict = checker::check(&files, &history, &drain);
    let observed = checker::Snapshot::read(&files).map(|s| checker::observe(&s)).unwrap_or_default();
    if !verdict.ok() {
        // The evidence for a post-mortem (kept with the files when the run fails).
        if let Ok(text) = serde_json::to_string(&history) {
            let _ = std::fs::write(dir.join("history.json"), text);
        }
    }
    let drain_seconds = match drain {
        Drain::Drained(d) => Some(d.as_secs_f64()),
        Drain::TimedOut { .. } => None,
    };
    let mut r = report(
        cfg,
        &progress,
        Some(&cluster),
        kills,
        started,
        load_seconds,
        drain_seconds,
        verdict,
        observed,
    );
    r.advance_calls = history.advances.len() as u64;
    r
}

/// What the servers had written, read from the databases: the producers' highest outbox
/// rowid; the consumers' highest inbox rowid and effect count. A server has worked since its
/// start when its numbers grew (with several instances on one database, the numbers are
/// shared: growth then says the kind worked, not that instance).
fn written(files: &checker::Files, v: Victim) -> Option<(u64, u64)> {
    match v {
        Victim::Producer(_) => {
            let p = db::try_open_ro(&files.producer_db).ok()?;
            Some((db::outbox_high_water(&p).ok()?, 0))
        }
        _ => {
            let c = db::try_open_ro(&files.consumer_db).ok()?;
            Some((db::inbox_high_water(&c).ok()?, db::count_effects(&c).ok()?))
        }
    }
}

/// Runs the kill schedule until it is exhausted (or the duration, the budget or a hang
/// ends it). Returns every kill made.
fn supervise(
    cfg: &ChaosConfig,
    cluster: &mut Cluster,
    progress: &Progress,
    started: Instant,
) -> Vec<KillRecord> {
    let mut kills = Vec::new();
    let files = cluster.files.clone();
    let mut marks: BTreeMap<Victim, (u64, u64)> = BTreeMap::new();
    for v in cluster.victims().into_iter().filter(|v| !matches!(v, Victim::Relay(_))) {
        marks.insert(v, written(&files, v).unwrap_or_default());
    }
    let out_of_time = |progress: &Progress| {
        progress.failed()
            || started.elapsed() > cfg.budget
            || cfg.duration.is_some_and(|d| started.elapsed() > d)
    };
    let mut step_no = 0usize;
    'blocks: for block in 0.. {
        if cfg.blocks.is_some_and(|b| block >= b) {
            break;
        }
        for step in schedule::block(cfg.seed, block, &cfg.quota) {
            step_no += 1;
            if !wait_threshold(cfg, &step, progress, &out_of_time) {
                break 'blocks;
            }
            // Only a process that has done work since its start is worth killing; all of the
            // step's victims must have, before any of them dies (a dead consumer stops the
            // relays' progress).
            for &victim in &step.victims {
                let worked = poll(cfg.hang, || {
                    let busy = match victim {
                        Victim::Relay(_) => cluster.relay_deliveries(victim) > 0,
                        Victim::Producer(_) => {
                            written(&files, victim).is_some_and(|now| now.0 > marks[&victim].0)
                        }
                        Victim::Consumer(_) => written(&files, victim).is_some_and(|now| {
                            let then = marks[&victim];
                            now.0 > then.0 || now.1 > then.1
                        }),
                    };
                    (busy || progress.failed()).then_some(())
                });
                if worked.is_none() || progress.failed() {
                    progress.fail(format!(
                        "{} made no progress within {:?} of its start",
                        victim.name(),
                        cfg.hang
                    ));
                    break 'blocks;
                }
                if !cluster.is_running(victim) {
                    progress.fail(format!("{} exited on its own before its kill", victim.name()));
                    break 'blocks;
                }
            }
            for &victim in &step.victims {
                let pid = cluster.pid(victim).unwrap_or(0);
                cluster.kill(victim);
                kills.push(KillRecord {
                    step: step_no,
                    victim,
                    pid,
                    threshold: step.at_committed,
                    at_committed: progress.committed.load(Ordering::SeqCst),
                    at_ms: started.elapsed().as_millis() as u64,
                });
            }
            for &victim in &step.victims {
                if let Err(e) = cluster.restart(victim) {
                    progress.fail(format!("restart of {}: {e}", victim.name()));
                    break 'blocks;
                }
                if !matches!(victim, Victim::Relay(_)) {
                    marks.insert(victim, written(&files, victim).unwrap_or_default());
                }
            }
            if step_no % 20 == 0 {
                eprintln!(
                    "chaos: {:>4.0}s step {step_no}: {} kills, committed {}, applied {}",
                    started.elapsed().as_secs_f64(),
                    kills.len(),
                    progress.committed.load(Ordering::SeqCst),
                    progress.applied.load(Ordering::SeqCst)
                );
            }
        }
    }
    kills
}

/// Waits until the committed count reaches the step's threshold. False when time ran out or
/// the count stopped moving for `cfg.hang` (a hang, recorded as fatal).
fn wait_threshold(
    cfg: &ChaosConfig,
    step: &KillStep,
    progress: &Progress,
    out_of_time: &dyn Fn(&Progress) -> bool,
) -> bool {
    let mut last = (progress.committed.load(Ordering::SeqCst), Instant::now());
    let reached = poll(cfg.budget, || {
        let now = progress.committed.load(Ordering::SeqCst);
        if now >= step.at_committed {
            return Some(true);
        }
        if out_of_time(progress) {
            return Some(false);
        }
        if now != last.0 {
            last = (now, Instant::now());
        } else if last.1.elapsed() > cfg.hang {
            progress.fail(format!("the committed count stayed at {now} for {:?}", cfg.hang));
            return Some(false);
        }
        None
    });
    reached == Some(true)
}

/// FNV-1a over the kills' steps, thresholds and victims: stable across runs and builds.
fn fingerprint(kills: &[KillRecord]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for k in kills {
        for b in format!("{}:{}:{};", k.step, k.threshold, k.victim.name()).bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// Counts the answers in every relay stdout file; a line cut by a SIGKILL mid-write counts
/// as truncated.
fn relay_answers(outputs: &[PathBuf]) -> (BTreeMap<String, u64>, u64) {
    let mut answers = BTreeMap::new();
    let mut truncated = 0;
    for path in outputs {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        for line in text.lines() {
            match serde_json::from_str::<serde_json::Value>(line) {
                Ok(v) if v["type"] == "delivery" => {
                    let word = v["outcome"].as_str().unwrap_or("?").to_owned();
                    *answers.entry(word).or_insert(0) += 1;
                }
                Ok(_) => {}
                Err(_) => truncated += 1,
            }
        }
    }
    (answers, truncated)
}

#[allow(clippy::too_many_arguments)]
fn report(
    cfg: &ChaosConfig,
    progress: &Progress,
    cluster: Option<&Cluster>,
    kills: Vec<KillRecord>,
    started: Instant,
    load_seconds: f64,
    drain_seconds: Option<f64>,
    verdict: Verdict,
    observed: Observed,
) -> ChaosReport {
    let mut per_kind: BTreeMap<&'static str, u64> = [("producer", 0), ("consumer", 0), ("relay", 0)].into();
    let mut steps: BTreeMap<usize, u64> = BTreeMap::new();
    for k in &kills {
        *per_kind.entry(k.victim.kind()).or_insert(0) += 1;
        *steps.entry(k.step).or_insert(0) += 1;
    }
    let (relay_answers, relay_truncated_lines) =
        cluster.map(|c| relay_answers(&c.relay_outputs)).unwrap_or_default();
    let injected_duplicates = progress.injected_duplicates.load(Ordering::SeqCst);
    let duplicates = relay_answers.get("DUPLICATE").copied().unwrap_or(0) + injected_duplicates;
    let mut r = ChaosReport {
        profile: cfg.profile,
        seed: cfg.seed,
        retention: cfg.retention.clone(),
        seconds: started.elapsed().as_secs_f64(),
        load_seconds,
        drain_seconds,
        kills_total: kills.len() as u64,
        kills_per_kind: per_kind,
        double_kill_steps: steps.values().filter(|n| **n > 1).count() as u64,
        committed_events: verdict.committed_events,
        flows: verdict.committed_flows,
        max_in_progress: progress.max_in_progress.load(Ordering::SeqCst),
        unknown_calls: progress.unknown.load(Ordering::SeqCst),
        advance_calls: 0,
        relay_answers,
        relay_truncated_lines,
        injected: progress.injected.load(Ordering::SeqCst),
        injected_duplicates,
        forged: progress.forged.load(Ordering::SeqCst),
        duplicates,
        observed,
        consumer_moves: cluster.map_or(0, |c| c.consumer_moves),
        schedule_fingerprint: fingerprint(&kills),
        verdict,
        unmet_floors: Vec::new(),
        fatal: progress.fatal.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        kills,
    };
    let f = &cfg.floors;
    let mut unmet = Vec::new();
    let mut need = |what: &str, got: u64, floor: u64| {
        if got < floor {
            unmet.push(format!("{what}: {got} < {floor}"));
        }
    };
    need("kills", r.kills_total, f.kills_total);
    for kind in ["producer", "consumer", "relay"] {
        need(&format!("{kind} kills"), r.kills_per_kind[kind], f.kills_per_kind);
    }
    need("committed events", r.committed_events, f.committed_events);
    need("flows", r.flows, f.flows);
    need("flows in progress at once", r.max_in_progress, f.in_progress);
    need("duplicate deliveries", r.duplicates, f.duplicates);
    need("out-of-order arrivals", r.observed.out_of_order_arrivals, f.out_of_order);
    r.unmet_floors = unmet;
    r
}
