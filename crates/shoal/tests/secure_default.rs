//! Secure by default, from the command line (docs/security.md): what would listen off
//! loopback without security is refused at start with the setting that turns it on, and
//! `shoal token add` keeps only a hash of the token it prints.

mod common;

#[test]
fn a_dispatcher_off_loopback_is_refused_without_insecure() {
    let out = common::shoal().args(["dispatcher", "--listen", "0.0.0.0:0", "--http", "off"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "it started: {stderr}");
    assert!(stderr.contains("--insecure") && stderr.contains("docs/security.md"), "{stderr}");
}

#[test]
fn a_cluster_file_with_its_ui_off_loopback_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let file = dir.path().join("cluster.toml");
    std::fs::write(
        &file,
        format!(
            "[cluster]\nhttp = \"0.0.0.0:0\"\nstate_dir = {state:?}\n\
             [[process]]\nname = \"w\"\nrole = \"writer\"\n[[process]]\nname = \"b\"\nrole = \"builder\"\nids = [0]\n\
             [[process]]\nname = \"s\"\nrole = \"source\"\nids = [0]\n[config.run]\nsources = 1\nbuilders = 1\n"
        ),
    )
    .unwrap();
    let out = common::shoal().arg("run").arg(&file).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "it ran: {stderr}");
    assert!(stderr.contains("[cluster.security]") && stderr.contains("cluster.insecure"), "{stderr}");
    assert!(!state.exists(), "nothing was started (no state directory made)");
}

#[test]
fn token_add_prints_the_token_once_and_keeps_its_hash() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens.toml");
    let add = |name: &str, role: &str| {
        common::shoal().args(["token", "add"]).arg(&file).args(["--name", name, "--role", role]).output().unwrap()
    };
    let out = add("alice", "viewer");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let token = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().to_string();
    assert!(token.starts_with("shoal_") && token.len() == 6 + 64, "{token:?}");
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains("alice") && text.contains("viewer") && !text.contains(&token), "{text}");
    assert!(!add("alice", "operator").status.success(), "a name twice");
    assert!(!add("carol", "superuser").status.success(), "an unknown role");
}
