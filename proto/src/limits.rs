//! Transport limits (SPEC §4), checked on `Receive` and `Advance` before anything is stored.
//! They bound the envelope's shape only; what a schema or kind means is decided by `Apply`.

use std::fmt;

use serde::Deserializer as _;
use serde::de::{self, IgnoredAny, MapAccess, Visitor};

use crate::body::{Event, MAX_SAFE_INT, Payload, Scalar};
use crate::pb;

/// Bytes of `event_id` and `flow_id`.
pub const MAX_ID_BYTES: usize = 128;
/// Bytes of `kind`.
pub const MAX_KIND_BYTES: usize = 64;
/// Largest `seq` (2^53).
pub const MAX_SEQ: u64 = MAX_SAFE_INT as u64;
/// Largest `schema`.
pub const MAX_SCHEMA: u32 = 65_535;
/// Members of a payload object.
pub const MAX_PAYLOAD_MEMBERS: usize = 16;
/// Bytes of a payload string value.
pub const MAX_STRING_BYTES: usize = 256;
/// Bytes of the payload in canonical form.
pub const MAX_CANONICAL_PAYLOAD_BYTES: usize = 4096;
/// Bytes of the payload JSON text as sent (whitespace included), checked before parsing.
pub const MAX_PAYLOAD_TEXT_BYTES: usize = 65_536;

/// A transport-limit violation: which field, and what the limit is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct LimitError {
    /// The request field, e.g. `flow_id` or `payload_json`.
    pub field: String,
    /// What is wrong with it, naming the limit.
    pub message: String,
}

impl LimitError {
    fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        LimitError { field: field.into(), message: message.into() }
    }
}

/// Checks an identifier: 1..=max bytes of printable ASCII without spaces (0x21..=0x7E).
pub fn check_token(field: &str, value: &str, max: usize) -> Result<(), LimitError> {
    if value.is_empty() {
        return Err(LimitError::new(field, format!("must be 1 to {max} bytes, got an empty value")));
    }
    if value.len() > max {
        return Err(LimitError::new(field, format!("must be 1 to {max} bytes, got {} bytes", value.len())));
    }
    if let Some(pos) = value.bytes().position(|b| !(0x21..=0x7e).contains(&b)) {
        return Err(LimitError::new(
            field,
            format!("must be printable ASCII without spaces; byte {pos} is not"),
        ));
    }
    Ok(())
}

/// Checks `seq` is within 1..=2^53.
pub fn check_seq(field: &str, seq: u64) -> Result<(), LimitError> {
    if seq == 0 || seq > MAX_SEQ {
        return Err(LimitError::new(field, format!("must be 1 to 2^53 ({MAX_SEQ}), got {seq}")));
    }
    Ok(())
}

/// Checks `schema` is within 1..=65535.
pub fn check_schema(schema: u32) -> Result<(), LimitError> {
    if schema == 0 || schema > MAX_SCHEMA {
        return Err(LimitError::new("schema", format!("must be 1 to {MAX_SCHEMA}, got {schema}")));
    }
    Ok(())
}

/// Checks every transport limit of an envelope and returns the event it carries. An unknown
/// kind or schema passes: only `Apply` decides what they mean.
pub fn check_envelope(env: &pb::EventEnvelope) -> Result<Event, LimitError> {
    check_token("event_id", &env.event_id, MAX_ID_BYTES)?;
    check_token("flow_id", &env.flow_id, MAX_ID_BYTES)?;
    check_seq("seq", env.seq)?;
    check_token("kind", &env.kind, MAX_KIND_BYTES)?;
    check_schema(env.schema)?;
    let payload = parse_payload(&env.payload_json)?;
    Ok(Event {
        event_id: env.event_id.clone(),
        flow_id: env.flow_id.clone(),
        seq: env.seq,
        kind: env.kind.clone(),
        schema: env.schema,
        payload,
    })
}

