//! The chaos run's real processes: producers, consumers and `relay run`s (one producer, one
//! consumer and two relays in the single-instance profiles; several of each on one
//! PostgreSQL database in the multi-instance one), each SIGKILLed and restarted on demand. A
//! restarted producer gets a new port (its clients follow the published address); a
//! restarted consumer takes its old address back (relays keep their URL), or a new one with
//! the relays that send to it restarted to point at it.

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
    /// Pass `--auto-apply` to the consumers (else the driver's applier task calls
    /// `ApplyAll`).
    pub auto_apply: bool,
    /// `relay run` flags after the subcommand.
    pub relay_args: Vec<String>,
    /// `--retention` of producers and consumers (`None`: their default).
    pub retention: Option<String>,
    /// How long a server may take to print its address.
    pub start_deadline: Duration,
    /// Producer instances, and consumer instances (the same number).
    pub instances: u8,
    /// `relay run` instances; relay `r` sends to consumer `r % instances`.
    pub relays: u8,
}

/// One consumer instance.
struct ConsumerSlot {
    process: Option<ServerProcess>,
    /// The address it listens on (kept across restarts while the port is free).
    addr: String,
    /// Where consumer clients (the injector, the applier) find it.
    ep: watch::Sender<Endpoint>,
}

/// The running processes and where their logs go.
pub struct Cluster {
    dir: PathBuf,
    /// The two databases.
    pub files: Files,
    opts: ProcessOptions,
    producers: Vec<Option<ServerProcess>>,
    consumers: Vec<ConsumerSlot>,
    relays: Vec<Option<RelayDaemon>>,
    /// Starts so far, per victim.
    starts: std::collections::BTreeMap<Victim, u64>,
    /// Every relay stdout file of every generation, for counting answers afterwards.
    pub relay_outputs: Vec<PathBuf>,
    /// Consumer restarts that could not take the old address back (relays were restarted).
    pub consumer_moves: u64,
    /// Where producer clients find each current producer.
    pub producer_eps: Vec<watch::Sender<Endpoint>>,
}

fn endpoint() -> watch::Sender<Endpoint> {
    watch::Sender::new(Endpoint { generation: 0, url: String::new() })
}

impl Cluster {
    /// Starts the producers (the first creates its store in `files`), the consumers, then the
    /// relays; logs go to `dir`.
    pub fn start(dir: &Path, files: Files, opts: ProcessOptions) -> Result<Cluster, String> {
        let n = opts.instances.max(1);
        let relays = opts.relays;
        let mut cluster = Cluster {
            dir: dir.to_owned(),
            files,
            producers: (0..n).map(|_| None).collect(),
            consumers: (0..n)
                .map(|_| ConsumerSlot { process: None, addr: "127.0.0.1:0".into(), ep: endpoint() })
                .collect(),
            relays: (0..relays).map(|_| None).collect(),
            starts: Default::default(),
            relay_outputs: Vec::new(),
            consumer_moves: 0,
            producer_eps: (0..n).map(|_| endpoint()).collect(),
            opts,
        };
        for i in 0..n {
            cluster.restart(Victim::Producer(i))?;
        }
        for i in 0..n {
            cluster.restart(Victim::Consumer(i))?;
        }
        for r in 0..relays {
            cluster.restart(Victim::Relay(r))?;
        }
        Ok(cluster)
    }

    /// Every process the cluster runs.
    pub fn victims(&self) -> Vec<Victim> {
        let n = self.producers.len() as u8;
        let mut all: Vec<Victim> = (0..n).map(Victim::Producer).collect();
        all.extend((0..n).map(Victim::Consumer));
        all.extend((0..self.relays.len() as u8).map(Victim::Relay));
        all
    }

    /// Where consumer `i`'s clients find it.
    pub fn consumer_ep(&self, i: usize) -> watch::Receiver<Endpoint> {
        self.consumers[i % self.consumers.len()].ep.subscribe()
    }

    /// Where producer `i`'s clients find it.
    pub fn producer_ep(&self, i: usize) -> watch::Receiver<Endpoint> {
        self.producer_eps[i % self.producer_eps.len()].subscribe()
    }

    /// The process id of a victim's current process.
    pub fn pid(&self, v: Victim) -> Option<u32> {
        match v {
            Victim::Producer(i) => self.producers[usize::from(i)].as_ref().and_then(ServerProcess::pid),
            Victim::Consumer(i) => {
                self.consumers[usize::from(i)].process.as_ref().and_then(ServerProcess::pid)
            }
            Victim::Relay(r) => self.relays[usize::from(r)].as_ref().and_then(RelayDaemon::pid),
        }
    }

    /// SIGKILL the victim's process now (and reap it).
    pub fn kill(&mut self, v: Victim) {
        match v {
            Victim::Producer(i) => drop(self.producers[usize::from(i)].take()),
            Victim::Consumer(i) => drop(self.consumers[usize::from(i)].process.take()),
            Victim::Relay(r) => {
                if let Some(mut relay) = self.relays[usize::from(r)].take() {
                    relay.kill();
                }
            }
        }
    }

