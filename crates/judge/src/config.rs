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

/// Declares the judge kinds from one list of `Variant(Settings) = "name"` lines: the
/// [`JudgeKind`] enum, the serde-tagged [`JudgeSpec`], and their dispatch (names, keys,
/// settings, building on a device).
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

            /// True for the judges that run a model in this process (built on a device with
            /// [`JudgeConfig::build_on`]).
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
            pub fn settings(&self) -> &dyn SettingsView {
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

            /// Builds the judge (an in-process one on `device`).
            #[cfg(feature = "local")]
            fn build_on<B: conrub_kernels::KernelOps>(
                &self,
                cfg: &JudgeConfig,
                device: &B::Device,
                rubrics: &RubricSet,
            ) -> Result<Judges> {
                match self {
                    $(JudgeSpec::$variant(s) => s.build_on::<B>(cfg, device, rubrics),)+
                }
            }
        }
    };
}

/// What the config reads of any kind's settings: [`KindSettings`] without its generic parts.
pub trait SettingsView {
    /// See [`KindSettings::prompts`].
    fn prompts(&self) -> Option<&PromptOverrides>;
    /// See [`KindSettings::cache`].
    fn cache(&self) -> Option<&PathBuf>;
    /// See [`KindSettings::device`].
    fn device(&self) -> Option<&str>;
    /// See [`KindSettings::concurrency`].
    fn concurrency(&self) -> Option<usize>;
    /// See [`KindSettings::check`].
    fn check(&self, prefix: &str) -> Result<()>;
    /// See [`KindSettings::build`].
    fn build(&self, cfg: &JudgeConfig, rubrics: &RubricSet) -> Result<Judges>;
}

impl<S: KindSettings> SettingsView for S {
    fn prompts(&self) -> Option<&PromptOverrides> {
        KindSettings::prompts(self)
    }
    fn cache(&self) -> Option<&PathBuf> {
        KindSettings::cache(self)
    }
    fn device(&self) -> Option<&str> {
        KindSettings::device(self)
    }
    fn concurrency(&self) -> Option<usize> {
        KindSettings::concurrency(self)
    }
    fn check(&self, prefix: &str) -> Result<()> {
        KindSettings::check(self, prefix)
    }
    fn build(&self, cfg: &JudgeConfig, rubrics: &RubricSet) -> Result<Judges> {
        KindSettings::build(self, cfg, rubrics)
    }
}

/// The field names serde's derive gives a struct (the names `deserialize_struct` is asked for,
/// renames applied): a kind's keys, read from its settings struct instead of a list kept by hand.
fn field_names<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    use serde::de::{self, Visitor};
    struct Fields(Option<&'static [&'static str]>);
    impl<'de> de::Deserializer<'de> for &mut Fields {
        type Error = de::value::Error;
        fn deserialize_any<V: Visitor<'de>>(
            self,
            _: V,
        ) -> std::result::Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            _visitor: V,
        ) -> std::result::Result<V::Value, Self::Error> {
            self.0 = Some(fields);
            Err(de::Error::custom("fields read"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
            option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
            ignored_any
        }
    }
    let mut fields = Fields(None);
    let _ = T::deserialize(&mut fields);
    // A settings struct with derived `Deserialize` and no `flatten` always names its fields.
    debug_assert!(
        fields.0.is_some(),
        "{} names no fields",
        std::any::type_name::<T>()
    );
    fields.0.unwrap_or(&[])
}

// The judge kinds: one line each. A kind is its settings struct (its fields are the kind's
// keys, with their defaults and docs) and that struct's `KindSettings` impl (what the config
// reads of it and how it is built); the macro derives `JudgeKind`, `JudgeSpec` and their
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

/// One judge kind, declared by its settings struct: what the config reads of it and how the
/// judge is built. The struct's serde fields are the kind's keys (see [`JudgeKind::keys`]).
pub trait KindSettings: Serialize + serde::de::DeserializeOwned {
    /// The judge runs a model in this process (built on a device: [`JudgeConfig::build_on`]).
    const IN_PROCESS: bool = false;

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

    /// Builds the judge without a device (`cfg` is the config this is part of; `rubrics` the
    /// records it will grade, possibly none). In-process kinds refuse.
    fn build(&self, cfg: &JudgeConfig, rubrics: &RubricSet) -> Result<Judges>;

    /// Builds the judge, an in-process one on `device`; the default is [`KindSettings::build`].
    #[cfg(feature = "local")]
    fn build_on<B: conrub_kernels::KernelOps>(
        &self,
        cfg: &JudgeConfig,
        device: &B::Device,
        rubrics: &RubricSet,
    ) -> Result<Judges> {
        let _ = device;
        self.build(cfg, rubrics)
    }
}

