//! The probe judge: labels every criterion of a response from a distilled probe over an
//! in-process model's hidden states, with no generation (one prefix pass and `⌈criteria /
//! batch_size⌉` suffix passes per response, see [`crate::probe::features`]). Criteria whose top
//! class probability is under `abstain_below` go to a fallback judge, in one request per response
//! holding only those criteria.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use conrub_kernels::KernelOps;
use conrub_rubric::Label;
use serde::Serialize;
use sha2::Digest;

use crate::cache::{hex, CacheKey, JudgeCache};
use crate::error::{JudgeError, Result};
use crate::judge::{CriterionJudge, CriterionRequest, CriterionVerdict};
use crate::probe::distill::argmax;
use crate::probe::features::{FeatureSpec, Pooling, ProbeFeaturizer};
use crate::probe::linear::{LinearProbe, ProbeMeta, PROBE_FORMAT};

/// Where abstained criteria go.
pub struct Abstention {
    /// Criteria whose top class probability is below this go to `fallback`.
    pub below: f64,
    /// The judge that labels them.
    pub fallback: Arc<dyn CriterionJudge>,
}

/// The probe judge on backend `B`.
pub struct ProbeJudge<B: KernelOps> {
    featurizer: Mutex<ProbeFeaturizer<B>>,
    probe: LinearProbe,
    meta: ProbeMeta,
    abstention: Option<Abstention>,
    cache: Option<Arc<JudgeCache>>,
    name: String,
}

/// One criterion's probe output, kept as the verdict's raw output.
#[derive(Serialize)]
struct Scored {
    label: Label,
    p: f64,
    by: &'static str,
}

impl<B: KernelOps> ProbeJudge<B> {
    /// A judge from a featurizer and the probe file at `probe_path` (or the folder
    /// `conrub judge distill --out` wrote, holding `probe.safetensors`). Refuses a probe distilled
    /// from another model (by digest), over another prompt version, at another precision than the
    /// featurizer's model runs at, or of another width, and a mean-pooled probe of format 1
    /// (whose features depended on the batch); `layer` and `pooling`, when a config names them,
    /// must be the probe's.
    pub fn new(
        featurizer: ProbeFeaturizer<B>,
        probe_path: &std::path::Path,
        expect: Option<FeatureSpecFilter>,
        abstention: Option<Abstention>,
        cache: Option<Arc<JudgeCache>>,
    ) -> Result<Self> {
        let probe_file = crate::probe::linear::probe_file(probe_path)?;
        let probe_path = probe_file.as_path();
        let bytes = std::fs::read(probe_path).map_err(|e| JudgeError::File {
            path: probe_path.into(),
            source: e,
        })?;
        let (probe, meta) = LinearProbe::from_bytes(&bytes, probe_path)?;
        let refuse = |m: String| {
            Err(JudgeError::Probe(format!(
                "{} does not fit this judge: {m}",
                probe_path.display()
            )))
        };
        if meta.base_model_sha256 != featurizer.model_digest() {
            return refuse(format!(
                "it was distilled from {} (sha256 {}), and {} is another model (sha256 {})",
                meta.base_model,
                &meta.base_model_sha256[..16.min(meta.base_model_sha256.len())],
                featurizer.model_dir().display(),
                &featurizer.model_digest()[..16]
            ));
        }
        let template = featurizer.template_version(meta.mode);
        if meta.template_version != template {
            return refuse(format!(
                "it was read over prompt version {}, and this judge's {} prompt is version \
                 {template} (distill again with the same prompts)",
                meta.template_version,
                meta.mode.as_str()
            ));
        }
        if meta.format > PROBE_FORMAT {
            return refuse(format!(
                "it is of format {}, newer than this build reads ({PROBE_FORMAT})",
                meta.format
            ));
        }
        if meta.format < 2 && meta.pooling == Pooling::Mean {
            return refuse(
                "it pools with `mean` over features of probe format 1, whose span depended on \
                 which criteria ran together (distill it again)"
                    .into(),
            );
        }
        let precision = featurizer.precision();
        if meta.precision != precision {
            return refuse(format!(
                "precision: it was distilled at precision = \"{}\", and this judge runs at \
                 precision = \"{precision}\" (set the judge's `precision` to the probe's, or \
                 distill again with --precision {precision})",
                meta.precision
            ));
        }
        if meta.layer > featurizer.num_layers() || meta.hidden_size != featurizer.hidden_size() {
            return refuse(format!(
                "layer {} of width {} on a model of {} layers of width {}",
                meta.layer,
                meta.hidden_size,
                featurizer.num_layers(),
                featurizer.hidden_size()
            ));
        }
        if let Some(f) = expect {
            if let Some(l) = f.layer.filter(|&l| l != meta.layer) {
                return refuse(format!(
                    "the config asks for layer {l}, the probe reads layer {}",
                    meta.layer
                ));
            }
            if let Some(p) = f.pooling.filter(|&p| p != meta.pooling) {
                return refuse(format!(
                    "the config asks for {} pooling, the probe uses {}",
                    p.as_str(),
                    meta.pooling.as_str()
                ));
            }
        }
        if let Some(a) = &abstention {
            if !(a.below > 0.0 && a.below <= 1.0) {
                return Err(JudgeError::config(
                    "abstain_below",
                    format!("{} is not a probability in (0, 1]", a.below),
                ));
            }
        }
        let digest = hex(&sha2::Sha256::digest(&bytes));
        let mut name = format!(
            "probe:{}:{}",
            featurizer.model_dir().display(),
            &digest[..16]
        );
        if let Some(a) = &abstention {
            name.push_str(&format!(":abstain<{}:{}", a.below, a.fallback.id()));
        }
        Ok(Self {
            featurizer: Mutex::new(featurizer),
            probe,
            meta,
            abstention,
            cache,
            name,
        })
    }

