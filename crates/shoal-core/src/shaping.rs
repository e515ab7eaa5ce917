//! Traffic shaping: when a source hands which fragment to which builder.
//!
//! A policy is a sans-IO state machine behind the [`Shaper`] trait. The driver (runtime or
//! simulator) feeds it finished fragments ([`Shaper::handle_fragment`]), transport
//! completions ([`Shaper::handle_sent`]) and, for credit-based pull policies, requests from
//! builders ([`Shaper::handle_request`]); it drains [`Transmit`]s with
//! [`Shaper::poll_transmit`] and sleeps until [`Shaper::poll_timeout`]. The shaper never
//! holds fragment bytes: it works on `(slice, length)` descriptors and tells the driver
//! which byte range of which fragment to write to which builder.
//!
//! Policies (domain.md section 3):
//! - [`Direct`]: send every fragment as soon as its slice ends.
//! - [`Delayed`] (barrel shifting): source `i` delays its fragments by `i div k` slices, so
//!   in steady state each builder receives from at most `k` sources per slot. One fragment
//!   is in flight at a time; a fragment that overruns its slot makes the source fall behind
//!   and catch up later (the default answer to variable data rates).
//! - [`TokenBucket`]: a token bucket per destination (like Linux `tc tbf`), sending in
//!   chunks of at most `burst` bytes.
//! - [`Pull`] (credit-based pull): the source holds each fragment until the builder its
//!   slice was assigned to asks for it ([`Shaper::handle_request`]), and evicts fragments
//!   nobody asked for after [`PullConfig::hold_slices`] ([`Shaper::poll_evicted`]). The
//!   builder's side is [`crate::node::PullRequester`], the assignment
//!   [`crate::node::DataFlowManager`]; all three share one [`PullConfig`]. With a rate, the
//!   answers leave through the same token buckets as [`TokenBucket`]'s.
//!
//! [`BurstCutoff`] is an optional stage in front of any policy: during a burst it keeps the
//! first `head` and last `tail` fragments and cuts the rest.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::str::FromStr;

use crate::slice::{SliceNumber, builder_for};
use crate::{BuilderId, Duration, Instant, SourceId};

/// A finished fragment offered to the shaper.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outgoing {
    pub slice: SliceNumber,
    /// Length on the wire (header + payload), in bytes.
    pub len: u64,
}

/// An instruction to the transport: write `len` bytes starting at `offset` of the fragment
/// of `slice` to builder `dest`. `last` marks the final piece of that fragment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transmit {
    pub dest: BuilderId,
    pub slice: SliceNumber,
    pub offset: u64,
    pub len: u64,
    pub last: bool,
}

/// A request from a builder for the fragment of a slice (credit-based pull).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PullRequest {
    pub builder: BuilderId,
    pub slice: SliceNumber,
}

/// What a shaper needs to know about its source and the farm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShaperContext {
    pub source: SourceId,
    pub n_builders: u32,
}

/// A traffic-shaping policy for one source.
pub trait Shaper: Send + fmt::Debug {
    /// The fragment of a slice that just ended is ready.
    fn handle_fragment(&mut self, now: Instant, frag: Outgoing);
    /// A builder asks for a fragment (pull policies). Push policies ignore requests.
    fn handle_request(&mut self, _now: Instant, _req: PullRequest) {}
    /// The transport has accepted the last byte of the fragment of `slice`.
    fn handle_sent(&mut self, now: Instant, slice: SliceNumber);
    /// A slot (slice) ended without a new fragment for this shaper, e.g. after the end of
    /// data taking: schedule-driven policies advance as if it had come, so a barrel shifter
    /// keeps its schedule instead of releasing its backlog at once.
    fn handle_slot_end(&mut self, _now: Instant, _slice: SliceNumber) {}
    /// No more fragments and no more slots: release what is held as soon as allowed
    /// (e.g. at a drain timeout).
    fn handle_drain(&mut self, now: Instant);
    /// The next piece to hand to the transport, if any is allowed at `now`.
    fn poll_transmit(&mut self, now: Instant) -> Option<Transmit>;
    /// When `poll_transmit` may next yield without further input (`None`: only inputs).
    fn poll_timeout(&self) -> Option<Instant>;
    /// Fragments accepted but not yet completely handed out by `poll_transmit`.
    fn queued(&self) -> usize;
    /// A fragment the policy gave up on without sending it (pull: held past its hold time,
    /// never requested). The node counts it and forgets it.
    fn poll_evicted(&mut self) -> Option<SliceNumber> {
        None
    }
}

/// Delayed transmission's window when the text form gives none (`delayed:K`).
pub const DELAYED_WINDOW: u32 = 1;

/// The policy of a run, as chosen on the command line or in a configuration file.
///
/// Text form: `direct`, `delayed:K[:W]`, `tbf:RATE[:BURST]` where RATE is bytes per second
/// (suffixes `k`, `M`, `G`; append `bit` for bits, e.g. `tbf:40Mbit`) and BURST bytes,
/// `pull:CREDITS[:cap=N][:timeout=DUR][:reasks=N][:hold=N][:rate=RATE[:burst=BURST]]` (see
/// [`PullConfig`]; DUR such as `50ms`, `200us`, `1s`; `rate`: sources answer requests
/// through a token bucket per builder, as `tbf`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Policy {
    Direct,
    /// `window`: most fragments of one source being written at a time (at least 1).
    Delayed {
        k: u32,
        window: u32,
    },
    TokenBucket {
        rate_bytes_per_s: u64,
        burst_bytes: u64,
    },
    Pull(PullConfig),
}

/// Credit-based pull: what the data-flow manager, the builders and the sources share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PullConfig {
    /// Slices a builder may hold assigned and not yet processed (its credits).
    pub credits: u32,
    /// Most fragment requests one builder keeps outstanding at a time, across its slices
    /// (the ATLAS "traffic shaping parameter"); 0: no cap (credits x sources).
    pub request_cap: u32,
    /// A request still unanswered after this long is asked again.
    pub reask_timeout: Duration,
    /// Re-asks per request before the builder gives that fragment up (the slice is then
    /// processed without it).
    pub max_reasks: u32,
    /// A source evicts a fragment nobody asked for once this many newer slices have
    /// ended (counted as never requested); this bounds a source's memory and how long a
    /// data-flow manager may be away without losing data.
    pub hold_slices: u32,
    /// A source answers requests through a token bucket per builder at this rate (pull
    /// combined with traffic shaping, as in the ATLAS studies); `None`: at once.
    pub answer_rate: Option<TokenRate>,
}

