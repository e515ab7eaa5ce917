//! Filter evaluation on generated data with ground truth (`shoal trigger-eval`): muon
//! efficiency versus the number of PMTs a muon lit, background event rate, purity and the
//! data reduction factor.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant as WallInstant;

use serde::Serialize;
use shoal_detector::physics::{MuonId, Origin, PhysicsGenerator};

use crate::{FragmentData, MuonFilter, SliceData, encode_events};

/// One row of the efficiency table.
#[derive(Clone, Debug, Serialize)]
pub struct EfficiencyRow {
    /// Muons that lit at least `min_pmts` and fewer than `max_pmts` PMTs (`max_pmts` 0: no limit).
    pub min_pmts: usize,
    pub max_pmts: usize,
    pub muons: u64,
    pub detected: u64,
    pub efficiency: f64,
}

/// The evaluation's result.
#[derive(Clone, Debug, Serialize)]
pub struct EvalReport {
    pub slices: u64,
    pub seconds: f64,
    pub modules: usize,
    pub pmts: usize,
    pub l0_hits: u64,
    pub l1_hits: u64,
    /// Module-slices left out of the trigger by the high-rate veto (bioluminescence).
    pub vetoed_module_slices: u64,
    /// Hit bytes into the filter (6 per hit; waveforms not counted).
    pub input_bytes: u64,
    /// Encoded event bytes out of the filter.
    pub output_bytes: u64,
    pub reduction: f64,
    pub events: u64,
    pub event_rate_hz: f64,
    /// Events with no muon light among their triggered hits.
    pub background_events: u64,
    pub background_rate_hz: f64,
    /// Fraction of events whose triggered hits include muon light.
    pub event_purity: f64,
    /// Fraction of triggered hits that are muon light.
    pub hit_purity: f64,
    /// Muons generated in the evaluated slices, and those that lit any PMT.
    pub muons: u64,
    pub muons_with_light: u64,
    pub efficiency: Vec<EfficiencyRow>,
    /// Filter time only (generation excluded), and the hit rate it sustains on one core.
    pub filter_seconds: f64,
    pub filter_hits_per_s: f64,
}

const BINS: [(usize, usize); 6] = [(1, 2), (2, 5), (5, 10), (10, 20), (20, 50), (50, 0)];

