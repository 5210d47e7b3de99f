//! Authentication and TLS over real processes: with a token file, every ordered_events.v1
//! RPC without the token or with a wrong one is UNAUTHENTICATED and changes nothing, while
//! health and reflection stay open; the relay sends the token; TLS with a trusted CA works.

use harness::{Consumer, Producer, Workdir, advance, db, reference_envelopes, relay};
use proto::pb;
use tonic::{Code, Request, Status};

const TOKEN: &str = "s3cret-token";

fn with(token: Option<&str>, mut req: Request<()>) -> Request<()> {
    if let Some(t) = token {
        req.metadata_mut().insert("authorization", format!("Bearer {t}").parse().expect("ascii header"));
    }
    req
}

fn req<T>(token: Option<&str>, msg: T) -> Request<T> {
    let (meta, ext, ()) = with(token, Request::new(())).into_parts();
    Request::from_parts(meta, ext, msg)
}

/// Calls every ordered_events.v1 RPC once with `token`; returns each call's status code.
async fn every_rpc(
    producer: &Producer,
    consumer: &Consumer,
    token: Option<&str>,
) -> Vec<(&'static str, Code)> {
    let code = |r: Result<(), Status>| r.err().map_or(Code::Ok, |s| s.code());
    let mut p = producer.client().await;
    let mut c = consumer.client().await;
    let mut out = Vec::new();
    out.push((
        "Producer.Advance",
        code(p.advance(req(token, advance("T", "T1", 0, "reserved", 1))).await.map(drop)),
    ));
    out.push((
        "Producer.GetFlow",
        code(p.get_flow(req(token, pb::GetFlowRequest { flow_id: "T".into() })).await.map(drop)),
    ));
    let receive = async {
        let mut stream =
            c.receive(req(token, tokio_stream::iter(reference_envelopes("R")))).await?.into_inner();
        while stream.message().await?.is_some() {}
        Ok(())
    };
    out.push(("Consumer.Receive", code(receive.await)));
    out.push((
        "Consumer.Apply",
        code(c.apply(req(token, pb::ApplyRequest { flow_id: "R".into(), max_steps: 0 })).await.map(drop)),
    ));
    out.push((
        "Consumer.ApplyAll",
        code(c.apply_all(req(token, pb::ApplyAllRequest { max_steps: 0 })).await.map(drop)),
    ));
    out.push((
        "Consumer.GetFlow",
        code(c.get_flow(req(token, pb::GetFlowRequest { flow_id: "R".into() })).await.map(drop)),
    ));
    out.push((
        "Consumer.ListStuck",
        code(c.list_stuck(req(token, pb::ListStuckRequest { limit: 0 })).await.map(drop)),
    ));
    out
}

