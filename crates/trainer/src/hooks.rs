//! What the training loop calls back: checkpoints exported by the policy's writer, plots drawn
//! after each checkpoint, progress lines on stderr.

use std::path::Path;
use std::sync::Arc;

use conrub_contracts::{Export, KernelWarmupLine, MetricsLine};
use conrub_grpo::{GrpoError, RunHooks};

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

    fn export(&mut self, policy: &P, dir: &Path) -> conrub_grpo::Result<()> {
        Ok(self.export.export(policy, dir)?)
    }

    fn export_dtype(&self) -> Option<burn::tensor::DType> {
        self.export.matrix_dtype()
    }

    fn progress(&mut self, line: &str) {
        tracing::info!("{line}");
    }

    fn checkpointed(&mut self, run_dir: &Path, _checkpoint: &Path) -> conrub_grpo::Result<()> {
        conrub_plot::plot_run(run_dir).map_err(|e| GrpoError::Hook(Box::new(e)))?;
        Ok(())
    }
}
