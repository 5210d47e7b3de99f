//! The event body: the six fields of an event and its canonical JSON form, the stored and
//! compared identity of an event. Keys are sorted here by hand at every level, so the bytes
//! never depend on serde_json's map ordering features.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::pb;

/// The largest magnitude of an integer in a payload, and the largest `seq` (2^53).
pub const MAX_SAFE_INT: i64 = 1 << 53;

/// A payload member value: the transport allows scalars only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scalar {
    /// A JSON string.
    Str(String),
    /// A JSON integer within ±[`MAX_SAFE_INT`].
    Int(i64),
    /// `true` or `false`.
    Bool(bool),
    /// `null`.
    Null,
}

/// A payload: a flat JSON object. `BTreeMap` keeps the members sorted by key bytes, which is
/// the canonical order.
pub type Payload = BTreeMap<String, Scalar>;

/// One immutable event, as committed by the producer and stored by the consumer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// The event's identity: one id, one body, for ever.
    pub event_id: String,
    /// The flow whose state the event changes.
    pub flow_id: String,
    /// The event's position in its flow, from 1.
    pub seq: u64,
    /// The step the event makes (`reserved`, `confirmed`, `released`), as sent.
    pub kind: String,
    /// The payload's schema version.
    pub schema: u32,
    /// The payload members, sorted by key.
    pub payload: Payload,
}

impl Event {
    /// The canonical body: `{"event_id","flow_id","kind","payload","schema","seq"}` with keys
    /// sorted at every level and no insignificant whitespace. Two deliveries are the same
    /// event iff these bytes are identical.
    pub fn canonical_body(&self) -> String {
        let mut out = String::with_capacity(96 + self.event_id.len() + self.flow_id.len() + self.kind.len());
        out.push_str("{\"event_id\":");
        push_json_str(&mut out, &self.event_id);
        out.push_str(",\"flow_id\":");
        push_json_str(&mut out, &self.flow_id);
        out.push_str(",\"kind\":");
        push_json_str(&mut out, &self.kind);
        out.push_str(",\"payload\":");
        push_payload(&mut out, &self.payload);
        out.push_str(",\"schema\":");
        out.push_str(itoa::Buffer::new().format(self.schema));
        out.push_str(",\"seq\":");
        out.push_str(itoa::Buffer::new().format(self.seq));
        out.push('}');
        out
    }

    /// The envelope that carries this event on the wire (payload as canonical JSON text).
    pub fn to_envelope(&self) -> pb::EventEnvelope {
        pb::EventEnvelope {
            event_id: self.event_id.clone(),
            flow_id: self.flow_id.clone(),
            seq: self.seq,
            kind: self.kind.clone(),
            schema: self.schema,
            payload_json: canonical_payload(&self.payload),
            committed_at_us: None,
        }
    }

    /// Parses a stored canonical body back into an event. Stored bodies were produced by
    /// [`Event::canonical_body`], so a failure here means the file was edited by hand.
    ///
    /// A body in exactly the canonical layout (no whitespace, no escape in the three names)
    /// is read by position and only its payload is parsed, once; anything else, and any
    /// failure, goes through the general JSON parser, which gives the same event or the
    /// same error as always. The consumer's `Apply` and the relay read every body once.
    pub fn from_canonical_body(body: &str) -> Result<Event, String> {
        match from_canonical_layout(body) {
            Some(event) => Ok(event),
            None => Event::from_any_body(body),
        }
    }

