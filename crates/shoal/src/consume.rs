//! `shoal consume --builder N`: attach to a builder's shared-memory slice ring and print
//! what arrives (the debugging tap and the reference client of docs/plugins.md).

use std::time::Duration;

use anyhow::Context;
use shoal_core::hit::HitPayload;
use shoal_shm::{ConsumerOptions, Next, Policy, SliceConsumer};

#[derive(clap::Args)]
pub struct ConsumeArgs {
    /// The builder's id.
    #[arg(long, default_value_t = 0)]
    builder: u32,
    /// The socket name template (`builder.consumers.socket`; `{builder}` is replaced).
    #[arg(long)]
    socket: Option<String>,
    /// Take the socket template from this configuration (or cluster) file's
    /// `[builder.consumers]`.
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// `hold`: the builder waits up to --hold-ms for each release; `skip`: never waited for.
    #[arg(long, default_value = "skip")]
    policy: String,
    #[arg(long, default_value_t = 1000)]
    hold_ms: u64,
    /// Most slices held at once.
    #[arg(long, default_value_t = 4)]
    window: u32,
    /// Runs to follow (0: until interrupted); between runs it waits for the next one.
    #[arg(long, default_value_t = 1)]
    runs: u64,
    /// How long to wait for the builder to come up, seconds.
    #[arg(long, default_value_t = 30.0)]
    wait_s: f64,
    /// A JSON object per line instead of text.
    #[arg(long)]
    json: bool,
}

fn socket_template(args: &ConsumeArgs) -> anyhow::Result<String> {
    if let Some(s) = &args.socket {
        return Ok(s.clone());
    }
    if let Some(path) = &args.config {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let v: toml::Value = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        // A process configuration, or a cluster file's `[config]` table.
        for root in [Some(&v), v.get("config")].into_iter().flatten() {
            let s = root.get("builder").and_then(|b| b.get("consumers")).and_then(|c| c.get("socket"));
            if let Some(s) = s.and_then(|s| s.as_str()) {
                return Ok(s.to_string());
            }
        }
    }
    Ok(String::new())
}

pub fn run(args: ConsumeArgs) -> anyhow::Result<std::process::ExitCode> {
    let name = shoal_shm::socket_name(&socket_template(&args)?, args.builder);
    let policy = match args.policy.as_str() {
        "hold" => Policy::Hold { max: Duration::from_millis(args.hold_ms) },
        "skip" => Policy::Skip,
        other => anyhow::bail!("--policy {other:?}: expected hold or skip"),
    };
    let opts = ConsumerOptions { policy, window: args.window };
    let mut runs = 0u64;
    while args.runs == 0 || runs < args.runs {
        let mut c = SliceConsumer::connect_within(&name, opts, Duration::from_secs_f64(args.wait_s))
            .with_context(|| format!("attaching to @{name}"))?;
        let run = c.run;
        loop {
            match c.next(None) {
                Ok(Next::Slice(s)) => {
                    let (mut hits, mut bytes, mut malformed) = (0u64, 0u64, 0u64);
                    for f in s.fragments() {
                        bytes += f.payload.len() as u64;
                        match HitPayload::parse(f.payload, f.hit_count) {
                            Ok(_) => hits += f.hit_count as u64,
                            Err(_) => malformed += 1,
                        }
                    }
                    let n = s.fragment_count();
                    let (slice, seq) = (s.slice, s.seq);
                    let intact = s.release();
                    if args.json {
                        println!(
                            "{}",
                            serde_json::json!({"run": run, "builder": c.builder, "slice": slice, "seq": seq,
                                "fragments": n, "hits": hits, "bytes": bytes, "opaque_or_malformed": malformed,
                                "intact": intact})
                        );
                    } else {
                        println!(
                            "run {run} builder {} slice {slice}: {n} fragments, {hits} hits, {bytes} bytes{}",
                            c.builder,
                            if intact { "" } else { " (overrun while read)" }
                        );
                    }
                }
                Ok(Next::End { offered, skipped, overrun }) => {
                    if args.json {
                        println!(
                            "{}",
                            serde_json::json!({"run": run, "builder": c.builder, "end": true, "offered": offered,
                                "skipped": skipped, "overrun": overrun, "lost_before_read": c.lost_before_read})
                        );
                    } else {
                        println!(
                            "end of run {run}: offered {offered}, skipped {skipped}, overrun {overrun} (of them {} before read)",
                            c.lost_before_read
                        );
                    }
                    break;
                }
                Ok(Next::Timeout) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    eprintln!("shoal consume: builder {} went away during run {run}", args.builder);
                    return Ok(std::process::ExitCode::from(1));
                }
                Err(e) => return Err(e).context("reading the slice ring"),
            }
        }
        runs += 1;
    }
    Ok(std::process::ExitCode::SUCCESS)
}
