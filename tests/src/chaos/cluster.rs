//! The chaos run's real processes: one producer, one consumer and two `relay run`s on one
//! pair of files, each SIGKILLed and restarted on demand. A restarted producer gets a new
//! port (clients follow the published address); a restarted consumer takes its old address
//! back (relays keep their URL), or a new one with the relays restarted to point at it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::watch;

use crate::background::RelayDaemon;
use crate::checker::Files;
use crate::proc::ServerProcess;

use super::schedule::Victim;

/// A server's current address and how many times it was (re)started, published to the
/// clients so they reconnect after a restart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// Bumped at every restart, so a client sees a new server.
    pub generation: u64,
    /// The server's URL.
    pub url: String,
}

/// How the processes are started.
#[derive(Clone, Debug)]
pub struct ProcessOptions {
    /// Pass `--auto-apply` to the consumer (a later change adds the flag; until then the
    /// driver's applier task calls `ApplyAll`).
    pub auto_apply: bool,
    /// `relay run` flags after the subcommand.
    pub relay_args: Vec<String>,
    /// How long a server may take to print its address.
    pub start_deadline: Duration,
}

/// The running processes and where their logs go.
pub struct Cluster {
    dir: PathBuf,
    /// The two databases.
    pub files: Files,
    opts: ProcessOptions,
    producer: Option<ServerProcess>,
    consumer: Option<ServerProcess>,
    consumer_addr: String,
    relays: [Option<RelayDaemon>; 2],
    /// Starts so far, per victim (0 = producer, 1 = consumer, 2/3 = relays).
    starts: [u64; 4],
    /// Every relay stdout file of every generation, for counting answers afterwards.
    pub relay_outputs: Vec<PathBuf>,
    /// Consumer restarts that could not take the old address back (relays were restarted).
    pub consumer_moves: u64,
    /// Where producer clients find the current producer.
    pub producer_ep: watch::Sender<Endpoint>,
    /// Where consumer clients find the current consumer.
    pub consumer_ep: watch::Sender<Endpoint>,
}

fn slot(v: Victim) -> usize {
    match v {
        Victim::Producer => 0,
        Victim::Consumer => 1,
        Victim::RelayA => 2,
        Victim::RelayB => 3,
    }
}

impl Cluster {
    /// Starts the producer (which creates its store in `files`), the consumer, then both
    /// relays; logs go to `dir`.
    pub fn start(dir: &Path, files: Files, opts: ProcessOptions) -> Result<Cluster, String> {
        let mut cluster = Cluster {
            dir: dir.to_owned(),
            files,
            opts,
            producer: None,
            consumer: None,
            consumer_addr: "127.0.0.1:0".into(),
            relays: [None, None],
            starts: [0; 4],
            relay_outputs: Vec::new(),
            consumer_moves: 0,
            producer_ep: watch::Sender::new(Endpoint { generation: 0, url: String::new() }),
            consumer_ep: watch::Sender::new(Endpoint { generation: 0, url: String::new() }),
        };
        for v in [Victim::Producer, Victim::Consumer, Victim::RelayA, Victim::RelayB] {
            cluster.restart(v)?;
        }
        Ok(cluster)
    }

    /// The process id of a victim's current process.
    pub fn pid(&self, v: Victim) -> Option<u32> {
        match v {
            Victim::Producer => self.producer.as_ref().and_then(ServerProcess::pid),
            Victim::Consumer => self.consumer.as_ref().and_then(ServerProcess::pid),
            Victim::RelayA => self.relays[0].as_ref().and_then(RelayDaemon::pid),
            Victim::RelayB => self.relays[1].as_ref().and_then(RelayDaemon::pid),
        }
    }

    /// SIGKILL the victim's process now (and reap it).
    pub fn kill(&mut self, v: Victim) {
        match v {
            Victim::Producer => drop(self.producer.take()),
            Victim::Consumer => drop(self.consumer.take()),
            Victim::RelayA | Victim::RelayB => {
                if let Some(mut relay) = self.relays[slot(v) - 2].take() {
                    relay.kill();
                }
            }
        }
    }

