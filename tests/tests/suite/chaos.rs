//! The chaos machinery itself, in miniature (the full CI profile runs as its own CI phase):
//! real processes killed on the seeded schedule under load, then the independent checker.

use harness::chaos::{self, ChaosConfig, schedule};

/// A smoke-sized chaos run passes the checker and its floors, and kills exactly what the
/// seeded schedule says, in order.
#[test]
fn a_small_chaos_run_passes_and_follows_its_schedule() {
    let seed = harness::rng::seed_from_clock();
    let cfg = ChaosConfig::profile("smoke", seed).expect("the smoke profile exists");
    let Some(work) = harness::Workdir::for_test() else { return };
    let files = harness::checker::Files { producer_db: work.producer_db(), consumer_db: work.consumer_db() };
    let report = chaos::run(&cfg, work.dir.path(), files);
    assert!(report.passed(), "chaos smoke run failed (seed {seed}):\n{}", report.summary());
    let planned: Vec<(u64, schedule::Victim)> = schedule::block(seed, 0, &cfg.quota)
        .into_iter()
        .flat_map(|s| s.victims.into_iter().map(move |v| (s.at_committed, v)))
        .collect();
    let done: Vec<(u64, schedule::Victim)> = report.kills.iter().map(|k| (k.threshold, k.victim)).collect();
    assert_eq!(done, planned, "seed {seed}");
    assert!(report.kills.iter().all(|k| k.at_committed >= k.threshold && k.pid > 0), "{:?}", report.kills);
}
