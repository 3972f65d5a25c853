//! The in-process judge: our burn model (any `conrub_models` family) with the same prompts as the HTTP judge, so a run needs no
//! server. Two modes:
//!
//! - `generate`: the model writes the JSON answer (greedy; a failed parse is retried with seeded
//!   sampling), parsed exactly like a served judge's output.
//! - `logprob-margin` (docs/METHOD.md §9, cheap judges): per criterion, one forward pass over a
//!   one-criterion prompt; the label whose first token is most likely wins, and the log-probability
//!   margin over the runner-up is reported. No sampling.
//!
//! Pairwise comparisons always use `generate`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use burn::tensor::activation::log_softmax;
use burn::tensor::{DType, Int, Tensor, TensorData};
use conrub_kernels::KernelOps;
use conrub_models::{Execution, Precision, Pretrained};
use conrub_rollout::{Decoding, SamplingConfig};
use conrub_rubric::{Label, ScoringMode};

use crate::cache::{CacheKey, JudgeCache};
use crate::client::CallError;
use crate::error::{JudgeError, Result};
use crate::judge::{
    CriterionJudge, CriterionRequest, CriterionVerdict, PairRequest, PairVerdict, PairwiseJudge,
};
use crate::parse::{parse_labels, parse_pair, OutputError};
use crate::prefix::{chat_ids, SharedPrefix};
use crate::prompts::PromptSet;

pub use conrub_settings::{LocalJudgeConfig, LocalMode};

/// The in-process judge on backend `B`.
pub struct LocalJudge<B: KernelOps> {
    model: Mutex<Pretrained<B>>,
    device: B::Device,
    prompts: PromptSet,
    cfg: LocalJudgeConfig,
    label_tokens: HashMap<Label, Vec<u32>>,
    cache: Option<Arc<JudgeCache>>,
    name: String,
}

/// Single-token spellings of a label (`correct`, `Correct`, ...).
fn label_token_ids<B: KernelOps>(model: &Pretrained<B>, label: Label) -> Result<Vec<u32>> {
    let tok = model
        .tokenizer
        .as_ref()
        .ok_or_else(|| JudgeError::Unfit(format!("{}: no tokenizer.json", model.dir.display())))?;
    let word = label.as_str();
    let mut cap = word.to_string();
    cap[..1].make_ascii_uppercase();
    let mut ids = Vec::new();
    for variant in [word.to_string(), cap, format!("\"{word}")] {
        let enc = tok
            .encode(&variant)
            .map_err(|e| JudgeError::Model(Box::new(e)))?;
        if enc.len() == 1 && !ids.contains(&enc[0]) && (enc[0] as usize) < model.config.vocab_size {
            ids.push(enc[0]);
        }
    }
    if ids.is_empty() {
        return Err(JudgeError::Unfit(format!(
            "label `{word}` is not a single token of this tokenizer; use mode = \"generate\""
        )));
    }
    Ok(ids)
}

fn log_sum_exp(xs: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = xs.collect();
    let m = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + v.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
}

impl<B: KernelOps> LocalJudge<B> {
    /// A judge around a loaded model (which must have its tokenizer), running at
    /// `cfg.precision`.
    pub fn new(
        model: Pretrained<B>,
        device: B::Device,
        prompts: PromptSet,
        cfg: LocalJudgeConfig,
        cache: Option<Arc<JudgeCache>>,
    ) -> Result<Self> {
        let exec = Execution {
            precision: cfg.precision,
            ..model.model.execution()
        };
        let model = model.with_execution(exec);
        if model.tokenizer.is_none() {
            return Err(JudgeError::Unfit(format!(
                "{}: the in-process judge needs tokenizer.json",
                model.dir.display()
            )));
        }
        if cfg.batch_size == 0 {
            return Err(JudgeError::config("local.batch_size", "must be at least 1"));
        }
        let mut label_tokens = HashMap::new();
        if cfg.mode == LocalMode::LogprobMargin {
            for mode in [ScoringMode::Binary, ScoringMode::ThreeState] {
                for &l in mode.labels() {
                    label_tokens.insert(l, label_token_ids(&model, l)?);
                }
            }
        }
        let mode = match cfg.mode {
            LocalMode::Generate => "generate",
            LocalMode::LogprobMargin => "logprob-margin",
        };
        // Verdicts depend on the precision: the cache keeps them apart (f32 keeps its old name).
        let name = match cfg.precision {
            Precision::F32 => format!("local:{}:{mode}", model.dir.display()),
            p => format!("local:{}:{mode}:{p}", model.dir.display()),
        };
        Ok(Self {
            model: Mutex::new(model),
            device,
            prompts,
            cfg,
            label_tokens,
            cache,
            name,
        })
    }

