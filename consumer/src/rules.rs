//! What `Apply` does with a flow's exact next inbox row (SPEC §7), without I/O: decode the
//! payload by schema, check the step, and decide Apply (with the projection after it) or
//! Block (with the reason that is stored on the row).

use proto::body::Event;
use proto::flow::{DecodeError, FlowState, Kind, check_step, decode_amount};

/// Why a stored row cannot be applied yet; stored lowercase in `inbox.reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockReason {
    /// No decoder for the row's schema is enabled (a consumer with one can apply it).
    UnsupportedSchema,
    /// The payload does not carry a valid amount for its schema.
    InvalidPayload,
    /// The step is not legal from the flow's applied state.
    InvalidTransition,
}

impl BlockReason {
    /// The lowercase name, exactly as stored and sent.
    pub fn as_str(self) -> &'static str {
        match self {
            BlockReason::UnsupportedSchema => "unsupported_schema",
            BlockReason::InvalidPayload => "invalid_payload",
            BlockReason::InvalidTransition => "invalid_transition",
        }
    }

    /// Parses a stored reason.
    pub fn parse(s: &str) -> Option<BlockReason> {
        match s {
            "unsupported_schema" => Some(BlockReason::UnsupportedSchema),
            "invalid_payload" => Some(BlockReason::InvalidPayload),
            "invalid_transition" => Some(BlockReason::InvalidTransition),
            _ => None,
        }
    }
}

/// A flow's applied state on the consumer. A flow with no row is [`Projection::NEW`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Projection {
    /// The seq of the last applied event (0: none).
    pub last_seq: u64,
    /// The state the last applied event led to.
    pub state: FlowState,
    /// Units held now (`state.held(amount)`).
    pub held: i64,
    /// Fixed by the `reserved` event; 0 while `new`.
    pub amount: i64,
}

impl Projection {
    /// A flow nothing has been applied to.
    pub const NEW: Projection = Projection { last_seq: 0, state: FlowState::New, held: 0, amount: 0 };

    /// The seq `Apply` looks for next: exactly one past the last applied.
    pub fn next_seq(&self) -> u64 {
        self.last_seq + 1
    }
}

/// What to do with the next row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Apply it: the projection becomes `after`, and the effect records `kind` and
    /// `after.held`.
    Apply {
        /// The step the row makes.
        kind: Kind,
        /// The projection after it.
        after: Projection,
    },
    /// Leave it stored, marked `blocked` with `reason`; `detail` says why in words.
    Block {
        /// Why, as stored.
        reason: BlockReason,
        /// Why in words.
        detail: String,
    },
}

/// Decides about `event`, the row stored at `from.next_seq()`, for a consumer whose v2
/// decoder is enabled or not. The order is SPEC §7's: schema and payload first, then the
/// step (an unknown kind or a changed amount is an invalid transition).
pub fn decide_next(from: &Projection, event: &Event, support_v2: bool) -> Decision {
    let amount = match decode_amount(event.schema, &event.payload, support_v2) {
        Ok(amount) => amount,
        Err(DecodeError::UnsupportedSchema(schema)) => {
            let detail = if schema == 2 {
                "schema 2 is not supported by this consumer (start it with --support-v2)".to_owned()
            } else {
                format!("schema {schema} is not supported by this consumer")
            };
            return Decision::Block { reason: BlockReason::UnsupportedSchema, detail };
        }
        Err(DecodeError::InvalidPayload(detail)) => {
            return Decision::Block { reason: BlockReason::InvalidPayload, detail };
        }
    };
    let invalid = |detail: String| Decision::Block { reason: BlockReason::InvalidTransition, detail };
    if event.seq != from.next_seq() {
        return invalid(format!("seq {} is not the flow's next seq {}", event.seq, from.next_seq()));
    }
    let Some(kind) = Kind::parse(&event.kind) else {
        return invalid(format!("kind {:?} is not a step (only reserved, confirmed, released)", event.kind));
    };
    match check_step(from.state, from.amount, kind, amount) {
        Ok(state) => {
            let amount = if from.state == FlowState::New { amount } else { from.amount };
            Decision::Apply {
                kind,
                after: Projection { last_seq: event.seq, state, held: state.held(amount), amount },
            }
        }
        Err(e) => invalid(e.to_string()),
    }
}

/// Why a flow with accepted-but-unapplied rows waits (the operator's view, `ListStuck`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waiting {
    /// The next row is stored and not blocked: `Apply` simply has not run yet.
    Ready,
    /// The next row is stored and blocked for this reason.
    Blocked(BlockReason),
    /// The next seq is missing while later ones are stored.
    Gap {
        /// The missing seq.
        waiting_for_seq: u64,
    },
}

