//! Building a judge from its settings ([`JudgeConfig`], read by `conrub-settings`): each kind's
//! [`BuildJudge`] impl, and [`JudgeBuild`], what a judge config does with them (its client, its
//! prompts, its cache, the judge itself). Adding a kind: its settings struct and line in
//! `conrub_settings::judge`, its `BuildJudge` impl and arm in [`for_kind!`] here.

use std::path::Path;
use std::sync::Arc;

use conrub_rubric::RubricSet;
pub use conrub_settings::judge::{
    field_names, JudgeConfig, JudgeKind, JudgeSpec, KindKeys, KindSettings, LexicalSettings,
    LocalSettings, OpenAiSettings, ProbeSettings,
};

use crate::cache::JudgeCache;
use crate::client::{ChatClient, ClientConfig};
use crate::error::{JudgeError, Result};
use crate::judge::{CriterionJudge, PairwiseJudge};
use crate::lexical::LexicalJudge;
use crate::openai::OpenAiJudge;
use crate::prompts::PromptSet;

/// Runs `$body` with `$s` bound to the settings of `$spec`'s kind: the one list of kinds here.
macro_rules! for_kind {
    ($spec:expr, $s:ident => $body:expr) => {
        match $spec {
            JudgeSpec::Openai($s) => $body,
            JudgeSpec::Local($s) => $body,
            JudgeSpec::Lexical($s) => $body,
            JudgeSpec::Probe($s) => $body,
        }
    };
}

/// How one kind's judge is built from its settings.
pub trait BuildJudge: KindSettings {
    /// Builds the judge without a device (`cfg` is the config this is part of; `rubrics` the
    /// records it will grade, possibly none). In-process kinds refuse.
    fn build(&self, cfg: &JudgeConfig, rubrics: &RubricSet) -> Result<Judges>;

    /// Builds the judge, an in-process one on `device`; the default is [`BuildJudge::build`].
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

/// The refusal of [`BuildJudge::build`] for a kind that needs a device.
fn needs_device(kind: JudgeKind) -> JudgeError {
    JudgeError::config(
        "kind",
        format!(
            "a {} judge is built with build_on (or build_local) on a device",
            kind.as_str()
        ),
    )
}

impl BuildJudge for OpenAiSettings {
    fn build(&self, cfg: &JudgeConfig, _rubrics: &RubricSet) -> Result<Judges> {
        let client = Arc::new(ChatClient::new(client_config(self)?)?);
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

/// The client settings of an `openai` judge (`url` first, then `urls`); checked.
pub fn client_config(o: &OpenAiSettings) -> Result<ClientConfig> {
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

impl BuildJudge for LocalSettings {
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
        let loaded = load_model::<B>(cfg, &self.model, device)?;
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

impl BuildJudge for LexicalSettings {
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

impl BuildJudge for ProbeSettings {
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
        let loaded = load_model::<B>(cfg, &self.model, device)?;
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

/// What a judge config does with its settings: the served judge's client, the prompts, the
/// cache, the judge.
pub trait JudgeBuild {
    /// The client settings of a served judge.
    fn client_config(&self) -> Result<ClientConfig>;

    /// The prompts with overrides applied (defaults for a kind without prompts).
    fn prompt_set(&self) -> Result<PromptSet>;

    /// Opens the cache, if one is configured.
    fn open_cache(&self) -> Result<Option<Arc<JudgeCache>>>;

    /// Builds a judge that needs no device (`openai`, `lexical`; an in-process kind is built
    /// with [`JudgeBuild::build_on`]); `rubrics` are the records it will grade (may be empty):
    /// a kind may check itself against them (the lexical judge's keyword file).
    fn build(&self, rubrics: &RubricSet) -> Result<Judges>;

    /// Builds a judge of any kind: an in-process one (`local`, `probe`) on `device`, any other
    /// as [`JudgeBuild::build`] does.
    #[cfg(feature = "local")]
    fn build_on<B: conrub_kernels::KernelOps>(
        &self,
        device: &B::Device,
        rubrics: &RubricSet,
    ) -> Result<Judges>;

    /// Builds an in-process judge (`local` or `probe`) on `device`: loads `model` (and a probe's
    /// file and fallback judge; a fallback that is itself in process runs on the same device).
    #[cfg(feature = "local")]
    fn build_local<B: conrub_kernels::KernelOps>(&self, device: &B::Device) -> Result<Judges>;
}

impl JudgeBuild for JudgeConfig {
    fn client_config(&self) -> Result<ClientConfig> {
        match &self.spec {
            JudgeSpec::Openai(o) => client_config(o),
            _ => Err(JudgeError::config(
                "kind",
                "only kind = \"openai\" has a client",
            )),
        }
    }

    fn prompt_set(&self) -> Result<PromptSet> {
        match self.prompts() {
            Some(overrides) => PromptSet::with_overrides(overrides, &self.base_dir),
            None => Ok(PromptSet::default()),
        }
    }

    fn open_cache(&self) -> Result<Option<Arc<JudgeCache>>> {
        self.cache_path()
            .map(|p| JudgeCache::open(&p).map(Arc::new))
            .transpose()
    }

    fn build(&self, rubrics: &RubricSet) -> Result<Judges> {
        for_kind!(&self.spec, s => s.build(self, rubrics))
    }

    #[cfg(feature = "local")]
    fn build_on<B: conrub_kernels::KernelOps>(
        &self,
        device: &B::Device,
        rubrics: &RubricSet,
    ) -> Result<Judges> {
        for_kind!(&self.spec, s => s.build_on::<B>(self, device, rubrics))
    }

    #[cfg(feature = "local")]
    fn build_local<B: conrub_kernels::KernelOps>(&self, device: &B::Device) -> Result<Judges> {
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
}

/// The base model of an in-process judge: a checkpoint directory relative to the config's
/// file, else a hub id.
#[cfg(feature = "local")]
fn load_model<B: conrub_kernels::KernelOps>(
    cfg: &JudgeConfig,
    model: &str,
    device: &B::Device,
) -> Result<conrub_models::Pretrained<B>> {
    let path = cfg.base_dir.join(model);
    if path.is_dir() {
        conrub_models::Pretrained::<B>::load_dir(&path, device)
    } else {
        conrub_models::Pretrained::<B>::load(model, device)
    }
    .map_err(|e| JudgeError::Model(Box::new(e)))
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
