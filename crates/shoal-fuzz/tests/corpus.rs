//! Replays the committed fuzz corpus and every crash the fuzzers ever found through the
//! targets' bodies on stable: a decoder that panics on any of them fails `make test`.
//! Also a few hand-made inputs per target, so the test exercises every target even with
//! an empty corpus.

use std::path::Path;

fn inputs(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut v: Vec<_> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().is_file())
        .map(|e| (e.path().display().to_string(), std::fs::read(e.path()).unwrap()))
        .collect();
    v.sort();
    v
}

#[test]
fn the_corpus_and_every_regression_replay_without_a_panic() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let mut replayed = 0;
    for (name, target) in shoal_fuzz::TARGETS {
        let mut all = inputs(&root.join("corpus").join(name));
        all.extend(inputs(&root.join("regressions").join(name)));
        // Hand-made: nothing, one byte, a long run of each extreme byte, text.
        for seed in [&b""[..], b"\0", &[0xff; 300], &[0; 300], b"[run]\nsources = 0\n", b"START 1 2"] {
            all.push((format!("{name}: seed {:?}", &seed[..seed.len().min(8)]), seed.to_vec()));
        }
        for (what, bytes) in &all {
            let r = std::panic::catch_unwind(|| target(bytes));
            assert!(r.is_ok(), "{name} panicked on {what}");
            replayed += 1;
        }
    }
    assert!(replayed >= 6 * 6);
}
