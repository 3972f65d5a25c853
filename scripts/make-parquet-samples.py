#!/usr/bin/env python3
"""Writes data/samples/parquet/*.parquet: the bundled JSONL samples as parquet, written by pyarrow
(`pip install pyarrow`), the writer behind pandas and Hugging Face datasets. The Rust reader is
checked against these files (crates/rubric, tests/e2e/train.rs): the same records, and the same run,
as from the JSONL. pyarrow unifies each column over the rows, so a key that some lines lack is a null
there; the reader leaves nulls out, as the lines do.

Run from the repository root: python3 scripts/make-parquet-samples.py
"""
import json
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq

SAMPLES = pathlib.Path("data/samples")
# One codec a file, so the reader's snappy, zstd and gzip pages are all exercised.
FILES = {
    "rubrics": "zstd",
    "rar": "snappy",
    "rubrichub": "snappy",
    "healthbench": "gzip",
}


def uniform(row: dict) -> dict:
    """A parquet column has one type: a list some lines give as a JSON string (RaR's `rubric`,
    RubricHub's `reward_model`, which the importer parses) is parsed here."""
    return {
        k: json.loads(v) if k in ("rubric", "reward_model") and isinstance(v, str) else v
        for k, v in row.items()
    }


def main() -> None:
    out = SAMPLES / "parquet"
    out.mkdir(exist_ok=True)
    for name, codec in FILES.items():
        lines = (SAMPLES / f"{name}.jsonl").read_text().splitlines()
        rows = [uniform(json.loads(line)) for line in lines if line.strip()]
        table = pa.Table.from_pylist(rows)
        pq.write_table(table, out / f"{name}.parquet", compression=codec)
        print(f"{out / name}.parquet: {len(rows)} rows, {codec}")


if __name__ == "__main__":
    main()
