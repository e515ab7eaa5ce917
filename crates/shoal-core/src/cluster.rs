//! Run control of a whole cluster, sans-IO: [`ClusterControl`].
//!
//! It decides what the run-control process says to whom and when: the order of commands
//! (downstream first on START, upstream first on STOP and OFF), the run's first and last
//! slices, the deadline for every answer, which processes are inactive and why, how
//! refusals add up to a failed command, and the discovery of processes that were running
//! before run control listened (`* STATUS`, asked again until all answered).
//!
//! Like the node machines it owns no socket or clock: the driver feeds it replies
//! ([`ClusterControl::handle_reply`]), departures ([`ClusterControl::handle_left`]),
//! operator commands ([`ClusterControl::handle_command`]) and timeouts, and publishes what
//! [`ClusterControl::poll_transmit`] returns (`<target> <command text>` on `RC_CMD`).
//! Time is an [`Instant`] on the UNIX epoch in production (the slice clock is), any origin
//! in tests.

use std::collections::{BTreeSet, VecDeque};
use std::fmt;

use crate::runstate::{Command, Reply, Role, RunState};
use crate::slice::{SliceClock, SliceNumber};
use crate::{Duration, Instant};

/// How long a step waits for answers before its command goes again to the processes not
/// yet heard from ([`ClusterEvent::Reminded`]); the wait doubles each time.
pub const ASK_AGAIN_FIRST: Duration = Duration::from_millis(500);
/// The longest wait between two reminders.
pub const ASK_AGAIN_MAX: Duration = Duration::from_secs(8);

/// One process of the cluster file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterProcess {
    pub name: String,
    pub role: Role,
}

/// What the controller needs to know of the cluster.
#[derive(Clone, Debug)]
pub struct ClusterControlConfig {
    pub processes: Vec<ClusterProcess>,
    /// The run configuration sent with CONFIGURE.
    pub configuration: String,
    pub slice_clock: SliceClock,
    /// A process that does not answer a command within this time (plus the drain time on
    /// STOP) is marked inactive.
    pub reply_timeout: Duration,
    /// How long processes have to announce themselves after run control starts.
    pub announce_timeout: Duration,
    /// How often `* STATUS` is asked while some process is still unheard of.
    pub status_interval: Duration,
    /// START even when processes are inactive (a run without a builder or a source loses
    /// data by design, so the default refuses).
    pub start_with_missing: bool,
    /// Extra time the sources, builders and the writer get to answer STOP (their drain).
    pub source_drain: Duration,
    pub builder_drain: Duration,
    pub writer_drain: Duration,
    /// A process that announces itself again while a run is on (restarted after a crash)
    /// is brought into the run: INIT, CONFIGURE, then START with a slice just ahead.
    pub rejoin: bool,
}

impl ClusterControlConfig {
    /// A configuration with shoal's default timings: 5 s per answer, 10 s to announce,
    /// STATUS every 0.5 s, 5 s of drain for every role.
    pub fn new(processes: Vec<ClusterProcess>, configuration: String, slice_clock: SliceClock) -> Self {
        Self {
            processes,
            configuration,
            slice_clock,
            reply_timeout: Duration::from_secs(5),
            announce_timeout: Duration::from_secs(10),
            status_interval: Duration::from_millis(500),
            start_with_missing: false,
            source_drain: Duration::from_secs(5),
            builder_drain: Duration::from_secs(5),
            writer_drain: Duration::from_secs(5),
            rejoin: true,
        }
    }
}

/// A command for the whole cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ClusterCommand {
    Init,
    Configure,
    Start,
    Pause,
    Continue,
    Stop,
    Reset,
    Off,
}

impl ClusterCommand {
    pub const ALL: [ClusterCommand; 8] = [
        ClusterCommand::Init,
        ClusterCommand::Configure,
        ClusterCommand::Start,
        ClusterCommand::Pause,
        ClusterCommand::Continue,
        ClusterCommand::Stop,
        ClusterCommand::Reset,
        ClusterCommand::Off,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ClusterCommand::Init => "INIT",
            ClusterCommand::Configure => "CONFIGURE",
            ClusterCommand::Start => "START",
            ClusterCommand::Pause => "PAUSE",
            ClusterCommand::Continue => "CONTINUE",
            ClusterCommand::Stop => "STOP",
            ClusterCommand::Reset => "RESET",
            ClusterCommand::Off => "OFF",
        }
    }
}