/// A token bucket's rate and depth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenRate {
    pub bytes_per_s: u64,
    pub burst_bytes: u64,
}

impl PullConfig {
    /// `credits` slices per builder; no request cap; re-ask after 100 ms, 3 times; hold
    /// 64 slices; answers unpaced.
    pub fn new(credits: u32) -> Self {
        Self {
            credits,
            request_cap: 0,
            reask_timeout: Duration::from_millis(100),
            max_reasks: 3,
            hold_slices: 64,
            answer_rate: None,
        }
    }
}

impl Policy {
    /// The pull parameters, for a pull policy.
    pub fn pull(&self) -> Option<PullConfig> {
        match self {
            Policy::Pull(p) => Some(*p),
            _ => None,
        }
    }
}

impl Policy {
    /// Builds the state machine for one source.
    pub fn build(&self, ctx: ShaperContext) -> Box<dyn Shaper> {
        match *self {
            Policy::Direct => Box::new(Direct::new(ctx)),
            Policy::Delayed { k, window } => Box::new(Delayed::with_window(ctx, k, window)),
            Policy::TokenBucket { rate_bytes_per_s, burst_bytes } => {
                Box::new(TokenBucket::new(ctx, rate_bytes_per_s, burst_bytes))
            }
            Policy::Pull(p) => Box::new(Pull::new(p.hold_slices, p.answer_rate)),
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::Direct => write!(f, "direct"),
            Policy::Delayed { k, window } if *window == DELAYED_WINDOW => write!(f, "delayed:{k}"),
            Policy::Delayed { k, window } => write!(f, "delayed:{k}:{window}"),
            Policy::TokenBucket { rate_bytes_per_s, burst_bytes } => {
                write!(f, "tbf:{rate_bytes_per_s}:{burst_bytes}")
            }
            Policy::Pull(p) => {
                let d = PullConfig::new(p.credits);
                write!(f, "pull:{}", p.credits)?;
                if p.request_cap != d.request_cap {
                    write!(f, ":cap={}", p.request_cap)?;
                }
                if p.reask_timeout != d.reask_timeout {
                    write!(f, ":timeout={}us", p.reask_timeout.as_micros())?;
                }
                if p.max_reasks != d.max_reasks {
                    write!(f, ":reasks={}", p.max_reasks)?;
                }
                if p.hold_slices != d.hold_slices {
                    write!(f, ":hold={}", p.hold_slices)?;
                }
                if let Some(r) = p.answer_rate {
                    write!(f, ":rate={}:burst={}", r.bytes_per_s, r.burst_bytes)?;
                }
                Ok(())
            }
        }
    }
}

/// Why a policy string is not valid.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid policy {input:?}: {reason} (expected direct, delayed:K, tbf:RATE[:BURST] or \
     pull:CREDITS[:cap=N][:timeout=DUR][:reasks=N][:hold=N][:rate=RATE[:burst=BURST]])"
)]
pub struct PolicyParseError {
    input: String,
    reason: &'static str,
}

/// Parses `250us`, `50ms`, `1.5s` into a duration.
fn parse_duration(s: &str) -> Option<Duration> {
    let (num, scale) = if let Some(n) = s.strip_suffix("us") {
        (n, 1e3)
    } else if let Some(n) = s.strip_suffix("ms") {
        (n, 1e6)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1e9)
    } else {
        return None;
    };
    let v: f64 = num.parse().ok()?;
    let ns = v * scale;
    (1.0..1e15).contains(&ns).then(|| Duration::from_nanos(ns as u64))
}

/// Parses `12`, `1.5k`, `40M`, `40Mbit`, `1G` into bytes (per second).
fn parse_quantity(s: &str) -> Option<u64> {
    let (s, bits) = match s.strip_suffix("bit") {
        Some(rest) => (rest, true),
        None => (s.strip_suffix('B').unwrap_or(s), false),
    };
    let (num, mult) = match s.chars().last()? {
        'k' | 'K' => (&s[..s.len() - 1], 1e3),
        'M' => (&s[..s.len() - 1], 1e6),
        'G' => (&s[..s.len() - 1], 1e9),
        _ => (s, 1.0),
    };
    let v: f64 = num.parse().ok()?;
    let v = v * mult / if bits { 8.0 } else { 1.0 };
    (v.is_finite() && v >= 1.0 && v < u64::MAX as f64).then_some(v as u64)
}

