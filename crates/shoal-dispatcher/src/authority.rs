//! Who may publish and subscribe what on a secured dispatcher: the control plane's rules
//! (docs/security.md, "Who may publish what"). Pure decisions, no I/O: the server asks,
//! for every message, [`Authority::judge_publish`] and, for every `_Subscri`,
//! [`Authority::judge_subscribe`].
//!
//! A connection is either *authenticated* (mutual TLS with a certificate of the cluster CA:
//! its process name and role, [`Publisher::Certified`]) or *plain* (the ControlHost port as
//! KM3NeT's clients use it, known by its address only, [`Publisher::Plain`]). shoal reserves
//! its own tags ([`RESERVED`]):
//!
//! - run control alone sends what processes obey (`RC_CMD`, `RC_TIME`, `RC_PING`), and a
//!   plain connection from a network `command_from` names explicitly `RC_CMD` (KM3NeT's
//!   run control);
//! - a process publishes only its own replies, statistics, end reports and clock answers,
//!   and each must name it as its subject (the first word, or the JSON `name`);
//! - builders alone publish what builders publish (monitoring taps, KM3NeT's data tags,
//!   alert answers);
//! - `ALERT` comes from run control, a `client` certificate (`shoal alert --credentials`),
//!   or a plain connection from a network `command_from` names;
//! - `RC_GONE` (a process's control connection closed) is the dispatcher's own.
//!
//! A plain connection publishes every other tag and subscribes to every tag but those that
//! carry the cluster's commands, configuration and addresses ([`SECRET_TAGS`]). Without
//! security nothing here applies: the address rule of
//! [`shoal_core::controlhost::CommandAccess`] is the only one, as before.

use std::net::IpAddr;

use shoal_core::controlhost::{IpNet, Subscription, Tag};

/// Published by the dispatcher when a process's authenticated control connection (its
/// nickname is its certificate's name) closes: `<name>`. No client may publish it.
pub const RC_GONE: &str = "RC_GONE";

/// Who may publish a reserved tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Publishers {
    /// Run control (role `runcontrol`).
    RunControl,
    /// Run control, or a plain connection from `command_from` (KM3NeT's run control).
    RunControlOrCommandFrom,
    /// A process of the data path, about itself: its name is the message's subject.
    Process(Subject),
    /// Builders.
    Builders,
    /// Run control, a `client` certificate, or a plain connection from `command_from`.
    Commanders,
    /// Nobody: the dispatcher's own.
    Dispatcher,
}

/// Where a process's message names the process it speaks of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Subject {
    /// The first word: `builder0 RUNNING ok`, `builder0 7 ...`.
    FirstWord,
    /// The JSON object's `name`.
    JsonName,
}

/// shoal's tags and who may publish them.
pub const RESERVED: [(&str, Publishers); 17] = [
    ("RC_CMD", Publishers::RunControlOrCommandFrom),
    ("RC_TIME", Publishers::RunControl),
    ("RC_PING", Publishers::RunControl),
    ("RC_REPLY", Publishers::Process(Subject::FirstWord)),
    ("RC_TIMEA", Publishers::Process(Subject::FirstWord)),
    ("RC_STATS", Publishers::Process(Subject::JsonName)),
    ("RC_END", Publishers::Process(Subject::JsonName)),
    ("SHL_RAW", Publishers::Builders),
    ("SHL_EVT", Publishers::Builders),
    ("ALERT_RE", Publishers::Builders),
    ("IO_TSL0", Publishers::Builders),
    ("IO_TSL1", Publishers::Builders),
    ("IO_TSL2", Publishers::Builders),
    ("IO_TSSN", Publishers::Builders),
    ("IO_EVT", Publishers::Builders),
    ("IO_SUM", Publishers::Builders),
    ("ALERT", Publishers::Commanders),
];

/// Tags a plain connection may not subscribe to on a secured dispatcher: commands (with
/// the run configuration and its addresses), clock probes, statistics (addresses, pids)
/// and end reports.
pub const SECRET_TAGS: [&str; 4] = ["RC_CMD", "RC_TIME", "RC_STATS", "RC_END"];

/// The roles of the data path's processes.
const PROCESS_ROLES: [&str; 4] = ["source", "builder", "writer", "dfm"];

