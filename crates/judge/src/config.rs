//! The judge config file (`--judge CONFIG`): one TOML schema for every judge kind.
//!
//! ```toml
//! kind = "openai"                 # openai | local | lexical
//! urls = ["http://judge-0:30000/v1", "http://judge-1:30000/v1"]   # or url = "..."
//! model = "Qwen/Qwen2.5-32B-Instruct"  # served name (openai) or checkpoint dir / hub id (local)
//! api_key_env = "JUDGE_API_KEY"   # optional; the key is read from this variable
//! concurrency = 16
//! timeout_secs = 120
//! max_retries = 8
//! max_tokens = 2048
//! cache = "judge-cache.sqlite"    # optional; relative to this file
//! [prompts]                       # optional overrides, TOML files with `system` and `user`
//! criteria_three_state = "prompts/my-three-state.toml"
//! [local]                         # kind = "local" only
//! mode = "generate"               # or "logprob-margin"
//! precision = "f32"               # or "bf16-mixed"
//! ```
//!
//! A probe judge (`conrub judge distill` writes the probe) names its base model and probe file, and
//! optionally a fallback judge for the criteria it is unsure of:
//!
//! ```toml
//! kind = "probe"
//! model = "meta-llama/Llama-3.2-1B-Instruct"
//! probe = "probes/med/probe.safetensors"
//! precision = "f32"              # or "bf16-mixed": the probe's (`distill --precision`)
//! abstain_below = 0.7            # top class probability under 0.7: ask the fallback
//! fallback = "judge-sglang.toml" # or an inline [fallback] table
//! ```
//!
//! The lexical test double takes one setting of its own, its keyword file (see [`crate::lexical`]):
//!
//! ```toml
//! kind = "lexical"
//! keywords = "../data/samples/lexical-keywords.jsonl"   # optional; relative to this file
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use conrub_rubric::RubricSet;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::cache::JudgeCache;
use crate::client::{ChatClient, ClientConfig};
use crate::error::{JudgeError, Result};
use crate::judge::{CriterionJudge, PairwiseJudge};
use crate::lexical::LexicalJudge;
use crate::openai::OpenAiJudge;
use crate::prompts::{PromptOverrides, PromptSet};

/// The kinds of judge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JudgeKind {
    /// An OpenAI-compatible endpoint (SGLang, vLLM, OpenAI).
    Openai,
    /// Our burn model (any `conrub_models` family), in process.
    Local,
    /// The lexical test double.
    Lexical,
    /// A linear probe on an in-process model's hidden states (`conrub judge distill`).
    Probe,
}

impl JudgeKind {
    /// Every kind, in the order error messages list them.
    pub const ALL: [JudgeKind; 4] = [
        JudgeKind::Openai,
        JudgeKind::Local,
        JudgeKind::Lexical,
        JudgeKind::Probe,
    ];

    /// True for the judges that run a model in this process (built with
    /// [`JudgeConfig::build_local`] on a device).
    pub fn in_process(self) -> bool {
        matches!(self, JudgeKind::Local | JudgeKind::Probe)
    }

