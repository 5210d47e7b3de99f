//! The business protocol (SPEC §3) and the payload decoders (SPEC §4): which step is legal
//! next, what a flow holds, and how each schema carries the amount. Pure functions, shared
//! by the producer (to refuse) and the consumer (to block).

use crate::body::{MAX_SAFE_INT, Payload, Scalar};

/// A flow's state. `New` is implicit: the flow has no row yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlowState {
    /// No step yet.
    New,
    /// After `reserved`: the amount is fixed.
    Reserved,
    /// After `confirmed`.
    Confirmed,
    /// After `released`: the flow is finished.
    Released,
}

impl FlowState {
    /// The lowercase name, exactly as stored and sent.
    pub fn as_str(self) -> &'static str {
        match self {
            FlowState::New => "new",
            FlowState::Reserved => "reserved",
            FlowState::Confirmed => "confirmed",
            FlowState::Released => "released",
        }
    }

    /// Parses a stored state name.
    pub fn parse(s: &str) -> Option<FlowState> {
        match s {
            "new" => Some(FlowState::New),
            "reserved" => Some(FlowState::Reserved),
            "confirmed" => Some(FlowState::Confirmed),
            "released" => Some(FlowState::Released),
            _ => None,
        }
    }

    /// The seq of the last event that led here (`new` is 0).
    pub fn seq(self) -> u64 {
        match self {
            FlowState::New => 0,
            FlowState::Reserved => 1,
            FlowState::Confirmed => 2,
            FlowState::Released => 3,
        }
    }

    /// Units held on the consumer in this state: `reserved` and `confirmed` hold the
    /// amount, `released` and `new` hold nothing.
    pub fn held(self, amount: i64) -> i64 {
        match self {
            FlowState::Reserved | FlowState::Confirmed => amount,
            FlowState::New | FlowState::Released => 0,
        }
    }
}

/// An event kind: the step it makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// The first step: fixes the amount.
    Reserved,
    /// The second step.
    Confirmed,
    /// The last step.
    Released,
}

impl Kind {
    /// The lowercase name, exactly as stored and sent.
    pub fn as_str(self) -> &'static str {
        self.target().as_str()
    }

    /// Parses a kind name; anything else is not one of the three steps.
    pub fn parse(s: &str) -> Option<Kind> {
        match s {
            "reserved" => Some(Kind::Reserved),
            "confirmed" => Some(Kind::Confirmed),
            "released" => Some(Kind::Released),
            _ => None,
        }
    }

    /// The state this step leads to.
    pub fn target(self) -> FlowState {
        match self {
            Kind::Reserved => FlowState::Reserved,
            Kind::Confirmed => FlowState::Confirmed,
            Kind::Released => FlowState::Released,
        }
    }
}

/// Why a step is not legal.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    /// The step does not lead from the flow's state to the next one.
    #[error("{from} -> {to} is not a legal step (only new->reserved->confirmed->released)")]
    Illegal {
        /// The flow's state.
        from: &'static str,
        /// The state the step would lead to.
        to: &'static str,
    },
    /// A later step carries another amount than the reserved one.
    #[error("amount {got} differs from the amount {fixed} fixed by the reserved event")]
    AmountChanged {
        /// The amount of the `reserved` step.
        fixed: i64,
        /// The amount this step carries.
        got: i64,
    },
}

/// Checks that `kind` with `amount` is the legal next step from `from`, whose amount (for
/// any state but `new`) is `fixed_amount`. Returns the new state.
pub fn check_step(
    from: FlowState,
    fixed_amount: i64,
    kind: Kind,
    amount: i64,
) -> Result<FlowState, TransitionError> {
    let to = kind.target();
    if to.seq() != from.seq() + 1 {
        return Err(TransitionError::Illegal { from: from.as_str(), to: to.as_str() });
    }
    if from != FlowState::New && amount != fixed_amount {
        return Err(TransitionError::AmountChanged { fixed: fixed_amount, got: amount });
    }
    Ok(to)
}

/// Why a stored payload cannot be decoded (SPEC §4 decoders).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// No decoder for this schema is enabled (the event waits for one that is).
    #[error("schema {0} is not supported by this consumer")]
    UnsupportedSchema(u32),
    /// The schema is known but the payload does not carry a valid amount (the message says
    /// which member and why).
    #[error("{0}")]
    InvalidPayload(String),
}

