//! Where closed files go: a mounted file system (`file:///path`) or an XRootD server
//! (`root://host[:port]//path`, the protocol of EOS and dCache, through Debian's
//! `xrdcp`/`xrdfs`: no maintained Rust client exists). Each copy ends with the
//! destination's own checksum of what it holds, which custody compares with the one
//! computed while the file was written.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use shoal_core::custody::Seal;
use shoal_store::custody::{FileSeal, sync_dir};

/// One destination of the archive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Destination {
    /// A mounted file system: files go under `root`.
    File { root: PathBuf },
    /// An XRootD server: `host` (with its port), files go under `path`.
    XRootD { host: String, path: String },
}

/// A destination's URL that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum BadUrl {
    #[error("{0:?}: a destination is file:///PATH or root://HOST[:PORT]//PATH")]
    Form(String),
    #[error("{0:?}: S3 destinations are not built yet (docs/archive.md)")]
    S3(String),
}

/// What one copy found: the local file as the copy read it, and the destination's own
/// checksum of what it now holds (none: it could not say).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Copied {
    pub read: Seal,
    pub remote: Option<Seal>,
}

fn seal(s: FileSeal) -> Seal {
    Seal { bytes: s.bytes, adler32: s.adler32 }
}

impl Destination {
    pub fn parse(url: &str) -> Result<Self, BadUrl> {
        if let Some(path) = url.strip_prefix("file://") {
            if !path.starts_with('/') {
                return Err(BadUrl::Form(url.into()));
            }
            return Ok(Destination::File { root: PathBuf::from(path) });
        }
        if let Some(rest) = url.strip_prefix("root://") {
            let (host, path) = rest.split_once("//").ok_or_else(|| BadUrl::Form(url.into()))?;
            if host.is_empty() || path.is_empty() {
                return Err(BadUrl::Form(url.into()));
            }
            return Ok(Destination::XRootD { host: host.into(), path: format!("/{}", path.trim_end_matches('/')) });
        }
        if url.starts_with("s3://") {
            return Err(BadUrl::S3(url.into()));
        }
        Err(BadUrl::Form(url.into()))
    }

    pub fn url(&self) -> String {
        match self {
            Destination::File { root } => format!("file://{}", root.display()),
            Destination::XRootD { host, path } => format!("root://{host}/{path}"),
        }
    }

    /// Copies `local` to the destination as `name`, replacing what is there, and asks
    /// the destination for its checksum of it.
    pub async fn copy(&self, local: &Path, name: &str) -> anyhow::Result<Copied> {
        match self {
            Destination::File { root } => {
                let (local, root, name) = (local.to_path_buf(), root.clone(), name.to_string());
                tokio::task::spawn_blocking(move || copy_to_dir(&local, &root, &name)).await?
            }
            Destination::XRootD { host, path } => {
                // The local file is read once for its own check (xrdcp reads it again to
                // send it: the two reads of one closed file).
                let l = local.to_path_buf();
                let read = tokio::task::spawn_blocking(move || shoal_store::custody::seal_of_file(&l)).await??;
                let target = format!("root://{host}/{path}/{name}");
                let out = xrootd_tool("xrdcp")
                    .args(["--force", "--nopbar", "--posc"])
                    .arg(local)
                    .arg(&target)
                    .stdin(Stdio::null())
                    .output()
                    .await
                    .map_err(|e| anyhow::anyhow!("xrdcp: {e} (Debian's xrootd-client)"))?;
                if !out.status.success() {
                    anyhow::bail!("xrdcp to {target}: {}", String::from_utf8_lossy(&out.stderr).trim());
                }
                let remote = self.remote_seal(name).await?;
                Ok(Copied { read: seal(read), remote })
            }
        }
    }

