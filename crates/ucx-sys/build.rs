//! Links the system's UCX (pkg-config `ucx`, Debian libucx-dev) when it is there. Without
//! it the crate still compiles (the bindings are committed), nothing is linked, and the
//! `ucx_missing` cfg tells the crates above that the transport is unavailable and why.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(ucx_missing)");
    for var in ["PKG_CONFIG_PATH", "PKG_CONFIG_LIBDIR"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    // Installing libucx-dev later must wake this probe up: watch the directories
    // pkg-config searches (those that exist; a missing path would rerun it every build).
    if let Ok(out) = std::process::Command::new("pkg-config").args(["--variable", "pc_path", "pkg-config"]).output() {
        let dirs = String::from_utf8_lossy(&out.stdout).trim().to_string();
        for dir in dirs.split(':').filter(|d| std::path::Path::new(d).is_dir()) {
            println!("cargo::rerun-if-changed={dir}");
        }
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
