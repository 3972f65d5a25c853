//! Loads a Qwen3 model directory (or hub id) and answers one question with the chat template.
//!
//! ```text
//! cargo run --release --example generate -- <model-dir-or-hub-id> "What is the first-line treatment of anaphylaxis?"
//! ```
//!
//! Written against `B: KernelOps` (burn's `Backend` plus conrub's fused kernels, implemented for every
//! burn backend), so the same function runs on any burn backend; `main` picks the
//! default CPU backend.

use conrub_kernels::KernelOps;
use conrub_models::{ChatOptions, Message, Pretrained};
use conrub_rollout::{Decoding, SamplingConfig, SamplingParams};

fn answer<B: KernelOps>(
    model: &str,
    question: &str,
    device: &B::Device,
) -> Result<(), Box<dyn std::error::Error>> {
    let qwen = Pretrained::<B>::load(model, device)?;
    let tokenizer = qwen
        .tokenizer
        .as_ref()
        .ok_or("the model directory has no tokenizer.json")?;
    let prompt = tokenizer.apply_chat_template(
        &[Message::user(question)],
        ChatOptions {
            add_generation_prompt: true,
            enable_thinking: Some(false),
        },
    )?;
    let cfg = SamplingConfig {
        decoding: Decoding::Sample(SamplingParams {
            temperature: 0.7,
            top_p: 0.8,
            top_k: Some(20),
            min_p: 0.0,
            repetition_penalty: 1.0,
        }),
        max_new_tokens: 256,
        seed: 1234,
        stop_ids: qwen.stop_ids(),
        first_stream: 0,
    };
    let out = qwen.generate(&[prompt], &cfg, device)?.remove(0);
    println!("{}", tokenizer.decode(&out.tokens, true)?);
    let mean_lp = out.logprobs.iter().sum::<f32>() / out.logprobs.len().max(1) as f32;
    eprintln!(
        "{} tokens, finish reason {:?}, mean log-prob {mean_lp:.3}",
        out.tokens.len(),
        out.finish_reason
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(model), Some(question)) = (args.next(), args.next()) else {
        eprintln!("usage: generate <model-dir-or-hub-id> <question>");
        std::process::exit(2);
    };
    answer::<burn::backend::Flex>(&model, &question, &Default::default())
}
