//! The training run as a library. A [`Trainer`] is built from the typed run config
//! ([`TrainConfig`]) and runs what `conrub train` runs, stage by stage:
//!
//! | stage | where | what |
//! |---|---|---|
//! | policy | [`load_policy`] (or an embedder's [`PolicyParts`]) | the model of `[model]` with its codec, stop ids and writers |
//! | task and rewards | [`Trainer::from_config`]: the rubric records (`data.rs`: `data.rubrics` or `[[data.train]]`'s files mixed by weight) and judges, `[[reward.functions]]` ([`Trainer::from_config_with`] adds an embedder's kinds); [`Trainer::new`]: any [`TaskPrompt`] type and [`RewardSource`] | prompts, rewards, tie breaker, validator |
//! | rollout engine | `engine.rs` | in process (`conrub-rollout`) or SGLang servers (`rollout.engine`) |
//! | kernel warm-up | [`Trainer::warm_kernels`] | every kernel of the first steps compiled before them (CubeCL backends) |
//! | supervised fine-tuning (`[warmup]`) | `sft.rs` | cross-entropy steps on the prompts' reference answers before GRPO (fresh runs) |
//! | learners | `run.rs` | one [`Learner`](conrub_grpo::Learner), or a data-parallel group on every device ([`Trainee`]) |
//! | the loop | [`train`] (`run_loop.rs`) | one struct with a method per stage: open (resume, claim the folder), draw, step, validate, checkpoint, finish |
//! | outputs | `sinks.rs` ([`RunSink`]) | every event to each sink: `metrics.jsonl` ([`telemetry`]), samples ([`samples`]), TensorBoard ([`tensorboard`]), progress; an embedder adds its own ([`RunHooks::sinks`]) |
//! | checkpoints | `checkpoint.rs`, [`run_folder`] | the export (by [`PolicyParts::export`]) and the learner's state, sealed behind the next steps, pruned; the best by the grader; the folder's lock, `--resume auto`'s newest checkpoint |
//! | validation | [`Validator`] (`validation.rs`) | held-out prompts scored by the training judge and a grader |
//!
//! `conrub train` parses its arguments, picks the backend and calls [`Trainer::from_config`] and
//! [`Trainer::run`]; a program that embeds the learner with its own task and reward calls
//! [`Trainer::new`] (see `examples/verifiable_reward.rs`):
//!
//! ```no_run
//! # use conrub_trainer::{load_policy, Trainer};
//! # use conrub_config::TrainConfig;
//! # fn demo(cfg: TrainConfig) -> conrub_trainer::Result<()> {
//! type B = burn::backend::Flex;
//! let device = Default::default();
//! let trainer = Trainer::<B>::from_config(cfg, vec![device])?;
//! let summary = trainer.run()?;
//! println!("{} steps", summary.total_steps);
//! # Ok(()) }
//! ```
//!
//! Progress lines and warnings are `tracing` events: install a subscriber (the binary prints
//! them on stderr, `CONRUB_LOG` filtering) to see them; what the set-up dropped is also
//! returned ([`Trainer::dropped_prompts`]).

mod checkpoint;
mod data;
mod engine;
mod error;
mod hooks;
mod kernel_warmup;
mod policy;
mod progress;
mod prompts;
mod report;
mod rubric;
mod run;
pub mod run_folder;
mod run_loop;
pub mod samples;
mod sft;
pub mod sinks;
pub mod telemetry;
pub mod tensorboard;
mod trainee;
mod validation;

use std::path::PathBuf;
use std::sync::Arc;

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use conrub_config::TrainConfig;
use conrub_contracts::{
    Export, KernelWarmupLine, PagedModel, Policy, RolloutEngine, TextCodec, TieMode,
};
use conrub_grpo::{Registry, TieBreaker};
use conrub_kernels::KernelOps;
use conrub_models::CausalLm;
use conrub_parallel::Collective;
use conrub_remote::WeightWriter;
use conrub_rewards::{RewardKinds, RewardSource, TaskPrompt};
use conrub_rubric::RubricRecord;

