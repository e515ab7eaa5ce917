//! The run-control state machine every shoal process follows (domain.md section 6).
//!
//! States: `Idle` (after start), `Standby` (initialised), `Ready` (configured), `Running`,
//! `Paused`, and `Off` (the process exits). Commands: `Init`, `Configure` (carries the run
//! configuration), `Start` (carries a run number), `Pause`, `Continue`, `Stop`, `Reset`,
//! `Off`. A command that does not apply to the current state is rejected and leaves the
//! state unchanged. Run numbers only go up: a `Start` with a number not above the last run
//! of this process is rejected.
//!
//! | from \ command | Init | Configure | Start | Pause | Continue | Stop | Reset | Off |
//! | --- | --- | --- | --- | --- | --- | --- | --- | --- |
//! | Idle | Standby | - | - | - | - | - | - | Off |
//! | Standby | - | Ready | - | - | - | - | Idle | Off |
//! | Ready | - | Ready | Running | - | - | - | Idle | Off |
//! | Running | - | - | - | Paused | - | Ready | - | Off |
//! | Paused | - | - | - | - | Running | Ready | - | Off |
//! | Off | - | - | - | - | - | - | - | - |
//!
//! The text form of commands and replies (payloads of the `RC_CMD` / `RC_REPLY` dispatcher
//! tags) is [`Command::to_text`] / [`Command::parse`]: `INIT`, `CONFIGURE <text>`,
//! `START <run> [<first slice>]`, `PAUSE`, `CONTINUE`, `STOP [<end slice>]`, `RESET`, `OFF` (or `QUIT`).

use core::fmt;

use crate::Instant;

/// The role a DAQ process plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize), serde(rename_all = "lowercase"))]
pub enum Role {
    Source,
    Builder,
    Writer,
    /// The data-flow manager of a pull run (assigns slices to builders).
    Dfm,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Source, Role::Builder, Role::Writer, Role::Dfm];

    pub fn name(self) -> &'static str {
        match self {
            Role::Source => "source",
            Role::Builder => "builder",
            Role::Writer => "writer",
            Role::Dfm => "dfm",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl core::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Role::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| format!("unknown role {s:?} (source, builder, writer or dfm)"))
    }
}

/// A process's run-control state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RunState {
    Idle,
    Standby,
    Ready,
    Running,
    Paused,
    Off,
}

impl RunState {
    pub const ALL: [RunState; 6] =
        [RunState::Idle, RunState::Standby, RunState::Ready, RunState::Running, RunState::Paused, RunState::Off];

    pub fn name(self) -> &'static str {
        match self {
            RunState::Idle => "IDLE",
            RunState::Standby => "STANDBY",
            RunState::Ready => "READY",
            RunState::Running => "RUNNING",
            RunState::Paused => "PAUSED",
            RunState::Off => "OFF",
        }
    }

    pub fn parse(s: &str) -> Option<RunState> {
        RunState::ALL.into_iter().find(|st| st.name().eq_ignore_ascii_case(s.trim()))
    }

    /// Builders keep taking data while paused (RUNNING and PAUSED alike for data).
    pub fn accepts_data(self) -> bool {
        matches!(self, RunState::Running | RunState::Paused)
    }

    /// Sources produce only while running.
    pub fn produces_data(self) -> bool {
        self == RunState::Running
    }
}

impl fmt::Display for RunState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A run-control command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    Init,
    /// Carries the run configuration (TOML text in shoal).
    Configure(String),
    Start {
        run: u64,
        /// First time slice of the run, so that every source starts with the same slice
        /// (`START <run> <slice>`); `None`: each process picks the next whole second.
        start_slice: Option<u64>,
    },
    Pause,
    Continue,
    Stop {
        /// First slice *not* taken (`STOP <slice>`), so that every source ends with the same
        /// slice; `None`: stop at once.
        end_slice: Option<u64>,
    },
    Reset,
    Off,
    /// A query, not a transition: the process answers with its current state. Run control
    /// asks every process (`* STATUS`) when it starts, so processes that announced
    /// themselves before it listened are found.
    Status,
}

/// Why a command text could not be parsed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "bad run-control command {0:?} (INIT, CONFIGURE <config>, START <run>, PAUSE, CONTINUE, STOP, RESET, OFF, STATUS)"
)]
pub struct CommandParseError(pub String);

