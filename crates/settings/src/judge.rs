//! The judge config (`--judge CONFIG`, `[judge]`, `[eval.grader]`): one TOML schema for every
//! judge kind, read into plain settings; `conrub_judge` builds the judge from them.
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
//! The lexical test double takes one setting of its own, its keyword file (`conrub_judge::lexical`):
//!
//! ```toml
//! kind = "lexical"
//! keywords = "../data/samples/lexical-keywords.jsonl"   # optional; relative to this file
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Result, SettingsError};
use crate::exec::Precision;

/// Declares the judge kinds from one list of `Variant(Settings) = "name"` lines: the
/// [`JudgeKind`] enum, the serde-tagged [`JudgeSpec`], and their dispatch (names, keys, the
/// settings as a [`KindKeys`]). `conrub_judge` builds each kind from its settings struct.
macro_rules! judge_kinds {
    ($($(#[$doc:meta])* $variant:ident($settings:ty) = $name:literal,)+) => {
        /// The kinds of judge.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
        pub enum JudgeKind {
            $($(#[$doc])* #[serde(rename = $name)] $variant,)+
        }

        /// Which judge, with the settings of its kind only.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "kind")]
        pub enum JudgeSpec {
            $($(#[$doc])* #[serde(rename = $name)] $variant($settings),)+
        }

        impl JudgeKind {
            /// Every kind, in the order error messages list them.
            pub const ALL: &'static [JudgeKind] = &[$(JudgeKind::$variant),+];

            /// The `kind` value of a config.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(JudgeKind::$variant => $name,)+
                }
            }

            /// True for the judges that run a model in this process (built on a device).
            pub fn in_process(self) -> bool {
                match self {
                    $(JudgeKind::$variant => <$settings as KindSettings>::IN_PROCESS,)+
                }
            }

            /// The keys a config of this kind may have besides `kind`: its settings struct's
            /// fields.
            pub fn keys(self) -> &'static [&'static str] {
                match self {
                    $(JudgeKind::$variant => field_names::<$settings>(),)+
                }
            }

            fn parse(s: &str) -> Option<Self> {
                Self::ALL.iter().copied().find(|k| k.as_str() == s)
            }
        }

        impl JudgeSpec {
            /// The kind.
            pub fn kind(&self) -> JudgeKind {
                match self {
                    $(JudgeSpec::$variant(_) => JudgeKind::$variant,)+
                }
            }

            /// The kind's settings, as the config reads them.
            pub fn keys(&self) -> &dyn KindKeys {
                match self {
                    $(JudgeSpec::$variant(s) => s,)+
                }
            }

            /// The settings of `kind` from `value` (every key but `kind`).
            fn deserialize_kind(
                kind: JudgeKind,
                value: toml::Value,
            ) -> std::result::Result<Self, serde_path_to_error::Error<toml::de::Error>> {
                Ok(match kind {
                    $(JudgeKind::$variant => {
                        JudgeSpec::$variant(serde_path_to_error::deserialize(value)?)
                    })+
                })
            }
        }
    };
}

/// One judge kind, declared by its settings struct: its serde fields are the kind's keys (see
/// [`JudgeKind::keys`]); [`KindKeys`] is what the config reads of it, and `conrub_judge`'s
/// `BuildJudge` how the judge is built.
pub trait KindSettings: KindKeys + Serialize + serde::de::DeserializeOwned {
    /// The judge runs a model in this process (built on a device).
    const IN_PROCESS: bool = false;
}

/// What the config reads of one kind's settings.
pub trait KindKeys {
    /// Prompt overrides, for a kind that prompts a model.
    fn prompts(&self) -> Option<&PromptOverrides> {
        None
    }

    /// The judge cache database, relative to the config file.
    fn cache(&self) -> Option<&PathBuf> {
        None
    }

    /// The in-process judge's device, when the config names one.
    fn device(&self) -> Option<&str> {
        None
    }

    /// Requests in flight, for a served judge.
    fn concurrency(&self) -> Option<usize> {
        None
    }

    /// Checks beyond the types (ranges, keys that go together); `prefix` names keys in errors.
    fn check(&self, prefix: &str) -> Result<()> {
        let _ = prefix;
        Ok(())
    }
}

/// The field names serde's derive gives a struct (the names `deserialize_struct` is asked for,
/// renames applied): a kind's keys, read from its settings struct instead of a list kept by hand
/// (and the learner's keys, by concern).
pub fn field_names<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    let mut probe = crate::flat::FieldProbe(None);
    let _ = T::deserialize(&mut probe);
    // A settings struct with derived `Deserialize` and no `flatten` always names its fields.
    debug_assert!(
        probe.0.is_some(),
        "{} names no fields",
        std::any::type_name::<T>()
    );
    probe.0.unwrap_or(&[])
}

// The judge kinds: one line each. A kind is its settings struct (its fields are the kind's
// keys, with their defaults and docs) and that struct's `KindSettings` impl (what the config
// reads of it, `conrub_judge::BuildJudge` how it is built); the macro derives `JudgeKind`, `JudgeSpec` and their
// dispatch from this list.
judge_kinds! {
    /// An OpenAI-compatible endpoint (SGLang, vLLM, OpenAI).
    Openai(OpenAiSettings) = "openai",
    /// Our burn model (any `conrub_models` family), in process.
    Local(LocalSettings) = "local",
    /// The lexical test double.
    Lexical(LexicalSettings) = "lexical",
    /// A linear probe on an in-process model's hidden states (`conrub judge distill`).
    Probe(ProbeSettings) = "probe",
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
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Per-call timeout, seconds.
    #[serde(default = "default_timeout")]
    pub timeout_secs: f64,
    /// Retries after the first attempt.
    #[serde(default = "default_retries")]
    pub max_retries: u32,
    /// `max_tokens` per call.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    /// Sampling temperature of the judge (0 by default).
    #[serde(default)]
    pub temperature: f64,
    /// First backoff ceiling, seconds.
    #[serde(default = "default_backoff_base")]
    pub backoff_base_secs: f64,
    /// Largest backoff, seconds.
    #[serde(default = "default_backoff_max")]
    pub backoff_max_secs: f64,
    /// `chat_template_kwargs` sent to SGLang/vLLM (thinking off by default; `{}` omits it).
    #[serde(default = "default_kwargs")]
    pub chat_template_kwargs: Option<Value>,
    /// Judge cache database (SQLite), relative to the config file.
    #[serde(default)]
    pub cache: Option<PathBuf>,
    /// Prompt overrides.
    #[serde(default)]
    pub prompts: PromptOverrides,
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
    #[serde(default)]
    pub local: LocalJudgeConfig,
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

/// `kind = "probe"`: a distilled probe on an in-process model (`conrub_judge::probe`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeSettings {
    /// The probe's base model: checkpoint directory (relative to the config file) or hub id.
    pub model: String,
    /// The probe file `conrub judge distill` wrote (`probe.safetensors`), or its `--out` folder,
    /// relative to the file.
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
    pub pooling: Option<Pooling>,
    /// Compute precision of the base model, `f32` or `bf16-mixed`: the probe's features depend
    /// on it, so it must be the one the probe was distilled at (its file says which).
    #[serde(default)]
    pub precision: Precision,
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

/// `concurrency` of a served judge unless set.
pub fn default_concurrency() -> usize {
    16
}
/// A served judge's per-call timeout unless set.
pub fn default_timeout() -> f64 {
    120.0
}
/// A served judge's retries unless set.
pub fn default_retries() -> u32 {
    8
}
/// A served judge's `max_tokens` per call unless set.
pub fn default_max_tokens() -> u32 {
    2048
}
/// A served judge's first backoff ceiling unless set.
pub fn default_backoff_base() -> f64 {
    1.0
}
/// A served judge's largest backoff unless set.
pub fn default_backoff_max() -> f64 {
    30.0
}
/// A served judge's `chat_template_kwargs` (thinking off) unless set.
pub fn default_kwargs() -> Option<Value> {
    Some(serde_json::json!({ "enable_thinking": false }))
}

impl KindKeys for OpenAiSettings {
    fn prompts(&self) -> Option<&PromptOverrides> {
        Some(&self.prompts)
    }

    fn cache(&self) -> Option<&PathBuf> {
        self.cache.as_ref()
    }

    fn concurrency(&self) -> Option<usize> {
        Some(self.concurrency)
    }
}

impl KindSettings for OpenAiSettings {}

impl KindSettings for LocalSettings {
    const IN_PROCESS: bool = true;
}

impl KindSettings for LexicalSettings {}

impl KindSettings for ProbeSettings {
    const IN_PROCESS: bool = true;
}

impl KindKeys for LocalSettings {
    fn prompts(&self) -> Option<&PromptOverrides> {
        Some(&self.prompts)
    }

    fn cache(&self) -> Option<&PathBuf> {
        self.cache.as_ref()
    }

    fn device(&self) -> Option<&str> {
        self.device.as_deref()
    }
}

impl KindKeys for LexicalSettings {}

impl KindKeys for ProbeSettings {
    fn prompts(&self) -> Option<&PromptOverrides> {
        Some(&self.prompts)
    }

    fn cache(&self) -> Option<&PathBuf> {
        self.cache.as_ref()
    }

    fn device(&self) -> Option<&str> {
        self.device.as_deref()
    }

    fn check(&self, prefix: &str) -> Result<()> {
        if let Some(b) = self.abstain_below.filter(|b| !(*b > 0.0 && *b <= 1.0)) {
            return Err(SettingsError::key(
                format!("{prefix}abstain_below"),
                format!("{b} is not a probability in (0, 1]"),
            ));
        }
        if self.batch_size == 0 {
            return Err(SettingsError::key(
                format!("{prefix}batch_size"),
                "must be at least 1",
            ));
        }
        if self.abstain_below.is_some() != self.fallback.is_some() {
            return Err(SettingsError::key(
                format!("{prefix}fallback"),
                "abstain_below and fallback go together (abstained criteria need a judge)",
            ));
        }
        Ok(())
    }
}

/// Paths of prompt files that replace the built-in ones (TOML with `system` and `user`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptOverrides {
    /// Replaces `PromptSet::criteria_binary`.
    pub criteria_binary: Option<std::path::PathBuf>,
    /// Replaces `PromptSet::criteria_three_state`.
    pub criteria_three_state: Option<std::path::PathBuf>,
    /// Replaces `PromptSet::pairwise`.
    pub pairwise: Option<std::path::PathBuf>,
    /// Replaces `PromptSet::single_binary`.
    pub single_binary: Option<std::path::PathBuf>,
    /// Replaces `PromptSet::single_three_state`.
    pub single_three_state: Option<std::path::PathBuf>,
}

/// How the in-process judge decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LocalMode {
    /// Generate the JSON answer.
    #[default]
    Generate,
    /// Next-token log-probability margin per criterion.
    LogprobMargin,
}

/// Settings of the in-process judge.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LocalJudgeConfig {
    /// Decision mode.
    pub mode: LocalMode,
    /// Longest generated answer.
    pub max_new_tokens: usize,
    /// Sequences per forward batch.
    pub batch_size: usize,
    /// Extra sampled attempts after an unparseable greedy answer.
    pub max_retries: u32,
    /// Seed of the retry sampling.
    pub seed: u64,
    /// Compute precision of the judge model: `f32` or `bf16-mixed` (bf16 activations and
    /// matmuls; norms, softmax and log-probabilities in f32).
    pub precision: Precision,
}

