//! Files a run and a sweep write: summary JSON, per-fragment CSV, SVG plots, and the
//! comparison table (Markdown + CSV) of a sweep.

use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::plot;
use crate::scenario::Scenario;
use crate::sim::{SimResult, SimSummary, run};

/// Writes `<name>.summary.json`, `<name>.fragments.csv`, `<name>.delay.svg` and (with
/// bursts) `<name>.bursts.svg` into `dir`; returns the paths.
pub fn write_run(r: &SimResult, dir: &Path, name: &str, records: bool) -> std::io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut paths = Vec::new();
    let p = dir.join(format!("{name}.summary.json"));
    std::fs::write(&p, serde_json::to_vec_pretty(&r.summary)?)?;
    paths.push(p);

    if records {
        paths.push(write_records(r, &dir.join(format!("{name}.fragments.csv")))?);
    }
    write_plots(r, dir, name, &mut paths)?;
    Ok(paths)
}

fn write_records(r: &SimResult, p: &Path) -> std::io::Result<PathBuf> {
    let mut f = BufWriter::new(std::fs::File::create(p)?);
    writeln!(f, "source,slice,builder,bytes,burst,cut_off,ready_ns,sent_ns,arrived_ns")?;
    for x in &r.records {
        writeln!(
            f,
            "{},{},{},{},{},{},{},{},{}",
            x.source,
            x.slice,
            x.builder,
            x.bytes,
            u8::from(x.burst),
            u8::from(x.cut_off),
            x.ready_ns,
            x.sent_ns,
            x.arrived_ns
        )?;
    }
    f.flush()?;
    Ok(p.to_path_buf())
}

fn write_plots(r: &SimResult, dir: &Path, name: &str, paths: &mut Vec<PathBuf>) -> std::io::Result<()> {
    // Per slice: mean and maximum network delay, mean shaping delay (ms).
    let mut per: BTreeMap<u64, (f64, f64, u32, f64)> = BTreeMap::new();
    for x in r.records.iter().filter(|x| x.arrived_ns > 0 && x.sent_ns > 0) {
        let e = per.entry(x.slice).or_default();
        let d = (x.arrived_ns - x.sent_ns) as f64 / 1e6;
        e.0 += d;
        e.1 = e.1.max(d);
        e.2 += 1;
        e.3 += x.sent_ns.saturating_sub(x.ready_ns) as f64 / 1e6;
    }
    let mean: Vec<(f64, f64)> = per.iter().map(|(&s, e)| (s as f64, e.0 / f64::from(e.2))).collect();
    let max: Vec<(f64, f64)> = per.iter().map(|(&s, e)| (s as f64, e.1)).collect();
    let shaping: Vec<(f64, f64)> = per.iter().map(|(&s, e)| (s as f64, e.3 / f64::from(e.2))).collect();
    let svg = plot::lines(
        &format!("{name}: network delay per slice"),
        "slice",
        "delay (ms, log)",
        &[("network mean".into(), mean), ("network max".into(), max), ("shaping mean".into(), shaping)],
        true,
    );
    let p = dir.join(format!("{name}.delay.svg"));
    std::fs::write(&p, svg)?;
    paths.push(p);

    if !r.summary.burst_histogram.is_empty() {
        let items: Vec<(String, f64)> =
            r.summary.burst_histogram.iter().enumerate().map(|(k, &c)| (k.to_string(), c as f64)).collect();
        let last = items.iter().rposition(|i| i.1 > 0.0).unwrap_or(0);
        let svg = plot::bars(
            &format!("{name}: boards in burst per slice (mean {:.1}%)", r.summary.burst_mean_fraction * 100.0),
            "slices",
            &items[..=last.max(1).min(items.len() - 1)],
            false,
        );
        let p = dir.join(format!("{name}.bursts.svg"));
        std::fs::write(&p, svg)?;
        paths.push(p);
    }
    Ok(())
}

fn pct(v: f64) -> String {
    if v == 0.0 { "0".into() } else { format!("{:.3}%", v * 100.0) }
}