impl FromStr for Policy {
    type Err = PolicyParseError;
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let err = |reason| PolicyParseError { input: input.to_string(), reason };
        let mut parts = input.trim().split(':');
        match parts.next().unwrap_or("") {
            "direct" if parts.next().is_none() => Ok(Policy::Direct),
            "delayed" => {
                let k: u32 = parts.next().ok_or(err("missing K"))?.parse().map_err(|_| err("K is not a number"))?;
                if k == 0 {
                    return Err(err("K must be at least 1"));
                }
                let window = match parts.next() {
                    Some(w) => w.parse().map_err(|_| err("W is not a number"))?,
                    None => DELAYED_WINDOW,
                };
                if window == 0 {
                    return Err(err("W must be at least 1"));
                }
                if parts.next().is_some() {
                    return Err(err("trailing text"));
                }
                Ok(Policy::Delayed { k, window })
            }
            "tbf" => {
                let rate = parse_quantity(parts.next().ok_or(err("missing RATE"))?).ok_or(err("bad RATE"))?;
                let burst = match parts.next() {
                    Some(b) => parse_quantity(b).ok_or(err("bad BURST"))?,
                    None => default_burst(rate),
                };
                if parts.next().is_some() {
                    return Err(err("trailing text"));
                }
                Ok(Policy::TokenBucket { rate_bytes_per_s: rate, burst_bytes: burst })
            }
            "pull" => {
                let credits: u32 =
                    parts.next().ok_or(err("missing CREDITS"))?.parse().map_err(|_| err("CREDITS is not a number"))?;
                if credits == 0 {
                    return Err(err("CREDITS must be at least 1"));
                }
                let mut p = PullConfig::new(credits);
                let (mut rate, mut burst) = (None, None);
                for part in parts {
                    let (key, value) = part.split_once('=').ok_or(err("expected key=value after CREDITS"))?;
                    let number = || value.parse::<u32>().map_err(|_| err("not a number"));
                    match key {
                        "cap" => p.request_cap = number()?,
                        "reasks" => p.max_reasks = number()?,
                        "hold" => p.hold_slices = number()?.max(1),
                        "timeout" => p.reask_timeout = parse_duration(value).ok_or(err("bad timeout"))?,
                        "rate" => rate = Some(parse_quantity(value).ok_or(err("bad rate"))?),
                        "burst" => burst = Some(parse_quantity(value).ok_or(err("bad burst"))?),
                        _ => return Err(err("unknown pull parameter (cap, timeout, reasks, hold, rate, burst)")),
                    }
                }
                p.answer_rate = match (rate, burst) {
                    (Some(r), b) => {
                        Some(TokenRate { bytes_per_s: r, burst_bytes: b.unwrap_or_else(|| default_burst(r)) })
                    }
                    (None, Some(_)) => return Err(err("burst without rate")),
                    (None, None) => None,
                };
                Ok(Policy::Pull(p))
            }
            _ => Err(err("unknown policy")),
        }
    }
}

/// Default token-bucket depth: one millisecond at the rate, at least one jumbo frame.
pub fn default_burst(rate_bytes_per_s: u64) -> u64 {
    (rate_bytes_per_s / 1000).max(9000)
}

fn whole(dest: BuilderId, frag: Outgoing) -> Transmit {
    Transmit { dest, slice: frag.slice, offset: 0, len: frag.len, last: true }
}

/// Sends every fragment as soon as its slice ends.
#[derive(Debug)]
pub struct Direct {
    ctx: ShaperContext,
    ready: VecDeque<Transmit>,
}

impl Direct {
    pub fn new(ctx: ShaperContext) -> Self {
        Self { ctx, ready: VecDeque::new() }
    }
}

impl Shaper for Direct {
    fn handle_fragment(&mut self, _now: Instant, frag: Outgoing) {
        self.ready.push_back(whole(builder_for(frag.slice, self.ctx.n_builders), frag));
    }
    fn handle_sent(&mut self, _now: Instant, _slice: SliceNumber) {}
    fn handle_drain(&mut self, _now: Instant) {}
    fn poll_transmit(&mut self, _now: Instant) -> Option<Transmit> {
        self.ready.pop_front()
    }
    fn poll_timeout(&self) -> Option<Instant> {
        None
    }
    fn queued(&self) -> usize {
        self.ready.len()
    }
}

/// Delayed transmission (barrel shifting) with fall-behind.
#[derive(Debug)]
pub struct Delayed {
    ctx: ShaperContext,
    delay: u64,
    fifo: VecDeque<Outgoing>,
    latest: Option<SliceNumber>,
    /// Fragments handed out and not yet reported sent (at most `window`, in slice order).
    in_flight: VecDeque<SliceNumber>,
    window: usize,
    draining: bool,
}

impl Delayed {
    /// `k`: sources per builder per slot (at least 1; 0 is treated as 1); one fragment
    /// in flight at a time.
    pub fn new(ctx: ShaperContext, k: u32) -> Self {
        Self::with_window(ctx, k, 1)
    }

    /// As [`Delayed::new`] with up to `window` fragments in flight (0 is treated as 1).
    pub fn with_window(ctx: ShaperContext, k: u32, window: u32) -> Self {
        let delay = u64::from(ctx.source / k.max(1));
        let window = window.max(1) as usize;
        Self { ctx, delay, fifo: VecDeque::new(), latest: None, in_flight: VecDeque::new(), window, draining: false }
    }

    /// This source's delay in slices (`source div k`).
    pub fn delay_slices(&self) -> u64 {
        self.delay
    }
}

impl Shaper for Delayed {
    fn handle_fragment(&mut self, _now: Instant, frag: Outgoing) {
        self.latest = Some(self.latest.map_or(frag.slice, |l| l.max(frag.slice)));
        self.fifo.push_back(frag);
    }
    fn handle_sent(&mut self, _now: Instant, slice: SliceNumber) {
        if let Some(i) = self.in_flight.iter().position(|&s| s == slice) {
            self.in_flight.remove(i);
        }
    }
    fn handle_slot_end(&mut self, _now: Instant, slice: SliceNumber) {
        self.latest = Some(self.latest.map_or(slice, |l| l.max(slice)));
    }
    fn handle_drain(&mut self, _now: Instant) {
        self.draining = true;
    }
    fn poll_transmit(&mut self, _now: Instant) -> Option<Transmit> {
        if self.in_flight.len() >= self.window {
            return None; // falling behind: the previous fragments still occupy the link
        }
        let front = *self.fifo.front()?;
        let latest = self.latest.unwrap_or(front.slice);
        let due = self.draining || latest.saturating_sub(front.slice) >= self.delay;
        if !due {
            return None;
        }
        self.fifo.pop_front();
        self.in_flight.push_back(front.slice);
        Some(whole(builder_for(front.slice, self.ctx.n_builders), front))
    }
    fn poll_timeout(&self) -> Option<Instant> {
        None
    }
    fn queued(&self) -> usize {
        self.fifo.len()
    }
}

/// One token bucket per destination builder.
///
/// Tokens are kept as byte-nanoseconds-per-second (`bytes * 1e9`) in integers so the
/// long-run rate is exact. A bucket starts full. A fragment is sent in chunks of at most
/// `burst` bytes, each chunk waiting until the bucket holds its size. With several chunks
/// queued for one destination, they wait until the bucket holds as many of them as its
/// depth allows and go together: one wake-up per batch instead of one per chunk (a busy
/// source at 1 Gbit/s with 9,000-byte fragments and the default 1-ms depth sends 13 at a
/// time), never more than the bucket holds, and a lone chunk goes as soon as it fits.
#[derive(Debug)]
pub struct TokenBucket {
    ctx: ShaperContext,
    pacer: Pacer,
}

