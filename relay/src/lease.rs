//! Partition leases of `relay run` on PostgreSQL: how several relays split one outbox with no
//! coordinator. The flow space is cut into [`PARTITIONS`] fixed partitions; each relay holds a
//! share through lease rows (owner, epoch, expiry by the database's clock), renewed by a
//! heartbeat task every third of the ttl. Each relay aims at `ceil(PARTITIONS / live relays)`,
//! takes free (unowned or expired) partitions up to it and hands extras back between passes,
//! so a newcomer gets its share. Every mark proves the lease's epoch in the same statement
//! (a fencing token): a relay that lost a lease (paused, cut off) cannot record afterwards,
//! drops the partition on the first mark that lands short, and marks it again only after it
//! took it again with a new epoch.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use producer::store::{Fence, LeaseView, StoreError};
use proto::partition::PARTITIONS;

use crate::ledger::Ledger;
use crate::output;
use crate::stop::Stop;

/// The default lease ttl (`--lease-ttl-ms`): a dead relay's partitions are taken over after
/// at most the ttl plus one heartbeat interval (a third of it): 6 s + 2 s.
pub const DEFAULT_LEASE_TTL_MS: u64 = 6_000;

/// One lease this relay holds.
#[derive(Clone, Copy, Debug)]
struct Held {
    epoch: u64,
    /// Before this instant the lease is surely unexpired by the database's clock (it was
    /// renewed for the ttl no earlier than the heartbeat began); after it, no row of the
    /// partition is sent until the next heartbeat renews it.
    valid_until: Instant,
    /// Handed back at the next pause between passes (an extra over the fair share).
    releasing: bool,
}

/// The leases of this process's `relay run`, for the metrics scrape (set once it shares
/// the outbox through leases).
pub(crate) static CURRENT: std::sync::OnceLock<Leases> = std::sync::OnceLock::new();

/// This relay's leases, shared by the heartbeat task and the passes.
#[derive(Clone)]
pub struct Leases {
    instance: Arc<str>,
    ttl: Duration,
    held: Arc<Mutex<BTreeMap<u16, Held>>>,
}

impl Leases {
    /// A relay instance with no lease yet; its id is unique per process start.
    pub fn new(ttl: Duration) -> Leases {
        let instance = format!("relay-{}-{:x}", std::process::id(), runtime::now_us());
        Leases { instance: instance.into(), ttl, held: Arc::default() }
    }

