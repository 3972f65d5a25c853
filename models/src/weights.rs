//! Hugging Face safetensors weights: loading (single file or sharded index; f32, bf16 or f16 storage,
//! converted to the backend's compute dtype) and export back to the HF layout.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::model::{Attention, CausalLm, DecoderLayer, Mlp, RmsNorm, RotaryEmbedding};

pub use conrub_settings::SaveDtype;

/// The single-file export's name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded export.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The name of shard `k` (1-based) of `n`, as transformers names them.
pub fn shard_name(k: usize, n: usize) -> String {
    format!("model-{k:05}-of-{n:05}.safetensors")
}

/// Tensors (name and stored bytes, in the order given) grouped into shards of at most
/// `max_bytes` each, filled in order; a tensor larger than the limit is a shard alone. No
/// limit: one shard.
pub fn shard_plan(sizes: &[(String, u64)], max_bytes: Option<u64>) -> Vec<Vec<String>> {
    let mut shards: Vec<Vec<String>> = Vec::new();
    let mut used = 0u64;
    for (name, bytes) in sizes {
        let fits = max_bytes.is_none_or(|max| used + bytes <= max);
        match shards.last_mut() {
            Some(last) if fits => last.push(name.clone()),
            _ => {
                shards.push(vec![name.clone()]);
                used = 0;
            }
        }
        used += bytes;
    }
    shards
}

/// Memory-mapped safetensors shards and the index of which shard holds which tensor.
pub struct WeightFiles {
    maps: Vec<(PathBuf, Mmap)>,
    index: HashMap<String, usize>,
}

impl WeightFiles {
    /// Opens `model.safetensors`, or the shards listed by `model.safetensors.index.json`, in `dir`.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        if single.exists() {
            Self::open(&[single])
        } else if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
            let parsed: serde_json::Value =
                serde_json::from_str(&text).map_err(|source| ModelError::Json {
                    path: index.clone(),
                    source,
                })?;
            let map = parsed
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ModelError::Weights {
                    file: index.clone(),
                    tensor: "weight_map".into(),
                    message: "missing or not an object".into(),
                })?;
            let shards: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
            let files: Vec<PathBuf> = shards.iter().map(|s| dir.join(s)).collect();
            let opened = Self::open(&files)?;
            for name in map.keys() {
                if !opened.index.contains_key(name) {
                    return Err(ModelError::Weights {
                        file: index,
                        tensor: name.clone(),
                        message: "listed in the index but absent from its shard".into(),
                    });
                }
            }
            Ok(opened)
        } else {
            Err(ModelError::ModelDir {
                dir: dir.to_path_buf(),
                message: "no model.safetensors or model.safetensors.index.json".into(),
            })
        }
    }

    /// Opens the given safetensors files.
    pub fn open(files: &[PathBuf]) -> Result<Self> {
        let mut maps = Vec::new();
        let mut index = HashMap::new();
        for (i, path) in files.iter().enumerate() {
            let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
            // SAFETY: the file is opened read-only; like every mmap-based loader we assume it is not
            // truncated by another process while the model loads.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
            let st = SafeTensors::deserialize(&map).map_err(|e| {
                let (tensor, message) =
                    inconsistent_tensor(&map).unwrap_or_else(|| ("<header>".into(), e.to_string()));
                ModelError::Weights {
                    file: path.clone(),
                    tensor,
                    message,
                }
            })?;
            for name in st.names() {
                if index.insert(name.to_string(), i).is_some() {
                    return Err(ModelError::Weights {
                        file: path.clone(),
                        tensor: name.to_string(),
                        message: "appears in more than one shard".into(),
                    });
                }
            }
            drop(st);
            maps.push((path.clone(), map));
        }
        Ok(Self { maps, index })
    }

    /// Names of all stored tensors.
    pub fn names(&self) -> BTreeSet<String> {
        self.index.keys().cloned().collect()
    }

    /// Reads tensor `name`, checks its shape and converts it to f32.
    pub fn read_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let &i = self.index.get(name).ok_or_else(|| ModelError::Weights {
            file: self.maps.first().map(|m| m.0.clone()).unwrap_or_default(),
            tensor: name.to_string(),
            message: "missing from the checkpoint".into(),
        })?;
        let (path, map) = &self.maps[i];
        let err = |message: String| ModelError::Weights {
            file: path.clone(),
            tensor: name.to_string(),
            message,
        };
        let st = SafeTensors::deserialize(map).map_err(|e| err(e.to_string()))?;
        let view = st.tensor(name).map_err(|e| err(e.to_string()))?;
        if view.shape() != shape {
            return Err(err(format!(
                "shape {:?} does not match the config, which expects {:?}",
                view.shape(),
                shape
            )));
        }
        let bytes = view.data();
        let values: Vec<f32> = match view.dtype() {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F64 => bytes
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
                .collect(),
            other => return Err(err(format!("unsupported dtype {other:?}"))),
        };
        // A diverged run's weights: refused here rather than turned into NaN outputs.
        if let Some((at, x)) = values.iter().enumerate().find(|(_, x)| !x.is_finite()) {
            let bad = values.iter().filter(|x| !x.is_finite()).count();
            return Err(err(format!(
                "{bad} of {} values are not finite (the first, at flat index {at}, is {x})",
                values.len()
            )));
        }
        Ok(values)
    }
}

