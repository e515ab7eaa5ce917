//! External alerts: the `ALERT` message a gamma-ray-burst notice (or an operator) sends on
//! the dispatcher to make every builder save the raw data of a time window.
//!
//! The payload is one line of ASCII `key=value` words separated by spaces, in any order:
//!
//! ```text
//! from=1795406400.25 to=1795406401.25 name=GRB261123A origin=gcn
//! ```
//!
//! `from` and `to` are UNIX times in seconds with up to nine decimals (read exactly, as
//! integer nanoseconds: shoal's clock is UNIX nanoseconds, so a window maps to slices
//! directly); `from < to`. `name` (required) and `origin` (optional, default `unknown`) are
//! 1 to 64 characters of `A-Z a-z 0-9 _ . : + -`. Unknown keys are refused, so a typo does
//! not silently save the wrong window.

use std::fmt;

use crate::Instant;

/// The dispatcher tag alerts are sent on.
pub const ALERT_TAG: &str = "ALERT";
/// The tag builders answer on (one JSON report per builder and alert).
pub const ALERT_REPLY_TAG: &str = "ALERT_RE";
/// Longest accepted name or origin.
pub const MAX_NAME_LEN: usize = 64;
/// Longest accepted payload.
pub const MAX_ALERT_LEN: usize = 512;

/// A request to save the raw data of the window `[from, to)`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Alert {
    pub name: String,
    pub from: Instant,
    pub to: Instant,
    /// Who raised it (a notice service, an operator, `shoal-ui`).
    pub origin: String,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AlertError {
    #[error("alert message longer than {MAX_ALERT_LEN} bytes")]
    TooLong,
    #[error("alert message is not ASCII text")]
    NotText,
    #[error("`{0}` is not key=value")]
    NotKeyValue(String),
    #[error("unknown key `{0}` (expected from, to, name, origin)")]
    UnknownKey(String),
    #[error("`{0}` given twice")]
    Repeated(&'static str),
    #[error("`{0}` missing")]
    Missing(&'static str),
    #[error("`{key}`: {value:?} is not a UNIX time in seconds (up to 9 decimals)")]
    BadTime { key: &'static str, value: String },
    #[error("`{key}`: {value:?} must be 1-{MAX_NAME_LEN} characters of A-Z a-z 0-9 _ . : + -")]
    BadName { key: &'static str, value: String },
    #[error("empty window: from must be before to")]
    EmptyWindow,
}

impl AlertError {
    /// Short stable name for counters.
    pub fn kind(&self) -> &'static str {
        match self {
            AlertError::TooLong => "too_long",
            AlertError::NotText => "not_text",
            AlertError::NotKeyValue(_) => "not_key_value",
            AlertError::UnknownKey(_) => "unknown_key",
            AlertError::Repeated(_) => "repeated_key",
            AlertError::Missing(_) => "missing_key",
            AlertError::BadTime { .. } => "bad_time",
            AlertError::BadName { .. } => "bad_name",
            AlertError::EmptyWindow => "empty_window",
        }
    }
}

/// Parses UNIX seconds with up to nine decimals into nanoseconds, exactly.
pub fn parse_unix_seconds(text: &str) -> Option<u64> {
    let (int, frac) = text.split_once('.').unwrap_or((text, ""));
    if int.is_empty() || int.len() > 11 || !int.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) || (text.contains('.') && frac.is_empty()) {
        return None;
    }
    let secs: u64 = int.parse().ok()?;
    let ns = frac.bytes().chain(std::iter::repeat(b'0')).take(9).fold(0u64, |ns, b| ns * 10 + u64::from(b - b'0'));
    secs.checked_mul(1_000_000_000)?.checked_add(ns)
}

/// Formats nanoseconds as UNIX seconds with nine decimals (what [`parse_unix_seconds`] reads).
pub fn format_unix_seconds(ns: u64) -> String {
    format!("{}.{:09}", ns / 1_000_000_000, ns % 1_000_000_000)
}

fn valid_name(s: &str) -> bool {
    (1..=MAX_NAME_LEN).contains(&s.len())
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'+' | b'-'))
}

