//! Hostile input over real gRPC: a boundary table of every transport limit (−1, at, +1),
//! oversized messages, then 10 000 seeded random mutants of envelopes and of Advance
//! requests. No panic, no row changed by any rejected request, every rejection reason hit,
//! a fair share of mutants still accepted, and the servers answer a probe afterwards.

use std::collections::BTreeMap;

use harness::{Consumer, Producer, Workdir, db};
use proto::pb::{self, AdvanceOutcome, ReceiveOutcome};
use tonic::Code;

const MAX_INT: i64 = 1 << 53;

/// The status tonic gives a message over `--max-message-bytes` (documented in the README).
const OVERSIZED: Code = Code::OutOfRange;

/// SplitMix64: a tiny seeded generator, so a failing run can be replayed from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

fn env(id: &str, flow: &str, seq: u64, kind: &str, schema: u32, payload: &str) -> pb::EventEnvelope {
    pb::EventEnvelope {
        event_id: id.into(),
        flow_id: flow.into(),
        seq,
        kind: kind.into(),
        schema,
        payload_json: payload.into(),
        committed_at_us: None,
    }
}

/// The field a rejection names (`payload_json.x` counts as `payload_json.<member>`).
fn rejected_field(detail: &str) -> String {
    let field = detail.split(':').next().unwrap_or_default();
    if field.starts_with("payload_json.") { "payload_json.<member>".to_owned() } else { field.to_owned() }
}