/// Classifies a waiting flow from its projection and its lowest unapplied row (its seq and,
/// if blocked, its reason).
pub fn why_waiting(from: &Projection, lowest_unapplied_seq: u64, blocked: Option<BlockReason>) -> Waiting {
    if lowest_unapplied_seq != from.next_seq() {
        return Waiting::Gap { waiting_for_seq: from.next_seq() };
    }
    match blocked {
        Some(reason) => Waiting::Blocked(reason),
        None => Waiting::Ready,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::limits::parse_payload;

    #[test]
    fn waiting_flows_are_classified() {
        let p1 = Projection { last_seq: 1, state: FlowState::Reserved, held: 3, amount: 3 };
        assert_eq!(why_waiting(&Projection::NEW, 1, None), Waiting::Ready);
        assert_eq!(why_waiting(&Projection::NEW, 3, None), Waiting::Gap { waiting_for_seq: 1 });
        assert_eq!(why_waiting(&p1, 3, None), Waiting::Gap { waiting_for_seq: 2 });
        assert_eq!(
            why_waiting(&p1, 2, Some(BlockReason::UnsupportedSchema)),
            Waiting::Blocked(BlockReason::UnsupportedSchema)
        );
    }

    fn event(seq: u64, kind: &str, schema: u32, payload: &str) -> Event {
        Event {
            event_id: format!("A{seq}"),
            flow_id: "A".into(),
            seq,
            kind: kind.into(),
            schema,
            payload: parse_payload(payload).expect("valid payload"),
        }
    }

    fn reason(d: Decision) -> BlockReason {
        match d {
            Decision::Block { reason, .. } => reason,
            other => panic!("expected a block, got {other:?}"),
        }
    }

    fn after(d: Decision) -> Projection {
        match d {
            Decision::Apply { after, .. } => after,
            other => panic!("expected apply, got {other:?}"),
        }
    }

    #[test]
    fn the_reference_flow_applies_step_by_step() {
        let p1 = after(decide_next(&Projection::NEW, &event(1, "reserved", 1, r#"{"amount":3}"#), false));
        assert_eq!(p1, Projection { last_seq: 1, state: FlowState::Reserved, held: 3, amount: 3 });
        let p2 = after(decide_next(&p1, &event(2, "confirmed", 1, r#"{"amount":3}"#), false));
        assert_eq!(p2, Projection { last_seq: 2, state: FlowState::Confirmed, held: 3, amount: 3 });
        let p3 = after(decide_next(&p2, &event(3, "released", 1, r#"{"amount":3}"#), false));
        assert_eq!(p3, Projection { last_seq: 3, state: FlowState::Released, held: 0, amount: 3 });
    }

    #[test]
    fn schema_2_needs_the_v2_decoder() {
        let p1 = after(decide_next(&Projection::NEW, &event(1, "reserved", 1, r#"{"amount":3}"#), false));
        let v2 = event(2, "confirmed", 2, r#"{"units":3}"#);
        let blocked = decide_next(&p1, &v2, false);
        assert!(matches!(&blocked, Decision::Block { detail, .. } if detail.contains("--support-v2")));
        assert_eq!(reason(blocked), BlockReason::UnsupportedSchema);
        assert_eq!(after(decide_next(&p1, &v2, true)).state, FlowState::Confirmed);
        assert_eq!(
            reason(decide_next(&p1, &event(2, "confirmed", 9, r#"{"amount":3}"#), true)),
            BlockReason::UnsupportedSchema
        );
    }

    #[test]
    fn bad_payloads_are_invalid_payload() {
        for payload in [r#"{"units":3}"#, r#"{"amount":"3"}"#, r#"{"amount":0}"#, "{}"] {
            let d = decide_next(&Projection::NEW, &event(1, "reserved", 1, payload), true);
            assert_eq!(reason(d), BlockReason::InvalidPayload, "{payload}");
        }
    }

    #[test]
    fn illegal_steps_unknown_kinds_and_changed_amounts_are_invalid_transitions() {
        let p1 = after(decide_next(&Projection::NEW, &event(1, "reserved", 1, r#"{"amount":3}"#), false));
        let cases = [
            (Projection::NEW, event(1, "confirmed", 1, r#"{"amount":3}"#)),
            (Projection::NEW, event(1, "teleported", 1, r#"{"amount":3}"#)),
            (p1, event(2, "reserved", 1, r#"{"amount":3}"#)),
            (p1, event(2, "released", 1, r#"{"amount":3}"#)),
            (p1, event(2, "confirmed", 1, r#"{"amount":4}"#)),
            (p1, event(3, "confirmed", 1, r#"{"amount":3}"#)),
        ];
        for (from, e) in cases {
            assert_eq!(reason(decide_next(&from, &e, true)), BlockReason::InvalidTransition, "{e:?}");
        }
        let released = Projection { last_seq: 3, state: FlowState::Released, held: 0, amount: 3 };
        assert_eq!(
            reason(decide_next(&released, &event(4, "released", 1, r#"{"amount":3}"#), true)),
            BlockReason::InvalidTransition
        );
    }

    #[test]
    fn payload_is_checked_before_the_step() {
        // An unknown kind with an undecodable schema is reported as the schema problem.
        let d = decide_next(&Projection::NEW, &event(1, "teleported", 7, "{}"), false);
        assert_eq!(reason(d), BlockReason::UnsupportedSchema);
    }

    #[test]
    fn reasons_round_trip() {
        for r in [BlockReason::UnsupportedSchema, BlockReason::InvalidPayload, BlockReason::InvalidTransition]
        {
            assert_eq!(BlockReason::parse(r.as_str()), Some(r));
        }
        assert_eq!(BlockReason::parse("nope"), None);
    }
}