fn counts(producer: &Producer, consumer: &Consumer) -> (usize, usize, usize, usize) {
    (
        db::flows(&producer.db).len(),
        db::outbox(&producer.db).len(),
        db::inbox(&consumer.db).len(),
        db::effects(&consumer.db).len(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_required_on_every_rpc_and_nothing_changes_without_it() {
    let Some(work) = Workdir::for_test() else { return };
    let token_file = work.path("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("write token");
    let token_arg = token_file.display().to_string();
    let producer = Producer::start_with(&work, &["--token-file", &token_arg]);
    let consumer = Consumer::start_with(&work, &["--token-file", &token_arg]);
    for token in [None, Some("wrong-token"), Some("s3cret-toke"), Some("s3cret-token-")] {
        let answers = every_rpc(&producer, &consumer, token).await;
        assert_eq!(answers.len(), 7);
        for (rpc, code) in answers {
            assert_eq!(code, Code::Unauthenticated, "{rpc} with {token:?}");
        }
        assert_eq!(counts(&producer, &consumer), (0, 0, 0, 0), "a refused call changed rows");
    }
    // Health and reflection stay open for operators.
    let mut health = tonic_health::pb::health_client::HealthClient::new(
        harness::proc::connect(&consumer.process.url()).await,
    );
    let status =
        health.check(tonic_health::pb::HealthCheckRequest { service: String::new() }).await.expect("health");
    assert_eq!(
        status.into_inner().status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    // With the token everything answers.
    let answers = every_rpc(&producer, &consumer, Some(TOKEN)).await;
    assert!(answers.iter().all(|(_, code)| *code == Code::Ok), "{answers:?}");
    assert_eq!(counts(&producer, &consumer), (1, 1, 3, 3));

    // The relay sends the token from its own file; without it, it fails with one line.
    let url = consumer.process.url();
    let refused = relay(&producer.db, &url, &["drain"], &[]);
    assert_eq!(refused.code, Some(1), "{refused:?}");
    assert!(refused.stderr.to_lowercase().contains("bearer token"), "{}", refused.stderr);
    assert!(!db::outbox(&producer.db)[0].accepted);
    let delivered = relay(&producer.db, &url, &["drain", "--token-file", &token_arg], &[]);
    assert_eq!(
        (delivered.code, delivered.outcomes()),
        (Some(0), vec!["ACCEPTED".to_owned()]),
        "{delivered:?}"
    );
    assert!(db::outbox(&producer.db)[0].accepted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_over_tls_trusting_a_given_ca() {
    let Some(work) = Workdir::for_test() else { return };
    let ca_key = rcgen::KeyPair::generate().expect("ca key");
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).expect("ca cert");
    let key = rcgen::KeyPair::generate().expect("server key");
    let params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).expect("server params");
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let cert = params.signed_by(&key, &issuer).expect("server cert");
    let (ca_pem, cert_pem, key_pem) = (work.path("ca.pem"), work.path("server.pem"), work.path("server.key"));
    std::fs::write(&ca_pem, ca.pem()).expect("write");
    std::fs::write(&cert_pem, cert.pem()).expect("write");
    std::fs::write(&key_pem, key.serialize_pem()).expect("write");

    let producer = Producer::start(&work, &[]);
    producer.advance(advance("A", "A1", 0, "reserved", 1)).await;
    let consumer = Consumer::start_with(
        &work,
        &["--tls-cert", &cert_pem.display().to_string(), "--tls-key", &key_pem.display().to_string()],
    );
    let port = consumer.process.addr.rsplit(':').next().expect("port").to_owned();
    let url = format!("https://localhost:{port}");
    // Without trusting the CA the handshake fails: an operational error, nothing marked.
    let untrusted = relay(&producer.db, &url, &["drain"], &[]);
    assert_eq!(untrusted.code, Some(1), "{untrusted:?}");
    assert!(!db::outbox(&producer.db)[0].accepted);
    let trusted = relay(&producer.db, &url, &["drain", "--tls-ca", &ca_pem.display().to_string()], &[]);
    assert_eq!((trusted.code, trusted.outcomes()), (Some(0), vec!["ACCEPTED".to_owned()]), "{trusted:?}");
    assert_eq!(db::inbox(&consumer.db).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bearer_scheme_is_case_insensitive() {
    let Some(work) = Workdir::for_test() else { return };
    let token_file = work.path("token");
    std::fs::write(&token_file, TOKEN).expect("write token");
    let producer = Producer::start_with(&work, &["--token-file", &token_file.display().to_string()]);
    let mut client = producer.client().await;
    let mut codes = Vec::new();
    for value in [format!("bearer {TOKEN}"), format!("BEARER {TOKEN}"), "bearer wrong-token".to_owned()] {
        let mut request = Request::new(pb::GetFlowRequest { flow_id: "T".into() });
        request.metadata_mut().insert("authorization", value.parse().expect("ascii header"));
        let answer = client.get_flow(request).await;
        codes.push((value, answer.err().map_or(Code::Ok, |s| s.code())));
    }
    let expected = [Code::Ok, Code::Ok, Code::Unauthenticated];
    assert_eq!(codes.iter().map(|(_, code)| *code).collect::<Vec<_>>(), expected, "{codes:?}");
}
