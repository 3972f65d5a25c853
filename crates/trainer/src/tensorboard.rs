//! TensorBoard event files, written directly: a run's scalars, its reward histogram and a few
//! samples as text, readable by TensorBoard (`tensorboard --logdir OUTPUT_DIR`) with no Python
//! in the training process.
//!
//! The format, from TensorFlow's record and protocol-buffer definitions:
//!
//! - A file is a sequence of records, each `u64` length (little-endian), the masked CRC-32C of
//!   those 8 bytes, the payload, and the masked CRC-32C of the payload. The mask is
//!   `((crc >> 15) | (crc << 17)) + 0xa282ead8` (wrapping).
//! - Each payload is an `Event` message: `wall_time` (field 1, double), `step` (2, int64) and
//!   one of `file_version` (3, string; the first record says `brain.Event:2`), `summary` (5)
//!   or `session_log` (7; field 6 is the deprecated `log_message`, which TensorBoard ignores).
//! - A `Summary` holds repeated `value` (1): `tag` (1, string) with `simple_value` (2, float),
//!   `histo` (5, a `HistogramProto`: `min` 1, `max` 2, `num` 3, `sum` 4, `sum_squares` 5,
//!   `bucket_limit` 6 and `bucket` 7 as packed doubles) or `tensor` (8, a `TensorProto`:
//!   `dtype` 1 = 7 for strings, `tensor_shape` 2, `string_val` 8) with `metadata` (9) naming the
//!   `text` plugin (`plugin_data` 1, its `plugin_name` 1).
//! - A `SessionLog` (`status` 1; 1 = START) at a resumed run's first step tells TensorBoard to
//!   drop the events of later steps that the earlier attempt wrote, as `metrics.jsonl` drops
//!   their lines.
//!
//! Every record is flushed as it is written: a kill loses at most the record being written,
//! which readers skip as a truncated tail.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use conrub_contracts::MetricsLine;

use crate::error::{Result, TrainerError};
use crate::samples::{format_group, GroupSample};
use conrub_grpo::StepOutput;

/// The folder of a run's event files.
pub fn tensorboard_dir(output_dir: &Path) -> PathBuf {
    output_dir.join("tensorboard")
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82f63b78) of `data`.
fn crc32c(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, entry) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 == 1 {
                    (c >> 1) ^ 0x82f6_3b78
                } else {
                    c >> 1
                };
            }
            *entry = c;
        }
        t
    });
    !data.iter().fold(!0u32, |c, &b| {
        table[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8)
    })
}

/// The record format's masked CRC.
fn masked_crc(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// A protocol-buffer message under construction (the few wire types events use).
#[derive(Default)]
struct Message(Vec<u8>);

impl Message {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    fn key(&mut self, field: u32, wire: u8) {
        self.varint(((field as u64) << 3) | wire as u64);
    }

    fn uint(&mut self, field: u32, v: u64) -> &mut Self {
        self.key(field, 0);
        self.varint(v);
        self
    }

    fn double(&mut self, field: u32, v: f64) -> &mut Self {
        self.key(field, 1);
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn float(&mut self, field: u32, v: f32) -> &mut Self {
        self.key(field, 5);
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn bytes(&mut self, field: u32, v: &[u8]) -> &mut Self {
        self.key(field, 2);
        self.varint(v.len() as u64);
        self.0.extend_from_slice(v);
        self
    }

    fn message(&mut self, field: u32, m: &Message) -> &mut Self {
        self.bytes(field, &m.0)
    }

    fn packed_doubles(&mut self, field: u32, vs: &[f64]) -> &mut Self {
        let raw: Vec<u8> = vs.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.bytes(field, &raw)
    }
}

/// A histogram of `values` over the buckets ending at `limits` (ascending; values past the last
/// limit go to the last bucket), as TensorBoard's `HistogramProto`.
fn histogram(values: &[f64], limits: &[f64]) -> Message {
    let mut counts = vec![0f64; limits.len()];
    for v in values {
        let i = limits
            .iter()
            .position(|l| v <= l)
            .unwrap_or(limits.len() - 1);
        counts[i] += 1.0;
    }
    let (min, max) = values
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    let mut h = Message::default();
    h.double(1, min)
        .double(2, max)
        .double(3, values.len() as f64)
        .double(4, values.iter().sum())
        .double(5, values.iter().map(|v| v * v).sum())
        .packed_doubles(6, limits)
        .packed_doubles(7, &counts);
    h
}

/// The numeric leaves of a JSON object, nested names joined by `/` under `prefix`; arrays,
/// strings and nulls are left out (`{"ties": {"accepted": 3}}` gives `prefix/ties/accepted`).
pub fn flatten_scalars(prefix: &str, value: &serde_json::Value) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    fn walk(name: &str, v: &serde_json::Value, out: &mut Vec<(String, f64)>) {
        match v {
            serde_json::Value::Number(n) => {
                if let Some(x) = n.as_f64() {
                    out.push((name.to_string(), x));
                }
            }
            serde_json::Value::Bool(b) => out.push((name.to_string(), *b as u8 as f64)),
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    walk(&format!("{name}/{k}"), v, out);
                }
            }
            _ => {}
        }
    }
    walk(prefix, value, &mut out);
    out
}

