//! Validation of `Apply`, `ApplyAll`, `GetFlow`, `ListStuck` and `Identify` requests before
//! anything is read or written: malformed input is `INVALID_ARGUMENT` naming the field and the limit.

use proto::limits::{LimitError, MAX_ID_BYTES, check_token};
use proto::pb;

/// `max_steps` 0 means this many.
pub const DEFAULT_MAX_STEPS: u32 = 1_000;
/// The largest `max_steps` a caller may ask for.
pub const MAX_MAX_STEPS: u32 = 100_000;
/// `ListStuck.limit` 0 means this many flows.
pub const DEFAULT_STUCK_LIMIT: u32 = 100;
/// The largest `ListStuck.limit`.
pub const MAX_STUCK_LIMIT: u32 = 10_000;

/// The most inbox probes one `Identify` may carry (a relay sends pages of 256).
pub const MAX_PROBES: usize = 1_024;

/// Checks `Identify.probes`: at most [`MAX_PROBES`], each event id within the transport
/// limits. Returns them as `(position, event_id)` pairs.
pub fn probes(probes: Vec<pb::InboxProbe>) -> Result<Vec<(u64, String)>, LimitError> {
    if probes.len() > MAX_PROBES {
        return Err(LimitError {
            field: "probes".into(),
            message: format!("must be at most {MAX_PROBES} per request, got {}", probes.len()),
        });
    }
    probes
        .into_iter()
        .map(|p| {
            check_token("probes.event_id", &p.event_id, MAX_ID_BYTES)?;
            Ok((p.position, p.event_id))
        })
        .collect()
}

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
    fn probe_limits() {
        let probe = |i: u64| pb::InboxProbe { position: i, event_id: format!("e{i}") };
        let ok = probes((1..=MAX_PROBES as u64).map(probe).collect()).unwrap();
        assert_eq!(ok.len(), MAX_PROBES);
        assert_eq!(ok[0], (1, "e1".to_owned()));
        let err = probes((0..=MAX_PROBES as u64).map(probe).collect()).unwrap_err();
        assert_eq!(err.field, "probes");
        assert!(err.to_string().contains("at most 1024 per request, got 1025"), "{err}");
        let bad = pb::InboxProbe { position: 1, event_id: String::new() };
        assert_eq!(probes(vec![bad]).unwrap_err().field, "probes.event_id");
    }

    #[test]
    fn flow_ids() {
        assert!(flow_id("A").is_ok());
        assert_eq!(flow_id("").unwrap_err().field, "flow_id");
        assert_eq!(flow_id("a b").unwrap_err().field, "flow_id");
        assert_eq!(flow_id(&"x".repeat(129)).unwrap_err().field, "flow_id");
    }
}
