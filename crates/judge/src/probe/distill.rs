//! Distilling a probe: features for every labelled row (reusing stored ones), a split by prompt,
//! a sweep over layers and poolings on a validation split carved from the training prompts (the
//! held-out prompts are never looked at until the end), a fit of the chosen setting on all
//! training prompts, and its agreement with the labels on the held-out prompts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use conrub_kernels::KernelOps;
use conrub_rubric::{Label, ScoringMode};
use serde::{Deserialize, Serialize};

use crate::error::{JudgeError, Result};
use crate::probe::examples::{split_by_prompt, LabelledExample};
use crate::probe::features::{FeatureSpec, FeatureStore, Pooling, ProbeFeaturizer, StoreMeta};
use crate::probe::linear::{LinearProbe, ProbeMeta, ProbeTraining, PROBE_FORMAT};
use crate::probe::metrics::{agreement, Agreement};

/// Settings of a distillation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DistillConfig {
    /// Feature layer; `None` sweeps [`candidate_layers`].
    pub layer: Option<usize>,
    /// Feature pooling; `None` sweeps both.
    pub pooling: Option<Pooling>,
    /// Share of prompts held out for the final report.
    pub holdout: f64,
    /// Share of the training prompts the sweep validates on.
    pub validation: f64,
    /// Seed of both splits.
    pub seed: u64,
    /// How each probe is fitted.
    pub training: ProbeTraining,
    /// Rows per feature-store shard.
    pub shard_rows: usize,
}

impl Default for DistillConfig {
    fn default() -> Self {
        Self {
            layer: None,
            pooling: None,
            holdout: 0.2,
            validation: 0.2,
            seed: 0,
            training: ProbeTraining::default(),
            shard_rows: 256,
        }
    }
}

/// The layers a sweep tries on a model with `n` decoder layers: a quarter, half and three
/// quarters of the way up, and the last (after the final norm). Probing work on judges finds the
/// middle layers best more often than the last, whose states are shaped for next-token
/// prediction; the sweep decides per model and label set.
pub fn candidate_layers(n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = [n / 4, n / 2, (3 * n) / 4, n]
        .into_iter()
        .map(|l| l.max(1).min(n.max(1)))
        .collect();
    v.sort();
    v.dedup();
    v
}

/// Rows, prompts and labels of a split.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SplitCounts {
    /// Labelled rows.
    pub rows: u64,
    /// Distinct prompts.
    pub prompts: u64,
    /// Rows per label.
    pub labels: BTreeMap<String, u64>,
}

/// One setting the sweep tried.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepRow {
    /// Layer.
    pub layer: usize,
    /// Pooling.
    pub pooling: Pooling,
    /// Macro-F1 on the validation prompts.
    pub macro_f1: f64,
    /// Kappa on the validation prompts.
    pub kappa: f64,
    /// Accuracy on the validation prompts.
    pub accuracy: f64,
}

/// What a distillation did and how well the probe agrees with its teacher.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DistillReport {
    /// The probe's metadata (model, layer, pooling, labels, template).
    pub probe: ProbeMeta,
    /// Where the probe was written.
    pub probe_file: PathBuf,
    /// `given` (both settings named) or `sweep`.
    pub chosen_by: String,
    /// The sweep on validation prompts (empty when both settings were given).
    pub sweep: Vec<SweepRow>,
    /// Training split (the sweep's fit and validation prompts together).
    pub train: SplitCounts,
    /// Held-out split.
    pub heldout_counts: SplitCounts,
    /// Agreement with the teacher's labels on the held-out prompts.
    pub heldout: Agreement,
    /// Feature rows computed by this run.
    pub features_computed: u64,
    /// Feature rows read from the store instead.
    pub features_reused: u64,
    /// Seconds spent computing features.
    pub feature_secs: f64,
    /// Seconds spent fitting probes.
    pub fit_secs: f64,
}

fn counts(examples: &[LabelledExample], ix: &[usize]) -> SplitCounts {
    let mut c = SplitCounts::default();
    let mut prompts = std::collections::BTreeSet::new();
    for &i in ix {
        c.rows += 1;
        prompts.insert(examples[i].prompt_id.as_str());
        *c.labels
            .entry(examples[i].label.as_str().into())
            .or_default() += 1;
    }
    c.prompts = prompts.len() as u64;
    c
}

