//! `shoal trigger-eval`: the muon filter on generated data with ground truth.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use shoal_detector::geometry::Geometry;
use shoal_detector::physics::{PhysicsConfig, PhysicsGenerator};
use shoal_trigger::eval::{evaluate, table};
use shoal_trigger::muon::{L1Kind, MuonConfig, MuonFilter};

#[derive(Parser)]
pub struct EvalArgs {
    /// Slices to generate and filter.
    #[arg(long, default_value_t = 300)]
    slices: u64,
    /// Slice length, ms.
    #[arg(long, default_value_t = 10)]
    slice_ms: u64,
    /// Strings of the ANTARES-like detector (30 floors x 3 OMs each).
    #[arg(long, default_value_t = 10)]
    strings: u32,
    /// A KM3NeT `.detx` geometry instead (KM3NeT generator flavour and L1 definition).
    #[arg(long)]
    detx: Option<PathBuf>,
    /// K-40 singles rate per PMT, kHz (default: 70 ANTARES, 7 KM3NeT).
    #[arg(long)]
    rate_khz: Option<f64>,
    /// Atmospheric muons crossing the generation disk, Hz.
    #[arg(long)]
    muon_hz: Option<f64>,
    /// Bioluminescence bursts off (they are on by default, 5% of the time).
    #[arg(long)]
    no_bursts: bool,
    /// Confirm clusters with the direction scan (always on with --detx).
    #[arg(long)]
    direction_scan: bool,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The physics generator's version (`[source.physics] version`; default: the latest).
    #[arg(long)]
    generator_version: Option<u32>,
    /// Exit with status 3 if the data reduction is below this factor.
    #[arg(long)]
    min_reduction: Option<f64>,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn eval(args: EvalArgs) -> anyhow::Result<ExitCode> {
    let (geometry, mut physics, mut muon) = match &args.detx {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            let g = Geometry::from_detx(&text)?;
            let mut m = MuonConfig { geometry: path.display().to_string(), ..Default::default() };
            m.l1.kind = L1Kind::Km3net;
            m.l1.window_ns = 25;
            // Small PMTs: a burst shows at tens of kHz, not hundreds.
            m.rate_veto_hz = 20_000.0;
            m.window_ns = 5_000;
            m.min_hits = 5;
            m.min_modules = 5;
            (g, PhysicsConfig::km3net(), m)
        }
        None => (Geometry::antares(args.strings, 30), PhysicsConfig::default(), MuonConfig::default()),
    };
    physics.seed = args.seed;
    physics.waveform_hz = 0.0;
    if let Some(v) = args.generator_version {
        physics.version = v;
    }
    if let Some(r) = args.rate_khz {
        physics.singles_hz = r * 1e3;
    }
    if let Some(m) = args.muon_hz {
        physics.muon_rate_hz = m;
    }
    if args.no_bursts {
        physics.burst_fraction = 0.0;
    }
    // KM3NeT-sized detectors need the direction scan: over hundreds of metres almost any
    // pair of L1 hits within microseconds passes the plain 3D causality test.
    muon.direction_scan = args.direction_scan || args.detx.is_some();
    let generator = PhysicsGenerator::new(physics, geometry.clone(), std::time::Duration::from_millis(args.slice_ms))?;
    let mut filter = MuonFilter::new(muon, geometry);
    // Slices far from zero, as in a real run (slice numbers count from the UNIX epoch).
    let first = 170_000_000_000 + args.seed * 1_000_000;
    let report = evaluate(&generator, &mut filter, first, args.slices);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", table(&report));
    }
    if let Some(min) = args.min_reduction
        && report.reduction < min
    {
        eprintln!("error: data reduction {:.0} is below the required {min}", report.reduction);
        return Ok(ExitCode::from(3));
    }
    Ok(ExitCode::SUCCESS)
}