impl TokenBucket {
    /// Panics if `rate` or `burst` is zero (validated by [`Policy`]'s parser).
    pub fn new(ctx: ShaperContext, rate_bytes_per_s: u64, burst_bytes: u64) -> Self {
        Self { ctx, pacer: Pacer::new(TokenRate { bytes_per_s: rate_bytes_per_s, burst_bytes }) }
    }
}

impl Shaper for TokenBucket {
    fn handle_fragment(&mut self, now: Instant, frag: Outgoing) {
        self.pacer.push(now, builder_for(frag.slice, self.ctx.n_builders), frag);
    }
    fn handle_sent(&mut self, _now: Instant, _slice: SliceNumber) {}
    fn handle_drain(&mut self, _now: Instant) {}
    fn poll_transmit(&mut self, now: Instant) -> Option<Transmit> {
        self.pacer.poll_transmit(now)
    }
    fn poll_timeout(&self) -> Option<Instant> {
        self.pacer.poll_timeout()
    }
    fn queued(&self) -> usize {
        self.pacer.queued()
    }
}

/// The token buckets of one source, one per destination: the pacing of [`TokenBucket`],
/// and of a [`Pull`] source's answers when its policy has a rate.
#[derive(Debug)]
struct Pacer {
    rate: u64,
    burst: u64,
    dests: BTreeMap<BuilderId, Bucket>,
    next_dest: BuilderId,
    queued: usize,
}

#[derive(Debug)]
struct Bucket {
    /// Tokens in units of 1e-9 byte.
    tokens: u128,
    updated: Instant,
    queue: VecDeque<(Outgoing, u64)>,
    /// A batch is going: its chunks need only their own tokens.
    releasing: bool,
}

const NANOS: u128 = 1_000_000_000;

impl Pacer {
    /// Panics if the rate or burst is zero (validated by [`Policy`]'s parser).
    fn new(rate: TokenRate) -> Self {
        assert!(rate.bytes_per_s > 0 && rate.burst_bytes > 0, "token bucket needs rate and burst");
        Self { rate: rate.bytes_per_s, burst: rate.burst_bytes, dests: BTreeMap::new(), next_dest: 0, queued: 0 }
    }

    fn push(&mut self, now: Instant, dest: BuilderId, frag: Outgoing) {
        let full = u128::from(self.burst) * NANOS;
        let b = self.dests.entry(dest).or_insert(Bucket {
            tokens: full,
            updated: now,
            queue: VecDeque::new(),
            releasing: false,
        });
        b.queue.push_back((frag, 0));
        self.queued += 1;
    }

    fn refill(&self, b: &mut Bucket, now: Instant) {
        if now > b.updated {
            let dt = u128::from((now - b.updated).as_nanos() as u64);
            b.tokens = (b.tokens + dt * u128::from(self.rate)).min(u128::from(self.burst) * NANOS);
            b.updated = now;
        }
    }

    fn chunk_len(&self, b: &Bucket) -> Option<u64> {
        b.queue.front().map(|(f, off)| (f.len - off).min(self.burst))
    }

    /// The bytes the front chunks that go together need: the queued fragments' chunks
    /// from the front, as many whole ones as the bucket's depth holds (at least one).
    fn batch_len(&self, b: &Bucket) -> Option<u64> {
        let mut need = 0;
        for (f, off) in &b.queue {
            let len = (f.len - off).min(self.burst);
            if need > 0 && need + len > self.burst {
                break;
            }
            need += len;
            if need >= self.burst {
                break;
            }
        }
        (need > 0).then_some(need)
    }

    /// Whether the front chunk may go: a batch under way needs the chunk's tokens, a new
    /// one the whole batch's.
    fn ready(&self, b: &Bucket) -> Option<u64> {
        let len = self.chunk_len(b)?;
        let need = if b.releasing { len } else { self.batch_len(b)? };
        (b.tokens >= u128::from(need) * NANOS).then_some(len)
    }

    fn poll_transmit(&mut self, now: Instant) -> Option<Transmit> {
        // Round-robin over destinations, starting after the last one served.
        let order: Vec<BuilderId> =
            self.dests.range(self.next_dest..).chain(self.dests.range(..self.next_dest)).map(|(d, _)| *d).collect();
        for dest in order {
            let mut b = self.dests.remove(&dest).expect("listed");
            self.refill(&mut b, now);
            // A bucket is kept even when idle: its token level must carry over.
            let Some(len) = self.ready(&b) else {
                b.releasing = false;
                self.dests.insert(dest, b);
                continue;
            };
            b.tokens -= u128::from(len) * NANOS;
            b.releasing = true;
            let (frag, offset) = b.queue.front_mut().expect("non-empty");
            let t = Transmit { dest, slice: frag.slice, offset: *offset, len, last: *offset + len == frag.len };
            *offset += len;
            if t.last {
                b.queue.pop_front();
                self.queued -= 1;
            }
            // The batch ends with the queue or when the next chunk's tokens are not there.
            b.releasing = self.chunk_len(&b).is_some_and(|next| b.tokens >= u128::from(next) * NANOS);
            self.dests.insert(dest, b);
            self.next_dest = dest.wrapping_add(1);
            return Some(t);
        }
        None
    }

    fn poll_timeout(&self) -> Option<Instant> {
        self.dests
            .values()
            .filter_map(|b| {
                let need = u128::from(self.batch_len(b)?) * NANOS;
                let missing = need.saturating_sub(b.tokens);
                let wait_ns = missing.div_ceil(u128::from(self.rate));
                Some(b.updated + Duration::from_nanos(u64::try_from(wait_ns).unwrap_or(u64::MAX)))
            })
            .min()
    }

    fn queued(&self) -> usize {
        self.queued
    }
}

