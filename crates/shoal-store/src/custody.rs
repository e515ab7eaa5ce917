//! What a stored file carries into custody: its size and adler32 computed while it is
//! written ([`ChecksumWriter`], no second read), and the metadata JSON written beside it at
//! close ([`FileMetadata`], `NAME.json`) in the form the field's movers read (DUNE's
//! declad and MetaCat: `checksum: "adler32:…"`, `file_size`, `runs`, `events`,
//! `data_tier`), so that a site's own mover takes shoal's files unchanged and shoal's
//! archiver (`shoal-archive`) knows a file is closed when its metadata exists.
//!
//! adler32 is the checksum XRootD (EOS), dCache and Rucio keep for every file: a copy's
//! checksum is asked of the destination and compared with the one computed here.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Size and adler32 of a file's bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileSeal {
    pub bytes: u64,
    pub adler32: u32,
}

impl FileSeal {
    /// The checksum as the field writes it: `adler32:` and 8 lower-case hex digits.
    pub fn checksum(&self) -> String {
        format!("adler32:{:08x}", self.adler32)
    }

    /// The adler32 of `text` in [`FileSeal::checksum`]'s form (or bare hex, as `xrdfs
    /// query checksum` and S3 tags give it after their own prefix).
    pub fn parse_adler32(text: &str) -> Option<u32> {
        let hex = text.trim().strip_prefix("adler32:").unwrap_or(text.trim());
        (hex.len() == 8).then(|| u32::from_str_radix(hex, 16).ok()).flatten()
    }
}

/// A writer that counts and checksums every byte on its way to `inner`.
pub struct ChecksumWriter<W> {
    inner: W,
    hash: simd_adler32::Adler32,
    bytes: u64,
}

impl<W> std::fmt::Debug for ChecksumWriter<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChecksumWriter").field("bytes", &self.bytes).finish_non_exhaustive()
    }
}

impl<W: Write> ChecksumWriter<W> {
    pub fn new(inner: W) -> Self {
        Self { inner, hash: simd_adler32::Adler32::new(), bytes: 0 }
    }

    /// What has gone through so far.
    pub fn seal(&self) -> FileSeal {
        FileSeal { bytes: self.bytes, adler32: self.hash.finish() }
    }

    pub fn into_parts(self) -> (W, FileSeal) {
        let seal = self.seal();
        (self.inner, seal)
    }
}

