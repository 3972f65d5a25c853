//! `conrub eval`: benchmarks on our generation engine.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::tensor::backend::Backend;
use clap::{Args, Subcommand};
use conrub_eval::{extract_choice, load_items, McqFormat, McqSummary};
use conrub_qwen3::{ChatMessage, ChatOptions, Qwen3, SamplingConfig};
use conrub_rubric::io::{write_bytes_atomic, write_jsonl_atomic};
use serde_json::json;

use crate::backend::{run_on_device, BackendTask};

/// `conrub eval ...`.
#[derive(Subcommand)]
pub enum EvalCommand {
    /// Multiple-choice accuracy (MedMCQA, PubMedQA, MMLU) under greedy decoding.
    Mcq(McqArgs),
}

/// Arguments of `eval mcq`.
#[derive(Args, Clone)]
pub struct McqArgs {
    /// Questions (JSONL).
    #[arg(long)]
    pub data: PathBuf,
    /// Row format: medmcqa, pubmedqa, mmlu.
    #[arg(long)]
    pub format: String,
    /// Model directory (a training checkpoint works as is) or hub id.
    #[arg(long)]
    pub model: String,
    /// Longest answer in tokens.
    #[arg(long, default_value_t = 512)]
    pub max_new_tokens: usize,
    /// Questions generated together.
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Evaluate only the first N questions.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Output directory: `report.json` and `examples.jsonl`.
    #[arg(long, default_value = "runs/eval")]
    pub out: PathBuf,
    /// Device.
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

/// Runs an `eval` subcommand.
pub fn run(cmd: EvalCommand) -> Result<()> {
    match cmd {
        EvalCommand::Mcq(a) => {
            let device = a.device.clone();
            run_on_device(&device, a)
        }
    }
}

impl BackendTask for McqArgs {
    fn run<B: Backend>(self, device: B::Device) -> Result<()> {
        let format: McqFormat = self.format.parse().map_err(anyhow::Error::msg).context("--format")?;
        let text = std::fs::read_to_string(&self.data).with_context(|| format!("cannot read {}", self.data.display()))?;
        let mut items = load_items(format, &text).map_err(anyhow::Error::msg).with_context(|| self.data.display().to_string())?;
        if let Some(n) = self.limit {
            items.truncate(n);
        }
        if items.is_empty() {
            bail!("{}: no questions", self.data.display());
        }
        let qwen = Qwen3::<B>::load(&self.model, &device)?;
        let tok = qwen.tokenizer.as_ref().with_context(|| format!("{}: no tokenizer.json", qwen.dir.display()))?;
        let cfg = SamplingConfig { max_new_tokens: self.max_new_tokens, greedy: true, stop_ids: qwen.stop_ids(), ..Default::default() };
        let start = Instant::now();
        let mut rows = Vec::with_capacity(items.len());
        let mut answers = Vec::with_capacity(items.len());
        let mut generated = 0usize;
        for chunk in items.chunks(self.batch_size.max(1)) {
            let prompts: Vec<Vec<u32>> = chunk
                .iter()
                .map(|it| tok.apply_chat_template(&[ChatMessage::new("user", &it.prompt)], ChatOptions { add_generation_prompt: true, enable_thinking: Some(false) }))
                .collect::<Result<_, _>>()?;
            for (it, g) in chunk.iter().zip(qwen.generate(&prompts, &cfg, &device)?) {
                let response = tok.decode(&g.tokens, true)?;
                let labels: Vec<&str> = it.labels.iter().map(String::as_str).collect();
                let extracted = extract_choice(&response, &labels);
                generated += g.tokens.len();
                answers.push((extracted, it.gold));
                rows.push(json!({
                    "id": it.id,
                    "subject": it.subject,
                    "gold": it.labels[it.gold],
                    "extracted": extracted.map(|i| it.labels[i].clone()),
                    "correct": extracted == Some(it.gold),
                    "response": response,
                    "response_tokens": g.tokens.len(),
                }));
            }
            eprintln!("{}/{} questions", rows.len(), items.len());
        }
        let summary = McqSummary::from_answers(&answers);
        let secs = start.elapsed().as_secs_f64();
        let report = json!({
            "kind": "mcq",
            "format": self.format,
            "data": self.data.display().to_string(),
            "model": self.model,
            "settings": {"decoding": "greedy", "max_new_tokens": self.max_new_tokens, "enable_thinking": false},
            "summary": summary,
            "timings": {"seconds": secs, "generated_tokens": generated, "tokens_per_second": generated as f64 / secs.max(1e-9)},
        });
        std::fs::create_dir_all(&self.out).with_context(|| self.out.display().to_string())?;
        write_jsonl_atomic(&self.out.join("examples.jsonl"), &rows)?;
        write_bytes_atomic(&self.out.join("report.json"), serde_json::to_string_pretty(&report)?.as_bytes())?;
        println!(
            "{}: accuracy {:.2}% (95% CI {:.2}-{:.2}%) on {} questions, {} invalid ({:.1}%); report {}",
            self.format,
            100.0 * summary.accuracy,
            100.0 * summary.ci95.0,
            100.0 * summary.ci95.1,
            summary.n,
            summary.invalid,
            100.0 * summary.invalid_rate,
            self.out.join("report.json").display()
        );
        Ok(())
    }
}
