//! The relay's stdout: JSON lines only, one per answered envelope and a final summary
//! (SPEC §11), written out after each recorded run of answers (one write per run, not per
//! line). Logs go to stderr. The report also remembers which answered rows are still left
//! unaccepted, so the exit code cannot say "delivered" while one is.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;

use producer::store::DeliveryAnswer;
use serde_json::json;

use crate::decision::{self, Disposition};

/// Counts what one run did and writes the lines.
#[derive(Debug, Default)]
pub struct Report {
    counts: BTreeMap<String, u64>,
    skipped_flows: BTreeSet<String>,
    sent: u64,
    /// Rows answered in this run whose last answer left them unaccepted, by event id. A row
    /// later accepted in the same run leaves this map, so it holds at most the unaccepted
    /// rows, however long `run` goes on.
    left_unaccepted: BTreeMap<String, Disposition>,
    /// Delivery lines not yet written to stdout.
    pending: String,
    /// `run` without `--delivery-lines` writes none (counts and metrics only).
    quiet_deliveries: bool,
    /// Partitions held (`run` with leases), shown in the progress and summary lines.
    partitions: Option<usize>,
}

/// Relay deliveries by the consumer's answer (one atomic add per answer).
pub static DELIVERIES: runtime::metrics::Counters<8> = runtime::metrics::Counters::new(
    "ordered_events_relay_deliveries",
    "Envelopes the consumer answered, by answer.",
    "answer",
    [
        "accepted",
        "duplicate",
        "id_conflict",
        "sequence_conflict",
        "rejected",
        "backlog_full",
        "unspecified",
        "unknown",
    ],
);

fn answer_index(answer: DeliveryAnswer) -> usize {
    match answer {
        DeliveryAnswer::Accepted => 0,
        DeliveryAnswer::Duplicate => 1,
        DeliveryAnswer::IdConflict => 2,
        DeliveryAnswer::SequenceConflict => 3,
        DeliveryAnswer::Rejected => 4,
        DeliveryAnswer::BacklogFull => 5,
        DeliveryAnswer::Unspecified => 6,
        DeliveryAnswer::Unknown(_) => 7,
    }
}

impl Report {
    /// A report that writes a `delivery` line per answer (`per_delivery`), or only counts.
    pub fn new(per_delivery: bool) -> Report {
        Report { quiet_deliveries: !per_delivery, ..Report::default() }
    }

    /// Notes one recorded answer and queues its `delivery` line.
    pub fn delivery(
        &mut self,
        event_id: &str,
        flow_id: &str,
        seq: u64,
        answer: DeliveryAnswer,
        detail: &str,
    ) {
        self.sent += 1;
        DELIVERIES.inc(answer_index(answer));
        let word = answer.word();
        *self.counts.entry(word.clone().into_owned()).or_default() += 1;
        match decision::disposition(answer) {
            Disposition::Mark => {
                self.left_unaccepted.remove(event_id);
            }
            other => {
                self.left_unaccepted.insert(event_id.to_owned(), other);
            }
        }
        if self.quiet_deliveries {
            return;
        }
        let mut line = json!({
            "type": "delivery",
            "event_id": event_id,
            "flow_id": flow_id,
            "seq": seq,
            "outcome": word,
        });
        if !detail.is_empty() {
            line["detail"] = json!(detail);
        }
        self.pending.push_str(&line.to_string());
        self.pending.push('\n');
    }

    /// Writes the delivery lines gathered since the last flush (call it after each recorded
    /// run of answers).
    pub fn flush(&mut self) {
        if !self.pending.is_empty() {
            write_out(&self.pending);
            self.pending.clear();
        }
    }

    /// Notes a flow whose remaining rows were not sent in a pass.
    pub fn skipped(&mut self, flow_id: &str) {
        self.skipped_flows.insert(flow_id.to_owned());
    }

    /// Notes how many partitions the relay holds now (`run` with leases).
    pub fn set_partitions(&mut self, held: usize) {
        self.partitions = Some(held);
    }