/// One event file of a run, appended record by record.
pub struct EventWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl EventWriter {
    /// A new event file in `dir` (created), named as TensorBoard expects
    /// (`events.out.tfevents.SECONDS.NANOS.HOST.PID.conrub`: later files sort after earlier
    /// ones), starting with its version record.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| TrainerError::io(dir, e))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().replace(['/', '.'], "-"))
            .unwrap_or_else(|_| "host".into());
        let (path, file) = loop {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default();
            let path = dir.join(format!(
                "events.out.tfevents.{:010}.{:09}.{host}.{}.conrub",
                now.as_secs(),
                now.subsec_nanos(),
                std::process::id()
            ));
            match std::fs::OpenOptions::new()
                .create_new(true)
                .append(true)
                .open(&path)
            {
                Ok(file) => break (path, file),
                // Two writers in one nanosecond: take the next.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(TrainerError::io(&path, e)),
            }
        };
        let mut w = Self { path, file };
        let mut version = w.event(0);
        version.bytes(3, b"brain.Event:2");
        w.record(&version)?;
        Ok(w)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// An `Event` with the wall time now and `step`.
    fn event(&self, step: u64) -> Message {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let mut e = Message::default();
        e.double(1, now).uint(2, step);
        e
    }

    /// Appends one record and flushes it.
    fn record(&mut self, event: &Message) -> Result<()> {
        let len = (event.0.len() as u64).to_le_bytes();
        let mut rec = Vec::with_capacity(event.0.len() + 16);
        rec.extend_from_slice(&len);
        rec.extend_from_slice(&masked_crc(&len).to_le_bytes());
        rec.extend_from_slice(&event.0);
        rec.extend_from_slice(&masked_crc(&event.0).to_le_bytes());
        self.file
            .write_all(&rec)
            .and_then(|_| self.file.flush())
            .map_err(|e| TrainerError::io(&self.path, e))
    }

    /// An event of `step` holding one summary of `values`.
    fn summary(&mut self, step: u64, values: &[Message]) -> Result<()> {
        let mut summary = Message::default();
        for v in values {
            summary.message(1, v);
        }
        let mut e = self.event(step);
        e.message(5, &summary);
        self.record(&e)
    }

    /// Scalars of `step` (as TensorBoard's 32-bit `simple_value`), one summary.
    pub fn scalars(&mut self, step: u64, scalars: &[(String, f64)]) -> Result<()> {
        let values: Vec<Message> = scalars
            .iter()
            .map(|(tag, x)| {
                let mut v = Message::default();
                v.bytes(1, tag.as_bytes()).float(2, *x as f32);
                v
            })
            .collect();
        self.summary(step, &values)
    }

