//! The archive's XRootD destination against a real server (Debian's `xrootd`, as EOS and
//! dCache speak it), root only: the server runs in a network namespace the test makes
//! (it listens on every interface of its namespace, so never on the host's), and so does
//! `shoal archive run`. Rows: a demo's files copied, verified by the server's own adler32
//! and their local copies deleted only then; the destination down when the archiver starts
//! and back later: every file safe once it returns, nothing deleted before, the ledger
//! balanced.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Namespace(String);

impl Namespace {
    fn new() -> Namespace {
        let name = format!("shoal-xrd-{}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).status();
        assert!(Command::new("ip").args(["netns", "add", &name]).status().unwrap().success());
        let ns = Namespace(name);
        assert!(Command::new("ip").args(["-n", &ns.0, "link", "set", "lo", "up"]).status().unwrap().success());
        ns
    }

    fn exec(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.0, program]);
        c
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// An XRootD server on 127.0.0.1:1094 of the namespace (its own port space: nothing else
/// binds there), exporting `dir/export` with adler32 checksums, run as `nobody` (xrootd
/// refuses to run as root).
struct Server {
    child: Child,
}

impl Server {
    fn start(ns: &Namespace, dir: &Path) -> Server {
        let run = dir.join("xrootd");
        std::fs::create_dir_all(run.join("export")).unwrap();
        std::fs::create_dir_all(run.join("admin")).unwrap();
        let chown = Command::new("chown").args(["-R", "nobody"]).arg(&run).status().unwrap();
        assert!(chown.success());
        // Every directory above must be searchable by nobody.
        let mut up = run.parent();
        while let Some(d) = up {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(d).unwrap().permissions().mode();
            if mode & 0o001 == 0 {
                std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode | 0o011)).unwrap();
            }
            up = d.parent();
        }
        let cfg = dir.join("xrootd.cfg");
        std::fs::write(
            &cfg,
            format!(
                "all.export {0}/export\nxrootd.chksum adler32\nall.adminpath {0}/admin\nall.pidpath {0}/admin\n",
                run.display()
            ),
        )
        .unwrap();
        let child = ns
            .exec("xrootd")
            .args(["-R", "nobody", "-p", "1094", "-c"])
            .arg(&cfg)
            .arg("-l")
            .arg(run.join("xrootd.log"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let server = Server { child };
        // Bounded: up within a few tries; a failure shows the server's log.
        let began = Instant::now();
        let export = run.join("export");
        while !ns
            .exec("xrdfs")
            .args(["127.0.0.1:1094", "ls"])
            .arg(&export)
            .env("XRD_CONNECTIONRETRY", "1")
            .output()
            .unwrap()
            .status
            .success()
        {
            let log = std::fs::read_to_string(run.join("xrootd.log")).unwrap_or_default();
            assert!(began.elapsed() < Duration::from_secs(60), "xrootd did not come up:\n{log}");
            std::thread::sleep(Duration::from_millis(100));
        }
        server
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // `ip netns exec` replaced itself with xrootd (exec), so this is the server.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn unavailable() -> Option<String> {
    if let Some(why) = shoal_testbed::netns::unavailable() {
        return Some(why);
    }
    let have = |t: &str| {
        Command::new("sh").args(["-c", &format!("command -v {t}")]).output().is_ok_and(|o| o.status.success())
    };
    ["xrootd", "xrdcp", "xrdfs"]
        .iter()
        .find(|t| !have(t))
        .map(|t| format!("`{t}` is missing (Debian xrootd-server, xrootd-client; `make deps` as root)"))
}

/// A demo's output: closed files with their metadata.
fn demo_files(out: &Path) -> Vec<PathBuf> {
    let run = common::shoal()
        .args(["demo", "--seconds", "1", "--sources", "4", "--builders", "2", "--alert-at", "0.5", "--out"])
        .arg(out)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let files: Vec<PathBuf> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter_map(|p| shoal_store::custody::FileMetadata::data_file_of(&p))
        .collect();
    assert!(!files.is_empty());
    files
}

fn status(out: &Path) -> serde_json::Value {
    let s = common::shoal().args(["archive", "status", "--json"]).arg(out).output().unwrap();
    serde_json::from_slice(&s.stdout).unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&s.stderr)))
}

#[test]
fn files_reach_an_xrootd_server_verified_and_a_server_down_at_first_loses_nothing() {
    if let Some(why) = unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ns = Namespace::new();
    let export = dir.path().join("xrootd").join("export");
    let url = format!("root://127.0.0.1:1094/{}", export.display());

    // The server is not up yet: the archiver is refused, backs off, and keeps every file.
    let out = dir.path().join("out");
    let files = demo_files(&out);
    let seals: Vec<_> = files.iter().map(|f| shoal_store::custody::seal_of_file(f).unwrap()).collect();
    let mut archiver = ns
        .exec(env!("CARGO_BIN_EXE_shoal"))
        .args(["archive", "run", "--delete-after", "1", "--max-attempts", "1000", "--backoff-s", "0.1", "--to", &url])
        .arg(&out)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let began = Instant::now();
    let refused = || {
        shoal_archive::journal::Journal::read(&out)
            .unwrap()
            .records
            .iter()
            .filter(|r| matches!(r, shoal_core::custody::Record::Refused { .. }))
            .count()
    };
    while refused() < 2 {
        assert!(began.elapsed() < Duration::from_secs(60), "the archiver never tried");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(files.iter().all(|f| f.exists()), "nothing deleted while the destination is down");
    let down = status(&out);
    assert_eq!(down["ledger"]["bytes_safe"], 0, "{down}");
    assert!(down["ledger"]["files_pending"].as_u64().unwrap() >= 1, "{down}");

    // Back: every file becomes safe, verified by the server's own checksum, and only then
    // is its local copy deleted.
    let server = Server::start(&ns, dir.path());
    let began = Instant::now();
    loop {
        let s = status(&out);
        // Whatever the moment: a file not yet safe is still on the local disk.
        for f in s["files"].as_array().unwrap() {
            if f["state"] != "safe" && f["state"] != "deleted" {
                assert!(out.join(f["file"].as_str().unwrap()).exists(), "{f}");
            }
        }
        if s["ledger"]["files_deleted"] == s["ledger"]["files"] {
            assert_eq!(s["ledger"]["files_safe"], s["ledger"]["files"], "{s}");
            break;
        }
        assert!(began.elapsed() < Duration::from_secs(120), "not every file safe and deleted: {s}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = Command::new("kill").args(["-INT", &archiver.id().to_string()]).status();
    let ended = archiver.wait().unwrap();
    let mut text = String::new();
    std::io::Read::read_to_string(archiver.stdout.as_mut().unwrap(), &mut text).unwrap();
    assert!(ended.success(), "{text}");
    assert!(text.contains("balanced"), "{text}");
    for (f, s) in files.iter().zip(&seals) {
        assert!(!f.exists(), "{} deleted once safe", f.display());
        let there = export.join(f.file_name().unwrap());
        assert_eq!(shoal_store::custody::seal_of_file(&there).unwrap(), *s, "{}", there.display());
    }
    drop(server);
}
