//! Transport limits (SPEC §4), checked on `Receive` and `Advance` before anything is stored.
//! They bound the envelope's shape only; what a schema or kind means is decided by `Apply`.

use std::fmt;

use serde::Deserializer as _;
use serde::de::{self, IgnoredAny, MapAccess, Visitor};

use crate::body::{Event, MAX_SAFE_INT, Payload, Scalar, plain_string};
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
    let payload = check_envelope_payload(env)?;
    Ok(Event {
        event_id: env.event_id.clone(),
        flow_id: env.flow_id.clone(),
        seq: env.seq,
        kind: env.kind.clone(),
        schema: env.schema,
        payload,
    })
}

/// The checks of [`check_envelope`], returning only the parsed payload: a caller that owns
/// the envelope moves its ids into the [`Event`] instead of copying them.
pub fn check_envelope_payload(env: &pb::EventEnvelope) -> Result<Payload, LimitError> {
    check_token("event_id", &env.event_id, MAX_ID_BYTES)?;
    check_token("flow_id", &env.flow_id, MAX_ID_BYTES)?;
    check_seq("seq", env.seq)?;
    check_token("kind", &env.kind, MAX_KIND_BYTES)?;
    check_schema(env.schema)?;
    parse_payload(&env.payload_json)
}

/// The request field a payload error names (a member's error adds `.<key>`).
const FIELD: &str = "payload_json";

/// Parses and checks a payload's JSON text: an object of at most 16 members with distinct
/// names, scalar values only (strings ≤ 256 bytes, integers with |n| ≤ 2^53, bools, null),
/// at most 4 KiB in canonical form.
pub fn parse_payload(text: &str) -> Result<Payload, LimitError> {
    if text.len() > MAX_PAYLOAD_TEXT_BYTES {
        return Err(LimitError::new(
            FIELD,
            format!("must be at most {MAX_PAYLOAD_TEXT_BYTES} bytes of JSON text, got {}", text.len()),
        ));
    }
    if let Some(payload) = parse_canonical_payload(text) {
        return Ok(payload);
    }
    parse_any_payload(text)
}

/// A payload written exactly in canonical form (what [`crate::body::canonical_payload`]
/// writes: members sorted by key bytes and distinct, no whitespace, strings and keys without
/// any escape, integers without a leading zero, no `-0`) and within every limit, read
/// without the JSON parser: `None` for anything else, which [`parse_any_payload`] then
/// decides. Every payload the services write is in this form, and reading one this way
/// costs a small fraction of the general parser (issue 18). Its canonical form is the text
/// itself, so the canonical size is the text's length.
pub(crate) fn parse_canonical_payload(text: &str) -> Option<Payload> {
    if text.len() > MAX_CANONICAL_PAYLOAD_BYTES {
        return None;
    }
    let mut rest = text.strip_prefix('{')?;
    let mut payload = Payload::new();
    if rest == "}" {
        return Some(payload);
    }
    let mut last: Option<&str> = None;
    loop {
        let (key, after) = plain_string(rest)?;
        // Strictly ascending: sorted as the canonical form writes them, and no duplicate.
        if last.is_some_and(|last| last >= key) || payload.len() == MAX_PAYLOAD_MEMBERS {
            return None;
        }
        let (value, after) = canonical_scalar(after.strip_prefix(':')?)?;
        payload.insert(key.to_owned(), value);
        last = Some(key);
        if after == "}" {
            return Some(payload);
        }
        rest = after.strip_prefix(',')?;
    }
}

/// A member value at the start of `text` in canonical form and within the limits, and the
/// text after it.
fn canonical_scalar(text: &str) -> Option<(Scalar, &str)> {
    match text.as_bytes().first()? {
        b'"' => {
            let (s, rest) = plain_string(text)?;
            (s.len() <= MAX_STRING_BYTES).then(|| (Scalar::Str(s.to_owned()), rest))
        }
        b't' => Some((Scalar::Bool(true), text.strip_prefix("true")?)),
        b'f' => Some((Scalar::Bool(false), text.strip_prefix("false")?)),
        b'n' => Some((Scalar::Null, text.strip_prefix("null")?)),
        _ => {
            let digits_at = usize::from(text.starts_with('-'));
            let digits = text[digits_at..].bytes().take_while(u8::is_ascii_digit).count();
            let end = digits_at + digits;
            let canonical = match &text[digits_at..end] {
                "" => false,
                "0" => digits_at == 0,
                d => !d.starts_with('0') && d.len() <= 16,
            };
            // A fraction or an exponent is not an integer: the general parser says why.
            if !canonical || matches!(text.as_bytes().get(end), Some(b'.' | b'e' | b'E')) {
                return None;
            }
            let n: i64 = text[..end].parse().ok()?;
            (n.unsigned_abs() <= MAX_SAFE_INT as u64).then(|| (Scalar::Int(n), &text[end..]))
        }
    }
}

