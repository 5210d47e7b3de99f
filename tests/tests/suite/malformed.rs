//! Raw protobuf that does not decode, sent over real gRPC framing: invalid UTF-8 in a string
//! field, truncated bytes and a wrong wire type are INVALID_ARGUMENT on every unary method
//! (never INTERNAL, which means storage), and on `Receive` each is answered REJECTED in-band
//! while the stream goes on: a good envelope after the bad ones is ACCEPTED.

use std::marker::PhantomData;

use bytes::BufMut as _;
use harness::{Consumer, Producer, Workdir, advance, envelope};
use prost::Message as _;
use proto::pb::{self, ReceiveOutcome};
use tonic::Code;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;

/// Sends each message's bytes as they are (tonic adds the 5-byte gRPC prefix) and decodes
/// the answers as `D`.
struct RawCodec<D>(PhantomData<D>);

impl<D> Default for RawCodec<D> {
    fn default() -> Self {
        RawCodec(PhantomData)
    }
}

struct RawEncoder;

impl Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(&mut self, item: Vec<u8>, buf: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        buf.put_slice(&item);
        Ok(())
    }
}

struct AnswerDecoder<D>(PhantomData<D>);

impl<D: prost::Message + Default> Decoder for AnswerDecoder<D> {
    type Item = D;
    type Error = tonic::Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<D>, tonic::Status> {
        D::decode(buf).map(Some).map_err(|e| tonic::Status::internal(format!("test client: bad answer: {e}")))
    }
}

impl<D: prost::Message + Default + Send + 'static> Codec for RawCodec<D> {
    type Encode = Vec<u8>;
    type Decode = D;
    type Encoder = RawEncoder;
    type Decoder = AnswerDecoder<D>;

    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }

    fn decoder(&mut self) -> AnswerDecoder<D> {
        AnswerDecoder(PhantomData)
    }
}

/// Bytes that are not a valid message of a type whose field 1 is a string, each named;
/// `valid` is an encoded message whose field 1 is a non-empty string.
fn malformed(valid: &[u8]) -> Vec<(&'static str, Vec<u8>)> {
    vec![
        // Field 1, length 2, bytes that are not UTF-8.
        ("invalid utf-8", vec![0x0a, 0x02, 0xff, 0xfe]),
        // A valid message cut inside its first field (a non-empty string): the header
        // promises bytes that never come.
        ("truncated", valid[..2].to_vec()),
        // Field 1 (a string) sent as a varint.
        ("wrong wire type", vec![0x08, 0x01]),
        // A field header whose varint never ends.
        ("broken varint", vec![0xff, 0xff, 0xff]),
    ]
}

async fn unary<D: prost::Message + Default + Send + 'static>(
    channel: &Channel,
    path: &'static str,
    bytes: Vec<u8>,
) -> Result<D, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await.expect("channel ready");
    grpc.unary(tonic::Request::new(bytes), PathAndQuery::from_static(path), RawCodec::<D>::default())
        .await
        .map(tonic::Response::into_inner)
}

#[tokio::test]
async fn malformed_unary_requests_are_invalid_argument() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer = Consumer::start(&work, false, &[]);
    let p = harness::proc::connect(&producer.process.url()).await;
    let c = harness::proc::connect(&consumer.process.url()).await;
    let advance_bytes = advance("M", "M1", 0, "reserved", 1).encode_to_vec();
    let get_flow_bytes = pb::GetFlowRequest { flow_id: "M".into() }.encode_to_vec();
    let apply_bytes = pb::ApplyRequest { flow_id: "M".into(), max_steps: 0 }.encode_to_vec();
    for (what, bytes) in malformed(&advance_bytes) {
        let status = unary::<pb::AdvanceResponse>(&p, "/ordered_events.v1.Producer/Advance", bytes)
            .await
            .expect_err(what);
        assert_eq!(status.code(), Code::InvalidArgument, "Advance, {what}: {status:?}");
        assert!(status.message().contains("malformed AdvanceRequest message"), "{what}: {status:?}");
    }
    for (what, bytes) in malformed(&get_flow_bytes) {
        let status = unary::<pb::ProducerFlow>(&p, "/ordered_events.v1.Producer/GetFlow", bytes.clone())
            .await
            .expect_err(what);
        assert_eq!(status.code(), Code::InvalidArgument, "producer GetFlow, {what}: {status:?}");
        let status = unary::<pb::ConsumerFlow>(&c, "/ordered_events.v1.Consumer/GetFlow", bytes)
            .await
            .expect_err(what);
        assert_eq!(status.code(), Code::InvalidArgument, "consumer GetFlow, {what}: {status:?}");
    }
    for (what, bytes) in malformed(&apply_bytes) {
        let status =
            unary::<pb::ApplyResult>(&c, "/ordered_events.v1.Consumer/Apply", bytes).await.expect_err(what);
        assert_eq!(status.code(), Code::InvalidArgument, "Apply, {what}: {status:?}");
    }
    // Nothing was committed, and the same raw path still serves a well-formed request.
    let answer = unary::<pb::AdvanceResponse>(&p, "/ordered_events.v1.Producer/Advance", advance_bytes)
        .await
        .expect("a well-formed Advance");
    assert_eq!(answer.outcome, pb::AdvanceOutcome::Committed as i32, "{answer:?}");
    assert_eq!(answer.seq, 1, "the malformed calls committed nothing: {answer:?}");
}

#[tokio::test]
async fn malformed_envelopes_are_rejected_in_band_and_the_stream_goes_on() {
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start(&work, false, &[]);
    let channel = harness::proc::connect(&consumer.process.url()).await;
    let good = envelope("G", 1, "reserved", 1, r#"{"amount":3}"#);
    let mut messages: Vec<Vec<u8>> = Vec::new();
    let cases = malformed(&good.encode_to_vec());
    for (_, bytes) in &cases {
        messages.push(bytes.clone());
    }
    messages.push(good.encode_to_vec());
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("channel ready");
    let mut answers = grpc
        .streaming(
            tonic::Request::new(tokio_stream::iter(messages)),
            PathAndQuery::from_static("/ordered_events.v1.Consumer/Receive"),
            RawCodec::<pb::ReceiveResult>::default(),
        )
        .await
        .expect("Receive opens")
        .into_inner();
    let mut got = Vec::new();
    while let Some(answer) = answers.message().await.expect("the stream ends OK, not with an error") {
        got.push(answer);
    }
    assert_eq!(got.len(), cases.len() + 1, "one answer per message: {got:?}");
    for ((what, _), answer) in cases.iter().zip(&got) {
        assert_eq!(answer.outcome, ReceiveOutcome::Rejected as i32, "{what}: {answer:?}");
        assert!(answer.detail.contains("malformed EventEnvelope message"), "{what}: {answer:?}");
    }
    let last = got.last().expect("answers");
    assert_eq!(
        last.outcome,
        ReceiveOutcome::Accepted as i32,
        "the good envelope after the bad ones: {last:?}"
    );
    assert_eq!(last.event_id, good.event_id);
    let flow = consumer.get_flow("G").await;
    assert_eq!(flow.inbox.len(), 1, "only the good envelope is stored: {flow:?}");
}
