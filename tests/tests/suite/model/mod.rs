//! The model test: random cases of the consumer's Receive / Apply / ApplyAll and of the
//! producer's Advance, with SIGKILL-and-restart and armed crash points, run against the real
//! `consumer` and `producer` binaries over gRPC and compared after every step with the
//! in-memory spec model of `harness::model` (each answer, and each flow's records). Cases are
//! drawn and shrunk by `proptest`; a failure prints its seed and the smallest failing case.
//!
//! `ORDERED_EVENTS_MODEL_SEED` replays a seed; `ORDERED_EVENTS_MODEL_CASES` scales the case
//! counts (e.g. `10` for ten times as many).

mod consumer;
mod producer;

use std::cell::{Cell, RefCell};
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};

use harness::model::CrashWhen;
use harness::rng::Rng;
use proptest::strategy::Strategy;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};
use proto::crash::CrashPoint;

/// The two flows every case uses (a namespace is prefixed when a case runs, so a shrunk
/// case can run again on the same files).
const FLOWS: [&str; 2] = ["A", "B"];
/// Cases per server process before a fresh one on fresh files (keeps ApplyAll's work small).
const CASES_PER_RIG: usize = 100;
/// Re-runs a failing case may spend on shrinking (each one is a real run of the binaries).
const SHRINK_ITERS: u32 = 400;

/// Writes straight to stderr (not captured by the test harness), so CI logs show the seed.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The run's seed: `ORDERED_EVENTS_MODEL_SEED`, or one from the clock (always printed).
fn seed() -> u64 {
    std::env::var("ORDERED_EVENTS_MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(harness::rng::seed_from_clock)
}

/// The case-count multiplier (`ORDERED_EVENTS_MODEL_CASES`, at least 1).
fn scale() -> usize {
    std::env::var("ORDERED_EVENTS_MODEL_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(1).max(1)
}

/// Where an armed crash point fires relative to the write it guards.
fn crash_when(point: CrashPoint) -> CrashWhen {
    match point {
        CrashPoint::ProducerAfterCommit
        | CrashPoint::ConsumerReceiveAfterCommit
        | CrashPoint::ConsumerApplyAfterCommit
        | CrashPoint::RelayAfterMarkCommit => CrashWhen::AfterCommit,
        _ => CrashWhen::BeforeCommit,
    }
}

/// What a set of cases exercised.
#[derive(Debug, Default)]
struct Tally {
    cases: usize,
    ops: usize,
    envelopes: usize,
    restarts: usize,
    crashes: usize,
}

impl Tally {
    fn add(&mut self, o: Tally) {
        self.cases += o.cases;
        self.ops += o.ops;
        self.envelopes += o.envelopes;
        self.restarts += o.restarts;
        self.crashes += o.crashes;
    }
}

/// One side of the model test: how to draw its cases, and how to run one on a rig (a server
/// process restarted at will on one file).
trait Side {
    /// A drawn case.
    type Case: std::fmt::Debug + Clone;
    /// The server process and its client.
    type Rig;

    /// What a case contains, for the tally.
    fn tally(case: &Self::Case) -> Tally;
    /// A rig on fresh files.
    fn rig() -> Self::Rig;
    /// Runs `case` under namespace `ns`; the first difference from the model is the error.
    fn run(
        rig: &mut Self::Rig,
        case: &Self::Case,
        ns: &str,
    ) -> impl std::future::Future<Output = Result<(), String>>;
}

/// The proptest runner of rig `r`: its cases and its random stream are fixed by `seed`, so a
/// printed seed replays every rig.
fn runner(seed: u64, r: usize, cases: u32) -> TestRunner {
    let mut stream = Rng::derive(seed, r as u64);
    let mut bytes = [0u8; 32];
    for chunk in bytes.chunks_mut(8) {
        chunk.copy_from_slice(&stream.next_u64().to_le_bytes());
    }
    let config =
        Config { cases, max_shrink_iters: SHRINK_ITERS, failure_persistence: None, ..Config::default() };
    TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
}

/// Runs `cases` cases drawn from `strategy` on `rigs` independent rigs side by side (the
/// calls are latency-bound, so this is what makes a thousand cases fit in CI). Rig `r` runs
/// cases `r, r + rigs, …` with its own proptest runner; the first failure stops the others
/// and comes back shrunk, with the seed that replays it. `stream` is mixed into the seed so
/// the two sides draw different cases from one printed seed.
fn run_rigs<S: Side>(
    side: &str,
    seed: u64,
    stream: u64,
    rigs: usize,
    cases: usize,
    strategy: impl Strategy<Value = S::Case> + Sync,
) -> Result<Tally, String> {
    let failed = AtomicBool::new(false);
    let results: Vec<Result<Tally, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..rigs)
            .map(|r| {
                let (strategy, failed) = (&strategy, &failed);
                s.spawn(move || {
                    let result = run_one_rig::<S>(
                        side,
                        seed,
                        stream,
                        r,
                        (r..cases).step_by(rigs).count(),
                        strategy,
                        failed,
                    );
                    if result.is_err() {
                        failed.store(true, Ordering::SeqCst);
                    }
                    result
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| Err(format!("a rig panicked: {p:?}"))))
            .collect()
    });
    let mut tally = Tally::default();
    for r in results {
        tally.add(r?);
    }
    Ok(tally)
}

fn run_one_rig<S: Side>(
    side: &str,
    seed: u64,
    stream: u64,
    r: usize,
    cases: usize,
    strategy: &(impl Strategy<Value = S::Case> + Sync),
    failed: &AtomicBool,
) -> Result<Tally, String> {
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
        return Err("no tokio runtime".to_owned());
    };
    let rig = RefCell::new(S::rig());
    let tally = RefCell::new(Tally::default());
    let runs = Cell::new(0usize);
    // Set once this rig saw a failure: from then on it is shrinking and must run every case.
    let shrinking = Cell::new(false);
    let mut runner = runner(seed ^ stream, r, cases as u32);
    let outcome = runner.run(strategy, |case| {
        if failed.load(Ordering::SeqCst) && !shrinking.get() {
            return Ok(()); // another rig failed: its report is the one that matters
        }
        let n = runs.get();
        runs.set(n + 1);
        if n > 0 && n % CASES_PER_RIG == 0 {
            *rig.borrow_mut() = S::rig();
        }
        tally.borrow_mut().add(S::tally(&case));
        let result = runtime.block_on(S::run(&mut rig.borrow_mut(), &case, &format!("r{r}.{n}.")));
        if result.is_err() {
            shrinking.set(true);
            failed.store(true, Ordering::SeqCst);
        }
        result.map_err(TestCaseError::fail)
    });
    match outcome {
        Ok(()) => Ok(tally.into_inner()),
        Err(TestError::Fail(why, case)) => Err(format!(
            "model: {side}: rig {r} of seed {seed} differs from the model \
             (replay: ORDERED_EVENTS_MODEL_SEED={seed}); after {} runs (shrinking included), \
             the smallest failing case is:\n{case:#?}\nfailure: {why}",
            runs.get()
        )),
        Err(e) => Err(format!("model: {side}: rig {r} of seed {seed}: {e}")),
    }
}
