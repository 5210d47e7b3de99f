//! Why a flow with unapplied rows waits (gap, ready or blocked) and how one change of a flow
//! moves the `gap` and `ready` counters both stores keep exact beside the backlog counters,
//! in the same transactions as the rows (SQLite from these functions, PostgreSQL from the
//! same rules spelled in its statement triggers). No I/O.

use crate::rules::Waiting;
use crate::store::{InboxState, Next};

/// Why the flow waits (`None`: it has no unapplied row), from what is stored at its next seq
/// `next_seq`. Each flow is in exactly one state, so the gap, ready and blocked counts add up
/// to the flows with unapplied rows.
pub fn state_of(next: &Next, next_seq: u64) -> Option<Waiting> {
    match next {
        Next::Idle => None,
        Next::Gap => Some(Waiting::Gap { waiting_for_seq: next_seq }),
        Next::Row(row) => Some(match (row.state, row.reason) {
            (InboxState::Blocked, Some(reason)) => Waiting::Blocked(reason),
            // An applied row at the next seq is inconsistent and refused where it is read.
            _ => Waiting::Ready,
        }),
    }
}

/// A change of the `gap` and `ready` counters. The blocked counts move with the blocked rows
/// (a blocked row is always its flow's next seq), so they are not part of it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WaitDelta {
    /// Flows gained (+) or lost (-) by `gap`.
    pub gap: i64,
    /// Flows gained (+) or lost (-) by `ready`.
    pub ready: i64,
}

impl WaitDelta {
    /// No change.
    pub const NONE: WaitDelta = WaitDelta { gap: 0, ready: 0 };

    /// One flow went from `before` to `after` (`None`: not waiting).
    pub fn between(before: Option<Waiting>, after: Option<Waiting>) -> WaitDelta {
        let count = |w: Option<Waiting>| {
            (i64::from(matches!(w, Some(Waiting::Gap { .. }))), i64::from(w == Some(Waiting::Ready)))
        };
        let (gap_before, ready_before) = count(before);
        let (gap_after, ready_after) = count(after);
        WaitDelta { gap: gap_after - gap_before, ready: ready_after - ready_before }
    }

    /// A new pending row at `seq` of a flow whose next seq is `next_seq`, which had other
    /// unapplied rows (`others_waiting`) before it. A seq below `next_seq` is never inserted
    /// (its row is applied and stays), so only the next seq and later ones are told apart.
    pub fn received(next_seq: u64, seq: u64, others_waiting: bool) -> WaitDelta {
        match (seq == next_seq, others_waiting) {
            // The next seq arrives: the flow was idle or waited at this very gap.
            (true, false) => WaitDelta::between(None, Some(Waiting::Ready)),
            (true, true) => WaitDelta::between(Some(gap(next_seq)), Some(Waiting::Ready)),
            // A later seq arrives at an idle flow: it now waits for its next seq.
            (false, false) => WaitDelta::between(None, Some(gap(next_seq))),
            // A later seq behind rows already waiting: the next seq is as it was.
            (false, true) => WaitDelta::NONE,
        }
    }

    /// This change and `other`.
    pub fn add(&mut self, other: WaitDelta) {
        self.gap += other.gap;
        self.ready += other.ready;
    }
}

fn gap(next_seq: u64) -> Waiting {
    Waiting::Gap { waiting_for_seq: next_seq }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;
    use crate::rules::BlockReason;

    /// One flow as a model: its last applied seq and its unapplied rows by seq.
    #[derive(Default)]
    struct Flow {
        last_seq: u64,
        rows: BTreeMap<u64, Option<BlockReason>>,
    }

    impl Flow {
        /// The state, read off the whole model (what the scrape's walk used to compute).
        fn state(&self) -> Option<Waiting> {
            match self.rows.get(&(self.last_seq + 1)) {
                _ if self.rows.is_empty() => None,
                None => Some(gap(self.last_seq + 1)),
                Some(None) => Some(Waiting::Ready),
                Some(Some(reason)) => Some(Waiting::Blocked(*reason)),
            }
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Receive { flow: usize, ahead: u64 },
        Apply { flow: usize },
        Block { flow: usize, reason: usize },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..3usize, 0..4u64).prop_map(|(flow, ahead)| Op::Receive { flow, ahead }),
            (0..3usize).prop_map(|flow| Op::Apply { flow }),
            (0..3usize, 0..3usize).prop_map(|(flow, reason)| Op::Block { flow, reason }),
        ]
    }

    proptest! {
        /// Counters moved only by the deltas, from the facts each store reads (Receive: the
        /// next seq and whether other rows wait; Apply: the state read before and after),
        /// always equal the states read off the whole model.
        #[test]
        fn the_deltas_keep_the_counts_exact(ops in proptest::collection::vec(op(), 0..80)) {
            let mut flows: Vec<Flow> = (0..3).map(|_| Flow::default()).collect();
            let mut counted = WaitDelta::NONE;
            for op in ops {
                match op {
                    Op::Receive { flow, ahead } => {
                        let f = &mut flows[flow];
                        let seq = f.last_seq + 1 + ahead;
                        if f.rows.contains_key(&seq) {
                            continue;
                        }
                        let others = !f.rows.is_empty();
                        f.rows.insert(seq, None);
                        counted.add(WaitDelta::received(f.last_seq + 1, seq, others));
                    }
                    Op::Apply { flow } => {
                        let f = &mut flows[flow];
                        let before = f.state();
                        // Applies the run of stored rows, as one Apply would (blocked ones too,
                        // as a consumer with the v2 decoder does).
                        while f.rows.remove(&(f.last_seq + 1)).is_some() {
                            f.last_seq += 1;
                        }
                        counted.add(WaitDelta::between(before, f.state()));
                    }
                    Op::Block { flow, reason } => {
                        let f = &mut flows[flow];
                        let before = f.state();
                        if let Some(row) = f.rows.get_mut(&(f.last_seq + 1)) {
                            *row = Some(crate::store::BLOCK_REASONS[reason]);
                        }
                        counted.add(WaitDelta::between(before, f.state()));
                    }
                }
                let gap = flows.iter().filter(|f| matches!(f.state(), Some(Waiting::Gap { .. }))).count() as i64;
                let ready = flows.iter().filter(|f| f.state() == Some(Waiting::Ready)).count() as i64;
                prop_assert_eq!(counted, WaitDelta { gap, ready });
            }
        }
    }

    #[test]
    fn receiving_moves_at_most_one_flow() {
        assert_eq!(WaitDelta::received(1, 1, false), WaitDelta { gap: 0, ready: 1 });
        assert_eq!(WaitDelta::received(3, 3, true), WaitDelta { gap: -1, ready: 1 });
        assert_eq!(WaitDelta::received(1, 2, false), WaitDelta { gap: 1, ready: 0 });
        assert_eq!(WaitDelta::received(1, 5, true), WaitDelta::NONE);
        let blocked = Some(Waiting::Blocked(BlockReason::UnsupportedSchema));
        assert_eq!(WaitDelta::between(Some(Waiting::Ready), blocked), WaitDelta { gap: 0, ready: -1 });
        assert_eq!(WaitDelta::between(blocked, Some(gap(4))), WaitDelta { gap: 1, ready: 0 });
        assert_eq!(WaitDelta::between(blocked, blocked), WaitDelta::NONE);
        assert_eq!(WaitDelta::between(Some(gap(2)), Some(gap(3))), WaitDelta::NONE, "still at a gap");
    }
}