/// Parses and checks a payload's JSON text: an object of at most 16 members with distinct
/// names, scalar values only (strings ≤ 256 bytes, integers with |n| ≤ 2^53, bools, null),
/// at most 4 KiB in canonical form.
pub fn parse_payload(text: &str) -> Result<Payload, LimitError> {
    const FIELD: &str = "payload_json";
    if text.len() > MAX_PAYLOAD_TEXT_BYTES {
        return Err(LimitError::new(
            FIELD,
            format!("must be at most {MAX_PAYLOAD_TEXT_BYTES} bytes of JSON text, got {}", text.len()),
        ));
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let members = de
        .deserialize_map(MembersVisitor)
        .and_then(|members| de.end().map(|()| members))
        .map_err(|e| LimitError::new(FIELD, format!("must be one JSON object: {e}")))?;
    if members.len() > MAX_PAYLOAD_MEMBERS {
        return Err(LimitError::new(
            FIELD,
            format!("must have at most {MAX_PAYLOAD_MEMBERS} members, got {}", members.len()),
        ));
    }
    let mut payload = Payload::new();
    let mut numbers = top_level_numbers(text).into_iter();
    for (key, value) in members {
        let token = matches!(value, WireValue::Int(_) | WireValue::BigInt | WireValue::Float)
            .then(|| numbers.next())
            .flatten();
        // JSON's `-0` is the integer zero; serde_json hands it over as the float -0.0 (to
        // keep its sign), which would draw the fraction/exponent reason for an integer.
        let value = match value {
            WireValue::Float if token == Some("-0") => WireValue::Int(0),
            other => other,
        };
        // The field name is only built for an error: formatting it for every member of every
        // accepted payload was an allocation and a format per member per event.
        let field = || format!("{FIELD}.{key}");
        let scalar = match value {
            WireValue::Str(s) if s.len() > MAX_STRING_BYTES => {
                return Err(LimitError::new(
                    field(),
                    format!("strings must be at most {MAX_STRING_BYTES} UTF-8 bytes, got {}", s.len()),
                ));
            }
            WireValue::Str(s) => Scalar::Str(s),
            WireValue::Int(n) if n.unsigned_abs() > MAX_SAFE_INT as u64 => {
                return Err(out_of_range(field()));
            }
            WireValue::Int(n) => Scalar::Int(n),
            WireValue::BigInt => return Err(out_of_range(field())),
            WireValue::Float => {
                return Err(LimitError::new(
                    field(),
                    "numbers must be integers: a fraction, an exponent or an integer beyond 2^53 is rejected",
                ));
            }
            WireValue::Bool(b) => Scalar::Bool(b),
            WireValue::Null => Scalar::Null,
            WireValue::Nested(what) => {
                return Err(LimitError::new(
                    field(),
                    format!("values must be scalars (string, integer, bool, null), got {what}"),
                ));
            }
        };
        payload.insert(key, scalar);
    }
    let canonical = crate::body::canonical_payload(&payload).len();
    if canonical > MAX_CANONICAL_PAYLOAD_BYTES {
        return Err(LimitError::new(
            FIELD,
            format!("must be at most {MAX_CANONICAL_PAYLOAD_BYTES} bytes in canonical form, got {canonical}"),
        ));
    }
    Ok(payload)
}

/// The number tokens that are values of the top-level object, in text order (string
/// contents and nested values skipped), so each parsed number can be matched to its text.
fn top_level_numbers(text: &str) -> Vec<&str> {
    let bytes = text.as_bytes();
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    let mut numbers = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else {
            match b {
                b'"' => in_string = true,
                b'{' | b'[' => depth += 1,
                b'}' | b']' => depth = depth.saturating_sub(1),
                b'-' | b'0'..=b'9' => {
                    let start = i;
                    while i < bytes.len()
                        && matches!(bytes[i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                    {
                        i += 1;
                    }
                    if depth == 1 {
                        numbers.push(&text[start..i]);
                    }
                    continue;
                }
                _ => {}
            }
        }
        i += 1;
    }
    numbers
}

fn out_of_range(field: String) -> LimitError {
    LimitError::new(field, format!("integers must satisfy |n| <= 2^53 ({MAX_SAFE_INT})"))
}

/// A member value as parsed, before the limits are applied (so errors can name the key).
enum WireValue {
    Str(String),
    Int(i64),
    BigInt,
    Float,
    Bool(bool),
    Null,
    Nested(&'static str),
}

impl<'de> de::Deserialize<'de> for WireValue {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(WireValueVisitor)
    }
}

struct WireValueVisitor;

impl<'de> Visitor<'de> for WireValueVisitor {
    type Value = WireValue;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<WireValue, E> {
        Ok(WireValue::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<WireValue, E> {
        Ok(WireValue::Int(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<WireValue, E> {
        Ok(i64::try_from(v).map_or(WireValue::BigInt, WireValue::Int))
    }
    fn visit_f64<E>(self, _: f64) -> Result<WireValue, E> {
        Ok(WireValue::Float)
    }
    fn visit_str<E>(self, v: &str) -> Result<WireValue, E> {
        Ok(WireValue::Str(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<WireValue, E> {
        Ok(WireValue::Str(v))
    }
    fn visit_unit<E>(self) -> Result<WireValue, E> {
        Ok(WireValue::Null)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<WireValue, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(WireValue::Nested("a nested object"))
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<WireValue, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(WireValue::Nested("an array"))
    }
}

/// Collects the top-level members in order, refusing duplicate names (serde_json alone
/// would silently keep the last one).
struct MembersVisitor;

impl<'de> Visitor<'de> for MembersVisitor {
    type Value = Vec<(String, WireValue)>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut members: Vec<(String, WireValue)> = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            if members.len() >= MAX_PAYLOAD_MEMBERS * 4 {
                return Err(de::Error::custom(format!("far more than {MAX_PAYLOAD_MEMBERS} members")));
            }
            if members.iter().any(|(k, _)| *k == key) {
                return Err(de::Error::custom(format!("duplicate member name {key:?}")));
            }
            let value = map.next_value::<WireValue>()?;
            members.push((key, value));
        }
        Ok(members)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(payload_json: &str) -> pb::EventEnvelope {
        pb::EventEnvelope {
            event_id: "A1".into(),
            flow_id: "A".into(),
            seq: 1,
            kind: "reserved".into(),
            schema: 1,
            payload_json: payload_json.into(),
            committed_at_us: None,
        }
    }

    fn field_of(e: pb::EventEnvelope) -> String {
        check_envelope(&e).expect_err("must be rejected").field
    }

    #[test]
    fn ids_are_bounded_printable_ascii() {
        assert!(check_token("event_id", &"x".repeat(128), 128).is_ok());
        let err = check_token("event_id", &"x".repeat(129), 128).unwrap_err();
        assert_eq!(err.to_string(), "event_id: must be 1 to 128 bytes, got 129 bytes");
        assert!(check_token("flow_id", "", 128).is_err());
        assert!(check_token("flow_id", "a b", 128).is_err());
        assert!(check_token("flow_id", "é", 128).is_err());
        assert!(check_token("kind", &"k".repeat(65), MAX_KIND_BYTES).is_err());
    }

    #[test]
    fn each_envelope_field_is_named() {
        assert_eq!(field_of(pb::EventEnvelope { event_id: String::new(), ..env("{}") }), "event_id");
        assert_eq!(field_of(pb::EventEnvelope { flow_id: " ".into(), ..env("{}") }), "flow_id");
        assert_eq!(field_of(pb::EventEnvelope { seq: 0, ..env("{}") }), "seq");
        assert_eq!(field_of(pb::EventEnvelope { seq: MAX_SEQ + 1, ..env("{}") }), "seq");
        assert_eq!(field_of(pb::EventEnvelope { kind: String::new(), ..env("{}") }), "kind");
        assert_eq!(field_of(pb::EventEnvelope { schema: 0, ..env("{}") }), "schema");
        assert_eq!(field_of(pb::EventEnvelope { schema: 65_536, ..env("{}") }), "schema");
        assert!(check_envelope(&pb::EventEnvelope { seq: MAX_SEQ, schema: 65_535, ..env("{}") }).is_ok());
    }

    #[test]
    fn unknown_kind_and_schema_pass_the_transport_check() {
        let e = pb::EventEnvelope { kind: "teleported".into(), schema: 99, ..env(r#"{"x":1}"#) };
        assert!(check_envelope(&e).is_ok());
    }

    #[test]
    fn payload_shapes() {
        assert!(parse_payload(r#"{"amount":3}"#).is_ok());
        // -0 is the integer zero (the decoder then refuses it for its range, not its form);
        // -0.0 and -0e0 still have a fraction or an exponent.
        let zero = parse_payload(r#"{"s":"-0.5,\"x\":-0","amount":-0,"b":[-0.0]}"#);
        assert!(zero.is_err(), "the nested array is still refused");
        let zero = parse_payload(r#"{"s":"-0.5,\"x\":-0","amount":-0}"#).unwrap();
        assert_eq!(zero.get("amount"), Some(&Scalar::Int(0)));
        for text in [r#"{"amount":-0.0}"#, r#"{"amount":-0e0}"#, r#"{"a":-0,"amount":-0.0}"#] {
            let err = parse_payload(text).unwrap_err();
            assert!(err.message.contains("fraction"), "{text}: {err}");
        }
        assert!(parse_payload("{}").is_ok());
        for bad in ["", "3", "[]", "\"s\"", "null", "{", "{} {}", "{\"a\":1}x"] {
            let err = parse_payload(bad).expect_err(bad);
            assert_eq!(err.field, "payload_json", "{bad}");
        }
    }

    #[test]
    fn payload_values() {
        let max = MAX_SAFE_INT;
        assert!(parse_payload(&format!(r#"{{"n":{max}}}"#)).is_ok());
        assert!(parse_payload(&format!(r#"{{"n":-{max}}}"#)).is_ok());
        for bad in [
            format!(r#"{{"n":{}}}"#, max + 1),
            format!(r#"{{"n":-{}}}"#, max + 1),
            r#"{"n":18446744073709551616}"#.to_string(),
            r#"{"n":1.5}"#.to_string(),
            r#"{"n":1.0}"#.to_string(),
            r#"{"n":1e3}"#.to_string(),
            r#"{"n":{"a":1}}"#.to_string(),
            r#"{"n":[1]}"#.to_string(),
            format!(r#"{{"n":"{}"}}"#, "s".repeat(257)),
        ] {
            let err = parse_payload(&bad).expect_err(&bad);
            assert_eq!(err.field, "payload_json.n", "{bad}");
        }
        assert!(parse_payload(&format!(r#"{{"n":"{}"}}"#, "s".repeat(256))).is_ok());
        // 128 two-byte characters are 256 bytes; one more is over.
        assert!(parse_payload(&format!(r#"{{"n":"{}"}}"#, "é".repeat(128))).is_ok());
        assert!(parse_payload(&format!(r#"{{"n":"{}"}}"#, "é".repeat(129))).is_err());
    }

    #[test]
    fn duplicate_member_names_are_refused() {
        let err = parse_payload(r#"{"amount":3,"amount":4}"#).unwrap_err();
        assert!(err.message.contains("duplicate member name \"amount\""), "{err}");
    }

    #[test]
    fn member_count_and_canonical_size_are_bounded() {
        let members = |n: usize| {
            let inner: Vec<String> = (0..n).map(|i| format!(r#""k{i}":1"#)).collect();
            format!("{{{}}}", inner.join(","))
        };
        assert!(parse_payload(&members(16)).is_ok());
        assert!(parse_payload(&members(17)).unwrap_err().message.contains("at most 16 members"));
        // 16 members of 250-byte strings exceed 4 KiB canonically.
        let big: Vec<String> = (0..16).map(|i| format!(r#""k{i:02}":"{}""#, "v".repeat(250))).collect();
        let err = parse_payload(&format!("{{{}}}", big.join(","))).unwrap_err();
        assert!(err.message.contains("4096 bytes in canonical form"), "{err}");
        let text = format!("{{{}}}", " ".repeat(MAX_PAYLOAD_TEXT_BYTES));
        assert!(parse_payload(&text).unwrap_err().message.contains("bytes of JSON text"));
    }
}