    /// This relay's instance id (the lease rows' owner).
    pub fn instance(&self) -> &str {
        &self.instance
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u16, Held>> {
        runtime::blocking::lock(&self.held)
    }

    /// The partitions whose rows may be read and sent now, with their epochs.
    pub fn readable(&self) -> Vec<(u16, u64)> {
        let now = Instant::now();
        self.lock()
            .iter()
            .filter(|(_, h)| !h.releasing && h.valid_until > now)
            .map(|(p, h)| (*p, h.epoch))
            .collect()
    }

    /// Every lease this relay holds (those being handed back included): `(partition, epoch)`.
    pub fn held_leases(&self) -> Vec<(u16, u64)> {
        self.lock().iter().map(|(p, h)| (*p, h.epoch)).collect()
    }

    /// How many partitions this relay holds.
    pub fn held(&self) -> usize {
        self.lock().len()
    }

    /// The fencing token for a row of `partition` about to be sent, while it is readable.
    pub fn fence(&self, partition: u16) -> Option<Fence> {
        let now = Instant::now();
        let held = self.lock();
        let h = held.get(&partition).filter(|h| !h.releasing && h.valid_until > now)?;
        Some(Fence { owner: self.instance.clone(), partition, epoch: h.epoch })
    }

    /// True while `fence` is still this relay's lease as it knows it (not lost or dropped).
    pub fn is_current(&self, fence: &Fence) -> bool {
        self.lock().get(&fence.partition).is_some_and(|h| h.epoch == fence.epoch)
    }

    /// A mark under these leases landed on fewer rows than it carried: the lease row names
    /// another owner or epoch. Said loudly; each still held is dropped (no mark for it until
    /// it is taken again with a new epoch).
    pub fn drop_fenced(&self, fences: &[Fence]) {
        let mut refused: Vec<(u16, u64)> = fences.iter().map(|f| (f.partition, f.epoch)).collect();
        refused.sort_unstable();
        refused.dedup();
        let dropped: Vec<(u16, u64)> = {
            let mut held = self.lock();
            let mut dropped = Vec::new();
            for (p, epoch) in &refused {
                if held.get(p).is_some_and(|h| h.epoch == *epoch) {
                    held.remove(p);
                    dropped.push((*p, *epoch));
                }
            }
            dropped
        };
        tracing::error!(
            instance = %self.instance, partitions = ?refused,
            "LEASE LOST: a mark under these leases was refused by the fence (another relay took them); \
             their answers are not recorded by this relay (the new owner sends the rows again), and the \
             partitions are dropped until taken again"
        );
        if !dropped.is_empty() {
            output::lease_line(&self.instance, "lost", &dropped, self.held());
        }
    }

    /// Hands back the leases marked for release (between passes: none of their rows is in
    /// flight). A failure leaves them marked; the heartbeat keeps them until the next try.
    pub async fn release_marked(&self, ledger: &Ledger) {
        let marked: Vec<(u16, u64)> =
            self.lock().iter().filter(|(_, h)| h.releasing).map(|(p, h)| (*p, h.epoch)).collect();
        if marked.is_empty() {
            return;
        }
        match ledger.lease_release(self.instance(), marked.clone(), false).await {
            Ok(_) => {
                let mut held = self.lock();
                for (p, _) in &marked {
                    held.remove(p);
                }
                drop(held);
                tracing::info!(instance = %self.instance, partitions = ?marked, "leases released for other relays");
                output::lease_line(&self.instance, "released", &marked, self.held());
            }
            Err(e) => tracing::warn!(error = %e, "releasing leases failed; trying again after the next pass"),
        }
    }

    /// A clean stop: every lease handed back and the heartbeat ended, so other relays take
    /// the partitions at once instead of after the ttl.
    pub async fn retire(&self, ledger: &Ledger) {
        let all: Vec<(u16, u64)> = self.lock().iter().map(|(p, h)| (*p, h.epoch)).collect();
        match ledger.lease_release(self.instance(), all.clone(), true).await {
            Ok(_) => {
                self.lock().clear();
                if !all.is_empty() {
                    output::lease_line(&self.instance, "released", &all, 0);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "releasing leases at stop failed; they expire after the ttl")
            }
        }
    }

    /// The heartbeat: every third of the ttl, renews what is held, notes what was lost, and
    /// moves toward the fair share. Runs until `stop`.
    pub async fn keep(self, ledger: Ledger, stop: Stop) {
        let every = self.ttl / 3;
        let mut failing = false;
        while !stop.requested() {
            // Short of its share, a relay looks again soon: partitions another relay hands
            // back for it are then idle for a moment only, not a whole heartbeat.
            let mut wait = every;
            match self.beat(&ledger).await {
                Ok(short) => {
                    if short {
                        wait = (every / 8).max(Duration::from_millis(50));
                    }
                    if failing {
                        tracing::info!("lease heartbeat works again");
                    }
                    failing = false;
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(
                            error = %e,
                            "lease heartbeat failed: rows of partitions not renewed in time are not sent"
                        );
                    }
                    failing = true;
                }
            }
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = stop.asked() => {}
            }
        }
    }

    /// One heartbeat. True when the relay still holds fewer partitions than its share.
    async fn beat(&self, ledger: &Ledger) -> Result<bool, StoreError> {
        let began = Instant::now();
        let held: Vec<(u16, u64)> = self.lock().iter().map(|(p, h)| (*p, h.epoch)).collect();
        let ttl_us = i64::try_from(self.ttl.as_micros()).unwrap_or(i64::MAX);
        let view = ledger.lease_heartbeat(self.instance(), ttl_us, held).await?;
        let lost = self.renewed(&view, began);
        if !lost.is_empty() {
            tracing::error!(
                instance = %self.instance, partitions = ?lost,
                "LEASE LOST: these leases were not renewed (another relay took them after they expired); \
                 no mark under them will land"
            );
            output::lease_line(&self.instance, "lost", &lost, self.held());
        }
        let target = fair_share(view.live_relays);
        let (keeping, releasing) = {
            let held = self.lock();
            (held.values().filter(|h| !h.releasing).count(), held.values().filter(|h| h.releasing).count())
        };
        if keeping > target {
            let mut held = self.lock();
            // The highest partitions go back first, so relays converge on a stable split.
            for (_, h) in held.iter_mut().rev().filter(|(_, h)| !h.releasing).take(keeping - target) {
                h.releasing = true;
            }
        } else if keeping < target && releasing == 0 {
            let mine = self.lock().keys().copied().collect::<Vec<_>>();
            let free: Vec<u16> = view
                .leases
                .iter()
                .filter(|l| l.free && !mine.contains(&l.partition))
                .map(|l| l.partition)
                .take(target - keeping)
                .collect();
            if !free.is_empty() {
                let taken = ledger.lease_acquire(self.instance(), ttl_us, free).await?;
                if !taken.is_empty() {
                    let valid_until = began + self.ttl - self.ttl / 10;
                    {
                        let mut held = self.lock();
                        for (p, epoch) in &taken {
                            held.insert(*p, Held { epoch: *epoch, valid_until, releasing: false });
                        }
                    }
                    tracing::info!(
                        instance = %self.instance, partitions = ?taken, live_relays = view.live_relays, target,
                        "leases acquired"
                    );
                    output::lease_line(&self.instance, "acquired", &taken, self.held());
                }
            }
        }
        Ok(self.held() < target)
    }

    /// Applies a heartbeat's renewals; returns the leases it did not renew (lost).
    fn renewed(&self, view: &LeaseView, began: Instant) -> Vec<(u16, u64)> {
        let valid_until = began + self.ttl - self.ttl / 10;
        let mut held = self.lock();
        let mut lost = Vec::new();
        held.retain(|p, h| {
            if view.renewed.contains(&(*p, h.epoch)) {
                h.valid_until = valid_until;
                true
            } else {
                lost.push((*p, h.epoch));
                false
            }
        });
        lost
    }
}

/// How many partitions each of `live` relays aims to hold: `ceil(PARTITIONS / live)`.
pub fn fair_share(live: u64) -> usize {
    let live = live.max(1) as usize;
    let all = PARTITIONS as usize;
    all.div_ceil(live)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fair_share_covers_every_partition() {
        assert_eq!(fair_share(0), 64);
        assert_eq!(fair_share(1), 64);
        assert_eq!(fair_share(2), 32);
        assert_eq!(fair_share(3), 22);
        assert_eq!(fair_share(100), 1);
        for live in 1..=64 {
            assert!(fair_share(live) * live as usize >= PARTITIONS as usize);
        }
    }
}
