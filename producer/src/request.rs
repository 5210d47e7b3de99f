//! Validation of an `Advance` request before anything is read or written: malformed input is
//! `INVALID_ARGUMENT` naming the field and the limit (SPEC §5).

use proto::body::Event;
use proto::flow::{Kind, MAX_AMOUNT, encode_amount};
use proto::limits::{LimitError, MAX_ID_BYTES, MAX_SEQ, check_token};
use proto::pb;

/// A well-formed `Advance` request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdvanceCommand {
    /// The flow to step.
    pub flow_id: String,
    /// The id the step's event gets (a retry sends the same one).
    pub event_id: String,
    /// The flow's seq the caller last saw; any other seq makes the call `STALE`.
    pub expected_seq: u64,
    /// The step.
    pub kind: Kind,
    /// The payload schema the event is written with.
    pub schema: u32,
    /// The flow's amount (fixed by `reserved`, repeated by the later steps).
    pub amount: i64,
}

impl AdvanceCommand {
    /// The event this command would commit (its seq is `expected_seq + 1`). Comparing its
    /// canonical body with a stored one decides `EXISTING` versus `CONFLICT`.
    pub fn event(&self) -> Event {
        Event {
            event_id: self.event_id.clone(),
            flow_id: self.flow_id.clone(),
            seq: self.expected_seq + 1,
            kind: self.kind.as_str().to_owned(),
            schema: self.schema,
            // `validate` admitted only schemas 1 and 2, which both have an encoding.
            payload: encode_amount(self.schema, self.amount).unwrap_or_default(),
        }
    }
}

/// Checks every field; the error names the field and the limit. Takes the request so that
/// its ids move into the command instead of being copied.
pub fn validate(req: pb::AdvanceRequest) -> Result<AdvanceCommand, LimitError> {
    check_token("flow_id", &req.flow_id, MAX_ID_BYTES)?;
    check_token("event_id", &req.event_id, MAX_ID_BYTES)?;
    let kind = Kind::parse(&req.kind).ok_or_else(|| LimitError {
        field: "kind".into(),
        message: format!("must be one of reserved, confirmed, released; got {:?}", req.kind),
    })?;
    if !(1..=2).contains(&req.schema) {
        return Err(LimitError {
            field: "schema".into(),
            message: format!("must be 1 (amount) or 2 (units), got {}", req.schema),
        });
    }
    if !(1..=MAX_AMOUNT).contains(&req.amount) {
        return Err(LimitError {
            field: "amount".into(),
            message: format!("must be 1 to 2^53 ({MAX_AMOUNT}), got {}", req.amount),
        });
    }
    if req.expected_seq >= MAX_SEQ {
        return Err(LimitError {
            field: "expected_seq".into(),
            message: format!("must be below 2^53 ({MAX_SEQ}), got {}", req.expected_seq),
        });
    }
    Ok(AdvanceCommand {
        flow_id: req.flow_id,
        event_id: req.event_id,
        expected_seq: req.expected_seq,
        kind,
        schema: req.schema,
        amount: req.amount,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> pb::AdvanceRequest {
        pb::AdvanceRequest {
            flow_id: "A".into(),
            event_id: "A1".into(),
            expected_seq: 0,
            kind: "reserved".into(),
            schema: 1,
            amount: 3,
        }
    }

    #[test]
    fn valid_request_builds_the_event() {
        let cmd = validate(req()).unwrap();
        assert_eq!(
            cmd.event().canonical_body(),
            r#"{"event_id":"A1","flow_id":"A","kind":"reserved","payload":{"amount":3},"schema":1,"seq":1}"#
        );
        let v2 =
            validate(pb::AdvanceRequest { schema: 2, expected_seq: 1, kind: "confirmed".into(), ..req() })
                .unwrap();
        assert_eq!(
            v2.event().canonical_body(),
            r#"{"event_id":"A1","flow_id":"A","kind":"confirmed","payload":{"units":3},"schema":2,"seq":2}"#
        );
    }

    #[test]
    fn malformed_fields_are_named() {
        let field = |r: pb::AdvanceRequest| validate(r).unwrap_err().field;
        assert_eq!(field(pb::AdvanceRequest { flow_id: String::new(), ..req() }), "flow_id");
        assert_eq!(field(pb::AdvanceRequest { event_id: "x".repeat(129), ..req() }), "event_id");
        assert_eq!(field(pb::AdvanceRequest { kind: "teleported".into(), ..req() }), "kind");
        assert_eq!(field(pb::AdvanceRequest { schema: 3, ..req() }), "schema");
        assert_eq!(field(pb::AdvanceRequest { schema: 0, ..req() }), "schema");
        assert_eq!(field(pb::AdvanceRequest { amount: 0, ..req() }), "amount");
        assert_eq!(field(pb::AdvanceRequest { amount: -3, ..req() }), "amount");
        assert_eq!(field(pb::AdvanceRequest { amount: MAX_AMOUNT + 1, ..req() }), "amount");
        assert_eq!(field(pb::AdvanceRequest { expected_seq: u64::MAX, ..req() }), "expected_seq");
        assert!(validate(pb::AdvanceRequest { amount: MAX_AMOUNT, ..req() }).is_ok());
    }
}