/// Credit-based pull, the source's side: fragments wait in the source's buffer until the
/// builder their slice was assigned to asks for them.
///
/// A request for a slice not yet produced (the builder's clock runs ahead of the source's)
/// waits for the fragment. A fragment nobody asks for is evicted once `hold` newer slices
/// have ended ([`Shaper::poll_evicted`]): that bounds the buffer, and is where a slice that
/// was never assigned, or whose builder left, ends. Requests for fragments already handed
/// out or evicted are the node's to count; the shaper ignores them.
#[derive(Debug)]
pub struct Pull {
    hold: u64,
    /// Produced, not yet requested.
    held: BTreeMap<SliceNumber, Outgoing>,
    /// Requested before they were produced.
    waiting: BTreeMap<SliceNumber, BuilderId>,
    ready: VecDeque<Transmit>,
    /// With [`PullConfig::answer_rate`]: answers leave through token buckets instead.
    pacer: Option<Pacer>,
    evicted: VecDeque<SliceNumber>,
    /// The newest slice whose end this shaper has seen.
    latest: Option<SliceNumber>,
}

impl Pull {
    /// Holds fragments `hold_slices` slices; answers at once (`answer_rate` `None`) or
    /// through a token bucket per builder.
    pub fn new(hold_slices: u32, answer_rate: Option<TokenRate>) -> Self {
        Self {
            hold: u64::from(hold_slices.max(1)),
            held: BTreeMap::new(),
            waiting: BTreeMap::new(),
            ready: VecDeque::new(),
            pacer: answer_rate.map(Pacer::new),
            evicted: VecDeque::new(),
            latest: None,
        }
    }

    fn answer(&mut self, now: Instant, dest: BuilderId, frag: Outgoing) {
        match &mut self.pacer {
            Some(p) => p.push(now, dest, frag),
            None => self.ready.push_back(whole(dest, frag)),
        }
    }

    fn advance(&mut self, slice: SliceNumber) {
        let latest = self.latest.map_or(slice, |l| l.max(slice));
        self.latest = Some(latest);
        let Some(limit) = latest.checked_sub(self.hold) else { return };
        while let Some(entry) = self.held.first_entry() {
            if *entry.key() > limit {
                break;
            }
            self.evicted.push_back(entry.remove().slice);
        }
        // A request for a slice that never came (the source ended before it) is forgotten
        // with the same delay.
        while self.waiting.first_key_value().is_some_and(|(&s, _)| s <= limit) {
            self.waiting.pop_first();
        }
    }
}

impl Shaper for Pull {
    fn handle_fragment(&mut self, now: Instant, frag: Outgoing) {
        match self.waiting.remove(&frag.slice) {
            Some(dest) => self.answer(now, dest, frag),
            None => {
                self.held.insert(frag.slice, frag);
            }
        }
        self.advance(frag.slice);
    }
    fn handle_request(&mut self, now: Instant, req: PullRequest) {
        if let Some(frag) = self.held.remove(&req.slice) {
            self.answer(now, req.builder, frag);
        } else if self.latest.is_none_or(|l| req.slice > l && req.slice <= l + self.hold)
            && self.waiting.len() < self.hold as usize
        {
            // Not produced yet: answer when it is (bounded: at most `hold` slices ahead and
            // `hold` requests).
            self.waiting.insert(req.slice, req.builder);
        }
    }
    fn handle_sent(&mut self, _now: Instant, _slice: SliceNumber) {}
    fn handle_slot_end(&mut self, _now: Instant, slice: SliceNumber) {
        self.advance(slice);
    }
    fn handle_drain(&mut self, _now: Instant) {}
    fn poll_transmit(&mut self, now: Instant) -> Option<Transmit> {
        match &mut self.pacer {
            Some(p) => p.poll_transmit(now),
            None => self.ready.pop_front(),
        }
    }
    fn poll_timeout(&self) -> Option<Instant> {
        self.pacer.as_ref().and_then(Pacer::poll_timeout)
    }
    fn queued(&self) -> usize {
        self.held.len() + self.ready.len() + self.pacer.as_ref().map_or(0, Pacer::queued)
    }
    fn poll_evicted(&mut self) -> Option<SliceNumber> {
        self.evicted.pop_front()
    }
}

/// The decision of [`BurstCutoff`] for one fragment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CutoffDecision {
    /// Send the fragment's data.
    Keep(SliceNumber),
    /// Replace the fragment's data by an empty payload flagged `CUT_OFF` (counted).
    Cut(SliceNumber),
}

/// The burst rate cutoff: during a burst send only the first `head` and last `tail` slices.
///
/// The last `tail` fragments of a burst are only known when the burst ends, so up to `tail`
/// burst fragments are held back; decisions come out in slice order.
#[derive(Debug)]
pub struct BurstCutoff {
    head: u32,
    tail: usize,
    burst_len: u32,
    held: VecDeque<SliceNumber>,
    out: VecDeque<CutoffDecision>,
}

impl BurstCutoff {
    pub fn new(head: u32, tail: u32) -> Self {
        Self { head, tail: tail as usize, burst_len: 0, held: VecDeque::new(), out: VecDeque::new() }
    }

    /// The fragment of `slice` is ready; `in_burst` says whether the source was in a burst.
    pub fn handle_fragment(&mut self, slice: SliceNumber, in_burst: bool) {
        if !in_burst {
            self.handle_drain();
            self.out.push_back(CutoffDecision::Keep(slice));
            return;
        }
        self.burst_len = self.burst_len.saturating_add(1);
        if self.burst_len <= self.head {
            self.out.push_back(CutoffDecision::Keep(slice));
            return;
        }
        self.held.push_back(slice);
        if self.held.len() > self.tail {
            let cut = self.held.pop_front().expect("non-empty");
            self.out.push_back(CutoffDecision::Cut(cut));
        }
    }

    /// End of burst or of run: the held fragments are the burst's tail and are kept.
    pub fn handle_drain(&mut self) {
        self.burst_len = 0;
        self.out.extend(self.held.drain(..).map(CutoffDecision::Keep));
    }

    pub fn poll_decision(&mut self) -> Option<CutoffDecision> {
        self.out.pop_front()
    }

