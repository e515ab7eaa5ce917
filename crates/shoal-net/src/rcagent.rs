//! The run-control agent a shoal process embeds: it follows commands published on the
//! dispatcher and answers with its new state (protocol in docs/run-control.md).
//!
//! - Commands arrive on tag [`RC_CMD`] as `<target> <command>`, where `<target>` is the
//!   process name or `*` (every process) and `<command>` is the text form of
//!   [`Command`] (`INIT`, `CONFIGURE <toml>`, `START <run>`, `PAUSE`, `CONTINUE`, `STOP`,
//!   `RESET`, `OFF`).
//! - Replies go out on tag [`RC_REPLY`] as `<name> <STATE> ok` or
//!   `<name> <STATE> error <reason>` (the state is unchanged after an error). On connect the
//!   agent announces itself with `<name> IDLE ok`, and after every reconnection to the
//!   dispatcher with its current state: a command published while it was away is lost,
//!   and run control sends it again when the announced state shows it was not seen.
//!
//! - Clock probes arrive on tag [`RC_TIME`] as `* PROBE <seq> <t1>`; the agent answers at
//!   once, from a connection and task of its own ([`spawn_clock_responder`]: a busy command
//!   loop must not delay the answer), on [`RC_TIME_REPLY`] with `<name> <seq> <t2> <t3> <correction>`: its clock when
//!   the probe arrived and when it answers, and the correction in effect (ns). Run control
//!   computes the offset (shoal-core's `clocksync`). `<name> ADJUST <ns>` sets the
//!   correction, outside a run only: a running data path keeps the clock it started with.
//!
//! The decisions are shoal-core's [`RunControl`]; this module only moves text.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use shoal_core::alert::{ALERT_TAG, Alert, AlertError};
use shoal_core::controlhost::Mode;
use shoal_core::runstate::{Command, CommandParseError, Reply, RunControl, RunState, TransitionError};

use crate::clock::WallClock;
use shoal_dispatcher::client::{ChClient, ClientError, ControlTls};
use tokio_util::sync::CancellationToken;

/// Tag of run-control commands.
pub const RC_CMD: &str = "RC_CMD";
/// Tag of the processes' replies.
pub const RC_REPLY: &str = "RC_REPLY";
/// Tag of the processes' periodic statistics (JSON, see [`crate::node::NodeStats`]).
pub const RC_STATS: &str = "RC_STATS";
/// Tag of a process's end-of-run report (JSON, see [`crate::node::NodeReport`]).
pub const RC_REPORT: &str = "RC_END";
/// Tag of run control's clock probes and corrections.
pub const RC_TIME: &str = "RC_TIME";
/// Tag of the processes' answers to clock probes.
pub const RC_TIME_REPLY: &str = "RC_TIMEA";

/// An answer to a clock probe, as run control reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimeAnswer {
    pub name: String,
    pub seq: u64,
    pub t2: u64,
    pub t3: u64,
    pub correction_ns: i64,
}

impl TimeAnswer {
    pub fn to_text(&self) -> String {
        format!("{} {} {} {} {}", self.name, self.seq, self.t2, self.t3, self.correction_ns)
    }

    pub fn parse(text: &str) -> Option<TimeAnswer> {
        let mut f = text.split_ascii_whitespace();
        let a = TimeAnswer {
            name: f.next()?.to_string(),
            seq: f.next()?.parse().ok()?,
            t2: f.next()?.parse().ok()?,
            t3: f.next()?.parse().ok()?,
            correction_ns: f.next()?.parse().ok()?,
        };
        f.next().is_none().then_some(a)
    }
}

/// What arrived for the process: a run-control command, or an alert (builders only).
#[derive(Debug)]
pub enum Inbound {
    Command(Result<Command, CommandParseError>),
    Alert(Result<Alert, AlertError>),
}

/// What one command did.
#[derive(Debug, PartialEq)]
pub struct Applied {
    pub command: Command,
    pub result: Result<RunState, TransitionError>,
}

/// A process's connection to run control.
#[derive(Debug)]
pub struct RcAgent {
    client: ChClient,
    rc: RunControl,
    name: String,
    clock: WallClock,
    clock_cell: Arc<ClockCell>,
    _responder: tokio_util::sync::DropGuard,
}