/// Distils a probe from `examples` (labels of set `mode`) on `featurizer`'s model, writing the
/// feature store under `out/features` and the probe to `out/probe.safetensors`. `base_model` is
/// how the model was named (recorded in the probe). `progress(done, total)` follows feature
/// extraction by rows.
pub fn distill<B: KernelOps>(
    featurizer: &ProbeFeaturizer<B>,
    base_model: &str,
    mode: ScoringMode,
    examples: &[LabelledExample],
    cfg: &DistillConfig,
    out: &Path,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<DistillReport> {
    let labels: Vec<Label> = mode.labels().to_vec();
    let class = |l: Label| labels.iter().position(|&x| x == l);
    let y: Vec<usize> = examples
        .iter()
        .enumerate()
        .map(|(i, e)| {
            class(e.label).ok_or_else(|| {
                JudgeError::Probe(format!(
                    "row {i}: label `{}` is not a {} label",
                    e.label.as_str(),
                    mode.as_str()
                ))
            })
        })
        .collect::<Result<_>>()?;
    let n_layers = featurizer.num_layers();
    if let Some(l) = cfg.layer.filter(|&l| l == 0 || l > n_layers) {
        return Err(JudgeError::config(
            "layer",
            format!("{l} is not a layer of this model (1..={n_layers})"),
        ));
    }
    let layers = cfg
        .layer
        .map_or_else(|| candidate_layers(n_layers), |l| vec![l]);
    let poolings = cfg.pooling.map_or(Pooling::ALL.to_vec(), |p| vec![p]);
    let specs: Vec<FeatureSpec> = layers
        .iter()
        .flat_map(|&layer| {
            poolings
                .iter()
                .map(move |&pooling| FeatureSpec { layer, pooling })
        })
        .collect();
    let h = featurizer.hidden_size();
    let meta = StoreMeta {
        model_sha256: featurizer.model_digest().to_string(),
        template_version: featurizer.template_version(mode),
        mode,
        specs: specs.clone(),
        hidden_size: h,
        precision: featurizer.precision(),
        span_version: StoreMeta::span_version_for(&specs),
    };
    let mut store = FeatureStore::open(&out.join("features"), &meta, cfg.shard_rows)?;
    let keys: Vec<_> = examples.iter().map(|e| e.feature_key(mode)).collect();

    // Features, one response (all its missing criteria) at a time.
    let started = Instant::now();
    let mut groups: BTreeMap<(&str, &str), Vec<usize>> = BTreeMap::new();
    for (i, e) in examples.iter().enumerate() {
        groups.entry((&e.prompt, &e.response)).or_default().push(i);
    }
    let total = examples.len();
    let reused = keys.iter().filter(|k| store.get(k).is_some()).count();
    let mut done = reused;
    progress(done, total);
    for ((question, response), rows) in groups {
        let todo: Vec<usize> = rows
            .into_iter()
            .filter(|&i| store.get(&keys[i]).is_none())
            .collect();
        if todo.is_empty() {
            continue;
        }
        let criteria: Vec<String> = todo
            .iter()
            .map(|&i| examples[i].criterion.clone())
            .collect();
        let feats = featurizer.features(mode, question, response, &criteria, &specs)?;
        for (&i, f) in todo.iter().zip(feats) {
            store.insert(keys[i], f)?;
        }
        done += todo.len();
        progress(done, total);
    }
    store.flush()?;
    let feature_secs = started.elapsed().as_secs_f64();

    let row = |i: usize, s: usize| -> &[f32] {
        &store.get(&keys[i]).expect("every row has features")[s * h..(s + 1) * h]
    };
    let fit_started = Instant::now();
    let device = featurizer.device();
    let fit = |ix: &[usize], s: usize| -> LinearProbe {
        let rows: Vec<&[f32]> = ix.iter().map(|&i| row(i, s)).collect();
        let ys: Vec<usize> = ix.iter().map(|&i| y[i]).collect();
        LinearProbe::fit::<B>(&rows, &ys, &labels, &cfg.training, device)
    };
    let score = |probe: &LinearProbe, ix: &[usize], s: usize| -> Agreement {
        let probs: Vec<Vec<f64>> = ix.iter().map(|&i| probe.probabilities(row(i, s))).collect();
        let pred: Vec<usize> = probs.iter().map(|p| argmax(p)).collect();
        let reference: Vec<usize> = ix.iter().map(|&i| y[i]).collect();
        agreement(&labels, &reference, &pred, &probs)
    };
    let (train, heldout) = split_by_prompt(examples, cfg.holdout, cfg.seed);
    if train.is_empty() || heldout.is_empty() {
        return Err(JudgeError::Probe(format!(
            "{} labelled rows from {} prompt(s): a split by prompt needs at least two prompts",
            examples.len(),
            counts(examples, &(0..examples.len()).collect::<Vec<_>>()).prompts
        )));
    }
    let mut sweep = Vec::new();
    let chosen = if specs.len() == 1 {
        0
    } else {
        let sub: Vec<LabelledExample> = train.iter().map(|&i| examples[i].clone()).collect();
        let (fit_ix, val_ix) = split_by_prompt(&sub, cfg.validation, cfg.seed.wrapping_add(1));
        let fit_ix: Vec<usize> = fit_ix.iter().map(|&j| train[j]).collect();
        let val_ix: Vec<usize> = val_ix.iter().map(|&j| train[j]).collect();
        let mut best = 0;
        for (s, spec) in specs.iter().enumerate() {
            let a = score(&fit(&fit_ix, s), &val_ix, s);
            sweep.push(SweepRow {
                layer: spec.layer,
                pooling: spec.pooling,
                macro_f1: a.macro_f1,
                kappa: a.kappa,
                accuracy: a.accuracy,
            });
            let (b, r) = (&sweep[best], &sweep[s]);
            if (r.macro_f1, r.kappa) > (b.macro_f1, b.kappa) {
                best = s;
            }
        }
        best
    };
    let probe = fit(&train, chosen);
    let heldout_agreement = score(&probe, &heldout, chosen);
    let fit_secs = fit_started.elapsed().as_secs_f64();
    let spec = specs[chosen];
    let meta = ProbeMeta {
        format: PROBE_FORMAT,
        base_model: base_model.to_string(),
        base_model_sha256: featurizer.model_digest().to_string(),
        layer: spec.layer,
        pooling: spec.pooling,
        mode,
        labels: labels.clone(),
        template_version: featurizer.template_version(mode),
        hidden_size: h,
        precision: featurizer.precision(),
    };
    std::fs::create_dir_all(out).map_err(|e| JudgeError::File {
        path: out.into(),
        source: e,
    })?;
    let probe_file = out.join(crate::probe::linear::PROBE_FILE);
    probe.save(&probe_file, &meta)?;
    let report = DistillReport {
        probe: meta,
        probe_file,
        chosen_by: if specs.len() == 1 { "given" } else { "sweep" }.into(),
        sweep,
        train: counts(examples, &train),
        heldout_counts: counts(examples, &heldout),
        heldout: heldout_agreement,
        features_computed: (total - reused) as u64,
        features_reused: reused as u64,
        feature_secs,
        fit_secs,
    };
    let text = serde_json::to_string_pretty(&report).expect("report serialises");
    conrub_base::write_bytes_atomic(&out.join("report.json"), text.as_bytes()).map_err(|e| {
        JudgeError::File {
            path: e.path,
            source: e.source,
        }
    })?;
    Ok(report)
}

/// Index of the largest value (the first of equals).
pub(crate) fn argmax(p: &[f64]) -> usize {
    let mut best = 0;
    for (k, &v) in p.iter().enumerate() {
        if v > p[best] {
            best = k;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweeps_cover_the_depth() {
        assert_eq!(candidate_layers(28), vec![7, 14, 21, 28]);
        assert_eq!(candidate_layers(2), vec![1, 2]);
        assert_eq!(candidate_layers(1), vec![1]);
    }
}
