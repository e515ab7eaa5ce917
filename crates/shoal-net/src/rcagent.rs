//! The run-control agent a shoal process embeds: it follows commands published on the
//! dispatcher and answers with its new state (protocol in docs/run-control.md).
//!
//! - Commands arrive on tag [`RC_CMD`] as `<target> <command>`, where `<target>` is the
//!   process name or `*` (every process) and `<command>` is the text form of
//!   [`Command`] (`INIT`, `CONFIGURE <toml>`, `START <run>`, `PAUSE`, `CONTINUE`, `STOP`,
//!   `RESET`, `OFF`).
//! - Replies go out on tag [`RC_REPLY`] as `<name> <STATE> ok` or
//!   `<name> <STATE> error <reason>` (the state is unchanged after an error). On connect the
//!   agent announces itself with `<name> IDLE ok`.
//!
//! The decisions are shoal-core's [`RunControl`]; this module only moves text.

use std::net::SocketAddr;

use shoal_core::controlhost::Mode;
use shoal_core::runstate::{Command, RunControl, RunState, TransitionError};

use crate::chclient::{ChClient, ClientError};
use crate::clock::WallClock;

/// Tag of run-control commands.
pub const RC_CMD: &str = "RC_CMD";
/// Tag of the processes' replies.
pub const RC_REPLY: &str = "RC_REPLY";

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
        let text = match error {
            None => format!("{} {} ok", self.name, self.rc.state()),
            Some(e) => format!("{} {} error {e}", self.name, self.rc.state()),
        };
        self.client.publish(RC_REPLY, text.as_bytes()).await
    }

    /// Waits for the next command addressed to this process, applies it, replies, and
    /// returns what happened. Malformed commands are answered with an error and skipped.
    pub async fn next_command(&mut self) -> Result<Applied, ClientError> {
        loop {
            let msg = self.client.next_message().await?;
            let text = String::from_utf8_lossy(&msg.payload);
            let (target, rest) = text.split_once(char::is_whitespace).unwrap_or((&text, ""));
            if target != "*" && target != self.name {
                continue;
            }
            let command = match Command::parse(rest) {
                Ok(c) => c,
                Err(e) => {
                    self.reply(Some(e.to_string())).await?;
                    continue;
                }
            };
            let result = self.rc.handle_command(self.clock.now(), command.clone());
            self.reply(result.as_ref().err().map(|e| e.to_string())).await?;
            return Ok(Applied { command, result });
        }
    }
}