impl RcAgent {
    /// Connects, names the connection (`_MyId`), subscribes to commands (lossless) and
    /// announces the initial state.
    pub async fn connect(addr: SocketAddr, name: &str, clock: WallClock) -> Result<Self, ClientError> {
        Self::connect_with(addr, None, name, clock).await
    }

    /// [`RcAgent::connect`] proving this process's certificate to a secured dispatcher
    /// (`tls`), its clock answers too.
    pub async fn connect_with(
        addr: SocketAddr,
        tls: Option<ControlTls>,
        name: &str,
        clock: WallClock,
    ) -> Result<Self, ClientError> {
        let mut client = ChClient::connect_with(addr, tls.clone()).await?;
        client.set_nickname(name).await?;
        client.subscribe(RC_CMD, Mode::All).await?;
        let clock_cell = Arc::new(ClockCell::new(clock));
        let stop = tokio_util::sync::CancellationToken::new();
        spawn_clock_responder(addr, tls, name.to_string(), clock_cell.clone(), stop.clone());
        let mut agent = Self {
            client,
            rc: RunControl::new(clock.now()),
            name: name.to_string(),
            clock,
            clock_cell,
            _responder: stop.drop_guard(),
        };
        agent.reply(None).await?;
        Ok(agent)
    }

    pub fn state(&self) -> RunState {
        self.rc.state()
    }

    pub fn run_control(&self) -> &RunControl {
        &self.rc
    }

    /// The process's clock, with run control's latest correction (for a data path that
    /// starts now).
    pub fn clock(&self) -> WallClock {
        self.clock_cell.get()
    }

    async fn reply(&mut self, error: Option<String>) -> Result<(), ClientError> {
        let reply = Reply { name: self.name.clone(), state: self.rc.state(), error };
        // After a reconnection the process announces its state again (see `set_hello`):
        // run control sends again a command it missed while away.
        let announce = Reply { error: None, ..reply.clone() };
        self.client.set_hello(RC_REPLY, announce.to_text().as_bytes())?;
        self.client.publish(RC_REPLY, reply.to_text().as_bytes()).await
    }

    /// Answers a command again without doing it: run control sent again the command the
    /// process carried out last because it did not see the answer.
    pub async fn repeat_answer(&mut self) -> Result<(), ClientError> {
        self.reply(None).await
    }

    /// Also receive alerts (`ALERT`, every one: lossless), for a builder's burst saver.
    pub async fn subscribe_alerts(&mut self) -> Result<(), ClientError> {
        self.client.subscribe(ALERT_TAG, Mode::All).await
    }

    /// The next command addressed to this process (by name or `*`). A text that is not a
    /// command comes back as `Err` for the caller to answer with [`RcAgent::refuse`].
    /// Cancel-safe: it only reads, so it can sit in a `select!` beside timers.
    pub async fn recv_command(&mut self) -> Result<Result<Command, CommandParseError>, ClientError> {
        loop {
            if let Inbound::Command(c) = self.recv().await? {
                return Ok(c);
            }
        }
    }

    /// The next command addressed to this process, or the next alert (after
    /// [`RcAgent::subscribe_alerts`]). Cancel-safe like [`RcAgent::recv_command`].
    pub async fn recv(&mut self) -> Result<Inbound, ClientError> {
        loop {
            let msg = self.client.next_message().await?;
            if msg.tag.name() == ALERT_TAG.as_bytes() {
                return Ok(Inbound::Alert(Alert::parse(&msg.payload)));
            }
            let text = String::from_utf8_lossy(&msg.payload);
            let (target, rest) = text.split_once(char::is_whitespace).unwrap_or((&text, ""));
            if target != "*" && target != self.name {
                continue;
            }
            return Ok(Inbound::Command(Command::parse(rest)));
        }
    }

    /// What `command` would do in the current state, without doing it.
    pub fn check(&self, command: &Command) -> Result<RunState, TransitionError> {
        self.rc.check(command)
    }

    /// Answers a command that was not carried out (state unchanged).
    pub async fn refuse(&mut self, reason: &str) -> Result<(), ClientError> {
        self.reply(Some(reason.to_string())).await
    }