pub use checkpoint::{checkpoint_dir, BestCheckpoint};
pub use conrub_contracts::{RunConfig, ValidationConfig};
pub use error::{Result, TrainerError};
pub use hooks::RunHooks;
pub use policy::{load_policy, PolicyParts};
pub use prompts::{drop_overlong, Overlong};
pub use report::report;
pub use rubric::{check_data, check_data_with, check_rubrics, CheckedData};
pub use run_folder::best_checkpoint_path;
pub use run_loop::{drawn_records, epoch_order, train, RunSummary};
pub use sft::{sft_pairs, sft_train};
pub use sinks::{RunEvent, RunSink};
pub use trainee::Trainee;
pub use validation::{HeldOutPrompt, Validator};

/// What scores a step and breaks its ties.
type Judging<T> = (Arc<dyn RewardSource<T>>, Option<Arc<dyn TieBreaker>>);

/// The rollout engine of a run, shared by its ranks and its kernel warm-up.
type Engine<B, P> = Arc<dyn RolloutEngine<B, <P as AutodiffModule<Autodiff<B>>>::InnerModule>>;

/// A training run: a policy on one or more devices of backend `B`, a task of prompts `T` with
/// their reward source, and the run config. Built by [`Trainer::from_config`] (the rubric task
/// of `conrub train`) or [`Trainer::new`] (any task); [`Trainer::run`] trains.
pub struct Trainer<B, P = CausalLm<Autodiff<B>>, T = RubricRecord>
where
    B: KernelOps,
    P: AutodiffModule<Autodiff<B>>,
    T: TaskPrompt,
{
    pub(crate) cfg: TrainConfig,
    pub(crate) devices: Vec<B::Device>,
    /// The policy; taken out while the warm-ups and the run train it.
    pub(crate) model: Option<P>,
    pub(crate) codec: Arc<dyn TextCodec>,
    pub(crate) stop_ids: Vec<u32>,
    pub(crate) export: Arc<dyn Export<P>>,
    pub(crate) rollout_weights: Option<WeightWriter<P::InnerModule>>,
    pub(crate) task: Vec<T>,
    pub(crate) rewards: Arc<dyn RewardSource<T>>,
    pub(crate) tie_breaker: Option<Arc<dyn TieBreaker>>,
    /// What the kernel warm-up scores with instead (no server is called): a lexical judge for
    /// rubric tasks; `None` uses `rewards` and `tie_breaker`.
    pub(crate) kernel_warmup_judging: Option<(Arc<dyn RewardSource<T>>, Arc<dyn TieBreaker>)>,
    pub(crate) validator: Option<Validator>,
    pub(crate) registry: Option<Registry<Autodiff<B>>>,
    pub(crate) collective: Option<Arc<dyn Collective<B>>>,
    pub(crate) resume: Option<PathBuf>,
    pub(crate) kv_pool_blocks: Option<usize>,
    pub(crate) engine: Option<Engine<B, P>>,
    pub(crate) kernel_warmup: Option<KernelWarmupLine>,
    /// The process's async runtime (judges, reward servers, SGLang).
    pub(crate) runtime: Arc<tokio::runtime::Runtime>,
    /// Names the task and its judge in the opening line.
    pub(crate) describe: String,
    /// Prompts `data.max_prompt_tokens` dropped.
    pub(crate) dropped: Overlong,
}

impl<B: KernelOps> Trainer<B> {
    /// `conrub train`'s run of `cfg` on `devices` (one rank each): the policy of `[model]`, the
    /// rubric records of `data.rubrics` scored by `[judge]` (ties broken by its pairwise judge
    /// unless `learner.tie_mode = "off"`), validation on `[eval]`.
    pub fn from_config(cfg: TrainConfig, devices: Vec<B::Device>) -> Result<Self> {
        Self::from_config_with(cfg, devices, RewardKinds::builtin())
    }

    /// [`from_config`](Self::from_config) with the reward function kinds `[[reward.functions]]`
    /// may name: the built-in ones plus an embedder's own ([`RewardKinds::register`]); `rubric`
    /// (the judge of `[judge]`) is added here.
    pub fn from_config_with(
        cfg: TrainConfig,
        devices: Vec<B::Device>,
        kinds: RewardKinds<RubricRecord>,
    ) -> Result<Self> {
        // No device fails before any file is read, as it always did.
        first_device::<B>(&devices)?;
        let checked = rubric::check_data_with(&cfg, kinds.clone())?;
        Self::from_checked_with(cfg, devices, kinds, checked)
    }