    /// The probe's metadata.
    pub fn meta(&self) -> &ProbeMeta {
        &self.meta
    }

    fn key(&self, r: &CriterionRequest) -> CacheKey {
        r.cache_key(&self.name, &self.meta.template_version)
    }

    /// The probe's labels and top probabilities for one request.
    fn probe_labels(&self, r: &CriterionRequest) -> Result<Vec<(Label, f64)>> {
        if r.mode != self.meta.mode {
            return Err(JudgeError::Probe(format!(
                "a {} probe cannot grade {} criteria",
                self.meta.mode.as_str(),
                r.mode.as_str()
            )));
        }
        let spec = FeatureSpec {
            layer: self.meta.layer,
            pooling: self.meta.pooling,
        };
        let f = self.featurizer.lock().unwrap_or_else(|p| p.into_inner());
        let feats = f.features(r.mode, &r.question, &r.response, &r.criteria, &[spec])?;
        Ok(feats
            .iter()
            .map(|x| {
                let p = self.probe.probabilities(x);
                let k = argmax(&p);
                (self.probe.labels[k], p[k])
            })
            .collect())
    }
}

/// Layer and pooling a config expects of its probe.
#[derive(Debug, Clone, Copy, Default)]
pub struct FeatureSpecFilter {
    /// Expected layer.
    pub layer: Option<usize>,
    /// Expected pooling.
    pub pooling: Option<super::pooling::Pooling>,
}

#[async_trait]
impl<B: KernelOps> CriterionJudge for ProbeJudge<B> {
    fn id(&self) -> String {
        self.name.clone()
    }

    async fn judge(&self, r: &CriterionRequest) -> CriterionVerdict {
        self.judge_batch(std::slice::from_ref(r))
            .await
            .pop()
            .expect("one verdict per request")
    }

