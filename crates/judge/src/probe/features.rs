//! Probe features: the hidden states of an in-process model (any `conrub_models` family) over the judge's one-criterion prompt,
//! pooled over the criterion's span, and a store that keeps them on disk so a rerun of
//! `conrub judge distill` computes none twice.
//!
//! Prompt layout: the one-criterion prompt puts the question and response first and the criterion
//! last, so all criteria of one response share their prefix; it runs once and each criterion adds
//! only its suffix (criterion, label definitions, the answer cue). A response with `c` criteria
//! costs one prefix pass and `⌈c / batch_size⌉` suffix passes, with no generation.
//!
//! A criterion's span is its prompt's tokens from the criterion's first token to the end (found per
//! prompt, where it departs from the same prompt with an empty criterion). The shared prefix never
//! runs past it, even when all criteria of a pass open with the same words ("The response ..."),
//! so the span, and the features, are the same whichever criteria run together.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use burn::tensor::{DType, Tensor, TensorData};
use conrub_kernels::KernelOps;
use conrub_models::{ModelConfig, Precision, Pretrained};
use conrub_rubric::ScoringMode;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::cache::{hex, CacheKey};
use crate::error::{JudgeError, Result};
use crate::prefix::{chat_ids, criterion_start, SharedPrefix};
use crate::prompts::PromptSet;

pub use super::pooling::Pooling;

/// Where a feature vector is read: a layer (Hugging Face's `hidden_states` numbering: `l` decoder
/// layers applied, the last one after the final norm) and a pooling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FeatureSpec {
    /// Layer.
    pub layer: usize,
    /// Pooling.
    pub pooling: Pooling,
}

