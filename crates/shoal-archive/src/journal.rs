//! The archiver's journal: one JSON line per custody record
//! ([`shoal_core::custody::Record`]), each synced to the disk before the archiver acts on
//! what it says, in `DIR/.shoal-archive/journal.jsonl` beside the files it keeps. Reading
//! it back gives the state after any crash. A line cut short by a crash in the middle of
//! its write is the last one, and is skipped (counted): the action it announced had not
//! begun.
//!
//! Beside it, `config.json` holds the destinations and the deletion rule the journal was
//! written under, so that `shoal archive status` reads the states without being told.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use shoal_core::custody::Record;

/// The journal's folder in an archived directory.
pub const FOLDER: &str = ".shoal-archive";

/// An open journal. It holds an exclusive lock on its file while open: one archiver (or
/// one `shoal archive release`) per directory at a time.
#[derive(Debug)]
pub struct Journal {
    file: File,
    path: PathBuf,
}

/// What reading a journal found.
#[derive(Debug, Default)]
pub struct Read {
    pub records: Vec<Record>,
    /// Lines that did not parse (a crash mid-write leaves at most one, at the end).
    pub torn: u64,
}

/// The rules a journal was written under.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct JournalConfig {
    pub destinations: Vec<String>,
    pub delete_after: Option<usize>,
    pub max_attempts: u32,
}

impl Journal {
    /// Opens (creating) the journal of `dir`, with what it holds so far.
    pub fn open(dir: &Path) -> io::Result<(Journal, Read)> {
        let folder = dir.join(FOLDER);
        std::fs::create_dir_all(&folder)?;
        let path = folder.join("journal.jsonl");
        let read = Self::read(dir)?;
        let mut file = OpenOptions::new().create(true).append(true).open(&path)?;
        if let Err(e) = file.try_lock() {
            return Err(match e {
                std::fs::TryLockError::WouldBlock => io::Error::new(
                    io::ErrorKind::WouldBlock,
                    format!("another archiver keeps {} (its journal is locked)", dir.display()),
                ),
                std::fs::TryLockError::Error(e) => e,
            });
        }
        // A line cut short by a crash is ended, so that the next record starts a line.
        let len = file.metadata()?.len();
        if len > 0 {
            use std::io::{Read as _, Seek, SeekFrom};
            let mut last = [0u8; 1];
            let mut r = File::open(&path)?;
            r.seek(SeekFrom::Start(len - 1))?;
            r.read_exact(&mut last)?;
            if last[0] != b'\n' {
                file.write_all(b"\n")?;
                file.sync_data()?;
            }
        }
        shoal_store::custody::sync_dir(&folder)?;
        Ok((Journal { file, path }, read))
    }

    /// The records of `dir`'s journal (none: no journal).
    pub fn read(dir: &Path) -> io::Result<Read> {
        let path = dir.join(FOLDER).join("journal.jsonl");
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Read::default()),
            Err(e) => return Err(e),
        };
        let mut read = Read::default();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            match serde_json::from_str(line) {
                Ok(r) => read.records.push(r),
                Err(_) => read.torn += 1,
            }
        }
        Ok(read)
    }

    /// Appends `record`, on the disk when this returns.
    pub fn append(&mut self, record: &Record) -> io::Result<()> {
        let mut line = serde_json::to_vec(record).map_err(io::Error::other)?;
        line.push(b'\n');
        self.file.write_all(&line)?;
        self.file.sync_data()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn write_config(dir: &Path, cfg: &JournalConfig) -> io::Result<()> {
        let path = dir.join(FOLDER).join("config.json");
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(cfg).map_err(io::Error::other)?)?;
        File::open(&tmp)?.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        shoal_store::custody::sync_dir(&dir.join(FOLDER))
    }

    pub fn read_config(dir: &Path) -> io::Result<JournalConfig> {
        let text = std::fs::read(dir.join(FOLDER).join("config.json"))?;
        serde_json::from_slice(&text).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_core::custody::Seal;

    #[test]
    fn records_read_back_and_a_torn_last_line_is_skipped_and_counted() {
        let dir = std::env::temp_dir().join(format!("shoal-journal-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (mut j, read) = Journal::open(&dir).unwrap();
        assert!(read.records.is_empty());
        let rs = [
            Record::Closed { file: "a".into(), run: 3, seal: Seal { bytes: 9, adler32: 7 }, closed_at: 1.5 },
            Record::Copying { file: "a".into(), dest: 0 },
            Record::Safe { file: "a".into(), dest: 0, at: 2.0 },
        ];
        for r in &rs {
            j.append(r).unwrap();
        }
        // A crash in the middle of a line.
        let mut f = OpenOptions::new().append(true).open(j.path()).unwrap();
        f.write_all(br#"{"record":"deleted","fi"#).unwrap();
        let read = Journal::read(&dir).unwrap();
        assert_eq!(read.records, rs);
        assert_eq!(read.torn, 1);
        // Opened again after the crash, the next record is a line of its own.
        drop(j);
        let (mut j, _) = Journal::open(&dir).unwrap();
        j.append(&Record::Deleted { file: "a".into(), at: 3.0 }).unwrap();
        let read = Journal::read(&dir).unwrap();
        assert_eq!((read.records.len(), read.torn), (4, 1));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
