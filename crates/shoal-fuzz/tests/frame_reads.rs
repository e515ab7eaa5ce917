//! A builder reads each connection into room made before each read, reads of whatever size
//! the socket gives, and gives its buffer back while it waits (`StreamDecoder::prepare_read`,
//! `release_idle`; shoal-net's `FrameReader`). Whatever the frames and the reads, that must
//! return the frames, and end the stream the way, that decoding the whole stream at once
//! does: the same check as the `frame_reads` fuzz target, here on stable in `make test`.

use proptest::prelude::*;
use shoal_fuzz::{READS_MAX_PAYLOAD, check_builder_reads, stream_and_reads};

#[test]
fn garbage_shorter_than_the_magic_waits_to_be_named() {
    // Two bytes of garbage and the stream ends: cut short, as decoding the whole says, not
    // refused as too short while the magic was not yet visible.
    check_builder_reads(b"GE", &[1], READS_MAX_PAYLOAD).unwrap();
    check_builder_reads(b"GE", &[4096], READS_MAX_PAYLOAD).unwrap();
    // Four bytes are enough to name it.
    check_builder_reads(b"GET / HTTP/1.1\r\n", &[1], READS_MAX_PAYLOAD).unwrap();
}

#[test]
fn large_and_small_frames_through_reads_of_every_size() {
    // Frames of 0, 2.5 kB, 16 kB and 262 kB (sizes 0, 191, 192, 255 in the target's
    // encoding; the last over the 256-kB limit, refused alike both ways), none flipped,
    // the stream whole, read 1 + b * b bytes at a time.
    let mut input = vec![0, 1, 0, 191, 2, 0, 192, 3, 0, 255, 4, 0, 0];
    for b in [8u8, 64, 128, 255, 200, 30] {
        input.push(b);
        let (stream, reads) = stream_and_reads(&input);
        assert!(stream.len() > 280_000);
        check_builder_reads(&stream, &reads, READS_MAX_PAYLOAD).unwrap();
    }
}

/// Frames described as the fuzz target describes them; reads of at least 65 bytes, so that
/// a case stays quick in a debug build (the fuzz target reads single bytes too).
fn input() -> impl Strategy<Value = Vec<u8>> {
    (proptest::collection::vec(any::<u8>(), 0..30), any::<u8>(), proptest::collection::vec(8u8..=255, 0..6)).prop_map(
        |(frames, cut, reads)| {
            let whole = frames.len() - frames.len() % 3;
            let mut v = frames[..whole].to_vec();
            v.push(cut);
            v.extend(reads);
            v
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn reading_as_a_builder_does_returns_what_decoding_the_whole_stream_returns(input in input()) {
        let (stream, reads) = stream_and_reads(&input);
        let checked = check_builder_reads(&stream, &reads, READS_MAX_PAYLOAD);
        prop_assert!(checked.is_ok(), "{:?}", checked);
    }
}
