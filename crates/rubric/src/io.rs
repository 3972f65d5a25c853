//! JSONL reading with precise errors, and atomic JSONL writing (through `conrub_base`'s
//! [`AtomicFile`], re-exported here).

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

pub use conrub_base::{sync_dir, AtomicFile, FileError};

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

/// Reads a JSONL file into `(line number, value)` pairs; blank lines are skipped. A parquet file
/// ([`crate::parquet::is_parquet`]) is read row by row instead, numbered from 1.
pub fn read_jsonl<T: DeserializeOwned>(path: &Path) -> Result<Vec<(usize, T)>> {
    if crate::parquet::is_parquet(path) {
        return crate::parquet::read_parquet_rows(path)?
            .into_iter()
            .map(|(row, v)| Ok((row, parse_value(v, path, row)?)))
            .collect();
    }
    let file = std::fs::File::open(path).map_err(|err| RubricError::Io {
        path: path.to_path_buf(),
        err,
    })?;
    let mut out = Vec::new();
    let mut reader = BufReader::new(file);
    let mut bytes = Vec::new();
    for i in 0.. {
        bytes.clear();
        let read = reader
            .read_until(b'\n', &mut bytes)
            .map_err(|err| RubricError::Io {
                path: path.to_path_buf(),
                err,
            })?;
        if read == 0 {
            break;
        }
        // A byte that is not UTF-8 is an error of that line.
        let line = utf8_text(&bytes, path, i + 1)?;
        let line = line.trim_end_matches(['\n', '\r']);
        if line.trim().is_empty() {
            continue;
        }
        out.push((i + 1, parse_line(line, path, i + 1)?));
    }
    Ok(out)
}

/// `bytes` (of `path`, from its line `first_line` on) as text; a byte that is not UTF-8 is an
/// error naming its line and its byte in the line.
pub(crate) fn utf8_text<'a>(bytes: &'a [u8], path: &Path, first_line: usize) -> Result<&'a str> {
    std::str::from_utf8(bytes).map_err(|e| {
        let before = &bytes[..e.valid_up_to()];
        let line = before.iter().filter(|b| **b == b'\n').count() + first_line;
        let start = before
            .iter()
            .rposition(|b| *b == b'\n')
            .map_or(0, |p| p + 1);
        RubricError::Invalid {
            path: path.to_path_buf(),
            line,
            message: format!(
                "not UTF-8 text (byte {} of the line)",
                e.valid_up_to() - start + 1
            ),
        }
    })
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

/// [`conrub_base::write_bytes_atomic`] with the error as a [`RubricError`].
pub fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    Ok(conrub_base::write_bytes_atomic(path, bytes)?)
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

    /// Issue 53, item 16: a byte 0xFF gave "stream did not contain valid UTF-8" with no line.
    #[test]
    fn a_byte_that_is_not_utf8_is_named_by_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.jsonl");
        std::fs::write(&p, b"{\"a\": 1}\n{\"a\": \"x\xff\"}\n").unwrap();
        let e = read_jsonl::<serde_json::Value>(&p).unwrap_err().to_string();
        assert_eq!(
            e,
            format!("{}:2: not UTF-8 text (byte 9 of the line)", p.display())
        );
        let bytes = std::fs::read(&p).unwrap();
        let e = utf8_text(&bytes, &p, 1).unwrap_err().to_string();
        assert_eq!(
            e,
            format!("{}:2: not UTF-8 text (byte 9 of the line)", p.display())
        );
    }

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

    /// The demo's rubric file as pyarrow writes it (zstd pages, scripts/make-parquet-samples.py)
    /// reads to the same records; a row that does not fit is named by its number.
    #[test]
    fn parquet_rubrics_read_as_their_jsonl() {
        let samples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/samples");
        let jsonl = read_rubrics(&samples.join("rubrics.jsonl")).unwrap();
        let parquet = read_rubrics(&samples.join("parquet/rubrics.parquet")).unwrap();
        assert_eq!(jsonl.len(), 8);
        assert_eq!(
            serde_json::to_value(&jsonl.records).unwrap(),
            serde_json::to_value(&parquet.records).unwrap()
        );
        let e = read_jsonl::<Vec<u32>>(&samples.join("parquet/rubrics.parquet"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rubrics.parquet:1: record: invalid type: map"),
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
}
