//! A readout program in Rust: the source SDK's documented example (docs/sdk.md), run by
//! `make test` (tests/python/test_sdk.py) beside the C and Python ones.
//!
//! ```sh
//! readout CONFIG.toml FIRST_SOURCE N_SOURCES SLICES SLICE_MS
//! ```
//!
//! CONFIG.toml is any shoal configuration whose `[source] ids` are the boards this program
//! reads and whose `input_time_base` is `"run"`. Each board's fragment of each slice is
//! submitted with its data time; at the end the program flushes, closes and prints the
//! end-of-run report (JSON) on stdout. The payloads are examples/c/pattern.h's.

use std::time::Duration;

use bytes::Bytes;
use shoal_core::ingest::{IngestError, When};
use shoal_net::sdk::SourceHandle;

/// examples/c/pattern.h: the payload of (source, slice).
fn pattern(source: u32, slice: u64) -> Vec<u8> {
    let len = 100 + ((slice * 37 + u64::from(source) * 101) % 3000) as usize;
    (0..len).map(|i| (i as u64 ^ slice.wrapping_mul(31) ^ (u64::from(source) << 3)) as u8).collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [config, first, n, slices, slice_ms] = args.as_slice() else {
        return Err("usage: readout CONFIG.toml FIRST_SOURCE N_SOURCES SLICES SLICE_MS".into());
    };
    let (first, n): (u32, u32) = (first.parse()?, n.parse()?);
    let (slices, slice_ns): (u64, u64) = (slices.parse()?, slice_ms.parse::<u64>()? * 1_000_000);

    let source = SourceHandle::open_file(std::path::Path::new(config))?;
    eprintln!("readout: run starts at slice {}", source.first_slice());
    for slice in 0..slices {
        for board in first..first + n {
            // The board's time of its data: somewhere inside the slice.
            let t = slice * slice_ns + u64::from(board) * 1000;
            match source.submit(board, When::TimeNs(t), Bytes::from(pattern(board, slice))) {
                Ok(_) => {}
                // Refused fragments are counted in the report; the run goes on.
                Err(e @ (IngestError::UnknownSource(_) | IngestError::TooLarge { .. })) => eprintln!("readout: {e}"),
                Err(e) => return Err(e.into()),
            }
        }
    }
    if !source.flush(Duration::from_secs(60)) {
        eprintln!("readout: data still on its way after 60 s");
    }
    let report = source.close()?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}
