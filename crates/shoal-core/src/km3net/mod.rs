//! KM3NeT's formats, sans-IO (issue 31, in progress): the CLB's optical packets
//! ([`clb`]) and the DataQueue that reassembles them into one frame per DOM and
//! timeslice ([`dataqueue`]). Not built yet: the `clb:` input socket driving them, the
//! emulator, the JDAQ encoders and the checks with km3pipe's readers.

pub mod clb;
pub mod dataqueue;
pub mod jdaq;