    /// Starts the victim again (it must not be running).
    pub fn restart(&mut self, v: Victim) -> Result<(), String> {
        let generation = self.starts[slot(v)] + 1;
        self.starts[slot(v)] = generation;
        match v {
            Victim::Producer => {
                let args = vec![
                    "--db".into(),
                    self.files.producer_db.arg(),
                    "--listen".into(),
                    "127.0.0.1:0".into(),
                ];
                let log = self.dir.join(format!("producer.{generation}.log"));
                let p = ServerProcess::try_start("producer", &args, &[], log, self.opts.start_deadline)?;
                self.producer_ep.send_replace(Endpoint { generation, url: p.url() });
                self.producer = Some(p);
            }
            Victim::Consumer => {
                let first = self.consumer_addr.clone();
                let consumer = match self.start_consumer(&first, generation, "") {
                    Ok(c) => c,
                    Err(e) if !first.ends_with(":0") => {
                        // The old port was taken meanwhile: take any, and move the relays.
                        eprintln!("chaos: consumer could not rebind {first}; moving ({})", first_line(&e));
                        self.consumer_moves += 1;
                        self.start_consumer("127.0.0.1:0", generation, ".moved")?
                    }
                    Err(e) => return Err(e),
                };
                let moved = consumer.addr != self.consumer_addr;
                self.consumer_addr = consumer.addr.clone();
                self.consumer_ep.send_replace(Endpoint { generation, url: consumer.url() });
                self.consumer = Some(consumer);
                if moved {
                    for (i, relay) in [Victim::RelayA, Victim::RelayB].into_iter().enumerate() {
                        if let Some(running) = self.relays[i].take() {
                            running.terminate(Duration::from_secs(30));
                            self.restart(relay)?;
                        }
                    }
                }
            }
            Victim::RelayA | Victim::RelayB => {
                let name = format!("{}.{generation}", v.name());
                let url = format!("http://{}", self.consumer_addr);
                let extra: Vec<&str> = self.opts.relay_args.iter().map(String::as_str).collect();
                let relay = RelayDaemon::start(&self.dir, &name, &self.files.producer_db, &url, &extra, &[]);
                self.relay_outputs.push(relay.stdout.clone());
                self.relays[slot(v) - 2] = Some(relay);
            }
        }
        Ok(())
    }

    fn start_consumer(&self, listen: &str, generation: u64, suffix: &str) -> Result<ServerProcess, String> {
        let mut args = vec![
            "--db".into(),
            self.files.consumer_db.arg(),
            "--listen".into(),
            listen.to_owned(),
            "--support-v2".into(),
        ];
        if self.opts.auto_apply {
            args.push("--auto-apply".into());
        }
        let log = self.dir.join(format!("consumer.{generation}{suffix}.log"));
        ServerProcess::try_start("consumer", &args, &[], log, self.opts.start_deadline)
    }

    /// Delivery lines the victim relay's current process has written so far (0 for others).
    pub fn relay_deliveries(&self, v: Victim) -> usize {
        let Some(relay) = (match v {
            Victim::RelayA => self.relays[0].as_ref(),
            Victim::RelayB => self.relays[1].as_ref(),
            _ => None,
        }) else {
            return 0;
        };
        std::fs::read_to_string(&relay.stdout)
            .map(|text| text.lines().filter(|l| l.contains("\"type\":\"delivery\"")).count())
            .unwrap_or(0)
    }

    /// True while the victim's process runs (a relay that exited on its own is not).
    pub fn is_running(&mut self, v: Victim) -> bool {
        match v {
            Victim::RelayA | Victim::RelayB => {
                self.relays[slot(v) - 2].as_mut().is_some_and(|r| r.is_running())
            }
            Victim::Producer => self.producer.is_some(),
            Victim::Consumer => self.consumer.is_some(),
        }
    }

    /// Stops everything cleanly (SIGTERM): relays first (their summary lines are written),
    /// then the consumer and the producer. Returns the relays' exit codes.
    pub fn stop(&mut self) -> Vec<Option<i32>> {
        let mut codes = Vec::new();
        for relay in self.relays.iter_mut() {
            if let Some(r) = relay.take() {
                codes.push(r.terminate(Duration::from_secs(30)).code);
            }
        }
        for server in [self.consumer.take(), self.producer.take()].into_iter().flatten() {
            let mut server = server;
            server.terminate(Duration::from_secs(30));
        }
        codes
    }
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or_default()
}