    /// Generates answers for `prompts` (system, user) and parses each with `parse`; unparseable
    /// ones are retried with sampling. Returns per prompt (result, raw outputs, attempts).
    fn generate_parsed<T>(
        &self,
        prompts: &[(String, String)],
        parse: impl Fn(usize, &str) -> std::result::Result<T, OutputError>,
    ) -> Vec<(std::result::Result<T, CallError>, Vec<String>, u32)> {
        let model = self.model.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<(std::result::Result<T, CallError>, Vec<String>, u32)> = (0..prompts
            .len())
            .map(|_| (Err(CallError("not attempted".into())), Vec::new(), 0))
            .collect();
        let ids: Vec<conrub_models::Result<Vec<u32>>> = prompts
            .iter()
            .map(|(s, u)| chat_ids(&model, s, u))
            .collect();
        let mut pending: Vec<usize> = Vec::new();
        for (i, r) in ids.iter().enumerate() {
            match r {
                Ok(_) => pending.push(i),
                Err(e) => out[i].0 = Err(CallError(format!("chat template: {e}"))),
            }
        }
        let tok = model.tokenizer.as_ref().expect("checked in new");
        for attempt in 0..=self.cfg.max_retries {
            if pending.is_empty() {
                break;
            }
            let sampling = SamplingConfig {
                max_new_tokens: self.cfg.max_new_tokens,
                decoding: if attempt == 0 {
                    Decoding::Greedy
                } else {
                    Decoding::temperature(0.7)
                },
                seed: self.cfg.seed.wrapping_add(attempt as u64),
                stop_ids: model.stop_ids(),
                first_stream: 0,
            };
            let mut still = Vec::new();
            for chunk in pending.chunks(self.cfg.batch_size) {
                let batch: Vec<Vec<u32>> = chunk
                    .iter()
                    .map(|&i| ids[i].as_ref().expect("pending ids are valid").clone())
                    .collect();
                match model.generate(&batch, &sampling, &self.device) {
                    Ok(gens) => {
                        for (&i, g) in chunk.iter().zip(gens) {
                            let text = tok.decode(&g.tokens, true).unwrap_or_default();
                            out[i].2 += 1;
                            match parse(i, &text) {
                                Ok(v) => out[i].0 = Ok(v),
                                Err(e) => {
                                    out[i].0 = Err(CallError(format!("unparseable output: {e}")));
                                    still.push(i);
                                }
                            }
                            out[i].1.push(text);
                        }
                    }
                    Err(e) => {
                        for &i in chunk {
                            out[i].2 += 1;
                            out[i].0 = Err(CallError(format!("generation failed: {e}")));
                        }
                    }
                }
            }
            pending = still;
        }
        out
    }

    /// Cheap mode: labels and margins for every (request, criterion). The criterion prompts of one
    /// response share their token prefix (system prompt, question, response); it is run once into
    /// a KV cache, copied per criterion, and only the criterion-specific suffixes are run on top.
    fn margin_labels(
        &self,
        requests: &[&CriterionRequest],
    ) -> Vec<std::result::Result<(Vec<Label>, Vec<f64>), CallError>> {
        let model = self.model.lock().unwrap_or_else(|p| p.into_inner());
        requests
            .iter()
            .map(|r| {
                let seqs: Vec<Vec<u32>> = r
                    .criteria
                    .iter()
                    .map(|c| {
                        let (s, u) =
                            self.prompts
                                .render_single(r.mode, &r.question, &r.response, c);
                        chat_ids(&model, &s, &u)
                            .map_err(|e| CallError(format!("chat template: {e}")))
                    })
                    .collect::<std::result::Result<_, _>>()?;
                let mut labels = Vec::with_capacity(seqs.len());
                let mut margins = Vec::with_capacity(seqs.len());
                // The next-token distribution after the whole prompt does not depend on where
                // the prompts split, so no span starts are needed.
                let mut shared = SharedPrefix::new(&model, &seqs, None, None, &self.device);
                let bs = self.cfg.batch_size;
                for start in (0..seqs.len()).step_by(bs) {
                    let rows = start..(start + bs).min(seqs.len());
                    for (l, m) in self.next_token_labels(&model, &mut shared, rows, r.mode)? {
                        labels.push(l);
                        margins.push(m);
                    }
                }
                Ok((labels, margins))
            })
            .collect()
    }