    /// Applies `command` after the process has carried out its part and replies with the
    /// new state (or the transition error).
    pub async fn commit(&mut self, command: Command) -> Result<Applied, ClientError> {
        let result = self.rc.handle_command(self.clock.now(), command.clone());
        // A running data path keeps the clock it started with: no correction meanwhile.
        self.clock_cell.freeze(matches!(self.rc.state(), RunState::Running | RunState::Paused));
        self.reply(result.as_ref().err().map(|e| e.to_string())).await?;
        Ok(Applied { command, result })
    }

    /// Publishes a message of the process's own (statistics, reports).
    pub async fn publish(&mut self, tag: &str, payload: &[u8]) -> Result<(), ClientError> {
        self.client.publish(tag, payload).await
    }

    /// Waits for the next command addressed to this process, applies it, replies, and
    /// returns what happened. Malformed commands are answered with an error and skipped.
    /// (For processes with nothing to do on a command; `shoal node` uses
    /// [`RcAgent::recv_command`], acts, then [`RcAgent::commit`].)
    pub async fn next_command(&mut self) -> Result<Applied, ClientError> {
        loop {
            match self.recv_command().await? {
                Ok(command) => return self.commit(command).await,
                Err(e) => self.refuse(&e.to_string()).await?,
            }
        }
    }
}

/// A process's clock as run control corrects it: read by the command loop at START,
/// corrected by the clock responder outside runs.
#[derive(Debug)]
pub struct ClockCell {
    clock: Mutex<WallClock>,
    frozen: AtomicBool,
}

impl ClockCell {
    pub fn new(clock: WallClock) -> Self {
        Self { clock: Mutex::new(clock), frozen: AtomicBool::new(false) }
    }

    pub fn get(&self) -> WallClock {
        *self.clock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// While frozen (a run in progress) corrections are refused.
    pub fn freeze(&self, frozen: bool) {
        self.frozen.store(frozen, Ordering::Relaxed);
    }

    /// Applies run control's correction unless frozen; the correction in effect after.
    pub fn correct(&self, by_ns: i64) -> i64 {
        let mut c = self.clock.lock().unwrap_or_else(|e| e.into_inner());
        if !self.frozen.load(Ordering::Relaxed) {
            *c = c.corrected(by_ns);
        }
        c.correction_ns()
    }
}

/// Answers run control's clock probes and corrections for process `name` on a dispatcher
/// connection of its own, until `stop` (reconnecting when the dispatcher goes away).
pub fn spawn_clock_responder(
    addr: SocketAddr,
    tls: Option<ControlTls>,
    name: String,
    cell: Arc<ClockCell>,
    stop: CancellationToken,
) {
    tokio::spawn(async move {
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = answer_clock_probes(addr, tls, &name, &cell) => {}
        }
    });
}

async fn answer_clock_probes(addr: SocketAddr, tls: Option<ControlTls>, name: &str, cell: &ClockCell) {
    let mut client = loop {
        match ChClient::connect_with(addr, tls.clone()).await {
            Ok(c) => break c,
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(500)).await,
        }
    };
    if client.subscribe(RC_TIME, Mode::All).await.is_err() {
        return;
    }
    loop {
        let msg = match client.next_message().await {
            Ok(m) => m,
            Err(_) => {
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                continue;
            }
        };
        let received = cell.get().now();
        let text = String::from_utf8_lossy(&msg.payload);
        let mut f = text.split_ascii_whitespace();
        let (Some(target), Some(what), Some(arg)) = (f.next(), f.next(), f.next()) else { continue };
        if target != "*" && target != name {
            continue;
        }
        let (seq, correction_ns) = match what {
            "PROBE" => match arg.parse::<u64>() {
                Ok(seq) => (seq, cell.get().correction_ns()),
                Err(_) => continue,
            },
            "ADJUST" => match arg.parse::<i64>() {
                Ok(ns) => (0, cell.correct(ns)),
                Err(_) => continue,
            },
            _ => continue,
        };
        let answer = TimeAnswer {
            name: name.to_string(),
            seq,
            t2: received.as_nanos(),
            t3: cell.get().now().as_nanos(),
            correction_ns,
        };
        if client.publish(RC_TIME_REPLY, answer.to_text().as_bytes()).await.is_err() {
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        }
    }
}
