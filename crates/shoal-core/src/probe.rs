//! The switch buffer probe (`shoal probe-switch`): its datagrams and the analysis of a flood.
//!
//! Synchronised senders flood one receiver through a switch, so the switch port toward the
//! receiver is oversubscribed; its output buffer fills and drop-tail drops what does not
//! fit. Every datagram carries its sender's send time, and the receiver stamps its arrival
//! (a kernel timestamp). A datagram's wait in the buffer is its arrival minus its send time
//! minus the path's delay when the buffer is empty (measured per sender from spaced
//! calibration datagrams sent before the flood, which also absorbs any offset between the
//! sender's and receiver's clocks). The datagrams that reached the receiver during that
//! wait were queued ahead of it: so every accepted datagram says how full the buffer was,
//! in packets and in bytes, when it came. While the port drops, every accepted datagram
//! found the buffer full but for its own room; the median over that stretch is the buffer.
//! A flood of large and one of small datagrams tell a packet limit (the same count) from a
//! byte limit (the same bytes).
//!
//! Main types: [`ProbeMessage`] (checked [`ProbeMessage::decode`]), [`Arrival`],
//! [`base_delays`], [`analyse_flood`] giving a [`FloodEstimate`], and [`classify`] giving a
//! [`BufferVerdict`].

use std::collections::BTreeMap;

/// First bytes of every probe datagram.
pub const MAGIC: [u8; 4] = *b"SHPB";
pub const VERSION: u8 = 1;
/// Header length of every probe datagram; data datagrams are padded to their size after it.
pub const HEADER_LEN: usize = 22;
/// Bytes a UDP/IPv4 datagram's payload is shorter than its Ethernet frame as a queue counts
/// it (14 Ethernet + 20 IPv4 + 8 UDP; no frame check sequence).
pub const FRAME_OVERHEAD: u32 = 42;
/// Largest payload of one datagram in a 1500-byte MTU without fragmentation.
pub const MAX_PAYLOAD: u16 = 1472;

const KIND_GO: u8 = 1;
const KIND_CALIB: u8 = 2;
const KIND_DATA: u8 = 3;
const KIND_END: u8 = 4;
const KIND_PING: u8 = 5;
const KIND_PONG: u8 = 6;

/// One datagram's send time and place in its sender's sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamp {
    pub sender: u16,
    pub round: u16,
    pub seq: u32,
    /// Sender's wall clock (UNIX nanoseconds) just before the send.
    pub send_ns: u64,
}

/// The receiver's order to a sender: flood me now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Go {
    /// The id the sender puts in its datagrams this round.
    pub sender: u16,
    pub round: u16,
    /// UDP payload bytes of the calibration and data datagrams.
    pub payload: u16,
    /// Data datagrams to send.
    pub count: u32,
    /// The rate the sender paces its datagrams at, bits per second of Ethernet frames.
    pub pace_bps: u64,
    /// Microseconds after this order arrives at which the flood starts (the calibration
    /// datagrams go before it).
    pub start_after_us: u32,
}

impl Go {
    /// How long the ordered flood lasts, nanoseconds (no overflow whatever the order says).
    pub fn flood_ns(&self) -> u128 {
        u128::from(pace_interval_ns(u32::from(self.payload) + FRAME_OVERHEAD, self.pace_bps)) * u128::from(self.count)
    }
}

/// A sender's report after its flood (sent several times, after the buffer drained).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct End {
    pub sender: u16,
    pub round: u16,
    /// Data datagrams sent.
    pub sent: u32,
    /// Send time of the last one (UNIX nanoseconds, sender's clock).
    pub last_send_ns: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeMessage {
    Go(Go),
    Calib(Stamp),
    Data(Stamp),
    End(End),
    /// The receiver's check that a sender is there (and the paths' addresses resolved)
    /// before a flood, and the sender's answer.
    Ping(Stamp),
    Pong(Stamp),
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    #[error("probe datagram of {0} bytes is shorter than its {HEADER_LEN}-byte header")]
    Short(usize),
    #[error("not a probe datagram (magic {0:02x?})")]
    Magic([u8; 4]),
    #[error("probe datagram version {0}, this build speaks {VERSION}")]
    Version(u8),
    #[error("probe datagram of unknown kind {0}")]
    Kind(u8),
    #[error("GO datagram of {0} bytes, want {GO_LEN}")]
    GoLength(usize),
    #[error("GO asks for {0}-byte datagrams: {HEADER_LEN} to {MAX_PAYLOAD}")]
    PayloadSize(u16),
}