    /// Label and margin from the next-token distribution after each prompt `rows` of `shared`.
    fn next_token_labels(
        &self,
        model: &Pretrained<B>,
        shared: &mut SharedPrefix<B>,
        rows: std::ops::Range<usize>,
        mode: ScoringMode,
    ) -> std::result::Result<Vec<(Label, f64)>, CallError> {
        let n = rows.len();
        let suffix = shared.rows(rows, model.pad_id(), &self.device);
        let (kv, pass) = shared.cache();
        // Log-softmax on the device; only the label tokens' columns come back to the host.
        let labels = mode.labels();
        let columns: Vec<u32> = labels
            .iter()
            .flat_map(|l| self.label_tokens[l].iter().copied())
            .collect();
        let logp = log_softmax(
            model
                .model
                .forward_last_paged(&suffix.batch, kv, pass)
                .cast(DType::F32),
            1,
        );
        let idx = Tensor::<B, 1, Int>::from_data(
            TensorData::new(
                columns.iter().map(|&c| c as i64).collect::<Vec<_>>(),
                [columns.len()],
            ),
            &self.device,
        );
        let host: Vec<f32> = logp
            .select(1, idx)
            .into_data()
            .convert::<f32>()
            .into_vec()
            .map_err(|e| CallError(format!("reading logits: {e:?}")))?;
        let k = columns.len();
        Ok((0..n)
            .map(|row| {
                let l = &host[row * k..(row + 1) * k];
                let mut at = 0;
                let mut scored: Vec<(Label, f64)> = labels
                    .iter()
                    .map(|lab| {
                        let m = self.label_tokens[lab].len();
                        let v = log_sum_exp(l[at..at + m].iter().map(|&x| x as f64));
                        at += m;
                        (*lab, v)
                    })
                    .collect();
                // Highest log-probability first; a tie goes to the label listed first.
                scored.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal));
                (scored[0].0, scored[0].1 - scored[1].1)
            })
            .collect())
    }

    fn key(&self, r: &CriterionRequest) -> CacheKey {
        let version = match self.cfg.mode {
            LocalMode::Generate => self.prompts.criteria(r.mode).version(),
            LocalMode::LogprobMargin => self.prompts.single(r.mode).version(),
        };
        r.cache_key(&self.name, &version)
    }
}

#[async_trait]
impl<B: KernelOps> CriterionJudge for LocalJudge<B> {
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
        let mut todo = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            match self
                .cache
                .as_ref()
                .and_then(|c| c.get_parsed::<Vec<Label>>(&keys[i]))
            {
                Some((labels, raw)) if labels.len() == r.criteria.len() => {
                    let mut v = CriterionVerdict::labelled(labels, vec![raw], 0, start.elapsed());
                    v.cached = true;
                    verdicts[i] = Some(v);
                }
                _ => todo.push(i),
            }
        }
        let reqs: Vec<&CriterionRequest> = todo.iter().map(|&i| &requests[i]).collect();
        match self.cfg.mode {
            LocalMode::Generate => {
                let prompts: Vec<(String, String)> = reqs
                    .iter()
                    .map(|r| {
                        self.prompts
                            .render_criteria(r.mode, &r.question, &r.response, &r.criteria)
                    })
                    .collect();
                let results = self.generate_parsed(&prompts, |k, text| {
                    parse_labels(text, reqs[k].criteria.len(), reqs[k].mode)
                });
                for (&i, (res, raw, attempts)) in todo.iter().zip(results) {
                    verdicts[i] = Some(match res {
                        Ok(labels) => {
                            CriterionVerdict::labelled(labels, raw, attempts, start.elapsed())
                        }
                        Err(e) => CriterionVerdict::failed(e.0, raw, attempts, start.elapsed()),
                    });
                }
            }
            LocalMode::LogprobMargin => {
                for (&i, res) in todo.iter().zip(self.margin_labels(&reqs)) {
                    verdicts[i] = Some(match res {
                        Ok((labels, margins)) => {
                            let raw = serde_json::to_string(&labels).expect("labels serialise");
                            let mut v =
                                CriterionVerdict::labelled(labels, vec![raw], 1, start.elapsed());
                            v.margins = margins;
                            v
                        }
                        Err(e) => CriterionVerdict::failed(e.0, Vec::new(), 1, start.elapsed()),
                    });
                }
            }
        }
        if let Some(c) = &self.cache {
            for &i in &todo {
                let v = verdicts[i].as_ref().expect("filled above");
                if let Some(labels) = &v.labels {
                    c.put_criteria(
                        &keys[i],
                        &self.name,
                        &requests[i],
                        labels,
                        v.raw_outputs.last().map_or("", String::as_str),
                    );
                }
            }
        }
        verdicts
            .into_iter()
            .map(|v| v.expect("every request answered"))
            .collect()
    }
}

#[async_trait]
impl<B: KernelOps> PairwiseJudge for LocalJudge<B> {
    fn id(&self) -> String {
        self.name.clone()
    }

    async fn compare(&self, r: &PairRequest) -> PairVerdict {
        let start = Instant::now();
        let prompt = self
            .prompts
            .render_pairwise(&r.question, &r.criteria, &r.first, &r.second);
        let n = r.criteria.len();
        let (res, raw_outputs, attempts) = self
            .generate_parsed(std::slice::from_ref(&prompt), |_, text| parse_pair(text, n))
            .pop()
            .expect("one result");
        let latency_ms = start.elapsed().as_secs_f64() * 1e3;
        match res {
            Ok(a) => PairVerdict {
                answer: Some(a),
                error: None,
                raw_outputs,
                attempts,
                latency_ms,
                cached: false,
            },
            Err(e) => PairVerdict {
                answer: None,
                error: Some(e.0),
                raw_outputs,
                attempts,
                latency_ms,
                cached: false,
            },
        }
    }
}
