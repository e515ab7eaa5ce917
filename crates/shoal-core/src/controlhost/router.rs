//! The dispatcher's routing state machine.
//!
//! The driver reports connections ([`Router::handle_connect`]), received messages
//! ([`Router::handle_message`]), completed writes ([`Router::handle_written`]) and
//! disconnections; it drains [`Output`]s: a message to hand to one client's socket (one
//! write, prefix and payload together), or a connection to close. Each client has a FIFO
//! in global arrival order. A client receives only while ready (`_Always`: forever; `_Gime`:
//! one message per credit) and only `window` messages at a time are in the driver's hands.
//!
//! Flow control (docs/controlhost.md section 5.3):
//! - `w` (any): enqueued only if the client is ready and holds fewer than `queue_limit`
//!   messages; otherwise dropped for that client and counted.
//! - `a` (all): always enqueued. While the bytes held for all clients exceed
//!   `memory_limit`, [`Router::accepting`] is false and the driver stops reading from
//!   publishers (back-pressure), until writes free memory.

use std::collections::{BTreeMap, HashMap, VecDeque};

use bytes::Bytes;

use super::codec::{Message, Tag};
use super::subscription::{Mode, parse_subscription};

/// A connection, numbered by the driver.
pub type ClientId = u64;

/// Dispatcher limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterConfig {
    /// Most messages queued for one client before `w` messages are dropped for it.
    pub queue_limit: usize,
    /// Bytes held for all clients above which publishers are paused.
    pub memory_limit: u64,
    /// Messages handed to a client's writer at once.
    pub window: usize,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self { queue_limit: 100, memory_limit: 1 << 30, window: 64 }
    }
}

/// Why the router wants a connection closed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CloseReason {
    /// `_UniqueI` named a nickname another live client holds.
    DuplicateNickname(String),
}

/// What the driver must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    /// Write this message to this client (then report it with [`Router::handle_written`]).
    Transmit {
        client: ClientId,
        message: Message,
    },
    Close {
        client: ClientId,
        reason: CloseReason,
    },
}

/// Counters per tag.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct TagStats {
    pub messages_in: u64,
    pub bytes_in: u64,
    pub messages_out: u64,
    pub bytes_out: u64,
    pub dropped: u64,
}

/// A client as shown on the status page.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct ClientStatus {
    pub id: ClientId,
    pub nickname: Option<String>,
    pub subscription: String,
    /// -1: always ready; n >= 0: credits left.
    pub ready: i64,
    pub queued: usize,
    pub in_flight: usize,
    pub dropped: u64,
    pub received: u64,
    pub delivered: u64,
}

#[derive(Debug, Default)]
struct Client {
    subs: BTreeMap<Tag, Mode>,
    /// 0: not ready; -1: always; n > 0: n more messages.
    waits: i64,
    nick: Option<Vec<u8>>,
    queue: VecDeque<Message>,
    in_flight: VecDeque<u64>,
    dropped: u64,
    received: u64,
    delivered: u64,
}

impl Client {
    fn ready(&self) -> bool {
        self.waits != 0
    }
    fn held(&self) -> usize {
        self.queue.len() + self.in_flight.len()
    }
}

/// The routing table and queues. See the module documentation.
#[derive(Debug, Default)]
pub struct Router {
    cfg: RouterConfig,
    clients: BTreeMap<ClientId, Client>,
    /// tag -> subscribed clients (for fan-out without scanning every client).
    index: HashMap<Tag, BTreeMap<ClientId, Mode>>,
    held_bytes: u64,
    out: VecDeque<Output>,
    /// Clients whose queue may have something to transmit.
    pending: VecDeque<ClientId>,
    stats: HashMap<Tag, TagStats>,
}

impl Router {
    pub fn new(cfg: RouterConfig) -> Self {
        Self { cfg, ..Default::default() }
    }

    pub fn handle_connect(&mut self, id: ClientId) {
        self.clients.insert(id, Client::default());
    }