/// SHA-256 of a model: its `config.json` and every `*.safetensors` file in `dir`, in name order
/// (the config alone, serialised, for a model without files such as a random demo model).
pub fn model_digest(dir: &Path, config: &ModelConfig) -> Result<String> {
    let mut h = Sha256::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    let config_file = dir.join("config.json");
    if files.is_empty() || !config_file.exists() {
        h.update(serde_json::to_vec(config).expect("config serialises"));
    } else {
        files.insert(0, config_file);
    }
    let mut buf = vec![0u8; 1 << 20];
    for path in files {
        let err = |e| JudgeError::File {
            path: path.clone(),
            source: e,
        };
        let mut f = std::fs::File::open(&path).map_err(err)?;
        h.update(path.file_name().unwrap_or_default().as_encoded_bytes());
        loop {
            let n = f.read(&mut buf).map_err(err)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    Ok(hex(&h.finalize()))
}

/// Computes probe features with an in-process model.
pub struct ProbeFeaturizer<B: KernelOps> {
    model: Pretrained<B>,
    device: B::Device,
    prompts: PromptSet,
    batch_size: usize,
    digest: String,
}

impl<B: KernelOps> ProbeFeaturizer<B> {
    /// A featurizer around a loaded model (which needs its tokenizer), `batch_size` criterion rows
    /// per suffix pass.
    pub fn new(
        model: Pretrained<B>,
        device: B::Device,
        prompts: PromptSet,
        batch_size: usize,
    ) -> Result<Self> {
        if model.tokenizer.is_none() {
            return Err(JudgeError::Probe(format!(
                "{}: the probe's model needs tokenizer.json",
                model.dir.display()
            )));
        }
        if batch_size == 0 {
            return Err(JudgeError::config("batch_size", "must be at least 1"));
        }
        let digest = model_digest(&model.dir, &model.config)?;
        Ok(Self {
            model,
            device,
            prompts,
            batch_size,
            digest,
        })
    }

    /// The model's [`model_digest`].
    pub fn model_digest(&self) -> &str {
        &self.digest
    }

    /// The device the model runs on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// Where the model was loaded from.
    pub fn model_dir(&self) -> &Path {
        &self.model.dir
    }

    /// Decoder layers (the deepest feature layer).
    pub fn num_layers(&self) -> usize {
        self.model.model.num_layers()
    }

    /// Width of one feature vector.
    pub fn hidden_size(&self) -> usize {
        self.model.config.hidden_size
    }

    /// Compute precision of the model (the features depend on it).
    pub fn precision(&self) -> Precision {
        self.model.model.execution().precision
    }

    /// The version of the prompt the features are read over.
    pub fn template_version(&self, mode: ScoringMode) -> String {
        self.prompts.single(mode).version()
    }

    /// Features of every criterion of one response: per criterion, the vectors of `specs`
    /// concatenated in order (`specs.len() · hidden_size` values).
    pub fn features(
        &self,
        mode: ScoringMode,
        question: &str,
        response: &str,
        criteria: &[String],
        specs: &[FeatureSpec],
    ) -> Result<Vec<Vec<f32>>> {
        if criteria.is_empty() {
            return Ok(Vec::new());
        }
        let model = &self.model;
        let deepest = specs.iter().map(|s| s.layer).max().unwrap_or(0);
        if deepest > self.num_layers() {
            return Err(JudgeError::Probe(format!(
                "layer {deepest} asked of a model with {} layers",
                self.num_layers()
            )));
        }
        let mut layers: Vec<usize> = specs.iter().map(|s| s.layer).collect();
        layers.sort();
        layers.dedup();
        let ids = |c: &str| {
            let (s, u) = self.prompts.render_single(mode, question, response, c);
            chat_ids(model, &s, &u).map_err(|e| JudgeError::Model(Box::new(e)))
        };
        let seqs: Vec<Vec<u32>> = criteria
            .iter()
            .map(|c| ids(c.as_str()))
            .collect::<Result<_>>()?;
        // Each criterion's span starts where its prompt departs from the blank one: a function of
        // the prompt alone, which the shared prefix never runs past.
        let blank = ids("")?;
        let starts: Vec<usize> = seqs.iter().map(|s| criterion_start(s, &blank)).collect();
        let mut shared =
            SharedPrefix::new(model, &seqs, Some(&starts[..]), Some(deepest), &self.device);
        let h = self.hidden_size();
        let mut out: Vec<Vec<f32>> = Vec::with_capacity(seqs.len());
        for start in (0..seqs.len()).step_by(self.batch_size) {
            let rows = start..(start + self.batch_size).min(seqs.len());
            let m = rows.len();
            let suffix = shared.rows(rows, model.pad_id(), &self.device);
            let len = suffix.len;
            let (kv, pass) = shared.cache();
            let states = model
                .model
                .forward_layers_paged(&suffix.batch, kv, pass, &layers);
            let span: Vec<f32> = suffix.span.iter().map(|&v| v as u8 as f32).collect();
            let span = Tensor::<B, 2>::from_data(TensorData::new(span, [m, len]), &self.device);
            let counts = span.clone().sum_dim(1);
            let mut pooled: Vec<Vec<f32>> = Vec::with_capacity(specs.len());
            for spec in specs {
                let li = layers.binary_search(&spec.layer).expect("layer listed");
                let x = states[li].clone().cast(DType::F32);
                let v: Tensor<B, 2> = match spec.pooling {
                    Pooling::Last => x.slice([0..m, len - 1..len, 0..h]).reshape([m, h]),
                    Pooling::Mean => {
                        let w = span.clone().reshape([m, len, 1]);
                        (x * w).sum_dim(1).reshape([m, h]) / counts.clone()
                    }
                };
                pooled.push(
                    v.into_data()
                        .convert::<f32>()
                        .into_vec()
                        .map_err(|e| JudgeError::Probe(format!("reading features: {e:?}")))?,
                );
            }
            for r in 0..m {
                let mut row = Vec::with_capacity(specs.len() * h);
                for p in &pooled {
                    row.extend_from_slice(&p[r * h..(r + 1) * h]);
                }
                out.push(row);
            }
        }
        Ok(out)
    }
}

/// Version of the span [`Pooling::Mean`] reads: 2 is the criterion's span, the same whatever the
/// batch (1, before it, was the suffix after the batch's shared prefix, which depended on the
/// batch).
pub const MEAN_SPAN_VERSION: u32 = 2;

/// What a store's features depend on; a store of other features lives in another directory (named
/// by a digest of this, serialised: the fields added later are left out at the values that the
/// stores from before them had, so those keep their directory).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoreMeta {
    /// [`model_digest`] of the model.
    pub model_sha256: String,
    /// Version of the prompt.
    pub template_version: String,
    /// Label set of the prompt.
    pub mode: ScoringMode,
    /// What each row holds, in order.
    pub specs: Vec<FeatureSpec>,
    /// Width of one spec's vector.
    pub hidden_size: usize,
    /// Compute precision of the model.
    #[serde(default, skip_serializing_if = "is_f32")]
    pub precision: Precision,
    /// [`MEAN_SPAN_VERSION`] when a spec pools with [`Pooling::Mean`], else 0 (see
    /// [`StoreMeta::span_version_for`]): mean-pooled features of an older span are not reused.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub span_version: u32,
}

fn is_f32(p: &Precision) -> bool {
    *p == Precision::F32
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

impl StoreMeta {
    /// The `span_version` of a store of `specs`.
    pub fn span_version_for(specs: &[FeatureSpec]) -> u32 {
        if specs.iter().any(|s| s.pooling == Pooling::Mean) {
            MEAN_SPAN_VERSION
        } else {
            0
        }
    }
}

/// Feature vectors on disk: `DIR/<digest of the meta>/shard-NNNNN.safetensors`, each shard
/// written atomically once it holds `shard_rows` rows (and at [`FeatureStore::flush`]), so an
/// interrupted extraction loses at most the unwritten shard.
pub struct FeatureStore {
    dir: PathBuf,
    width: usize,
    rows: HashMap<CacheKey, Vec<f32>>,
    pending: Vec<CacheKey>,
    next_shard: usize,
    shard_rows: usize,
}

impl FeatureStore {
    /// Opens (or starts) the store for `meta` under `root`, reading every shard written so far.
    pub fn open(root: &Path, meta: &StoreMeta, shard_rows: usize) -> Result<Self> {
        let text = serde_json::to_string_pretty(meta).expect("meta serialises");
        let dir = root.join(&hex(&Sha256::digest(text.as_bytes()))[..16]);
        let file_err = |path: &Path| {
            let path = path.to_path_buf();
            move |e| JudgeError::File { path, source: e }
        };
        std::fs::create_dir_all(&dir).map_err(file_err(&dir))?;
        let meta_path = dir.join("meta.json");
        if !meta_path.exists() {
            conrub_base::write_bytes_atomic(&meta_path, text.as_bytes()).map_err(|e| {
                JudgeError::File {
                    path: e.path,
                    source: e.source,
                }
            })?;
        }
        let width = meta.specs.len() * meta.hidden_size;
        let mut store = Self {
            dir: dir.clone(),
            width,
            rows: HashMap::new(),
            pending: Vec::new(),
            next_shard: 0,
            shard_rows: shard_rows.max(1),
        };
        let mut shards: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(file_err(&dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("shard-") && n.ends_with(".safetensors"))
            })
            .collect();
        shards.sort();
        for path in &shards {
            store.read_shard(path)?;
        }
        store.next_shard = shards.len();
        Ok(store)
    }

    fn read_shard(&mut self, path: &Path) -> Result<()> {
        let bytes = std::fs::read(path).map_err(|e| JudgeError::File {
            path: path.into(),
            source: e,
        })?;
        let bad = |m: String| JudgeError::Probe(format!("{}: {m}", path.display()));
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
        let keys = st.tensor("keys").map_err(|e| bad(e.to_string()))?;
        let feats = st.tensor("features").map_err(|e| bad(e.to_string()))?;
        let n = keys.shape()[0];
        if feats.shape() != [n, self.width] {
            return Err(bad(format!(
                "features of shape {:?}, expected [{n}, {}]",
                feats.shape(),
                self.width
            )));
        }
        let data = feats.data();
        for (i, k) in keys.data().chunks_exact(32).enumerate() {
            let key = CacheKey(k.try_into().expect("32 bytes"));
            let row = &data[i * self.width * 4..(i + 1) * self.width * 4];
            let row = row
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect();
            self.rows.insert(key, row);
        }
        Ok(())
    }

    /// The stored features of a row.
    pub fn get(&self, key: &CacheKey) -> Option<&[f32]> {
        self.rows.get(key).map(Vec::as_slice)
    }

    /// Rows stored (written or pending).
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// True when nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Adds a row, writing a shard when enough are pending.
    pub fn insert(&mut self, key: CacheKey, features: Vec<f32>) -> Result<()> {
        assert_eq!(features.len(), self.width, "feature width");
        if self.rows.insert(key, features).is_none() {
            self.pending.push(key);
        }
        if self.pending.len() >= self.shard_rows {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes the pending rows as one shard.
    pub fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let n = self.pending.len();
        let mut keys = Vec::with_capacity(n * 32);
        let mut feats = Vec::with_capacity(n * self.width * 4);
        for k in &self.pending {
            keys.extend_from_slice(&k.0);
            for x in &self.rows[k] {
                feats.extend_from_slice(&x.to_le_bytes());
            }
        }
        use safetensors::tensor::TensorView;
        let views = [
            (
                "keys",
                TensorView::new(safetensors::Dtype::U8, vec![n, 32], &keys).expect("key view"),
            ),
            (
                "features",
                TensorView::new(safetensors::Dtype::F32, vec![n, self.width], &feats)
                    .expect("feature view"),
            ),
        ];
        let bytes = safetensors::serialize(views, None)
            .map_err(|e| JudgeError::Probe(format!("writing features: {e}")))?;
        let path = self
            .dir
            .join(format!("shard-{:05}.safetensors", self.next_shard));
        conrub_base::write_bytes_atomic(&path, &bytes).map_err(|e| JudgeError::File {
            path: e.path,
            source: e.source,
        })?;
        self.next_shard += 1;
        self.pending.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_keeps_written_shards_and_separates_metas() {
        let d = tempfile::tempdir().unwrap();
        let meta = StoreMeta {
            model_sha256: "m".into(),
            template_version: "t".into(),
            mode: ScoringMode::ThreeState,
            specs: vec![FeatureSpec {
                layer: 1,
                pooling: Pooling::Last,
            }],
            hidden_size: 2,
            precision: Precision::F32,
            span_version: 0,
        };
        let key = |i: u8| CacheKey([i; 32]);
        let mut s = FeatureStore::open(d.path(), &meta, 2).unwrap();
        for i in 0..3 {
            s.insert(key(i), vec![i as f32, -1.0]).unwrap();
        }
        // Two rows made a shard; the third is pending and is lost without a flush.
        drop(s);
        let mut s = FeatureStore::open(d.path(), &meta, 2).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s.get(&key(1)), Some(&[1.0, -1.0][..]));
        assert_eq!(s.get(&key(2)), None);
        s.insert(key(2), vec![2.0, -1.0]).unwrap();
        s.flush().unwrap();
        assert_eq!(FeatureStore::open(d.path(), &meta, 2).unwrap().len(), 3);
        let other = StoreMeta {
            template_version: "t2".into(),
            ..meta
        };
        assert!(FeatureStore::open(d.path(), &other, 2).unwrap().is_empty());
    }

    #[test]
    fn only_changed_features_move_to_another_store() {
        let specs = |pooling| vec![FeatureSpec { layer: 1, pooling }];
        let meta = |pooling, precision| StoreMeta {
            model_sha256: "m".into(),
            template_version: "t".into(),
            mode: ScoringMode::Binary,
            specs: specs(pooling),
            hidden_size: 2,
            precision,
            span_version: StoreMeta::span_version_for(&specs(pooling)),
        };
        let text = |m: &StoreMeta| serde_json::to_string(m).unwrap();
        // Last-pooled f32 features serialise (and so are stored) as before the two fields.
        let last = text(&meta(Pooling::Last, Precision::F32));
        assert!(
            !last.contains("precision") && !last.contains("span_version"),
            "{last}"
        );
        let old: StoreMeta = serde_json::from_str(&last).unwrap();
        assert_eq!(old, meta(Pooling::Last, Precision::F32));
        // Mean-pooled features of the old span and features of another precision are not reused.
        let mean = text(&meta(Pooling::Mean, Precision::F32));
        assert!(mean.contains("\"span_version\":2"), "{mean}");
        let bf16 = text(&meta(Pooling::Last, Precision::Bf16Mixed));
        assert!(bf16.contains("\"precision\":\"bf16-mixed\""), "{bf16}");
    }
}