/// Generates `slices` slices from `first_slice` on with `generator`, filters them with
/// `filter` and compares the events with the ground truth.
pub fn evaluate(generator: &PhysicsGenerator, filter: &mut MuonFilter, first_slice: u64, slices: u64) -> EvalReport {
    let modules = generator.geometry().modules.len();
    let mut light: BTreeMap<MuonId, HashSet<(u32, u8)>> = BTreeMap::new();
    let mut detected: HashSet<MuonId> = HashSet::new();
    let (mut l0, mut input, mut output) = (0u64, 0u64, 0u64);
    let (mut events, mut background, mut trig_hits, mut trig_signal) = (0u64, 0u64, 0u64, 0u64);
    let mut filter_s = 0.0;
    let mut muons = 0u64;
    for slice in first_slice..first_slice + slices {
        muons += generator.muons(slice).len() as u64;
        let truth: Vec<_> = std::thread::scope(|s| {
            let half = modules / 2;
            let a = s.spawn(move || (0..half).map(|m| generator.generate_with_truth(m, slice)).collect::<Vec<_>>());
            let mut v: Vec<_> = (half..modules).map(|m| generator.generate_with_truth(m, slice)).collect();
            let mut first = a.join().expect("generator thread");
            first.append(&mut v);
            first
        });
        let mut origin: HashMap<(u32, u8, u32), Origin> = HashMap::new();
        let mut fragments = Vec::with_capacity(modules);
        for (m, t) in truth.into_iter().enumerate() {
            for (h, o) in t.hits.iter().zip(&t.origins) {
                if let Origin::Muon(id) = o {
                    light.entry(*id).or_default().insert((m as u32, h.channel));
                    origin.insert((m as u32, h.channel, h.time_ns), *o);
                }
            }
            l0 += u64::from(t.fragment.hit_count);
            input += u64::from(t.fragment.hit_count) * 6;
            fragments.push(FragmentData {
                source: m as u32,
                flags: 0,
                hit_count: t.fragment.hit_count,
                payload: t.fragment.payload,
            });
        }
        let data = SliceData { slice, slice_start_ns: 0, slice_ns: u64::from(generator.slice_ns()), fragments };
        let t0 = WallInstant::now();
        let ev = filter.process_slice(&data);
        filter_s += t0.elapsed().as_secs_f64();
        output += encode_events(&ev).len() as u64;
        for e in &ev {
            events += 1;
            let mut signal = false;
            for h in e.hits.iter().filter(|h| h.triggered) {
                trig_hits += 1;
                if let Some(Origin::Muon(id)) = origin.get(&(h.source, h.channel, h.time_ns)) {
                    trig_signal += 1;
                    signal = true;
                    detected.insert(*id);
                }
            }
            if !signal {
                background += 1;
            }
        }
    }
    let seconds = slices as f64 * f64::from(generator.slice_ns()) * 1e-9;
    // Only muons of the evaluated slices (light from the neighbours' muons is not theirs).
    let range = first_slice..first_slice + slices;
    let efficiency = BINS
        .iter()
        .map(|&(lo, hi)| {
            let sel: Vec<&MuonId> = light
                .iter()
                .filter(|(id, pmts)| range.contains(&id.slice) && pmts.len() >= lo && (hi == 0 || pmts.len() < hi))
                .map(|(id, _)| id)
                .collect();
            let det = sel.iter().filter(|id| detected.contains(id)).count() as u64;
            let n = sel.len() as u64;
            EfficiencyRow { min_pmts: lo, max_pmts: hi, muons: n, detected: det, efficiency: ratio(det, n) }
        })
        .collect();
    EvalReport {
        slices,
        seconds,
        modules,
        pmts: generator.geometry().pmt_count(),
        l0_hits: l0,
        l1_hits: filter.stats.l1_hits,
        vetoed_module_slices: filter.stats.vetoed_modules,
        input_bytes: input,
        output_bytes: output,
        reduction: if output > 0 { input as f64 / output as f64 } else { f64::INFINITY },
        events,
        event_rate_hz: events as f64 / seconds,
        background_events: background,
        background_rate_hz: background as f64 / seconds,
        event_purity: ratio(events - background, events),
        hit_purity: ratio(trig_signal, trig_hits),
        muons,
        muons_with_light: light.keys().filter(|id| range.contains(&id.slice)).count() as u64,
        efficiency,
        filter_seconds: filter_s,
        filter_hits_per_s: l0 as f64 / filter_s.max(1e-9),
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// The report as a text table.
pub fn table(r: &EvalReport) -> String {
    let mut s = String::new();
    use std::fmt::Write;
    let _ = writeln!(
        s,
        "trigger evaluation: {} slices = {:.2} s, {} modules, {} PMTs",
        r.slices, r.seconds, r.modules, r.pmts
    );
    let _ = writeln!(
        s,
        "  L0 hits          {} ({:.1} M hits/s), L1 hits {} ({:.2}% of L0)",
        r.l0_hits,
        r.l0_hits as f64 / r.seconds / 1e6,
        r.l1_hits,
        100.0 * r.l1_hits as f64 / r.l0_hits.max(1) as f64
    );
    let _ = writeln!(
        s,
        "  high-rate veto   {} module-slices ({:.2}%) left out of the trigger",
        r.vetoed_module_slices,
        100.0 * r.vetoed_module_slices as f64 / (r.slices as f64 * r.modules as f64).max(1.0)
    );
    let _ = writeln!(s, "  muons            {} generated, {} lit at least one PMT", r.muons, r.muons_with_light);
    let _ = writeln!(s, "\n  | PMTs lit | muons | triggered | efficiency |\n  | --- | ---: | ---: | ---: |");
    for e in &r.efficiency {
        let bin =
            if e.max_pmts == 0 { format!("{}+", e.min_pmts) } else { format!("{}-{}", e.min_pmts, e.max_pmts - 1) };
        let _ = writeln!(s, "  | {bin} | {} | {} | {:.1}% |", e.muons, e.detected, 100.0 * e.efficiency);
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "  events           {} ({:.2} Hz), background {} ({:.2} Hz)",
        r.events, r.event_rate_hz, r.background_events, r.background_rate_hz
    );
    let _ = writeln!(
        s,
        "  purity           {:.1}% of events contain muon light; {:.1}% of triggered hits are muon light",
        100.0 * r.event_purity,
        100.0 * r.hit_purity
    );
    let _ = writeln!(
        s,
        "  data reduction   {} hit bytes in, {} event bytes out: factor {:.0}",
        r.input_bytes, r.output_bytes, r.reduction
    );
    let _ = writeln!(
        s,
        "  filter speed     {:.1} M hits/s on one core ({:.2} s for {:.2} s of data)",
        r.filter_hits_per_s / 1e6,
        r.filter_seconds,
        r.seconds
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MuonConfig;
    use shoal_detector::geometry::Geometry;
    use shoal_detector::physics::PhysicsConfig;

    #[test]
    fn bright_muons_are_found_and_noise_is_reduced() {
        // One string, high muon rate so that a short run has statistics.
        let g = Geometry::antares(1, 30);
        let cfg = PhysicsConfig { muon_rate_hz: 400.0, burst_fraction: 0.0, ..Default::default() };
        let generator = PhysicsGenerator::new(cfg, g.clone(), core::time::Duration::from_millis(10)).unwrap();
        let mut f = MuonFilter::new(MuonConfig::default(), g);
        let r = evaluate(&generator, &mut f, 1000, 30);
        assert!(r.muons > 50, "{r:?}");
        // Muons lighting 20 PMTs or more are found; those lighting one PMT cannot be.
        let (n, d) =
            r.efficiency.iter().filter(|e| e.min_pmts >= 20).fold((0, 0), |(n, d), e| (n + e.muons, d + e.detected));
        assert!(n > 0 && d * 2 > n, "{:?}", r.efficiency);
        assert_eq!(r.efficiency[0].detected, 0, "{:?}", r.efficiency);
        assert!(r.reduction > 10.0, "{r:?}");
        assert!(r.event_purity > 0.5, "{r:?}");
    }
}
