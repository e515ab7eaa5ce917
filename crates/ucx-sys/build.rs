//! Links the system's UCX (pkg-config `ucx`, Debian libucx-dev) when it is there. Without
//! it the crate still compiles (the bindings are committed), nothing is linked, and the
//! `ucx_missing` cfg tells the crates above that the transport is unavailable and why.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(ucx_missing)");
    for var in ["PKG_CONFIG_PATH", "PKG_CONFIG_LIBDIR"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    match pkg_config::Config::new().atleast_version("1.13").probe("ucx") {
        Ok(lib) => println!("cargo::metadata=version={}", lib.version),
        Err(e) => {
            let e = e.to_string().replace('\n', " ");
            println!("cargo::rustc-cfg=ucx_missing");
            println!(
                "cargo::warning=UCX not found ({e}); the ucx transport needs UCX 1.13 or newer: \
                 Debian's libucx-dev, or PKG_CONFIG_PATH pointing at the site's UCX"
            );
        }
    }
}