    /// The `kind` value of a config.
    pub fn as_str(self) -> &'static str {
        match self {
            JudgeKind::Openai => "openai",
            JudgeKind::Local => "local",
            JudgeKind::Lexical => "lexical",
            JudgeKind::Probe => "probe",
        }
    }

    /// The keys a config of this kind may have besides `kind` (each variant's own).
    pub fn keys(self) -> &'static [&'static str] {
        match self {
            JudgeKind::Openai => OpenAiSettings::KEYS,
            JudgeKind::Local => LocalSettings::KEYS,
            JudgeKind::Lexical => LexicalSettings::KEYS,
            JudgeKind::Probe => ProbeSettings::KEYS,
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// `kind = "openai"`: a judge served behind an OpenAI-compatible chat API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAiSettings {
    /// One base URL (alternative to `urls`).
    #[serde(default)]
    pub url: Option<String>,
    /// Base URLs to spread calls over.
    #[serde(default)]
    pub urls: Vec<String>,
    /// Served model name.
    pub model: String,
    /// Environment variable holding the API key.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Requests in flight.
    #[serde(default = "crate::client::default_concurrency")]
    pub concurrency: usize,
    /// Per-call timeout, seconds.
    #[serde(default = "crate::client::default_timeout")]
    pub timeout_secs: f64,
    /// Retries after the first attempt.
    #[serde(default = "crate::client::default_retries")]
    pub max_retries: u32,
    /// `max_tokens` per call.
    #[serde(default = "crate::client::default_max_tokens")]
    pub max_tokens: u32,
    /// Sampling temperature of the judge (0 by default).
    #[serde(default)]
    pub temperature: f64,
    /// First backoff ceiling, seconds.
    #[serde(default = "crate::client::default_backoff_base")]
    pub backoff_base_secs: f64,
    /// Largest backoff, seconds.
    #[serde(default = "crate::client::default_backoff_max")]
    pub backoff_max_secs: f64,
    /// `chat_template_kwargs` sent to SGLang/vLLM (thinking off by default; `{}` omits it).
    #[serde(default = "crate::client::default_kwargs")]
    pub chat_template_kwargs: Option<Value>,
    /// Judge cache database (SQLite), relative to the config file.
    #[serde(default)]
    pub cache: Option<PathBuf>,
    /// Prompt overrides.
    #[serde(default)]
    pub prompts: PromptOverrides,
}

impl OpenAiSettings {
    /// The keys of this kind.
    pub const KEYS: &'static [&'static str] = &[
        "url",
        "urls",
        "model",
        "api_key_env",
        "concurrency",
        "timeout_secs",
        "max_retries",
        "max_tokens",
        "temperature",
        "backoff_base_secs",
        "backoff_max_secs",
        "chat_template_kwargs",
        "cache",
        "prompts",
    ];
}

/// `kind = "local"`: our burn model in process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalSettings {
    /// Checkpoint directory (relative to the config file) or hub id.
    pub model: String,
    /// Device of the judge (`cpu`, `wgpu`, `cuda:0`, ...) for `conrub score` and `judge-pair`.
    #[serde(default)]
    pub device: Option<String>,
    /// Judge cache database (SQLite), relative to the config file.
    #[serde(default)]
    pub cache: Option<PathBuf>,
    /// Prompt overrides.
    #[serde(default)]
    pub prompts: PromptOverrides,
    /// Settings of the in-process judge.
    #[cfg(feature = "local")]
    #[serde(default)]
    pub local: crate::local::LocalJudgeConfig,
    /// Settings of the in-process judge (this build has no in-process judge).
    #[cfg(not(feature = "local"))]
    #[serde(default)]
    pub local: Option<toml::Table>,
}

impl LocalSettings {
    /// The keys of this kind.
    pub const KEYS: &'static [&'static str] = &["model", "device", "cache", "prompts", "local"];
}

/// `kind = "lexical"`: the keyword test double.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LexicalSettings {
    /// Its keyword file (JSONL of `{criterion, keywords, contradictions}`), relative to the
    /// config file. Without it every criterion is matched by its own words.
    #[serde(default)]
    pub keywords: Option<PathBuf>,
}

impl LexicalSettings {
    /// The keys of this kind.
    pub const KEYS: &'static [&'static str] = &["keywords"];
}

/// `kind = "probe"`: a distilled probe on an in-process model (see [`crate::probe`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeSettings {
    /// The probe's base model: checkpoint directory (relative to the config file) or hub id.
    pub model: String,
    /// The probe file `conrub judge distill` wrote (`probe.safetensors`), relative to the file.
    pub probe: PathBuf,
    /// Device of the probe's base model (`cpu`, `wgpu`, `cuda:0`, ...) for `conrub score` and
    /// `judge-pair`, whose `--device` overrides it.
    #[serde(default)]
    pub device: Option<String>,
    /// Judge cache database (SQLite), relative to the config file.
    #[serde(default)]
    pub cache: Option<PathBuf>,
    /// Prompt overrides (the probe refuses prompts other than those it was distilled over).
    #[serde(default)]
    pub prompts: PromptOverrides,
    /// The layer the probe must read (a check: the probe file says which it reads).
    #[serde(default)]
    pub layer: Option<usize>,
    /// The pooling the probe must use (a check, like `layer`).
    #[serde(default)]
    pub pooling: Option<crate::probe::Pooling>,
    /// Compute precision of the base model, `f32` or `bf16-mixed`: the probe's features depend
    /// on it, so it must be the one the probe was distilled at (its file says which).
    #[cfg(feature = "local")]
    #[serde(default)]
    pub precision: conrub_models::Precision,
    /// Compute precision of the base model (this build has no in-process judge).
    #[cfg(not(feature = "local"))]
    #[serde(default)]
    pub precision: Option<String>,
    /// Criterion rows per suffix pass.
    #[serde(default = "default_probe_batch")]
    pub batch_size: usize,
    /// Criteria whose top class probability is below this go to `fallback`.
    #[serde(default)]
    pub abstain_below: Option<f64>,
    /// The judge for abstained criteria: a judge table, or the path of a judge file.
    #[serde(default)]
    pub fallback: Option<toml::Value>,
}