impl Command {
    /// The state a process is in once it has carried out this command (`None` for
    /// STATUS, which changes nothing). Run control tells an answer from an announcement
    /// by it: a process that re-announces itself in another state has not seen the
    /// command (it was sent while the process was reconnecting to the dispatcher).
    pub fn result_state(&self) -> Option<RunState> {
        Some(match self {
            Command::Init => RunState::Standby,
            Command::Configure(_) => RunState::Ready,
            Command::Start { .. } | Command::Continue => RunState::Running,
            Command::Pause => RunState::Paused,
            Command::Stop { .. } => RunState::Ready,
            Command::Reset => RunState::Idle,
            Command::Off => RunState::Off,
            Command::Status => return None,
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            Command::Init => "INIT",
            Command::Configure(_) => "CONFIGURE",
            Command::Start { .. } => "START",
            Command::Pause => "PAUSE",
            Command::Continue => "CONTINUE",
            Command::Stop { .. } => "STOP",
            Command::Reset => "RESET",
            Command::Off => "OFF",
            Command::Status => "STATUS",
        }
    }

    pub fn to_text(&self) -> String {
        match self {
            Command::Configure(cfg) => format!("CONFIGURE {cfg}"),
            Command::Start { run, start_slice: None } => format!("START {run}"),
            Command::Start { run, start_slice: Some(s) } => format!("START {run} {s}"),
            Command::Stop { end_slice: Some(s) } => format!("STOP {s}"),
            other => other.name().to_string(),
        }
    }

    pub fn parse(text: &str) -> Result<Command, CommandParseError> {
        let err = || CommandParseError(text.chars().take(80).collect());
        let text = text.trim_start();
        let (word, rest) = text.split_once(char::is_whitespace).unwrap_or((text, ""));
        let simple = |c: Command| if rest.trim().is_empty() { Ok(c) } else { Err(err()) };
        match word.to_ascii_uppercase().as_str() {
            "INIT" => simple(Command::Init),
            "CONFIGURE" => Ok(Command::Configure(rest.to_string())),
            "START" => {
                let mut words = rest.split_whitespace();
                let run = words.next().and_then(|w| w.parse().ok()).ok_or_else(err)?;
                let start_slice = match words.next() {
                    Some(w) => Some(w.parse().map_err(|_| err())?),
                    None => None,
                };
                if words.next().is_some() {
                    return Err(err());
                }
                Ok(Command::Start { run, start_slice })
            }
            "PAUSE" => simple(Command::Pause),
            "CONTINUE" => simple(Command::Continue),
            "STOP" => match rest.trim() {
                "" => Ok(Command::Stop { end_slice: None }),
                w => w.parse().map(|s| Command::Stop { end_slice: Some(s) }).map_err(|_| err()),
            },
            "RESET" => simple(Command::Reset),
            "OFF" | "QUIT" => simple(Command::Off),
            "STATUS" => simple(Command::Status),
            _ => Err(err()),
        }
    }
}

/// A command that does not apply.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    #[error("{command} is not allowed in state {state}")]
    NotAllowed { state: RunState, command: &'static str },
    #[error("run number {run} is not above the last run {last} of this process")]
    RunNumberReused { run: u64, last: u64 },
}

/// A process's answer to a command (payload of `RC_REPLY`): `<name> <STATE> ok`, or
/// `<name> <STATE> error <reason>` when the command was refused (the state is then the
/// unchanged one). The text form is written by the processes and read by run control.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub name: String,
    pub state: RunState,
    pub error: Option<String>,
}

impl Reply {
    pub fn to_text(&self) -> String {
        match &self.error {
            None => format!("{} {} ok", self.name, self.state),
            Some(e) => format!("{} {} error {e}", self.name, self.state),
        }
    }

    /// `None` for a text that is not a reply.
    pub fn parse(text: &str) -> Option<Reply> {
        let mut words = text.splitn(4, ' ');
        let name = words.next().filter(|n| !n.is_empty())?.to_string();
        let state = RunState::parse(words.next()?)?;
        let error = match words.next()? {
            "ok" => None,
            "error" => Some(words.next().unwrap_or("").to_string()),
            _ => return None,
        };
        Some(Reply { name, state, error })
    }
}

/// The state machine of one process.
#[derive(Clone, Debug)]
pub struct RunControl {
    state: RunState,
    since: Instant,
    config: Option<String>,
    run: Option<u64>,
    last_run: Option<u64>,
    /// The last command carried out (STATUS aside), to recognise it sent again.
    last_applied: Option<Command>,
}

impl RunControl {
    pub fn new(now: Instant) -> Self {
        Self { state: RunState::Idle, since: now, config: None, run: None, last_run: None, last_applied: None }
    }

    pub fn state(&self) -> RunState {
        self.state
    }

    /// When the current state was entered.
    pub fn since(&self) -> Instant {
        self.since
    }

    /// The configuration of the last `Configure`, while Ready, Running or Paused.
    pub fn config(&self) -> Option<&str> {
        self.config.as_deref()
    }

    /// The current run number while Running or Paused.
    pub fn run(&self) -> Option<u64> {
        self.run
    }

