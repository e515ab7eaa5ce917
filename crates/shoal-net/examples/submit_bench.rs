//! The source SDK's submission benchmark in Rust (scripts/bench_sdk.py runs it).
//!
//! ```sh
//! cargo run --release -p shoal-net --example submit_bench -- CONFIG.toml SOURCE SIZE COUNT
//! ```
//!
//! Submits COUNT fragments of SIZE bytes for board SOURCE, fragment i into slice
//! first + i, each copied from one buffer a readout would reuse (as the C benchmark does
//! through libshoal), then closes. Prints one JSON object: submitting and closing times (s)
//! and the end-of-run report.

use std::time::Instant;

use bytes::Bytes;
use shoal_core::ingest::When;
use shoal_net::sdk::SourceHandle;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [config, source, size, count] = args.as_slice() else {
        return Err("usage: submit_bench CONFIG.toml SOURCE SIZE COUNT".into());
    };
    let (source, size, count): (u32, usize, u64) = (source.parse()?, size.parse()?, count.parse()?);
    let mut buf: Vec<u8> = (0..size).map(|i| (i * 7) as u8).collect();

    let handle = SourceHandle::open_file(std::path::Path::new(config))?;
    let first = handle.first_slice();
    let t0 = Instant::now();
    for i in 0..count {
        if let Some(b) = buf.first_mut() {
            *b = i as u8;
        }
        handle.submit(source, When::Slice(first + i), Bytes::copy_from_slice(&buf))?;
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
    Ok(())
}