fn default_probe_batch() -> usize {
    16
}

impl ProbeSettings {
    /// The keys of this kind.
    pub const KEYS: &'static [&'static str] = &[
        "model",
        "probe",
        "device",
        "cache",
        "prompts",
        "layer",
        "pooling",
        "precision",
        "batch_size",
        "abstain_below",
        "fallback",
    ];
}

/// Which judge, with the settings of its kind only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum JudgeSpec {
    /// A served judge.
    Openai(OpenAiSettings),
    /// The in-process judge.
    Local(LocalSettings),
    /// The lexical test double.
    Lexical(LexicalSettings),
    /// A distilled probe.
    Probe(ProbeSettings),
}

/// A parsed judge config: the judge and the directory its relative paths resolve against.
#[derive(Debug, Clone, PartialEq)]
pub struct JudgeConfig {
    /// Which judge.
    pub spec: JudgeSpec,
    /// Directory the config was read from (relative paths resolve against it).
    pub base_dir: PathBuf,
    /// A probe's fallback judge, parsed (and checked) with the config.
    fallback: Option<Box<JudgeConfig>>,
}

/// A built judge: criterion and pairwise sides share the client and cache.
#[derive(Clone)]
pub struct Judges {
    /// Grades responses.
    pub criterion: Arc<dyn CriterionJudge>,
    /// Compares responses.
    pub pairwise: Arc<dyn PairwiseJudge>,
    /// The HTTP client, for its counters (openai only).
    pub client: Option<Arc<ChatClient>>,
    /// The cache, when configured.
    pub cache: Option<Arc<JudgeCache>>,
}