/// The first tensor whose header entry does not fit the file (offsets reversed or past the data,
/// or a byte length that is not its shape x dtype), and why: what a safetensors file whose
/// header lies is reported as, where the parser only says that the header is invalid.
fn inconsistent_tensor(bytes: &[u8]) -> Option<(String, String)> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(bytes.get(8..8usize.checked_add(n)?)?).ok()?;
    let data = bytes.len() - 8 - n;
    let mut entries: Vec<_> = header
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .collect();
    entries.sort_by_key(|(_, t)| t["data_offsets"][0].as_u64());
    for (name, t) in entries {
        let offsets = (t["data_offsets"][0].as_u64(), t["data_offsets"][1].as_u64());
        let (Some(a), Some(b)) = offsets else {
            return Some((name.clone(), "no data_offsets [start, end]".into()));
        };
        let size = match t["dtype"].as_str() {
            Some("F64" | "I64" | "U64") => 8,
            Some("F32" | "I32" | "U32") => 4,
            Some("F16" | "BF16" | "I16" | "U16") => 2,
            Some("I8" | "U8" | "BOOL") => 1,
            _ => continue,
        };
        let elems: u64 = t["shape"]
            .as_array()?
            .iter()
            .map(|d| d.as_u64().unwrap_or(0))
            .product();
        let message = if b < a || b > data as u64 {
            format!("data_offsets [{a}, {b}] lie outside the file's {data} data bytes")
        } else if b - a != elems * size {
            format!(
                "data_offsets [{a}, {b}] hold {} bytes, but shape {} x {} needs {}",
                b - a,
                t["shape"],
                t["dtype"],
                elems * size
            )
        } else {
            continue;
        };
        return Some((name.clone(), message));
    }
    None
}

/// Builds burn modules from checkpoint tensors, recording which names were consumed.
struct Builder<'a, B: Backend> {
    files: &'a WeightFiles,
    device: &'a B::Device,
    used: BTreeSet<String>,
}

impl<B: Backend> Builder<'_, B> {
    fn tensor<const D: usize>(&mut self, name: &str, shape: [usize; D]) -> Result<Tensor<B, D>> {
        let data = self.files.read_f32(name, &shape)?;
        self.used.insert(name.to_string());
        Ok(Tensor::from_data(TensorData::new(data, shape), self.device))
    }

    fn param<const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
    ) -> Result<Param<Tensor<B, D>>> {
        Ok(Param::from_tensor(self.tensor(name, shape)?))
    }

    /// HF stores `[out, in]`; burn's `Linear` multiplies by `[in, out]`. The transpose is done once
    /// on the host so the stored weight is contiguous.
    fn linear(&mut self, prefix: &str, d_in: usize, d_out: usize, bias: bool) -> Result<Linear<B>> {
        let name = format!("{prefix}.weight");
        let w = self.files.read_f32(&name, &[d_out, d_in])?;
        self.used.insert(name);
        let weight = Tensor::from_data(
            TensorData::new(transpose(&w, d_out, d_in), [d_in, d_out]),
            self.device,
        );
        let bias = if bias {
            Some(self.param(&format!("{prefix}.bias"), [d_out])?)
        } else {
            None
        };
        Ok(Linear {
            weight: Param::from_tensor(weight),
            bias,
        })
    }

    fn norm(&mut self, name: &str, dim: usize, eps: f64) -> Result<RmsNorm<B>> {
        Ok(RmsNorm {
            weight: self.param(name, [dim])?,
            eps,
        })
    }
}

