//! Validation of `Apply`, `ApplyAll`, `GetFlow` and `ListStuck` requests before anything is
//! read or written: malformed input is `INVALID_ARGUMENT` naming the field and the limit.

use proto::limits::{LimitError, MAX_ID_BYTES, check_token};

/// `max_steps` 0 means this many.
pub const DEFAULT_MAX_STEPS: u32 = 1_000;
/// The largest `max_steps` a caller may ask for.
pub const MAX_MAX_STEPS: u32 = 100_000;
/// `ListStuck.limit` 0 means this many flows.
pub const DEFAULT_STUCK_LIMIT: u32 = 100;
/// The largest `ListStuck.limit`.
pub const MAX_STUCK_LIMIT: u32 = 10_000;

/// Checks a flow id with the transport limits (1–128 bytes of printable ASCII).
pub fn flow_id(value: &str) -> Result<(), LimitError> {
    check_token("flow_id", value, MAX_ID_BYTES)
}

/// The step limit per flow: 0 is the default, more than 100 000 is refused.
pub fn max_steps(requested: u32) -> Result<u32, LimitError> {
    match requested {
        0 => Ok(DEFAULT_MAX_STEPS),
        n if n > MAX_MAX_STEPS => Err(LimitError {
            field: "max_steps".into(),
            message: format!("must be at most {MAX_MAX_STEPS} (0 means {DEFAULT_MAX_STEPS}), got {n}"),
        }),
        n => Ok(n),
    }
}

/// How many flows `ListStuck` reports: 0 is the default, more than 10 000 is refused.
pub fn stuck_limit(requested: u32) -> Result<u32, LimitError> {
    match requested {
        0 => Ok(DEFAULT_STUCK_LIMIT),
        n if n > MAX_STUCK_LIMIT => Err(LimitError {
            field: "limit".into(),
            message: format!("must be at most {MAX_STUCK_LIMIT} (0 means {DEFAULT_STUCK_LIMIT}), got {n}"),
        }),
        n => Ok(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_limits() {
        assert_eq!(max_steps(0), Ok(DEFAULT_MAX_STEPS));
        assert_eq!(max_steps(1), Ok(1));
        assert_eq!(max_steps(MAX_MAX_STEPS), Ok(MAX_MAX_STEPS));
        let err = max_steps(MAX_MAX_STEPS + 1).unwrap_err();
        assert_eq!(err.field, "max_steps");
        assert!(err.to_string().starts_with("max_steps: must be at most 100000"), "{err}");
    }

    #[test]
    fn stuck_limits() {
        assert_eq!(stuck_limit(0), Ok(DEFAULT_STUCK_LIMIT));
        assert_eq!(stuck_limit(7), Ok(7));
        assert_eq!(stuck_limit(MAX_STUCK_LIMIT + 1).unwrap_err().field, "limit");
    }

    #[test]
    fn flow_ids() {
        assert!(flow_id("A").is_ok());
        assert_eq!(flow_id("").unwrap_err().field, "flow_id");
        assert_eq!(flow_id("a b").unwrap_err().field, "flow_id");
        assert_eq!(flow_id(&"x".repeat(129)).unwrap_err().field, "flow_id");
    }
}
