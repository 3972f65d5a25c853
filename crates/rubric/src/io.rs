//! JSONL reading with precise errors, and atomic JSONL writing.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Result, RubricError};
use crate::record::RubricRecord;

/// Parses one JSON value, naming the failing field path (`criteria[2].kind`) in the error.
pub fn parse_line<T: DeserializeOwned>(text: &str, path: &Path, line: usize) -> Result<T> {
    let de = &mut serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| path_error(e, path, line))
}

/// Converts an already parsed JSON value, naming the failing field path in the error like
/// [`parse_line`] (used after a row was rewritten, e.g. a list given as a JSON string was parsed).
pub fn parse_value<T: DeserializeOwned>(
    value: serde_json::Value,
    path: &Path,
    line: usize,
) -> Result<T> {
    serde_path_to_error::deserialize(value).map_err(|e| path_error(e, path, line))
}

fn path_error(
    e: serde_path_to_error::Error<serde_json::Error>,
    path: &Path,
    line: usize,
) -> RubricError {
    let field = e.path().to_string();
    let inner = e.into_inner();
    let field = if inner.is_syntax() || inner.is_eof() {
        format!("column {}", inner.column())
    } else if field == "." {
        "record".to_string()
    } else {
        field
    };
    RubricError::Parse {
        path: path.to_path_buf(),
        line,
        field,
        message: strip_position(&inner.to_string()),
    }
}

/// serde_json appends "at line 1 column 57"; the line is ours, the column is already in `field`.
fn strip_position(msg: &str) -> String {
    match msg.rfind(" at line ") {
        Some(i) => msg[..i].to_string(),
        None => msg.to_string(),
    }
}

/// Reads a JSONL file into `(line number, value)` pairs; blank lines are skipped.
pub fn read_jsonl<T: DeserializeOwned>(path: &Path) -> Result<Vec<(usize, T)>> {
    let file = std::fs::File::open(path).map_err(|err| RubricError::Io {
        path: path.to_path_buf(),
        err,
    })?;
    let mut out = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|err| RubricError::Io {
            path: path.to_path_buf(),
            err,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        out.push((i + 1, parse_line(&line, path, i + 1)?));
    }
    Ok(out)
}

/// Writes values as JSONL to a temporary file next to `path`, syncs it and renames it over `path`,
/// so a crash leaves either the old file or the complete new one.
pub fn write_jsonl_atomic<T: Serialize>(
    path: &Path,
    values: impl IntoIterator<Item = T>,
) -> Result<()> {
    let mut buf = Vec::new();
    for v in values {
        serde_json::to_writer(&mut buf, &v).map_err(|e| RubricError::Invalid {
            path: path.to_path_buf(),
            line: 0,
            message: format!("cannot serialise: {e}"),
        })?;
        buf.push(b'\n');
    }
    write_bytes_atomic(path, &buf)
}

/// Atomic whole-file write (temporary file, fsync, rename, directory fsync).
pub fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = AtomicFile::create(path)?;
    f.write_all(bytes).map_err(|err| RubricError::Io {
        path: path.to_path_buf(),
        err,
    })?;
    f.commit()
}

/// A file written through a temporary file next to its path and renamed over it by
/// [`AtomicFile::commit`]: the data is flushed and fsynced, the file renamed into place, and then the
/// parent directory is fsynced so the rename itself survives a crash. Dropped without a commit, or
/// when the commit fails, it removes the temporary file and leaves the old one in place.
///
/// This is the workspace's one "write to a temporary file, then rename" helper: every crate that
/// replaces a file whole goes through it (or [`write_bytes_atomic`] / [`write_jsonl_atomic`]).
pub struct AtomicFile {
    path: PathBuf,
    tmp: PathBuf,
    dir: PathBuf,
    out: Option<std::io::BufWriter<std::fs::File>>,
    /// True once the temporary file has been renamed into place (nothing left to clean up).
    renamed: bool,
}

impl AtomicFile {
    /// Starts writing `path` (its parent directory is created when missing).
    pub fn create(path: &Path) -> Result<Self> {
        let io = |err| RubricError::Io {
            path: path.to_path_buf(),
            err,
        };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&dir).map_err(io)?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
        let f = std::fs::File::create(&tmp).map_err(io)?;
        Ok(Self {
            path: path.to_path_buf(),
            tmp,
            dir,
            out: Some(std::io::BufWriter::new(f)),
            renamed: false,
        })
    }

    /// The final path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Flushes and fsyncs the data, renames it into place and fsyncs the directory. On an error
    /// the temporary file is removed (the old file, if any, is untouched unless the rename
    /// already happened, in which case only the directory sync failed).
    pub fn commit(mut self) -> Result<()> {
        let io = |err| RubricError::Io {
            path: self.path.clone(),
            err,
        };
        let out = self.out.take().expect("not committed yet");
        let f = out.into_inner().map_err(|e| io(e.into_error()))?;
        f.sync_all().map_err(io)?;
        drop(f);
        std::fs::rename(&self.tmp, &self.path).map_err(io)?;
        self.renamed = true;
        sync_dir(&self.dir).map_err(|err| RubricError::Io {
            path: self.dir.clone(),
            err,
        })
    }
}