/// Who sent a message.
#[derive(Clone, Copy, Debug)]
pub enum Publisher<'a> {
    /// A certificate of the cluster CA: its process's name and role.
    Certified { name: &'a str, role: &'a str },
    /// A plain ControlHost connection from `ip`.
    Plain { ip: IpAddr },
}

/// Why a message was refused: a counter label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A reserved tag from a role that may not publish it.
    Role,
    /// A process's message about another process (or with no readable subject).
    Subject,
    /// A reserved tag on the plain port (a command tag from an address not allowed).
    Plain,
    /// The dispatcher's own tag.
    Dispatcher,
}

impl Refusal {
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::Role => "role",
            Refusal::Subject => "subject",
            Refusal::Plain => "plain",
            Refusal::Dispatcher => "dispatcher",
        }
    }
}

/// The rules of one secured dispatcher.
#[derive(Clone, Debug, Default)]
pub struct Authority {
    /// Plain connections from these networks may publish command tags (`RC_CMD`, `ALERT`);
    /// loopback is not implied.
    command_from: Vec<IpNet>,
}

fn reserved(tag: &Tag) -> Option<Publishers> {
    RESERVED
        .iter()
        .find(|(t, _)| t.as_bytes() == tag.name())
        .map(|(_, p)| *p)
        .or_else(|| (tag.name() == RC_GONE.as_bytes()).then_some(Publishers::Dispatcher))
}

/// The subject a process's message names, `None` where it has none readable.
pub fn subject_of(form: Subject, payload: &[u8]) -> Option<String> {
    match form {
        Subject::FirstWord => {
            let text = std::str::from_utf8(payload).ok()?;
            text.split_ascii_whitespace().next().map(str::to_string)
        }
        Subject::JsonName => {
            #[derive(serde::Deserialize)]
            struct Named {
                name: String,
            }
            serde_json::from_slice::<Named>(payload).ok().map(|n| n.name)
        }
    }
}

impl Authority {
    pub fn new(command_from: Vec<IpNet>) -> Self {
        Self { command_from }
    }

    pub fn command_from(&self) -> &[IpNet] {
        &self.command_from
    }

    /// Whether `who` may publish `payload` on `tag`.
    pub fn judge_publish(&self, who: Publisher<'_>, tag: &Tag, payload: &[u8]) -> Result<(), Refusal> {
        let Some(rule) = reserved(tag) else { return Ok(()) };
        match (rule, who) {
            (Publishers::Dispatcher, _) => Err(Refusal::Dispatcher),
            (Publishers::Commanders | Publishers::RunControlOrCommandFrom, Publisher::Plain { ip })
                if self.command_from.iter().any(|n| n.contains(ip)) =>
            {
                Ok(())
            }
            (_, Publisher::Plain { .. }) => Err(Refusal::Plain),
            (Publishers::RunControl | Publishers::RunControlOrCommandFrom, Publisher::Certified { role, .. }) => {
                ok_if(role == "runcontrol")
            }
            (Publishers::Commanders, Publisher::Certified { role, .. }) => {
                ok_if(role == "runcontrol" || role == "client")
            }
            (Publishers::Builders, Publisher::Certified { role, .. }) => ok_if(role == "builder"),
            (Publishers::Process(form), Publisher::Certified { name, role }) => {
                if !PROCESS_ROLES.contains(&role) {
                    return Err(Refusal::Role);
                }
                match subject_of(form, payload) {
                    Some(subject) if subject == name => Ok(()),
                    _ => Err(Refusal::Subject),
                }
            }
        }
    }

    /// The tags of `sub` that `who` may not subscribe to (they are taken out of its
    /// subscription; the rest stands).
    pub fn judge_subscribe(&self, who: Publisher<'_>, sub: &Subscription) -> Vec<Tag> {
        match who {
            Publisher::Certified { .. } => Vec::new(),
            Publisher::Plain { .. } => {
                sub.tags.keys().filter(|t| SECRET_TAGS.iter().any(|s| s.as_bytes() == t.name())).copied().collect()
            }
        }
    }
}

/// Whether `tag` commands processes (`RC_CMD`, `ALERT`): audited when the plain port
/// takes one.
pub fn is_command(tag: &Tag) -> bool {
    shoal_core::controlhost::access::COMMAND_TAGS.iter().any(|t| t.as_bytes() == tag.name())
}

