//! The relay's stdout: JSON lines only, one per answered envelope and a final summary
//! (SPEC §11), written out after each recorded run of answers (one write per run, not per
//! line). Logs go to stderr.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;

use proto::pb::ReceiveOutcome;
use serde_json::json;

/// The short word of an answer, e.g. `ACCEPTED`, `ID_CONFLICT`.
pub fn word(outcome: ReceiveOutcome) -> &'static str {
    let name = outcome.as_str_name();
    name.strip_prefix("RECEIVE_OUTCOME_").unwrap_or(name)
}

/// True for answers that mean the consumer durably holds the event.
pub fn is_accepted(outcome: ReceiveOutcome) -> bool {
    matches!(outcome, ReceiveOutcome::Accepted | ReceiveOutcome::Duplicate)
}

/// True for answers that need a human (exit code 3).
pub fn is_refusal(outcome: ReceiveOutcome) -> bool {
    matches!(
        outcome,
        ReceiveOutcome::IdConflict | ReceiveOutcome::SequenceConflict | ReceiveOutcome::Rejected
    )
}

/// Counts what one run did and writes the lines.
#[derive(Debug, Default)]
pub struct Report {
    counts: BTreeMap<&'static str, u64>,
    skipped_flows: BTreeSet<String>,
    sent: u64,
    refusals: u64,
    /// Delivery lines not yet written to stdout.
    pending: String,
}

impl Report {
    /// Writes one `delivery` line and counts it.
    pub fn delivery(
        &mut self,
        event_id: &str,
        flow_id: &str,
        seq: u64,
        outcome: ReceiveOutcome,
        detail: &str,
    ) {
        self.sent += 1;
        *self.counts.entry(word(outcome)).or_default() += 1;
        if is_refusal(outcome) {
            self.refusals += 1;
        }
        let mut line = json!({
            "type": "delivery",
            "event_id": event_id,
            "flow_id": flow_id,
            "seq": seq,
            "outcome": word(outcome),
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

    /// Envelopes answered so far.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// Writes the final `summary` line and returns the exit code: 3 when any answer was a
    /// conflict or rejection, else 0.
    pub fn finish(&mut self, mode: &str) -> i32 {
        self.flush();
        emit(&json!({
            "type": "summary",
            "mode": mode,
            "sent": self.sent,
            "counts": self.counts,
            "skipped_flows": self.skipped_flows,
            "idle": self.sent == 0,
        }));
        if self.refusals > 0 { 3 } else { 0 }
    }
}

fn emit(line: &serde_json::Value) {
    write_out(&format!("{line}\n"));
}

fn write_out(lines: &str) {
    let mut out = std::io::stdout().lock();
    // stdout closed by the reader is not worth dying for; the ledger is what counts.
    let _ = out.write_all(lines.as_bytes());
    let _ = out.flush();
}
