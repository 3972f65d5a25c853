//! The task's records: `data.rubrics`, or the files of `[[data.train]]` (rubric JSONL or any
//! format `conrub rubrics import` reads), each checked as `conrub rubrics validate` checks it,
//! ids unique over every file, then mixed by weight.
//!
//! A file of weight `w` and `n` records contributes `round(w * n)` records to the task: every
//! record `floor(w)` times, then a seeded choice (run seed and the file's place in the list) of
//! the rest. Repeats are new prompts to the learner: the k-th copy of `id` is `id~k` (k >= 2),
//! so its groups, seeds and samples are its own. The task is fixed at start; epochs go through
//! it in their seeded order as through one file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use conrub_config::{TrainConfig, TrainFile};
use conrub_rubric::import::ImportOptions;
use conrub_rubric::{
    import_file, read_jsonl, seeded_permutation, stable_seed, RubricRecord, RubricSet,
};

use crate::error::{Result, TrainerError};

/// One file's records with their line numbers (rows for an imported file).
pub(crate) struct FileRecords {
    /// The file.
    pub path: PathBuf,
    /// Its records, in file order.
    pub records: Vec<(usize, RubricRecord)>,
}

/// Every file's records, and the task they mix into.
pub(crate) struct TaskData {
    /// Each file as read.
    pub files: Vec<FileRecords>,
    /// The mixed task.
    pub task: RubricSet,
    /// Names the files in the opening line.
    pub describe: String,
}

/// The most prompts a task may hold once its files are mixed by weight: every one is a record
/// in memory (a weight of 1e6 ran conrub out of memory without a word).
pub(crate) const MAX_TASK_RECORDS: usize = 1 << 20;

/// Reads, checks and mixes the task's files.
pub(crate) fn read_task(cfg: &TrainConfig) -> Result<TaskData> {
    let specs = cfg.train_files()?;
    let mut files = Vec::with_capacity(specs.len());
    for spec in &specs {
        let records = read_file(spec)?;
        if records.is_empty() {
            return Err(TrainerError::Input {
                path: spec.path.clone(),
                message: "has no records".into(),
            });
        }
        check_records(&spec.path, &records)?;
        files.push(FileRecords {
            path: spec.path.clone(),
            records,
        });
    }
    check_unique_ids(&files)?;
    let mut mixed = Vec::new();
    for (i, (spec, file)) in specs.iter().zip(&files).enumerate() {
        mixed.extend(weighted(&file.records, spec.weight, cfg.learner.seed, i)?);
        if mixed.len() > MAX_TASK_RECORDS {
            return Err(TrainerError::Setup(format!(
                "data.train: the weighted files make {} prompts by data.train[{i}], over the {MAX_TASK_RECORDS} a task may hold",
                mixed.len()
            )));
        }
    }
    check_copy_ids(&files, &mixed)?;
    let (name, describe) = match specs.as_slice() {
        [one] if one.weight == 1.0 => (one.path.clone(), one.path.display().to_string()),
        _ => {
            let parts: Vec<String> = specs
                .iter()
                .zip(&files)
                .map(|(s, f)| format!("{} x {} ({})", s.weight, s.path.display(), f.records.len()))
                .collect();
            (PathBuf::from("data.train"), parts.join(" + "))
        }
    };
    let task = RubricSet::from_records(name, mixed)?;
    Ok(TaskData {
        files,
        task,
        describe,
    })
}

/// One file's records: rubric JSONL as it is, another format imported with
/// `rubrics import`'s defaults (line numbers are the rows').
fn read_file(spec: &TrainFile) -> Result<Vec<(usize, RubricRecord)>> {
    match spec.format {
        // Read without indexing: a repeated id is one of the errors the validator lists.
        None => Ok(read_jsonl(&spec.path)?),
        Some(format) => {
            let (records, report) = import_file(&spec.path, &ImportOptions::new(format))?;
            let skipped = report.rows - report.records;
            if skipped > 0 {
                tracing::warn!(
                    "{}: imported {} of {} rows ({} duplicate prompts; see `conrub rubrics import` for the rest)",
                    spec.path.display(),
                    report.records,
                    report.rows,
                    report.duplicate_prompts
                );
            }
            Ok(records
                .into_iter()
                .enumerate()
                .map(|(i, r)| {
                    let line = r.provenance.as_ref().map_or(i + 1, |p| p.line);
                    (line, r)
                })
                .collect())
        }
    }
}

