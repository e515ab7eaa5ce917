//! A source's data generated ahead, on a thread of its own.
//!
//! A front-end board's data for a slice exist when the slice ends; the emulated board
//! ([`shoal_core::node::Workload`]) computes them when asked, and a physics slice with a
//! burst or a muon takes milliseconds. Computed inside the source's async task, that work
//! holds a runtime worker: the other sources and the links on that worker wait, and a
//! source reached its slice end a whole slice late now and then on an idle machine (`make
//! demo`: 5-15 of 1,000 slice ends, 10-16 ms late, each behind a 5-20 ms generation).
//! Most of that work is a burst: a physics slice in a bioluminescence burst holds ten
//! times the hits and took up to 97 ms of CPU for 10 ms of data (`perf sched` of `shoal
//! demo`), while the generators' mean is 8% of a core each. [`Prefetch`] computes slices
//! ahead on a thread of its own, for every hosted source, so that at a slice end the node
//! only takes the slice, and a burst's cost is spread over the slices computed before it.
//! Workloads are deterministic per (source, slice), so the data are the same bytes
//! whoever computes them, whenever.
//!
//! Bounded: at most `ahead` slices past the last one asked for, and at most `max_bytes` of
//! payload held (a share of the process's memory budget, `budget::ProcessPlan`); slices the
//! node skipped are dropped. When the thread is behind, the node computes the slice
//! itself, as before, and [`PrefetchStats::generated_inline`] counts it.
//!
//! Few wake-ups: a thread that has caught up sleeps until a batch of slices (a quarter of
//! `ahead`) can be computed, and each side wakes the other only when it waits. Waking the
//! thread at every fragment the node took, and the node at every fragment computed, cost
//! the live full-shape demo (75 such threads) 2.4-3.1 futex calls a fragment, where a
//! replay-pool run makes 0.03; now 0.3-0.9 (docs/bench/history.md, "The generator draws in
//! time order").

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use shoal_core::SourceId;
use shoal_core::node::{GeneratedFragment, Workload};
use shoal_core::slice::SliceNumber;

/// The most payload one source node holds computed ahead; the memory plan gives each
/// node less when its sources' slices for `source.generate_ahead_ms` need less.
pub const MAX_BYTES: u64 = 64 << 20;

/// `source.generate_ahead_ms` in slices of the run (0: no computing ahead; else at least
/// one). Only hits computed for each slice are worth a thread: a fixed or replayed fragment
/// costs a copy, and 75 threads handing them over slowed the full-shape run from 548 to
/// 319 MB/s. The memory plan asks here too, so such a node keeps its whole share.
pub fn ahead_slices(cfg: &crate::config::Config) -> Result<SliceNumber, crate::config::ConfigError> {
    if !cfg.computes_hits_per_slice() {
        return Ok(0);
    }
    let slice = (cfg.slice_clock()?.length().as_nanos() as u64).max(1);
    Ok((cfg.source.generate_ahead_ms.saturating_mul(1_000_000)).div_ceil(slice))
}

/// The generator threads' nice value (the runtime's is 0).
const GENERATOR_NICE: i32 = 10;

/// How the fragments the node took were computed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    /// Ready when the node asked.
    pub generated_ahead: u64,
    /// Being computed when the node asked (it waited for the rest).
    pub waited: u64,
    /// Computed by the node itself: the thread was behind (a starved machine).
    pub generated_inline: u64,
    /// Times the thread woke from waiting for work and computed a batch.
    pub batches_after_waiting: u64,
}

struct State {
    ready: HashMap<(SourceId, SliceNumber), GeneratedFragment>,
    /// The first slice not yet claimed by the thread.
    next_to_generate: SliceNumber,
    /// The slice the thread is computing now.
    in_progress: Option<SliceNumber>,
    /// The thread may compute slices up to and including this one: the slice after the
    /// last one the node asked for.
    horizon: SliceNumber,
    /// The last slice the node asked for: older ones will not be asked for again.
    oldest_wanted: SliceNumber,
    /// Payload bytes in `ready`.
    ready_bytes: u64,
    closed: bool,
    /// The thread sleeps until a batch can be computed; the node, until its slice is.
    thread_waiting: bool,
    node_waiting: bool,
    stats: PrefetchStats,
}

