//! The source SDK's submission benchmark in Rust (scripts/bench_sdk.py runs it).
//!
//! ```sh
//! cargo run --release -p shoal-net --example submit_bench -- CONFIG.toml SOURCE SIZE COUNT [copy|lent]
//! ```
//!
//! Submits COUNT fragments of SIZE bytes for board SOURCE, fragment i into slice
//! first + i, then closes. `copy` (default): each copied from one buffer a readout would
//! reuse (`Bytes::copy_from_slice`). `lent`: from a ring of 256 buffers, as a readout with
//! a DMA ring, handed over without a copy (`Bytes::from_owner`); a buffer goes back to the
//! ring when shoal drops it, and the submitter waits for a free one. Prints one JSON
//! object: submitting and closing times (s) and the end-of-run report.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use bytes::Bytes;
use shoal_core::ingest::When;
use shoal_net::sdk::SourceHandle;

// As shoal's own binary (and libshoal, and the Python module).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const RING: usize = 256;

#[derive(Default)]
struct Ring {
    free: Mutex<Vec<Vec<u8>>>,
    freed: Condvar,
}

/// A ring buffer lent to shoal: back to the ring when dropped.
struct Lent {
    buf: Option<Vec<u8>>,
    ring: Arc<Ring>,
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        self.buf.as_deref().unwrap_or_default()
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.ring.free.lock().unwrap().push(b);
            self.ring.freed.notify_one();
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (config, source, size, count, lent) = match args.as_slice() {
        [c, s, z, n] => (c, s, z, n, false),
        [c, s, z, n, m] => (c, s, z, n, m == "lent"),
        _ => return Err("usage: submit_bench CONFIG.toml SOURCE SIZE COUNT [copy|lent]".into()),
    };
    let (source, size, count): (u32, usize, u64) = (source.parse()?, size.parse()?, count.parse()?);
    let pattern: Vec<u8> = (0..size).map(|i| (i * 7) as u8).collect();
    let ring = Arc::new(Ring::default());
    ring.free.lock().unwrap().extend((0..if lent { RING } else { 1 }).map(|_| pattern.clone()));

    let handle = SourceHandle::open_file(std::path::Path::new(config))?;
    let first = handle.first_slice();
    let t0 = Instant::now();
    for i in 0..count {
        let payload = if lent {
            let mut free = ring.free.lock().unwrap();
            while free.is_empty() {
                free = ring.freed.wait(free).unwrap();
            }
            let mut buf = free.pop().expect("not empty");
            drop(free);
            if let Some(b) = buf.first_mut() {
                *b = i as u8; // the readout's fresh data
            }
            Bytes::from_owner(Lent { buf: Some(buf), ring: ring.clone() })
        } else {
            let mut free = ring.free.lock().unwrap();
            if let Some(b) = free[0].first_mut() {
                *b = i as u8;
            }
            Bytes::copy_from_slice(&free[0])
        };
        handle.submit(source, When::Slice(first + i), payload)?;
    }
    let t1 = Instant::now();
    let report = handle.close()?;
    let t2 = Instant::now();
    println!(
        "{{\"submit_s\": {:.6}, \"close_s\": {:.6}, \"report\": {}}}",
        (t1 - t0).as_secs_f64(),
        (t2 - t1).as_secs_f64(),
        serde_json::to_string(&report)?
    );
    let back = ring.free.lock().unwrap().len();
    if back != if lent { RING } else { 1 } {
        return Err(format!("{back} ring buffers came back").into());
    }
    Ok(())
}