/// Length of a GO datagram.
pub const GO_LEN: usize = HEADER_LEN + 18;

impl ProbeMessage {
    /// The datagram of this message. Calibration and data datagrams are padded to
    /// `payload` bytes (at least the header).
    pub fn encode(&self, payload: u16) -> Vec<u8> {
        let mut b = Vec::with_capacity(usize::from(payload).max(GO_LEN));
        b.extend_from_slice(&MAGIC);
        b.push(VERSION);
        let (kind, sender, round, seq, ns) = match *self {
            ProbeMessage::Go(g) => (KIND_GO, g.sender, g.round, g.count, g.pace_bps),
            ProbeMessage::Calib(s) => (KIND_CALIB, s.sender, s.round, s.seq, s.send_ns),
            ProbeMessage::Data(s) => (KIND_DATA, s.sender, s.round, s.seq, s.send_ns),
            ProbeMessage::End(e) => (KIND_END, e.sender, e.round, e.sent, e.last_send_ns),
            ProbeMessage::Ping(s) => (KIND_PING, s.sender, s.round, s.seq, s.send_ns),
            ProbeMessage::Pong(s) => (KIND_PONG, s.sender, s.round, s.seq, s.send_ns),
        };
        b.push(kind);
        b.extend_from_slice(&sender.to_be_bytes());
        b.extend_from_slice(&round.to_be_bytes());
        b.extend_from_slice(&seq.to_be_bytes());
        b.extend_from_slice(&ns.to_be_bytes());
        match *self {
            ProbeMessage::Go(g) => {
                b.extend_from_slice(&g.payload.to_be_bytes());
                b.extend_from_slice(&g.start_after_us.to_be_bytes());
                b.resize(GO_LEN, 0);
            }
            ProbeMessage::Calib(_) | ProbeMessage::Data(_) => b.resize(usize::from(payload).max(HEADER_LEN), 0),
            ProbeMessage::End(_) | ProbeMessage::Ping(_) | ProbeMessage::Pong(_) => {}
        }
        b
    }

    /// Checks and decodes one datagram; the padding of data datagrams is not read.
    pub fn decode(b: &[u8]) -> Result<ProbeMessage, ProbeError> {
        if b.len() < HEADER_LEN {
            return Err(ProbeError::Short(b.len()));
        }
        let magic: [u8; 4] = b[..4].try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(ProbeError::Magic(magic));
        }
        if b[4] != VERSION {
            return Err(ProbeError::Version(b[4]));
        }
        let u16_at = |i: usize| u16::from_be_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_be_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_be_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let (sender, round, seq, ns) = (u16_at(6), u16_at(8), u32_at(10), u64_at(14));
        let stamp = Stamp { sender, round, seq, send_ns: ns };
        Ok(match b[5] {
            KIND_GO => {
                if b.len() != GO_LEN {
                    return Err(ProbeError::GoLength(b.len()));
                }
                let payload = u16_at(HEADER_LEN);
                if !(HEADER_LEN as u16..=MAX_PAYLOAD).contains(&payload) {
                    return Err(ProbeError::PayloadSize(payload));
                }
                ProbeMessage::Go(Go {
                    sender,
                    round,
                    payload,
                    count: seq,
                    pace_bps: ns,
                    start_after_us: u32_at(HEADER_LEN + 2),
                })
            }
            KIND_CALIB => ProbeMessage::Calib(stamp),
            KIND_DATA => ProbeMessage::Data(stamp),
            KIND_END => ProbeMessage::End(End { sender, round, sent: seq, last_send_ns: ns }),
            KIND_PING => ProbeMessage::Ping(stamp),
            KIND_PONG => ProbeMessage::Pong(stamp),
            k => return Err(ProbeError::Kind(k)),
        })
    }
}

/// Nanoseconds between two datagrams of `frame_bytes` paced at `pace_bps`.
pub fn pace_interval_ns(frame_bytes: u32, pace_bps: u64) -> u64 {
    (u64::from(frame_bytes) * 8 * 1_000_000_000).div_ceil(pace_bps.max(1))
}

/// One datagram as the receiver got it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arrival {
    pub sender: u16,
    pub seq: u32,
    /// Sender's clock, UNIX nanoseconds.
    pub send_ns: u64,
    /// Receiver's clock (kernel receive timestamp), UNIX nanoseconds.
    pub arrival_ns: u64,
    /// Ethernet frame length as the switch queue counts it (payload + [`FRAME_OVERHEAD`]).
    pub frame_bytes: u32,
}