    /// [`from_config`](Self::from_config) on records already read and checked by
    /// [`check_data`] (as `conrub train` does before it loads anything): the files are not read
    /// again.
    pub fn from_checked(
        cfg: TrainConfig,
        devices: Vec<B::Device>,
        checked: CheckedData,
    ) -> Result<Self> {
        Self::from_checked_with(cfg, devices, RewardKinds::builtin(), checked)
    }

    /// [`from_checked`](Self::from_checked) with an embedder's reward function kinds (the
    /// records checked by [`check_data_with`] with the same kinds).
    pub fn from_checked_with(
        cfg: TrainConfig,
        devices: Vec<B::Device>,
        kinds: RewardKinds<RubricRecord>,
        checked: CheckedData,
    ) -> Result<Self> {
        let device = first_device::<B>(&devices)?;
        let task = rubric::rubric_task::<B>(&cfg, &device, kinds, checked)?;
        let policy = load_policy::<B>(&cfg, &device)?;
        let source = task.describe;
        let judge = task.judges.criterion.id();
        let kernel_warmup_judging = rubric::lexical_judging(&cfg);
        let mut trainer = Trainer::new(cfg, devices, policy, task.records, task.rewards)?
            .with_tie_breaker(task.tie_breaker)
            .with_validator(task.validator);
        trainer.kernel_warmup_judging = Some(kernel_warmup_judging);
        trainer.describe = format!(
            "{} prompts from {} with judge {judge} ({} mode, ties: {:?})",
            trainer.task.len(),
            source,
            trainer.cfg.reward.mode.as_str(),
            trainer.cfg.learner.tie_mode
        );
        let functions = &trainer.cfg.reward.functions;
        if !functions.is_empty() {
            let mix: Vec<String> = functions
                .iter()
                .map(|f| format!("{} x {}", f.weight, f.name()))
                .collect();
            trainer.describe += &format!("; rewards {}", mix.join(" + "));
        }
        Ok(trainer)
    }
}