/// [`parse_payload`] through the general JSON parser: any layout, and every error.
fn parse_any_payload(text: &str) -> Result<Payload, LimitError> {
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

    #[test]
    fn canonical_payloads_take_the_fast_path_and_others_the_general_parser() {
        for text in [
            "{}",
            r#"{"amount":3}"#,
            r#"{"amount":-9007199254740992,"b":true,"c":false,"d":null,"s":"x y é"}"#,
            r#"{"a":0,"units":9007199254740992}"#,
        ] {
            let fast = parse_canonical_payload(text).expect(text);
            assert_eq!(Ok(fast.clone()), parse_any_payload(text), "{text}");
            assert_eq!(crate::body::canonical_payload(&fast), text);
        }
        // Not canonical, or over a limit: the fast path declines and the general parser
        // decides (accepting some, refusing others with their reasons).
        for text in [
            r#"{ "amount":3}"#,
            r#"{"amount": 3}"#,
            r#"{"amount":-0}"#,
            r#"{"amount":03}"#,
            r#"{"amount":3.0}"#,
            r#"{"amount":3e0}"#,
            r#"{"amount":9007199254740993}"#,
            r#"{"amount":3,"amount":4}"#,
            r#"{"b":1,"a":2}"#,
            r#"{"a\"b":1}"#,
            r#"{"s":"a\nb"}"#,
            r#"{"amount":3}}"#,
            r#"{"amount":3,}"#,
            r#"{"amount":tru}"#,
            r#"{"amount":[1]}"#,
            "{",
            "",
        ] {
            assert_eq!(parse_canonical_payload(text), None, "{text}");
        }
        let members = |n: usize| {
            let inner: Vec<String> = (0..n).map(|i| format!(r#""k{i:02}":1"#)).collect();
            format!("{{{}}}", inner.join(","))
        };
        assert!(parse_canonical_payload(&members(16)).is_some());
        assert_eq!(parse_canonical_payload(&members(17)), None);
        assert!(parse_payload(&members(17)).unwrap_err().message.contains("at most 16 members"));
        let long = format!(r#"{{"s":"{}"}}"#, "v".repeat(257));
        assert_eq!(parse_canonical_payload(&long), None);
        assert_eq!(parse_payload(&long).unwrap_err().field, "payload_json.s");
    }

    mod fast_path {
        use proptest::prelude::*;

        use super::super::*;
        use crate::body::canonical_payload;

        fn scalar() -> impl Strategy<Value = Scalar> {
            prop_oneof![
                "[a-z \"\\\\\n\u{e9}]{0,6}".prop_map(Scalar::Str),
                (250usize..260).prop_map(|n| Scalar::Str("v".repeat(n))),
                any::<i64>().prop_map(Scalar::Int),
                (-MAX_SAFE_INT - 2..MAX_SAFE_INT + 2).prop_map(Scalar::Int),
                (-20i64..20).prop_map(Scalar::Int),
                any::<bool>().prop_map(Scalar::Bool),
                Just(Scalar::Null),
            ]
        }

        fn payload() -> impl Strategy<Value = Payload> {
            proptest::collection::btree_map("[a-z\"\\\\\u{e9}]{0,3}", scalar(), 0..19)
        }

        /// A payload within every limit whose keys and strings need no escape.
        fn plain_payload() -> impl Strategy<Value = Payload> {
            let value = prop_oneof![
                "[a-z \u{e9}]{0,6}".prop_map(Scalar::Str),
                Just(Scalar::Str("v".repeat(MAX_STRING_BYTES))),
                (-MAX_SAFE_INT..=MAX_SAFE_INT).prop_map(Scalar::Int),
                (-20i64..20).prop_map(Scalar::Int),
                any::<bool>().prop_map(Scalar::Bool),
                Just(Scalar::Null),
            ];
            proptest::collection::btree_map("[a-z\u{e9}]{0,3}", value, 0..=MAX_PAYLOAD_MEMBERS)
                .prop_filter("within 4 KiB", |p| canonical_payload(p).len() <= MAX_CANONICAL_PAYLOAD_BYTES)
        }

        /// The text of a payload in canonical form, or a variant of it: spaces, members
        /// reversed, `-0`, a number with a fraction, an exponent or a leading zero, a key
        /// repeated.
        fn text() -> impl Strategy<Value = String> {
            (payload(), 0u8..12).prop_map(|(payload, variant)| {
                let canonical = canonical_payload(&payload);
                match variant {
                    0 => canonical.replacen(':', ": ", 1),
                    1 => {
                        let members: Vec<String> = payload
                            .iter()
                            .rev()
                            .map(|(k, v)| {
                                let one = canonical_payload(&Payload::from([(k.clone(), v.clone())]));
                                one[1..one.len() - 1].to_owned()
                            })
                            .collect();
                        format!("{{{}}}", members.join(","))
                    }
                    2 => canonical.replacen(":0", ":-0", 1),
                    3 => canonical.replacen(":1", ":1.0", 1),
                    4 => canonical.replacen(":2", ":2e0", 1),
                    5 => canonical.replacen('{', "{\"k\":1,\"k\":2,", 1),
                    6 => canonical.replacen(":1", ":01", 1),
                    _ => canonical,
                }
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// The fast path never decides differently from the general parser: it either
            /// declines or returns exactly what the general parser returns, and
            /// `parse_payload` answers exactly as the general parser does.
            #[test]
            fn agrees_with_the_general_parser(text in text()) {
                let general = parse_any_payload(&text);
                if let Some(fast) = parse_canonical_payload(&text) {
                    prop_assert_eq!(Ok(fast.clone()), general.clone());
                    prop_assert_eq!(canonical_payload(&fast), text.clone());
                }
                prop_assert_eq!(parse_payload(&text), general);
            }

            /// Every payload the services write (plain keys and strings, integers in range,
            /// within the limits) takes the fast path.
            #[test]
            fn takes_every_plain_canonical_payload(payload in plain_payload()) {
                let text = canonical_payload(&payload);
                prop_assert_eq!(parse_canonical_payload(&text), Some(payload));
            }
        }
    }
}
