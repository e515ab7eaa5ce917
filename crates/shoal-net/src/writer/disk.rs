//! The writer's disk watched while a run writes to it (`shoal_core::buffer`): every
//! second its free bytes (`statvfs` of `writer.out_dir`), the rate it fills, the hours of
//! autonomy left; a warning in the log at each threshold crossed (75, 90, 95 % used), and
//! the figures on `/metrics` (`shoal_writer_disk_*`) for the alerting rules and the UI.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use shoal_core::buffer::{BufferLevel, BufferWatch, DiskSample};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::live::Live;

/// Watches `dir`'s file system until `cancel`.
pub fn watch(dir: PathBuf, live: Arc<Live>, cancel: CancellationToken) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let began = std::time::Instant::now();
        let mut w = BufferWatch::new();
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = cancel.cancelled() => return,
            }
            let Ok(fs) = nix::sys::statvfs::statvfs(&dir) else { continue };
            let unit = fs.fragment_size().max(1);
            let (free, total) = (fs.blocks_available() * unit, fs.blocks() * unit);
            let at = shoal_core::Instant::from_nanos(began.elapsed().as_nanos() as u64);
            let (state, crossed) = w.handle_sample(DiskSample { at, free, total, written: total.saturating_sub(free) });
            live.disk_free_bytes.store(free, Ordering::Relaxed);
            live.disk_total_bytes.store(total, Ordering::Relaxed);
            live.disk_autonomy_s.store(state.autonomy.map_or(u64::MAX, |a| a.as_secs()), Ordering::Relaxed);
            live.disk_level.store(u64::from(state.level.index()), Ordering::Relaxed);
            let hours = state.autonomy.map(|a| a.as_secs_f64() / 3600.0);
            let used = format!("{:.1} %", 100.0 * state.used_ratio);
            match crossed {
                Some(BufferLevel::Ok) if at > shoal_core::Instant::ZERO => {
                    info!(dir = %dir.display(), %used, "the writer's disk is below 75 % again")
                }
                Some(BufferLevel::Ok) | None => {}
                Some(level) => warn!(
                    dir = %dir.display(), %used, free, autonomy_hours = ?hours, level = level.name(),
                    "the writer's disk is filling: free space or let the archive delete safe copies (docs/archive.md)"
                ),
            }
        }
    })
}

/// `shoal_writer_disk_*` on `/metrics` (a writer that has watched its disk).
pub fn register_metrics(reg: &mut prometheus_client::registry::Registry, labels: &[(String, String)], live: &Live) {
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    let total = Live::get(&live.disk_total_bytes);
    if total == 0 {
        return;
    }
    let free = Live::get(&live.disk_free_bytes);
    let gauge = |v: i64| {
        let f = Family::<Vec<(String, String)>, Gauge>::default();
        f.get_or_create(&labels.to_vec()).set(v);
        f
    };
    reg.register("shoal_writer_disk_free_bytes", "Bytes free on the writer's output file system", gauge(free as i64));
    reg.register("shoal_writer_disk_total_bytes", "Size of the writer's output file system", gauge(total as i64));
    let autonomy = Live::get(&live.disk_autonomy_s);
    reg.register(
        "shoal_writer_disk_autonomy_seconds",
        "Free bytes over the rate the disk fills: how long the run can go on if nothing leaves it (-1: not filling)",
        gauge(if autonomy == u64::MAX { -1 } else { autonomy as i64 }),
    );
    reg.register(
        "shoal_writer_disk_level",
        "0 below 75 % used, 1 from 75 % (warning), 2 from 90 % (alert), 3 from 95 % (throttle)",
        gauge(Live::get(&live.disk_level) as i64),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The watch reads the output directory's file system and its figures reach /metrics.
    #[tokio::test]
    async fn the_disk_s_figures_reach_the_metrics() {
        let dir = std::env::temp_dir();
        let live = Arc::new(Live::default());
        let cancel = CancellationToken::new();
        let task = watch(dir, live.clone(), cancel.clone());
        // Bounded: the first sample is taken at once (the interval's first tick).
        let began = std::time::Instant::now();
        while Live::get(&live.disk_total_bytes) == 0 {
            assert!(began.elapsed() < std::time::Duration::from_secs(60), "no sample of the disk");
            tokio::task::yield_now().await;
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        cancel.cancel();
        task.await.unwrap();
        let mut reg = prometheus_client::registry::Registry::default();
        register_metrics(&mut reg, &[("name".into(), "writer".into())], &live);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        for name in ["free_bytes", "total_bytes", "autonomy_seconds", "level"] {
            assert!(text.contains(&format!("shoal_writer_disk_{name}{{name=\"writer\"}}")), "{name}: {text}");
        }
        assert!(Live::get(&live.disk_free_bytes) <= Live::get(&live.disk_total_bytes));
    }
}
