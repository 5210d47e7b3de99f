//! The consumer's gRPC routes: `Receive` is served here with [`LenientCodec`], so an envelope
//! that does not decode reaches the stream's reader as an item and is answered `REJECTED`
//! in-band while the stream goes on (tonic ends a stream at its first decoder error); every
//! other method goes to the generated `ConsumerServer`, whose codec answers a malformed
//! request `INVALID_ARGUMENT`.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use proto::codec::LenientCodec;
use proto::pb;
use proto::pb::consumer_server::ConsumerServer;
use tonic::server::NamedService;
use tonic::{Request, Response, Status, Streaming};

use crate::service::{ConsumerService, Envelopes, ReceiveAnswers};

const RECEIVE_PATH: &str = "/ordered_events.v1.Consumer/Receive";

/// `ordered_events.v1.Consumer` with `Receive` decoded leniently.
#[derive(Clone)]
pub struct ConsumerRoutes {
    generated: ConsumerServer<ConsumerService>,
    service: ConsumerService,
    max_message_bytes: usize,
}

impl ConsumerRoutes {
    /// Serves `service`, decoding messages up to `max_message_bytes` (a larger one is
    /// OUT_OF_RANGE, tonic's framing limit: it cannot be skipped without reading it).
    pub fn new(service: ConsumerService, max_message_bytes: usize) -> ConsumerRoutes {
        let generated = ConsumerServer::new(service.clone()).max_decoding_message_size(max_message_bytes);
        ConsumerRoutes { generated, service, max_message_bytes }
    }
}

impl NamedService for ConsumerRoutes {
    const NAME: &'static str = <ConsumerServer<ConsumerService> as NamedService>::NAME;
}

type RouteFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<tonic::body::Body>, Infallible>> + Send>>;

impl<B> tower_service::Service<http::Request<B>> for ConsumerRoutes
where
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = RouteFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> RouteFuture {
        if request.uri().path() != RECEIVE_PATH {
            return self.generated.call(request);
        }
        let method = LenientReceive(self.service.clone());
        let max = self.max_message_bytes;
        Box::pin(async move {
            let mut grpc =
                tonic::server::Grpc::new(LenientCodec::<pb::ReceiveResult, pb::EventEnvelope>::default())
                    .max_decoding_message_size(max);
            Ok(grpc.streaming(method, request).await)
        })
    }
}

/// `Receive` over envelopes that may not have decoded.
struct LenientReceive(ConsumerService);

impl tonic::server::StreamingService<Result<pb::EventEnvelope, proto::codec::Malformed>> for LenientReceive {
    type Response = pb::ReceiveResult;
    type ResponseStream = ReceiveAnswers;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ReceiveAnswers>, Status>> + Send>>;

    fn call(
        &mut self,
        request: Request<Streaming<Result<pb::EventEnvelope, proto::codec::Malformed>>>,
    ) -> Self::Future {
        let service = self.0.clone();
        Box::pin(async move {
            let inbound: Envelopes = Box::pin(request.into_inner());
            Ok(Response::new(service.receive_envelopes(inbound)))
        })
    }
}