impl Alert {
    /// Checks a name and window; the constructor for senders.
    pub fn new(name: &str, from: Instant, to: Instant, origin: &str) -> Result<Alert, AlertError> {
        if !valid_name(name) {
            return Err(AlertError::BadName { key: "name", value: name.into() });
        }
        if !valid_name(origin) {
            return Err(AlertError::BadName { key: "origin", value: origin.into() });
        }
        if from >= to {
            return Err(AlertError::EmptyWindow);
        }
        Ok(Alert { name: name.into(), from, to, origin: origin.into() })
    }

    /// Reads an `ALERT` payload (see the module documentation).
    pub fn parse(payload: &[u8]) -> Result<Alert, AlertError> {
        if payload.len() > MAX_ALERT_LEN {
            return Err(AlertError::TooLong);
        }
        let text = std::str::from_utf8(payload).ok().filter(|t| t.is_ascii()).ok_or(AlertError::NotText)?;
        let (mut from, mut to, mut name, mut origin) = (None, None, None, None);
        for word in text.split_ascii_whitespace() {
            let (key, value) = word.split_once('=').ok_or_else(|| AlertError::NotKeyValue(word.into()))?;
            let (slot, key): (&mut Option<&str>, &'static str) = match key {
                "from" => (&mut from, "from"),
                "to" => (&mut to, "to"),
                "name" => (&mut name, "name"),
                "origin" => (&mut origin, "origin"),
                _ => return Err(AlertError::UnknownKey(key.into())),
            };
            if slot.replace(value).is_some() {
                return Err(AlertError::Repeated(key));
            }
        }
        let time = |key: &'static str, v: Option<&str>| -> Result<Instant, AlertError> {
            let v = v.ok_or(AlertError::Missing(key))?;
            parse_unix_seconds(v).map(Instant::from_nanos).ok_or(AlertError::BadTime { key, value: v.into() })
        };
        let (from, to) = (time("from", from)?, time("to", to)?);
        Alert::new(name.ok_or(AlertError::Missing("name"))?, from, to, origin.unwrap_or("unknown"))
    }

    /// The payload that [`Alert::parse`] reads back.
    pub fn encode(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Alert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "from={} to={} name={} origin={}",
            format_unix_seconds(self.from.as_nanos()),
            format_unix_seconds(self.to.as_nanos()),
            self.name,
            self.origin
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn reads_the_documented_example() {
        let a = Alert::parse(b"from=1795406400.25 to=1795406401.25 name=GRB261123A origin=gcn").unwrap();
        assert_eq!(a.from.as_nanos(), 1_795_406_400_250_000_000);
        assert_eq!(a.to.as_nanos(), 1_795_406_401_250_000_000);
        assert_eq!((a.name.as_str(), a.origin.as_str()), ("GRB261123A", "gcn"));
        let b = Alert::parse(b"  name=x to=2 from=1\n").unwrap();
        assert_eq!(b.origin, "unknown");
    }

    #[test]
    fn refuses_what_it_cannot_read_exactly() {
        let bad: &[(&[u8], &str)] = &[
            (b"from=1 to=2", "missing_key"),
            (b"from=1 to=2 name=a nme=b", "unknown_key"),
            (b"from=1 to=2 name=a name=b", "repeated_key"),
            (b"from=1.0000000001 to=2 name=a", "bad_time"),
            (b"from=-1 to=2 name=a", "bad_time"),
            (b"from=1. to=2 name=a", "bad_time"),
            (b"from=1e9 to=2 name=a", "bad_time"),
            (b"from=2 to=2 name=a", "empty_window"),
            (b"from=1 to=2 name=a/b", "bad_name"),
            (b"from=1 to=2 name", "not_key_value"),
            (b"from=1 to=2 name=\xff", "not_text"),
        ];
        for (payload, kind) in bad {
            assert_eq!(Alert::parse(payload).unwrap_err().kind(), *kind, "{}", String::from_utf8_lossy(payload));
        }
        assert_eq!(Alert::parse(&[b' '; 600]).unwrap_err(), AlertError::TooLong);
    }

    proptest! {
        #[test]
        fn encode_parse_round_trip(from in 0u64..4_000_000_000_000_000_000, len in 1u64..1_000_000_000_000, name in "[A-Za-z0-9_.:+-]{1,64}") {
            let a = Alert::new(&name, Instant::from_nanos(from), Instant::from_nanos(from + len), "test").unwrap();
            prop_assert_eq!(Alert::parse(a.encode().as_bytes()).unwrap(), a);
        }

        #[test]
        fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = Alert::parse(&bytes);
        }
    }
}