    /// Envelopes answered so far.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// The summary line's value (without writing it) and the exit code.
    pub fn summary(&self, mode: &str) -> (serde_json::Value, u8) {
        let summary = json!({
            "type": "summary",
            "mode": mode,
            "sent": self.sent,
            "counts": self.counts,
            "skipped_flows": self.skipped_flows,
            "left_unaccepted": self.left_unaccepted.len(),
            "idle": self.sent == 0,
        });
        let mut summary = summary;
        if let Some(held) = self.partitions {
            summary["partitions"] = json!(held);
        }
        (summary, decision::exit_code(self.left_unaccepted.values().copied()))
    }

    /// Writes a `progress` line: the summary so far (`run`'s periodic report when it writes
    /// no delivery lines).
    pub fn progress(&mut self, mode: &str) {
        self.flush();
        let (mut line, _) = self.summary(mode);
        line["type"] = json!("progress");
        write_out(&format!("{line}\n"));
    }

    /// Writes the final `summary` line and returns the exit code (see [`decision::exit_code`]).
    pub fn finish(&mut self, mode: &str) -> u8 {
        self.flush();
        let (summary, code) = self.summary(mode);
        write_out(&format!("{summary}\n"));
        code
    }
}

/// Writes one `{"type":"lease",...}` line: `event` (`acquired`, `lost`, `released`) of
/// `leases` (`(partition, epoch)`) by relay `instance`, and how many it holds now.
pub fn lease_line(instance: &str, event: &str, leases: &[(u16, u64)], held: usize) {
    let line = json!({
        "type": "lease",
        "event": event,
        "instance": instance,
        "partitions": leases.iter().map(|(p, e)| json!({"partition": p, "epoch": e})).collect::<Vec<_>>(),
        "held": held,
    });
    write_out(&format!("{line}\n"));
}

/// Writes the one `{"type":"accept_lost",...}` line of `relay accept-lost`.
pub fn accept_lost_line(done: &crate::identity::LossAccepted) {
    let line = json!({
        "type": "accept_lost",
        "consumer_database_id": done.consumer_db,
        "lost": done.lost,
        "loss_accepted": done.loss_accepted,
        "first": done.first,
        "unmarked": done.unmarked,
    });
    write_out(&format!("{line}\n"));
}

fn write_out(lines: &str) {
    let mut out = std::io::stdout().lock();
    // stdout closed by the reader is not worth dying for; the ledger is what counts.
    let _ = out.write_all(lines.as_bytes());
    let _ = out.flush();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::{EXIT_DELIVERED, EXIT_REFUSED, EXIT_UNACCEPTED};

    #[test]
    fn an_unknown_answer_shows_in_the_summary_and_the_exit_code() {
        let mut r = Report::default();
        r.delivery("A1", "A", 1, DeliveryAnswer::Accepted, "");
        r.delivery("B1", "B", 1, DeliveryAnswer::from_wire(99), "");
        let (summary, code) = r.summary("drain");
        assert_eq!(code, EXIT_UNACCEPTED);
        assert_eq!(summary["left_unaccepted"], 1);
        assert_eq!(summary["counts"]["UNKNOWN_99"], 1);
        assert_eq!(summary["counts"]["ACCEPTED"], 1);
    }

    #[test]
    fn a_row_deferred_then_accepted_is_delivered() {
        let mut r = Report::default();
        r.delivery("A1", "A", 1, DeliveryAnswer::BacklogFull, "backlog full");
        assert_eq!(r.summary("drain").1, EXIT_UNACCEPTED);
        r.delivery("A1", "A", 1, DeliveryAnswer::Accepted, "");
        let (summary, code) = r.summary("drain");
        assert_eq!((code, summary["left_unaccepted"].as_u64()), (EXIT_DELIVERED, Some(0)));
        assert_eq!(summary["sent"], 2);
        r.delivery("B1", "B", 1, DeliveryAnswer::SequenceConflict, "");
        r.delivery("C1", "C", 1, DeliveryAnswer::Unspecified, "");
        assert_eq!(r.summary("drain").1, EXIT_REFUSED);
    }

    #[test]
    fn nothing_answered_is_idle_and_clean() {
        let (summary, code) = Report::default().summary("once");
        assert_eq!((summary["idle"].as_bool(), code), (Some(true), EXIT_DELIVERED));
    }
}
