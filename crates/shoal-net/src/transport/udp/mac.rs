//! The datagram transport's MAC under `[security] data` (`run.transport = "udp"`): every
//! datagram, both ways, ends with a 16-byte tag, BLAKE3 in keyed mode over everything
//! before it under the run's key. Run control draws a fresh 256-bit key from the OS's
//! random source for every run and hands it out with CONFIGURE (`[security] udp_key`), which
//! on a secured cluster only the processes' authenticated control connections receive. A
//! datagram whose tag does not verify (a stranger's, or one altered on the way) is dropped
//! and counted before anything reads it.
//!
//! The key is the run's, not a source's: it keeps out whoever is not of the cluster; which
//! source a datagram speaks for is what it says (the TCP path binds that to the
//! certificate, docs/security.md).

/// Bytes of the tag at a datagram's end.
pub const TAG_LEN: usize = 16;

/// A run's datagram key.
#[derive(Clone)]
pub struct DatagramMac {
    key: [u8; 32],
}

impl std::fmt::Debug for DatagramMac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DatagramMac")
    }
}

/// Why a key was refused.
#[derive(Debug, thiserror::Error)]
#[error("security.udp_key must be 64 hex digits (a 256-bit key), not {0} characters")]
pub struct BadKey(usize);

impl DatagramMac {
    /// From the configuration's hex text.
    pub fn from_hex(text: &str) -> Result<Self, BadKey> {
        let bytes = text.as_bytes();
        if bytes.len() != 64 || !bytes.iter().all(u8::is_ascii_hexdigit) {
            return Err(BadKey(bytes.len()));
        }
        let mut key = [0u8; 32];
        for (i, k) in key.iter_mut().enumerate() {
            *k = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).map_err(|_| BadKey(bytes.len()))?;
        }
        Ok(Self { key })
    }

    /// A fresh key from the OS's random source, as hex (run control's, the demo's).
    pub fn new_key_hex() -> std::io::Result<String> {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(|e| std::io::Error::other(format!("no randomness for a UDP key: {e}")))?;
        Ok(key.iter().map(|b| format!("{b:02x}")).collect())
    }

    fn tag(&self, data: &[u8]) -> [u8; TAG_LEN] {
        let full = blake3::keyed_hash(&self.key, data);
        full.as_bytes()[..TAG_LEN].try_into().expect("16 of 32 bytes")
    }

    /// `datagram` with its tag appended.
    pub fn seal(&self, datagram: &[u8]) -> bytes::Bytes {
        let mut out = Vec::with_capacity(datagram.len() + TAG_LEN);
        out.extend_from_slice(datagram);
        out.extend_from_slice(&self.tag(datagram));
        out.into()
    }

    /// The datagram without its tag, if the tag verifies.
    pub fn open(&self, sealed: &bytes::Bytes) -> Option<bytes::Bytes> {
        let body = sealed.len().checked_sub(TAG_LEN)?;
        let want = self.tag(&sealed[..body]);
        // Compared without an early exit: the time taken does not say how much matched.
        let diff = want.iter().zip(&sealed[body..]).fold(0u8, |acc, (a, b)| acc | (a ^ b));
        (diff == 0).then(|| sealed.slice(..body))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_datagram_opens_under_its_key_only_and_not_once_altered() {
        let mac = DatagramMac::from_hex(&DatagramMac::new_key_hex().unwrap()).unwrap();
        let other = DatagramMac::from_hex(&DatagramMac::new_key_hex().unwrap()).unwrap();
        let sealed = mac.seal(b"a datagram");
        assert_eq!(sealed.len(), 10 + TAG_LEN);
        assert_eq!(&mac.open(&sealed).unwrap()[..], b"a datagram");
        assert!(other.open(&sealed).is_none(), "another run's key");
        for i in 0..sealed.len() {
            let mut altered = sealed.to_vec();
            altered[i] ^= 1;
            assert!(mac.open(&altered.into()).is_none(), "byte {i} altered");
        }
        assert!(mac.open(&bytes::Bytes::from_static(b"short")).is_none());
        assert!(DatagramMac::from_hex("00").is_err() && DatagramMac::from_hex(&"g".repeat(64)).is_err());
    }
}
