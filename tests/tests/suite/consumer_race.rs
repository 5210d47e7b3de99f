//! Racing the consumer: six clients against one server, and six servers on one consumer.db,
//! on Receive of the same event and on Apply of the same flow. Racers connect first and
//! start together from a barrier; the asserts are allowed answer sets and final records.

use std::sync::Arc;

use harness::db;
use harness::proc::connect;
use harness::{Consumer, Workdir, reference_envelopes};
use proto::pb::consumer_client::ConsumerClient;
use proto::pb::{self, ApplyStop, ReceiveOutcome};
use tokio::sync::Barrier;

use crate::consumer::{effect_rows, outcomes, reference_effects};

const RACERS: usize = 6;

/// Runs `call` once per url (one connection each), all released together from a barrier
/// after every racer has connected.
async fn race<T, F, Fut>(urls: Vec<String>, call: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(ConsumerClient<tonic::transport::Channel>) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = T> + Send,
{
    let barrier = Arc::new(Barrier::new(urls.len()));
    let call = Arc::new(call);
    let tasks: Vec<_> = urls
        .into_iter()
        .map(|url| {
            let barrier = Arc::clone(&barrier);
            let call = Arc::clone(&call);
            tokio::spawn(async move {
                let client = ConsumerClient::new(connect(&url).await);
                barrier.wait().await;
                call(client).await
            })
        })
        .collect();
    let mut out = Vec::with_capacity(tasks.len());
    for task in tasks {
        out.push(task.await.expect("racer task"));
    }
    out
}

async fn receive_same_event(mut client: ConsumerClient<tonic::transport::Channel>) -> pb::ReceiveResult {
    let mut answers = client
        .receive(tokio_stream::iter(vec![reference_envelopes("A")[0].clone()]))
        .await
        .expect("Receive call")
        .into_inner();
    let answer = answers.message().await.expect("Receive stream").expect("one answer");
    assert!(answers.message().await.expect("stream end").is_none(), "one answer per envelope");
    answer
}

async fn apply_flow_a(mut client: ConsumerClient<tonic::transport::Channel>) -> pb::ApplyResult {
    client
        .apply(pb::ApplyRequest { flow_id: "A".into(), max_steps: 0 })
        .await
        .expect("Apply call")
        .into_inner()
}

fn assert_one_accepted(answers: &[pb::ReceiveResult], consumer: &Consumer) {
    let mut got = outcomes(answers);
    got.sort_by_key(|o| *o as i32);
    let mut expected = vec![ReceiveOutcome::Duplicate; RACERS - 1];
    expected.insert(0, ReceiveOutcome::Accepted);
    assert_eq!(got, expected, "{answers:?}");
    assert_eq!(db::inbox(&consumer.db).len(), 1);
}

fn assert_applied_once_each(results: &[pb::ApplyResult], consumer: &Consumer) {
    let total: u32 = results.iter().map(|r| r.applied).sum();
    assert_eq!(total, 3, "{results:?}");
    let mut ids: Vec<&str> =
        results.iter().flat_map(|r| r.applied_event_ids.iter().map(String::as_str)).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["A1", "A2", "A3"], "each event applied by exactly one racer");
    for r in results {
        assert_eq!(pb::ApplyStop::try_from(r.stop), Ok(ApplyStop::Idle), "{r:?}");
        let p = r.projection.as_ref().expect("projection");
        assert_eq!((p.last_seq, p.state.as_str(), p.held), (3, "released", 0), "{r:?}");
    }
    assert_eq!(effect_rows(consumer), reference_effects("A"));
}

#[tokio::test]
async fn six_clients_race_on_one_server() {
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start(&work, false, &[]);
    let urls = vec![consumer.process.url(); RACERS];

    let answers = race(urls.clone(), receive_same_event).await;
    assert_one_accepted(&answers, &consumer);

    let rest = consumer.receive(reference_envelopes("A")[1..].to_vec()).await;
    assert_eq!(outcomes(&rest), [ReceiveOutcome::Accepted, ReceiveOutcome::Accepted]);
    let results = race(urls, apply_flow_a).await;
    assert_applied_once_each(&results, &consumer);
}

/// Six consumer processes on one file: only what each re-reads inside its own
/// `BEGIN IMMEDIATE` decides, so the answers and records are the same as with one server.
#[tokio::test]
async fn six_servers_race_on_one_file() {
    let Some(work) = Workdir::for_test() else { return };
    let servers: Vec<Consumer> = (0..RACERS)
        .map(|i| Consumer::start_on(work.consumer_db(), work.path(&format!("consumer-{i}.log")), false, &[]))
        .collect();
    let urls: Vec<String> = servers.iter().map(|s| s.process.url()).collect();

    let answers = race(urls.clone(), receive_same_event).await;
    assert_one_accepted(&answers, &servers[0]);

    let rest = servers[1].receive(reference_envelopes("A")[1..].to_vec()).await;
    assert_eq!(outcomes(&rest), [ReceiveOutcome::Accepted, ReceiveOutcome::Accepted]);
    let results = race(urls, apply_flow_a).await;
    assert_applied_once_each(&results, &servers[0]);
}