/// Row-major `[rows, cols]` -> `[cols, rows]`, in 32 x 32 tiles so both sides stay in cache (a
/// naive loop strides through memory and dominated load time).
fn transpose(data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    const TILE: usize = 32;
    let mut out = vec![0.0; data.len()];
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for c in c0..(c0 + TILE).min(cols) {
                    out[c * rows + r] = data[r * cols + c];
                }
            }
        }
    }
    out
}

/// Loads a causal LM of `config`'s family from checkpoint files. Every tensor the config implies must be present
/// with the right shape, and every stored tensor must be used (for a tied model a stored
/// `lm_head.weight` is ignored, as transformers does).
pub fn load_weights<B: Backend>(
    config: &ModelConfig,
    files: &WeightFiles,
    device: &B::Device,
) -> Result<CausalLm<B>> {
    let (v, h, i) = (
        config.vocab_size,
        config.hidden_size,
        config.intermediate_size,
    );
    let (nh, nkv, hd) = (
        config.num_attention_heads,
        config.num_key_value_heads(),
        config.head_dim(),
    );
    let eps = config.rms_norm_eps;
    let arch = config.architecture()?;
    let (qkv, o) = (arch.qkv_bias, arch.o_bias);
    let mut b = Builder::<B> {
        files,
        device,
        used: BTreeSet::new(),
    };
    let embed_tokens = b.param("model.embed_tokens.weight", [v, h])?;
    let mut layers = Vec::with_capacity(config.num_hidden_layers);
    for l in 0..config.num_hidden_layers {
        let p = format!("model.layers.{l}");
        layers.push(DecoderLayer {
            input_layernorm: b.norm(&format!("{p}.input_layernorm.weight"), h, eps)?,
            self_attn: Attention {
                q_proj: b.linear(&format!("{p}.self_attn.q_proj"), h, nh * hd, qkv)?,
                k_proj: b.linear(&format!("{p}.self_attn.k_proj"), h, nkv * hd, qkv)?,
                v_proj: b.linear(&format!("{p}.self_attn.v_proj"), h, nkv * hd, qkv)?,
                o_proj: b.linear(&format!("{p}.self_attn.o_proj"), nh * hd, h, o)?,
                q_norm: arch
                    .qk_norm
                    .then(|| b.norm(&format!("{p}.self_attn.q_norm.weight"), hd, eps))
                    .transpose()?,
                k_norm: arch
                    .qk_norm
                    .then(|| b.norm(&format!("{p}.self_attn.k_norm.weight"), hd, eps))
                    .transpose()?,
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
            },
            post_attention_layernorm: b.norm(
                &format!("{p}.post_attention_layernorm.weight"),
                h,
                eps,
            )?,
            mlp: Mlp {
                gate_proj: b.linear(&format!("{p}.mlp.gate_proj"), h, i, false)?,
                up_proj: b.linear(&format!("{p}.mlp.up_proj"), h, i, false)?,
                down_proj: b.linear(&format!("{p}.mlp.down_proj"), i, h, false)?,
            },
        });
    }
    let norm = b.norm("model.norm.weight", h, eps)?;
    let lm_head = if config.tie_word_embeddings {
        b.used.insert("lm_head.weight".into());
        None
    } else {
        Some(b.param("lm_head.weight", [v, h])?)
    };
    let stored = files.names();
    if let Some(extra) = stored.difference(&b.used).next() {
        let file = files.maps[files.index[extra]].0.clone();
        return Err(ModelError::Weights {
            file,
            tensor: extra.clone(),
            message: format!(
                "not part of a {} model with this config (unexpected tensor)",
                config.model_type
            ),
        });
    }
    Ok(CausalLm {
        embed_tokens,
        layers,
        norm,
        lm_head,
        rope: RotaryEmbedding::new(hd, &arch.rope),
        exec: Default::default(),
    })
}

fn host_f32<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 tensor data")
}

