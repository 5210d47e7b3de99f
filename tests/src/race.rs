//! Races between real client processes: every racer connects first and says `ready`; only
//! when all are ready does the parent release them together (a line on each stdin).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;

use crate::proc::{RELAY_DEADLINE, bin_path};

/// Runs one `racer` process per argument list, releases them together, and returns each
/// racer's JSON answer (in the order given).
pub fn race(calls: Vec<Vec<String>>) -> Vec<serde_json::Value> {
    let mut children = Vec::new();
    let (ready_tx, ready_rx) = mpsc::channel();
    let mut answers = Vec::new();
    for (i, args) in calls.into_iter().enumerate() {
        let mut child = Command::new(bin_path("racer"))
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn racer");
        let stdout = child.stdout.take().expect("piped");
        let ready_tx = ready_tx.clone();
        let (answer_tx, answer_rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let first = lines.next().and_then(Result::ok);
            let _ = ready_tx.send((i, first));
            let answer = lines.next().and_then(Result::ok);
            let _ = answer_tx.send(answer);
        });
        answers.push(answer_rx);
        children.push(child);
    }
    drop(ready_tx);
    for _ in 0..children.len() {
        let (i, line) = ready_rx.recv_timeout(RELAY_DEADLINE).expect("every racer connects");
        assert_eq!(line.as_deref(), Some("ready"), "racer {i} failed before the barrier");
    }
    for child in &mut children {
        let stdin = child.stdin.as_mut().expect("piped");
        stdin.write_all(b"go\n").expect("release racer");
        stdin.flush().expect("release racer");
    }
    let out = answers
        .into_iter()
        .enumerate()
        .map(|(i, rx)| {
            let line = rx
                .recv_timeout(RELAY_DEADLINE)
                .ok()
                .flatten()
                .unwrap_or_else(|| panic!("racer {i} gave no answer"));
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("racer {i} answer {line:?}: {e}"))
        })
        .collect();
    for mut child in children {
        let _ = child.wait();
    }
    out
}