impl<B, P, T> Trainer<B, P, T>
where
    B: KernelOps,
    P: Policy<Autodiff<B>> + AutodiffModule<Autodiff<B>> + Send + 'static,
    P::InnerModule: Policy<B> + PagedModel<B> + 'static,
    T: TaskPrompt + 'static,
{
    /// A run of `cfg` on `devices` (one data-parallel rank each) with `policy` (on the first
    /// device) and a task of `prompts` scored by `rewards`. `[judge]`, `[eval]` and
    /// `data.rubrics` are not read: the task is the caller's; prompts longer than
    /// `data.max_prompt_tokens` (when set) are dropped ([`drop_overlong`]). Without a tie breaker
    /// ([`with_tie_breaker`](Self::with_tie_breaker)) the config must set
    /// `learner.tie_mode = "off"`.
    pub fn new(
        cfg: TrainConfig,
        devices: Vec<B::Device>,
        policy: PolicyParts<B, P>,
        prompts: Vec<T>,
        rewards: impl RewardSource<T> + 'static,
    ) -> Result<Self> {
        first_device::<B>(&devices)?;
        if prompts.is_empty() {
            return Err(TrainerError::NoRecords);
        }
        cfg.learner.validate()?;
        cfg.run.validate()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|e| TrainerError::Setup(format!("starting the async runtime: {e}")))?;
        let (prompts, dropped) = match cfg.data.max_prompt_tokens {
            Some(max) => {
                let (kept, overlong) = prompts::drop_overlong(
                    prompts,
                    policy.codec.as_ref(),
                    max,
                    cfg.data.overlong_prompts,
                )?;
                if let Some(line) = overlong.line(max) {
                    tracing::warn!("{line}");
                }
                (kept, overlong)
            }
            None => {
                if let Some(line) = prompts::over_the_plan(&prompts, policy.codec.as_ref())? {
                    tracing::warn!("{line}");
                }
                (prompts, Overlong::default())
            }
        };
        let describe = format!("{} prompts", prompts.len());
        Ok(Self {
            cfg,
            devices,
            model: Some(policy.model),
            codec: policy.codec,
            stop_ids: policy.stop_ids,
            export: policy.export,
            rollout_weights: policy.rollout_weights,
            task: prompts,
            rewards: Arc::new(rewards),
            tie_breaker: None,
            kernel_warmup_judging: None,
            validator: None,
            registry: None,
            collective: None,
            resume: None,
            kv_pool_blocks: None,
            engine: None,
            kernel_warmup: None,
            runtime: Arc::new(runtime),
            describe,
            dropped,
        })
    }

    /// What `data.max_prompt_tokens` dropped from the task (nothing when unset).
    pub fn dropped_prompts(&self) -> &Overlong {
        &self.dropped
    }

    /// What breaks exact ties (required unless `learner.tie_mode = "off"`).
    pub fn with_tie_breaker(mut self, breaker: impl TieBreaker + 'static) -> Self {
        self.tie_breaker = Some(Arc::new(breaker));
        self
    }

    /// Validation during training (`None`: none).
    pub fn with_validator(mut self, validator: Option<Validator>) -> Self {
        self.validator = validator;
        self
    }

    /// Where `learner.estimator` and `learner.loss` are looked up (an embedder's own entries
    /// beside the built-in ones).
    pub fn with_registry(mut self, registry: Registry<Autodiff<B>>) -> Self {
        self.registry = Some(registry);
        self
    }

    /// The collective of a data-parallel run (default: the host collective; `conrub train`
    /// passes NCCL between CUDA devices).
    pub fn with_collective(mut self, collective: Arc<dyn Collective<B>>) -> Self {
        self.collective = Some(collective);
        self
    }

    /// Continue from a checkpoint directory (`output_dir/checkpoint-NNNNNN`).
    pub fn resume_from(mut self, checkpoint: Option<PathBuf>) -> Self {
        self.resume = checkpoint;
        self
    }

    /// The in-process engine's KV pool in blocks (the memory plan's), unless
    /// `rollout.kv_cache_gb` sets it; unset: every row at full length.
    pub fn with_kv_pool_blocks(mut self, blocks: Option<usize>) -> Self {
        self.kv_pool_blocks = blocks;
        // An engine built before (by the kernel warm-up) had the old pool.
        self.engine = None;
        self
    }

    /// What a stage checks before it trains: `sharding = "full"` with the per-layer backward
    /// it gathers through, and a tie breaker when `learner.tie_mode` needs one.
    pub(crate) fn preflight(&self) -> Result<()> {
        if self.cfg.sharding.shards_parameters()
            && self.devices.len() > 1
            && !self.cfg.learner.system.activation_checkpointing
        {
            return Err(TrainerError::Setup(format!(
                "{}: sharding = \"full\" gathers the parameters one decoder layer at a time in \
                 the per-layer backward: set learner.activation_checkpointing = true (without it \
                 every backward pass would gather the whole model)",
                self.cfg.path.display()
            )));
        }
        let mode = self.cfg.learner.tie_mode;
        if mode != TieMode::Off && self.tie_breaker.is_none() {
            return Err(TrainerError::Setup(format!(
                "learner.tie_mode = {mode:?} needs a tie breaker: call Trainer::with_tie_breaker, \
                 or set learner.tie_mode = \"off\""
            )));
        }
        Ok(())
    }

    /// The run config.
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }

    /// The async runtime the run's judges and servers are called on: a program that needs one
    /// (a reward server client) uses this one instead of starting its own.
    pub fn runtime(&self) -> &Arc<tokio::runtime::Runtime> {
        &self.runtime
    }
}

/// The policy of each rank of a group built from `model`, asked for in rank order: a copy for
/// every rank but the last, which takes `model` itself, so no whole copy outlives the build (a
/// `full` group's ranks then hold a share each).
pub(crate) fn policy_for_ranks<P: Clone>(model: P, ranks: usize) -> impl FnMut(usize) -> P {
    let mut model = Some(model);
    move |rank| {
        let policy = if rank + 1 == ranks {
            model.take()
        } else {
            model.clone()
        };
        policy.expect("ranks are built in order, each once")
    }
}

/// Checks that a run has a device and returns the first.
fn first_device<B: KernelOps>(devices: &[B::Device]) -> Result<B::Device> {
    devices
        .first()
        .cloned()
        .ok_or_else(|| TrainerError::Setup("no device to train on".into()))
}
