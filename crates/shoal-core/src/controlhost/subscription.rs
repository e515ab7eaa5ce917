//! The `_Subscri` payload: a lenient parser (docs/controlhost.md section 4.2).
//!
//! Tokens are separated by ASCII whitespace or NUL. A mode token (`a` = all/lossless,
//! `w` = any/lossy; the CASPUR letters `s`, `m`, `W`, `S` count as `w` unless combined with
//! `a`) applies to the tags that follow it. Tags before any mode are `w`; a tag longer than
//! 8 bytes keeps its first 8; a tag named twice is `a` if either says so.

use std::collections::BTreeMap;

use super::codec::Tag;

/// How a client wants a tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mode {
    /// `w` (KM3NeT "any"): best effort, may be dropped for a slow or unready client.
    Any,
    /// `a` (KM3NeT "all"): never dropped; kept until delivered.
    All,
}

impl Mode {
    pub fn letter(self) -> char {
        match self {
            Mode::Any => 'w',
            Mode::All => 'a',
        }
    }
}

/// A parsed subscription set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Subscription {
    pub tags: BTreeMap<Tag, Mode>,
}

impl Subscription {
    /// The canonical text form, e.g. `w IO_EVT a IO_SUM`.
    pub fn to_text(&self) -> String {
        self.tags.iter().map(|(t, m)| format!("{} {t}", m.letter())).collect::<Vec<_>>().join(" ")
    }
}

fn mode_token(tok: &[u8]) -> Option<Mode> {
    if tok.is_empty() || tok.len() > 3 || !tok.iter().all(|c| b"awsmWS".contains(c)) {
        return None;
    }
    Some(if tok.contains(&b'a') { Mode::All } else { Mode::Any })
}

/// Parses a `_Subscri` payload. Never fails: anything is some set of tags.
pub fn parse_subscription(payload: &[u8]) -> Subscription {
    let mut sub = Subscription::default();
    let mut mode = Mode::Any;
    for tok in payload.split(|b| b.is_ascii_whitespace() || *b == 0).filter(|t| !t.is_empty()) {
        if let Some(m) = mode_token(tok) {
            mode = m;
            continue;
        }
        let tag = Tag::new(&tok[..tok.len().min(8)]).expect("non-empty, no blanks");
        let e = sub.tags.entry(tag).or_insert(mode);
        *e = (*e).max(mode);
    }
    sub
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> Tag {
        Tag::new(s.as_bytes()).unwrap()
    }

    #[test]
    fn real_client_strings() {
        let s = parse_subscription(b" w IO_EVT a IO_SUM");
        assert_eq!(s.tags, BTreeMap::from([(t("IO_EVT"), Mode::Any), (t("IO_SUM"), Mode::All)]));
        let s = parse_subscription(b" w IO_EVT IO_SUM");
        assert_eq!(s.tags.len(), 2);
        let s = parse_subscription(b" w IO_EVT\0\0");
        assert_eq!(s.tags, BTreeMap::from([(t("IO_EVT"), Mode::Any)]));
        assert!(parse_subscription(b"").tags.is_empty());
        assert_eq!(parse_subscription(b"IO_EVT").tags[&t("IO_EVT")], Mode::Any);
        let s = parse_subscription(b"w X a X am Y s Z LONGER_THAN_8");
        assert_eq!(s.tags[&t("X")], Mode::All);
        assert_eq!(s.tags[&t("Y")], Mode::All);
        assert_eq!(s.tags[&t("Z")], Mode::Any);
        assert!(s.tags.contains_key(&t("LONGER_T")));
        assert_eq!(parse_subscription(b" w IO_EVT a IO_SUM").to_text(), "w IO_EVT a IO_SUM");
    }
}
