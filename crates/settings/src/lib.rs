//! conrub's settings as plain serde structs, below every other crate: what a train config, a
//! judge file and the command line set, with their defaults and range checks, and nothing that
//! acts on them. The config crate reads files into them; the learner, the models, the kernels,
//! the engines and the judges take them.
//!
//! | table | settings |
//! |---|---|
//! | `[learner]` | [`LearnerConfig`] (by concern: [`SamplingParams`], [`OptimizerSettings`], [`ObjectiveSettings`], [`SystemSettings`]; + [`Clip`], [`TieMode`], [`Aggregation`], [`ScaleRewards`], [`KlEstimator`], [`LrScheduleKind`], [`OnNonFinite`]) |
//! | `[run]`, `[eval]` | [`RunConfig`], [`ValidationConfig`] ([`ValidationDecoding`]) |
//! | top level | [`Precision`], [`AttentionKernelChoice`], [`Sharding`] |
//! | `[model]` | [`ModelSection`] ([`RandomModel`], [`Family`], [`SaveDtype`], [`ShardSize`]) |
//! | `[rollout]` | [`RolloutSection`] ([`RolloutEngineKind`]) |
//! | a generation call | [`Decoding`] ([`SamplingParams`]: the one type of the sampling rule's parameters) |
//! | `[judge]`, `[eval.grader]`, a judge file | [`JudgeConfig`] ([`JudgeSpec`]: one settings struct per [`JudgeKind`]) |
//!
//! Errors: [`SettingsError`], naming the dotted key.

mod error;
mod exec;
mod flat;
pub mod judge;
mod learner;
mod model;
mod rollout;
mod run;
mod sampling;