impl JudgeConfig {
    /// Parses a judge table. `prefix` is how its keys are named in errors (`"judge."` inside a
    /// train config, `""` for a judge file); `base_dir` resolves relative paths. A key of another
    /// kind is an error naming the key and both kinds.
    pub fn from_table(mut table: toml::Table, base_dir: &Path, prefix: &str) -> Result<Self> {
        let kinds = JudgeKind::ALL.map(JudgeKind::as_str).join(", ");
        let kind = match table.remove("kind") {
            None => {
                return Err(JudgeError::config(
                    format!("{prefix}kind"),
                    format!("missing (one of {kinds})"),
                ))
            }
            Some(toml::Value::String(k)) => JudgeKind::parse(&k).ok_or_else(|| {
                JudgeError::config(
                    format!("{prefix}kind"),
                    format!("`{k}` is not a judge kind (one of {kinds})"),
                )
            })?,
            Some(other) => {
                return Err(JudgeError::config(
                    format!("{prefix}kind"),
                    format!(
                        "expected a string (one of {kinds}), found {}",
                        other.type_str()
                    ),
                ))
            }
        };
        for key in table.keys() {
            if kind.keys().contains(&key.as_str()) {
                continue;
            }
            let owner = JudgeKind::ALL
                .into_iter()
                .find(|k| k.keys().contains(&key.as_str()));
            let message = match owner {
                Some(o) => format!(
                    "not a key of kind = \"{}\" (it belongs to kind = \"{}\")",
                    kind.as_str(),
                    o.as_str()
                ),
                None => format!(
                    "unknown key of kind = \"{}\" (its keys: {})",
                    kind.as_str(),
                    kind.keys().join(", ")
                ),
            };
            return Err(JudgeError::config(format!("{prefix}{key}"), message));
        }
        let value = toml::Value::Table(table);
        let field = |e: serde_path_to_error::Error<toml::de::Error>| {
            let path = e.path().to_string();
            let key = if path == "." { String::new() } else { path };
            let message = e.into_inner().message().trim_end().to_string();
            JudgeError::config(
                format!("{prefix}{key}").trim_end_matches('.').to_string(),
                format!("{message} (kind = \"{}\")", kind.as_str()),
            )
        };
        let spec = match kind {
            JudgeKind::Openai => {
                JudgeSpec::Openai(serde_path_to_error::deserialize(value).map_err(field)?)
            }
            JudgeKind::Local => {
                JudgeSpec::Local(serde_path_to_error::deserialize(value).map_err(field)?)
            }
            JudgeKind::Lexical => {
                JudgeSpec::Lexical(serde_path_to_error::deserialize(value).map_err(field)?)
            }
            JudgeKind::Probe => {
                JudgeSpec::Probe(serde_path_to_error::deserialize(value).map_err(field)?)
            }
        };
        let mut fallback = None;
        if let JudgeSpec::Probe(p) = &spec {
            if let Some(b) = p.abstain_below.filter(|b| !(*b > 0.0 && *b <= 1.0)) {
                return Err(JudgeError::config(
                    format!("{prefix}abstain_below"),
                    format!("{b} is not a probability in (0, 1]"),
                ));
            }
            if p.batch_size == 0 {
                return Err(JudgeError::config(
                    format!("{prefix}batch_size"),
                    "must be at least 1",
                ));
            }
            if p.abstain_below.is_some() != p.fallback.is_some() {
                return Err(JudgeError::config(
                    format!("{prefix}fallback"),
                    "abstain_below and fallback go together (abstained criteria need a judge)",
                ));
            }
            fallback = Self::parse_fallback(p, base_dir, prefix)?.map(Box::new);
        }
        Ok(Self {
            spec,
            base_dir: base_dir.to_path_buf(),
            fallback,
        })
    }

    /// A probe judge's fallback judge config (a table, or a file named by a string), as it was
    /// parsed with this config; `None` for other kinds and for a probe without one.
    pub fn fallback(&self) -> Option<&JudgeConfig> {
        self.fallback.as_deref()
    }

    /// Parses a probe's `fallback` (keys named with `prefix` in errors); `base_dir` resolves
    /// relative paths.
    fn parse_fallback(
        p: &ProbeSettings,
        base_dir: &Path,
        prefix: &str,
    ) -> Result<Option<JudgeConfig>> {
        let key = format!("{prefix}fallback");
        let cfg = match &p.fallback {
            None => return Ok(None),
            Some(toml::Value::String(file)) => JudgeConfig::from_file(&base_dir.join(file))?,
            Some(toml::Value::Table(t)) => {
                JudgeConfig::from_table(t.clone(), base_dir, &format!("{key}."))?
            }
            Some(other) => {
                return Err(JudgeError::config(
                    key,
                    format!(
                        "expected a judge table or a judge file's path, found {}",
                        other.type_str()
                    ),
                ))
            }
        };
        if cfg.kind() == JudgeKind::Probe {
            return Err(JudgeError::config(
                key,
                "a probe's fallback cannot be a probe",
            ));
        }
        Ok(Some(cfg))
    }

    /// Parses a judge file's TOML text; `base_dir` resolves relative paths.
    pub fn from_toml(text: &str, base_dir: &Path) -> Result<Self> {
        let table: toml::Table = toml::from_str(text).map_err(|e| JudgeError::Toml {
            message: e.to_string().trim_end().to_string(),
        })?;
        Self::from_table(table, base_dir, "")
    }

