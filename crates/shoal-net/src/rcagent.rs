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
//! The decisions are shoal-core's [`RunControl`]; this module only moves text.

use std::net::SocketAddr;

use shoal_core::alert::{ALERT_TAG, Alert, AlertError};
use shoal_core::controlhost::Mode;
use shoal_core::runstate::{Command, CommandParseError, Reply, RunControl, RunState, TransitionError};

use crate::clock::WallClock;
use shoal_dispatcher::client::{ChClient, ClientError};

/// Tag of run-control commands.
pub const RC_CMD: &str = "RC_CMD";
/// Tag of the processes' replies.
pub const RC_REPLY: &str = "RC_REPLY";
/// Tag of the processes' periodic statistics (JSON, see [`crate::node::NodeStats`]).
pub const RC_STATS: &str = "RC_STATS";
/// Tag of a process's end-of-run report (JSON, see [`crate::node::NodeReport`]).
pub const RC_REPORT: &str = "RC_END";

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
}

impl RcAgent {
    /// Connects, names the connection (`_MyId`), subscribes to commands (lossless) and
    /// announces the initial state.
    pub async fn connect(addr: SocketAddr, name: &str, clock: WallClock) -> Result<Self, ClientError> {
        let mut client = ChClient::connect(addr).await?;
        client.set_nickname(name).await?;
        client.subscribe(RC_CMD, Mode::All).await?;
        let mut agent = Self { client, rc: RunControl::new(clock.now()), name: name.to_string(), clock };
        agent.reply(None).await?;
        Ok(agent)
    }

    pub fn state(&self) -> RunState {
        self.rc.state()
    }

    pub fn run_control(&self) -> &RunControl {
        &self.rc
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