    /// Starts the victim again (it must not be running).
    pub fn restart(&mut self, v: Victim) -> Result<(), String> {
        let generation = {
            let starts = self.starts.entry(v).or_insert(0);
            *starts += 1;
            *starts
        };
        let name = v.name();
        match v {
            Victim::Producer(i) => {
                let mut args = vec![
                    "--db".into(),
                    self.files.producer_db.arg(),
                    "--listen".into(),
                    "127.0.0.1:0".into(),
                ];
                args.extend(self.retention_args());
                let log = self.dir.join(format!("{name}.{generation}.log"));
                let p = ServerProcess::try_start("producer", &args, &[], log, self.opts.start_deadline)?;
                self.producer_eps[usize::from(i)].send_replace(Endpoint { generation, url: p.url() });
                self.producers[usize::from(i)] = Some(p);
            }
            Victim::Consumer(i) => {
                let slot = usize::from(i);
                let first = self.consumers[slot].addr.clone();
                let consumer = match self.start_consumer(&name, &first, generation, "") {
                    Ok(c) => c,
                    Err(e) if !first.ends_with(":0") => {
                        // The old port was taken meanwhile: take any, and move its relays.
                        eprintln!("chaos: {name} could not rebind {first}; moving ({})", first_line(&e));
                        self.consumer_moves += 1;
                        self.start_consumer(&name, "127.0.0.1:0", generation, ".moved")?
                    }
                    Err(e) => return Err(e),
                };
                let moved = consumer.addr != self.consumers[slot].addr;
                self.consumers[slot].addr = consumer.addr.clone();
                self.consumers[slot].ep.send_replace(Endpoint { generation, url: consumer.url() });
                self.consumers[slot].process = Some(consumer);
                if moved {
                    for r in 0..self.relays.len() {
                        if self.relay_target(r) == slot
                            && let Some(running) = self.relays[r].take()
                        {
                            running.terminate(Duration::from_secs(30));
                            self.restart(Victim::Relay(r as u8))?;
                        }
                    }
                }
            }
            Victim::Relay(r) => {
                let name = format!("{name}.{generation}");
                let url = format!("http://{}", self.consumers[self.relay_target(usize::from(r))].addr);
                let extra: Vec<&str> = self.opts.relay_args.iter().map(String::as_str).collect();
                let relay = RelayDaemon::start(&self.dir, &name, &self.files.producer_db, &url, &extra, &[]);
                self.relay_outputs.push(relay.stdout.clone());
                self.relays[usize::from(r)] = Some(relay);
            }
        }
        Ok(())
    }

    /// `--retention R` when the run sets one.
    fn retention_args(&self) -> Vec<String> {
        self.opts.retention.iter().flat_map(|r| ["--retention".to_owned(), r.clone()]).collect()
    }

    /// The consumer relay `r` sends to.
    fn relay_target(&self, r: usize) -> usize {
        r % self.consumers.len()
    }

    fn start_consumer(
        &self,
        name: &str,
        listen: &str,
        generation: u64,
        suffix: &str,
    ) -> Result<ServerProcess, String> {
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
        args.extend(self.retention_args());
        let log = self.dir.join(format!("{name}.{generation}{suffix}.log"));
        ServerProcess::try_start("consumer", &args, &[], log, self.opts.start_deadline)
    }

    /// Delivery lines the victim relay's current process has written so far (0 for others).
    pub fn relay_deliveries(&self, v: Victim) -> usize {
        let Victim::Relay(r) = v else { return 0 };
        let Some(relay) = self.relays[usize::from(r)].as_ref() else { return 0 };
        std::fs::read_to_string(&relay.stdout)
            .map(|text| text.lines().filter(|l| l.contains("\"type\":\"delivery\"")).count())
            .unwrap_or(0)
    }

    /// True while the victim's process runs (a relay that exited on its own is not).
    pub fn is_running(&mut self, v: Victim) -> bool {
        match v {
            Victim::Relay(r) => self.relays[usize::from(r)].as_mut().is_some_and(|r| r.is_running()),
            Victim::Producer(i) => self.producers[usize::from(i)].is_some(),
            Victim::Consumer(i) => self.consumers[usize::from(i)].process.is_some(),
        }
    }

    /// Stops everything cleanly (SIGTERM): relays first (their summary lines are written),
    /// then the consumers and the producers. Returns the relays' exit codes.
    pub fn stop(&mut self) -> Vec<Option<i32>> {
        let mut codes = Vec::new();
        for relay in self.relays.iter_mut() {
            if let Some(r) = relay.take() {
                codes.push(r.terminate(Duration::from_secs(30)).code);
            }
        }
        let consumers = self.consumers.iter_mut().filter_map(|c| c.process.take());
        let producers: Vec<ServerProcess> = self.producers.iter_mut().filter_map(Option::take).collect();
        for mut server in consumers.collect::<Vec<_>>().into_iter().chain(producers) {
            server.terminate(Duration::from_secs(30));
        }
        codes
    }
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or_default()
}