    /// The envelope of a stored canonical body: `Event::from_canonical_body(body)` and then
    /// [`Event::to_envelope`], without building the event. A body in exactly the canonical
    /// layout gives its payload's text as it is (checked as the fast path of
    /// `from_canonical_body` checks it, so the same bodies pass and the text is what
    /// `to_envelope` would write); anything else takes that same general path. The relay
    /// sends every stored body so (~1k instructions per event saved, callgrind, bench).
    pub fn envelope_from_canonical_body(body: &str) -> Result<pb::EventEnvelope, String> {
        if let Some(parts) = canonical_layout(body) {
            if crate::limits::parse_canonical_payload(parts.payload).is_some() {
                return Ok(pb::EventEnvelope {
                    event_id: parts.event_id.to_owned(),
                    flow_id: parts.flow_id.to_owned(),
                    seq: parts.seq,
                    kind: parts.kind.to_owned(),
                    schema: parts.schema,
                    payload_json: parts.payload.to_owned(),
                    committed_at_us: None,
                });
            }
        }
        Event::from_any_body(body).map(|event| event.to_envelope())
    }

    /// [`Event::from_canonical_body`] through the general JSON parser.
    fn from_any_body(body: &str) -> Result<Event, String> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Stored {
            event_id: String,
            flow_id: String,
            kind: String,
            payload: serde_json::Value,
            schema: u32,
            seq: u64,
        }
        let stored: Stored =
            serde_json::from_str(body).map_err(|e| format!("stored body is not an event: {e}"))?;
        let payload_text = stored.payload.to_string();
        let payload = crate::limits::parse_payload(&payload_text).map_err(|e| e.to_string())?;
        Ok(Event {
            event_id: stored.event_id,
            flow_id: stored.flow_id,
            seq: stored.seq,
            kind: stored.kind,
            schema: stored.schema,
            payload,
        })
    }
}

/// The event in a body written exactly as [`Event::canonical_body`] writes it, read by
/// position: `None` for anything else (whitespace, an escaped character in a name, another
/// key order, a payload the transport limits refuse), which the general parser then decides.
fn from_canonical_layout(body: &str) -> Option<Event> {
    let parts = canonical_layout(body)?;
    // Only a payload already in canonical form (what the general parser's re-serialization
    // would hand over): a hand-edited `-0` or extra space takes the general path.
    let payload = crate::limits::parse_canonical_payload(parts.payload)?;
    Some(Event {
        event_id: parts.event_id.to_owned(),
        flow_id: parts.flow_id.to_owned(),
        seq: parts.seq,
        kind: parts.kind.to_owned(),
        schema: parts.schema,
        payload,
    })
}

/// The fields of a body in the canonical layout, the payload as its text (not checked).
struct CanonicalParts<'a> {
    event_id: &'a str,
    flow_id: &'a str,
    kind: &'a str,
    payload: &'a str,
    schema: u32,
    seq: u64,
}

/// [`from_canonical_layout`]'s reading by position, before the payload is parsed.
fn canonical_layout(body: &str) -> Option<CanonicalParts<'_>> {
    let rest = body.strip_prefix("{\"event_id\":")?;
    let (event_id, rest) = plain_string(rest)?;
    let rest = rest.strip_prefix(",\"flow_id\":")?;
    let (flow_id, rest) = plain_string(rest)?;
    let rest = rest.strip_prefix(",\"kind\":")?;
    let (kind, rest) = plain_string(rest)?;
    let rest = rest.strip_prefix(",\"payload\":")?;
    // The top-level `schema` and `seq` end the body, read from the end (a payload member
    // may be named `schema`, but it comes before them).
    let (rest, seq) = trailing_digits(rest.strip_suffix('}')?);
    let (rest, schema) = trailing_digits(rest.strip_suffix(",\"seq\":")?);
    let payload = rest.strip_suffix(",\"schema\":")?;
    let schema = plain_number(schema)?.try_into().ok()?;
    let seq = plain_number(seq)?;
    Some(CanonicalParts { event_id, flow_id, kind, payload, schema, seq })
}

/// A JSON string at the start of `text` with nothing escaped (no `\\`, no control
/// character), and the text after it.
pub(crate) fn plain_string(text: &str) -> Option<(&str, &str)> {
    let inner = text.strip_prefix('"')?;
    let end = inner.bytes().position(|b| b == b'"' || b == b'\\' || b < 0x20)?;
    if inner.as_bytes()[end] != b'"' {
        return None;
    }
    Some((&inner[..end], &inner[end + 1..]))
}

