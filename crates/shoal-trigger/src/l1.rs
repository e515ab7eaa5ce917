//! L1 local coincidences plus a multiplicity trigger (see the crate documentation).

use serde::{Deserialize, Serialize};
use shoal_core::SourceId;
use shoal_core::hit::Hit;

use crate::muon::{L1Kind, L1Params, l1_hit_indices};
use crate::{Event, EventHit, Filter, FilterConfig, FilterError, SliceData, SliceHits};

/// Parameters of [`L1Multiplicity`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct L1Config {
    /// Two hits on different channels of one source within this window form an L1
    /// (ANTARES: 20 ns).
    pub coincidence_ns: u32,
    /// A single hit with at least this amplitude is an L1 on its own (0: disabled).
    pub high_amplitude: u8,
    /// L1 hits on at least this many distinct sources ...
    pub min_sources: u32,
    /// ... within this window fire the trigger (ANTARES 3N: 2.2 us).
    pub cluster_ns: u32,
    /// The event keeps every hit within this margin before and after its L1 hits.
    pub snapshot_ns: u32,
}

impl Default for L1Config {
    fn default() -> Self {
        Self { coincidence_ns: 20, high_amplitude: 0, min_sources: 2, cluster_ns: 2_200, snapshot_ns: 1_000 }
    }
}

/// The `l1` filter.
#[derive(Debug, Default)]
pub struct L1Multiplicity {
    cfg: L1Config,
    /// The slice's hits, one fragment at a time (a reused buffer).
    hits: SliceHits,
}

/// Indices of the L1 hits among one source's time-sorted hits: a hit is L1 if a hit on
/// another channel lies within `coincidence_ns` before or after it, or if its amplitude
/// reaches `high_amplitude` (when enabled): the `muon` filter's ANTARES definition.
pub(crate) fn l1_indices(hits: &[Hit], cfg: &L1Config, out: &mut Vec<usize>) {
    let p = L1Params { kind: L1Kind::Antares, window_ns: cfg.coincidence_ns, high_amplitude: cfg.high_amplitude };
    l1_hit_indices(hits, &p, out);
}

impl Filter for L1Multiplicity {
    fn init(&mut self, config: &FilterConfig) -> Result<(), FilterError> {
        let c = &config.l1;
        if c.min_sources == 0 {
            return Err(FilterError::BadParameter("l1.min_sources must be at least 1".into()));
        }
        self.cfg = c.clone();
        Ok(())
    }