    /// Reads a config file; errors name the file and the key.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| JudgeError::File {
            path: path.into(),
            source: e,
        })?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Self::from_toml(&text, &base).map_err(|e| JudgeError::InFile {
            path: path.into(),
            source: Box::new(e),
        })
    }

    /// Which kind of judge.
    pub fn kind(&self) -> JudgeKind {
        match &self.spec {
            JudgeSpec::Openai(_) => JudgeKind::Openai,
            JudgeSpec::Local(_) => JudgeKind::Local,
            JudgeSpec::Lexical(_) => JudgeKind::Lexical,
            JudgeSpec::Probe(_) => JudgeKind::Probe,
        }
    }

    /// The in-process judge's device, when the config names one.
    pub fn device(&self) -> Option<&str> {
        match &self.spec {
            JudgeSpec::Local(l) => l.device.as_deref(),
            JudgeSpec::Probe(p) => p.device.as_deref(),
            _ => None,
        }
    }

    /// Requests in flight for a served judge (the client's default for other kinds).
    pub fn concurrency(&self) -> usize {
        match &self.spec {
            JudgeSpec::Openai(o) => o.concurrency,
            _ => crate::client::default_concurrency(),
        }
    }

    /// The client settings of a served judge.
    pub fn client_config(&self) -> Result<ClientConfig> {
        let JudgeSpec::Openai(o) = &self.spec else {
            return Err(JudgeError::config(
                "kind",
                "only kind = \"openai\" has a client",
            ));
        };
        let mut urls = o.urls.clone();
        if let Some(u) = &o.url {
            urls.insert(0, u.clone());
        }
        if urls.is_empty() {
            return Err(JudgeError::config(
                "url",
                "kind = \"openai\" needs `url` or `urls`",
            ));
        }
        let cfg = ClientConfig {
            urls,
            model: o.model.clone(),
            api_key_env: o.api_key_env.clone(),
            concurrency: o.concurrency,
            timeout_secs: o.timeout_secs,
            max_retries: o.max_retries,
            max_tokens: o.max_tokens,
            temperature: o.temperature,
            backoff_base_secs: o.backoff_base_secs,
            backoff_max_secs: o.backoff_max_secs,
            chat_template_kwargs: o.chat_template_kwargs.clone(),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The prompts with overrides applied (the lexical judge has none).
    pub fn prompt_set(&self) -> Result<PromptSet> {
        let overrides = match &self.spec {
            JudgeSpec::Openai(o) => &o.prompts,
            JudgeSpec::Local(l) => &l.prompts,
            JudgeSpec::Probe(p) => &p.prompts,
            JudgeSpec::Lexical(_) => return Ok(PromptSet::default()),
        };
        PromptSet::with_overrides(overrides, &self.base_dir)
    }

    /// Opens the cache, if one is configured.
    pub fn open_cache(&self) -> Result<Option<Arc<JudgeCache>>> {
        let cache = match &self.spec {
            JudgeSpec::Openai(o) => &o.cache,
            JudgeSpec::Local(l) => &l.cache,
            JudgeSpec::Probe(p) => &p.cache,
            JudgeSpec::Lexical(_) => &None,
        };
        cache
            .as_ref()
            .map(|p| JudgeCache::open(&self.base_dir.join(p)).map(Arc::new))
            .transpose()
    }

    /// Builds an `openai` or `lexical` judge (a `local` judge needs a backend: see
    /// [`JudgeConfig::build_local`]). The lexical judge reads its keyword file (`keywords`);
    /// `rubrics`, the records it will grade (may be empty), is only checked against that file: when
    /// the file names none of their criteria it is an error (a keyword file for other data, or
    /// criteria edited since).
    pub fn build(&self, rubrics: &RubricSet) -> Result<Judges> {
        match &self.spec {
            JudgeSpec::Openai(_) => {
                let client = Arc::new(ChatClient::new(self.client_config()?)?);
                let cache = self.open_cache()?;
                let judge = Arc::new(OpenAiJudge::new(
                    client.clone(),
                    self.prompt_set()?,
                    cache.clone(),
                ));
                Ok(Judges {
                    criterion: judge.clone(),
                    pairwise: judge,
                    client: Some(client),
                    cache,
                })
            }
            JudgeSpec::Lexical(lexical) => {
                let judge = match &lexical.keywords {
                    Some(p) => self.keyword_judge(&self.base_dir.join(p), rubrics)?,
                    None => LexicalJudge::default(),
                };
                let judge = Arc::new(judge);
                Ok(Judges {
                    criterion: judge.clone(),
                    pairwise: judge,
                    client: None,
                    cache: None,
                })
            }
            JudgeSpec::Local(_) | JudgeSpec::Probe(_) => Err(JudgeError::config(
                "kind",
                format!(
                    "a {} judge is built with build_local on a device",
                    self.kind().as_str()
                ),
            )),
        }
    }

    /// The lexical judge of keyword file `path`, checked against the criteria it will grade.
    fn keyword_judge(&self, path: &Path, rubrics: &RubricSet) -> Result<LexicalJudge> {
        let judge = LexicalJudge::from_file(path)?;
        let texts: Vec<&str> = rubrics
            .iter()
            .flat_map(|r| &r.criteria)
            .map(|c| c.text.as_str())
            .collect();
        if !texts.is_empty() && !judge.is_empty() && !texts.iter().any(|t| judge.knows(t)) {
            return Err(JudgeError::config(
                "keywords",
                format!(
                    "{} names none of the {} criteria in {} (entries match the criterion text exactly)",
                    path.display(),
                    texts.len(),
                    rubrics.path.display()
                ),
            ));
        }
        Ok(judge)
    }

    /// Builds a judge of any kind: an in-process one (`local`, `probe`) on `device` with
    /// [`JudgeConfig::build_local`], any other with [`JudgeConfig::build`], which checks it against
    /// `rubrics` (the records it will grade; may be empty).
    #[cfg(feature = "local")]
    pub fn build_on<B: conrub_kernels::GrpoOps>(
        &self,
        device: &B::Device,
        rubrics: &RubricSet,
    ) -> Result<Judges> {
        if self.kind().in_process() {
            self.build_local::<B>(device)
        } else {
            self.build(rubrics)
        }
    }

    /// Builds an in-process judge (`local` or `probe`) on `device`: loads `model` (and a probe's
    /// file and fallback judge; a fallback that is itself in process runs on the same device).
    #[cfg(feature = "local")]
    pub fn build_local<B: conrub_kernels::GrpoOps>(&self, device: &B::Device) -> Result<Judges> {
        let model = match &self.spec {
            JudgeSpec::Local(s) => &s.model,
            JudgeSpec::Probe(s) => &s.model,
            _ => {
                return Err(JudgeError::config(
                    "kind",
                    format!(
                        "build_local builds kind = \"local\" or \"probe\", not \"{}\"",
                        self.kind().as_str()
                    ),
                ))
            }
        };
        let path = self.base_dir.join(model);
        let loaded = if path.is_dir() {
            conrub_models::Pretrained::<B>::load_dir(&path, device)
        } else {
            conrub_models::Pretrained::<B>::load(model, device)
        }
        .map_err(|e| JudgeError::Model(Box::new(e)))?;
        let cache = self.open_cache()?;
        match &self.spec {
            JudgeSpec::Probe(settings) => self.build_probe::<B>(settings, loaded, device, cache),
            JudgeSpec::Local(settings) => {
                let judge = Arc::new(crate::local::LocalJudge::new(
                    loaded,
                    device.clone(),
                    self.prompt_set()?,
                    settings.local.clone(),
                    cache.clone(),
                )?);
                Ok(Judges {
                    criterion: judge.clone(),
                    pairwise: judge,
                    client: None,
                    cache,
                })
            }
            _ => unreachable!("checked above"),
        }
    }

    #[cfg(feature = "local")]
    fn build_probe<B: conrub_kernels::GrpoOps>(
        &self,
        settings: &ProbeSettings,
        loaded: conrub_models::Pretrained<B>,
        device: &B::Device,
        cache: Option<Arc<JudgeCache>>,
    ) -> Result<Judges> {
        use crate::probe::{Abstention, FeatureSpecFilter, ProbeFeaturizer, ProbeJudge};
        let fallback = match self.fallback() {
            None => None,
            Some(f) => {
                let none = RubricSet::from_records("fallback", vec![])
                    .map_err(|e| JudgeError::Probe(e.to_string()))?;
                Some(f.build_on::<B>(device, &none)?)
            }
        };
        let exec = conrub_models::Execution {
            precision: settings.precision,
            ..loaded.model.execution()
        };
        let featurizer = ProbeFeaturizer::new(
            loaded.with_execution(exec),
            device.clone(),
            self.prompt_set()?,
            settings.batch_size,
        )?;
        let abstention = match (settings.abstain_below, &fallback) {
            (Some(below), Some(f)) => Some(Abstention {
                below,
                fallback: f.criterion.clone(),
            }),
            _ => None,
        };
        let judge = Arc::new(ProbeJudge::new(
            featurizer,
            &self.base_dir.join(&settings.probe),
            Some(FeatureSpecFilter {
                layer: settings.layer,
                pooling: settings.pooling,
            }),
            abstention,
            cache.clone(),
        )?);
        let (pairwise, client): (Arc<dyn PairwiseJudge>, _) = match fallback {
            Some(f) => (f.pairwise, f.client),
            None => (Arc::new(crate::probe::judge::NoComparisons), None),
        };
        Ok(Judges {
            criterion: judge,
            pairwise,
            client,
            cache,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_key() {
        let err = |text: &str| {
            JudgeConfig::from_toml(text, Path::new("."))
                .unwrap_err()
                .to_string()
        };
        let e = err("kind = \"sglang\"\n");
        assert!(
            e.starts_with("kind: `sglang`") && e.contains("openai"),
            "{e}"
        );
        let e = err("kind = \"openai\"\nmodel = \"m\"\nconcurency = 3\n");
        assert!(
            e.starts_with("concurency: unknown key of kind = \"openai\""),
            "{e}"
        );
        // A key of another kind names the key and both kinds.
        let e = err("kind = \"openai\"\nmodel = \"m\"\nkeywords = \"kw.jsonl\"\n");
        assert_eq!(
            e,
            "keywords: not a key of kind = \"openai\" (it belongs to kind = \"lexical\")"
        );
        let table: toml::Table = toml::from_str("kind = \"lexical\"\ndevice = \"cpu\"\n").unwrap();
        let e = JudgeConfig::from_table(table, Path::new("."), "judge.")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "judge.device: not a key of kind = \"lexical\" (it belongs to kind = \"local\")"
        );
        let e = err("kind = \"openai\"\n");
        assert!(
            e.contains("model") && e.contains("kind = \"openai\""),
            "{e}"
        );
        let e = err("kind = \"openai\"\nmodel = \"m\"\nconcurrency = \"many\"\n");
        assert!(e.starts_with("concurrency: "), "{e}");
        let c =
            JudgeConfig::from_toml("kind = \"openai\"\nmodel = \"m\"\n", Path::new(".")).unwrap();
        assert!(c
            .client_config()
            .unwrap_err()
            .to_string()
            .starts_with("url:"));
        let c = JudgeConfig::from_toml(
            "kind = \"openai\"\nurl = \"localhost:1\"\nmodel = \"m\"\n",
            Path::new("."),
        )
        .unwrap();
        assert!(c
            .client_config()
            .unwrap_err()
            .to_string()
            .contains("not an http(s) URL"));
        #[cfg(feature = "local")]
        {
            let c = JudgeConfig::from_toml(
                "kind = \"local\"\nmodel = \"m\"\n[local]\nprecision = \"bf16-mixed\"\n",
                Path::new("."),
            )
            .unwrap();
            let JudgeSpec::Local(l) = &c.spec else {
                panic!("{c:?}")
            };
            assert_eq!(l.local.precision, conrub_models::Precision::Bf16Mixed);
            let e = err("kind = \"local\"\nmodel = \"m\"\n[local]\nprecision = \"bf16\"\n");
            assert!(
                e.starts_with("local.precision: ") && e.contains("bf16-mixed"),
                "{e}"
            );
            let probe = "kind = \"probe\"\nmodel = \"m\"\nprobe = \"p\"\n";
            let c = JudgeConfig::from_toml(
                &format!("{probe}precision = \"bf16-mixed\"\n"),
                Path::new("."),
            )
            .unwrap();
            let JudgeSpec::Probe(p) = &c.spec else {
                panic!("{c:?}")
            };
            assert_eq!(p.precision, conrub_models::Precision::Bf16Mixed);
            let e = err(format!("{probe}precision = \"bf16\"\n").as_str());
            assert!(
                e.starts_with("precision: ") && e.contains("bf16-mixed"),
                "{e}"
            );
        }
    }

    /// Each kind's `KEYS` are exactly the fields its settings have (serialised with every
    /// optional field set, so none is skipped).
    #[test]
    fn each_kind_lists_its_own_keys() {
        let keys = |v: serde_json::Value| -> Vec<String> {
            let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
            k.retain(|k| k != "kind");
            k.sort();
            k
        };
        let sorted = |k: &[&str]| {
            let mut k: Vec<String> = k.iter().map(|s| s.to_string()).collect();
            k.sort();
            k
        };
        for kind in JudgeKind::ALL {
            let text = match kind {
                JudgeKind::Openai => "kind = \"openai\"\nmodel = \"m\"\n",
                JudgeKind::Local => "kind = \"local\"\nmodel = \"m\"\n",
                JudgeKind::Lexical => "kind = \"lexical\"\n",
                JudgeKind::Probe => {
                    "kind = \"probe\"\nmodel = \"m\"\nprobe = \"p\"\nabstain_below = 0.5\n\
                     [fallback]\nkind = \"lexical\"\n"
                }
            };
            let c = JudgeConfig::from_toml(text, Path::new(".")).unwrap();
            let v = serde_json::to_value(&c.spec).unwrap();
            assert_eq!(v["kind"], kind.as_str());
            assert_eq!(keys(v), sorted(kind.keys()), "{kind:?}");
        }
    }

    #[test]
    fn the_lexical_judge_reads_its_keyword_file() {
        use conrub_rubric::{Criterion, Message, RubricRecord};
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("kw.jsonl"),
            "{\"criterion\": \"The response says t7.\", \"keywords\": [\"t7\"]}\n",
        )
        .unwrap();
        let record = |text: &str| RubricRecord {
            id: "p".into(),
            question: vec![Message::user("q")],
            reference_answer: None,
            source: None,
            criteria: vec![Criterion::content(text)],
            provenance: None,
        };
        let set = |text: &str| RubricSet::from_records("r.jsonl", vec![record(text)]).unwrap();
        let c = JudgeConfig::from_toml("kind = \"lexical\"\nkeywords = \"kw.jsonl\"\n", dir.path())
            .unwrap();
        let judges = c.build(&set("The response says t7.")).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let req = |response: &str| crate::CriterionRequest {
            question: "q".into(),
            response: response.into(),
            criteria: vec!["The response says t7.".into()],
            mode: conrub_rubric::ScoringMode::Binary,
        };
        let v = rt.block_on(judges.criterion.judge(&req("it is t7")));
        assert_eq!(v.labels, Some(vec![conrub_rubric::Label::Yes]));
        // An empty set (e.g. `eval rubric` on HealthBench rows) is fine; a set none of whose criteria
        // the file names is an error.
        c.build(&RubricSet::from_records("none", vec![]).unwrap())
            .unwrap();
        let e = c
            .build(&set("The response says t9."))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.starts_with("keywords: ") && e.contains("names none of the 1 criteria in r.jsonl"),
            "{e}"
        );
        // Without a file, criteria are matched by their own words (t7 is too short to be one).
        let plain = JudgeConfig::from_toml("kind = \"lexical\"\n", dir.path())
            .unwrap()
            .build(&set("The response says t7."))
            .unwrap();
        assert_eq!(
            rt.block_on(plain.criterion.judge(&req("it is t7"))).labels,
            Some(vec![conrub_rubric::Label::No])
        );
        let e = JudgeConfig::from_toml(
            "kind = \"lexical\"\nkeywords = \"missing.jsonl\"\n",
            dir.path(),
        )
        .unwrap()
        .build(&set("x"))
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.starts_with("keywords: ") && e.contains("missing.jsonl"),
            "{e}"
        );
    }

    #[test]
    fn defaults_match_the_published_judge_settings() {
        let c = JudgeConfig::from_toml(
            "kind = \"openai\"\nurl = \"http://h:1/v1\"\nmodel = \"Qwen/Qwen2.5-32B-Instruct\"\n",
            Path::new("."),
        )
        .unwrap();
        let cc = c.client_config().unwrap();
        assert_eq!(
            (
                cc.concurrency,
                cc.timeout_secs,
                cc.max_retries,
                cc.temperature
            ),
            (16, 120.0, 8, 0.0)
        );
        assert_eq!(
            cc.chat_template_kwargs,
            Some(serde_json::json!({"enable_thinking": false}))
        );
    }
}