impl fmt::Display for ClusterCommand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ClusterCommand {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let upper = s.trim().to_ascii_uppercase();
        ClusterCommand::ALL.into_iter().find(|c| c.name() == upper).ok_or_else(|| {
            let known: Vec<&str> = ClusterCommand::ALL.iter().map(|c| c.name()).collect();
            format!("unknown command {s:?}; known: {}", known.join(" "))
        })
    }
}

/// Why a process is not taking part.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InactiveReason {
    NeverAnnounced {
        within: Duration,
    },
    NoAnswer {
        command: &'static str,
        within: Duration,
    },
    LeftDispatcher,
    /// The launched process exited; the text is its exit status.
    Exited(String),
}

impl fmt::Display for InactiveReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InactiveReason::NeverAnnounced { within } => write!(f, "did not announce itself within {within:?}"),
            InactiveReason::NoAnswer { command, within } => write!(f, "no answer to {command} within {within:?}"),
            InactiveReason::LeftDispatcher => f.write_str("left the dispatcher"),
            InactiveReason::Exited(how) => write!(f, "process exited ({how})"),
        }
    }
}

/// What run control knows of one process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessView {
    pub name: String,
    pub role: Role,
    /// The last state it reported; `None` before it announced itself.
    pub state: Option<RunState>,
    /// Answered in time and still connected.
    pub active: bool,
    pub inactive_reason: Option<InactiveReason>,
    /// It was told OFF: leaving and exiting is expected now.
    pub switched_off: bool,
    /// The slice from which it takes part in the run in progress (the run's start, or
    /// where it rejoined); `None` when it is not in the run.
    pub joined_at: Option<SliceNumber>,
    /// Rejoining: the state it was in when it was sent its last catch-up command.
    catching_up: Option<RunState>,
}

/// A process that left the run in progress (it exited, or stopped answering): what it
/// took part in, so that its production can be attributed although its report is lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Departure {
    pub name: String,
    pub role: Role,
    pub run: u64,
    /// It took part in slices `from_slice..to_slice` (to: the slice in progress when it
    /// was found gone, not produced).
    pub from_slice: SliceNumber,
    pub to_slice: SliceNumber,
    pub at: Instant,
    pub reason: InactiveReason,
}

/// A process that refused a command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub name: String,
    pub error: String,
}

/// A command that is not carried out at all.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CommandRejected {
    #[error("busy with {0}")]
    Busy(&'static str),
    #[error("still waiting for the processes to announce themselves")]
    Discovering,
    #[error("a run is in progress")]
    RunInProgress,
    #[error("no run in progress")]
    NoRun,
    #[error(
        "not starting: {} of {total} processes inactive ({}); bring them back, or set \
         cluster.start_with_missing = true to run without them",
        missing.len(), missing.join(", ")
    )]
    ProcessesMissing { missing: Vec<String>, total: usize },
    #[error("no run number: {0}")]
    NoRunNumber(String),
}

/// How a command went, once every answer is in or overdue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommandOutcome {
    pub command: ClusterCommand,
    pub refusals: Vec<Refusal>,
    /// Processes that did not answer in time (now inactive).
    pub no_answer: Vec<String>,
}

impl CommandOutcome {
    /// A command succeeds when nobody refused it (silent processes are marked inactive,
    /// which START then refuses to run with).
    pub fn is_ok(&self) -> bool {
        self.refusals.is_empty()
    }
}

