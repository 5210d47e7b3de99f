//! The seeded fault schedule: which processes to SIGKILL, and at which committed-event count.
//! It depends on the seed alone (never on timing), so a printed seed replays the same
//! schedule; every block of it kills each kind of process its quota of times.

use serde::Serialize;

use crate::rng::Rng;

/// A process the schedule can kill: which kind, and which instance of that kind (0-based).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Victim {
    /// A producer server.
    Producer(u8),
    /// A consumer server.
    Consumer(u8),
    /// A `relay run`.
    Relay(u8),
}

impl Victim {
    /// The kind of process (`producer`, `consumer`, `relay`), for the per-kind floors.
    pub fn kind(self) -> &'static str {
        match self {
            Victim::Producer(_) => "producer",
            Victim::Consumer(_) => "consumer",
            Victim::Relay(_) => "relay",
        }
    }

    /// The process's name in logs and reports: `producer`, `consumer`, `relay-a`, `relay-b`
    /// for the single-instance profiles (the names their schedules always had), then
    /// `producer-2`, `consumer-3`, `relay-c`, ….
    pub fn name(self) -> String {
        match self {
            Victim::Producer(0) => "producer".into(),
            Victim::Consumer(0) => "consumer".into(),
            Victim::Producer(i) => format!("producer-{}", u32::from(i) + 1),
            Victim::Consumer(i) => format!("consumer-{}", u32::from(i) + 1),
            Victim::Relay(i) => format!("relay-{}", char::from(b'a' + i % 26)),
        }
    }
}

/// Kill these victims (one, or two at once) when the committed count reaches `at_committed`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KillStep {
    /// The committed count that triggers the step.
    pub at_committed: u64,
    /// The processes killed at once.
    pub victims: Vec<Victim>,
}

/// How many kills of each victim one block of the schedule holds, and over how many
/// committed events it is spread.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Quota {
    /// Producer kills per block.
    pub producer: usize,
    /// Consumer kills per block.
    pub consumer: usize,
    /// Per relay.
    pub relay_each: usize,
    /// Producer and consumer instances (the producer and consumer kills are spread over
    /// them in turn).
    pub instances: u8,
    /// `relay run` instances.
    pub relays: u8,
    /// Percent of steps that kill two different processes at once.
    pub double_percent: u64,
    /// The first step's threshold.
    pub start: u64,
    /// Committed events one block spans.
    pub span: u64,
}

impl Quota {
    /// Kills in one block.
    pub fn kills(&self) -> usize {
        self.producer + self.consumer + usize::from(self.relays) * self.relay_each
    }
}

/// Block `block` of the schedule for `seed`: the quota's kills in a seeded order, grouped
/// into single and double steps, with thresholds rising from `start + block * span` and
/// spread (seeded gaps) over `span` committed events.
pub fn block(seed: u64, block: u64, quota: &Quota) -> Vec<KillStep> {
    let mut rng = Rng::derive(seed ^ 0x5CED_0000, block);
    let mut victims: Vec<Victim> = Vec::with_capacity(quota.kills());
    let instances = quota.instances.max(1);
    victims.extend((0..quota.producer).map(|k| Victim::Producer((k % usize::from(instances)) as u8)));
    victims.extend((0..quota.consumer).map(|k| Victim::Consumer((k % usize::from(instances)) as u8)));
    for r in 0..quota.relays {
        victims.extend(std::iter::repeat_n(Victim::Relay(r), quota.relay_each));
    }
    rng.shuffle(&mut victims);
    let mut groups: Vec<Vec<Victim>> = Vec::new();
    let mut i = 0;
    while i < victims.len() {
        let first = victims[i];
        let second = victims.get(i + 1).copied().filter(|v| *v != first);
        match second {
            Some(second) if rng.percent(quota.double_percent) => {
                groups.push(vec![first, second]);
                i += 2;
            }
            _ => {
                groups.push(vec![first]);
                i += 1;
            }
        }
    }
    // Seeded gaps (1..=3 units each), scaled so the block's last step lands within its span.
    let gaps: Vec<u64> = groups.iter().map(|_| rng.between(1, 3)).collect();
    let total: u64 = gaps.iter().sum::<u64>().max(1);
    let base = quota.start + block * quota.span;
    let mut reached = 0;
    groups
        .into_iter()
        .zip(gaps)
        .map(|(victims, gap)| {
            reached += gap;
            KillStep { at_committed: base + reached * quota.span / total, victims }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const QUOTA: Quota = Quota {
        producer: 50,
        consumer: 50,
        relay_each: 30,
        instances: 1,
        relays: 2,
        double_percent: 20,
        start: 100,
        span: 9_400,
    };

    #[test]
    fn same_seed_same_schedule() {
        assert_eq!(block(42, 0, &QUOTA), block(42, 0, &QUOTA));
        assert_ne!(block(42, 0, &QUOTA), block(43, 0, &QUOTA));
        assert_ne!(block(42, 0, &QUOTA), block(42, 1, &QUOTA));
    }

    #[test]
    fn a_block_kills_each_kind_its_quota_within_its_span() {
        for seed in 0..20 {
            let steps = block(seed, 1, &QUOTA);
            let all: Vec<Victim> = steps.iter().flat_map(|s| s.victims.clone()).collect();
            let count = |kind: &str| all.iter().filter(|v| v.kind() == kind).count();
            assert_eq!((count("producer"), count("consumer"), count("relay")), (50, 50, 60));
            assert!(steps.iter().any(|s| s.victims.len() == 2), "seed {seed}: no double kill");
            assert!(steps.iter().all(|s| s.victims.len() == 1 || s.victims[0] != s.victims[1]));
            assert!(steps.windows(2).all(|w| w[0].at_committed <= w[1].at_committed));
            let (first, last) = (steps[0].at_committed, steps[steps.len() - 1].at_committed);
            assert!(first > 100 + 9_400 && last == 100 + 2 * 9_400, "seed {seed}: {first}..{last}");
        }
    }

    #[test]
    fn several_instances_share_their_kinds_kills() {
        let quota = Quota { instances: 3, relays: 3, relay_each: 20, ..QUOTA };
        let all: Vec<Victim> = block(7, 0, &quota).into_iter().flat_map(|s| s.victims).collect();
        for i in 0..3u8 {
            let of = |v: Victim| all.iter().filter(|x| **x == v).count();
            assert!(of(Victim::Producer(i)) >= 16, "producer {i}");
            assert!(of(Victim::Consumer(i)) >= 16, "consumer {i}");
            assert_eq!(of(Victim::Relay(i)), 20, "relay {i}");
        }
        assert_eq!(all.len(), 160);
    }
}