impl State {
    /// Whether the thread has a batch of `batch` slices to compute and room to keep them.
    fn batch_ready(&self, batch: SliceNumber, max_bytes: u64) -> bool {
        self.horizon.saturating_add(1).saturating_sub(self.next_to_generate) >= batch && self.ready_bytes < max_bytes
    }
}

struct Shared<W> {
    workload: W,
    sources: Vec<SourceId>,
    ahead: SliceNumber,
    /// Slices the thread waits for once it has caught up (at least one).
    batch: SliceNumber,
    max_bytes: u64,
    state: Mutex<State>,
    changed: Condvar,
}

impl<W> Shared<W> {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the map half-updated in a way that
        // matters (entries are whole fragments): carry on with it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A [`Workload`] whose slices are computed ahead by a thread (see the module doc).
pub struct Prefetch<W: Workload + Send + Sync + 'static> {
    shared: Arc<Shared<W>>,
    thread: Option<JoinHandle<()>>,
}

impl<W: Workload + Send + Sync + 'static> Prefetch<W> {
    /// Computes `sources`' fragments from `first_slice` on, up to `ahead` slices (at least
    /// one) past the last one asked for and `max_bytes` of payload.
    pub fn new(
        workload: W,
        sources: Vec<SourceId>,
        first_slice: SliceNumber,
        ahead: SliceNumber,
        max_bytes: u64,
    ) -> std::io::Result<Self> {
        let ahead = ahead.max(1);
        let shared = Arc::new(Shared {
            workload,
            sources,
            ahead,
            batch: (ahead / 4).max(1),
            max_bytes,
            state: Mutex::new(State {
                ready: HashMap::new(),
                next_to_generate: first_slice,
                in_progress: None,
                horizon: first_slice + ahead - 1,
                oldest_wanted: first_slice,
                ready_bytes: 0,
                closed: false,
                thread_waiting: false,
                node_waiting: false,
                stats: PrefetchStats::default(),
            }),
            changed: Condvar::new(),
        });
        let worker = Arc::clone(&shared);
        let thread =
            std::thread::Builder::new().name("shoal-generate".into()).spawn(move || generate_ahead(&worker))?;
        Ok(Prefetch { shared, thread: Some(thread) })
    }

    pub fn stats(&self) -> PrefetchStats {
        self.shared.lock().stats
    }
}

/// The thread: compute every slice up to the horizon, then wait for the node to move it.
fn generate_ahead<W: Workload>(shared: &Shared<W>) {
    // Whatever happens to this thread, the node stops waiting for it.
    struct Done<'a, W>(&'a Shared<W>);
    impl<W> Drop for Done<'_, W> {
        fn drop(&mut self) {
            let mut s = self.0.lock();
            s.closed = true;
            s.in_progress = None;
            self.0.changed.notify_all();
        }
    }
    let _done = Done(shared);
    // Below the runtime: on an idle machine the thread has its CPU, on a starved one the
    // transport comes first (a slice not ready is computed by the node, as without it).
    if let Err(e) = rustix::process::setpriority_process(Some(rustix::thread::gettid()), GENERATOR_NICE) {
        tracing::debug!("generator thread priority: {e}");
    }
    let mut state = shared.lock();
    let mut slept = false;
    loop {
        if state.closed {
            return;
        }
        // Caught up: sleep until a batch can be computed (a lone slice at a time would
        // wake the thread at every slice the node takes).
        let has_work = state.next_to_generate <= state.horizon && state.ready_bytes < shared.max_bytes;
        if !has_work || (slept && !state.batch_ready(shared.batch, shared.max_bytes)) {
            state.thread_waiting = true;
            state = shared.changed.wait(state).unwrap_or_else(|p| p.into_inner());
            state.thread_waiting = false;
            slept = true;
            continue;
        }
        if slept {
            state.stats.batches_after_waiting += 1;
            slept = false;
        }
        let slice = state.next_to_generate;
        state.next_to_generate += 1;
        state.in_progress = Some(slice);
        drop(state);
        for &source in &shared.sources {
            let fragment = shared.workload.generate(source, slice);
            let mut s = shared.lock();
            // Skipped meanwhile (the node moved past it): not kept.
            if slice >= s.oldest_wanted {
                s.ready_bytes += fragment.payload.len() as u64;
                s.ready.insert((source, slice), fragment);
            }
            if s.node_waiting {
                shared.changed.notify_all();
            }
        }
        state = shared.lock();
        state.in_progress = None;
        if state.node_waiting {
            shared.changed.notify_all();
        }
    }
}

