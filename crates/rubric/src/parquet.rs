//! Parquet input (the shape the Hugging Face datasets of RaR, RubricHub and HealthBench ship in):
//! every row becomes the JSON object a JSONL line of the same data holds, so each reader of rubric
//! files ([`crate::read_jsonl`], [`crate::import_file`]) takes either.
//!
//! Columns map as the `parquet` crate's record API reads them: strings, numbers and booleans as
//! themselves, lists as arrays, structs and maps as objects. A null field is left out of its object
//! (a column that a writer unified over rows with and without the field, as pyarrow and pandas do,
//! holds nulls where a JSONL line has no key). Rows are numbered from 1, in file order, in the
//! place of line numbers in errors.

use std::path::Path;

use parquet::file::reader::{FileReader, SerializedFileReader};
use serde_json::Value;

use crate::error::{Result, RubricError};

/// The four bytes a parquet file starts (and ends) with.
const MAGIC: &[u8; 4] = b"PAR1";

/// True when `path` is a parquet file: named `*.parquet`, or starting with parquet's magic bytes.
pub fn is_parquet(path: &Path) -> bool {
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
    {
        return true;
    }
    let mut head = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head))
        .is_ok_and(|()| &head == MAGIC)
}

/// Reads every row of a parquet file as a JSON object, with its row number (from 1).
pub fn read_parquet_rows(path: &Path) -> Result<Vec<(usize, Value)>> {
    let file = std::fs::File::open(path).map_err(|err| RubricError::Io {
        path: path.to_path_buf(),
        err,
    })?;
    let invalid = |row: usize, e: parquet::errors::ParquetError| RubricError::Invalid {
        path: path.to_path_buf(),
        line: row,
        message: format!("not a readable parquet file: {e}"),
    };
    let reader = SerializedFileReader::new(file).map_err(|e| invalid(0, e))?;
    let rows = reader.get_row_iter(None).map_err(|e| invalid(0, e))?;
    rows.enumerate()
        .map(|(i, row)| {
            let row = row.map_err(|e| invalid(i + 1, e))?;
            Ok((i + 1, without_nulls(row.to_json_value())))
        })
        .collect()
}

/// `value` with every null-valued key of every object removed (arrays keep their nulls).
fn without_nulls(value: Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.into_iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k, without_nulls(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(without_nulls).collect()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nulls_leave_objects_but_not_arrays() {
        let v = serde_json::json!({"a": null, "b": [null, {"c": null, "d": 1}], "e": {"f": null}});
        assert_eq!(
            without_nulls(v),
            serde_json::json!({"b": [null, {"d": 1}], "e": {}})
        );
    }

    #[test]
    fn a_file_that_is_not_parquet_is_named_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("broken.parquet");
        std::fs::write(&p, b"PAR1 this is not a parquet file").unwrap();
        assert!(is_parquet(&p));
        let e = read_parquet_rows(&p).unwrap_err().to_string();
        assert!(
            e.contains("broken.parquet:0: not a readable parquet file"),
            "{e}"
        );
        let q = dir.path().join("plain.jsonl");
        std::fs::write(&q, b"{}\n").unwrap();
        assert!(!is_parquet(&q));
    }
}
