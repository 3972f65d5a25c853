//! Supervised fine-tuning before GRPO, the `[warmup]` table: a few cross-entropy steps on the
//! prompts' reference answers (fresh runs only; the offline demo uses it to give a tiny random
//! policy a vocabulary worth rewarding). In the code it is "sft" throughout; "warm-up" alone is
//! the kernel warm-up (`kernel_warmup.rs`) and "lr warm-up" the learning-rate ramp.

use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ElementConversion;
use conrub_contracts::{Policy, TextCodec, TokenBatch};
use conrub_grpo::GrpoError;
use conrub_rewards::TaskPrompt;

/// `(prompt, reference answer + stop token)` ids of every prompt that has a reference answer,
/// each distinct prompt and answer once: the warm-up is one batch over them, and the copies a
/// `[[data.train]]` weight above 1 makes would only grow it (a weight of 1e4 aborted it).
pub fn sft_pairs<T: TaskPrompt>(
    records: &[T],
    codec: &dyn TextCodec,
    stop_ids: &[u32],
) -> conrub_grpo::Result<Vec<(Vec<u32>, Vec<u32>)>> {
    let mut seen = std::collections::HashSet::new();
    records
        .iter()
        .filter_map(|r| r.reference_answer().map(|a| (r, a)))
        .filter(|(r, answer)| seen.insert(format!("{:?}{answer}", r.messages())))
        .map(|(r, answer)| {
            let prompt = codec
                .encode_prompt(r.messages())
                .map_err(|e| GrpoError::Prompt {
                    id: r.id().to_string(),
                    message: codec_message(e),
                })?;
            let mut ids = codec.encode_text(answer).map_err(|e| GrpoError::Prompt {
                id: r.id().to_string(),
                message: format!("reference answer: {}", codec_message(e)),
            })?;
            ids.extend(stop_ids.first());
            Ok((prompt, ids))
        })
        .collect()
}

/// A codec's error without the "prompt" wrapper it carries (the caller names the record).
fn codec_message(e: conrub_contracts::ContractError) -> String {
    match e {
        conrub_contracts::ContractError::Prompt { message, .. } => message,
        other => other.to_string(),
    }
}

/// Runs `steps` AdamW steps (lr `lr`) of mean token cross-entropy on `(prompt, answer)` pairs, all
/// pairs per step; `on_step(done, loss)` is called after each step (for a progress bar). Returns
/// the policy and the loss of each step; a non-finite loss stops it before its step, with an
/// error naming the step ([`GrpoError::NonFinite`]).
pub fn sft_train<B, P>(
    mut policy: P,
    pairs: &[(Vec<u32>, Vec<u32>)],
    steps: usize,
    lr: f64,
    device: &B::Device,
    on_step: &mut dyn FnMut(usize, f64),
) -> conrub_grpo::Result<(P, Vec<f64>)>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
{
    let mut optim = AdamWConfig::new().with_weight_decay(0.0).init::<B, P>();
    let batch = TokenBatch::<B>::new(
        pairs.iter().map(|(p, a)| (p.as_slice(), a.as_slice())),
        device,
    );
    let tokens = pairs.iter().map(|(_, a)| a.len()).sum::<usize>().max(1);
    let mut losses = Vec::with_capacity(steps);
    for done in 1..=steps {
        let loss = policy.response_logprobs(&batch).logprobs.sum().neg() / tokens as f64;
        let value = loss.clone().into_scalar().elem::<f64>();
        if !value.is_finite() {
            return Err(GrpoError::NonFinite {
                at: format!("warm-up step {done}"),
                what: format!("the supervised loss is {value} (warmup.lr is {lr})"),
            });
        }
        losses.push(value);
        let grads = GradientsParams::from_grads(loss.backward(), &policy);
        policy = optim.step(lr, policy, grads);
        on_step(done, value);
    }
    Ok((policy, losses))
}