/// Fsyncs a directory, so that a rename inside it is durable. On platforms where a directory
/// cannot be opened as a file (Windows) there is nothing to do.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::fs::File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.out.as_mut().expect("not committed").write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.as_mut().expect("not committed").flush()
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        // Not committed, or the commit failed before the rename: the temporary file goes.
        drop(self.out.take());
        if !self.renamed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// A rubric file in memory, indexed by prompt id.
#[derive(Debug, Clone)]
pub struct RubricSet {
    /// The file it was read from.
    pub path: PathBuf,
    /// Records in file order, each with its line number.
    pub records: Vec<(usize, RubricRecord)>,
    index: HashMap<String, usize>,
}

impl RubricSet {
    /// Builds a set from records already in memory (line numbers are positions).
    pub fn from_records(path: impl Into<PathBuf>, records: Vec<RubricRecord>) -> Result<Self> {
        let path = path.into();
        let records: Vec<_> = records
            .into_iter()
            .enumerate()
            .map(|(i, r)| (i + 1, r))
            .collect();
        Self::index(path, records)
    }

    fn index(path: PathBuf, records: Vec<(usize, RubricRecord)>) -> Result<Self> {
        let mut index: HashMap<String, usize> = HashMap::with_capacity(records.len());
        for (i, (line, r)) in records.iter().enumerate() {
            if let Some(&prev) = index.get(&r.id) {
                let prev_line: usize = records[prev].0;
                return Err(RubricError::Invalid {
                    path,
                    line: *line,
                    message: format!("id `{}` already used on line {prev_line}", r.id),
                });
            }
            index.insert(r.id.clone(), i);
        }
        Ok(Self {
            path,
            records,
            index,
        })
    }

    /// The record with this prompt id.
    pub fn get(&self, id: &str) -> Option<&RubricRecord> {
        self.index.get(id).map(|&i| &self.records[i].1)
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// True when the file held no records.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Records in file order.
    pub fn iter(&self) -> impl Iterator<Item = &RubricRecord> {
        self.records.iter().map(|(_, r)| r)
    }
}

/// Reads a rubric JSONL file; fails on the first malformed line or duplicate id.
pub fn read_rubrics(path: &Path) -> Result<RubricSet> {
    RubricSet::index(path.to_path_buf(), read_jsonl(path)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_file_line_and_field() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.jsonl");
        std::fs::write(
            &p,
            "{\"id\":\"a\",\"question\":\"q\",\"criteria\":[]}\n\n{\"id\":\"b\",\"question\":\"q\",\"criteria\":[{\"text\":\"t\",\"kind\":\"contnet\"}]}\n",
        )
        .unwrap();
        let e = read_rubrics(&p).unwrap_err().to_string();
        assert!(
            e.contains("r.jsonl:3: criteria[0].kind: unknown variant `contnet`"),
            "{e}"
        );

        std::fs::write(&p, "{\"id\":\"a\",\"question\":\"q\",\"criteria\":[]}\n{\"id\":\"a\",\"question\":\"q\",\"criteria\":[]}\n").unwrap();
        let e = read_rubrics(&p).unwrap_err().to_string();
        assert!(
            e.contains("r.jsonl:2: id `a` already used on line 1"),
            "{e}"
        );

        std::fs::write(&p, "{\"id\":\"a\",\"question\":\"q\",\"criteria\":[}\n").unwrap();
        let e = read_rubrics(&p).unwrap_err().to_string();
        assert!(e.contains("r.jsonl:1: column"), "{e}");

        std::fs::write(&p, "{\"id\":\"a\",\"question\":\"q\"}\n").unwrap();
        let e = read_rubrics(&p).unwrap_err().to_string();
        assert!(
            e.contains("r.jsonl:1: record: missing field `criteria`"),
            "{e}"
        );
    }

    #[test]
    fn atomic_write_replaces_whole_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.jsonl");
        std::fs::write(&p, "old\n").unwrap();
        write_jsonl_atomic(
            &p,
            [serde_json::json!({"a": 1}), serde_json::json!({"b": 2})],
        )
        .unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "{\"a\":1}\n{\"b\":2}\n"
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary file left"
        );
    }

    #[test]
    fn failed_commit_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        // A non-empty directory in the way: the rename fails after the data was written and synced.
        let p = dir.path().join("taken");
        std::fs::create_dir(&p).unwrap();
        std::fs::write(p.join("inside"), "x").unwrap();
        let e = write_bytes_atomic(&p, b"new").unwrap_err().to_string();
        assert!(e.contains("taken"), "{e}");
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            vec!["taken".to_string()],
            "the temporary file is removed when the rename fails"
        );
        // Dropped without a commit: also removed.
        let mut f = AtomicFile::create(&dir.path().join("never.jsonl")).unwrap();
        f.write_all(b"partial").unwrap();
        drop(f);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn directory_sync_errors_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        sync_dir(dir.path()).unwrap();
        #[cfg(unix)]
        assert!(
            sync_dir(&dir.path().join("missing")).is_err(),
            "a directory that cannot be synced is an error, not ignored"
        );
    }
}