/// Refuses an id that two files (or two lines) share, naming both places.
fn check_unique_ids(files: &[FileRecords]) -> Result<()> {
    let mut seen: HashMap<&str, (&Path, usize)> = HashMap::new();
    for f in files {
        for (line, r) in &f.records {
            if let Some((path, first)) = seen.insert(&r.id, (&f.path, *line)) {
                return Err(TrainerError::Input {
                    path: f.path.clone(),
                    message: format!(
                        "line {line}: prompt id `{}` is already used at {}:{first}; ids must be \
                         unique over every file of the task",
                        r.id,
                        path.display()
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Refuses a repeat's id (`id~k`) that is also a record's own id in some file.
fn check_copy_ids(files: &[FileRecords], mixed: &[RubricRecord]) -> Result<()> {
    let own: HashMap<&str, (&Path, usize)> = files
        .iter()
        .flat_map(|f| {
            f.records
                .iter()
                .map(move |(line, r)| (r.id.as_str(), (f.path.as_path(), *line)))
        })
        .collect();
    let mut seen = std::collections::HashSet::new();
    for r in mixed {
        if seen.insert(r.id.as_str()) {
            continue;
        }
        // A second record with this id: a repeat whose name a record of a file already has.
        let (path, line) = own
            .get(r.id.as_str())
            .copied()
            .unwrap_or((Path::new("data.train"), 0));
        return Err(TrainerError::Input {
            path: path.to_path_buf(),
            message: format!(
                "line {line}: prompt id `{}` is also the name of a repeat a weight above 1 makes \
                 (`ID~K`); rename the record",
                r.id
            ),
        });
    }
    Ok(())
}

/// The `round(weight * n)` records a file of weight `weight` contributes (see the module docs);
/// `index` is its place in `[[data.train]]`.
fn weighted(
    records: &[(usize, RubricRecord)],
    weight: f64,
    seed: u64,
    index: usize,
) -> Result<Vec<RubricRecord>> {
    let n = records.len();
    let wanted = (weight * n as f64).round();
    if wanted > MAX_TASK_RECORDS as f64 {
        return Err(TrainerError::Setup(format!(
            "data.train[{index}].weight: {weight} x {n} records makes {wanted} prompts, over the {MAX_TASK_RECORDS} a task may hold (each is a copy in memory)"
        )));
    }
    let count = wanted as usize;
    if count == 0 {
        return Err(TrainerError::Setup(format!(
            "data.train[{index}].weight: {weight} of {n} records draws none"
        )));
    }
    let (whole, rest) = (count / n, count % n);
    let mut out = Vec::with_capacity(count);
    for copy in 1..=whole {
        out.extend(records.iter().map(|(_, r)| copy_of(r, copy)));
    }
    let key = format!("data.train[{index}]");
    let mut chosen = seeded_permutation(n, stable_seed(&[&seed.to_le_bytes(), key.as_bytes()]));
    chosen.truncate(rest);
    chosen.sort_unstable();
    out.extend(
        chosen
            .into_iter()
            .map(|i| copy_of(&records[i].1, whole + 1)),
    );
    Ok(out)
}

/// Copy `k` (1-based) of a record: the record itself, or a new prompt `id~k`.
fn copy_of(r: &RubricRecord, k: usize) -> RubricRecord {
    let mut r = r.clone();
    if k > 1 {
        r.id = format!("{}~{k}", r.id);
    }
    r
}

/// Refuses `path`'s `records` (with their line numbers) as `conrub rubrics validate` does.
pub(crate) fn check_records(path: &Path, records: &[(usize, RubricRecord)]) -> Result<()> {
    let report = conrub_rubric::validate_records(records);
    if report.is_ok() {
        return Ok(());
    }
    let errors: Vec<String> = report
        .to_string()
        .lines()
        .filter_map(|l| l.strip_prefix("error: "))
        .map(|l| format!("  {}: {l}", path.display()))
        .collect();
    Err(TrainerError::Input {
        path: path.to_path_buf(),
        message: format!(
            "{} errors that `conrub rubrics validate` rejects; training refuses them:\n{}",
            report.errors(),
            errors.join("\n")
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use conrub_rubric::Message;

    fn records(n: usize) -> Vec<(usize, RubricRecord)> {
        (0..n)
            .map(|i| {
                let r = RubricRecord {
                    id: format!("r{i}"),
                    question: vec![Message::user(format!("q{i}"))],
                    reference_answer: None,
                    ground_truth: None,
                    source: None,
                    criteria: vec![],
                    provenance: None,
                };
                (i + 1, r)
            })
            .collect()
    }

    fn ids(v: &[RubricRecord]) -> Vec<&str> {
        v.iter().map(|r| r.id.as_str()).collect()
    }

    #[test]
    fn weights_repeat_records_and_choose_a_seeded_rest() {
        let recs = records(4);
        let one = weighted(&recs, 1.0, 7, 0).unwrap();
        assert_eq!(ids(&one), ["r0", "r1", "r2", "r3"]);
        let twice = weighted(&recs, 2.0, 7, 0).unwrap();
        assert_eq!(
            ids(&twice),
            ["r0", "r1", "r2", "r3", "r0~2", "r1~2", "r2~2", "r3~2"]
        );
        // 1.5 x 4 = 6: every record once, then two of them again, chosen by the seed.
        let more = weighted(&recs, 1.5, 7, 0).unwrap();
        assert_eq!(more.len(), 6);
        assert_eq!(ids(&more)[..4], ["r0", "r1", "r2", "r3"]);
        assert!(more[4..].iter().all(|r| r.id.ends_with("~2")));
        assert_eq!(ids(&weighted(&recs, 1.5, 7, 0).unwrap()), ids(&more));
        // 0.5 x 4 = 2: a seeded half, in file order; another seed or place, another half.
        let half = weighted(&recs, 0.5, 7, 0).unwrap();
        assert_eq!(half.len(), 2);
        assert!(half[0].id < half[1].id);
        let halves: std::collections::BTreeSet<Vec<String>> = (0..16)
            .map(|s| {
                weighted(&recs, 0.5, s, 1)
                    .unwrap()
                    .into_iter()
                    .map(|r| r.id)
                    .collect()
            })
            .collect();
        assert!(halves.len() > 1, "the seed chooses: {halves:?}");
        let e = weighted(&recs, 0.1, 7, 3).unwrap_err().to_string();
        assert!(e.contains("data.train[3].weight"), "{e}");
        // Issue 53, item 11: a weight of 1e6 is refused before any copy is made.
        let e = weighted(&recs, 1e6, 7, 2).unwrap_err().to_string();
        assert!(
            e.contains("data.train[2].weight: 1000000 x") && e.contains("over the"),
            "{e}"
        );
    }

    #[test]
    fn a_repeat_named_like_a_record_is_refused() {
        let mut recs = records(2);
        recs[1].1.id = "r0~2".into();
        let files = vec![FileRecords {
            path: "a.jsonl".into(),
            records: recs.clone(),
        }];
        let mixed = weighted(&recs, 2.0, 7, 0).unwrap();
        let e = check_copy_ids(&files, &mixed).unwrap_err().to_string();
        assert!(
            e.contains("a.jsonl") && e.contains("line 2") && e.contains("`r0~2`"),
            "{e}"
        );
        assert!(check_copy_ids(&files, &weighted(&recs, 1.0, 7, 0).unwrap()).is_ok());
    }

    #[test]
    fn an_id_in_two_files_is_refused_with_both_places() {
        let files = vec![
            FileRecords {
                path: "a.jsonl".into(),
                records: records(2),
            },
            FileRecords {
                path: "b.jsonl".into(),
                records: records(3)[1..].to_vec(),
            },
        ];
        let e = check_unique_ids(&files).unwrap_err().to_string();
        assert!(
            e.contains("b.jsonl") && e.contains("`r1`") && e.contains("a.jsonl:2"),
            "{e}"
        );
    }
}
