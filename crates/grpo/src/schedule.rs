//! Learning-rate schedules (`learner.lr_schedule`), counted in optimizer steps.
//!
//! With base rate `lr`, warm-up `W` optimizer steps, horizon `T` optimizer steps (the run's
//! training steps x `ppo_epochs` x `mini_batches`) and floor ratio `r = min_lr_ratio`, the
//! optimizer step numbered `k` (0-based over the whole run) takes:
//!
//! - `k < W`: `lr * (k + 1) / W` (a linear ramp; its first step is not wasted at rate 0 and its
//!   last reaches `lr`);
//! - otherwise, with progress `p = min(1, (k - W) / max(1, T - W - 1))` (1 at the run's last
//!   optimizer step, `k = T - 1`):
//!   - `constant`: `lr`;
//!   - `linear`: `lr * (r + (1 - r) * (1 - p))`;
//!   - `cosine`: `lr * (r + (1 - r) * (1 + cos(pi * p)) / 2)`.
//!
//! `learner.lr_warmup_ratio` sets `W = ceil(ratio * T)`. `T` counts `ppo_epochs x mini_batches`
//! optimizer steps a training step; a step that takes fewer (one whose judge scored too few
//! responses takes none; a mini-batch count above the step's responses takes as many as there are
//! responses) leaves the run's last rates above the floor. Every optimizer step counts, one
//! dropped for a non-finite gradient (`on_nonfinite = "skip-step"`) included, and the count is
//! saved with the training state, so a resumed run continues the schedule where it stopped.

use conrub_contracts::{LearnerConfig, LrScheduleKind};

use crate::error::{GrpoError, Result};

/// A learning-rate schedule: the rate of each optimizer step of a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// The shape after the warm-up.
    pub kind: LrScheduleKind,
    /// The peak rate (`learner.lr`).
    pub base: f64,
    /// Optimizer steps of the linear warm-up.
    pub lr_warmup: u64,
    /// Optimizer steps of the whole run (the horizon the decay ends at); 0 when unknown, which
    /// only `constant` without `lr_warmup_ratio` accepts.
    pub total: u64,
    /// The decay's floor as a share of `base`.
    pub min_ratio: f64,
}

impl LrSchedule {
    /// `cfg`'s schedule over a run of `training_steps` steps (each `ppo_epochs x
    /// mini_batches` optimizer steps), or of unknown length (`None`: an error for a schedule
    /// that needs it, naming the key).
    pub fn new(cfg: &LearnerConfig, training_steps: Option<u64>) -> Result<Self> {
        let per_step = (cfg.ppo_epochs * cfg.mini_batches) as u64;
        let total = training_steps.map(|n| n * per_step);
        let needs = |key: &str, what: &str| {
            GrpoError::config(
                format!("learner.{key}"),
                format!(
                    "{what} needs the run's length: call Learner::set_training_steps \
                     (conrub_trainer::train does)"
                ),
            )
        };
        if cfg.optimizer.lr_schedule != LrScheduleKind::Constant && total.is_none() {
            return Err(needs("lr_schedule", cfg.optimizer.lr_schedule.name()));
        }
        let lr_warmup = match (cfg.optimizer.lr_warmup_steps, cfg.optimizer.lr_warmup_ratio) {
            (Some(steps), _) => steps as u64,
            (None, Some(ratio)) => {
                let total = total.ok_or_else(|| needs("lr_warmup_ratio", "a warm-up ratio"))?;
                (ratio * total as f64).ceil() as u64
            }
            (None, None) => 0,
        };
        Ok(Self {
            kind: cfg.optimizer.lr_schedule,
            base: cfg.optimizer.lr,
            lr_warmup,
            total: total.unwrap_or(0),
            min_ratio: cfg.optimizer.min_lr_ratio,
        })
    }

    /// A constant rate, no warm-up.
    pub fn constant(lr: f64) -> Self {
        Self {
            kind: LrScheduleKind::Constant,
            base: lr,
            lr_warmup: 0,
            total: 0,
            min_ratio: 0.0,
        }
    }

    /// The rate of optimizer step `k` (0-based over the run).
    pub fn lr(&self, k: u64) -> f64 {
        if k < self.lr_warmup {
            return self.base * (k + 1) as f64 / self.lr_warmup as f64;
        }
        let span = self.total.saturating_sub(self.lr_warmup + 1).max(1);
        let p = ((k - self.lr_warmup) as f64 / span as f64).min(1.0);
        let r = self.min_ratio;
        let factor = match self.kind {
            LrScheduleKind::Constant => 1.0,
            LrScheduleKind::Linear => r + (1.0 - r) * (1.0 - p),
            LrScheduleKind::Cosine => {
                r + (1.0 - r) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
            }
        };
        self.base * factor
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::learner::OptimizerSettings;

    fn cfg(kind: LrScheduleKind) -> LearnerConfig {
        LearnerConfig {
            ppo_epochs: 2,
            mini_batches: 2,
            optimizer: OptimizerSettings {
                lr: 1e-3,
                lr_schedule: kind,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// The rates by hand: 10 training steps x 4 optimizer steps = 40 (k = 0..=39), warm-up 5,
    /// so the decay spans k = 5..=39 over 34 steps.
    #[test]
    fn rates_follow_the_documented_formulas() {
        let mut c = cfg(LrScheduleKind::Cosine);
        c.optimizer.lr_warmup_steps = Some(5);
        c.optimizer.min_lr_ratio = 0.1;
        let s = LrSchedule::new(&c, Some(10)).unwrap();
        assert_eq!((s.lr_warmup, s.total), (5, 40));
        let close = |a: f64, b: f64| assert!((a - b).abs() < 1e-15, "{a} vs {b}");
        close(s.lr(0), 0.2e-3);
        close(s.lr(4), 1e-3);
        close(s.lr(5), 1e-3);
        // Half-way through the decay (k = 5 + 17): the cosine is at 0, so r + (1 - r) / 2.
        close(s.lr(22), 1e-3 * (0.1 + 0.9 * 0.5));
        // The run's last optimizer step is at the floor, and so is anything after it.
        close(s.lr(39), 1e-4);
        close(s.lr(400), 1e-4);
        let mut l = cfg(LrScheduleKind::Linear);
        l.optimizer.lr_warmup_ratio = Some(0.1);
        let s = LrSchedule::new(&l, Some(10)).unwrap();
        assert_eq!(s.lr_warmup, 4);
        close(s.lr(13), 1e-3 * (1.0 - 9.0 / 35.0));
        close(s.lr(39), 0.0);
        let s = LrSchedule::new(&cfg(LrScheduleKind::Constant), None).unwrap();
        assert!((0..100).all(|k| s.lr(k) == 1e-3));
    }

    #[test]
    fn schedules_that_need_the_run_length_say_so() {
        let e = LrSchedule::new(&cfg(LrScheduleKind::Cosine), None).unwrap_err();
        assert_eq!(
            e.to_string(),
            "learner.lr_schedule: cosine needs the run's length: call \
             Learner::set_training_steps (conrub_trainer::train does)"
        );
        let mut c = cfg(LrScheduleKind::Constant);
        c.optimizer.lr_warmup_ratio = Some(0.5);
        let e = LrSchedule::new(&c, None).unwrap_err().to_string();
        assert!(
            e.starts_with("learner.lr_warmup_ratio: a warm-up ratio needs"),
            "{e}"
        );
    }
}
