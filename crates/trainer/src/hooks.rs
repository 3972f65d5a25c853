//! What the training loop asks of its caller ([`RunHooks`]), and `conrub train`'s answers:
//! checkpoints exported by the policy's writer, plots drawn after each checkpoint.

use std::path::Path;
use std::sync::Arc;

use burn::tensor::DType;
use conrub_contracts::{Export, KernelWarmupLine, MetricsLine};

use crate::error::Result;
use crate::sinks::RunSink;

/// What the training loop asks of its caller.
pub trait RunHooks<P> {
    /// Writes `policy` in its deployable format into `dir` (a Hugging Face directory for the `conrub_models` families);
    /// the training state goes into `dir/training_state` next to it.
    fn export(&mut self, policy: &P, dir: &Path) -> Result<()>;
    /// The dtype [`RunHooks::export`] writes weight matrices in, when narrower than the
    /// policy's (see `conrub_contracts::Export::matrix_dtype`); `None` by default.
    fn export_dtype(&self) -> Option<DType> {
        None
    }
    /// Outputs of the run besides the built-in ones ([`default_sinks`](crate::sinks::default_sinks)),
    /// asked once when the run opens its folder; they hear every event after the built-in ones.
    fn sinks(&mut self) -> Vec<Box<dyn RunSink>> {
        Vec::new()
    }
    /// Lines written to `metrics.jsonl` once it is opened, before the first step (the binary's
    /// kernel warm-up line).
    fn opening_lines(&mut self) -> Vec<MetricsLine> {
        Vec::new()
    }
    /// Called after every checkpoint (the periodic ones and the last) with the run directory,
    /// whose `metrics.jsonl` is complete up to that step: where `conrub train` draws its curves.
    /// With `run.checkpoint_in_background` it comes once the checkpoint is in place: at the
    /// first step boundary after its seal is done (or at the next save, or the run's end).
    fn checkpointed(&mut self, _run_dir: &Path, _checkpoint: &Path) -> Result<()> {
        Ok(())
    }
}

/// The run's hooks.
pub(crate) struct Hooks<P> {
    pub export: Arc<dyn Export<P>>,
    /// The kernel warm-up's line, written once `metrics.jsonl` is open.
    pub kernel_warmup: Option<KernelWarmupLine>,
}

impl<P> RunHooks<P> for Hooks<P> {
    fn opening_lines(&mut self) -> Vec<MetricsLine> {
        self.kernel_warmup
            .take()
            .map(MetricsLine::KernelWarmup)
            .into_iter()
            .collect()
    }

    fn export(&mut self, policy: &P, dir: &Path) -> Result<()> {
        Ok(self.export.export(policy, dir)?)
    }

    fn export_dtype(&self) -> Option<DType> {
        self.export.matrix_dtype()
    }

    /// Redraws the plots; a plot that fails is a warning, never the end of a run.
    fn checkpointed(&mut self, run_dir: &Path, _checkpoint: &Path) -> Result<()> {
        if let Err(e) = conrub_plot::plot_run(run_dir) {
            tracing::warn!("{}: the plots were not redrawn: {e}", run_dir.display());
        }
        Ok(())
    }
}