impl<W: Workload + Send + Sync + 'static> Workload for Prefetch<W> {
    fn generate(&self, source: SourceId, slice: SliceNumber) -> GeneratedFragment {
        let shared = &*self.shared;
        let mut s = shared.lock();
        // The node asks in slice order: what is older than this slice will not be asked for.
        if slice > s.oldest_wanted {
            s.oldest_wanted = slice;
            let mut dropped = 0;
            s.ready.retain(|&(_, sl), f| {
                let keep = sl >= slice;
                dropped += if keep { 0 } else { f.payload.len() as u64 };
                keep
            });
            s.ready_bytes -= dropped;
        }
        if s.horizon < slice + shared.ahead {
            s.horizon = slice + shared.ahead;
        }
        // Taking frees room; the horizon may have moved: a sleeping thread looks again
        // once a batch is there.
        if s.thread_waiting && s.batch_ready(shared.batch, shared.max_bytes) {
            shared.changed.notify_all();
        }
        let mut waited = false;
        loop {
            if let Some(f) = s.ready.remove(&(source, slice)) {
                s.ready_bytes -= f.payload.len() as u64;
                if waited {
                    s.stats.waited += 1;
                } else {
                    s.stats.generated_ahead += 1;
                }
                return f;
            }
            if s.in_progress != Some(slice) || s.closed {
                break;
            }
            // Being computed: wait for it (bounded, then look again; the thread always
            // notifies, the timeout only guards against a notification lost to a panic).
            waited = true;
            s.node_waiting = true;
            s = shared.changed.wait_timeout(s, Duration::from_millis(50)).unwrap_or_else(|p| p.into_inner()).0;
            s.node_waiting = false;
        }
        // The thread is behind: compute it here, and let the thread skip what the node
        // has passed.
        if s.next_to_generate <= slice {
            s.next_to_generate = slice + 1;
        }
        s.stats.generated_inline += 1;
        drop(s);
        shared.workload.generate(source, slice)
    }
}