    /// What `cmd` would do, without doing it (so a process can refuse a command whose
    /// payload it cannot use before its state changes).
    pub fn check(&self, cmd: &Command) -> Result<RunState, TransitionError> {
        self.clone().handle_command(self.since, cmd.clone())
    }

    /// Whether `cmd` is the command carried out last, sent again because its answer was
    /// not seen: the process answers again with its state and does nothing else (a
    /// STOP is not refused for being in READY, a START not for the run number).
    pub fn is_repeat(&self, cmd: &Command) -> bool {
        *cmd != Command::Status && self.last_applied.as_ref() == Some(cmd)
    }

    /// Applies a command; on success returns the new state.
    pub fn handle_command(&mut self, now: Instant, cmd: Command) -> Result<RunState, TransitionError> {
        use RunState::*;
        let applied = (cmd != Command::Status).then(|| cmd.clone());
        let not_allowed = TransitionError::NotAllowed { state: self.state, command: cmd.name() };
        let next = match (self.state, cmd) {
            (state, Command::Status) => return Ok(state),
            (Off, _) => return Err(not_allowed),
            (_, Command::Off) => Off,
            (Idle, Command::Init) => Standby,
            (Standby | Ready, Command::Configure(cfg)) => {
                self.config = Some(cfg);
                Ready
            }
            (Ready, Command::Start { run, .. }) => {
                if let Some(last) = self.last_run.filter(|&l| run <= l) {
                    return Err(TransitionError::RunNumberReused { run, last });
                }
                self.run = Some(run);
                self.last_run = Some(run);
                Running
            }
            (Running, Command::Pause) => Paused,
            (Paused, Command::Continue) => Running,
            (Running | Paused, Command::Stop { .. }) => {
                self.run = None;
                Ready
            }
            (Standby | Ready, Command::Reset) => {
                self.config = None;
                Idle
            }
            _ => return Err(not_allowed),
        };
        self.state = next;
        self.since = now;
        self.last_applied = applied;
        Ok(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use RunState::*;

    #[test]
    fn the_command_carried_out_last_is_recognised_when_sent_again() {
        let mut rc = RunControl::new(Instant::ZERO);
        let stop = Command::Stop { end_slice: Some(40) };
        for c in [Command::Init, Command::Configure("x".into()), Command::Start { run: 3, start_slice: Some(9) }] {
            assert!(!rc.is_repeat(&c));
            rc.handle_command(Instant::ZERO, c.clone()).unwrap();
            assert!(rc.is_repeat(&c));
        }
        rc.handle_command(Instant::ZERO, Command::Status).unwrap();
        assert!(rc.is_repeat(&Command::Start { run: 3, start_slice: Some(9) }), "STATUS changes nothing");
        assert!(!rc.is_repeat(&Command::Status));
        rc.handle_command(Instant::ZERO, stop.clone()).unwrap();
        assert!(rc.is_repeat(&stop));
        assert!(!rc.is_repeat(&Command::Stop { end_slice: Some(41) }), "another end slice is another command");
        // Carried out again it would be refused: the repeat is what lets it be answered.
        assert!(rc.check(&stop).is_err());
        // A refused command does not replace the last one.
        assert!(rc.handle_command(Instant::ZERO, Command::Pause).is_err());
        assert!(rc.is_repeat(&stop));
    }

    fn commands() -> Vec<Command> {
        vec![
            Command::Init,
            Command::Configure("[run]\nsources = 5".into()),
            Command::Start { run: 7, start_slice: None },
            Command::Pause,
            Command::Continue,
            Command::Stop { end_slice: Some(9) },
            Command::Reset,
            Command::Off,
            Command::Status,
        ]
    }

    /// The table of the module documentation, written out independently.
    fn expected(from: RunState, cmd: &Command) -> Option<RunState> {
        let i = commands().iter().position(|c| c.name() == cmd.name()).unwrap();
        // The last column is STATUS: every state answers with itself.
        let row: [Option<RunState>; 9] = match from {
            Idle => [Some(Standby), None, None, None, None, None, None, Some(Off), Some(Idle)],
            Standby => [None, Some(Ready), None, None, None, None, Some(Idle), Some(Off), Some(Standby)],
            Ready => [None, Some(Ready), Some(Running), None, None, None, Some(Idle), Some(Off), Some(Ready)],
            Running => [None, None, None, Some(Paused), None, Some(Ready), None, Some(Off), Some(Running)],
            Paused => [None, None, None, None, Some(Running), Some(Ready), None, Some(Off), Some(Paused)],
            Off => [None, None, None, None, None, None, None, None, Some(Off)],
        };
        row[i]
    }

    /// Brings a fresh machine into `state` by the shortest legal path.
    fn machine_in(state: RunState) -> RunControl {
        let mut m = RunControl::new(Instant::ZERO);
        let path: &[Command] = match state {
            Idle => &[],
            Standby => &[Command::Init],
            Ready => &[Command::Init, Command::Configure("c".into())],
            Running => {
                &[Command::Init, Command::Configure("c".into()), Command::Start { run: 1, start_slice: Some(3) }]
            }
            Paused => &[
                Command::Init,
                Command::Configure("c".into()),
                Command::Start { run: 1, start_slice: Some(3) },
                Command::Pause,
            ],
            Off => &[Command::Off],
        };
        for c in path {
            m.handle_command(Instant::ZERO, c.clone()).unwrap();
        }
        assert_eq!(m.state(), state);
        m
    }

    #[test]
    fn every_state_times_every_command() {
        for from in RunState::ALL {
            for cmd in commands() {
                let mut m = machine_in(from);
                let got = m.handle_command(Instant::from_nanos(5), cmd.clone());
                match expected(from, &cmd) {
                    Some(to) => {
                        assert_eq!(got, Ok(to), "{from} --{}-->", cmd.name());
                        assert_eq!(m.state(), to);
                        // A query is not a transition: the state's start time stays.
                        let since = if cmd == Command::Status { Instant::ZERO } else { Instant::from_nanos(5) };
                        assert_eq!(m.since(), since);
                    }
                    None => {
                        assert_eq!(got, Err(TransitionError::NotAllowed { state: from, command: cmd.name() }));
                        assert_eq!(m.state(), from, "a rejected command changes nothing");
                    }
                }
            }
        }
    }

    #[test]
    fn run_numbers_never_go_back_and_config_is_kept() {
        let mut m = machine_in(Ready);
        assert_eq!(m.config(), Some("c"));
        m.handle_command(Instant::ZERO, Command::Start { run: 10, start_slice: None }).unwrap();
        assert_eq!(m.run(), Some(10));
        assert!(m.state().accepts_data() && m.state().produces_data());
        m.handle_command(Instant::ZERO, Command::Pause).unwrap();
        assert!(m.state().accepts_data() && !m.state().produces_data());
        m.handle_command(Instant::ZERO, Command::Stop { end_slice: None }).unwrap();
        assert_eq!(m.run(), None);
        assert_eq!(
            m.handle_command(Instant::ZERO, Command::Start { run: 10, start_slice: None }),
            Err(TransitionError::RunNumberReused { run: 10, last: 10 })
        );
        assert_eq!(m.handle_command(Instant::ZERO, Command::Start { run: 11, start_slice: None }), Ok(Running));
    }

    #[test]
    fn text_forms_roundtrip() {
        for c in commands() {
            assert_eq!(Command::parse(&c.to_text()), Ok(c));
        }
        for state in RunState::ALL {
            for error in [None, Some("START is not allowed in state IDLE".to_string())] {
                let r = Reply { name: "builder0".into(), state, error };
                assert_eq!(Reply::parse(&r.to_text()), Some(r));
            }
        }
        let r = Reply::parse("builder0 READY ok").unwrap();
        assert_eq!((r.name.as_str(), r.state, r.error), ("builder0", Ready, None));
        let r = Reply::parse("s1 IDLE error START is not allowed in state IDLE").unwrap();
        assert_eq!(r.error.as_deref(), Some("START is not allowed in state IDLE"));
        assert!(Reply::parse("garbage").is_none());
        assert!(Reply::parse("a B maybe").is_none());
        assert!(Reply::parse("a READY maybe").is_none());
        assert_eq!(Command::parse("quit"), Ok(Command::Off));
        assert_eq!(Command::parse("  start 42 "), Ok(Command::Start { run: 42, start_slice: None }));
        assert_eq!(Command::parse("START 42 1700"), Ok(Command::Start { run: 42, start_slice: Some(1700) }));
        assert!(Command::parse("START 42 x").is_err());
        assert!(Command::parse("START 42 1 2").is_err());
        assert!(Command::parse("START").is_err());
        assert_eq!(Command::parse("STOP"), Ok(Command::Stop { end_slice: None }));
        assert_eq!(Command::parse("stop 77"), Ok(Command::Stop { end_slice: Some(77) }));
        assert!(Command::parse("STOP now").is_err());
        assert_eq!(Command::parse("CONFIGURE [run]\nx = 1"), Ok(Command::Configure("[run]\nx = 1".into())));
        for bad in ["", "START", "START -1", "START x", "PAUSE now", "LAUNCH"] {
            assert!(Command::parse(bad).is_err(), "{bad:?}");
        }
        for s in RunState::ALL {
            assert_eq!(RunState::parse(s.name()), Some(s));
        }
    }
}