impl<W: Write> Write for ChecksumWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // Only what the inner writer took is counted: a short write's rest comes again.
        let n = self.inner.write(buf)?;
        self.hash.write(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Size and adler32 of the file at `path`, read once (a destination's own copy on a
/// mounted file system; the local copy when it is checked again).
pub fn seal_of_file(path: &Path) -> io::Result<FileSeal> {
    let mut sink = ChecksumWriter::new(io::sink());
    io::copy(&mut io::BufReader::with_capacity(1 << 20, File::open(path)?), &mut sink)?;
    Ok(sink.seal())
}

/// The metadata written beside every stored file at its close (`NAME.json`).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FileMetadata {
    /// The file's name (no directory).
    pub file_name: String,
    pub file_size: u64,
    /// `adler32:` and 8 hex digits.
    pub checksum: String,
    /// `[[run, subrun, run type]]` as SAM and MetaCat write runs (shoal has no subruns: 0).
    pub runs: Vec<(u64, u64, String)>,
    /// Events (rows) the file holds.
    pub events: u64,
    /// `raw` (fragments as the boards sent them), `filtered` (events), `manifest`.
    pub data_tier: String,
    /// `parquet`, `km3net-daq`, `jsonl`.
    pub file_format: String,
    /// What wrote it: `writer`, `builder3`.
    pub producer: String,
    /// The slices it holds, first and last (none for a file of no slice).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_slice: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_slice: Option<u64>,
    /// Seconds since the Unix epoch at close.
    pub closed_at: f64,
    /// shoal's version.
    pub application_version: String,
}

impl FileMetadata {
    /// Where the metadata of `data_file` goes: beside it, `NAME.json`.
    pub fn path_for(data_file: &Path) -> PathBuf {
        let mut name = data_file.file_name().map(|n| n.to_os_string()).unwrap_or_default();
        name.push(".json");
        data_file.with_file_name(name)
    }

    /// The data file a metadata file speaks for, if `path` is one (`NAME.parquet.json`).
    pub fn data_file_of(path: &Path) -> Option<PathBuf> {
        let name = path.file_name()?.to_str()?;
        let data = name.strip_suffix(".json")?;
        [".parquet", ".dat", ".jsonl", ".root"].iter().any(|e| data.ends_with(e)).then(|| path.with_file_name(data))
    }

    pub fn seal(&self) -> Option<FileSeal> {
        Some(FileSeal { bytes: self.file_size, adler32: FileSeal::parse_adler32(&self.checksum)? })
    }

    /// Writes the metadata beside `data_file` so that it exists whole or not at all, on
    /// the disk before this returns: a temporary file, synced, renamed, the directory
    /// synced. The data file itself must be synced before (its metadata says it is whole).
    pub fn write_beside(&self, data_file: &Path) -> io::Result<PathBuf> {
        let path = Self::path_for(data_file);
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_vec_pretty(self).map_err(io::Error::other)?;
        {
            let mut f = File::create(&tmp)?;
            f.write_all(&text)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &path)?;
        if let Some(dir) = path.parent() {
            sync_dir(dir)?;
        }
        Ok(path)
    }

    pub fn read(path: &Path) -> io::Result<Self> {
        serde_json::from_slice(&std::fs::read(path)?).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

/// Makes a directory's entries (a file created or renamed in it) durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    File::open(dir)?.sync_all()
}

/// Seconds since the Unix epoch now.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// adler32 of "Wikipedia" is 0x11E60398 (the algorithm's textbook example).
    #[test]
    fn the_checksum_is_adler32_and_what_went_through_whatever_the_pieces() {
        let mut w = ChecksumWriter::new(Vec::new());
        w.write_all(b"Wiki").unwrap();
        w.write_all(b"pedia").unwrap();
        let (inner, seal) = w.into_parts();
        assert_eq!(inner, b"Wikipedia");
        assert_eq!(seal, FileSeal { bytes: 9, adler32: 0x11e6_0398 });
        assert_eq!(seal.checksum(), "adler32:11e60398");
        assert_eq!(FileSeal::parse_adler32("adler32:11e60398"), Some(0x11e6_0398));
        assert_eq!(FileSeal::parse_adler32("11e60398\n"), Some(0x11e6_0398));
        assert_eq!(FileSeal::parse_adler32("adler32:11e6"), None);
    }

    #[test]
    fn the_file_s_seal_read_back_is_the_one_computed_while_writing_and_metadata_round_trips() {
        let dir = std::env::temp_dir().join(format!("shoal-custody-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let data = dir.join("run000001.events.parquet");
        let mut w = ChecksumWriter::new(File::create(&data).unwrap());
        let big: Vec<u8> = (0..3_000_000u32).map(|i| (i * 31 % 251) as u8).collect();
        w.write_all(&big).unwrap();
        let (_, seal) = w.into_parts();
        assert_eq!(seal_of_file(&data).unwrap(), seal);
        let meta = FileMetadata {
            file_name: "run000001.events.parquet".into(),
            file_size: seal.bytes,
            checksum: seal.checksum(),
            runs: vec![(1, 0, "physics".into())],
            events: 7,
            data_tier: "filtered".into(),
            file_format: "parquet".into(),
            producer: "writer".into(),
            first_slice: Some(0),
            last_slice: Some(9),
            closed_at: unix_now(),
            application_version: "test".into(),
        };
        let at = meta.write_beside(&data).unwrap();
        assert_eq!(at, dir.join("run000001.events.parquet.json"));
        assert_eq!(FileMetadata::data_file_of(&at), Some(data.clone()));
        assert_eq!(FileMetadata::read(&at).unwrap(), meta);
        assert_eq!(FileMetadata::read(&at).unwrap().seal(), Some(seal));
        let text = std::fs::read_to_string(&at).unwrap();
        assert!(text.contains("\"checksum\": \"adler32:") && text.contains("\"file_size\""), "{text}");
        assert_eq!(FileMetadata::data_file_of(&dir.join("run000001.writer.json")), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
