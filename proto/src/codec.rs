//! The protobuf codecs of the `ordered_events.v1` services. A message that does not decode
//! (invalid UTF-8 in a string, truncated bytes, a wrong wire type) is the sender's fault:
//! [`WireCodec`] (every generated service) answers it `INVALID_ARGUMENT` instead of tonic's
//! `INTERNAL`, which this project keeps for storage failures, and [`LenientCodec`] (the
//! consumer's `Receive`) hands it to the handler as an item, so one bad envelope is answered
//! in-band and the stream goes on.

use std::marker::PhantomData;

use bytes::Buf as _;
use prost::Message;
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

/// A message whose bytes do not decode as the expected protobuf type; the text says what
/// type and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Malformed(pub String);

impl std::fmt::Display for Malformed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Decodes one whole gRPC message as `U`. The message's bytes are taken out of the buffer
/// first, whatever happens: bytes left behind would be read as the next message's header.
fn decode_message<U: Message + Default>(buf: &mut DecodeBuf<'_>) -> Result<U, Malformed> {
    let bytes = buf.copy_to_bytes(buf.remaining());
    U::decode(bytes).map_err(|e| Malformed(format!("malformed {} message: {e}", short_type_name::<U>())))
}

/// `EventEnvelope` rather than `proto::pb::EventEnvelope`: the name a client knows.
fn short_type_name<U>() -> &'static str {
    let full = std::any::type_name::<U>();
    full.rsplit("::").next().unwrap_or(full)
}

/// Prost encoding and decoding for the generated services (`codec_path` in `build.rs`). It
/// differs from `tonic_prost::ProstCodec` only in the status of a message that does not
/// decode: `INVALID_ARGUMENT`, naming the message type and prost's reason. (A client that
/// receives a malformed answer sees the same code; only a faulty server sends one.)
#[derive(Debug, Clone)]
pub struct WireCodec<T, U> {
    _types: PhantomData<(T, U)>,
}

impl<T, U> Default for WireCodec<T, U> {
    fn default() -> Self {
        WireCodec { _types: PhantomData }
    }
}

impl<T, U> Codec for WireCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = MessageEncoder<T>;
    type Decoder = StrictDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        MessageEncoder(PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        StrictDecoder(PhantomData)
    }
}

/// Encodes a prost message.
#[derive(Debug, Clone, Default)]
pub struct MessageEncoder<T>(PhantomData<T>);

impl<T: Message> Encoder for MessageEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        // EncodeBuf grows as needed, so prost's only error (not enough room) cannot happen.
        item.encode(buf).map_err(|e| Status::internal(format!("cannot encode a message: {e}")))
    }
}

/// Decodes `U`; a malformed message is `INVALID_ARGUMENT`.
#[derive(Debug, Clone, Default)]
pub struct StrictDecoder<U>(PhantomData<U>);

impl<U: Message + Default> Decoder for StrictDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        decode_message(buf).map(Some).map_err(|m| Status::invalid_argument(m.0))
    }
}

/// Like [`WireCodec`], but a malformed message is an item (`Err(Malformed)`), not a failed
/// stream: tonic ends a request stream at the first decoder error, and the contract says a
/// per-envelope problem is answered in-band while the stream goes on.
#[derive(Debug, Clone)]
pub struct LenientCodec<T, U> {
    _types: PhantomData<(T, U)>,
}

impl<T, U> Default for LenientCodec<T, U> {
    fn default() -> Self {
        LenientCodec { _types: PhantomData }
    }
}

impl<T, U> Codec for LenientCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = Result<U, Malformed>;
    type Encoder = MessageEncoder<T>;
    type Decoder = LenientDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        MessageEncoder(PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        LenientDecoder(PhantomData)
    }
}

/// Decodes `U`, or says why the message is not one.
#[derive(Debug, Clone, Default)]
pub struct LenientDecoder<U>(PhantomData<U>);

impl<U: Message + Default> Decoder for LenientDecoder<U> {
    type Item = Result<U, Malformed>;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Status> {
        Ok(Some(decode_message(buf)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb;

    fn decode<U: Message + Default>(bytes: &[u8]) -> Result<U, Malformed> {
        U::decode(bytes).map_err(|e| Malformed(format!("malformed {} message: {e}", short_type_name::<U>())))
    }

    #[test]
    fn malformed_messages_name_the_type_and_the_reason() {
        // Field 1 (event_id), length 2, bytes that are not UTF-8.
        let bad_utf8 = decode::<pb::EventEnvelope>(&[0x0a, 0x02, 0xff, 0xfe]).unwrap_err();
        assert!(bad_utf8.0.starts_with("malformed EventEnvelope message:"), "{bad_utf8}");
        // Field 1 says 10 bytes follow; 1 does.
        assert!(decode::<pb::EventEnvelope>(&[0x0a, 0x0a, b'x']).is_err());
        // Field 3 (seq, a varint) sent as a length-delimited field.
        assert!(decode::<pb::EventEnvelope>(&[0x1a, 0x01, b'x']).is_err());
        let good = pb::EventEnvelope { event_id: "e".into(), seq: 1, ..Default::default() };
        assert_eq!(decode::<pb::EventEnvelope>(&good.encode_to_vec()), Ok(good));
    }
}
