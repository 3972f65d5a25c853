//! The probe itself: multinomial logistic regression on standardised features, trained full-batch
//! with Adam on the device (the gradient of softmax cross-entropy is written out, so no autodiff
//! backend is needed), with class weights against label imbalance and an L2 penalty.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use conrub_models::Precision;
use conrub_rubric::{Label, ScoringMode};
use serde::{Deserialize, Serialize};

use crate::error::{JudgeError, Result};
use crate::probe::features::Pooling;

/// How a probe is fitted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbeTraining {
    /// Full-batch Adam steps.
    pub epochs: usize,
    /// Adam learning rate.
    pub lr: f64,
    /// L2 penalty on the weights (features are standardised, so one scale fits every model).
    pub l2: f64,
    /// Weigh each class by `rows / (classes · rows of the class)` so that a rare label (`wrong` is
    /// often under 10% of criteria) counts as much as a common one.
    pub balanced: bool,
}

impl Default for ProbeTraining {
    fn default() -> Self {
        Self {
            epochs: 300,
            lr: 0.05,
            l2: 1e-3,
            balanced: true,
        }
    }
}

/// The probe file format [`LinearProbe::save`] writes. 2: mean-pooled features are read over the
/// criterion's span, the same whatever the batch ([`crate::probe::features`]; format 1's depended
/// on which criteria ran together), and the model's precision is recorded.
pub const PROBE_FORMAT: u32 = 2;

/// What a probe was trained on and for; a probe judge refuses a probe whose model, layer, prompt
/// or precision differs from its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbeMeta {
    /// Format version of the probe file ([`PROBE_FORMAT`] for the probes written now).
    pub format: u32,
    /// The base model as given to `distill` (directory or hub id).
    pub base_model: String,
    /// Its [`crate::probe::model_digest`].
    pub base_model_sha256: String,
    /// Feature layer.
    pub layer: usize,
    /// Feature pooling.
    pub pooling: Pooling,
    /// Label set.
    pub mode: ScoringMode,
    /// The classes, in the order of the weight rows.
    pub labels: Vec<Label>,
    /// Version of the one-criterion prompt the features were read over.
    pub template_version: String,
    /// Feature width.
    pub hidden_size: usize,
    /// Compute precision of the base model the features were read at (`conrub judge distill
    /// --precision`); `f32` for files written before it was recorded (the default then).
    #[serde(default)]
    pub precision: Precision,
}

/// A fitted linear probe.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearProbe {
    /// Classes in row order.
    pub labels: Vec<Label>,
    /// Feature width.
    pub dim: usize,
    /// Per-feature mean of the training rows.
    pub mean: Vec<f32>,
    /// Per-feature `1 / std` of the training rows.
    pub scale: Vec<f32>,
    /// `[classes, dim]` row-major.
    pub weight: Vec<f32>,
    /// `[classes]`.
    pub bias: Vec<f32>,
}

