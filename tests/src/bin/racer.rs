//! `racer`: one client process of a race. It connects first, prints `ready`, waits for a
//! line on stdin (the barrier: the parent releases every racer at once), makes one call and
//! prints the answer as one JSON line. Used by the suite and the experiment runner.
//!
//! Usage: racer advance URL FLOW EVENT EXPECTED_SEQ KIND
//!        racer receive URL FLOW SEQ KIND PAYLOAD_JSON
//!        racer apply URL FLOW

use std::io::BufRead as _;

use proto::pb;
use proto::pb::consumer_client::ConsumerClient;
use proto::pb::producer_client::ProducerClient;
use serde_json::json;

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg =
        |i: usize| args.get(i).cloned().ok_or_else(|| anyhow::anyhow!("missing argument {i}; see the usage"));
    let channel = tonic::transport::Channel::from_shared(arg(1)?)?.connect().await?;
    println!("ready");
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    let answer = match arg(0)?.as_str() {
        "advance" => {
            let req = harness::advance(&arg(2)?, &arg(3)?, arg(4)?.parse()?, &arg(5)?, 1);
            match ProducerClient::new(channel).advance(req).await {
                Ok(r) => {
                    let r = r.into_inner();
                    json!({"outcome": pb::AdvanceOutcome::try_from(r.outcome)?.as_str_name(), "seq": r.seq})
                }
                Err(status) => json!({"error": format!("{:?}", status.code())}),
            }
        }
        "receive" => {
            let mut envelope = harness::envelope(&arg(2)?, arg(3)?.parse()?, &arg(4)?, 1, &arg(5)?);
            envelope.event_id = format!("{}{}", arg(2)?, arg(3)?);
            let mut stream =
                ConsumerClient::new(channel).receive(tokio_stream::iter(vec![envelope])).await?.into_inner();
            match stream.message().await {
                Ok(Some(r)) => json!({"outcome": pb::ReceiveOutcome::try_from(r.outcome)?.as_str_name()}),
                Ok(None) => json!({"error": "no answer"}),
                Err(status) => json!({"error": format!("{:?}", status.code())}),
            }
        }
        "apply" => {
            let req = pb::ApplyRequest { flow_id: arg(2)?, max_steps: 0 };
            match ConsumerClient::new(channel).apply(req).await {
                Ok(r) => {
                    let r = r.into_inner();
                    json!({"applied": r.applied, "applied_event_ids": r.applied_event_ids,
                           "stop": pb::ApplyStop::try_from(r.stop)?.as_str_name()})
                }
                Err(status) => json!({"error": format!("{:?}", status.code())}),
            }
        }
        other => anyhow::bail!("unknown race call {other:?}"),
    };
    println!("{answer}");
    Ok(())
}