    fn process(&mut self, slice: &SliceData) -> Vec<Event> {
        let cfg = &self.cfg;
        self.hits.clear();
        // (time, fragment index, hit index) of every L1 hit in the slice.
        let mut l1: Vec<(u32, usize, usize)> = Vec::new();
        let mut idx = Vec::new();
        for (fi, f) in slice.fragments.iter().enumerate() {
            let hits = self.hits.read(f);
            l1_indices(hits, cfg, &mut idx);
            l1.extend(idx.iter().map(|&hi| (hits[hi].time_ns, fi, hi)));
        }
        l1.sort_unstable();
        let sources: Vec<SourceId> = slice.fragments.iter().map(|f| f.source).collect();

        // Sweep: a cluster starts at each L1 and spans cluster_ns; overlapping firing
        // windows merge into one event. Two pointers with per-source counts: O(L1 hits).
        let mut windows: Vec<(usize, usize)> = Vec::new(); // inclusive index ranges into l1
        let mut per_source = vec![0u32; slice.fragments.len()];
        let mut distinct = 0u32;
        let mut end = 0; // l1[i..end] is the current window
        for i in 0..l1.len() {
            while end < l1.len() && l1[end].0 - l1[i].0 <= cfg.cluster_ns {
                let c = &mut per_source[l1[end].1];
                distinct += u32::from(*c == 0);
                *c += 1;
                end += 1;
            }
            if distinct >= cfg.min_sources {
                let j = end - 1;
                match windows.last_mut() {
                    Some(w) if i <= w.1 => w.1 = w.1.max(j),
                    _ => windows.push((i, j)),
                }
            }
            let c = &mut per_source[l1[i].1];
            *c -= 1;
            distinct -= u32::from(*c == 0);
        }

        // Which hits triggered: the window's L1 hits, as (fragment, hit index).
        let sorted = self.hits.sorted(slice);
        let mut triggered: Vec<(usize, usize)> = Vec::new();
        let mut events = Vec::with_capacity(windows.len());
        for (id, &(a, b)) in windows.iter().enumerate() {
            triggered.clear();
            triggered.extend(l1[a..=b].iter().map(|&(_, fi, hi)| (fi, hi)));
            triggered.sort_unstable();
            let t0 = l1[a].0.saturating_sub(cfg.snapshot_ns);
            let t1 = l1[b].0.saturating_add(cfg.snapshot_ns);
            let mut hits = Vec::new();
            for (fi, fh) in sorted.iter().enumerate() {
                let start = fh.partition_point_by_time(|t| t < t0);
                let end = fh.partition_point_by_time(|t| t <= t1);
                for k in start..end {
                    hits.push(EventHit::from_hit(sources[fi], fh.get(k), triggered.binary_search(&(fi, k)).is_ok()));
                }
            }
            hits.sort_unstable_by_key(|h| (h.time_ns, h.source, h.channel));
            events.push(Event { id: id as u32, trigger_mask: 1, overlays: 0, hits });
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FragmentData;
    use bytes::BytesMut;
    use proptest::prelude::*;

    fn frag(source: u32, hits: &[Hit]) -> FragmentData {
        let mut b = BytesMut::new();
        for h in hits {
            h.encode(&mut b);
        }
        FragmentData { source, flags: 0, hit_count: hits.len() as u32, payload: b.freeze() }
    }

    fn h(channel: u8, time_ns: u32) -> Hit {
        Hit { channel, time_ns, amplitude: 20 }
    }

    /// The definition, checked pair by pair.
    fn brute_l1(hits: &[Hit], cfg: &L1Config) -> Vec<usize> {
        (0..hits.len())
            .filter(|&i| {
                (cfg.high_amplitude > 0 && hits[i].amplitude >= cfg.high_amplitude)
                    || (0..hits.len()).any(|j| {
                        j != i
                            && hits[j].channel != hits[i].channel
                            && hits[i].time_ns.abs_diff(hits[j].time_ns) <= cfg.coincidence_ns
                    })
            })
            .collect()
    }

    proptest! {
        #[test]
        fn l1_matches_brute_force(raw in proptest::collection::vec((0u8..3, 0u32..2000, 0u8..60), 0..80), window in 0u32..50, high in 0u8..60) {
            let mut hits: Vec<Hit> = raw.into_iter().map(|(channel, time_ns, amplitude)| Hit { channel, time_ns, amplitude }).collect();
            hits.sort_unstable();
            let cfg = L1Config { coincidence_ns: window, high_amplitude: high, ..Default::default() };
            let mut got = Vec::new();
            l1_indices(&hits, &cfg, &mut got);
            prop_assert_eq!(got, brute_l1(&hits, &cfg));
        }
    }

    proptest! {
        /// The triggered hits are exactly the L1 hits inside some firing window, a window
        /// being [t, t + cluster_ns] from any L1 hit at t that holds L1 hits on at least
        /// min_sources sources (checked by brute force).
        #[test]
        fn multiplicity_matches_brute_force(
            raw in proptest::collection::vec(proptest::collection::vec((0u8..3, 0u32..20_000), 0..40), 1..6),
            min_sources in 1u32..4, cluster_ns in 0u32..3000,
        ) {
            let cfg = L1Config { min_sources, cluster_ns, snapshot_ns: 0, ..Default::default() };
            let mut f = L1Multiplicity::default();
            f.init(&FilterConfig { name: "l1".into(), l1: cfg.clone(), ..Default::default() }).unwrap();
            let mut sorted: Vec<Vec<Hit>> = raw.iter().map(|v| { let mut h: Vec<Hit> = v.iter().map(|&(c, t)| h(c, t)).collect(); h.sort_unstable(); h }).collect();
            for v in &mut sorted { v.dedup(); }
            let slice = SliceData { slice: 0, slice_start_ns: 0, slice_ns: 10_000_000, fragments: sorted.iter().enumerate().map(|(i, v)| frag(i as u32, v)).collect() };
            let got: std::collections::BTreeSet<(u32, u32, u8)> = f.process(&slice).iter()
                .flat_map(|e| e.hits.iter().filter(|h| h.triggered).map(|h| (h.source, h.time_ns, h.channel)).collect::<Vec<_>>())
                .collect();
            let mut l1 = Vec::new();
            for (s, v) in sorted.iter().enumerate() {
                for i in brute_l1(v, &cfg) { l1.push((v[i].time_ns, s as u32, v[i].channel)); }
            }
            let mut want = std::collections::BTreeSet::new();
            for &(t, _, _) in &l1 {
                let window: Vec<_> = l1.iter().filter(|x| x.0 >= t && x.0 - t <= cluster_ns).collect();
                let distinct: std::collections::BTreeSet<u32> = window.iter().map(|x| x.1).collect();
                if distinct.len() as u32 >= min_sources {
                    want.extend(window.iter().map(|x| (x.1, x.0, x.2)));
                }
            }
            prop_assert_eq!(got, want);
            // Payloads out of time order (the hits reversed) give the same events.
            let reversed: Vec<FragmentData> =
                sorted.iter().enumerate().map(|(i, v)| frag(i as u32, &v.iter().rev().copied().collect::<Vec<_>>())).collect();
            prop_assert_eq!(f.process(&SliceData { fragments: reversed, ..slice.clone() }), f.process(&slice));
        }
    }

    #[test]
    fn triggers_on_two_sources_and_snapshots() {
        let mut f = L1Multiplicity::default();
        f.init(&FilterConfig::default()).unwrap();
        let slice = SliceData {
            slice: 1,
            slice_start_ns: 0,
            slice_ns: 10_000_000,
            fragments: vec![
                frag(0, &[h(0, 1_000), h(1, 1_010), h(2, 1_500), h(0, 500_000)]),
                frag(1, &[h(0, 2_000), h(2, 2_015), h(1, 9_000)]),
                frag(2, &[h(0, 3_000), h(0, 3_005)]), // same channel: no L1
            ],
        };
        let events = f.process(&slice);
        assert_eq!(events.len(), 1);
        let e = &events[0];
        assert_eq!(e.triggered_hits(), 4);
        // Snapshot [0, 3015]: adds source 0's 1500 and source 2's two hits.
        assert_eq!(e.hits.len(), 7);
        assert_eq!(e.first_time_ns(), Some(1_000));

        // One source alone never fires with min_sources = 2.
        let lone = SliceData { fragments: vec![slice.fragments[0].clone()], ..slice };
        assert!(f.process(&lone).is_empty());
    }
}