    /// The connection is gone; its queue is discarded, its nickname announced as `Died`.
    pub fn handle_disconnect(&mut self, id: ClientId) {
        let Some(c) = self.clients.remove(&id) else { return };
        for tag in c.subs.keys() {
            self.unindex(*tag, id);
        }
        let freed: u64 = c.queue.iter().map(|m| m.payload.len() as u64).sum::<u64>() + c.in_flight.iter().sum::<u64>();
        self.held_bytes -= freed;
        if let Some(nick) = c.nick {
            self.publish(Message { tag: Tag::DIED, payload: Bytes::from(nick) });
        }
    }

    /// A message arrived from `from`: control tags act, data tags fan out.
    pub fn handle_message(&mut self, from: ClientId, msg: Message) {
        if let Some(c) = self.clients.get_mut(&from) {
            c.received += 1;
        }
        let s = self.stats.entry(msg.tag).or_default();
        s.messages_in += 1;
        s.bytes_in += msg.payload.len() as u64;
        if !msg.tag.is_control() {
            self.publish(msg);
            return;
        }
        let Some(c) = self.clients.get_mut(&from) else { return };
        match msg.tag {
            Tag::SUBSCRIBE => {
                let new = parse_subscription(&msg.payload).tags;
                let old = std::mem::replace(&mut c.subs, new.clone());
                for tag in old.keys() {
                    self.unindex(*tag, from);
                }
                for (tag, mode) in new {
                    self.index.entry(tag).or_default().insert(from, mode);
                }
            }
            Tag::ALWAYS => {
                c.waits = -1;
                self.pending.push_back(from);
            }
            Tag::GIME => {
                if c.waits >= 0 {
                    c.waits += 1;
                }
                self.pending.push_back(from);
            }
            Tag::MY_ID | Tag::UNIQUE_ID => {
                let end = msg.payload.iter().position(|&b| b == 0).unwrap_or(msg.payload.len());
                let nick = msg.payload[..end].to_vec();
                if msg.tag == Tag::UNIQUE_ID
                    && !nick.is_empty()
                    && self.clients.iter().any(|(id, o)| *id != from && o.nick.as_deref() == Some(&nick[..]))
                {
                    let reason = CloseReason::DuplicateNickname(String::from_utf8_lossy(&nick).into_owned());
                    self.out.push_back(Output::Close { client: from, reason });
                    return;
                }
                let c = self.clients.get_mut(&from).expect("checked above");
                let old = std::mem::replace(&mut c.nick, (!nick.is_empty()).then(|| nick.clone()));
                if let Some(old) = old {
                    self.publish(Message { tag: Tag::DIED, payload: Bytes::from(old) });
                }
                if !nick.is_empty() {
                    self.publish(Message { tag: Tag::BORN, payload: Bytes::from(nick) });
                }
            }
            // Every other control tag (_Version, _ShowSta, _StopDis, ...) is ignored:
            // never forwarded, never a reason to disconnect.
            _ => {}
        }
    }

    /// The driver finished writing the `messages` oldest messages handed to `client`.
    pub fn handle_written(&mut self, client: ClientId, messages: usize) {
        let Some(c) = self.clients.get_mut(&client) else { return };
        let n = messages.min(c.in_flight.len());
        let freed: u64 = c.in_flight.drain(..n).sum();
        self.held_bytes -= freed;
        if n > 0 {
            self.pending.push_back(client);
        }
    }

    /// False while publishers must be paused (held bytes above the memory limit).
    pub fn accepting(&self) -> bool {
        self.held_bytes <= self.cfg.memory_limit
    }

