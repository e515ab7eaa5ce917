//! Hit and waveform records, the content of a data frame's payload.
//!
//! Payload layout (v1): `hit_count` hit records of [`HIT_LEN`] bytes, then zero or more
//! waveform records of [`WAVEFORM_LEN`] bytes. All integers little-endian.
//!
//! - Hit (6 bytes): channel `u8` (PMT / optical module within the source), leading-edge
//!   time `u32` in ns since the slice start, amplitude `u8` (time over threshold in ns or a
//!   charge code).
//! - Waveform (263 bytes, the ANTARES record size): channel `u8`, time `u32`, 258 samples.

use bytes::BufMut;

/// Size of one hit record.
pub const HIT_LEN: usize = 6;
/// Size of one waveform record.
pub const WAVEFORM_LEN: usize = 263;
/// Samples in one waveform record.
pub const WAVEFORM_SAMPLES: usize = WAVEFORM_LEN - 5;

/// One photomultiplier hit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Hit {
    /// Leading-edge time in ns since the slice start (first, so hits sort by time).
    pub time_ns: u32,
    pub channel: u8,
    pub amplitude: u8,
}

impl Hit {
    pub fn encode<B: BufMut>(&self, buf: &mut B) {
        let mut rec = [0u8; HIT_LEN];
        self.write_record(&mut rec);
        buf.put_slice(&rec);
    }

    /// Writes the 6-byte record into `rec` (for filling a preallocated payload).
    pub fn write_record(&self, rec: &mut [u8]) {
        rec[0] = self.channel;
        rec[1..5].copy_from_slice(&self.time_ns.to_le_bytes());
        rec[5] = self.amplitude;
    }

    /// Decodes one record. Inlined, on an array: the filters decode every hit of a slice
    /// through this (a call with six bounds checks per hit was 5 % of the KM3NeT trigger).
    #[inline]
    pub fn from_record(rec: &[u8; HIT_LEN]) -> Hit {
        Hit { channel: rec[0], time_ns: u32::from_le_bytes([rec[1], rec[2], rec[3], rec[4]]), amplitude: rec[5] }
    }
}

/// Why a payload does not hold `hit_count` hits followed by whole waveforms.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    #[error("payload of {len} bytes cannot hold {hit_count} hits")]
    TooShortForHits { len: usize, hit_count: u32 },
    #[error("{rest} bytes after the hits are not a whole number of {WAVEFORM_LEN}-byte waveforms")]
    PartialWaveform { rest: usize },
}

/// A checked view of a hit payload.
#[derive(Clone, Copy, Debug)]
pub struct HitPayload<'a> {
    hits: &'a [u8],
    waveforms: &'a [u8],
}

impl<'a> HitPayload<'a> {
    pub fn parse(payload: &'a [u8], hit_count: u32) -> Result<Self, PayloadError> {
        let hit_bytes = (hit_count as usize)
            .checked_mul(HIT_LEN)
            .filter(|&n| n <= payload.len())
            .ok_or(PayloadError::TooShortForHits { len: payload.len(), hit_count })?;
        let (hits, waveforms) = payload.split_at(hit_bytes);
        if waveforms.len() % WAVEFORM_LEN != 0 {
            return Err(PayloadError::PartialWaveform { rest: waveforms.len() });
        }
        Ok(Self { hits, waveforms })
    }

    pub fn hit_count(&self) -> usize {
        self.hits.len() / HIT_LEN
    }

    pub fn waveform_count(&self) -> usize {
        self.waveforms.len() / WAVEFORM_LEN
    }

    pub fn hits(&self) -> impl ExactSizeIterator<Item = Hit> + 'a {
        self.records().iter().map(Hit::from_record)
    }

    /// The hit records themselves, for reading hits in place (a binary search by time
    /// over records already in order needs no decoded copy).
    pub fn records(&self) -> &'a [[u8; HIT_LEN]] {
        self.hits.as_chunks::<HIT_LEN>().0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_and_waveforms() {
        let mut buf = Vec::new();
        let hits =
            [Hit { channel: 1, time_ns: 5, amplitude: 27 }, Hit { channel: 2, time_ns: 9_999_999, amplitude: 3 }];
        for h in &hits {
            h.encode(&mut buf);
        }
        buf.extend_from_slice(&[0u8; WAVEFORM_LEN]);
        let p = HitPayload::parse(&buf, 2).unwrap();
        assert_eq!(p.hits().collect::<Vec<_>>(), hits);
        assert_eq!(p.waveform_count(), 1);
        assert!(HitPayload::parse(&buf, 50).is_err());
        assert!(HitPayload::parse(&buf[..buf.len() - 1], 2).is_err());
        assert!(HitPayload::parse(&buf, u32::MAX).is_err());
    }
}
