//! The judge config file (`--judge CONFIG`): one TOML schema for every judge kind.
//!
//! ```toml
//! kind = "openai"                 # openai | local | lexical
//! urls = ["http://judge-0:30000/v1", "http://judge-1:30000/v1"]   # or url = "..."
//! model = "Qwen/Qwen3-32B"        # served name (openai) or checkpoint dir / hub id (local)
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
//! The lexical test double takes one setting of its own, its keyword file (see [`crate::lexical`]):
//!
//! ```toml
//! kind = "lexical"
//! keywords = "../data/samples/lexical-keywords.jsonl"   # optional; relative to this file
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use conrub_rubric::RubricSet;
use serde::Deserialize;
use serde_json::Value;

use crate::cache::JudgeCache;
use crate::client::{ChatClient, ClientConfig};
use crate::error::{JudgeError, Result};
use crate::judge::{CriterionJudge, PairwiseJudge};
use crate::lexical::LexicalJudge;
use crate::openai::OpenAiJudge;
use crate::prompts::{PromptOverrides, PromptSet};

/// The kinds of judge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JudgeKind {
    /// An OpenAI-compatible endpoint (SGLang, vLLM, OpenAI).
    Openai,
    /// Our burn Qwen3, in process.
    Local,
    /// The lexical test double.
    Lexical,
}

/// A parsed judge config.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JudgeConfig {
    /// Which judge.
    pub kind: JudgeKind,
    /// One base URL (alternative to `urls`).
    #[serde(default)]
    pub url: Option<String>,
    /// Base URLs to spread calls over.
    #[serde(default)]
    pub urls: Vec<String>,
    /// Served model name (openai) or checkpoint directory / hub id (local).
    #[serde(default)]
    pub model: Option<String>,
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
    /// Device of the local judge (`cpu`, `wgpu`, `cuda:0`, ...).
    #[serde(default)]
    pub device: Option<String>,
    /// Prompt overrides.
    #[serde(default)]
    pub prompts: PromptOverrides,
    /// Lexical judge only: its keyword file (JSONL of `{criterion, keywords, contradictions}`),
    /// relative to the config file. Without it every criterion is matched by its own words.
    #[serde(default)]
    pub keywords: Option<PathBuf>,
    /// Local judge settings.
    #[cfg(feature = "local")]
    #[serde(default)]
    pub local: crate::local::LocalJudgeConfig,
    /// Local judge settings (this build has no local judge).
    #[cfg(not(feature = "local"))]
    #[serde(default)]
    pub local: Option<toml::Table>,
    /// Directory the config was read from (relative paths resolve against it).
    #[serde(skip)]
    pub base_dir: PathBuf,
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
    /// Parses a TOML string; `base_dir` resolves relative paths.
    pub fn from_toml(text: &str, base_dir: &Path) -> std::result::Result<Self, String> {
        let mut cfg: JudgeConfig =
            toml::from_str(text).map_err(|e| e.to_string().trim_end().to_string())?;
        if cfg.keywords.is_some() && cfg.kind != JudgeKind::Lexical {
            return Err("keywords: only the lexical test-double judge (kind = \"lexical\") reads a keyword file".into());
        }
        cfg.base_dir = base_dir.to_path_buf();
        Ok(cfg)
    }

    /// Reads a config file; errors name the file and the key.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| JudgeError::File {
            path: path.into(),
            message: e.to_string(),
        })?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Self::from_toml(&text, &base).map_err(|message| JudgeError::File {
            path: path.into(),
            message,
        })
    }

    /// The client settings (openai).
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
        let model = self.model.clone().ok_or_else(|| {
            JudgeError::config("model", "kind = \"openai\" needs the served model name")
        })?;
        let cfg = ClientConfig {
            urls,
            model,
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

    /// The prompts with overrides applied.
    pub fn prompt_set(&self) -> Result<PromptSet> {
        PromptSet::with_overrides(&self.prompts, &self.base_dir)
    }

    /// Opens the cache, if one is configured.
    pub fn open_cache(&self) -> Result<Option<Arc<JudgeCache>>> {
        self.cache
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
        match self.kind {
            JudgeKind::Openai => {
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
            JudgeKind::Lexical => {
                let judge = match &self.keywords {
                    Some(p) => {
                        let path = self.base_dir.join(p);
                        let judge = LexicalJudge::from_file(&path)?;
                        let texts: Vec<&str> = rubrics
                            .iter()
                            .flat_map(|r| &r.criteria)
                            .map(|c| c.text.as_str())
                            .collect();
                        if !texts.is_empty()
                            && !judge.is_empty()
                            && !texts.iter().any(|t| judge.knows(t))
                        {
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
                        judge
                    }
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
            JudgeKind::Local => Err(JudgeError::config(
                "kind",
                "a local judge is built with build_local on a device",
            )),
        }
    }

    /// Builds the in-process judge on `device` (loads `model`).
    #[cfg(feature = "local")]
    pub fn build_local<B: conrub_kernels::GrpoOps>(&self, device: &B::Device) -> Result<Judges> {
        let model = self.model.as_ref().ok_or_else(|| {
            JudgeError::config(
                "model",
                "kind = \"local\" needs a checkpoint directory or hub id",
            )
        })?;
        let path = self.base_dir.join(model);
        let loaded = if path.is_dir() {
            conrub_qwen3::Qwen3::<B>::load_dir(&path, device)
        } else {
            conrub_qwen3::Qwen3::<B>::load(model, device)
        }
        .map_err(|e| JudgeError::Model(e.to_string()))?;
        let cache = self.open_cache()?;
        let judge = Arc::new(crate::local::LocalJudge::new(
            loaded,
            device.clone(),
            self.prompt_set()?,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_key() {
        let e = JudgeConfig::from_toml("kind = \"sglang\"\n", Path::new(".")).unwrap_err();
        assert!(e.contains("kind") && e.contains("openai"), "{e}");
        let e = JudgeConfig::from_toml("kind = \"openai\"\nconcurency = 3\n", Path::new("."))
            .unwrap_err();
        assert!(e.contains("concurency"), "{e}");
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
            assert_eq!(c.local.precision, conrub_qwen3::Precision::Bf16Mixed);
            let e = JudgeConfig::from_toml(
                "kind = \"local\"\nmodel = \"m\"\n[local]\nprecision = \"bf16\"\n",
                Path::new("."),
            )
            .unwrap_err();
            assert!(
                e.contains("precision") && e.contains("bf16-mixed") && e.contains("line 4"),
                "{e}"
            );
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
        let e = JudgeConfig::from_toml("kind = \"openai\"\nkeywords = \"kw.jsonl\"\n", dir.path())
            .unwrap_err();
        assert!(e.starts_with("keywords: only the lexical"), "{e}");
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
            "kind = \"openai\"\nurl = \"http://h:1/v1\"\nmodel = \"Qwen/Qwen3-32B\"\n",
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
