//! The closing lines of a run on stderr.

use std::path::Path;

/// The closing lines: one per epoch, then where everything went.
pub fn report(summary: &crate::run_loop::RunSummary, output_dir: &Path) {
    for e in &summary.epochs {
        tracing::info!(
            "epoch {}: {} steps, reward {:+.3}, ties {}/{} ({} accepted, {} same, {} order flips, {} invalid), mean length {:.1}",
            e.epoch,
            e.steps,
            e.reward_mean,
            e.ties.tied_groups,
            e.ties.groups,
            e.ties.accepted,
            e.ties.same,
            e.ties.order_flips,
            e.ties.invalid,
            e.response_len_mean
        );
    }
    if let Some(b) = &summary.best {
        tracing::info!(
            "best checkpoint by the grader: {} (step {}, score {:+.4} ± {:.4}; {})",
            b.checkpoint.display(),
            b.step,
            b.grader_score,
            b.grader_score_std,
            crate::run_folder::best_checkpoint_path(output_dir).display()
        );
    }
    tracing::info!(
        "done: {} steps ({} this run); metrics {}, plots in {}, checkpoint {}",
        summary.total_steps,
        summary.steps_run,
        output_dir.join("metrics.jsonl").display(),
        output_dir.display(),
        summary
            .last_checkpoint
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    );
}
