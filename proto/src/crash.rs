//! Named crash points (SPEC §9): a process armed through `ORDERED_EVENTS_CRASH_AT` writes
//! `crash_point=<name>` to stderr and calls `_exit(73)` exactly there: no destructors, no
//! flush, no rollback-on-drop. Only a write path that reaches the point fires it.

use std::fmt;
use std::str::FromStr;

/// The environment variable that arms a crash point.
pub const ENV: &str = "ORDERED_EVENTS_CRASH_AT";
/// The exit code of a fired crash point.
pub const EXIT_CODE: i32 = 73;

/// The crash points: the ten of the reference in SPEC order, then the four of compaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CrashPoint {
    /// `producer.after_flow_update`: the flow row is written, its outbox row is not.
    ProducerAfterFlowUpdate,
    /// `producer.after_outbox_insert`: both rows are written, not committed.
    ProducerAfterOutboxInsert,
    /// `producer.after_commit`: committed, not answered.
    ProducerAfterCommit,
    /// `consumer.receive.after_insert`: the inbox row is written, not committed.
    ConsumerReceiveAfterInsert,
    /// `consumer.receive.after_commit`: committed, not answered.
    ConsumerReceiveAfterCommit,
    /// `relay.after_mark`: the accepted marks are written, not committed.
    RelayAfterMark,
    /// `relay.after_mark_commit`: the marks are committed.
    RelayAfterMarkCommit,
    /// `consumer.apply.after_projection`: the projection is written, its effect is not.
    ConsumerApplyAfterProjection,
    /// `consumer.apply.after_effect`: projection, effect and applied mark are written, not
    /// committed.
    ConsumerApplyAfterEffect,
    /// `consumer.apply.after_commit`: the step is committed, not answered.
    ConsumerApplyAfterCommit,
    /// `producer.compact.after_batch`: a compaction batch of outbox rows is rewritten to
    /// tombstones, not committed.
    ProducerCompactAfterBatch,
    /// `producer.compact.after_commit`: a compaction batch is committed.
    ProducerCompactAfterCommit,
    /// `consumer.compact.after_batch`: a compaction batch of inbox rows is rewritten to
    /// tombstones, not committed.
    ConsumerCompactAfterBatch,
    /// `consumer.compact.after_commit`: a compaction batch is committed.
    ConsumerCompactAfterCommit,
}

impl CrashPoint {
    /// Every point, in SPEC order.
    pub const ALL: [CrashPoint; 14] = [
        CrashPoint::ProducerAfterFlowUpdate,
        CrashPoint::ProducerAfterOutboxInsert,
        CrashPoint::ProducerAfterCommit,
        CrashPoint::ConsumerReceiveAfterInsert,
        CrashPoint::ConsumerReceiveAfterCommit,
        CrashPoint::RelayAfterMark,
        CrashPoint::RelayAfterMarkCommit,
        CrashPoint::ConsumerApplyAfterProjection,
        CrashPoint::ConsumerApplyAfterEffect,
        CrashPoint::ConsumerApplyAfterCommit,
        CrashPoint::ProducerCompactAfterBatch,
        CrashPoint::ProducerCompactAfterCommit,
        CrashPoint::ConsumerCompactAfterBatch,
        CrashPoint::ConsumerCompactAfterCommit,
    ];

    /// The name used in the environment variable and the stderr marker.
    pub fn name(self) -> &'static str {
        match self {
            CrashPoint::ProducerAfterFlowUpdate => "producer.after_flow_update",
            CrashPoint::ProducerAfterOutboxInsert => "producer.after_outbox_insert",
            CrashPoint::ProducerAfterCommit => "producer.after_commit",
            CrashPoint::ConsumerReceiveAfterInsert => "consumer.receive.after_insert",
            CrashPoint::ConsumerReceiveAfterCommit => "consumer.receive.after_commit",
            CrashPoint::RelayAfterMark => "relay.after_mark",
            CrashPoint::RelayAfterMarkCommit => "relay.after_mark_commit",
            CrashPoint::ConsumerApplyAfterProjection => "consumer.apply.after_projection",
            CrashPoint::ConsumerApplyAfterEffect => "consumer.apply.after_effect",
            CrashPoint::ConsumerApplyAfterCommit => "consumer.apply.after_commit",
            CrashPoint::ProducerCompactAfterBatch => "producer.compact.after_batch",
            CrashPoint::ProducerCompactAfterCommit => "producer.compact.after_commit",
            CrashPoint::ConsumerCompactAfterBatch => "consumer.compact.after_batch",
            CrashPoint::ConsumerCompactAfterCommit => "consumer.compact.after_commit",
        }
    }

    /// The stderr line a fired point writes.
    pub fn marker(self) -> String {
        format!("crash_point={}", self.name())
    }
}

impl fmt::Display for CrashPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is not one of the known points.
#[derive(Debug, thiserror::Error)]
#[error("{ENV}={0:?} is not a crash point; known points: {known}", known = CrashPoint::ALL.map(CrashPoint::name).join(", "))]
pub struct UnknownCrashPoint(pub String);

impl FromStr for CrashPoint {
    type Err = UnknownCrashPoint;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CrashPoint::ALL.into_iter().find(|p| p.name() == s).ok_or_else(|| UnknownCrashPoint(s.to_owned()))
    }
}

/// The crash point this process is armed with, if any. Cheap to copy into every worker.
#[derive(Clone, Copy, Debug, Default)]
pub struct CrashSwitch {
    armed: Option<CrashPoint>,
}

impl CrashSwitch {
    /// Reads `ORDERED_EVENTS_CRASH_AT`; unset or empty means disarmed, an unknown name is an
    /// error. An armed point is logged loudly, since it will kill the process.
    pub fn from_env() -> Result<CrashSwitch, UnknownCrashPoint> {
        let armed = match std::env::var(ENV) {
            Ok(name) if !name.is_empty() => Some(name.parse::<CrashPoint>()?),
            _ => None,
        };
        if let Some(point) = armed {
            tracing::warn!(
                crash_point = point.name(),
                "CRASH POINT ARMED: this process will _exit({EXIT_CODE}) when a write reaches {point}"
            );
        }
        Ok(CrashSwitch { armed })
    }

    /// True when this process is armed at `point` (a store may then take a slower path that
    /// reaches the point exactly where it stands, e.g. between two statements it would
    /// otherwise pipeline).
    pub fn is_armed_at(&self, point: CrashPoint) -> bool {
        self.armed == Some(point)
    }

    /// Dies here if armed at `point`: marker on stderr, then `_exit(73)` with no unwinding,
    /// no destructors and no rollback-on-drop.
    pub fn reach(&self, point: CrashPoint) {
        if self.armed == Some(point) {
            use std::io::Write as _;
            let mut err = std::io::stderr().lock();
            let _ = writeln!(err, "{}", point.marker());
            let _ = err.flush();
            // The one unsafe call of this crate: a crash point must die without running
            // destructors or rollback-on-drop, which `std::process::exit` would not skip
            // (it runs atexit handlers and flushes stdio), and no safe `_exit` exists.
            #[allow(unsafe_code)]
            // SAFETY: `_exit` ends the process immediately; nothing after it runs.
            unsafe {
                libc::_exit(EXIT_CODE)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_unique() {
        for p in CrashPoint::ALL {
            assert_eq!(p.name().parse::<CrashPoint>().unwrap(), p);
        }
        let mut names: Vec<_> = CrashPoint::ALL.map(CrashPoint::name).to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), 14);
        assert!("producer.nowhere".parse::<CrashPoint>().is_err());
    }
}
