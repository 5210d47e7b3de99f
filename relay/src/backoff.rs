//! Capped, jittered exponential backoff: every retry of the relay (reconnecting, reopening
//! a failed stream, offering deferred rows again) waits through one, so no failure can make
//! it retry in a tight loop, and relays that failed together do not retry in lockstep.

use std::time::Duration;

/// A doubling delay between `first` and `cap`; each wait is drawn from the upper half of
/// the current step ("equal jitter"), so it is never shorter than half the step.
#[derive(Clone, Debug)]
pub struct Backoff {
    first: Duration,
    cap: Duration,
    step: Duration,
    seed: u64,
}

impl Backoff {
    /// A backoff starting at `first` and never above `cap` (a `cap` below `first` wins).
    pub fn new(first: Duration, cap: Duration) -> Backoff {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ (u64::from(std::process::id()) << 32);
        Backoff::seeded(first, cap, seed)
    }

    /// [`Backoff::new`] with a fixed jitter seed (tests).
    pub fn seeded(first: Duration, cap: Duration, seed: u64) -> Backoff {
        let first = first.min(cap);
        Backoff { first, cap, step: first, seed: seed | 1 }
    }

    /// The next wait, then doubles the step up to the cap.
    pub fn next_wait(&mut self) -> Duration {
        let step = self.step;
        self.step = (self.step * 2).min(self.cap);
        let half = step / 2;
        let spread = (step - half).as_micros() as u64;
        half + Duration::from_micros(if spread == 0 { 0 } else { self.random() % (spread + 1) })
    }

    /// Back to the first step, after the thing retried worked.
    pub fn reset(&mut self) {
        self.step = self.first;
    }

    /// The current step (the most the next wait can be).
    pub fn step(&self) -> Duration {
        self.step
    }

    fn random(&mut self) -> u64 {
        // xorshift64: jitter needs spread, not cryptographic quality.
        let mut x = self.seed;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.seed = x;
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_with_jitter_in_the_upper_half() {
        let ms = Duration::from_millis;
        let mut b = Backoff::seeded(ms(100), ms(1000), 7);
        for step in [100, 200, 400, 800, 1000, 1000, 1000] {
            let wait = b.next_wait();
            assert!(wait >= ms(step) / 2 && wait <= ms(step), "{wait:?} for step {step}");
        }
        b.reset();
        assert_eq!(b.step(), ms(100));
    }

    #[test]
    fn jitter_spreads_the_waits() {
        let ms = Duration::from_millis;
        let mut b = Backoff::seeded(ms(1000), ms(1000), 1);
        let waits: std::collections::BTreeSet<_> = (0..20).map(|_| b.next_wait()).collect();
        assert!(waits.len() > 10, "{waits:?}");
    }

    #[test]
    fn a_cap_below_the_first_step_wins_and_zero_never_spins_forever() {
        let mut b = Backoff::seeded(Duration::from_secs(5), Duration::from_millis(10), 3);
        assert!(b.next_wait() <= Duration::from_millis(10));
        let mut zero = Backoff::seeded(Duration::ZERO, Duration::ZERO, 3);
        assert_eq!(zero.next_wait(), Duration::ZERO);
    }
}