/// The comparison table of a sweep, one row per scenario.
pub fn markdown_table(rows: &[SimSummary]) -> String {
    let mut s = String::from(
        "| scenario | transport | policy | sources x builders | fragment B | net delay avg / p99 / max (ms) | shaping delay avg (ms) | TCP retransmitted | UDP fragments lost | slices complete (of produced) | queue drops | ledger unaccounted | sim wall (s) | M events/s |\n\
         | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for r in rows {
        // Over the slices produced: a slice no builder ever saw is not complete.
        let complete = if r.slices > 0 { r.slices_complete as f64 / r.slices as f64 } else { 0.0 };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} x {} | {} | {:.2} / {:.2} / {:.2} | {:.1} | {} | {} | {} | {} | {} | {:.1} | {:.1} |",
            r.name,
            r.transport,
            r.policy,
            r.sources,
            r.builders,
            r.fragment_bytes,
            r.network_delay_avg_us / 1e3,
            r.network_delay_p99_us / 1e3,
            r.network_delay_max_us / 1e3,
            r.shaping_delay_avg_us / 1e3,
            if r.transport == "tcp" { pct(r.tcp_retransmit_fraction) } else { "-".into() },
            if r.transport == "udp" { pct(r.udp_fragment_loss_fraction) } else { "-".into() },
            pct(complete),
            r.queue_drops,
            r.ledger_unaccounted,
            r.wall_s,
            r.events as f64 / r.wall_s.max(1e-9) / 1e6
        );
    }
    s
}

fn csv_table(rows: &[SimSummary]) -> String {
    let mut s = String::from(
        "scenario,transport,policy,sources,builders,fragment_bytes,delay_avg_us,delay_p99_us,delay_max_us,shaping_avg_us,tcp_retransmit_fraction,udp_fragment_loss_fraction,slices_complete,slices_incomplete,queue_drops,damaged_packets,unaccounted,events,wall_s\n",
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{},{},{},{},{},{},{:.1},{:.1},{:.1},{:.1},{:.6},{:.6},{},{},{},{},{},{},{:.2}",
            r.name,
            r.transport,
            r.policy,
            r.sources,
            r.builders,
            r.fragment_bytes,
            r.network_delay_avg_us,
            r.network_delay_p99_us,
            r.network_delay_max_us,
            r.shaping_delay_avg_us,
            r.tcp_retransmit_fraction,
            r.udp_fragment_loss_fraction,
            r.slices_complete,
            r.slices_incomplete,
            r.queue_drops,
            r.damaged_packets,
            r.ledger_unaccounted,
            r.events,
            r.wall_s
        );
    }
    s
}

use std::fmt::Write as _;

/// Runs every `*.toml` in `dir` on `threads` threads; writes each run's files into
/// `out/<stem>/`, and `out/sweep.md`, `out/sweep.csv`, `out/sweep.svg`. Returns the
/// summaries in file-name order.
pub fn sweep(
    dir: &Path,
    out: &Path,
    threads: usize,
    records: bool,
    progress: &(dyn Fn(&str, &SimSummary) + Sync),
) -> Result<Vec<SimSummary>, String> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!("no .toml scenario in {}", dir.display()));
    }
    let scenarios: Vec<(String, Scenario)> = files
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
            let mut sc = Scenario::from_toml(&text).map_err(|e| format!("{}: {e}", p.display()))?;
            let stem = p.file_stem().unwrap_or_default().to_string_lossy().into_owned();
            // Rows, plots and directories are named after the file.
            sc.name = stem.clone();
            Ok((stem, sc))
        })
        .collect::<Result<_, String>>()?;
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<SimSummary, String>>>> = Mutex::new(vec![None; scenarios.len()]);
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some((stem, sc)) = scenarios.get(i) else { return };
                    let r = run(sc).and_then(|r| {
                        write_run(&r, &out.join(stem), stem, records).map_err(|e| format!("{stem}: {e}"))?;
                        Ok(r.summary)
                    });
                    if let Ok(summary) = &r {
                        progress(stem, summary);
                    }
                    results.lock().expect("no poisoned lock")[i] = Some(r);
                }
            });
        }
    });
    let rows: Vec<SimSummary> = results
        .into_inner()
        .expect("no poisoned lock")
        .into_iter()
        .map(|r| r.expect("every scenario ran"))
        .collect::<Result<_, _>>()?;
    std::fs::create_dir_all(out).map_err(|e| e.to_string())?;
    std::fs::write(out.join("sweep.md"), markdown_table(&rows)).map_err(|e| e.to_string())?;
    std::fs::write(out.join("sweep.csv"), csv_table(&rows)).map_err(|e| e.to_string())?;
    let items: Vec<(String, f64)> = rows.iter().map(|r| (r.name.clone(), r.network_delay_p99_us / 1e3)).collect();
    std::fs::write(
        out.join("sweep.svg"),
        plot::bars("99th percentile network delay per scenario", "ms (log)", &items, true),
    )
    .map_err(|e| e.to_string())?;
    Ok(rows)
}