/// All tensors of `model` under their HF names and shapes (`[out, in]` for projections), as f32.
pub fn hf_tensors<B: Backend>(model: &CausalLm<B>) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let mut out = BTreeMap::new();
    let mut put = |name: String, shape: Vec<usize>, data: Vec<f32>| {
        out.insert(name, (shape, data));
    };
    let emb = model.embed_tokens.val();
    put(
        "model.embed_tokens.weight".into(),
        emb.dims().to_vec(),
        host_f32(emb),
    );
    let linear = |lin: &Linear<B>| {
        let [d_in, d_out] = lin.weight.dims();
        let w = transpose(&host_f32(lin.weight.val()), d_in, d_out);
        (
            vec![d_out, d_in],
            w,
            lin.bias.as_ref().map(|b| host_f32(b.val())),
        )
    };
    for (l, layer) in model.layers.iter().enumerate() {
        let p = format!("model.layers.{l}");
        let a = &layer.self_attn;
        for (name, lin) in [
            ("self_attn.q_proj", &a.q_proj),
            ("self_attn.k_proj", &a.k_proj),
            ("self_attn.v_proj", &a.v_proj),
            ("self_attn.o_proj", &a.o_proj),
            ("mlp.gate_proj", &layer.mlp.gate_proj),
            ("mlp.up_proj", &layer.mlp.up_proj),
            ("mlp.down_proj", &layer.mlp.down_proj),
        ] {
            let (shape, w, bias) = linear(lin);
            let d_out = shape[0];
            put(format!("{p}.{name}.weight"), shape, w);
            if let Some(bias) = bias {
                put(format!("{p}.{name}.bias"), vec![d_out], bias);
            }
        }
        for (name, norm) in [
            ("input_layernorm", Some(&layer.input_layernorm)),
            (
                "post_attention_layernorm",
                Some(&layer.post_attention_layernorm),
            ),
            ("self_attn.q_norm", a.q_norm.as_ref()),
            ("self_attn.k_norm", a.k_norm.as_ref()),
        ] {
            let Some(norm) = norm else { continue };
            let w = norm.weight.val();
            put(format!("{p}.{name}.weight"), w.dims().to_vec(), host_f32(w));
        }
    }
    let n = model.norm.weight.val();
    put("model.norm.weight".into(), n.dims().to_vec(), host_f32(n));
    if let Some(head) = &model.lm_head {
        let w = head.val();
        put("lm_head.weight".into(), w.dims().to_vec(), host_f32(w));
    }
    out
}

/// Serialises `model` as a single HF `model.safetensors` byte buffer.
pub fn to_safetensors_bytes<B: Backend>(model: &CausalLm<B>, dtype: SaveDtype) -> Result<Vec<u8>> {
    encode_tensors(hf_tensors(model), dtype, SINGLE_FILE)
}

/// Serialises `tensors` (HF names, shapes, f32 values) as one safetensors buffer in `dtype`;
/// `file` names it in errors.
pub fn encode_tensors(
    tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    dtype: SaveDtype,
    file: &str,
) -> Result<Vec<u8>> {
    let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(name, (shape, data))| {
            let bytes = match dtype {
                SaveDtype::F32 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
                SaveDtype::Bf16 => data
                    .iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                    .collect(),
            };
            (name, shape, bytes)
        })
        .collect();
    let st_dtype = match dtype {
        SaveDtype::F32 => Dtype::F32,
        SaveDtype::Bf16 => Dtype::BF16,
    };
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = encoded
        .iter()
        .map(|(name, shape, bytes)| {
            let view = safetensors::tensor::TensorView::new(st_dtype, shape.clone(), bytes)
                .expect("consistent tensor view");
            (name.clone(), view)
        })
        .collect();
    let mut metadata = HashMap::new();
    metadata.insert("format".to_string(), "pt".to_string());
    safetensors::serialize(views, Some(metadata)).map_err(|e| ModelError::Weights {
        file: file.into(),
        tensor: "<all>".into(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn shards_fill_in_order_and_a_big_tensor_stands_alone() {
        let sizes: Vec<(String, u64)> = [("a", 4), ("b", 4), ("c", 9), ("d", 2), ("e", 1)]
            .iter()
            .map(|(n, b)| (n.to_string(), *b))
            .collect();
        let names = |plan: Vec<Vec<String>>| -> Vec<String> {
            plan.into_iter().map(|s| s.concat()).collect()
        };
        assert_eq!(names(super::shard_plan(&sizes, Some(8))), ["ab", "c", "de"]);
        assert_eq!(names(super::shard_plan(&sizes, None)), ["abcde"]);
        assert_eq!(names(super::shard_plan(&sizes, Some(100))), ["abcde"]);
        assert_eq!(super::shard_name(2, 14), "model-00002-of-00014.safetensors");
    }

    #[test]
    fn transpose_handles_ragged_tiles() {
        let (rows, cols) = (37, 70);
        let data: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let t = super::transpose(&data, rows, cols);
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(t[c * rows + r], data[r * cols + c]);
            }
        }
    }
}