/// Something the driver should know about (to log, show, or act on).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClusterEvent {
    /// A process reported its state for the first time.
    Announced {
        name: String,
        state: RunState,
    },
    /// A process that was inactive answered again.
    Back {
        name: String,
        state: RunState,
    },
    Inactive {
        name: String,
        reason: InactiveReason,
    },
    /// A process left the run in progress.
    Departed(Departure),
    /// A process that came back during a run was sent START: it takes part from
    /// `start_slice`.
    Rejoined {
        name: String,
        run: u64,
        start_slice: SliceNumber,
    },
    /// A command went again to a process whose answer was not seen: it announced itself
    /// in the state before the command, or run control's connection was broken.
    AskedAgain {
        name: String,
        command: &'static str,
    },
    /// The step's command went again to the processes not yet heard from, after
    /// [`ASK_AGAIN_FIRST`] and then twice as long each time (up to [`ASK_AGAIN_MAX`]): a
    /// command can be lost without a trace; a slow answer (a drain) is also asked again.
    Reminded {
        command: &'static str,
        names: Vec<String>,
    },
    /// A process could not be brought back into the run (it refused a catch-up command).
    RejoinFailed {
        name: String,
        error: String,
    },
    /// Discovery ended: every process announced itself, or these did not in time.
    DiscoveryDone {
        missing: Vec<String>,
    },
    RunStarted {
        run: u64,
        start_slice: SliceNumber,
    },
    /// Every STOP was answered (or is overdue): the end-of-run reports are in.
    RunStopped {
        run: u64,
        start_slice: SliceNumber,
        end_slice: SliceNumber,
    },
    CommandDone(CommandOutcome),
}

/// One message to publish on `RC_CMD`: `<target> <command text>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outgoing {
    /// A process name, or `*` for every process.
    pub target: String,
    pub command: Command,
}

impl Outgoing {
    pub fn to_text(&self) -> String {
        format!("{} {}", self.target, self.command.to_text())
    }
}

/// The run in progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActiveRun {
    pub run: u64,
    pub start_slice: SliceNumber,
}

#[derive(Clone, Debug)]
enum Step {
    /// Sends `command` to the processes of `role` (all roles if `None`); only the active
    /// ones unless `including_inactive` (OFF reaches everyone).
    Send { role: Option<Role>, command: Command, timeout: Duration, including_inactive: bool },
    /// The STOP steps are done.
    EndOfRun { end_slice: SliceNumber },
}

#[derive(Clone, Debug)]
struct Sequence {
    command: ClusterCommand,
    steps: VecDeque<Step>,
    /// The step waiting for answers: who, what, until when.
    waiting: BTreeSet<usize>,
    /// The command of the step waiting for answers (sent again to a process that shows
    /// it has not seen it).
    step: Option<Command>,
    step_timeout: Duration,
    deadline: Option<Instant>,
    /// When the step's command goes again to the processes not yet heard from, and the
    /// wait after that (doubling).
    ask_again_at: Option<Instant>,
    ask_again_after: Duration,
    refusals: Vec<Refusal>,
    no_answer: Vec<String>,
}

#[derive(Clone, Debug)]
enum Phase {
    Discovering { deadline: Instant, next_ask: Instant },
    Idle,
    Busy(Sequence),
}

/// The cluster's run control (see the module documentation).
#[derive(Debug)]
pub struct ClusterControl {
    cfg: ClusterControlConfig,
    processes: Vec<ProcessView>,
    phase: Phase,
    run: Option<ActiveRun>,
    paused: bool,
    departures: Vec<Departure>,
    transmits: VecDeque<Outgoing>,
    events: VecDeque<ClusterEvent>,
}