/// `text` split before the ASCII digits that end it.
fn trailing_digits(text: &str) -> (&str, &str) {
    let digits = text.bytes().rev().take_while(u8::is_ascii_digit).count();
    text.split_at(text.len() - digits)
}

/// A JSON non-negative integer as the canonical body writes it (no sign, no leading zero).
fn plain_number(text: &str) -> Option<u64> {
    let valid = !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text.len() == 1 || !text.starts_with('0'));
    if valid { text.parse().ok() } else { None }
}

/// The canonical JSON text of a payload: members sorted by key, no whitespace.
pub fn canonical_payload(payload: &Payload) -> String {
    let mut out = String::with_capacity(32);
    push_payload(&mut out, payload);
    out
}

/// Appends [`canonical_payload`]'s text. Integers are written by `itoa` (the same digits as
/// `Display`, without the formatting machinery a `write!` costs per integer).
fn push_payload(out: &mut String, payload: &Payload) {
    out.push('{');
    for (i, (key, value)) in payload.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_json_str(out, key);
        out.push(':');
        match value {
            Scalar::Str(s) => push_json_str(out, s),
            Scalar::Int(n) => out.push_str(itoa::Buffer::new().format(*n)),
            Scalar::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Scalar::Null => out.push_str("null"),
        }
    }
    out.push('}');
}