pub use error::{Result, SettingsError};
pub use exec::{AttentionKernelChoice, Precision, Sharding};
pub use judge::{
    JudgeConfig, JudgeKind, JudgeSpec, KindKeys, KindSettings, LexicalSettings, LocalJudgeConfig,
    LocalMode, LocalSettings, OpenAiSettings, Pooling, ProbeSettings, PromptOverrides,
};
pub use learner::{
    Aggregation, Clip, KlEstimator, LearnerConfig, LrScheduleKind, ObjectiveSettings, OnNonFinite,
    OptimizerSettings, ScaleRewards, SystemSettings, TieMode, DEFAULT_ESTIMATOR, DEFAULT_LOSS,
    GSPO_LOSS, MAX_GROUP_SIZE,
};
pub use model::{Family, ModelSection, RandomModel, SaveDtype, ShardSize};
pub use rollout::{RolloutEngineKind, RolloutSection, DEFAULT_BLOCK_SIZE, DEFAULT_MAX_ROWS};
pub use run::{RunConfig, ValidationConfig, ValidationDecoding, MAX_PROMPTS_PER_STEP};
pub use sampling::{Decoding, SamplingParams};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_pass_their_own_checks() {
        LearnerConfig::default().validate().unwrap();
        RunConfig::default().validate().unwrap();
        RolloutSection::default().validate().unwrap();
        let e = LearnerConfig {
            sampling: SamplingParams {
                top_p: 0.0,
                ..SamplingParams::default()
            },
            ..LearnerConfig::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e.to_string(), "learner.top_p: 0 must be in (0, 1]");
    }

    /// Settings that used to train and exit 0 (issue 53, items 5 and 8) are refused by name:
    /// a negative KL weight, AdamW's betas outside [0, 1), a non-positive epsilon, a negative
    /// weight decay or gradient clip, an infinite temperature and a repetition penalty that is
    /// subnormal in f32.
    #[test]
    fn out_of_range_learner_settings_are_refused() {
        type Set = fn(&mut LearnerConfig);
        let cases: [(&str, Set); 12] = [
            // Issue 53, item 10: `plan` scanned for minutes at a group size near 2^63.
            ("group_size", |c| c.group_size = 1 << 62),
            ("kl_beta", |c| c.objective.kl_beta = -1.0),
            ("beta1", |c| c.optimizer.beta1 = 1.0),
            ("beta2", |c| c.optimizer.beta2 = -0.1),
            ("adam_eps", |c| c.optimizer.adam_eps = 0.0),
            ("weight_decay", |c| c.optimizer.weight_decay = -0.1),
            ("max_grad_norm", |c| c.optimizer.max_grad_norm = -1.0),
            ("max_grad_norm", |c| c.optimizer.max_grad_norm = f64::NAN),
            ("temperature", |c| c.sampling.temperature = f64::INFINITY),
            ("repetition_penalty", |c| {
                c.sampling.repetition_penalty = 1e-40
            }),
            ("repetition_penalty", |c| {
                c.sampling.repetition_penalty = 1e31
            }),
            ("repetition_penalty", |c| {
                c.sampling.repetition_penalty = 0.0
            }),
        ];
        for (key, set) in cases {
            let mut c = LearnerConfig::default();
            set(&mut c);
            let e = c.validate().unwrap_err().to_string();
            assert!(e.starts_with(&format!("learner.{key}: ")), "{key}: {e}");
        }
        // Their edges stay valid: no clipping, no decay, beta 0.
        let mut c = LearnerConfig::default();
        (
            c.optimizer.max_grad_norm,
            c.optimizer.weight_decay,
            c.optimizer.beta1,
        ) = (0.0, 0.0, 0.0);
        c.sampling.repetition_penalty = 1e-30;
        c.group_size = MAX_GROUP_SIZE;
        c.validate().unwrap();
        let run = |prompts_per_step| RunConfig {
            prompts_per_step,
            ..RunConfig::default()
        };
        run(MAX_PROMPTS_PER_STEP).validate().unwrap();
        let e = run(1 << 62).validate().unwrap_err().to_string();
        assert!(e.starts_with("run.prompts_per_step: "), "{e}");
    }

    /// A random model's shape is checked here, before any model crate sees it; errors name the
    /// key under `model.random`.
    #[test]
    fn a_random_shape_is_checked_key_by_key() {
        let shape = |heads: usize, kv: usize, head_dim: usize| ModelSection {
            random: Some(RandomModel {
                family: Family::Llama,
                tokenizer: "t".into(),
                hidden_size: 64,
                intermediate_size: 128,
                num_hidden_layers: 2,
                num_attention_heads: heads,
                num_key_value_heads: kv,
                head_dim,
                std: 0.02,
                seed: 0,
            }),
            ..ModelSection::default()
        };
        shape(4, 2, 16).validate().unwrap();
        let e = shape(4, 3, 16).validate().unwrap_err().to_string();
        assert!(
            e.starts_with("model.random.num_key_value_heads: 3 does not divide"),
            "{e}"
        );
        let e = shape(4, 2, 15).validate().unwrap_err().to_string();
        assert!(e.starts_with("model.random.head_dim: "), "{e}");
        let e = shape(0, 2, 16).validate().unwrap_err().to_string();
        assert!(e.starts_with("model.random.num_attention_heads: "), "{e}");
    }

    /// `[learner]` is one flat table: the sampling keys land in `sampling`, and a wrong type or
    /// an unknown key names `learner.KEY` wherever the key belongs.
    #[test]
    fn the_learner_table_is_flat() {
        #[derive(serde::Deserialize)]
        struct File {
            learner: LearnerConfig,
        }
        let read = |text: &str| {
            let table: toml::Table = toml::from_str(text).unwrap();
            serde_path_to_error::deserialize::<_, File>(toml::Value::Table(table))
                .map(|f| f.learner)
                .map_err(|e| {
                    let path = e.path().to_string();
                    format!("{path}: {}", e.into_inner().message())
                })
        };
        let l = read("[learner]\nlr = 1e-5\ntop_k = 20\nmin_p = 0.05\ngroup_size = 4\n").unwrap();
        assert_eq!((l.optimizer.lr, l.group_size), (1e-5, 4));
        assert_eq!(
            (l.sampling.top_k, l.sampling.min_p, l.sampling.temperature),
            (Some(20), 0.05, 1.0)
        );
        let e = read("[learner]\ntemperature = \"hot\"\n").unwrap_err();
        assert!(
            e.starts_with("learner.temperature: invalid type: string"),
            "{e}"
        );
        let e = read("[learner]\nlr = \"fast\"\n").unwrap_err();
        assert!(e.starts_with("learner.lr: invalid type: string"), "{e}");
        // Every float TOML writes reaches the range checks, infinities included.
        let odd = read("[learner]\nlr = inf\ntemperature = nan\n").unwrap();
        assert!(odd.optimizer.lr.is_infinite() && odd.sampling.temperature.is_nan());
        assert_eq!(
            odd.validate().unwrap_err().to_string(),
            "learner.temperature: NaN must be > 0 (use greedy decoding for 0)"
        );
        let e = read("[learner]\nnew_knob = 1\n").unwrap_err();
        assert!(
            e.starts_with("learner.new_knob: unknown field `new_knob`, expected one of"),
            "{e}"
        );
        assert!(
            e.contains("`group_size`") && e.contains("`repetition_penalty`"),
            "{e}"
        );
        // The state file's JSON round-trips through the same flat form.
        let json = serde_json::to_value(&l).unwrap();
        assert_eq!(json["top_k"], 20);
        assert!(json.get("sampling").is_none());
        assert_eq!(serde_json::from_value::<LearnerConfig>(json).unwrap(), l);
    }

    #[test]
    fn family_names_round_trip() {
        for f in Family::ALL {
            assert_eq!(Family::from_model_type(f.model_type()), Some(f));
            assert_eq!(f.to_string(), f.model_type());
        }
        assert_eq!(Family::names(), "qwen3, llama, qwen2");
    }

    /// A judge file named by `config = "FILE"` is read relative to the table's directory, and
    /// its errors name that file.
    #[test]
    fn a_judge_file_is_read_and_its_errors_name_it() {
        let dir = std::env::temp_dir().join(format!("conrub-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("j.toml"), "kind = \"lexical\"\n").unwrap();
        let c = JudgeConfig::from_file(&dir.join("j.toml")).unwrap();
        assert_eq!(
            (c.kind(), c.base_dir.as_path()),
            (JudgeKind::Lexical, dir.as_path())
        );
        std::fs::write(dir.join("bad.toml"), "kind = \"lexical\"\nkeywords = 3\n").unwrap();
        let e = JudgeConfig::from_file(&dir.join("bad.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad.toml: keywords: "), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
