//! A model directory (or hub id) loaded as a whole, and writing one back.

use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;

use crate::config::{GenerationConfig, ModelConfig};
use crate::error::{ModelError, Result};
use crate::family::FamilyModel;
use crate::hub::resolve_model_dir;
use crate::model::CausalLm;
use crate::tokenizer::ChatTokenizer;
use crate::weights::{
    encode_tensors, hf_tensors, load_weights, shard_name, shard_plan, SaveDtype, WeightFiles,
    INDEX_FILE, SINGLE_FILE,
};
use conrub_contracts::{Generation, SamplingConfig};

/// Tokenizer files copied by [`save_pretrained`] when present in the source directory.
pub const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
];

/// A model of any family with its configs and (optional) tokenizer.
pub struct Pretrained<B: Backend> {
    /// The network.
    pub model: CausalLm<B>,
    /// `config.json`.
    pub config: ModelConfig,
    /// `generation_config.json`, if present.
    pub generation_config: Option<GenerationConfig>,
    /// The tokenizer, if the directory has `tokenizer.json`.
    pub tokenizer: Option<ChatTokenizer>,
    /// Where it was loaded from.
    pub dir: PathBuf,
}

impl<B: Backend> Pretrained<B> {
    /// Loads from a local directory or a hub id such as `Qwen/Qwen3-0.6B`.
    pub fn load(model: &str, device: &B::Device) -> Result<Self> {
        Self::load_dir(&resolve_model_dir(model)?, device)
    }

    /// A randomly initialised model (normal weights of std `std`, seeded) with the tokenizer in
    /// `tokenizer_dir`: for demos and tests. `dir` is the tokenizer directory.
    pub fn random(
        config: ModelConfig,
        tokenizer_dir: &Path,
        std: f64,
        seed: u64,
        device: &B::Device,
    ) -> Result<Self> {
        config.validate()?;
        let tokenizer = ChatTokenizer::from_dir(tokenizer_dir)?;
        Ok(Self {
            model: CausalLm::random(&config, std, seed, device),
            config,
            generation_config: None,
            tokenizer: Some(tokenizer),
            dir: tokenizer_dir.to_path_buf(),
        })
    }

    /// The same model running with `exec` (precision, attention, activation checkpointing).
    pub fn with_execution(mut self, exec: crate::model::Execution) -> Self {
        self.model = self.model.with_execution(exec);
        self
    }

    /// Loads from a local directory.
    pub fn load_dir(dir: &Path, device: &B::Device) -> Result<Self> {
        let config_path = dir.join("config.json");
        if !config_path.exists() {
            return Err(ModelError::ModelDir {
                dir: dir.to_path_buf(),
                message: "no config.json".into(),
            });
        }
        let config = ModelConfig::from_file(&config_path)?;
        let gen_path = dir.join("generation_config.json");
        let generation_config = if gen_path.exists() {
            Some(GenerationConfig::from_file(&gen_path)?)
        } else {
            None
        };
        let tokenizer = if dir.join("tokenizer.json").exists() {
            Some(ChatTokenizer::from_dir(dir)?)
        } else {
            None
        };
        let files = WeightFiles::open_dir(dir)?;
        let model = load_weights(&config, &files, device)?;
        Ok(Self {
            model,
            config,
            generation_config,
            tokenizer,
            dir: dir.to_path_buf(),
        })
    }

    /// End-of-sequence ids, the one definition used by generation, evaluation, the local judge and
    /// training: `generation_config.json`'s, else `config.json`'s, plus the tokenizer's EOS token
    /// and the chat templates' end markers where the tokenizer has them inside the model's
    /// vocabulary: Qwen's `<|im_end|>` (end of a chat turn) and `<|endoftext|>`, Llama 3's
    /// `<|eot_id|>` and `<|eom_id|>` (a base checkpoint's EOS is the end of text, but answers
    /// rendered with the chat template end with the end-of-turn marker).
    pub fn stop_ids(&self) -> Vec<u32> {
        let mut ids = self
            .generation_config
            .as_ref()
            .and_then(|g| g.eos_token_id.as_ref())
            .or(self.config.eos_token_id.as_ref())
            .map(|t| t.to_vec())
            .unwrap_or_default();
        if let Some(tok) = &self.tokenizer {
            let markers = ["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>"]
                .map(|m| tok.token_id(m));
            for id in std::iter::once(tok.eos_id()).chain(markers).flatten() {
                if !ids.contains(&id) && (id as usize) < self.config.vocab_size {
                    ids.push(id);
                }
            }
        }
        ids
    }

