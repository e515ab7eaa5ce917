//! The burst saver beside the assembler, and the channel to its spool thread.

use std::sync::Arc;

use shoal_core::saver::{BurstSaver, SaverOutput};
use shoal_trigger::FragmentData;
use tokio::sync::mpsc;

use crate::builder::settings::SaverSettings;
use crate::builder::spool::{SpoolReport, SpoolWork};
use crate::live::Live;
use crate::transport::link::Link;

/// The burst saver and the channel to its spool thread.
pub(super) struct Saving {
    pub(super) saver: BurstSaver<FragmentData>,
    pub(super) spool: std::sync::mpsc::Sender<SpoolWork>,
    pub(super) live: Arc<Live>,
}

impl Saving {
    /// The burst saver of builder `id` and its spool thread, which ships what it spools on
    /// `writer_link` and reports each write's bytes on `spooled`.
    pub(super) fn start(
        s: SaverSettings,
        id: u32,
        writer_link: &Arc<Link>,
        spooled: mpsc::UnboundedSender<u64>,
        live: &Arc<Live>,
    ) -> (Self, std::thread::JoinHandle<SpoolReport>) {
        let (spool_tx, spool_rx) = std::sync::mpsc::channel();
        let slice_clock = s.spool.slice_clock;
        let thread = crate::builder::spool::spawn(s.spool, writer_link.clone(), spool_rx, spooled);
        let saver = BurstSaver::new(s.saver, id, slice_clock);
        (Self { saver, spool: spool_tx, live: live.clone() }, thread)
    }

    /// Hands what the saver decided to the spool thread; alert reports also go to whoever
    /// listens (the dispatcher in a run-controlled process).
    pub(super) fn drain(&mut self) {
        while let Some(o) = self.saver.poll_output() {
            match &o {
                SaverOutput::Closed(r) => {
                    Live::add(&self.live.alerts_answered, 1);
                    let _ = self.live.alerts.reports.send(r.clone());
                }
                SaverOutput::Fragment { record: shoal_core::saver::Record::Late, .. } => {
                    Live::add(&self.live.late_salvaged, 1);
                }
                SaverOutput::Fragment { .. } => Live::add(&self.live.fragments_saved, 1),
                SaverOutput::Opened { .. } => {}
            }
            if self.spool.send(SpoolWork::Save(o)).is_err() {
                // The spool thread is gone (it ends only after Finish): nothing to do.
                break;
            }
        }
    }
}
