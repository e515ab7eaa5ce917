//! KM3NeT's formats, sans-IO (issue 31, in progress): the CLB's optical packets
//! ([`clb`]) and the DataQueue that reassembles them into one frame per DOM and
//! timeslice ([`dataqueue`]), and the JDAQTimeslice codec ([`jdaq`]). Checked with
//! km3pipe's readers by tests/python/test_km3net.py. Not built yet: the `clb:` input
//! socket driving the DataQueue in a source, JDAQEvent and JDAQSummaryslice, publishing
//! on `IO_*` through the dispatcher (docs/km3net.md).

pub mod clb;
pub mod dataqueue;
pub mod jdaq;