impl LinearProbe {
    /// Fits a probe on `rows` (each `dim` wide) with class indices `classes` into `labels`.
    pub fn fit<B: Backend>(
        rows: &[&[f32]],
        classes: &[usize],
        labels: &[Label],
        cfg: &ProbeTraining,
        device: &B::Device,
    ) -> Self {
        let n = rows.len();
        let c = labels.len();
        let dim = rows.first().map_or(0, |r| r.len());
        let mut mean = vec![0f64; dim];
        let mut sq = vec![0f64; dim];
        for r in rows {
            for (j, &x) in r.iter().enumerate() {
                mean[j] += x as f64;
                sq[j] += (x as f64) * (x as f64);
            }
        }
        let nf = n.max(1) as f64;
        let scale: Vec<f32> = (0..dim)
            .map(|j| {
                let m = mean[j] / nf;
                let var = (sq[j] / nf - m * m).max(0.0);
                (1.0 / var.sqrt().max(1e-6)) as f32
            })
            .collect();
        let mean: Vec<f32> = mean.iter().map(|m| (m / nf) as f32).collect();
        let mut x = Vec::with_capacity(n * dim);
        for r in rows {
            x.extend(r.iter().enumerate().map(|(j, &v)| (v - mean[j]) * scale[j]));
        }
        let mut counts = vec![0usize; c];
        for &y in classes {
            counts[y] += 1;
        }
        let class_weight: Vec<f64> = counts
            .iter()
            .map(|&k| {
                if !cfg.balanced || k == 0 {
                    1.0
                } else {
                    n as f64 / (c as f64 * k as f64)
                }
            })
            .collect();
        let total: f64 = classes
            .iter()
            .map(|&y| class_weight[y])
            .sum::<f64>()
            .max(1e-12);
        let mut onehot = vec![0f32; n * c];
        let mut w_row = vec![0f32; n];
        for (i, &y) in classes.iter().enumerate() {
            onehot[i * c + y] = 1.0;
            w_row[i] = (class_weight[y] / total) as f32;
        }
        let xt = Tensor::<B, 2>::from_data(TensorData::new(x, [n, dim]), device);
        let yt = Tensor::<B, 2>::from_data(TensorData::new(onehot, [n, c]), device);
        let wt = Tensor::<B, 2>::from_data(TensorData::new(w_row, [n, 1]), device);
        let mut weight = Tensor::<B, 2>::zeros([c, dim], device);
        let mut bias = Tensor::<B, 2>::zeros([1, c], device);
        let (mut m_w, mut v_w) = (weight.zeros_like(), weight.zeros_like());
        let (mut m_b, mut v_b) = (bias.zeros_like(), bias.zeros_like());
        let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8f64);
        for t in 1..=cfg.epochs {
            let logits = xt.clone().matmul(weight.clone().transpose()) + bias.clone();
            let g = (softmax(logits, 1) - yt.clone()) * wt.clone();
            let g_w = g.clone().transpose().matmul(xt.clone()) + weight.clone() * cfg.l2;
            let g_b = g.sum_dim(0);
            let step =
                |p: Tensor<B, 2>, m: &mut Tensor<B, 2>, v: &mut Tensor<B, 2>, g: Tensor<B, 2>| {
                    *m = m.clone() * b1 + g.clone() * (1.0 - b1);
                    *v = v.clone() * b2 + g.clone() * g * (1.0 - b2);
                    let mh = m.clone() / (1.0 - b1.powi(t as i32));
                    let vh = v.clone() / (1.0 - b2.powi(t as i32));
                    p - mh / (vh.sqrt() + eps) * cfg.lr
                };
            weight = step(weight, &mut m_w, &mut v_w, g_w);
            bias = step(bias, &mut m_b, &mut v_b, g_b);
        }
        let host = |t: Tensor<B, 2>| -> Vec<f32> {
            t.into_data()
                .convert::<f32>()
                .into_vec()
                .expect("f32 probe weights")
        };
        Self {
            labels: labels.to_vec(),
            dim,
            mean,
            scale,
            weight: host(weight),
            bias: host(bias),
        }
    }

    /// Class probabilities of one feature row.
    pub fn probabilities(&self, row: &[f32]) -> Vec<f64> {
        let z: Vec<f64> = (0..self.labels.len())
            .map(|k| {
                let w = &self.weight[k * self.dim..(k + 1) * self.dim];
                let mut s = self.bias[k] as f64;
                for j in 0..self.dim {
                    s += w[j] as f64 * ((row[j] - self.mean[j]) * self.scale[j]) as f64;
                }
                s
            })
            .collect();
        let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = z.iter().map(|v| (v - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        e.into_iter().map(|v| v / sum).collect()
    }

    /// Writes the probe as safetensors (`weight`, `bias`, `mean`, `scale`) with `meta` as JSON in
    /// the header's `conrub_probe` entry, atomically.
    pub fn save(&self, path: &Path, meta: &ProbeMeta) -> Result<()> {
        use safetensors::tensor::TensorView;
        let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let c = self.labels.len();
        let parts = [
            ("weight", vec![c, self.dim], bytes(&self.weight)),
            ("bias", vec![c], bytes(&self.bias)),
            ("mean", vec![self.dim], bytes(&self.mean)),
            ("scale", vec![self.dim], bytes(&self.scale)),
        ];
        let views: Vec<(&str, TensorView<'_>)> = parts
            .iter()
            .map(|(n, s, b)| {
                let view = TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .expect("probe tensor view");
                (*n, view)
            })
            .collect();
        let info = HashMap::from([(
            "conrub_probe".to_string(),
            serde_json::to_string(meta).expect("meta serialises"),
        )]);
        let data = safetensors::serialize(views, Some(info))
            .map_err(|e| JudgeError::Probe(format!("{}: {e}", path.display())))?;
        conrub_base::write_bytes_atomic(path, &data).map_err(|e| JudgeError::File {
            path: e.path,
            source: e.source,
        })
    }

    /// Reads a probe written by [`LinearProbe::save`]: `path` is its file or a folder holding
    /// [`PROBE_FILE`] (see [`probe_file`]).
    pub fn load(path: &Path) -> Result<(Self, ProbeMeta)> {
        let path = probe_file(path)?;
        let path = path.as_path();
        let data = std::fs::read(path).map_err(|e| JudgeError::File {
            path: path.into(),
            source: e,
        })?;
        Self::from_bytes(&data, path)
    }

    /// A probe from the bytes of a file [`LinearProbe::save`] wrote; `path` names it in errors.
    pub fn from_bytes(data: &[u8], path: &Path) -> Result<(Self, ProbeMeta)> {
        let bad = |m: String| JudgeError::Probe(format!("{}: {m}", path.display()));
        let (_, header) =
            safetensors::SafeTensors::read_metadata(data).map_err(|e| bad(e.to_string()))?;
        let meta: ProbeMeta = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get("conrub_probe"))
            .ok_or_else(|| bad("not a conrub probe (no `conrub_probe` metadata)".into()))
            .and_then(|s| serde_json::from_str(s).map_err(|e| bad(e.to_string())))?;
        let st = safetensors::SafeTensors::deserialize(data).map_err(|e| bad(e.to_string()))?;
        let read = |name: &str, len: usize| -> Result<Vec<f32>> {
            let t = st.tensor(name).map_err(|e| bad(e.to_string()))?;
            let v: Vec<f32> = t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect();
            if v.len() != len {
                return Err(bad(format!(
                    "`{name}` has {} values, expected {len}",
                    v.len()
                )));
            }
            Ok(v)
        };
        let (c, d) = (meta.labels.len(), meta.hidden_size);
        let probe = Self {
            labels: meta.labels.clone(),
            dim: d,
            weight: read("weight", c * d)?,
            bias: read("bias", c)?,
            mean: read("mean", d)?,
            scale: read("scale", d)?,
        };
        Ok((probe, meta))
    }
}

/// The probe's file name in the folder `conrub judge distill --out` writes.
pub const PROBE_FILE: &str = "probe.safetensors";

/// The probe file `path` names: the path itself, or [`PROBE_FILE`] inside it when it is a folder
/// (a folder without one is an error naming both).
pub fn probe_file(path: &Path) -> Result<PathBuf> {
    if !path.is_dir() {
        return Ok(path.to_path_buf());
    }
    let inside = path.join(PROBE_FILE);
    if inside.is_file() {
        return Ok(inside);
    }
    Err(JudgeError::Probe(format!(
        "{} is a folder without {PROBE_FILE}: give the probe file, or the folder `conrub judge \
         distill --out` wrote once it finished",
        path.display()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_folder_names_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let e = probe_file(dir.path()).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "probe: {} is a folder without probe.safetensors: give the probe file, or the \
                 folder `conrub judge distill --out` wrote once it finished",
                dir.path().display()
            )
        );
        let file = dir.path().join(PROBE_FILE);
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(probe_file(dir.path()).unwrap(), file);
        assert_eq!(probe_file(&file).unwrap(), file);
        let e = LinearProbe::load(dir.path()).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("probe: {}: ", file.display())),
            "{e}"
        );
    }

    #[test]
    fn probe_files_without_a_precision_read_as_f32() {
        let meta = ProbeMeta {
            format: PROBE_FORMAT,
            base_model: "m".into(),
            base_model_sha256: "s".into(),
            layer: 1,
            pooling: Pooling::Last,
            mode: ScoringMode::Binary,
            labels: ScoringMode::Binary.labels().to_vec(),
            template_version: "t".into(),
            hidden_size: 2,
            precision: Precision::Bf16Mixed,
        };
        let mut v = serde_json::to_value(&meta).unwrap();
        assert_eq!(v["precision"], "bf16-mixed");
        v.as_object_mut().unwrap().remove("precision");
        let old: ProbeMeta = serde_json::from_value(v).unwrap();
        assert_eq!(
            old,
            ProbeMeta {
                precision: Precision::F32,
                ..meta
            }
        );
    }
}
