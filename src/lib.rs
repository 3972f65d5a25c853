//! The `conrub` command-line tool: argument parsing and wiring, with the work in the crates.
//! `src/main.rs` only calls [`main`].
//!
//! The commands live in this library rather than in the binary so that the integration tests,
//! which link it, reuse its instantiations of the backends (Flex, wgpu, their autodiff) instead of
//! compiling them again: on CI's two cores that saves minutes. It is not an API for embedding;
//! programs that embed the learner, the judges or the model use those crates directly.

/// `println!` that never panics: a line to a closed stdout (`conrub ... | head`) is dropped
/// (see [`write_out`]).
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::write_out(false, format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` that never panics (see [`outln!`]).
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::write_out(false, format_args!($($arg)*))
    };
}

/// `eprintln!` that never panics: a line to a closed stderr is dropped.
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::write_out(true, format_args!("{}\n", format_args!($($arg)*)))
    };
}

mod backend;
mod commands;
mod logging;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// Rubric-reward RL post-training of Qwen3, Llama 3.x and Qwen2.5 policies on burn.
#[derive(Parser)]
#[command(name = "conrub", version, about)]
struct Cli {
    /// Where compiled kernels and autotune results are kept on the CubeCL backends (cuda, wgpu):
    /// one folder per device and conrub build inside it. Overrides a train config's
    /// `kernel_cache`; default `~/.cache/conrub/kernels` ($XDG_CACHE_HOME/conrub/kernels).
    #[arg(long, global = true, value_name = "DIR", env = "CONRUB_KERNEL_CACHE")]
    kernel_cache: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation with a model (Qwen3, Llama 3.x or Qwen2.5).
    Generate(commands::generate::GenerateArgs),
    /// Teacher-forced log-probabilities and per-position argmax of a token sequence.
    Logprobs(commands::logprobs::LogprobsArgs),
    /// Tokenize text or chat messages with a model's tokenizer and chat template.
    Tokenize(commands::tokenize::TokenizeArgs),
    /// Validate or import rubric files.
    #[command(subcommand)]
    Rubrics(commands::rubrics::RubricsCommand),
    /// Judge responses against their rubrics and write rewards.
    Score(commands::score::ScoreArgs),
    /// Compare two responses with the pairwise judge in both orders.
    JudgePair(commands::judge_pair::JudgePairArgs),
    /// Build judges: `judge distill` trains a probe judge on a big judge's verdicts.
    #[command(subcommand)]
    Judge(commands::distill::JudgeCommand),
    /// Train a policy (Qwen3, Llama 3.x or Qwen2.5) with GRPO on rubric rewards.
    Train(commands::train::TrainArgs),
    /// Predict the peak device memory of a train config and the largest micro-batch and rollout
    /// call that fit.
    Plan(commands::plan::PlanArgs),
    /// Evaluate a model on benchmarks.
    #[command(subcommand)]
    Eval(commands::eval::EvalCommand),
    /// conrub's side of the GPU benchmark against PyTorch (benches/gpu/): one training step or
    /// one rollout at a Qwen3 shape, as a JSON line.
    #[command(subcommand)]
    Bench(commands::bench::BenchCommand),
    /// Check the fused GRPO kernels on a device against true-f32 references and time them.
    KernelsCheck(commands::kernels::KernelsArgs),
    /// Compile and autotune the kernels of a train config's steps into the kernel cache (a dry
    /// step of the run's shapes), so that its first step compiles nothing.
    KernelsWarmup(commands::kernel_warmup::KernelsWarmupArgs),
    /// Compile every CubeCL kernel for an NVIDIA architecture without a GPU (NVRTC, ptxas) and
    /// report registers, spills, shared memory and occupancy.
    KernelsCompile(commands::kernels_compile::KernelsCompileArgs),
    /// Check and time the data-parallel gradient all-reduce between devices (NCCL on CUDA)
    /// against the host sum.
    AllreduceCheck(commands::allreduce::AllreduceArgs),
    /// Draw a run's curves (reward, tie rate, accepted pairs, response length) from its
    /// metrics.jsonl into the run directory.
    Plot(commands::plot::PlotArgs),
    /// Print a step's rollouts (prompt, responses, rewards and their parts, labels, tie
    /// verdicts, advantages) or a validation round's answers from the run's samples/ folder.
    Samples(commands::samples::SamplesArgs),
}

fn run(cli: Cli) -> Result<()> {
    logging::install()?;
    // Counts CubeCL's compilations and autotune runs (metrics lines, the closing report).
    conrub_kernels::events::install();
    backend::set_kernel_cache_flag(cli.kernel_cache);
    run_command(cli.command)?;
    backend::report_kernel_events();
    Ok(())
}

fn run_command(command: Command) -> Result<()> {
    match command {
        Command::Generate(args) => commands::generate::run(args),
        Command::Logprobs(args) => commands::logprobs::run(args),
        Command::Tokenize(args) => commands::tokenize::run(args),
        Command::Rubrics(cmd) => commands::rubrics::run(cmd),
        Command::Score(args) => commands::score::run(args),
        Command::JudgePair(args) => commands::judge_pair::run(args),
        Command::Judge(cmd) => commands::distill::run(cmd),
        Command::Train(args) => commands::train::run(args),
        Command::Plan(args) => commands::plan::run(args),
        Command::Eval(cmd) => commands::eval::run(cmd),
        Command::KernelsCheck(args) => commands::kernels::run(args),
        Command::Bench(cmd) => commands::bench::run(cmd),
        Command::KernelsWarmup(args) => commands::kernel_warmup::run_command(args),
        Command::KernelsCompile(args) => commands::kernels_compile::run(args),
        Command::AllreduceCheck(args) => commands::allreduce::run(args),
        Command::Plot(args) => commands::plot::run(args),
        Command::Samples(args) => commands::samples::run(args),
    }
}

/// Writes to stdout (or stderr) without panicking: `conrub train ... | head -3` or a dead `tee`
/// must not kill a run, and `rubrics validate --json | head -c 10` must not print a panic. A
/// closed pipe drops what is written; another error (a full disk under `> file`) is said once on
/// stderr, since nothing else can report it.
fn write_out(stderr: bool, args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};
    static SAID: AtomicBool = AtomicBool::new(false);
    let result = if stderr {
        std::io::stderr().lock().write_fmt(args)
    } else {
        std::io::stdout().lock().write_fmt(args)
    };
    match result {
        Err(e)
            if e.kind() != std::io::ErrorKind::BrokenPipe
                && !SAID.swap(true, Ordering::Relaxed) =>
        {
            let which = if stderr { "stderr" } else { "stdout" };
            let _ = writeln!(std::io::stderr(), "warning: writing to {which} failed: {e}");
        }
        _ => {}
    }
}

/// Parses the command line, runs the command and prints any error with its context chain.
pub fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The whole chain on one line, no backtrace for user errors. Library errors repeat
            // their source's message in their own (so `to_string` alone is complete): a cause
            // whose text is already in the line is not printed twice.
            let mut line = String::new();
            for cause in e.chain() {
                let text = cause.to_string();
                if !line.contains(&text) {
                    if !line.is_empty() {
                        line.push_str(": ");
                    }
                    line.push_str(&text);
                }
            }
            errln!("error: {line}");
            ExitCode::FAILURE
        }
    }
}