    async fn judge_batch(&self, requests: &[CriterionRequest]) -> Vec<CriterionVerdict> {
        let start = Instant::now();
        let mut verdicts: Vec<Option<CriterionVerdict>> = vec![None; requests.len()];
        let keys: Vec<CacheKey> = requests.iter().map(|r| self.key(r)).collect();
        let mut scored: Vec<(usize, Vec<(Label, f64)>)> = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            if let Some((labels, raw)) = self
                .cache
                .as_ref()
                .and_then(|c| c.get_parsed::<Vec<Label>>(&keys[i]))
                .filter(|(l, _)| l.len() == r.criteria.len())
            {
                let mut v = CriterionVerdict::labelled(labels, vec![raw], 0, start.elapsed());
                v.cached = true;
                verdicts[i] = Some(v);
                continue;
            }
            match self.probe_labels(r) {
                Ok(l) => scored.push((i, l)),
                Err(e) => {
                    verdicts[i] = Some(CriterionVerdict::failed(
                        e.to_string(),
                        Vec::new(),
                        1,
                        start.elapsed(),
                    ))
                }
            }
        }
        // Abstained criteria, one fallback request per response.
        let mut deferred: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut fallback_requests = Vec::new();
        if let Some(a) = &self.abstention {
            for (i, labels) in &scored {
                let low: Vec<usize> = (0..labels.len())
                    .filter(|&k| labels[k].1 < a.below)
                    .collect();
                if low.is_empty() {
                    continue;
                }
                let r = &requests[*i];
                fallback_requests.push(CriterionRequest {
                    criteria: low.iter().map(|&k| r.criteria[k].clone()).collect(),
                    ..r.clone()
                });
                deferred.push((*i, low));
            }
        }
        let answers = match &self.abstention {
            Some(a) if !fallback_requests.is_empty() => {
                a.fallback.judge_batch(&fallback_requests).await
            }
            _ => Vec::new(),
        };
        let mut by: Vec<Vec<&'static str>> = vec![Vec::new(); requests.len()];
        for (i, labels) in &scored {
            by[*i] = vec!["probe"; labels.len()];
        }
        let mut failed: Vec<Option<String>> = vec![None; requests.len()];
        for ((i, low), answer) in deferred.iter().zip(answers) {
            let entry = scored.iter_mut().find(|(j, _)| j == i).expect("scored");
            match answer.labels {
                Some(l) if l.len() == low.len() => {
                    for (&k, label) in low.iter().zip(l) {
                        entry.1[k].0 = label;
                        by[*i][k] = "fallback";
                    }
                }
                _ => {
                    failed[*i] = Some(format!(
                        "fallback judge {}: {}",
                        self.abstention.as_ref().expect("abstaining").fallback.id(),
                        answer
                            .error
                            .unwrap_or_else(|| "wrong number of labels".into())
                    ));
                }
            }
        }
        for (i, labels) in scored {
            let raw: Vec<Scored> = labels
                .iter()
                .zip(&by[i])
                .map(|(&(label, p), &by)| Scored { label, p, by })
                .collect();
            let raw = serde_json::to_string(&raw).expect("probe output serialises");
            let n_deferred = by[i].iter().filter(|b| **b == "fallback").count();
            let mut v = match failed[i].take() {
                Some(e) => CriterionVerdict::failed(e, vec![raw], 1, start.elapsed()),
                None => {
                    let l: Vec<Label> = labels.iter().map(|x| x.0).collect();
                    if let Some(c) = &self.cache {
                        c.put_criteria(&keys[i], &self.name, &requests[i], &l, &raw);
                    }
                    CriterionVerdict::labelled(l, vec![raw], 1, start.elapsed())
                }
            };
            v.deferred = n_deferred as u32;
            verdicts[i] = Some(v);
        }
        verdicts
            .into_iter()
            .map(|v| v.expect("every request answered"))
            .collect()
    }
}

/// The pairwise side of a probe judge without a fallback: a probe labels criteria and cannot
/// compare two responses, so every comparison comes back unanswered, saying why.
pub struct NoComparisons;

#[async_trait]
impl crate::judge::PairwiseJudge for NoComparisons {
    fn id(&self) -> String {
        "probe:no-comparisons".into()
    }

    async fn compare(&self, _: &crate::judge::PairRequest) -> crate::judge::PairVerdict {
        crate::judge::PairVerdict {
            answer: None,
            error: Some(
                "a probe judge cannot compare responses: give it a fallback judge, or turn \
                 tie-breaking off"
                    .into(),
            ),
            raw_outputs: Vec::new(),
            attempts: 0,
            latency_ms: 0.0,
            cached: false,
        }
    }
}