impl Default for LocalJudgeConfig {
    fn default() -> Self {
        Self {
            mode: LocalMode::Generate,
            max_new_tokens: 512,
            batch_size: 8,
            max_retries: 2,
            seed: 0,
            precision: Precision::F32,
        }
    }
}

/// How one row's hidden states over its criterion's span become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// The state at the last prompt token, where the model would start its answer.
    Last,
    /// The mean over the criterion's span: every prompt token from the criterion's first to the
    /// end (criterion, label definitions, answer cue), fixed by the prompt alone, never by the
    /// criteria it shares a pass with.
    Mean,
}

impl Pooling {
    /// Every pooling, in sweep order.
    pub const ALL: [Pooling; 2] = [Pooling::Last, Pooling::Mean];

    /// The name used in files and flags.
    pub fn as_str(self) -> &'static str {
        match self {
            Pooling::Last => "last",
            Pooling::Mean => "mean",
        }
    }
}

impl std::str::FromStr for Pooling {
    type Err = SettingsError;

    fn from_str(s: &str) -> Result<Self> {
        Pooling::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| {
                SettingsError::key("pooling", format!("`{s}` is not a pooling (last, mean)"))
            })
    }
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

impl JudgeConfig {
    /// Parses a judge table. `prefix` is how its keys are named in errors (`"judge."` inside a
    /// train config, `""` for a judge file); `base_dir` resolves relative paths. A key of another
    /// kind is an error naming the key and both kinds.
    pub fn from_table(mut table: toml::Table, base_dir: &Path, prefix: &str) -> Result<Self> {
        let kinds: Vec<&str> = JudgeKind::ALL.iter().map(|k| k.as_str()).collect();
        let kinds = kinds.join(", ");
        let kind = match table.remove("kind") {
            None => {
                return Err(SettingsError::key(
                    format!("{prefix}kind"),
                    format!("missing (one of {kinds})"),
                ))
            }
            Some(toml::Value::String(k)) => JudgeKind::parse(&k).ok_or_else(|| {
                SettingsError::key(
                    format!("{prefix}kind"),
                    format!("`{k}` is not a judge kind (one of {kinds})"),
                )
            })?,
            Some(other) => {
                return Err(SettingsError::key(
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
                .iter()
                .copied()
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
            return Err(SettingsError::key(format!("{prefix}{key}"), message));
        }
        let value = toml::Value::Table(table);
        let field = |e: serde_path_to_error::Error<toml::de::Error>| {
            let path = e.path().to_string();
            let key = if path == "." { String::new() } else { path };
            let message = e.into_inner().message().trim_end().to_string();
            SettingsError::key(
                format!("{prefix}{key}").trim_end_matches('.').to_string(),
                format!("{message} (kind = \"{}\")", kind.as_str()),
            )
        };
        let spec = JudgeSpec::deserialize_kind(kind, value).map_err(field)?;
        spec.keys().check(prefix)?;
        let fallback = match &spec {
            JudgeSpec::Probe(p) => Self::parse_fallback(p, base_dir, prefix)?.map(Box::new),
            _ => None,
        };
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
                return Err(SettingsError::key(
                    key,
                    format!(
                        "expected a judge table or a judge file's path, found {}",
                        other.type_str()
                    ),
                ))
            }
        };
        if cfg.kind() == JudgeKind::Probe {
            return Err(SettingsError::key(
                key,
                "a probe's fallback cannot be a probe",
            ));
        }
        Ok(Some(cfg))
    }

    /// Parses a judge file's TOML text; `base_dir` resolves relative paths.
    pub fn from_toml(text: &str, base_dir: &Path) -> Result<Self> {
        let table: toml::Table = toml::from_str(text).map_err(|e| SettingsError::Toml {
            message: e.to_string().trim_end().to_string(),
        })?;
        Self::from_table(table, base_dir, "")
    }

    /// Reads a config file; errors name the file and the key.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| SettingsError::File {
            path: path.into(),
            source: e,
        })?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Self::from_toml(&text, &base).map_err(|e| SettingsError::InFile {
            path: path.into(),
            source: Box::new(e),
        })
    }

    /// Which kind of judge.
    pub fn kind(&self) -> JudgeKind {
        self.spec.kind()
    }

    /// The in-process judge's device, when the config names one.
    pub fn device(&self) -> Option<&str> {
        self.spec.keys().device()
    }

    /// Requests in flight for a served judge (the client's default for other kinds).
    pub fn concurrency(&self) -> usize {
        self.spec
            .keys()
            .concurrency()
            .unwrap_or_else(default_concurrency)
    }

    /// The prompt overrides of a kind that prompts a model.
    pub fn prompts(&self) -> Option<&PromptOverrides> {
        self.spec.keys().prompts()
    }

    /// The judge cache database, resolved against the config's directory, when one is set.
    pub fn cache_path(&self) -> Option<PathBuf> {
        self.spec.keys().cache().map(|p| self.base_dir.join(p))
    }
}