    /// A histogram of `values` under `tag`, buckets ending at `limits`.
    pub fn histogram(
        &mut self,
        step: u64,
        tag: &str,
        values: &[f64],
        limits: &[f64],
    ) -> Result<()> {
        if values.is_empty() || limits.is_empty() {
            return Ok(());
        }
        let mut v = Message::default();
        v.bytes(1, tag.as_bytes())
            .message(5, &histogram(values, limits));
        self.summary(step, &[v])
    }

    /// Markdown `text` under `tag`, for TensorBoard's text plugin.
    pub fn text(&mut self, step: u64, tag: &str, text: &str) -> Result<()> {
        let mut plugin = Message::default();
        plugin.bytes(1, b"text");
        let mut metadata = Message::default();
        metadata.message(1, &plugin);
        let mut tensor = Message::default();
        tensor
            .uint(1, 7)
            .message(2, &Message::default())
            .bytes(8, text.as_bytes());
        let mut v = Message::default();
        v.bytes(1, tag.as_bytes())
            .message(9, &metadata)
            .message(8, &tensor);
        self.summary(step, &[v])
    }

    /// A session start at `step`: TensorBoard drops what earlier files hold for later steps.
    pub fn session_start(&mut self, step: u64) -> Result<()> {
        let mut log = Message::default();
        log.uint(1, 1);
        let mut e = self.event(step);
        e.message(7, &log);
        self.record(&e)
    }
}

/// A run's dashboard: the scalars of every `metrics.jsonl` line, each step's reward histogram
/// and its first group as text. TensorBoard's step is the steps done (the metrics' 0-based
/// `step` + 1), the x of validation rounds (their `step`) and epochs alike.
pub struct Dashboard {
    writer: EventWriter,
}

impl Dashboard {
    /// A new event file under `output_dir/tensorboard/`; a run resumed after `resume_step`
    /// steps starts it with a session start, so TensorBoard drops the earlier attempt's events
    /// of the steps this run writes again.
    pub fn open(output_dir: &Path, resume_step: Option<u64>) -> Result<Self> {
        let mut writer = EventWriter::create(&tensorboard_dir(output_dir))?;
        if let Some(step) = resume_step {
            writer.session_start(step + 1)?;
        }
        Ok(Self { writer })
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        self.writer.path()
    }

    /// A `metrics.jsonl` line's scalars (`train/...`, `epoch/...`, `eval/...`; a kernel
    /// warm-up line has none), at the steps done it ends at (`steps_done`).
    pub fn line(&mut self, line: &MetricsLine, steps_done: u64) -> Result<()> {
        let (prefix, value) = match line {
            MetricsLine::Step { metrics, .. } => ("train", serde_json::to_value(metrics)),
            MetricsLine::Epoch(e) => ("epoch", serde_json::to_value(e)),
            MetricsLine::Eval(e) => ("eval", serde_json::to_value(e)),
            MetricsLine::KernelWarmup(_) => return Ok(()),
        };
        let value = value.map_err(|e| TrainerError::io(&self.writer.path, e))?;
        self.writer
            .scalars(steps_done, &flatten_scalars(prefix, &value))
    }