    /// Padding id (its value never influences results; padded positions are masked).
    pub fn pad_id(&self) -> u32 {
        self.generation_config
            .as_ref()
            .and_then(|g| g.pad_token_id)
            .or_else(|| self.tokenizer.as_ref().and_then(|t| t.pad_id()))
            .or_else(|| self.stop_ids().first().copied())
            .unwrap_or(0)
    }

    /// One continuation per prompt with the rollout engine (`conrub_rollout::generate`).
    pub fn generate(
        &self,
        prompts: &[Vec<u32>],
        cfg: &SamplingConfig,
        device: &B::Device,
    ) -> Result<Vec<Generation>>
    where
        B: conrub_kernels::KernelOps,
    {
        Ok(conrub_rollout::generate(&self.model, prompts, cfg, device)?)
    }
}

/// Writes `model` as a Hugging Face directory: `model.safetensors`, `config.json`,
/// `generation_config.json` (when given) and the tokenizer files found in `tokenizer_dir`. Every
/// file is written atomically. The result loads in transformers and vLLM as is.
pub fn save_pretrained<B: Backend>(
    model: &CausalLm<B>,
    config: &ModelConfig,
    generation_config: Option<&GenerationConfig>,
    tokenizer_dir: Option<&Path>,
    dir: &Path,
    dtype: SaveDtype,
) -> Result<()> {
    save_pretrained_sharded(
        model,
        config,
        generation_config,
        tokenizer_dir,
        dir,
        dtype,
        None,
    )
    .map(|_| ())
}

/// [`save_pretrained`] with the weights cut into shards of at most `max_shard_bytes` each
/// (`model-0000K-of-0000N.safetensors` and `model.safetensors.index.json`, as transformers
/// writes them; one `model.safetensors` when they fit in one). Returns the weights' bytes.
#[allow(clippy::too_many_arguments)]
pub fn save_pretrained_sharded<B: Backend>(
    model: &CausalLm<B>,
    config: &ModelConfig,
    generation_config: Option<&GenerationConfig>,
    tokenizer_dir: Option<&Path>,
    dir: &Path,
    dtype: SaveDtype,
    max_shard_bytes: Option<u64>,
) -> Result<u64> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let weight_bytes = write_weights(model, dir, dtype, max_shard_bytes)?;
    let mut config = config.clone();
    let name = match dtype {
        SaveDtype::F32 => "float32",
        SaveDtype::Bf16 => "bfloat16",
    };
    if config.dtype.is_some() {
        config.dtype = Some(name.into());
    } else {
        config.torch_dtype = Some(name.into());
    }
    let family = config.family().unwrap_or_default();
    config
        .architectures
        .get_or_insert_with(|| vec![family.hf_architecture().into()]);
    config.write(&dir.join("config.json"))?;
    if let Some(g) = generation_config {
        let text = serde_json::to_string_pretty(g).expect("generation config serialises");
        crate::io::write_atomic(&dir.join("generation_config.json"), text.as_bytes())?;
    }
    if let Some(src) = tokenizer_dir {
        for f in TOKENIZER_FILES {
            let from = src.join(f);
            if from.exists() && src.canonicalize().ok() != dir.canonicalize().ok() {
                let bytes = std::fs::read(&from).map_err(|e| ModelError::io(&from, e))?;
                crate::io::write_atomic(&dir.join(f), &bytes)?;
            }
        }
    }
    Ok(weight_bytes)
}