impl<W: Workload + Send + Sync + 'static> Drop for Prefetch<W> {
    fn drop(&mut self) {
        {
            let mut s = self.shared.lock();
            s.closed = true;
            self.shared.changed.notify_all();
        }
        if let Some(t) = self.thread.take() {
            // At most one slice's generation to finish.
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A workload that says who asked, and counts how often each fragment was computed.
    struct Counting {
        calls: AtomicU64,
    }

    impl Workload for Counting {
        fn generate(&self, source: SourceId, slice: SliceNumber) -> GeneratedFragment {
            self.calls.fetch_add(1, Ordering::Relaxed);
            let payload = Bytes::from(format!("{source}:{slice}"));
            GeneratedFragment { hit_count: 0, waveform_count: 0, payload, burst: false, opaque: false }
        }
    }

    fn payload(f: &GeneratedFragment) -> String {
        String::from_utf8(f.payload.to_vec()).unwrap()
    }

    #[test]
    fn every_fragment_is_the_workloads_own_whoever_computed_it() {
        let p = Prefetch::new(Counting { calls: AtomicU64::new(0) }, vec![3, 7], 100, 4, u64::MAX).unwrap();
        for slice in 100..150 {
            for source in [3, 7] {
                assert_eq!(payload(&p.generate(source, slice)), format!("{source}:{slice}"));
            }
        }
        let st = p.stats();
        assert_eq!(st.generated_ahead + st.waited + st.generated_inline, 100, "{st:?}");
        // Each fragment computed once, plus at most the four slices ahead of the last asked.
        let calls = p.shared.workload.calls.load(Ordering::Relaxed);
        assert!((100..=108).contains(&calls), "{calls} computations for 100 fragments");
    }

    #[test]
    fn a_thread_that_caught_up_wakes_for_a_batch_not_for_every_slice() {
        // 16 slices ahead: batches of 4.
        let p = Prefetch::new(Counting { calls: AtomicU64::new(0) }, vec![0, 1], 0, 16, u64::MAX).unwrap();
        // A node at a detector's pace: the thread has computed what it could and sleeps
        // before each slice is asked for (a guard of a minute, not a timing).
        let asleep = |p: &Prefetch<Counting>| {
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            let sh = &p.shared;
            let mut s = sh.lock();
            while !s.thread_waiting || s.batch_ready(sh.batch, sh.max_bytes) {
                assert!(std::time::Instant::now() < deadline, "the thread never caught up");
                s = sh.changed.wait_timeout(s, Duration::from_millis(10)).unwrap().0;
            }
        };
        for slice in 0..400 {
            asleep(&p);
            for source in [0, 1] {
                assert_eq!(payload(&p.generate(source, slice)), format!("{source}:{slice}"));
            }
        }
        let st = p.stats();
        // The thread goes to sleep only once caught up (nothing left to compute); it
        // resumes once the node has moved the horizon by a batch: over 400 slices and 16
        // ahead, at most 104 times, however the two were scheduled (woken at every slice,
        // 400).
        assert!(st.batches_after_waiting <= (400 + 16) / 4, "{st:?}");
        assert_eq!(st.generated_ahead + st.waited + st.generated_inline, 800, "{st:?}");
    }

    #[test]
    fn skipped_slices_are_not_kept_and_the_thread_follows() {
        let p = Prefetch::new(Counting { calls: AtomicU64::new(0) }, vec![0], 0, 1, u64::MAX).unwrap();
        assert_eq!(payload(&p.generate(0, 0)), "0:0");
        // The node skips to slice 1000 (it fell behind by more than max_lag).
        assert_eq!(payload(&p.generate(0, 1000)), "0:1000");
        assert_eq!(payload(&p.generate(0, 1001)), "0:1001");
        let s = p.shared.lock();
        assert!(s.ready.keys().all(|&(_, sl)| sl >= 1001), "old slices dropped: {:?}", s.ready.keys());
        assert!(s.horizon == 1002 && s.next_to_generate <= 1003);
    }

    #[test]
    fn what_is_held_ahead_stays_within_its_bytes() {
        // Fragments of 3-4 bytes ("0:12"), at most 8 bytes held: two fragments ahead.
        let p = Prefetch::new(Counting { calls: AtomicU64::new(0) }, vec![0], 10, 100, 8).unwrap();
        for slice in 10..40 {
            assert_eq!(payload(&p.generate(0, slice)), format!("0:{slice}"));
            let s = p.shared.lock();
            // The thread stops at the bound: at most one fragment past it.
            assert!(s.ready_bytes <= 8 + 4, "{} bytes held", s.ready_bytes);
            assert_eq!(s.ready_bytes, s.ready.values().map(|f| f.payload.len() as u64).sum::<u64>());
        }
    }

    #[test]
    fn a_workload_that_panics_on_the_thread_leaves_the_node_computing_itself() {
        struct PanicsAhead;
        impl Workload for PanicsAhead {
            fn generate(&self, source: SourceId, slice: SliceNumber) -> GeneratedFragment {
                if std::thread::current().name() == Some("shoal-generate") {
                    panic!("generator failed on the thread (test)");
                }
                GeneratedFragment {
                    hit_count: 0,
                    waveform_count: 0,
                    payload: Bytes::from(format!("{source}:{slice}")),
                    burst: false,
                    opaque: false,
                }
            }
        }
        let p = Prefetch::new(PanicsAhead, vec![1], 5, 3, u64::MAX).unwrap();
        for slice in 5..10 {
            assert_eq!(payload(&p.generate(1, slice)), format!("1:{slice}"));
        }
        assert_eq!(p.stats().generated_inline, 5);
    }
}