    /// A step's rewards as a histogram (`train/reward`, twenty buckets over [-1, 1]) and its
    /// first group, read as `conrub samples` prints it (`samples/first_group`).
    pub fn step_details(&mut self, out: &StepOutput, first: Option<&GroupSample>) -> Result<()> {
        let done = out.metrics.step + 1;
        let rewards: Vec<f64> = out
            .scores
            .iter()
            .flatten()
            .filter_map(|s| s.reward())
            .collect();
        let limits: Vec<f64> = (1..=20).map(|i| -1.0 + 0.1 * i as f64).collect();
        self.writer
            .histogram(done, "train/reward", &rewards, &limits)?;
        if let Some(g) = first {
            let text = format!("```\n{}```", format_group(g));
            self.writer.text(done, "samples/first_group", &text)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use conrub_contracts::StepMetrics;

    /// The Python of a venv with the `tensorboard` package (scripts/setup-tensorboard.sh makes
    /// `.tensorboard/venv`; `CONRUB_TENSORBOARD_PYTHON` names another). Without one the test says
    /// so and passes, unless `CONRUB_REQUIRE_TENSORBOARD=1` (CI) makes that a failure.
    fn tensorboard_python(test: &str) -> Option<PathBuf> {
        let default =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.tensorboard/venv/bin/python");
        let python = std::env::var_os("CONRUB_TENSORBOARD_PYTHON").map_or(default, PathBuf::from);
        if python.exists() {
            return Some(python);
        }
        let why = format!(
            "{test}: no {} (run scripts/setup-tensorboard.sh)",
            python.display()
        );
        assert!(
            std::env::var_os("CONRUB_REQUIRE_TENSORBOARD").is_none(),
            "{why}"
        );
        eprintln!("SKIPPED {why}");
        None
    }

    /// Issue 53, item 4: the session start of a resumed run was written as `log_message`
    /// (field 6), which TensorBoard ignores, so it showed both attempts' values of the repeated
    /// steps. Read here by TensorBoard's own `EventAccumulator`, not by a reader of ours.
    #[test]
    fn tensorboard_reads_a_resumed_run_with_one_value_per_step() {
        let Some(python) = tensorboard_python("tensorboard_reads_a_resumed_run") else {
            return;
        };
        let d = tempfile::tempdir().unwrap();
        let line = |step: u64, reward_mean: f64| MetricsLine::Step {
            epoch: 0,
            metrics: Box::new(StepMetrics {
                step,
                reward_mean,
                ..Default::default()
            }),
        };
        // The first attempt wrote steps 0-3, then was killed; its checkpoint is after 2 steps.
        let mut first = Dashboard::open(d.path(), None).unwrap();
        for i in 0..4 {
            first.line(&line(i, i as f64), i + 1).unwrap();
        }
        drop(first);
        let mut resumed = Dashboard::open(d.path(), Some(2)).unwrap();
        for i in 2..5 {
            resumed.line(&line(i, 100.0 + i as f64), i + 1).unwrap();
        }
        drop(resumed);
        let script = r#"
import json, sys
from tensorboard.backend.event_processing import event_accumulator as ea
acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0})
acc.Reload()
print(json.dumps([[e.step, e.value] for e in acc.Scalars("train/reward_mean")]))
"#;
        let out = std::process::Command::new(&python)
            .args(["-c", script])
            .arg(tensorboard_dir(d.path()))
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stdout}{stderr}");
        let got: Vec<(u64, f64)> = serde_json::from_str(stdout.trim()).unwrap();
        let want = vec![(1, 0.0), (2, 1.0), (3, 102.0), (4, 103.0), (5, 104.0)];
        assert_eq!(
            got, want,
            "one value per step, the resumed run's from step 3 on"
        );
    }

    /// The check value of CRC-32C ("123456789"), RFC 3720's test vectors, and the masked form
    /// of an empty payload.
    #[test]
    fn crc32c_matches_its_published_check_values() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62a8_ab43);
        // The empty payload's CRC is 0, so its masked form is the mask's constant alone.
        assert_eq!(masked_crc(b""), 0xa282_ead8);
    }

    #[test]
    fn nested_numbers_flatten_by_name() {
        let v = serde_json::json!({"a": 1, "ties": {"accepted": 3, "x": [1, 2]}, "s": "t", "n": null, "b": true});
        let mut got = flatten_scalars("train", &v);
        got.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            got,
            vec![
                ("train/a".to_string(), 1.0),
                ("train/b".to_string(), 1.0),
                ("train/ties/accepted".to_string(), 3.0)
            ]
        );
    }
}
