//! Text side of the policy: prompt rendering and response decoding, so the learner can hand text to
//! judges without knowing the tokenizer.

use conrub_qwen3::{ChatMessage, ChatOptions, Qwen3Tokenizer};
use conrub_rubric::Message;

/// Turns prompts into ids and response ids into text.
pub trait TextCodec: Send + Sync {
    /// Prompt ids for chat messages (with the generation prompt).
    fn encode_prompt(&self, messages: &[Message]) -> Result<Vec<u32>, String>;
    /// Response text (special tokens such as the stop token dropped).
    fn decode(&self, ids: &[u32]) -> Result<String, String>;
}

/// The Qwen3 tokenizer and chat template; `enable_thinking` is passed to the template (`Some(false)`
/// for thinking-disabled policies such as Qwen3-4B-Instruct runs).
pub struct ChatTemplateCodec {
    /// The tokenizer.
    pub tokenizer: Qwen3Tokenizer,
    /// Passed to the chat template.
    pub enable_thinking: Option<bool>,
}

impl TextCodec for ChatTemplateCodec {
    fn encode_prompt(&self, messages: &[Message]) -> Result<Vec<u32>, String> {
        let msgs: Vec<ChatMessage> = messages.iter().map(|m| ChatMessage::new(&m.role, &m.content)).collect();
        self.tokenizer
            .apply_chat_template(&msgs, ChatOptions { add_generation_prompt: true, enable_thinking: self.enable_thinking })
            .map_err(|e| e.to_string())
    }

    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.tokenizer.decode(ids, true).map_err(|e| e.to_string())
    }
}
