//! The relay's pure decisions, with no I/O: what an answer does to its outbox row and its
//! flow, the exit code a run ends with, and what counts as progress of a full consumer
//! backlog. Every answer that leaves a row unaccepted shows in the exit code.

use producer::store::DeliveryAnswer;

/// What an answer does to its row and to the rest of its flow in this pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Disposition {
    /// The consumer durably holds the event: mark the row accepted, go on with the flow.
    Mark,
    /// A full consumer backlog: not refused, only later. The flow waits (its later rows must
    /// not overtake the row) and the row is offered again after a backoff.
    Defer,
    /// A conflict or a rejection: the row stays unaccepted for an operator, the flow is held
    /// back.
    Refuse,
    /// An answer this relay does not understand (`UNSPECIFIED`, or a number from a newer or
    /// broken consumer): the row stays unaccepted and the flow is held back, since nothing
    /// says whether later rows may follow.
    NotUnderstood,
}

impl Disposition {
    /// True when the row stays unaccepted.
    pub fn leaves_unaccepted(self) -> bool {
        self != Disposition::Mark
    }

    /// True when no new row of the flow may be sent after this answer in this pass.
    pub fn holds_flow(self) -> bool {
        self != Disposition::Mark
    }
}

/// The disposition of every answer, spelled out so a new answer cannot fall into another's
/// arm unnoticed.
pub fn disposition(answer: DeliveryAnswer) -> Disposition {
    match answer {
        DeliveryAnswer::Accepted | DeliveryAnswer::Duplicate => Disposition::Mark,
        DeliveryAnswer::BacklogFull => Disposition::Defer,
        DeliveryAnswer::IdConflict | DeliveryAnswer::SequenceConflict | DeliveryAnswer::Rejected => {
            Disposition::Refuse
        }
        DeliveryAnswer::Unspecified | DeliveryAnswer::Unknown(_) => Disposition::NotUnderstood,
    }
}

/// Every row answered ends accepted (or nothing was answered).
pub const EXIT_DELIVERED: u8 = 0;
/// At least one row was left unaccepted by a conflict or a rejection: a human must decide.
pub const EXIT_REFUSED: u8 = 3;
/// No refusal, but at least one row answered in this run was left unaccepted for another
/// reason: an answer the relay does not understand, or a full backlog not retried before
/// the run ended (`once`, `send`, `run`).
pub const EXIT_UNACCEPTED: u8 = 4;

/// The exit code of a run, from the last disposition of every row answered in it that is
/// still unaccepted: refusals win over the other reasons, since they need a human.
pub fn exit_code(left_unaccepted: impl IntoIterator<Item = Disposition>) -> u8 {
    let mut code = EXIT_DELIVERED;
    for d in left_unaccepted {
        match d {
            Disposition::Mark => {}
            Disposition::Refuse => return EXIT_REFUSED,
            Disposition::Defer | Disposition::NotUnderstood => code = EXIT_UNACCEPTED,
        }
    }
    code
}

/// Whether a full consumer backlog moved between two passes of `drain`: any row accepted in
/// the last pass, or fewer rows deferred than in the pass before. "No progress at all" is
/// neither: the same (or a larger) number of rows deferred and nothing accepted.
pub fn backlog_progressed(previous_deferred: Option<usize>, deferred: usize, accepted: u64) -> bool {
    accepted > 0 || previous_deferred.is_some_and(|before| deferred < before)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_answer_has_its_disposition() {
        let table = [
            (DeliveryAnswer::Accepted, Disposition::Mark),
            (DeliveryAnswer::Duplicate, Disposition::Mark),
            (DeliveryAnswer::BacklogFull, Disposition::Defer),
            (DeliveryAnswer::IdConflict, Disposition::Refuse),
            (DeliveryAnswer::SequenceConflict, Disposition::Refuse),
            (DeliveryAnswer::Rejected, Disposition::Refuse),
            (DeliveryAnswer::Unspecified, Disposition::NotUnderstood),
            (DeliveryAnswer::Unknown(42), Disposition::NotUnderstood),
        ];
        for (answer, expected) in table {
            let d = disposition(answer);
            assert_eq!(d, expected, "{answer:?}");
            // Only a marking answer lets the row count as delivered or the flow go on.
            assert_eq!(d.leaves_unaccepted(), !answer.holds_event(), "{answer:?}");
            assert_eq!(d.holds_flow(), !answer.holds_event(), "{answer:?}");
        }
    }

    #[test]
    fn an_answer_not_understood_is_not_a_clean_exit() {
        // The bug this guards: UNSPECIFIED/unknown left the row unmarked yet exited 0.
        let unknown = disposition(DeliveryAnswer::from_wire(99));
        assert_eq!(exit_code([unknown]), EXIT_UNACCEPTED);
        assert_eq!(exit_code([disposition(DeliveryAnswer::from_wire(0))]), EXIT_UNACCEPTED);
    }

    #[test]
    fn exit_codes() {
        use Disposition::*;
        assert_eq!(exit_code([]), EXIT_DELIVERED);
        assert_eq!(exit_code([Mark, Mark]), EXIT_DELIVERED);
        assert_eq!(exit_code([Defer]), EXIT_UNACCEPTED);
        assert_eq!(exit_code([NotUnderstood, Mark]), EXIT_UNACCEPTED);
        assert_eq!(exit_code([Refuse]), EXIT_REFUSED);
        // A refusal needs a human: it wins whatever else was left.
        assert_eq!(exit_code([NotUnderstood, Refuse, Defer]), EXIT_REFUSED);
        assert_eq!(exit_code([Defer, NotUnderstood]), EXIT_UNACCEPTED);
    }

    #[test]
    fn backlog_progress() {
        // The first pass that meets a full backlog has nothing to compare with.
        assert!(!backlog_progressed(None, 5, 0));
        assert!(backlog_progressed(None, 5, 1));
        assert!(backlog_progressed(Some(5), 4, 0));
        assert!(backlog_progressed(Some(5), 5, 2));
        assert!(!backlog_progressed(Some(5), 5, 0));
        assert!(!backlog_progressed(Some(5), 6, 0));
    }
}
