//! Text side of the policy: prompt rendering and response decoding, so the learner can hand text to
//! judges without knowing the tokenizer.

use conrub_qwen3::{ChatOptions, Qwen3Tokenizer};
use conrub_rubric::Message;

use crate::error::{GrpoError, Result};

/// Turns prompts into ids and response ids into text.
pub trait TextCodec: Send + Sync {
    /// Prompt ids for chat messages (with the generation prompt).
    fn encode_prompt(&self, messages: &[Message]) -> Result<Vec<u32>>;
    /// Response text (special tokens such as the stop token dropped).
    fn decode(&self, ids: &[u32]) -> Result<String>;
}

/// The Qwen3 tokenizer and chat template; `enable_thinking` is passed to the template (`Some(false)`
/// for thinking-disabled policies such as Qwen3-4B-Instruct runs).
#[derive(Clone)]
pub struct ChatTemplateCodec {
    /// The tokenizer.
    pub tokenizer: Qwen3Tokenizer,
    /// Passed to the chat template.
    pub enable_thinking: Option<bool>,
}

impl TextCodec for ChatTemplateCodec {
    fn encode_prompt(&self, messages: &[Message]) -> Result<Vec<u32>> {
        self.tokenizer
            .apply_chat_template(
                messages,
                ChatOptions {
                    add_generation_prompt: true,
                    enable_thinking: self.enable_thinking,
                },
            )
            .map_err(|e| GrpoError::Prompt {
                id: String::new(),
                message: e.to_string(),
            })
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| GrpoError::Decode(e.to_string()))
    }
}
