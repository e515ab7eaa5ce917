//! KM3NeT's formats and DAQ steps, sans-IO: the CLB's optical packets ([`clb`]), the
//! DataQueue that reassembles them into one frame per DOM and timeslice ([`dataqueue`]),
//! the JDAQ codecs (timeslice, superframe, event, summaryslice: [`jdaq`]) and what the
//! DataFilter derives from a complete timeslice ([`datafilter`]: L1 and SN hits, rates).
//! The runtime drives them from shoal-net (`source.input = "clb:ADDR"`, the builder's
//! `km3out`); tests/python/test_km3net.py checks them with km3pipe's readers
//! (docs/km3net.md).

pub mod clb;
pub mod datafilter;
pub mod dataqueue;
pub mod jdaq;