/// The refusal of [`KindSettings::build`] for a kind that needs a device.
fn needs_device(kind: JudgeKind) -> JudgeError {
    JudgeError::config(
        "kind",
        format!(
            "a {} judge is built with build_on (or build_local) on a device",
            kind.as_str()
        ),
    )
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

impl KindSettings for OpenAiSettings {
    fn prompts(&self) -> Option<&PromptOverrides> {
        Some(&self.prompts)
    }

    fn cache(&self) -> Option<&PathBuf> {
        self.cache.as_ref()
    }

    fn concurrency(&self) -> Option<usize> {
        Some(self.concurrency)
    }

    fn build(&self, cfg: &JudgeConfig, _rubrics: &RubricSet) -> Result<Judges> {
        let client = Arc::new(ChatClient::new(self.client_config()?)?);
        let cache = cfg.open_cache()?;
        let judge = Arc::new(OpenAiJudge::new(
            client.clone(),
            cfg.prompt_set()?,
            cache.clone(),
        ));
        Ok(Judges {
            criterion: judge.clone(),
            pairwise: judge,
            client: Some(client),
            cache,
        })
    }
}

impl OpenAiSettings {
    /// The client settings (`url` first, then `urls`); checked.
    pub fn client_config(&self) -> Result<ClientConfig> {
        let mut urls = self.urls.clone();
        if let Some(u) = &self.url {
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
            model: self.model.clone(),
            api_key_env: self.api_key_env.clone(),
            concurrency: self.concurrency,
            timeout_secs: self.timeout_secs,
            max_retries: self.max_retries,
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            backoff_base_secs: self.backoff_base_secs,
            backoff_max_secs: self.backoff_max_secs,
            chat_template_kwargs: self.chat_template_kwargs.clone(),
        };
        cfg.validate()?;
        Ok(cfg)
    }
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

impl KindSettings for LocalSettings {
    const IN_PROCESS: bool = true;

    fn prompts(&self) -> Option<&PromptOverrides> {
        Some(&self.prompts)
    }

    fn cache(&self) -> Option<&PathBuf> {
        self.cache.as_ref()
    }

    fn device(&self) -> Option<&str> {
        self.device.as_deref()
    }

    fn build(&self, _cfg: &JudgeConfig, _rubrics: &RubricSet) -> Result<Judges> {
        Err(needs_device(JudgeKind::Local))
    }

    #[cfg(feature = "local")]
    fn build_on<B: conrub_kernels::KernelOps>(
        &self,
        cfg: &JudgeConfig,
        device: &B::Device,
        _rubrics: &RubricSet,
    ) -> Result<Judges> {
        let loaded = cfg.load_model::<B>(&self.model, device)?;
        let cache = cfg.open_cache()?;
        let judge = Arc::new(crate::local::LocalJudge::new(
            loaded,
            device.clone(),
            cfg.prompt_set()?,
            self.local.clone(),
            cache.clone(),
        )?);
        Ok(Judges {
            criterion: judge.clone(),
            pairwise: judge,
            client: None,
            cache,
        })
    }
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

impl KindSettings for LexicalSettings {
    /// The lexical judge reads its keyword file (`keywords`); `rubrics`, the records it will
    /// grade (may be empty), is only checked against that file: when the file names none of
    /// their criteria it is an error (a keyword file for other data, or criteria edited since).
    fn build(&self, cfg: &JudgeConfig, rubrics: &RubricSet) -> Result<Judges> {
        let judge = match &self.keywords {
            Some(p) => keyword_judge(&cfg.base_dir.join(p), rubrics)?,
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
}

/// The lexical judge of keyword file `path`, checked against the criteria it will grade.
fn keyword_judge(path: &Path, rubrics: &RubricSet) -> Result<LexicalJudge> {
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

/// `kind = "probe"`: a distilled probe on an in-process model (see [`crate::probe`]).
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

impl KindSettings for ProbeSettings {
    const IN_PROCESS: bool = true;

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
            return Err(JudgeError::config(
                format!("{prefix}abstain_below"),
                format!("{b} is not a probability in (0, 1]"),
            ));
        }
        if self.batch_size == 0 {
            return Err(JudgeError::config(
                format!("{prefix}batch_size"),
                "must be at least 1",
            ));
        }
        if self.abstain_below.is_some() != self.fallback.is_some() {
            return Err(JudgeError::config(
                format!("{prefix}fallback"),
                "abstain_below and fallback go together (abstained criteria need a judge)",
            ));
        }
        Ok(())
    }

    fn build(&self, _cfg: &JudgeConfig, _rubrics: &RubricSet) -> Result<Judges> {
        Err(needs_device(JudgeKind::Probe))
    }

    #[cfg(feature = "local")]
    fn build_on<B: conrub_kernels::KernelOps>(
        &self,
        cfg: &JudgeConfig,
        device: &B::Device,
        _rubrics: &RubricSet,
    ) -> Result<Judges> {
        use crate::probe::{Abstention, FeatureSpecFilter, ProbeFeaturizer, ProbeJudge};
        let loaded = cfg.load_model::<B>(&self.model, device)?;
        let cache = cfg.open_cache()?;
        let fallback = match cfg.fallback() {
            None => None,
            Some(f) => Some(f.build_on::<B>(device, &no_records()?)?),
        };
        let exec = conrub_models::Execution {
            precision: self.precision,
            ..loaded.model.execution()
        };
        let featurizer = ProbeFeaturizer::new(
            loaded.with_execution(exec),
            device.clone(),
            cfg.prompt_set()?,
            self.batch_size,
        )?;
        let abstention = match (self.abstain_below, &fallback) {
            (Some(below), Some(f)) => Some(Abstention {
                below,
                fallback: f.criterion.clone(),
            }),
            _ => None,
        };
        let judge = Arc::new(ProbeJudge::new(
            featurizer,
            &cfg.base_dir.join(&self.probe),
            Some(FeatureSpecFilter {
                layer: self.layer,
                pooling: self.pooling,
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
        let kinds: Vec<&str> = JudgeKind::ALL.iter().map(|k| k.as_str()).collect();
        let kinds = kinds.join(", ");
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
        let spec = JudgeSpec::deserialize_kind(kind, value).map_err(field)?;
        spec.settings().check(prefix)?;
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
        self.spec.kind()
    }

    /// The in-process judge's device, when the config names one.
    pub fn device(&self) -> Option<&str> {
        self.spec.settings().device()
    }

    /// Requests in flight for a served judge (the client's default for other kinds).
    pub fn concurrency(&self) -> usize {
        self.spec
            .settings()
            .concurrency()
            .unwrap_or_else(crate::client::default_concurrency)
    }

    /// The client settings of a served judge.
    pub fn client_config(&self) -> Result<ClientConfig> {
        match &self.spec {
            JudgeSpec::Openai(o) => o.client_config(),
            _ => Err(JudgeError::config(
                "kind",
                "only kind = \"openai\" has a client",
            )),
        }
    }

    /// The prompts with overrides applied (defaults for a kind without prompts).
    pub fn prompt_set(&self) -> Result<PromptSet> {
        match self.spec.settings().prompts() {
            Some(overrides) => PromptSet::with_overrides(overrides, &self.base_dir),
            None => Ok(PromptSet::default()),
        }
    }

    /// Opens the cache, if one is configured.
    pub fn open_cache(&self) -> Result<Option<Arc<JudgeCache>>> {
        self.spec
            .settings()
            .cache()
            .map(|p| JudgeCache::open(&self.base_dir.join(p)).map(Arc::new))
            .transpose()
    }

    /// Builds a judge that needs no device (`openai`, `lexical`; an in-process kind is built
    /// with [`JudgeConfig::build_on`]); `rubrics` are the records it will grade (may be empty):
    /// a kind may check itself against them (the lexical judge's keyword file).
    pub fn build(&self, rubrics: &RubricSet) -> Result<Judges> {
        self.spec.settings().build(self, rubrics)
    }

    /// Builds a judge of any kind: an in-process one (`local`, `probe`) on `device`, any other
    /// as [`JudgeConfig::build`] does.
    #[cfg(feature = "local")]
    pub fn build_on<B: conrub_kernels::KernelOps>(
        &self,
        device: &B::Device,
        rubrics: &RubricSet,
    ) -> Result<Judges> {
        self.spec.build_on::<B>(self, device, rubrics)
    }

    /// Builds an in-process judge (`local` or `probe`) on `device`: loads `model` (and a probe's
    /// file and fallback judge; a fallback that is itself in process runs on the same device).
    #[cfg(feature = "local")]
    pub fn build_local<B: conrub_kernels::KernelOps>(&self, device: &B::Device) -> Result<Judges> {
        if !self.kind().in_process() {
            return Err(JudgeError::config(
                "kind",
                format!(
                    "build_local builds kind = \"local\" or \"probe\", not \"{}\"",
                    self.kind().as_str()
                ),
            ));
        }
        self.build_on::<B>(device, &no_records()?)
    }

    /// The base model of an in-process judge: a checkpoint directory relative to the file, else
    /// a hub id.
    #[cfg(feature = "local")]
    fn load_model<B: conrub_kernels::KernelOps>(
        &self,
        model: &str,
        device: &B::Device,
    ) -> Result<conrub_models::Pretrained<B>> {
        let path = self.base_dir.join(model);
        if path.is_dir() {
            conrub_models::Pretrained::<B>::load_dir(&path, device)
        } else {
            conrub_models::Pretrained::<B>::load(model, device)
        }
        .map_err(|e| JudgeError::Model(Box::new(e)))
    }
}

/// No records: what an in-process judge is checked against (nothing).
#[cfg(feature = "local")]
fn no_records() -> Result<RubricSet> {
    RubricSet::from_records("none", vec![]).map_err(|e| JudgeError::Probe(e.to_string()))
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

    /// Each kind's keys (its settings struct's fields, as serde's derive names them) are the
    /// fields it serialises (with every optional field set, so none is skipped).
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
            ground_truth: None,
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
