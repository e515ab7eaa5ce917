//! Helpers shared by the integration tests: a small run on loopback.

#![allow(dead_code)]

use std::sync::Arc;

use shoal_net::clock::WallClock;
use shoal_net::config::Config;
use shoal_net::live::Live;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// A small configuration: `sources` x `builders`, short slices, `seconds` of data.
pub fn small_config(sources: u32, builders: u32, seconds: f64, out: &std::path::Path) -> Config {
    let mut cfg = Config::default();
    cfg.run.sources = sources;
    cfg.run.builders = builders;
    cfg.run.seconds = seconds;
    cfg.run.slice_ms = 10;
    cfg.source.noise.rate_hz = 20_000.0;
    cfg.source.noise.waveform_rate_hz = 100.0;
    cfg.builder.drain_timeout_ms = 5_000;
    cfg.writer.out_dir = out.to_path_buf();
    cfg
}

pub fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("shoal-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Binds a writer and the builders on ephemeral ports and fills their addresses in.
/// The writer's listener and each builder's data port (with its UDP socket for the
/// datagram transport), on ports the kernel picks.
pub async fn bind_all(cfg: &mut Config) -> (TcpListener, Vec<shoal_net::transport::listen::DataPort>) {
    let w = TcpListener::bind("127.0.0.1:0").await.unwrap();
    cfg.run.writer_addr = w.local_addr().unwrap().to_string();
    let mut bs = Vec::new();
    cfg.run.builder_addrs.clear();
    for _ in 0..cfg.run.builders {
        let l = shoal_net::builder::bind_port(cfg, "127.0.0.1:0".parse().unwrap()).unwrap();
        cfg.run.builder_addrs.push(l.local_addr().unwrap().to_string());
        bs.push(l);
    }
    (w, bs)
}

pub fn live() -> Arc<Live> {
    Arc::new(Live::default())
}

pub fn clock() -> WallClock {
    WallClock::new()
}

pub fn never() -> CancellationToken {
    CancellationToken::new()
}
