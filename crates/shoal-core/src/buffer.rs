//! The writer's disk as a buffer in front of the archive: how full it is, how fast the
//! run fills it, and so how long the run can go on if nothing leaves it (its autonomy).
//! Sans-IO: the runtime samples the file system (`statvfs`) and the bytes written, with
//! the time; this says where the disk stands.
//!
//! Levels, as the field's storage managers name them: below 75 % used all is well; at 75 %
//! a warning, at 90 % an alert, at 95 % the run should be throttled (the last 5 % keep the
//! files being written whole).

use crate::{Duration, Instant};

/// How full the buffer is, by threshold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum BufferLevel {
    Ok,
    /// 75 % used or more.
    Warning,
    /// 90 % or more.
    Alert,
    /// 95 % or more.
    Throttle,
}

impl BufferLevel {
    pub fn of(used_ratio: f64) -> Self {
        match used_ratio {
            r if r >= 0.95 => BufferLevel::Throttle,
            r if r >= 0.90 => BufferLevel::Alert,
            r if r >= 0.75 => BufferLevel::Warning,
            _ => BufferLevel::Ok,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            BufferLevel::Ok => "ok",
            BufferLevel::Warning => "warning",
            BufferLevel::Alert => "alert",
            BufferLevel::Throttle => "throttle",
        }
    }

    /// 0 to 3, for a gauge.
    pub fn index(self) -> u8 {
        self as u8
    }
}

/// One look at the disk.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DiskSample {
    pub at: Instant,
    /// Bytes free to this process (what `statvfs` gives unprivileged writers).
    pub free: u64,
    pub total: u64,
    /// Bytes used on the file system (`total - free`): what fills it, whoever writes; a
    /// fall (the archiver deleting safe copies) counts as no filling.
    pub written: u64,
}

/// What the watch says now.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BufferState {
    pub free: u64,
    pub total: u64,
    pub used_ratio: f64,
    /// Bytes a second the writer fills the disk with, smoothed.
    pub write_rate: f64,
    /// Free bytes over the write rate (none: nothing is being written).
    pub autonomy: Option<Duration>,
    pub level: BufferLevel,
}

/// The writer's disk, watched. See the module documentation.
#[derive(Clone, Debug, Default)]
pub struct BufferWatch {
    last: Option<DiskSample>,
    /// Smoothed write rate, bytes a second.
    rate: f64,
    level: Option<BufferLevel>,
}

/// How quickly the smoothed rate follows the measured one: the weight of a sample one
/// second long (a run's rate over about the last ten seconds).
const RATE_WEIGHT_PER_SECOND: f64 = 0.1;

impl BufferWatch {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes a sample; the state, and the level when it changed since the last sample
    /// (for a warning in the log at each crossing).
    pub fn handle_sample(&mut self, s: DiskSample) -> (BufferState, Option<BufferLevel>) {
        if let Some(last) = self.last
            && s.at > last.at
        {
            let dt = s.at.saturating_duration_since(last.at).as_secs_f64();
            let measured = s.written.saturating_sub(last.written) as f64 / dt;
            let w = (RATE_WEIGHT_PER_SECOND * dt).min(1.0);
            self.rate = if self.rate == 0.0 { measured } else { self.rate + w * (measured - self.rate) };
        }
        self.last = Some(s);
        let used_ratio = if s.total == 0 { 0.0 } else { 1.0 - s.free as f64 / s.total as f64 };
        let level = BufferLevel::of(used_ratio);
        let changed = (self.level != Some(level)).then_some(level);
        self.level = Some(level);
        let autonomy = (self.rate > 0.0).then(|| Duration::from_secs_f64((s.free as f64 / self.rate).min(1e12)));
        (BufferState { free: s.free, total: s.total, used_ratio, write_rate: self.rate, autonomy, level }, changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: u64) -> Instant {
        Instant::from_nanos(s * 1_000_000_000)
    }

    #[test]
    fn autonomy_is_free_bytes_over_the_write_rate_and_levels_cross_at_75_90_95() {
        let mut w = BufferWatch::new();
        let total = 1_000_000_000;
        let (s, changed) = w.handle_sample(DiskSample { at: at(0), free: 500_000_000, total, written: 0 });
        assert_eq!((s.level, changed, s.autonomy), (BufferLevel::Ok, Some(BufferLevel::Ok), None));
        // 10 MB/s for a while: 490 MB free is 49 s.
        let mut written = 0;
        let mut free = 500_000_000;
        let mut last = s;
        for t in 1..=20 {
            written += 10_000_000;
            free -= 10_000_000;
            last = w.handle_sample(DiskSample { at: at(t), free, total, written }).0;
        }
        assert!((last.write_rate - 1e7).abs() < 1.0, "{last:?}");
        assert_eq!(last.autonomy.unwrap().as_secs(), free / 10_000_000);
        let levels: Vec<_> = [0.74, 0.75, 0.80, 0.90, 0.95, 0.96, 0.5]
            .iter()
            .enumerate()
            .map(|(i, used)| {
                let free = ((1.0 - used) * total as f64) as u64;
                w.handle_sample(DiskSample { at: at(30 + i as u64), free, total, written }).1
            })
            .collect();
        use BufferLevel::*;
        assert_eq!(levels, [None, Some(Warning), None, Some(Alert), Some(Throttle), None, Some(Ok)]);
        assert_eq!(Throttle.name(), "throttle");
    }
}