/// The weights of `model` into `dir` as [`save_pretrained_sharded`] lays them out, one shard
/// encoded and written at a time; files of the other layout (an earlier export into the same
/// folder) are removed first, so a reader never finds a stale copy beside the new one.
fn write_weights<B: Backend>(
    model: &CausalLm<B>,
    dir: &Path,
    dtype: SaveDtype,
    max_shard_bytes: Option<u64>,
) -> Result<u64> {
    let mut tensors = hf_tensors(model);
    let sizes: Vec<(String, u64)> = tensors
        .iter()
        .map(|(name, (_, data))| (name.clone(), data.len() as u64 * dtype.bytes()))
        .collect();
    let total: u64 = sizes.iter().map(|(_, b)| b).sum();
    let plan = shard_plan(&sizes, max_shard_bytes);
    remove_weight_files(dir)?;
    if plan.len() <= 1 {
        let bytes = encode_tensors(tensors, dtype, SINGLE_FILE)?;
        crate::io::write_atomic(&dir.join(SINGLE_FILE), &bytes)?;
        return Ok(total);
    }
    let mut weight_map = serde_json::Map::new();
    for (k, names) in plan.iter().enumerate() {
        let file = shard_name(k + 1, plan.len());
        let part = names
            .iter()
            .map(|n| (n.clone(), tensors.remove(n).expect("a planned tensor")))
            .collect();
        let bytes = encode_tensors(part, dtype, &file)?;
        crate::io::write_atomic(&dir.join(&file), &bytes)?;
        for n in names {
            weight_map.insert(n.clone(), serde_json::Value::String(file.clone()));
        }
    }
    let index = serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": weight_map,
    });
    let text = serde_json::to_string_pretty(&index).expect("an index serialises");
    crate::io::write_atomic(&dir.join(INDEX_FILE), text.as_bytes())?;
    Ok(total)
}

/// Removes `model.safetensors`, the index and every `model-*-of-*.safetensors` shard in `dir`.
fn remove_weight_files(dir: &Path) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| ModelError::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let shard = name.starts_with("model-") && name.ends_with(".safetensors");
        if name == SINGLE_FILE || name == INDEX_FILE || shard {
            std::fs::remove_file(entry.path()).map_err(|e| ModelError::io(&entry.path(), e))?;
        }
    }
    Ok(())
}

/// [`save_pretrained`] as the contracts' [`Export`](conrub_contracts::Export): what a checkpoint
/// writes for a policy of any family. The policy's weights are read on the inner backend (no autodiff
/// tape is kept).
#[derive(Debug, Clone)]
pub struct HfExport {
    /// The `config.json` to write.
    pub config: ModelConfig,
    /// The `generation_config.json` to write, when the model came with one.
    pub generation_config: Option<GenerationConfig>,
    /// Where the tokenizer files are copied from.
    pub tokenizer_dir: Option<PathBuf>,
    /// The dtype of the saved weights.
    pub dtype: SaveDtype,
    /// The largest weight file in bytes (`model.max_shard_size`); `None`: one file.
    pub max_shard_bytes: Option<u64>,
}

impl<B> conrub_contracts::Export<CausalLm<B>> for HfExport
where
    B: burn::tensor::backend::AutodiffBackend,
{
    fn export(&self, policy: &CausalLm<B>, dir: &Path) -> conrub_contracts::Result<()> {
        use burn::module::AutodiffModule;
        save_pretrained_sharded(
            &policy.valid(),
            &self.config,
            self.generation_config.as_ref(),
            self.tokenizer_dir.as_deref(),
            dir,
            self.dtype,
            self.max_shard_bytes,
        )
        .map(|_| ())
        .map_err(|e| conrub_contracts::ContractError::Export {
            path: dir.to_path_buf(),
            message: e.to_string(),
        })
    }

    fn matrix_dtype(&self) -> Option<burn::tensor::DType> {
        (self.dtype == SaveDtype::Bf16).then_some(burn::tensor::DType::BF16)
    }
}