fn members(n: usize) -> String {
    let inner: Vec<String> = (0..n).map(|i| format!(r#""k{i}":1"#)).collect();
    format!("{{{}}}", inner.join(","))
}

/// A payload whose canonical form is exactly `len` bytes (members `"kNN":"vvv…"`, each value
/// at most 256 bytes).
fn canonical_of_len(len: usize) -> String {
    const FRAME: usize = 8; // "kNN":"" is 8 bytes; members are joined by commas
    let members = (len - 2).div_ceil(FRAME + 1 + 256);
    let mut values = len - 2 - members * FRAME - (members - 1);
    let parts: Vec<String> = (0..members)
        .map(|i| {
            let take = values.div_ceil(members - i);
            values -= take;
            format!(r#""k{i:02}":"{}""#, "v".repeat(take))
        })
        .collect();
    let text = format!("{{{}}}", parts.join(","));
    assert_eq!(text.len(), len, "canonical_of_len({len})");
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receive_boundary_table() {
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start(&work, false, &[]);
    let big = (MAX_INT + 1).to_string();
    let rows: Vec<(&str, pb::EventEnvelope, Option<&str>)> = vec![
        ("event_id 128", env(&"e".repeat(128), "f1", 1, "reserved", 1, "{}"), None),
        ("event_id 129", env(&"e".repeat(129), "f1", 1, "reserved", 1, "{}"), Some("event_id")),
        ("event_id empty", env("", "f1", 1, "reserved", 1, "{}"), Some("event_id")),
        ("event_id space", env("a b", "f1", 1, "reserved", 1, "{}"), Some("event_id")),
        ("flow_id 128", env("e2", &"f".repeat(128), 1, "reserved", 1, "{}"), None),
        ("flow_id 129", env("e3", &"f".repeat(129), 1, "reserved", 1, "{}"), Some("flow_id")),
        ("flow_id empty", env("e3", "", 1, "reserved", 1, "{}"), Some("flow_id")),
        ("kind 64", env("e4", "f4", 1, &"k".repeat(64), 1, "{}"), None),
        ("kind 65", env("e5", "f5", 1, &"k".repeat(65), 1, "{}"), Some("kind")),
        ("kind empty", env("e5", "f5", 1, "", 1, "{}"), Some("kind")),
        ("seq 0", env("e6", "f6", 0, "reserved", 1, "{}"), Some("seq")),
        ("seq 1", env("e7", "f7", 1, "reserved", 1, "{}"), None),
        ("seq 2^53", env("e8", "f8", MAX_INT as u64, "reserved", 1, "{}"), None),
        ("seq 2^53+1", env("e9", "f9", MAX_INT as u64 + 1, "reserved", 1, "{}"), Some("seq")),
        ("seq 2^64-1", env("e9", "f9", u64::MAX, "reserved", 1, "{}"), Some("seq")),
        ("schema 0", env("e10", "f10", 1, "reserved", 0, "{}"), Some("schema")),
        ("schema 65535", env("e11", "f11", 1, "reserved", 65_535, "{}"), None),
        ("schema 65536", env("e12", "f12", 1, "reserved", 65_536, "{}"), Some("schema")),
        ("16 members", env("e13", "f13", 1, "reserved", 1, &members(16)), None),
        ("17 members", env("e14", "f14", 1, "reserved", 1, &members(17)), Some("payload_json")),
        (
            "string 256",
            env("e15", "f15", 1, "reserved", 1, &format!(r#"{{"s":"{}"}}"#, "x".repeat(256))),
            None,
        ),
        (
            "string 257",
            env("e16", "f16", 1, "reserved", 1, &format!(r#"{{"s":"{}"}}"#, "x".repeat(257))),
            Some("payload_json.<member>"),
        ),
        ("int 2^53", env("e17", "f17", 1, "reserved", 1, &format!(r#"{{"n":{MAX_INT}}}"#)), None),
        ("int -2^53", env("e18", "f18", 1, "reserved", 1, &format!(r#"{{"n":-{MAX_INT}}}"#)), None),
        (
            "int 2^53+1",
            env("e19", "f19", 1, "reserved", 1, &format!(r#"{{"n":{big}}}"#)),
            Some("payload_json.<member>"),
        ),
        (
            "int -(2^53+1)",
            env("e19", "f19", 1, "reserved", 1, &format!(r#"{{"n":-{big}}}"#)),
            Some("payload_json.<member>"),
        ),
        (
            "int 10^30",
            env("e19", "f19", 1, "reserved", 1, &format!(r#"{{"n":1{}}}"#, "0".repeat(30))),
            Some("payload_json.<member>"),
        ),
        ("float", env("e20", "f20", 1, "reserved", 1, r#"{"n":1.5}"#), Some("payload_json.<member>")),
        ("exponent", env("e20", "f20", 1, "reserved", 1, r#"{"n":1e3}"#), Some("payload_json.<member>")),
        (
            "nested object",
            env("e20", "f20", 1, "reserved", 1, r#"{"n":{"a":1}}"#),
            Some("payload_json.<member>"),
        ),
        ("array", env("e20", "f20", 1, "reserved", 1, r#"{"n":[1,2]}"#), Some("payload_json.<member>")),
        (
            "nesting 100",
            env("e20", "f20", 1, "reserved", 1, &format!("{{\"n\":{}{}}}", "[".repeat(100), "]".repeat(100))),
            Some("payload_json.<member>"),
        ),
        (
            "nesting 100 000 (past the parser's recursion limit)",
            env(
                "e20",
                "f20",
                1,
                "reserved",
                1,
                &format!("{{\"n\":{}{}}}", "[".repeat(100_000), "]".repeat(100_000)),
            ),
            Some("payload_json"),
        ),
        ("invalid JSON", env("e20", "f20", 1, "reserved", 1, r#"{"n":"#), Some("payload_json")),
        ("not an object", env("e20", "f20", 1, "reserved", 1, "[1]"), Some("payload_json")),
        ("scalar", env("e20", "f20", 1, "reserved", 1, "3"), Some("payload_json")),
        ("empty text", env("e20", "f20", 1, "reserved", 1, ""), Some("payload_json")),
        ("duplicate names", env("e20", "f20", 1, "reserved", 1, r#"{"a":1,"a":2}"#), Some("payload_json")),
        ("canonical 4096", env("e21", "f21", 1, "reserved", 1, &canonical_of_len(4096)), None),
        (
            "canonical 4097",
            env("e22", "f22", 1, "reserved", 1, &canonical_of_len(4097)),
            Some("payload_json"),
        ),
        (
            "unknown kind and schema",
            env("e23", "f23", 1, "teleported", 9, r#"{"x":null,"y":true,"z":"é"}"#),
            None,
        ),
    ];
    let answers = consumer.receive(rows.iter().map(|(_, e, _)| e.clone()).collect()).await;
    assert_eq!(answers.len(), rows.len(), "one answer per envelope, the stream went on");
    let mut accepted = 0;
    for ((name, _, expected), answer) in rows.iter().zip(&answers) {
        let outcome = ReceiveOutcome::try_from(answer.outcome).expect("known outcome");
        match expected {
            None => {
                assert_eq!(outcome, ReceiveOutcome::Accepted, "{name}: {answer:?}");
                accepted += 1;
            }
            Some(field) => {
                assert_eq!(outcome, ReceiveOutcome::Rejected, "{name}: {answer:?}");
                assert_eq!(rejected_field(&answer.detail), *field, "{name}: {}", answer.detail);
            }
        }
    }
    assert_eq!(db::inbox(&consumer.db).len(), accepted, "a rejected envelope was stored");

    // Over the message size limit: the stream ends RESOURCE_EXHAUSTED, nothing stored, and
    // the server answers the next call.
    let huge = env("huge", "fh", 1, "reserved", 1, &format!(r#"{{"s":"{}"}}"#, "x".repeat(4 << 20)));
    let mut client = consumer.client().await;
    let result = async {
        let mut stream = client.receive(tokio_stream::iter(vec![huge])).await?.into_inner();
        while stream.message().await?.is_some() {}
        Ok::<(), tonic::Status>(())
    }
    .await;
    assert_eq!(result.expect_err("over the limit").code(), OVERSIZED);
    assert_eq!(db::inbox(&consumer.db).len(), accepted);
    assert_eq!(consumer.get_flow("f1").await.inbox.len(), 1);
    assert!(!consumer.process.log_text().contains("panicked"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advance_boundary_table() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let mut client = producer.client().await;
    let base = |flow: &str| {
        harness::advance(flow, &format!("{}-{}", flow.len(), &flow[..flow.len().min(8)]), 0, "reserved", 1)
    };
    let rows: Vec<(&str, pb::AdvanceRequest, Option<&str>)> = vec![
        ("flow_id 128", base(&"f".repeat(128)), None),
        ("flow_id 129", base(&"f".repeat(129)), Some("flow_id")),
        ("flow_id empty", pb::AdvanceRequest { flow_id: String::new(), ..base("a") }, Some("flow_id")),
        ("event_id 128", pb::AdvanceRequest { event_id: "e".repeat(128), ..base("b") }, None),
        ("event_id 129", pb::AdvanceRequest { event_id: "e".repeat(129), ..base("c") }, Some("event_id")),
        ("event_id tab", pb::AdvanceRequest { event_id: "a\tb".into(), ..base("c") }, Some("event_id")),
        ("kind unknown", pb::AdvanceRequest { kind: "teleported".into(), ..base("c") }, Some("kind")),
        ("schema 0", pb::AdvanceRequest { schema: 0, ..base("c") }, Some("schema")),
        ("schema 2", pb::AdvanceRequest { schema: 2, ..base("d") }, None),
        ("schema 3", pb::AdvanceRequest { schema: 3, ..base("e") }, Some("schema")),
        ("amount 0", pb::AdvanceRequest { amount: 0, ..base("e") }, Some("amount")),
        ("amount -1", pb::AdvanceRequest { amount: -1, ..base("e") }, Some("amount")),
        ("amount 2^53", pb::AdvanceRequest { amount: MAX_INT, ..base("g") }, None),
        ("amount 2^53+1", pb::AdvanceRequest { amount: MAX_INT + 1, ..base("h") }, Some("amount")),
        ("amount i64::MIN", pb::AdvanceRequest { amount: i64::MIN, ..base("h") }, Some("amount")),
        (
            "expected_seq 2^64-1",
            pb::AdvanceRequest { expected_seq: u64::MAX, ..base("h") },
            Some("expected_seq"),
        ),
    ];
    let mut committed = 0;
    for (name, request, expected) in rows {
        let answer = client.advance(request).await;
        match expected {
            None => {
                let r = answer.unwrap_or_else(|s| panic!("{name}: {s}")).into_inner();
                assert_eq!(AdvanceOutcome::try_from(r.outcome), Ok(AdvanceOutcome::Committed), "{name}");
                committed += 1;
            }
            Some(field) => {
                let status = answer.expect_err(name);
                assert_eq!(status.code(), Code::InvalidArgument, "{name}");
                assert!(status.message().starts_with(field), "{name}: {}", status.message());
            }
        }
    }
    assert_eq!(db::outbox(&producer.db).len(), committed);
    assert_eq!(db::flows(&producer.db).len(), committed);
    let huge = base(&"f".repeat(4 << 20));
    assert_eq!(client.advance(huge).await.expect_err("over the limit").code(), OVERSIZED);
    assert_eq!(db::outbox(&producer.db).len(), committed);
}

/// Identify's probes: 1024 are answered (one per probe, in order), 1025 or a malformed event
/// id are INVALID_ARGUMENT naming the field and the limit, and the consumer still answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identify_probe_limits() {
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start(&work, false, &[]);
    let accepted = consumer.receive(vec![env("p1", "f1", 1, "reserved", 1, r#"{"amount":3}"#)]).await;
    assert_eq!(ReceiveOutcome::try_from(accepted[0].outcome), Ok(ReceiveOutcome::Accepted));
    let position = accepted[0].inbox_position;
    let mut client = consumer.client().await;
    let probe = |i: u64| pb::InboxProbe { position: i, event_id: format!("p{i}") };
    let ask = |probes: Vec<pb::InboxProbe>| pb::IdentifyRequest { producer_database_id: "x".into(), probes };
    let mut at_limit: Vec<pb::InboxProbe> = (2..=1024).map(probe).collect();
    at_limit.insert(0, pb::InboxProbe { position, event_id: "p1".into() });
    let answer = client.identify(ask(at_limit)).await.expect("1024 probes").into_inner();
    assert_eq!(answer.probes_held.len(), 1024);
    assert_eq!(answer.probes_held.iter().filter(|h| **h).count(), 1, "only p1 is held");
    assert!(answer.probes_held[0]);
    let over = client.identify(ask((1..=1025).map(probe).collect())).await.expect_err("1025 probes");
    assert_eq!(over.code(), Code::InvalidArgument);
    assert!(over.message().starts_with("probes") && over.message().contains("1024"), "{}", over.message());
    for (name, event_id) in [("empty", String::new()), ("129 bytes", "e".repeat(129)), ("tab", "a\tb".into())]
    {
        let bad = vec![pb::InboxProbe { position: 1, event_id }];
        let status = client.identify(ask(bad)).await.expect_err(name);
        assert_eq!(status.code(), Code::InvalidArgument, "{name}");
        assert!(status.message().starts_with("probes.event_id"), "{name}: {}", status.message());
    }
    let positions = [0, u64::MAX, i64::MAX as u64 + 1];
    let odd: Vec<pb::InboxProbe> =
        positions.iter().map(|&p| pb::InboxProbe { position: p, event_id: "p1".into() }).collect();
    let answer = client.identify(ask(odd)).await.expect("odd positions").into_inner();
    assert_eq!(answer.probes_held, [false, false, false]);
    assert!(!consumer.process.log_text().contains("panicked"));
}

/// One random envelope: mostly plausible, often broken in one way, sometimes a resend.
fn mutant_envelope(rng: &mut Rng, n: usize, sent: &[pb::EventEnvelope]) -> pb::EventEnvelope {
    if !sent.is_empty() && rng.below(10) == 0 {
        let mut again = rng.pick(sent).clone();
        if rng.below(2) == 0 {
            again.payload_json = format!(r#"{{"amount":{}}}"#, 4 + rng.below(5)); // same id, other body
        }
        return again;
    }
    let flow = format!("F{}", rng.below(3000));
    let seq = 1 + rng.below(3);
    let kind = *rng.pick(&["reserved", "confirmed", "released"]);
    let mut e = env(&format!("m{n}"), &flow, seq, kind, 1, r#"{"amount":3}"#);
    match rng.below(40) {
        0 => e.event_id = String::new(),
        1 => e.event_id = "x".repeat(129),
        2 => e.event_id = format!("sp ace{n}"),
        3 => e.flow_id = "é".into(),
        4 => e.flow_id = "y".repeat(129 + rng.below(50) as usize),
        5 => e.seq = 0,
        6 => e.seq = (MAX_INT as u64) + 1 + rng.below(1000),
        7 => e.kind = String::new(),
        8 => e.kind = "k".repeat(65),
        9 => e.schema = 0,
        10 => e.schema = 65_536 + rng.below(1000) as u32,
        11 => {
            e.payload_json =
                (*rng.pick(&["", "{", "[]", "null", "\"s\"", "{}x", r#"{"a":1,"a":1}"#])).to_owned()
        }
        12 => e.payload_json = format!(r#"{{"amount":{}.5}}"#, rng.below(9)),
        13 => e.payload_json = format!(r#"{{"amount":{}}}"#, (MAX_INT as u64) + 1 + rng.below(99)),
        14 => e.payload_json = r#"{"amount":{"n":3}}"#.into(),
        15 => e.payload_json = members(17 + rng.below(5) as usize),
        16 => e.payload_json = format!(r#"{{"s":"{}"}}"#, "z".repeat(257 + rng.below(100) as usize)),
        17 => e.payload_json = canonical_of_len(4097 + rng.below(200) as usize),
        18 => e.kind = "teleported".into(),
        19 => e.schema = 2 + rng.below(100) as u32,
        20 => e.payload_json = format!("{{ \"amount\" : 3 , \"note\" : \"n{}\" }}", rng.below(5)),
        _ => {}
    }
    e
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_mutant_envelopes() {
    let seed = 0x5eed_0001_u64;
    eprintln!("mutant envelopes seed {seed:#x}");
    let mut rng = Rng(seed);
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start(&work, false, &[]);
    let mut sent: Vec<pb::EventEnvelope> = Vec::new();
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    let mut fields: BTreeMap<String, usize> = BTreeMap::new();
    let mut n = 0;
    for _batch in 0..20 {
        let batch: Vec<pb::EventEnvelope> = (0..500)
            .map(|_| {
                n += 1;
                mutant_envelope(&mut rng, n, &sent)
            })
            .collect();
        let answers = consumer.receive(batch.clone()).await;
        assert_eq!(answers.len(), batch.len());
        for (e, a) in batch.into_iter().zip(answers) {
            let outcome = ReceiveOutcome::try_from(a.outcome).expect("known outcome");
            *outcomes.entry(outcome.as_str_name().to_owned()).or_default() += 1;
            if outcome == ReceiveOutcome::Rejected {
                *fields.entry(rejected_field(&a.detail)).or_default() += 1;
            } else if outcome == ReceiveOutcome::Accepted {
                sent.push(e);
            }
        }
    }
    eprintln!("outcomes {outcomes:?}\nrejected fields {fields:?}");
    let total: usize = outcomes.values().sum();
    assert_eq!(total, 10_000);
    for field in ["event_id", "flow_id", "seq", "kind", "schema", "payload_json", "payload_json.<member>"] {
        assert!(
            fields.get(field).copied().unwrap_or(0) > 0,
            "no mutant was rejected for {field}: {fields:?}"
        );
    }
    for outcome in [
        "RECEIVE_OUTCOME_ACCEPTED",
        "RECEIVE_OUTCOME_DUPLICATE",
        "RECEIVE_OUTCOME_ID_CONFLICT",
        "RECEIVE_OUTCOME_SEQUENCE_CONFLICT",
    ] {
        assert!(outcomes.get(outcome).copied().unwrap_or(0) > 0, "{outcome} never seen: {outcomes:?}");
    }
    let accepted = outcomes["RECEIVE_OUTCOME_ACCEPTED"];
    assert!(accepted * 5 >= total, "the generator is mostly noise: {outcomes:?}");
    // Only accepted envelopes left rows, each exactly as accepted.
    assert_eq!(db::inbox(&consumer.db).len(), accepted);
    assert_eq!(
        consumer.apply_all(0).await.results.len(),
        db::inbox(&consumer.db).iter().map(|r| &r.flow_id).collect::<std::collections::BTreeSet<_>>().len()
    );
    assert!(!consumer.process.log_text().contains("panicked"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_mutant_advances() {
    let seed = 0x5eed_0002_u64;
    eprintln!("mutant advances seed {seed:#x}");
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let url = producer.process.url();
    let tasks: Vec<_> = (0..8u64)
        .map(|t| {
            let url = url.clone();
            tokio::spawn(async move {
                let mut rng = Rng(seed ^ (t << 32));
                let mut client = pb::producer_client::ProducerClient::new(harness::proc::connect(&url).await);
                let mut seen: Vec<(String, String)> = Vec::new();
                for i in 0..1250u64 {
                    let flow = format!("F{}", rng.below(300));
                    let expected = rng.below(4);
                    let kind = ["reserved", "confirmed", "released"][rng.below(3) as usize];
                    let mut r = harness::advance(
                        &flow,
                        &format!("{flow}-{}", expected + 1),
                        expected,
                        kind,
                        1 + rng.below(2) as u32,
                    );
                    match rng.below(16) {
                        0 => r.flow_id = String::new(),
                        1 => r.event_id = "e".repeat(129),
                        2 => r.kind = "shipped".into(),
                        3 => r.schema = 3 + rng.below(9) as u32,
                        4 => r.amount = -(rng.below(5) as i64),
                        5 => r.amount = MAX_INT + 1,
                        6 => r.expected_seq = u64::MAX - rng.below(9),
                        7 => r.event_id = format!("t{t}-{i}"),
                        8 => r.amount = 4,
                        _ => {}
                    }
                    let answer = match client.advance(r).await {
                        Ok(a) => AdvanceOutcome::try_from(a.into_inner().outcome)
                            .expect("known")
                            .as_str_name()
                            .to_owned(),
                        Err(s) if s.code() == Code::InvalidArgument => {
                            format!("INVALID_ARGUMENT:{}", s.message().split(':').next().unwrap_or_default())
                        }
                        Err(s) => panic!("unexpected status {s:?}"),
                    };
                    seen.push((flow, answer));
                }
                seen
            })
        })
        .collect();
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    let mut committed_per_flow: BTreeMap<String, u64> = BTreeMap::new();
    for task in tasks {
        for (flow, answer) in task.await.expect("client task") {
            if answer == "ADVANCE_OUTCOME_COMMITTED" {
                *committed_per_flow.entry(flow).or_default() += 1;
            }
            *outcomes.entry(answer).or_default() += 1;
        }
    }
    eprintln!("outcomes {outcomes:?}");
    assert_eq!(outcomes.values().sum::<usize>(), 10_000);
    for field in ["flow_id", "event_id", "kind", "schema", "amount", "expected_seq"] {
        assert!(
            outcomes.contains_key(&format!("INVALID_ARGUMENT:{field}")),
            "{field} never rejected: {outcomes:?}"
        );
    }
    for outcome in ["COMMITTED", "EXISTING", "CONFLICT", "STALE", "INVALID_TRANSITION"] {
        assert!(
            outcomes.contains_key(&format!("ADVANCE_OUTCOME_{outcome}")),
            "{outcome} never seen: {outcomes:?}"
        );
    }
    // Only COMMITTED answers wrote: one outbox row each, and each flow's seq is its count.
    let committed: u64 = committed_per_flow.values().sum();
    assert_eq!(db::outbox(&producer.db).len() as u64, committed);
    for flow in db::flows(&producer.db) {
        assert_eq!(Some(&flow.seq), committed_per_flow.get(&flow.flow_id), "{flow:?}");
    }
    assert_eq!(producer.advance(harness::advance("probe", "probe-1", 0, "reserved", 1)).await.seq, 1);
    assert!(!producer.process.log_text().contains("panicked"));
}
