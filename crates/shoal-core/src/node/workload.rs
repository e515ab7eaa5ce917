//! The workload interface: what a source produces for a slice.

use bytes::Bytes;

use crate::SourceId;
use crate::slice::SliceNumber;

/// One source's data for one slice: `hit_count` hit records followed by whole waveform
/// records (the payload of a data frame, see [`crate::hit`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GeneratedFragment {
    pub hit_count: u32,
    pub waveform_count: u32,
    pub payload: Bytes,
    /// The source was in a bioluminescence burst (the burst cutoff acts on it).
    pub burst: bool,
    /// The payload is user data in no format shoal knows (submitted through the source
    /// SDK, `crate::ingest`): sent with [`crate::frame::Flags::OPAQUE`], stored, not
    /// filtered. `hit_count` is then 0.
    pub opaque: bool,
}

impl GeneratedFragment {
    /// A fragment with no data (what a paused source sends).
    pub fn empty() -> Self {
        Self { hit_count: 0, waveform_count: 0, payload: Bytes::new(), burst: false, opaque: false }
    }
}

/// Where a source's data come from. Implementations must be deterministic: the fragment of
/// (source, slice) is the same whichever process or driver asks, in whatever order, so the
/// runtime and the simulator can run the same data and a burst-saver dump can be checked
/// byte for byte.
pub trait Workload {
    fn generate(&self, source: SourceId, slice: SliceNumber) -> GeneratedFragment;
}

impl<W: Workload + ?Sized> Workload for &W {
    fn generate(&self, source: SourceId, slice: SliceNumber) -> GeneratedFragment {
        (**self).generate(source, slice)
    }
}