impl Arrival {
    /// A received datagram's stamp, its arrival time, and its frame length on the wire from
    /// the UDP payload length.
    pub fn of(stamp: Stamp, arrival_ns: u64, payload_bytes: usize) -> Arrival {
        Arrival {
            sender: stamp.sender,
            seq: stamp.seq,
            send_ns: stamp.send_ns,
            arrival_ns,
            frame_bytes: (payload_bytes as u32).saturating_add(FRAME_OVERHEAD),
        }
    }
}

/// Per sender, the smallest arrival-minus-send time of its calibration datagrams: the path
/// delay with empty queues plus the offset between its clock and the receiver's.
pub fn base_delays(calibration: &[Arrival]) -> BTreeMap<u16, i64> {
    let mut base: BTreeMap<u16, i64> = BTreeMap::new();
    for a in calibration {
        // Times come from the network: clamped, never overflowing.
        let d = (i128::from(a.arrival_ns) - i128::from(a.send_ns)).clamp(i64::MIN.into(), i64::MAX.into()) as i64;
        base.entry(a.sender).and_modify(|m| *m = (*m).min(d)).or_insert(d);
    }
    base
}

/// What one flood says about the buffer.
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct FloodEstimate {
    /// Ethernet frame length of the flood's datagrams.
    pub frame_bytes: u32,
    /// Data datagrams sent, and received.
    pub sent: u64,
    pub received: u64,
    /// Accepted datagrams that came while the port dropped (the sample of the estimate).
    pub saturated: u64,
    /// Median buffer occupancy met by those datagrams, counting themselves: in packets and
    /// in bytes.
    pub packets: u32,
    pub bytes: u64,
    /// The same, 10th and 90th percentiles (a sharp buffer gives a narrow spread).
    pub packets_p10: u32,
    pub packets_p90: u32,
    /// The rate the port drained at while it dropped, bits per second of frames (the
    /// port's rate, measured).
    pub drain_bps: u64,
    /// From the first to the last datagram sent, milliseconds (the flood, as it happened).
    pub flood_ms: f64,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AnalysisError {
    #[error("no calibration datagram arrived from sender {0}: its path delay is unknown")]
    NoCalibration(u16),
    #[error("no datagram was lost: the flood never filled the buffer (flood longer or with more senders)")]
    NoLoss,
    #[error("only {0} datagrams arrived while the port dropped: too few to estimate (flood longer)")]
    TooFewSaturated(u64),
}

/// The buffer estimate of one flood. `data` are the data datagrams received (any order);
/// `base` from [`base_delays`]; `ends` the senders' reports (what each sent, when it sent
/// its last).
pub fn analyse_flood(
    data: &[Arrival],
    base: &BTreeMap<u16, i64>,
    ends: &BTreeMap<u16, End>,
) -> Result<FloodEstimate, AnalysisError> {
    let mut by_arrival: Vec<Arrival> = data.to_vec();
    by_arrival.sort_by_key(|a| (a.arrival_ns, a.sender, a.seq));
    for a in &by_arrival {
        if !base.contains_key(&a.sender) {
            return Err(AnalysisError::NoCalibration(a.sender));
        }
    }
    // Enqueue time at the switch, in the receiver's clock.
    let enqueued = |a: &Arrival| i128::from(a.send_ns) + i128::from(base[&a.sender]);
    // The stretch in which the port dropped: from the first to the last lost datagram, each
    // placed between the datagrams of its sender that arrived around it.
    let mut per_sender: BTreeMap<u16, Vec<&Arrival>> = BTreeMap::new();
    for a in &by_arrival {
        per_sender.entry(a.sender).or_default().push(a);
    }
    let mut first_loss = i128::MAX;
    let mut last_loss = i128::MIN;
    let mut note_loss = |t: i128| {
        first_loss = first_loss.min(t);
        last_loss = last_loss.max(t);
    };
    let senders: std::collections::BTreeSet<u16> = per_sender.keys().chain(ends.keys()).copied().collect();
    for s in senders {
        let mut got = per_sender.remove(&s).unwrap_or_default();
        got.sort_by_key(|a| a.seq);
        got.dedup_by_key(|a| a.seq);
        // A gap lies between the datagrams around it; a lost tail between the last one
        // that arrived and the sender's last send.
        let mut expected = 0u32;
        let mut previous: Option<i128> = None;
        for a in &got {
            if a.seq > expected {
                previous.into_iter().for_each(&mut note_loss);
                note_loss(enqueued(a));
            }
            expected = a.seq.saturating_add(1);
            previous = Some(enqueued(a));
        }
        if let (Some(end), Some(&b)) = (ends.get(&s), base.get(&s))
            && end.sent > expected
        {
            previous.into_iter().for_each(&mut note_loss);
            note_loss(i128::from(end.last_send_ns) + i128::from(b));
        }
    }
    if first_loss > last_loss {
        return Err(AnalysisError::NoLoss);
    }
    // Prefix sums of frame bytes in arrival order: bytes that arrived in an interval.
    let mut prefix = Vec::with_capacity(by_arrival.len() + 1);
    prefix.push(0u64);
    for a in &by_arrival {
        prefix.push(prefix.last().expect("non-empty") + u64::from(a.frame_bytes));
    }
    let mut packets = Vec::new();
    let mut bytes = Vec::new();
    for (i, a) in by_arrival.iter().enumerate() {
        let t = enqueued(a);
        if t < first_loss || t > last_loss {
            continue;
        }
        // Datagrams that left the buffer after this one came were ahead of it (FIFO).
        let first_after = by_arrival.partition_point(|b| i128::from(b.arrival_ns) <= t).min(i);
        packets.push((i - first_after) as u32 + 1);
        bytes.push(prefix[i] - prefix[first_after] + u64::from(a.frame_bytes));
    }
    if packets.len() < 20 {
        return Err(AnalysisError::TooFewSaturated(packets.len() as u64));
    }
    let in_window = |a: &&Arrival| (first_loss..=last_loss).contains(&i128::from(a.arrival_ns));
    let window_bytes: u64 = by_arrival.iter().filter(in_window).map(|a| u64::from(a.frame_bytes)).sum();
    let drain_bps = (window_bytes as f64 * 8e9 / (last_loss - first_loss).max(1) as f64) as u64;
    let sends = by_arrival.iter().map(|a| a.send_ns).chain(ends.values().map(|e| e.last_send_ns));
    let (first_send, last_send) = sends.fold((u64::MAX, 0), |(lo, hi), t| (lo.min(t), hi.max(t)));
    let received = by_arrival.len() as u64;
    let sent = ends.values().map(|e| u64::from(e.sent)).sum::<u64>().max(received);
    let frame_bytes = median(&mut by_arrival.iter().map(|a| a.frame_bytes).collect::<Vec<_>>());
    let saturated = packets.len() as u64;
    Ok(FloodEstimate {
        frame_bytes,
        sent,
        received,
        saturated,
        packets: median(&mut packets.clone()),
        bytes: median(&mut bytes),
        packets_p10: percentile(&mut packets.clone(), 10),
        packets_p90: percentile(&mut packets, 90),
        drain_bps,
        flood_ms: last_send.saturating_sub(first_send) as f64 / 1e6,
    })
}

fn percentile<T: Copy + Ord>(v: &mut [T], p: usize) -> T {
    v.sort_unstable();
    v[(v.len() - 1) * p / 100]
}

fn median<T: Copy + Ord>(v: &mut [T]) -> T {
    percentile(v, 50)
}

/// What limits the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize), serde(rename_all = "lowercase"))]
pub enum BufferLimit {
    Packets,
    Bytes,
}

/// The probe's answer from a flood of large and one of small datagrams.
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct BufferVerdict {
    pub limit: BufferLimit,
    /// The buffer in packets (for a byte limit: of the large frames).
    pub packets: u32,
    /// The buffer in bytes (for a packet limit: of the large frames).
    pub bytes: u64,
    pub large: FloodEstimate,
    pub small: FloodEstimate,
}

/// A packet limit holds as many small as large datagrams; a byte limit as many bytes.
/// Whichever ratio is nearer one names the limit.
pub fn classify(large: FloodEstimate, small: FloodEstimate) -> BufferVerdict {
    let off_one = |a: f64, b: f64| (a.max(1.0) / b.max(1.0)).ln().abs();
    let packet_spread = off_one(f64::from(small.packets), f64::from(large.packets));
    let byte_spread = off_one(small.bytes as f64, large.bytes as f64);
    if packet_spread <= byte_spread {
        BufferVerdict {
            limit: BufferLimit::Packets,
            packets: (large.packets + small.packets).div_ceil(2),
            bytes: large.bytes,
            large,
            small,
        }
    } else {
        // The finer grain of the small datagrams comes nearer the limit from below.
        BufferVerdict {
            limit: BufferLimit::Bytes,
            packets: large.packets,
            bytes: large.bytes.max(small.bytes),
            large,
            small,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_message_round_trips_and_bad_datagrams_are_refused() {
        let stamp = Stamp { sender: 3, round: 9, seq: 77, send_ns: 1_700_000_000_123_456_789 };
        let go = Go { sender: 2, round: 1, payload: 200, count: 4000, pace_bps: 20_000_000, start_after_us: 80_000 };
        let end = End { sender: 1, round: 2, sent: 999, last_send_ns: 5 };
        for (m, payload) in [
            (ProbeMessage::Data(stamp), 1472u16),
            (ProbeMessage::Calib(stamp), 200),
            (ProbeMessage::Go(go), 0),
            (ProbeMessage::End(end), 0),
            (ProbeMessage::Ping(stamp), 0),
            (ProbeMessage::Pong(stamp), 0),
        ] {
            let b = m.encode(payload);
            if let ProbeMessage::Data(_) = m {
                assert_eq!(b.len(), 1472);
            }
            assert_eq!(ProbeMessage::decode(&b), Ok(m));
        }
        let good = ProbeMessage::Data(stamp).encode(100);
        assert_eq!(ProbeMessage::decode(&good[..10]), Err(ProbeError::Short(10)));
        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(matches!(ProbeMessage::decode(&bad), Err(ProbeError::Magic(_))));
        let mut bad = good.clone();
        bad[4] = 9;
        assert_eq!(ProbeMessage::decode(&bad), Err(ProbeError::Version(9)));
        let mut bad = good;
        bad[5] = 0;
        assert_eq!(ProbeMessage::decode(&bad), Err(ProbeError::Kind(0)));
        let mut go_bytes = ProbeMessage::Go(Go { payload: 9000, ..go }).encode(0);
        assert_eq!(ProbeMessage::decode(&go_bytes), Err(ProbeError::PayloadSize(9000)));
        go_bytes.push(0);
        assert_eq!(ProbeMessage::decode(&go_bytes), Err(ProbeError::GoLength(GO_LEN + 1)));
    }

    /// A switch port: a drop-tail buffer in front of a link that releases one frame per
    /// frame time (what tc's tbf does with its child queue). Returns what the receiver gets.
    struct Port {
        limit: BufferLimit,
        size: u64,
        ns_per_byte: f64,
    }

    /// Floods the port from `senders` senders, each pacing `count` frames of `frame` bytes
    /// at the port's rate, starting `skew_ns * i` late; sender i's clock is `clock_ns[i]`
    /// off the receiver's and its path `path_ns` long. Calibration datagrams go first.
    fn flood(port: &Port, senders: u16, frame: u32, count: u32, skew_ns: u64, clock_ns: &[i64]) -> FloodEstimate {
        let path_ns = 30_000i64;
        // Wall clocks in UNIX nanoseconds (2023 here), as the datagrams carry them.
        let epoch = 1_700_000_000_000_000_000u64;
        let interval = (f64::from(frame) * port.ns_per_byte) as u64;
        // (enqueue time in receiver clock, sender, seq, send time in sender clock)
        let mut offered = Vec::new();
        let mut calibration = Vec::new();
        for s in 0..senders {
            let off = clock_ns[usize::from(s) % clock_ns.len()];
            for k in 0..5u64 {
                // Spaced calibration datagrams on an idle port: only the path delay.
                let t = epoch + 1_000_000 + k * 2_000_000 + u64::from(s) * 100_000;
                calibration.push(Arrival {
                    sender: s,
                    seq: k as u32,
                    send_ns: (t as i64 + off) as u64,
                    arrival_ns: t + path_ns as u64,
                    frame_bytes: frame,
                });
            }
            for seq in 0..count {
                let t = epoch + 50_000_000 + u64::from(s) * skew_ns + u64::from(seq) * interval;
                offered.push((t, s, seq, (t as i64 + off) as u64));
            }
        }
        offered.sort();
        let mut queue: std::collections::VecDeque<(u64, u16, u32, u64)> = Default::default();
        let mut link_free = 0u64;
        let mut released: Vec<Arrival> = Vec::new();
        let mut release_until = |queue: &mut std::collections::VecDeque<(u64, u16, u32, u64)>, now: u64| {
            while let Some(&(t, s, seq, send)) = queue.front() {
                let at = link_free.max(t) + interval;
                if at > now {
                    break;
                }
                link_free = at;
                queue.pop_front();
                released.push(Arrival {
                    sender: s,
                    seq,
                    send_ns: send,
                    arrival_ns: at + path_ns as u64,
                    frame_bytes: frame,
                });
            }
        };
        for &(t, s, seq, send) in &offered {
            release_until(&mut queue, t);
            let fits = match port.limit {
                BufferLimit::Packets => (queue.len() as u64) < port.size,
                BufferLimit::Bytes => (queue.len() as u64 + 1) * u64::from(frame) <= port.size,
            };
            if fits {
                queue.push_back((t, s, seq, send));
            }
        }
        release_until(&mut queue, u64::MAX);
        let ends = (0..senders)
            .map(|s| {
                let last = offered.iter().filter(|o| o.1 == s).map(|o| o.3).max().unwrap();
                (s, End { sender: s, round: 0, sent: count, last_send_ns: last })
            })
            .collect();
        analyse_flood(&released, &base_delays(&calibration), &ends).unwrap()
    }

    #[test]
    fn a_packet_buffer_holds_as_many_small_as_large_datagrams() {
        let port = Port { limit: BufferLimit::Packets, size: 100, ns_per_byte: 400.0 };
        let large = flood(&port, 3, 1514, 600, 150_000, &[0, 4_000_000, -7_000_000]);
        let small = flood(&port, 3, 242, 3000, 150_000, &[0, 4_000_000, -7_000_000]);
        assert_eq!((large.packets, small.packets), (100, 100), "{large:?} {small:?}");
        let v = classify(large, small);
        assert_eq!((v.limit, v.packets), (BufferLimit::Packets, 100));
    }

    #[test]
    fn a_byte_buffer_holds_as_many_bytes_of_small_as_of_large_datagrams() {
        let port = Port { limit: BufferLimit::Bytes, size: 108_000, ns_per_byte: 400.0 };
        let large = flood(&port, 4, 1514, 600, 0, &[0]);
        let small = flood(&port, 4, 242, 3000, 0, &[0]);
        assert_eq!((large.packets, small.packets), (71, 446), "{large:?} {small:?}");
        let v = classify(large, small);
        assert_eq!(v.limit, BufferLimit::Bytes);
        assert_eq!(v.bytes, 446 * 242);
        assert!((108_000 - v.bytes) < 242);
    }

    #[test]
    fn a_flood_that_never_fills_the_buffer_says_so() {
        let port = Port { limit: BufferLimit::Packets, size: 10_000, ns_per_byte: 400.0 };
        let mut calibration = Vec::new();
        let mut data = Vec::new();
        for seq in 0..50 {
            let a = Arrival { sender: 0, seq, send_ns: 1000 * u64::from(seq), arrival_ns: 0, frame_bytes: 1514 };
            calibration.push(Arrival { arrival_ns: a.send_ns + 10, ..a });
            data.push(Arrival { arrival_ns: a.send_ns + 10 + (port.ns_per_byte as u64), ..a });
        }
        let ends = [(0, End { sender: 0, round: 0, sent: 50, last_send_ns: 49_000 })].into();
        assert_eq!(analyse_flood(&data, &base_delays(&calibration), &ends), Err(AnalysisError::NoLoss));
        assert_eq!(analyse_flood(&data, &BTreeMap::new(), &ends), Err(AnalysisError::NoCalibration(0)));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// Whatever the buffer, the number of senders, their start skew and clock offsets,
        /// the estimate is the buffer (in frames of the flood's size) and the verdict names
        /// the limit.
        #[test]
        fn the_estimate_is_the_buffer_whatever_the_senders(
            by_bytes in any::<bool>(),
            packets in 20u64..400,
            senders in 2u16..6,
            skew_us in 0u64..2_000,
            offsets in proptest::collection::vec(-50_000_000i64..50_000_000, 1..4),
        ) {
            let (limit, size) = if by_bytes { (BufferLimit::Bytes, packets * 1000) } else { (BufferLimit::Packets, packets) };
            let port = Port { limit, size, ns_per_byte: 80.0 };
            let count = (packets as u32 * 10).max(400);
            let large = flood(&port, senders, 1514, count, skew_us * 1000, &offsets);
            let small = flood(&port, senders, 242, count * 6, skew_us * 1000, &offsets);
            let v = classify(large, small);
            prop_assert_eq!(v.limit, limit);
            match limit {
                BufferLimit::Packets => prop_assert_eq!(v.packets as u64, packets),
                BufferLimit::Bytes => prop_assert!(size - v.bytes < 242, "{:?}", v),
            }
        }
    }
}