impl ClusterControl {
    /// Starts discovering: the first `* STATUS` is due at `now`.
    pub fn new(cfg: ClusterControlConfig, now: Instant) -> Self {
        let processes = cfg
            .processes
            .iter()
            .map(|p| ProcessView {
                name: p.name.clone(),
                role: p.role,
                state: None,
                active: true,
                inactive_reason: None,
                switched_off: false,
                joined_at: None,
                catching_up: None,
            })
            .collect();
        let deadline = now + cfg.announce_timeout;
        let mut c = Self {
            cfg,
            processes,
            phase: Phase::Discovering { deadline, next_ask: now },
            run: None,
            paused: false,
            departures: Vec::new(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
        };
        c.handle_timeout(now);
        c
    }

    pub fn processes(&self) -> &[ProcessView] {
        &self.processes
    }

    pub fn config(&self) -> &ClusterControlConfig {
        &self.cfg
    }

    /// The run in progress.
    pub fn run(&self) -> Option<ActiveRun> {
        self.run
    }

    /// Processes that left a run while it was on (this run and earlier ones).
    pub fn departures(&self) -> &[Departure] {
        &self.departures
    }

    /// The command being carried out.
    pub fn busy(&self) -> Option<ClusterCommand> {
        match &self.phase {
            Phase::Busy(s) => Some(s.command),
            _ => None,
        }
    }

    pub fn is_discovering(&self) -> bool {
        matches!(self.phase, Phase::Discovering { .. })
    }

    /// Processes that are not active, with the reason.
    pub fn inactive(&self) -> impl Iterator<Item = &ProcessView> {
        self.processes.iter().filter(|p| !p.active)
    }

    fn index(&self, name: &str) -> Option<usize> {
        self.processes.iter().position(|p| p.name == name)
    }

    /// A process's answer (to a command or to STATUS). Returns false for a name that is
    /// not in the cluster file.
    pub fn handle_reply(&mut self, now: Instant, reply: &Reply) -> bool {
        let Some(i) = self.index(&reply.name) else { return false };
        let p = &mut self.processes[i];
        let first = p.state.is_none();
        p.state = Some(reply.state);
        if reply.state != RunState::Off && !p.active {
            p.active = true;
            p.inactive_reason = None;
            self.events.push_back(ClusterEvent::Back { name: p.name.clone(), state: reply.state });
        } else if first {
            self.events.push_back(ClusterEvent::Announced { name: p.name.clone(), state: reply.state });
        }
        if let Phase::Busy(seq) = &mut self.phase
            && seq.waiting.contains(&i)
        {
            let step = seq.step.as_ref().expect("a step waits for answers");
            if reply.error.is_none() && step.result_state().is_some_and(|s| s != reply.state) {
                // Not an answer: the process announced itself again (it reconnected to
                // the dispatcher) in the state before the command, which it never saw.
                self.events.push_back(ClusterEvent::AskedAgain { name: reply.name.clone(), command: step.name() });
                self.transmits.push_back(Outgoing { target: reply.name.clone(), command: step.clone() });
                return true;
            }
            seq.waiting.remove(&i);
            if let Some(e) = &reply.error {
                seq.refusals.push(Refusal { name: reply.name.clone(), error: e.clone() });
            }
            if seq.waiting.is_empty() {
                self.advance(now);
            }
        } else {
            self.catch_up(now, i, reply);
        }
        if let Phase::Discovering { .. } = self.phase
            && self.processes.iter().all(|p| p.state.is_some())
        {
            self.phase = Phase::Idle;
            self.events.push_back(ClusterEvent::DiscoveryDone { missing: Vec::new() });
        }
        true
    }

    /// A process that is not in the run in progress (restarted after a crash) is brought
    /// into it one command per answer: INIT, CONFIGURE, START just ahead of now.
    fn catch_up(&mut self, now: Instant, i: usize, reply: &Reply) {
        let Some(run) = self.run else { return };
        let p = &mut self.processes[i];
        if !self.cfg.rejoin || self.paused || !matches!(self.phase, Phase::Idle) || !p.active || p.switched_off {
            return;
        }
        if p.joined_at.is_some() {
            return;
        }
        if let Some(e) = &reply.error
            && p.catching_up.is_some()
        {
            p.catching_up = None;
            self.events.push_back(ClusterEvent::RejoinFailed { name: p.name.clone(), error: e.clone() });
            return;
        }
        let command = match reply.state {
            RunState::Idle => Command::Init,
            RunState::Standby => Command::Configure(self.cfg.configuration.clone()),
            RunState::Ready => {
                let lead = self.cfg.reply_timeout.min(Duration::from_millis(500));
                let start_slice = (self.cfg.slice_clock.slice_at(now + lead) + 1).max(run.start_slice);
                p.joined_at = Some(start_slice);
                self.events.push_back(ClusterEvent::Rejoined { name: p.name.clone(), run: run.run, start_slice });
                Command::Start { run: run.run, start_slice: Some(start_slice) }
            }
            // Running (or paused) all along, only out of touch: it is in the run.
            RunState::Running | RunState::Paused => {
                p.joined_at = Some(self.cfg.slice_clock.slice_at(now));
                return;
            }
            RunState::Off => return,
        };
        if p.catching_up == Some(reply.state) && !matches!(command, Command::Start { .. }) {
            return; // already asked; its answer will move it on
        }
        p.catching_up = Some(reply.state);
        self.transmits.push_back(Outgoing { target: p.name.clone(), command });
    }

    /// Answers may have been lost (run control's own connection to the dispatcher was
    /// broken and is back): the command of the step in progress goes again to every
    /// process not yet heard from. A process answers a repeat of the command it carried
    /// out last by repeating its answer, so nothing is done twice.
    pub fn handle_answers_missed(&mut self) {
        let Phase::Busy(seq) = &self.phase else { return };
        let Some(step) = &seq.step else { return };
        for &i in &seq.waiting {
            let name = self.processes[i].name.clone();
            self.events.push_back(ClusterEvent::AskedAgain { name: name.clone(), command: step.name() });
            self.transmits.push_back(Outgoing { target: name, command: step.clone() });
        }
    }

    /// The process left the dispatcher.
    pub fn handle_left(&mut self, now: Instant, name: &str) {
        self.lost(now, name, InactiveReason::LeftDispatcher);
    }

    /// A launched process exited (`how`: its exit status).
    pub fn handle_exited(&mut self, now: Instant, name: &str, how: &str) {
        self.lost(now, name, InactiveReason::Exited(how.to_string()));
    }

    fn lost(&mut self, now: Instant, name: &str, reason: InactiveReason) {
        let Some(i) = self.index(name) else { return };
        let p = &mut self.processes[i];
        if p.switched_off || !p.active {
            return;
        }
        p.active = false;
        p.inactive_reason = Some(reason.clone());
        p.catching_up = None;
        if let (Some(run), Some(from_slice)) = (self.run, p.joined_at.take()) {
            let d = Departure {
                name: p.name.clone(),
                role: p.role,
                run: run.run,
                from_slice,
                to_slice: self.cfg.slice_clock.slice_at(now).max(from_slice),
                at: now,
                reason: reason.clone(),
            };
            self.departures.push(d.clone());
            self.events.push_back(ClusterEvent::Departed(d));
        }
        self.events.push_back(ClusterEvent::Inactive { name: p.name.clone(), reason });
        // Waiting for a process that is gone only delays the others.
        if let Phase::Busy(seq) = &mut self.phase
            && seq.waiting.remove(&i)
            && seq.waiting.is_empty()
        {
            self.advance(now);
        }
    }

    /// An operator's command. `next_run` hands out the run number and is called only when
    /// a START goes ahead (run numbers are never wasted on a refused START).
    pub fn handle_command(
        &mut self,
        now: Instant,
        command: ClusterCommand,
        next_run: impl FnOnce() -> Result<u64, String>,
    ) -> Result<(), CommandRejected> {
        match &self.phase {
            Phase::Busy(s) => return Err(CommandRejected::Busy(s.command.name())),
            Phase::Discovering { .. } => return Err(CommandRejected::Discovering),
            Phase::Idle => {}
        }
        let t = self.cfg.reply_timeout;
        let send = |role, command: Command, timeout, including_inactive| Step::Send {
            role,
            command,
            timeout,
            including_inactive,
        };
        let mut steps = VecDeque::new();
        match command {
            ClusterCommand::Init => steps.push_back(send(None, Command::Init, t, false)),
            ClusterCommand::Configure => {
                steps.push_back(send(None, Command::Configure(self.cfg.configuration.clone()), t, false))
            }
            ClusterCommand::Pause => {
                self.paused = true;
                steps.push_back(send(None, Command::Pause, t, false))
            }
            ClusterCommand::Continue => {
                self.paused = false;
                steps.push_back(send(None, Command::Continue, t, false))
            }
            ClusterCommand::Reset => steps.push_back(send(None, Command::Reset, t, false)),
            ClusterCommand::Start => {
                if self.run.is_some() {
                    return Err(CommandRejected::RunInProgress);
                }
                let missing: Vec<String> = self
                    .inactive()
                    .map(|p| {
                        format!(
                            "{}: {}",
                            p.name,
                            p.inactive_reason.as_ref().map_or(String::from("inactive"), |r| r.to_string())
                        )
                    })
                    .collect();
                if !missing.is_empty() && !self.cfg.start_with_missing {
                    return Err(CommandRejected::ProcessesMissing { missing, total: self.processes.len() });
                }
                let run = next_run().map_err(CommandRejected::NoRunNumber)?;
                // Every source begins with the same slice, far enough ahead for the START
                // to reach all of them.
                let lead = t.min(Duration::from_secs(1));
                let start_slice = self.cfg.slice_clock.slice_at(now + lead) + 1;
                self.run = Some(ActiveRun { run, start_slice });
                self.events.push_back(ClusterEvent::RunStarted { run, start_slice });
                // Downstream first, so the receivers listen before data arrives (the
                // data-flow manager of a pull run before the builders that connect to it).
                for role in [Role::Writer, Role::Dfm, Role::Builder, Role::Source] {
                    steps.push_back(send(Some(role), Command::Start { run, start_slice: Some(start_slice) }, t, false));
                }
            }
            ClusterCommand::Stop => {
                if self.run.is_none() {
                    return Err(CommandRejected::NoRun);
                }
                self.stop_steps(now, &mut steps);
            }
            ClusterCommand::Off => {
                if self.run.is_some() {
                    self.stop_steps(now, &mut steps);
                }
                // Upstream first, the reverse of START; to every process of the cluster,
                // also the inactive ones (one that is alive but was not heard from must not
                // keep running a data path without control).
                for role in [Role::Source, Role::Builder, Role::Dfm, Role::Writer] {
                    steps.push_back(send(Some(role), Command::Off, t, true));
                }
            }
        }
        self.phase = Phase::Busy(Sequence {
            command,
            steps,
            waiting: BTreeSet::new(),
            step: None,
            step_timeout: Duration::ZERO,
            deadline: None,
            ask_again_at: None,
            ask_again_after: ASK_AGAIN_FIRST,
            refusals: Vec::new(),
            no_answer: Vec::new(),
        });
        self.advance(now);
        Ok(())
    }

    /// STOP in data-flow order: sources drain up to the common end slice, the data-flow
    /// manager of a pull run ends once every slice before it is assigned and processed
    /// (the builders still run), builders finish behind them, the writer closes its file
    /// last.
    fn stop_steps(&self, now: Instant, steps: &mut VecDeque<Step>) {
        let t = self.cfg.reply_timeout;
        // A little ahead, so that the STOP reaches every source before its end slice.
        let lead = t.min(Duration::from_millis(500));
        let end_slice = self.cfg.slice_clock.slice_at(now + lead) + 1;
        for (role, drain, end) in [
            (Role::Source, self.cfg.source_drain, Some(end_slice)),
            (Role::Dfm, self.cfg.builder_drain, Some(end_slice)),
            (Role::Builder, self.cfg.builder_drain, None),
            (Role::Writer, self.cfg.writer_drain, None),
        ] {
            steps.push_back(Step::Send {
                role: Some(role),
                command: Command::Stop { end_slice: end },
                timeout: t + drain + lead,
                including_inactive: false,
            });
        }
        steps.push_back(Step::EndOfRun { end_slice });
    }

    /// Starts the next step with anyone to talk to; ends the sequence after the last.
    fn advance(&mut self, now: Instant) {
        let Phase::Busy(seq) = &mut self.phase else { return };
        seq.deadline = None;
        seq.ask_again_at = None;
        while let Some(step) = seq.steps.pop_front() {
            match step {
                Step::EndOfRun { end_slice } => {
                    self.paused = false;
                    for p in &mut self.processes {
                        p.joined_at = None;
                        p.catching_up = None;
                    }
                    if let Some(r) = self.run.take() {
                        self.events.push_back(ClusterEvent::RunStopped {
                            run: r.run,
                            start_slice: r.start_slice,
                            end_slice,
                        });
                    }
                }
                Step::Send { role, command, timeout, including_inactive } => {
                    for (i, p) in self.processes.iter_mut().enumerate() {
                        if role.is_some_and(|r| r != p.role) || !(p.active || including_inactive) {
                            continue;
                        }
                        if command == Command::Off {
                            p.switched_off = true;
                        }
                        if let Command::Start { start_slice: Some(s), .. } = command {
                            p.joined_at = Some(s);
                        }
                        seq.waiting.insert(i);
                        self.transmits.push_back(Outgoing { target: p.name.clone(), command: command.clone() });
                    }
                    if !seq.waiting.is_empty() {
                        seq.step = Some(command);
                        seq.step_timeout = timeout;
                        seq.deadline = Some(now + timeout);
                        seq.ask_again_after = ASK_AGAIN_FIRST;
                        seq.ask_again_at = Some(now + ASK_AGAIN_FIRST);
                        return;
                    }
                }
            }
        }
        let outcome = CommandOutcome {
            command: seq.command,
            refusals: std::mem::take(&mut seq.refusals),
            no_answer: std::mem::take(&mut seq.no_answer),
        };
        self.phase = Phase::Idle;
        self.events.push_back(ClusterEvent::CommandDone(outcome));
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        match &mut self.phase {
            Phase::Discovering { deadline, next_ask } => {
                if now < *deadline && now >= *next_ask {
                    self.transmits.push_back(Outgoing { target: "*".into(), command: Command::Status });
                    *next_ask = now + self.cfg.status_interval;
                }
                if now >= *deadline {
                    let within = self.cfg.announce_timeout;
                    let mut missing = Vec::new();
                    for p in self.processes.iter_mut().filter(|p| p.state.is_none() && p.active) {
                        p.active = false;
                        p.inactive_reason = Some(InactiveReason::NeverAnnounced { within });
                        missing.push(p.name.clone());
                        self.events.push_back(ClusterEvent::Inactive {
                            name: p.name.clone(),
                            reason: InactiveReason::NeverAnnounced { within },
                        });
                    }
                    self.phase = Phase::Idle;
                    self.events.push_back(ClusterEvent::DiscoveryDone { missing });
                }
            }
            Phase::Busy(seq) => {
                if seq.ask_again_at.is_some_and(|t| now >= t)
                    && let Some(step) = &seq.step
                {
                    // Nothing acknowledges a command on the dispatcher: one published while
                    // a process was reconnecting, or before its subscription reached the new
                    // dispatcher, is lost without a trace. A process answers a repeat of
                    // what it carried out last by answering again, so asking again is safe.
                    let names: Vec<String> = seq.waiting.iter().map(|&i| self.processes[i].name.clone()).collect();
                    for name in &names {
                        self.transmits.push_back(Outgoing { target: name.clone(), command: step.clone() });
                    }
                    self.events.push_back(ClusterEvent::Reminded { command: step.name(), names });
                    seq.ask_again_after = (seq.ask_again_after * 2).min(ASK_AGAIN_MAX);
                    seq.ask_again_at = Some(now + seq.ask_again_after);
                }
                if seq.deadline.is_some_and(|d| now >= d) {
                    let command = seq.step.as_ref().map_or("", Command::name);
                    let reason = InactiveReason::NoAnswer { command, within: seq.step_timeout };
                    for i in std::mem::take(&mut seq.waiting) {
                        let p = &mut self.processes[i];
                        seq.no_answer.push(p.name.clone());
                        // OFF that is not answered: the process is gone or going; it is
                        // switched off all the same.
                        if p.active {
                            p.active = false;
                            p.inactive_reason = Some(reason.clone());
                            self.events
                                .push_back(ClusterEvent::Inactive { name: p.name.clone(), reason: reason.clone() });
                        }
                    }
                    self.advance(now);
                }
            }
            Phase::Idle => {}
        }
    }

    /// When [`ClusterControl::handle_timeout`] is next due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match &self.phase {
            Phase::Discovering { deadline, next_ask } => Some((*deadline).min(*next_ask)),
            Phase::Busy(seq) => match (seq.deadline, seq.ask_again_at) {
                (Some(d), Some(a)) => Some(d.min(a)),
                (d, a) => d.or(a),
            },
            Phase::Idle => None,
        }
    }

    pub fn poll_transmit(&mut self) -> Option<Outgoing> {
        self.transmits.pop_front()
    }

    pub fn poll_event(&mut self) -> Option<ClusterEvent> {
        self.events.pop_front()
    }
}
