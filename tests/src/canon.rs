//! The canonical body of SPEC §4, written again from the spec for the checker and the model
//! (which must not import the services' `proto::body`): keys sorted at every level, no
//! insignificant whitespace. If the two ever disagree, the model test says so.

use std::fmt::Write as _;

/// A payload member value (the transport allows scalars only).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Value {
    /// A JSON string.
    Str(String),
    /// A JSON integer.
    Int(i64),
    /// `true` or `false`.
    Bool(bool),
    /// `null`.
    Null,
}

/// An event's six fields, with the payload as (name, value) members in any order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Body {
    /// The event id.
    pub event_id: String,
    /// The flow.
    pub flow_id: String,
    /// The step's seq in its flow.
    pub seq: u64,
    /// The step kind.
    pub kind: String,
    /// The payload schema.
    pub schema: u32,
    /// The payload members, in any order.
    pub payload: Vec<(String, Value)>,
}

impl Body {
    /// The canonical JSON text: `{"event_id","flow_id","kind","payload","schema","seq"}`.
    pub fn canonical(&self) -> String {
        let mut out = String::from("{\"event_id\":");
        push_str(&mut out, &self.event_id);
        out.push_str(",\"flow_id\":");
        push_str(&mut out, &self.flow_id);
        out.push_str(",\"kind\":");
        push_str(&mut out, &self.kind);
        out.push_str(",\"payload\":");
        out.push_str(&canonical_payload(&self.payload));
        // Writing into a String cannot fail.
        let _ = write!(out, ",\"schema\":{},\"seq\":{}}}", self.schema, self.seq);
        out
    }
}

/// The payload's canonical text: members sorted by name bytes, no whitespace.
pub fn canonical_payload(members: &[(String, Value)]) -> String {
    let mut sorted: Vec<&(String, Value)> = members.iter().collect();
    sorted.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    let mut out = String::from("{");
    for (i, (name, value)) in sorted.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_str(&mut out, name);
        out.push(':');
        match value {
            Value::Str(s) => push_str(&mut out, s),
            Value::Int(n) => {
                let _ = write!(out, "{n}");
            }
            Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Value::Null => out.push_str("null"),
        }
    }
    out.push('}');
    out
}

/// The canonical body an `Advance` request would commit: seq is `expected_seq + 1` and the
/// payload carries the amount under the schema's name.
pub fn advance_body(
    event_id: &str,
    flow_id: &str,
    expected_seq: u64,
    kind: &str,
    schema: u32,
    amount: i64,
) -> String {
    Body {
        event_id: event_id.to_owned(),
        flow_id: flow_id.to_owned(),
        seq: expected_seq + 1,
        kind: kind.to_owned(),
        schema,
        payload: amount_payload(schema, amount),
    }
    .canonical()
}

/// The payload a producer emits for `schema` (1 → `amount`, 2 → `units`).
pub fn amount_payload(schema: u32, amount: i64) -> Vec<(String, Value)> {
    let name = if schema == 2 { "units" } else { "amount" };
    vec![(name.to_owned(), Value::Int(amount))]
}

fn push_str(out: &mut String, s: &str) {
    // JSON string escaping as serde_json does it (`"`, `\` and control characters);
    // serializing a &str cannot fail.
    out.push_str(&serde_json::to_string(s).unwrap_or_default());
}

/// The fields of a stored canonical body the checker compares (event id, flow, seq, kind,
/// schema, payload text), parsed with serde_json; `None` if it is not such an object.
pub fn parse_body(text: &str) -> Option<(String, String, u64, String, u32, serde_json::Value)> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    Some((
        v.get("event_id")?.as_str()?.to_owned(),
        v.get("flow_id")?.as_str()?.to_owned(),
        v.get("seq")?.as_u64()?,
        v.get("kind")?.as_str()?.to_owned(),
        u32::try_from(v.get("schema")?.as_u64()?).ok()?,
        v.get("payload")?.clone(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_the_specs() {
        let body = Body {
            event_id: "A1".into(),
            flow_id: "A".into(),
            seq: 1,
            kind: "reserved".into(),
            schema: 1,
            payload: vec![("note".into(), Value::Str("x\"y".into())), ("amount".into(), Value::Int(3))],
        };
        assert_eq!(
            body.canonical(),
            r#"{"event_id":"A1","flow_id":"A","kind":"reserved","payload":{"amount":3,"note":"x\"y"},"schema":1,"seq":1}"#
        );
        let parsed = parse_body(&body.canonical()).expect("parses");
        assert_eq!((parsed.0.as_str(), parsed.2, parsed.4), ("A1", 1, 1));
        assert_eq!(canonical_payload(&amount_payload(2, 5)), r#"{"units":5}"#);
    }
}