    /// Bytes held in queues and in the drivers' hands.
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes
    }

    pub fn poll_output(&mut self) -> Option<Output> {
        loop {
            if let Some(o) = self.out.pop_front() {
                return Some(o);
            }
            let id = self.pending.pop_front()?;
            self.fill_window(id);
        }
    }

    fn fill_window(&mut self, id: ClientId) {
        let Some(c) = self.clients.get_mut(&id) else { return };
        while c.ready() && c.in_flight.len() < self.cfg.window {
            let Some(m) = c.queue.pop_front() else { break };
            if c.waits > 0 {
                c.waits -= 1;
            }
            c.in_flight.push_back(m.payload.len() as u64);
            c.delivered += 1;
            let s = self.stats.entry(m.tag).or_default();
            s.messages_out += 1;
            s.bytes_out += m.payload.len() as u64;
            self.out.push_back(Output::Transmit { client: id, message: m });
        }
    }

    /// Fan-out to every subscriber of the tag, the sender included.
    fn publish(&mut self, msg: Message) {
        let Some(subs) = self.index.get(&msg.tag) else { return };
        let len = msg.payload.len() as u64;
        for (&id, &mode) in subs {
            let c = self.clients.get_mut(&id).expect("indexed clients exist");
            let keep = match mode {
                Mode::All => true,
                Mode::Any => c.ready() && c.held() < self.cfg.queue_limit,
            };
            if keep {
                c.queue.push_back(msg.clone());
                self.held_bytes += len;
                self.pending.push_back(id);
            } else {
                c.dropped += 1;
                self.stats.entry(msg.tag).or_default().dropped += 1;
            }
        }
    }

    fn unindex(&mut self, tag: Tag, id: ClientId) {
        if let Some(m) = self.index.get_mut(&tag) {
            m.remove(&id);
            if m.is_empty() {
                self.index.remove(&tag);
            }
        }
    }

    pub fn tag_stats(&self) -> impl Iterator<Item = (&Tag, &TagStats)> {
        self.stats.iter()
    }

    pub fn client_count(&self) -> usize {
        self.clients.len()
    }

    pub fn status(&self) -> Vec<ClientStatus> {
        self.clients
            .iter()
            .map(|(&id, c)| ClientStatus {
                id,
                nickname: c.nick.as_ref().map(|n| String::from_utf8_lossy(n).into_owned()),
                subscription: super::subscription::Subscription { tags: c.subs.clone() }.to_text(),
                ready: c.waits,
                queued: c.queue.len(),
                in_flight: c.in_flight.len(),
                dropped: c.dropped,
                received: c.received,
                delivered: c.delivered,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(s: &str) -> Tag {
        Tag::new(s.as_bytes()).unwrap()
    }
    fn msg(t: Tag, p: &[u8]) -> Message {
        Message { tag: t, payload: Bytes::copy_from_slice(p) }
    }
    fn sub(r: &mut Router, id: ClientId, s: &str) {
        r.handle_message(id, msg(Tag::SUBSCRIBE, s.as_bytes()));
        r.handle_message(id, msg(Tag::ALWAYS, b""));
    }
    fn outputs(r: &mut Router) -> Vec<Output> {
        std::iter::from_fn(|| r.poll_output()).collect()
    }
    fn delivered(outs: &[Output]) -> Vec<(ClientId, String, Vec<u8>)> {
        outs.iter()
            .filter_map(|o| match o {
                Output::Transmit { client, message } => {
                    Some((*client, message.tag.to_string(), message.payload.to_vec()))
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn fan_out_in_order_including_sender_and_no_control_forwarding() {
        let mut r = Router::new(RouterConfig::default());
        for id in 1..=3 {
            r.handle_connect(id);
        }
        sub(&mut r, 1, " w MSG");
        sub(&mut r, 2, " a MSG w OTHER");
        r.handle_message(1, msg(tag("MSG"), b"one"));
        r.handle_message(3, msg(tag("MSG"), b"two"));
        r.handle_message(3, msg(tag("NOBODY"), b"x"));
        r.handle_message(3, msg(Tag::new(b"_Version").unwrap(), b"1.8"));
        let d = delivered(&outputs(&mut r));
        let to = |c| d.iter().filter(|x| x.0 == c).map(|x| x.2.clone()).collect::<Vec<_>>();
        assert_eq!(to(1), [b"one".to_vec(), b"two".to_vec()], "the sender gets its own message");
        assert_eq!(to(2), [b"one".to_vec(), b"two".to_vec()]);
        assert!(to(3).is_empty());
        assert!(d.iter().all(|x| !x.1.starts_with('_')));
    }

    #[test]
    fn subscribe_replaces_the_whole_set() {
        let mut r = Router::new(RouterConfig::default());
        r.handle_connect(1);
        sub(&mut r, 1, " w A");
        sub(&mut r, 1, " w B");
        r.handle_message(1, msg(tag("A"), b"a"));
        r.handle_message(1, msg(tag("B"), b"b"));
        assert_eq!(delivered(&outputs(&mut r)).len(), 1);
        sub(&mut r, 1, "");
        r.handle_message(1, msg(tag("B"), b"b"));
        assert!(delivered(&outputs(&mut r)).is_empty());
    }

    #[test]
    fn readiness_gime_and_window() {
        let cfg = RouterConfig { window: 2, ..Default::default() };
        let mut r = Router::new(cfg);
        r.handle_connect(1);
        r.handle_message(1, msg(Tag::SUBSCRIBE, b"a X"));
        for i in 0..4u8 {
            r.handle_message(1, msg(tag("X"), &[i]));
        }
        assert!(outputs(&mut r).is_empty(), "not ready: nothing sent, all-mode kept");
        r.handle_message(1, msg(Tag::GIME, b""));
        assert_eq!(delivered(&outputs(&mut r)).len(), 1);
        r.handle_written(1, 1);
        assert!(outputs(&mut r).is_empty(), "one credit, one message");
        r.handle_message(1, msg(Tag::ALWAYS, b""));
        assert_eq!(delivered(&outputs(&mut r)).len(), 2, "window of 2");
        r.handle_written(1, 1);
        assert_eq!(delivered(&outputs(&mut r)).len(), 1);
        r.handle_written(1, 1);
        r.handle_written(1, 1);
        assert_eq!(r.held_bytes(), 0);
    }

    #[test]
    fn any_mode_drops_beyond_queue_limit_all_mode_backpressures() {
        let cfg = RouterConfig { queue_limit: 3, memory_limit: 10, window: 1 };
        let mut r = Router::new(cfg);
        r.handle_connect(1);
        r.handle_connect(2);
        sub(&mut r, 1, "w T");
        sub(&mut r, 2, "a T");
        for _ in 0..6 {
            r.handle_message(1, msg(tag("T"), b"1234"));
        }
        let d = delivered(&outputs(&mut r));
        assert_eq!(d.iter().filter(|x| x.0 == 1).count(), 1, "window 1");
        let st = r.status();
        assert_eq!((st[0].queued + st[0].in_flight, st[0].dropped), (3, 3));
        assert_eq!((st[1].queued + st[1].in_flight, st[1].dropped), (6, 0));
        assert!(!r.accepting(), "36 bytes held > 10");
        for _ in 0..6 {
            r.handle_written(2, 1);
            r.handle_written(1, 1);
            outputs(&mut r);
        }
        assert!(r.accepting());
    }

    #[test]
    fn nicknames_born_died_unique() {
        let mut r = Router::new(RouterConfig::default());
        for id in 1..=3 {
            r.handle_connect(id);
        }
        sub(&mut r, 1, "w Born w Died");
        r.handle_message(2, msg(Tag::MY_ID, b"JDataWriter\0junk"));
        r.handle_message(3, msg(Tag::UNIQUE_ID, b"JDataWriter"));
        let outs = outputs(&mut r);
        assert!(
            outs.contains(&Output::Close { client: 3, reason: CloseReason::DuplicateNickname("JDataWriter".into()) })
        );
        r.handle_disconnect(3);
        r.handle_message(2, msg(Tag::MY_ID, b"Other"));
        r.handle_disconnect(2);
        let mut d = delivered(&outs);
        d.extend(delivered(&outputs(&mut r)));
        let got: Vec<(String, String)> = d.into_iter().map(|x| (x.1, String::from_utf8(x.2).unwrap())).collect();
        assert_eq!(
            got,
            [
                ("Born".into(), "JDataWriter".into()),
                ("Died".into(), "JDataWriter".into()),
                ("Born".into(), "Other".into()),
                ("Died".into(), "Other".into())
            ]
        );
    }
}