/// Schema 1 carries the amount as `amount`; schema 2 renames it to `units` and is decoded
/// only when the v2 decoder is enabled. Other members are ignored.
pub fn decode_amount(schema: u32, payload: &Payload, support_v2: bool) -> Result<i64, DecodeError> {
    let field = match schema {
        1 => "amount",
        2 if support_v2 => "units",
        other => return Err(DecodeError::UnsupportedSchema(other)),
    };
    match payload.get(field) {
        Some(Scalar::Int(n)) if *n >= 1 => Ok(*n),
        Some(Scalar::Int(n)) => Err(DecodeError::InvalidPayload(format!(
            "schema {schema}: {field} must be an integer >= 1, got {n}"
        ))),
        Some(_) => Err(DecodeError::InvalidPayload(format!("schema {schema}: {field} must be an integer"))),
        None => Err(DecodeError::InvalidPayload(format!("schema {schema}: {field} is missing"))),
    }
}

/// The payload the producer emits for `schema` (1 → `amount`, 2 → `units`).
pub fn encode_amount(schema: u32, amount: i64) -> Option<Payload> {
    let field = match schema {
        1 => "amount",
        2 => "units",
        _ => return None,
    };
    Some(Payload::from([(field.to_owned(), Scalar::Int(amount))]))
}

/// The largest amount a producer accepts (2^53, the payload integer limit).
pub const MAX_AMOUNT: i64 = MAX_SAFE_INT;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_next_step_is_legal() {
        use FlowState::*;
        assert_eq!(check_step(New, 0, Kind::Reserved, 3), Ok(Reserved));
        assert_eq!(check_step(Reserved, 3, Kind::Confirmed, 3), Ok(Confirmed));
        assert_eq!(check_step(Confirmed, 3, Kind::Released, 3), Ok(Released));
        for (from, kind) in [
            (New, Kind::Confirmed),
            (New, Kind::Released),
            (Reserved, Kind::Reserved),
            (Reserved, Kind::Released),
            (Confirmed, Kind::Reserved),
            (Released, Kind::Reserved),
            (Released, Kind::Released),
        ] {
            assert!(matches!(check_step(from, 3, kind, 3), Err(TransitionError::Illegal { .. })));
        }
    }

    #[test]
    fn the_amount_is_fixed_by_reserved() {
        assert_eq!(
            check_step(FlowState::Reserved, 3, Kind::Confirmed, 4),
            Err(TransitionError::AmountChanged { fixed: 3, got: 4 })
        );
        assert_eq!(check_step(FlowState::New, 0, Kind::Reserved, 7), Ok(FlowState::Reserved));
    }

    #[test]
    fn held_units() {
        assert_eq!(FlowState::Reserved.held(3), 3);
        assert_eq!(FlowState::Confirmed.held(3), 3);
        assert_eq!(FlowState::Released.held(3), 0);
        assert_eq!(FlowState::New.held(3), 0);
    }

    #[test]
    fn decoders() {
        let v1 = encode_amount(1, 3).unwrap();
        let v2 = encode_amount(2, 3).unwrap();
        assert_eq!(decode_amount(1, &v1, false), Ok(3));
        assert_eq!(decode_amount(2, &v2, false), Err(DecodeError::UnsupportedSchema(2)));
        assert_eq!(decode_amount(2, &v2, true), Ok(3));
        assert_eq!(decode_amount(7, &v1, true), Err(DecodeError::UnsupportedSchema(7)));
        assert!(matches!(decode_amount(1, &v2, true), Err(DecodeError::InvalidPayload(_))));
        assert!(matches!(decode_amount(2, &v1, true), Err(DecodeError::InvalidPayload(_))));
        let zero = Payload::from([("amount".to_owned(), Scalar::Int(0))]);
        assert!(matches!(decode_amount(1, &zero, false), Err(DecodeError::InvalidPayload(_))));
        let text = Payload::from([("amount".to_owned(), Scalar::Str("3".into()))]);
        assert!(matches!(decode_amount(1, &text, false), Err(DecodeError::InvalidPayload(_))));
        let extra = Payload::from([("amount".to_owned(), Scalar::Int(3)), ("note".to_owned(), Scalar::Null)]);
        assert_eq!(decode_amount(1, &extra, false), Ok(3));
    }
}