fn ok_if(allowed: bool) -> Result<(), Refusal> {
    if allowed { Ok(()) } else { Err(Refusal::Role) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_core::controlhost::parse_subscription;

    fn tag(s: &str) -> Tag {
        Tag::new(s.as_bytes()).unwrap()
    }

    fn certified<'a>(name: &'a str, role: &'a str) -> Publisher<'a> {
        Publisher::Certified { name, role }
    }

    #[test]
    fn run_control_alone_commands_and_each_process_speaks_only_for_itself() {
        let a = Authority::new(vec!["192.0.2.10/32".parse().unwrap()]);
        let rc = certified("runcontrol", "runcontrol");
        let b0 = certified("builder0", "builder");
        let stranger = Publisher::Plain { ip: "127.0.0.1".parse().unwrap() };
        let km3net_rc = Publisher::Plain { ip: "192.0.2.10".parse().unwrap() };
        assert_eq!(a.judge_publish(rc, &tag("RC_CMD"), b"* STOP"), Ok(()));
        assert_eq!(a.judge_publish(b0, &tag("RC_CMD"), b"* STOP"), Err(Refusal::Role));
        assert_eq!(
            a.judge_publish(stranger, &tag("RC_CMD"), b"* STOP"),
            Err(Refusal::Plain),
            "loopback is not implied"
        );
        assert_eq!(a.judge_publish(km3net_rc, &tag("RC_CMD"), b"* STOP"), Ok(()), "command_from names it");
        assert_eq!(a.judge_publish(km3net_rc, &tag("RC_TIME"), b"* PROBE 1 2"), Err(Refusal::Plain));
        assert_eq!(a.judge_publish(certified("ops", "client"), &tag("RC_CMD"), b"* STOP"), Err(Refusal::Role));
        assert_eq!(a.judge_publish(km3net_rc, &tag("ALERT"), b"x"), Ok(()), "command_from may alert");
        assert_eq!(a.judge_publish(stranger, &tag("RC_TIME"), b"source0 ADJUST 300000000"), Err(Refusal::Plain));
        assert_eq!(a.judge_publish(b0, &tag("RC_TIME"), b"* PROBE 1 2"), Err(Refusal::Role));
        // A process about itself, and about another.
        assert_eq!(a.judge_publish(b0, &tag("RC_REPLY"), b"builder0 RUNNING ok"), Ok(()));
        assert_eq!(a.judge_publish(b0, &tag("RC_REPLY"), b"builder1 RUNNING ok"), Err(Refusal::Subject));
        assert_eq!(a.judge_publish(b0, &tag("RC_END"), br#"{"name":"builder0","run":1}"#), Ok(()));
        assert_eq!(a.judge_publish(b0, &tag("RC_END"), br#"{"name":"builder1","run":1}"#), Err(Refusal::Subject));
        assert_eq!(a.judge_publish(b0, &tag("RC_STATS"), b"not json"), Err(Refusal::Subject));
        assert_eq!(a.judge_publish(rc, &tag("RC_END"), br#"{"name":"runcontrol"}"#), Err(Refusal::Role));
        assert_eq!(a.judge_publish(stranger, &tag("RC_END"), br#"{"name":"builder0"}"#), Err(Refusal::Plain));
        // Builders' tags; the dispatcher's own; a user's data tag is anyone's.
        assert_eq!(a.judge_publish(b0, &tag("IO_EVT"), b""), Ok(()));
        assert_eq!(a.judge_publish(certified("source1", "source"), &tag("SHL_EVT"), b""), Err(Refusal::Role));
        assert_eq!(a.judge_publish(rc, &tag(RC_GONE), b"builder0"), Err(Refusal::Dispatcher));
        assert_eq!(a.judge_publish(stranger, &tag("MY_DATA"), b"anything"), Ok(()));
        assert_eq!(a.judge_publish(certified("prometheus", "client"), &tag("ALERT"), b"x"), Ok(()));
    }

    #[test]
    fn a_plain_connection_cannot_subscribe_to_commands_clocks_statistics_or_reports() {
        let a = Authority::default();
        let sub = parse_subscription(b"a IO_EVT a RC_CMD w RC_STATS a RC_REPLY a RC_END a RC_TIME");
        let stranger = Publisher::Plain { ip: "127.0.0.1".parse().unwrap() };
        let refused = a.judge_subscribe(stranger, &sub);
        assert_eq!(refused, ["RC_CMD", "RC_END", "RC_STATS", "RC_TIME"].map(tag));
        assert!(a.judge_subscribe(certified("source0", "source"), &sub).is_empty());
    }
}
