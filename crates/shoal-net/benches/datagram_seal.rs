//! The datagram transport's seal (`[security] data` with `transport = "udp"`) on a full
//! datagram, beside what it replaced and what every datagram costs anyway: AES-256-GCM
//! sealing and opening in place (shoal's), ring's GMAC of the same bytes as associated
//! data, BLAKE3's keyed hash (the first seal), the CRC32C each datagram already carries,
//! and a plain copy. Divide the size by the median for bytes per second.
//!
//! `cargo bench -p shoal-net --bench datagram_seal` (docs/benchmarks.md).

use divan::{Bencher, black_box};
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use shoal_net::transport::udp::mac::{DatagramMac, SEAL_LEN};

fn main() {
    divan::main();
}

/// A full datagram at the default `udp.max_payload` (1,420 + the 52-byte header), and a
/// short one (a NACK's size).
const SIZES: [usize; 2] = [1_472, 120];

const KEY: [u8; 32] = [0x5a; 32];

fn datagram(size: usize) -> Vec<u8> {
    (0..size).map(|i| (i * 7 + 3) as u8).collect()
}

fn mac() -> DatagramMac {
    DatagramMac::from_hex(&"5a".repeat(32)).expect("a key")
}

#[divan::bench(args = SIZES)]
fn seal_aes_gcm(bencher: Bencher, size: usize) {
    let (d, mac) = (datagram(size), mac());
    let mut out = Vec::with_capacity(size + SEAL_LEN);
    bencher.counter(divan::counter::BytesCount::new(size)).bench_local(|| {
        out.clear();
        mac.seal_into(black_box(&d), &mut out);
    });
}

#[divan::bench(args = SIZES)]
fn open_aes_gcm(bencher: Bencher, size: usize) {
    let (d, mac) = (datagram(size), mac());
    let sealed = mac.seal(&d).to_vec();
    let mut buf = sealed.clone();
    bencher.counter(divan::counter::BytesCount::new(size)).bench_local(|| {
        buf.copy_from_slice(&sealed);
        assert!(mac.open_in_place(black_box(&mut buf)).is_some());
    });
}

#[divan::bench(args = SIZES)]
fn gmac_as_associated_data(bencher: Bencher, size: usize) {
    let d = datagram(size);
    let key = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &KEY).expect("a key"));
    let mut n = 0u64;
    bencher.counter(divan::counter::BytesCount::new(size)).bench_local(|| {
        n += 1;
        let mut nonce = [0u8; 12];
        nonce[4..].copy_from_slice(&n.to_le_bytes());
        key.seal_in_place_separate_tag(Nonce::assume_unique_for_key(nonce), Aad::from(black_box(&d[..])), &mut [])
            .expect("sealed")
    });
}

#[divan::bench(args = SIZES)]
fn blake3_keyed(bencher: Bencher, size: usize) {
    let d = datagram(size);
    bencher.counter(divan::counter::BytesCount::new(size)).bench(|| blake3::keyed_hash(&KEY, black_box(&d)));
}

#[divan::bench(args = SIZES)]
fn crc32c(bencher: Bencher, size: usize) {
    let d = datagram(size);
    bencher.counter(divan::counter::BytesCount::new(size)).bench(|| shoal_core::checksum::crc32c(black_box(&d)));
}

#[divan::bench(args = SIZES)]
fn copy(bencher: Bencher, size: usize) {
    let d = datagram(size);
    bencher.counter(divan::counter::BytesCount::new(size)).bench(|| black_box(&d).to_vec());
}
