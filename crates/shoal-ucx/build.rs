//! Whether ucx-sys found the system's UCX (its `links = "ucp"` metadata): without it the
//! worker reports at run time that the transport is unavailable and what it needs, and
//! nothing calls into a library that is not linked.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(ucx_missing)");
    println!("cargo::rerun-if-env-changed=DEP_UCP_VERSION");
    if std::env::var_os("DEP_UCP_VERSION").is_none() {
        println!("cargo::rustc-cfg=ucx_missing");
    }
}