fn push_json_str(out: &mut String, s: &str) {
    // serde_json's string escaping is deterministic: `"`, `\` and control characters are
    // escaped, everything else is written as UTF-8. A string with none of them (every id,
    // kind and payload key the services write) is that string in quotes, written without a
    // serializer and its allocation; the others go through serde_json. Serializing a &str
    // cannot fail.
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.reserve(s.len() + 2);
        out.push('"');
        out.push_str(s);
        out.push('"');
    } else {
        out.push_str(&serde_json::to_string(s).unwrap_or_default());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::parse_payload;

    fn event(payload_json: &str) -> Event {
        Event {
            event_id: "A1".into(),
            flow_id: "A".into(),
            seq: 1,
            kind: "reserved".into(),
            schema: 1,
            payload: parse_payload(payload_json).expect("valid payload"),
        }
    }

    #[test]
    fn canonical_body_bytes_are_pinned() {
        assert_eq!(
            event(r#"{"amount":3}"#).canonical_body(),
            r#"{"event_id":"A1","flow_id":"A","kind":"reserved","payload":{"amount":3},"schema":1,"seq":1}"#
        );
    }

    #[test]
    fn key_order_and_whitespace_do_not_change_the_body() {
        let a = event(r#"{"z":"last","amount":3,"b":true,"n":null,"neg":-7}"#);
        let b = event("{ \"neg\" : -7,\n\t\"n\":null , \"b\" : true, \"amount\":3 ,\"z\" :\"last\"}");
        assert_eq!(a.canonical_body(), b.canonical_body());
        assert_eq!(
            a.canonical_body(),
            r#"{"event_id":"A1","flow_id":"A","kind":"reserved","payload":{"amount":3,"b":true,"n":null,"neg":-7,"z":"last"},"schema":1,"seq":1}"#
        );
    }

    #[test]
    fn plain_strings_are_written_as_serde_json_writes_them() {
        for s in ["", "A1", "reserved", "é ü 漢", "a/b~c\u{7f}", "tab\t", "quo\"te", "back\\slash", "\u{1}"]
        {
            let mut out = String::new();
            push_json_str(&mut out, s);
            assert_eq!(out, serde_json::to_string(s).unwrap(), "{s:?}");
        }
    }

    #[test]
    fn strings_are_escaped_deterministically() {
        let e = event(r#"{"s":"quote\" back\\ tab\t é \u00e9 \u0001"}"#);
        assert_eq!(canonical_payload(&e.payload), "{\"s\":\"quote\\\" back\\\\ tab\\t é é \\u0001\"}");
    }

    #[test]
    fn the_canonical_layout_reads_like_the_general_parser() {
        let bodies = [
            event(r#"{"units":3,"note":"x"}"#).canonical_body(),
            // A payload member named like a top-level key, and braces inside a string.
            event(r#"{"schema":7,"seq":"}{,\"seq\":1}","amount":3}"#).canonical_body(),
            event(r#"{"schema":7,"seq":"}{,seq:1}","amount":3}"#).canonical_body(),
            Event { event_id: "quo\"te".into(), ..event(r#"{"amount":3}"#) }.canonical_body(),
            r#"{"event_id":"A1", "flow_id":"A","kind":"reserved","payload":{"amount":3},"schema":1,"seq":1}"#
                .to_owned(),
            r#"{"event_id":"A1","flow_id":"A","kind":"reserved","payload":{"amount":3},"schema":1,"seq":01}"#
                .to_owned(),
            r#"{"event_id":"A1","flow_id":"A","kind":"reserved","payload":{"a":{"b":1}},"schema":1,"seq":1}"#
                .to_owned(),
            r#"{"event_id":"A1","flow_id":"A","kind":"reserved","payload":{"amount":-0},"schema":1,"seq":1}"#
                .to_owned(),
            r#"{"event_id":"A1","flow_id":"A","kind":"reserved","payload":{"amount": 3},"schema":1,"seq":1}"#
                .to_owned(),
            r#"{"event_id":"A1","flow_id":"A","kind":"reserved","payload":{"amount":3},"schema":1,"seq":1,"x":1}"#
                .to_owned(),
            r#"{"event_id":"A1","flow_id":"A","kind":"reserved","payload":{"amount":3},"schema":99999999999,"seq":1}"#
                .to_owned(),
            r#"{"event_id":"A1","flow_id":"A","kind":"reserved","payload":{"amount":3},"schema":,"seq":1}"#.to_owned(),
            r#"{"event_id":"A1","flow_id":"A","kind":"reserved","payload":{"amount":3},"seq":1,"schema":1}"#.to_owned(),
            r#"{"event_id":"A1","flow_id":"A","kind":"reserved","payload":{"amount":3},"schema":1,"seq":1 }"#.to_owned(),
        ];
        for body in &bodies {
            assert_eq!(Event::from_canonical_body(body), Event::from_any_body(body), "{body}");
            assert_eq!(
                Event::envelope_from_canonical_body(body),
                Event::from_any_body(body).map(|e| e.to_envelope()),
                "{body}"
            );
        }
        // The fast path took the canonical ones without an escape, and only those (a payload
        // string with an escaped quote is canonical too, but the general parser reads it).
        assert!(from_canonical_layout(&bodies[0]).is_some());
        assert!(from_canonical_layout(&bodies[2]).is_some());
        assert!(from_canonical_layout(&event("{}").canonical_body()).is_some());
        assert!(from_canonical_layout(&bodies[1]).is_none());
        assert!(bodies[3..].iter().all(|b| from_canonical_layout(b).is_none()));
    }

    #[test]
    fn integers_are_written_as_display_writes_them() {
        for n in [0, 1, -1, 10, -10, MAX_SAFE_INT, -MAX_SAFE_INT, i64::MAX, i64::MIN] {
            let payload = Payload::from([("n".to_owned(), Scalar::Int(n))]);
            assert_eq!(canonical_payload(&payload), format!("{{\"n\":{n}}}"));
        }
        let e = Event { schema: u32::MAX, seq: u64::MAX, ..event("{}") };
        assert!(e.canonical_body().ends_with(&format!(",\"schema\":{},\"seq\":{}}}", u32::MAX, u64::MAX)));
    }

    #[test]
    fn body_round_trips() {
        let e = event(r#"{"units":3,"note":"x"}"#);
        let back = Event::from_canonical_body(&e.canonical_body()).expect("round trip");
        assert_eq!(back, e);
        assert_eq!(back.canonical_body(), e.canonical_body());
    }
}