    /// The destination's own size and checksum of `name` (none: it holds no such file).
    pub async fn remote_seal(&self, name: &str) -> anyhow::Result<Option<Seal>> {
        match self {
            Destination::File { root } => {
                let p = root.join(name);
                let r = tokio::task::spawn_blocking(move || shoal_store::custody::seal_of_file(&p)).await?;
                match r {
                    Ok(s) => Ok(Some(seal(s))),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(e.into()),
                }
            }
            Destination::XRootD { host, path } => {
                let file = format!("{path}/{name}");
                let sum = xrdfs(host, &["query", "checksum", &file]).await?;
                // "adler32 0a1b2c3d" (5.5 adds the query's own options after it).
                let hex = sum.split_whitespace().nth(1).unwrap_or("");
                let Some(adler32) = FileSeal::parse_adler32(hex) else {
                    anyhow::bail!(
                        "xrdfs query checksum {file}: {sum:?} is no adler32 (server without xrootd.chksum adler32?)"
                    );
                };
                let stat = xrdfs(host, &["stat", &file]).await?;
                let bytes = stat
                    .lines()
                    .find_map(|l| l.trim().strip_prefix("Size:"))
                    .and_then(|s| s.trim().parse().ok())
                    .ok_or_else(|| anyhow::anyhow!("xrdfs stat {file}: no size in {stat:?}"))?;
                Ok(Some(Seal { bytes, adler32 }))
            }
        }
    }

    /// Removes `name` from the destination (a copy that did not verify); none there is fine.
    pub async fn remove(&self, name: &str) -> anyhow::Result<()> {
        match self {
            Destination::File { root } => match tokio::fs::remove_file(root.join(name)).await {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
                _ => Ok(()),
            },
            Destination::XRootD { host, path } => {
                let _ = xrdfs(host, &["rm", &format!("{path}/{name}")]).await;
                Ok(())
            }
        }
    }
}

/// Copies into `root` under a temporary name, synced, renamed, the directory synced; the
/// local file's seal as read; the copy's own seal as read back from the destination.
fn copy_to_dir(local: &Path, root: &Path, name: &str) -> anyhow::Result<Copied> {
    std::fs::create_dir_all(root)?;
    let target = root.join(name);
    let part = root.join(format!(".{name}.part"));
    let mut src = std::fs::File::open(local)?;
    let mut dst = std::fs::File::create(&part)?;
    let mut hash = shoal_store::custody::ChecksumWriter::new(&mut dst);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = src.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hash.write_all(&buf[..n])?;
    }
    let (_, read) = hash.into_parts();
    dst.sync_all()?;
    drop(dst);
    std::fs::rename(&part, &target)?;
    sync_dir(root)?;
    let remote = shoal_store::custody::seal_of_file(&target)?;
    Ok(Copied { read: seal(read), remote: Some(seal(remote)) })
}

/// An XRootD client tool that gives up on an unreachable server at once (one connection
/// attempt): custody's back-off does the retrying, and a copy waiting minutes in the tool
/// would hold a copy slot. A site's own `XRD_*` settings win.
fn xrootd_tool(name: &str) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(name);
    for (key, value) in [("XRD_CONNECTIONRETRY", "1"), ("XRD_CONNECTIONWINDOW", "10"), ("XRD_REQUESTTIMEOUT", "300")] {
        if std::env::var_os(key).is_none() {
            c.env(key, value);
        }
    }
    c.kill_on_drop(true);
    c
}

async fn xrdfs(host: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = xrootd_tool("xrdfs")
        .arg(host)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| anyhow::anyhow!("xrdfs: {e} (Debian's xrootd-client)"))?;
    if !out.status.success() {
        anyhow::bail!("xrdfs {host} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_into_destinations_and_back() {
        assert_eq!(
            Destination::parse("file:///data/archive").unwrap(),
            Destination::File { root: "/data/archive".into() }
        );
        let x = Destination::parse("root://eos.example:1094//eos/km3net/raw/").unwrap();
        assert_eq!(x, Destination::XRootD { host: "eos.example:1094".into(), path: "/eos/km3net/raw".into() });
        assert_eq!(x.url(), "root://eos.example:1094//eos/km3net/raw");
        for bad in ["file://relative", "root://host/no-double-slash", "http://x", "root:////p"] {
            assert!(Destination::parse(bad).is_err(), "{bad}");
        }
        assert!(matches!(Destination::parse("s3://bucket/prefix"), Err(BadUrl::S3(_))));
    }
}
