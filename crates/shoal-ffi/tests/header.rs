//! `include/shoal.h` is what cbindgen makes of this crate today: a stale header fails here.
//! Regenerate with `SHOAL_BLESS=1 cargo test -p shoal-ffi --test header`.

use std::path::Path;

#[test]
fn the_committed_header_is_fresh() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let generated = String::from_utf8(generated).unwrap();
    let path = crate_dir.join("../../include/shoal.h");
    if std::env::var_os("SHOAL_BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/shoal.h is stale: run SHOAL_BLESS=1 cargo test -p shoal-ffi --test header and commit it"
    );
}