    /// Fragments waiting for a decision.
    pub fn held(&self) -> usize {
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ctx(source: u32, n_builders: u32) -> ShaperContext {
        ShaperContext { source, n_builders }
    }

    const SLOT: u64 = 10_000_000;

    #[test]
    fn parse_policies() {
        assert_eq!("direct".parse::<Policy>(), Ok(Policy::Direct));
        assert_eq!("delayed:8".parse::<Policy>(), Ok(Policy::Delayed { k: 8, window: DELAYED_WINDOW }));
        assert_eq!("delayed:8:4".parse::<Policy>(), Ok(Policy::Delayed { k: 8, window: 4 }));
        for p in [Policy::Delayed { k: 8, window: 4 }, Policy::Delayed { k: 3, window: DELAYED_WINDOW }] {
            assert_eq!(p.to_string().parse::<Policy>(), Ok(p));
        }
        assert_eq!(
            "tbf:40Mbit".parse::<Policy>(),
            Ok(Policy::TokenBucket { rate_bytes_per_s: 5_000_000, burst_bytes: 9000 })
        );
        assert_eq!(
            "tbf:2MB:64k".parse::<Policy>(),
            Ok(Policy::TokenBucket { rate_bytes_per_s: 2_000_000, burst_bytes: 64_000 })
        );
        for bad in [
            "",
            "delayed",
            "delayed:0",
            "delayed:x",
            "delayed:8:0",
            "delayed:8:x",
            "delayed:8:2:1",
            "tbf",
            "tbf:0",
            "tbf:-5",
            "fast",
            "direct:1",
            "tbf:1M:2k:3",
        ] {
            assert!(bad.parse::<Policy>().is_err(), "{bad} should be rejected");
        }
        let p = Policy::TokenBucket { rate_bytes_per_s: 7, burst_bytes: 9000 };
        assert_eq!(p.to_string().parse::<Policy>(), Ok(p));
    }

    #[test]
    fn parse_pull_policies() {
        let Ok(Policy::Pull(p)) = "pull:8".parse::<Policy>() else { panic!("pull:8") };
        assert_eq!(p, PullConfig::new(8));
        let Ok(Policy::Pull(p)) = "pull:4:cap=16:timeout=50ms:reasks=2:hold=32:rate=40Mbit".parse::<Policy>() else {
            panic!("pull with every parameter")
        };
        assert_eq!((p.credits, p.request_cap, p.max_reasks, p.hold_slices), (4, 16, 2, 32));
        assert_eq!(p.reask_timeout, Duration::from_millis(50));
        assert_eq!(p.answer_rate, Some(TokenRate { bytes_per_s: 5_000_000, burst_bytes: 9000 }));
        let Ok(Policy::Pull(p)) = "pull:2:rate=1MB:burst=64k".parse::<Policy>() else { panic!("rate and burst") };
        assert_eq!(p.answer_rate, Some(TokenRate { bytes_per_s: 1_000_000, burst_bytes: 64_000 }));
        for text in ["pull:8", "pull:4:cap=16:timeout=50ms:reasks=2:hold=32:rate=40Mbit", "pull:2:rate=1MB:burst=64k"] {
            let p: Policy = text.parse().unwrap();
            assert_eq!(p.to_string().parse::<Policy>(), Ok(p), "{text} -> {p}");
        }
        for bad in ["pull", "pull:0", "pull:x", "pull:8:cap", "pull:8:speed=3", "pull:8:burst=9k", "pull:8:rate=0"] {
            assert!(bad.parse::<Policy>().is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn paced_pull_answers_through_a_token_bucket_per_builder() {
        // 1000 B/s, burst 100: two 150-byte answers to builder 0 and one to builder 1.
        let mut s = Pull::new(64, Some(TokenRate { bytes_per_s: 1000, burst_bytes: 100 }));
        let t0 = Instant::ZERO;
        for slice in 0..3 {
            s.handle_fragment(t0, Outgoing { slice, len: 150 });
        }
        assert_eq!(s.poll_transmit(t0), None, "nothing is sent before it is requested");
        s.handle_request(t0, PullRequest { builder: 0, slice: 0 });
        s.handle_request(t0, PullRequest { builder: 1, slice: 1 });
        s.handle_request(t0, PullRequest { builder: 0, slice: 2 });
        // Each builder's bucket starts full: one 100-byte chunk each at once.
        let first: Vec<_> = std::iter::from_fn(|| s.poll_transmit(t0)).map(|t| (t.dest, t.slice, t.len)).collect();
        assert_eq!(first, [(0, 0, 100), (1, 1, 100)]);
        assert_eq!(s.queued(), 3);
        // The rest of slice 0 and 1 after 50 ms, slice 2 in two more chunks behind them.
        let mut sent = first.iter().map(|&(_, _, len)| len).sum::<u64>();
        let mut now = t0;
        while let Some(wake) = s.poll_timeout() {
            assert!(wake > now);
            now = wake;
            while let Some(t) = s.poll_transmit(now) {
                sent += t.len;
            }
        }
        assert_eq!(sent, 450);
        assert_eq!(s.queued(), 0);
        // Builder 0 received 300 bytes: 100 of burst, 200 at 1000 B/s.
        assert_eq!(now, Instant::from_nanos(200_000_000));
    }

    #[test]
    fn a_delayed_source_behind_hands_out_its_window_at_once() {
        let mut s = Delayed::with_window(ctx(17, 10), 8, 3); // delay 2
        let t = Instant::ZERO;
        for slice in 0..3 {
            s.handle_fragment(t, Outgoing { slice, len: 1 });
        }
        // On schedule: slice 0 is due, and the window does not send anything early.
        assert_eq!(s.poll_transmit(t).unwrap().slice, 0);
        assert_eq!(s.poll_transmit(t), None);
        // Slice 0 overruns three slots: 1, 2 and 3 are due and go together, to their own
        // builders, while 0 is still being written; 4 waits for a place in the window.
        for slice in 3..7 {
            s.handle_fragment(t, Outgoing { slice, len: 1 });
        }
        let out: Vec<_> = std::iter::from_fn(|| s.poll_transmit(t)).map(|tx| (tx.slice, tx.dest)).collect();
        assert_eq!(out, [(1, 1), (2, 2)]);
        // Reports out of order: each frees its own place.
        s.handle_sent(t, 2);
        assert_eq!(s.poll_transmit(t).unwrap().slice, 3);
        assert_eq!(s.poll_transmit(t), None);
        s.handle_sent(t, 0);
        assert_eq!(s.poll_transmit(t).unwrap().slice, 4);
        // Slice 5 is not due before slice 7's slot, whatever the window.
        s.handle_sent(t, 1);
        s.handle_sent(t, 3);
        assert_eq!(s.poll_transmit(t), None);
        assert_eq!(s.queued(), 2);
        // A report for a slice not in flight (already released) changes nothing.
        s.handle_sent(t, 1);
        s.handle_slot_end(t, 7);
        assert_eq!(s.poll_transmit(t).unwrap().slice, 5);
    }

    #[test]
    fn direct_sends_at_once_round_robin() {
        let mut s = Direct::new(ctx(0, 3));
        for slice in 0..4 {
            s.handle_fragment(Instant::ZERO, Outgoing { slice, len: 100 });
        }
        let dests: Vec<_> = std::iter::from_fn(|| s.poll_transmit(Instant::ZERO)).map(|t| t.dest).collect();
        assert_eq!(dests, [0, 1, 2, 0]);
    }

    #[test]
    fn delayed_holds_source_div_k_and_falls_behind() {
        let mut s = Delayed::new(ctx(17, 10), 8); // delay 2
        assert_eq!(s.delay_slices(), 2);
        let t = Instant::ZERO;
        s.handle_fragment(t, Outgoing { slice: 0, len: 1 });
        s.handle_fragment(t, Outgoing { slice: 1, len: 1 });
        assert_eq!(s.poll_transmit(t), None);
        s.handle_fragment(t, Outgoing { slice: 2, len: 1 });
        let tx = s.poll_transmit(t).unwrap();
        assert_eq!((tx.slice, tx.dest), (0, 0));
        // Slice 0 overruns its slot: slice 1 becomes due but must wait.
        s.handle_fragment(t, Outgoing { slice: 3, len: 1 });
        assert_eq!(s.poll_transmit(t), None);
        s.handle_fragment(t, Outgoing { slice: 4, len: 1 });
        assert_eq!(s.poll_transmit(t), None);
        s.handle_sent(t, 0);
        assert_eq!(s.poll_transmit(t).unwrap().slice, 1);
        s.handle_sent(t, 1);
        assert_eq!(s.poll_transmit(t).unwrap().slice, 2); // catching up
        s.handle_sent(t, 2);
        assert_eq!(s.poll_transmit(t), None);
        assert_eq!(s.queued(), 2);
        // Slots keep passing after the last fragment: the schedule goes on.
        s.handle_slot_end(t, 5);
        assert_eq!(s.poll_transmit(t).unwrap().slice, 3);
        assert_eq!(s.poll_transmit(t), None, "one in flight");
        s.handle_sent(t, 3);
        assert_eq!(s.poll_transmit(t), None, "slice 4 is due at slot 6");
        s.handle_drain(t);
        assert_eq!(s.poll_transmit(t).unwrap().slice, 4, "a drain releases the rest at once");
    }

    #[test]
    fn token_bucket_paces_and_chunks() {
        // 1000 B/s, burst 100: a 250-byte fragment takes 100 now, 100 at 0.1 s, 50 at 0.15 s.
        let mut s = TokenBucket::new(ctx(0, 1), 1000, 100);
        let t0 = Instant::ZERO;
        s.handle_fragment(t0, Outgoing { slice: 0, len: 250 });
        let a = s.poll_transmit(t0).unwrap();
        assert_eq!((a.offset, a.len, a.last), (0, 100, false));
        assert_eq!(s.poll_transmit(t0), None);
        let t1 = s.poll_timeout().unwrap();
        assert_eq!(t1, Instant::from_nanos(100_000_000));
        let b = s.poll_transmit(t1).unwrap();
        assert_eq!((b.offset, b.len), (100, 100));
        let t2 = s.poll_timeout().unwrap();
        assert_eq!(t2, Instant::from_nanos(150_000_000));
        let c = s.poll_transmit(t2).unwrap();
        assert_eq!((c.offset, c.len, c.last), (200, 50, true));
        assert_eq!(s.queued(), 0);
        assert_eq!(s.poll_timeout(), None);
    }

    #[test]
    fn a_busy_bucket_sends_a_batch_per_wake_up_never_more_than_it_holds() {
        // 1000 B/s, depth 400, eight 100-byte fragments queued at once: four now (the
        // bucket starts full), then one wake-up when it holds four again, not four.
        let mut s = TokenBucket::new(ctx(0, 1), 1000, 400);
        let t0 = Instant::ZERO;
        for slice in 0..8 {
            s.handle_fragment(t0, Outgoing { slice, len: 100 });
        }
        let burst =
            |s: &mut TokenBucket, t| std::iter::from_fn(|| s.poll_transmit(t)).map(|t| t.slice).collect::<Vec<_>>();
        assert_eq!(burst(&mut s, t0), [0, 1, 2, 3]);
        let t1 = s.poll_timeout().unwrap();
        assert_eq!(t1, Instant::from_nanos(400_000_000), "when four fit, not when one does (0.1 s)");
        assert_eq!(burst(&mut s, Instant::from_nanos(100_000_000)), [], "one fits, the batch waits");
        assert_eq!(burst(&mut s, t1), [4, 5, 6, 7]);
        // A lone fragment goes as soon as its own tokens are there.
        s.handle_fragment(t1, Outgoing { slice: 8, len: 100 });
        assert_eq!(s.poll_timeout(), Some(Instant::from_nanos(500_000_000)));
    }

    #[test]
    fn cutoff_keeps_head_and_tail() {
        let mut c = BurstCutoff::new(4, 4);
        let mut decisions = Vec::new();
        c.handle_fragment(0, false);
        for s in 1..=12 {
            c.handle_fragment(s, true);
        }
        c.handle_fragment(13, false);
        while let Some(d) = c.poll_decision() {
            decisions.push(d);
        }
        let kept: Vec<_> = decisions
            .iter()
            .filter_map(|d| match d {
                CutoffDecision::Keep(s) => Some(*s),
                _ => None,
            })
            .collect();
        let cut: Vec<_> = decisions
            .iter()
            .filter_map(|d| match d {
                CutoffDecision::Cut(s) => Some(*s),
                _ => None,
            })
            .collect();
        assert_eq!(kept, [0, 1, 2, 3, 4, 9, 10, 11, 12, 13]);
        assert_eq!(cut, [5, 6, 7, 8]);
        let order: Vec<_> = decisions
            .iter()
            .map(|d| match d {
                CutoffDecision::Keep(s) | CutoffDecision::Cut(s) => *s,
            })
            .collect();
        assert_eq!(order, (0..=13).collect::<Vec<_>>());
    }

    proptest! {
        /// Barrel-shifter steady state (domain.md section 3): every source sends at most one
        /// fragment per slot, source i queues i div k fragments, and no builder receives
        /// from more than k sources in one slot.
        /// A window changes nothing on schedule: one fragment becomes due per slot.
        #[test]
        fn barrel_shifter_steady_state(n in 1u32..120, k in 1u32..20, extra_builders in 0u32..5, slots in 1u64..40, window in 1u32..5) {
            let m = n.div_ceil(k) + extra_builders;
            let mut shapers: Vec<Delayed> = (0..n).map(|i| Delayed::with_window(ctx(i, m), k, window)).collect();
            let max_delay = u64::from((n - 1) / k);
            for slot in 0..(max_delay + slots) {
                let now = Instant::from_nanos((slot + 1) * SLOT);
                let mut per_builder = vec![0u32; m as usize];
                for (i, s) in shapers.iter_mut().enumerate() {
                    s.handle_fragment(now, Outgoing { slice: slot, len: 30_000 });
                    let mut sent = 0;
                    while let Some(t) = s.poll_transmit(now) {
                        prop_assert!(t.last && t.offset == 0);
                        prop_assert_eq!(t.slice + s.delay_slices(), slot);
                        per_builder[t.dest as usize] += 1;
                        sent += 1;
                        s.handle_sent(now, t.slice);
                    }
                    if slot >= max_delay {
                        prop_assert_eq!(sent, 1, "source {} sent {} in slot {}", i, sent, slot);
                        prop_assert_eq!(s.queued() as u32, i as u32 / k);
                    }
                    prop_assert!(sent <= 1);
                }
                prop_assert!(per_builder.iter().all(|&c| c <= k), "slot {}: {:?}", slot, per_builder);
            }
        }

        /// With arbitrary transport completion delays (completing out of order, too),
        /// Delayed still sends every fragment exactly once, in order, never more than its
        /// window at a time, and never before its slot.
        #[test]
        fn delayed_overrun_sends_each_once_in_order(source in 0u32..50, k in 1u32..10, window in 1u32..5, lags in proptest::collection::vec(0u8..4, 1..60)) {
            let mut s = Delayed::with_window(ctx(source, 7), k, window);
            let mut sent = Vec::new();
            let mut in_flight: Vec<(SliceNumber, u8)> = Vec::new();
            let n = lags.len() as u64;
            for slot in 0..n + 200 {
                let now = Instant::from_nanos(slot * SLOT);
                if slot < n { s.handle_fragment(now, Outgoing { slice: slot, len: 1 }); }
                if slot == n { s.handle_drain(now); }
                let mut writing = Vec::new();
                for (slice, left) in in_flight.drain(..) {
                    if left == 0 { s.handle_sent(now, slice); } else { writing.push((slice, left - 1)); }
                }
                in_flight = writing;
                while let Some(t) = s.poll_transmit(now) {
                    prop_assert!(in_flight.len() < window as usize, "{} in flight, window {}", in_flight.len(), window);
                    prop_assert!(slot >= n || t.slice + s.delay_slices() <= slot, "slice {} before its slot {}", t.slice, slot);
                    sent.push(t.slice);
                    in_flight.push((t.slice, lags[t.slice as usize]));
                }
            }
            prop_assert_eq!(sent, (0..n).collect::<Vec<_>>());
        }

        /// A token bucket never sends more than rate x t + burst to one destination in any
        /// window, and eventually sends everything.
        #[test]
        fn token_bucket_bound(rate in 1_000u64..10_000_000, burst in 100u64..100_000, frags in proptest::collection::vec((0u64..30, 1u64..200_000, 0u64..50_000_000), 1..30)) {
            let mut s = TokenBucket::new(ctx(0, 3), rate, burst);
            let mut arrivals: Vec<(Instant, Outgoing)> = frags.iter().map(|&(slice, len, at)| (Instant::from_nanos(at), Outgoing { slice, len })).collect();
            arrivals.sort_by_key(|a| a.0);
            let total: u64 = arrivals.iter().map(|a| a.1.len).sum();
            let mut log: Vec<Vec<(u64, u64)>> = vec![Vec::new(); 3];
            let mut now = Instant::ZERO;
            let mut next = 0;
            let mut sent = 0u64;
            for _ in 0..100_000 {
                while next < arrivals.len() && arrivals[next].0 <= now { s.handle_fragment(now, arrivals[next].1); next += 1; }
                while let Some(t) = s.poll_transmit(now) {
                    log[t.dest as usize].push((now.as_nanos(), t.len));
                    sent += t.len;
                }
                let wake = [s.poll_timeout(), arrivals.get(next).map(|a| a.0)].into_iter().flatten().min();
                match wake { Some(w) => now = w.max(now), None => break }
            }
            prop_assert_eq!(sent, total);
            for events in &log {
                for i in 0..events.len() {
                    let mut bytes = 0u128;
                    for j in i..events.len() {
                        bytes += u128::from(events[j].1);
                        let window = u128::from(events[j].0 - events[i].0);
                        prop_assert!(bytes * 1_000_000_000 <= window * u128::from(rate) + u128::from(burst) * 1_000_000_000);
                    }
                }
            }
        }
    }
}
