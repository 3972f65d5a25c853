//! The [`TextCodec`] of every family: its tokenizer and chat template.

use conrub_base::Message;
use conrub_contracts::{ContractError, TextCodec};

use crate::tokenizer::{ChatOptions, ChatTokenizer};

/// A model's tokenizer and chat template; `enable_thinking` is passed to the template (`Some(false)`
/// for thinking-disabled policies such as Qwen3-4B-Instruct runs; templates without the variable
/// ignore it).
#[derive(Clone)]
pub struct ChatTemplateCodec {
    /// The tokenizer.
    pub tokenizer: ChatTokenizer,
    /// Passed to the chat template.
    pub enable_thinking: Option<bool>,
}

impl TextCodec for ChatTemplateCodec {
    fn encode_prompt(&self, messages: &[Message]) -> conrub_contracts::Result<Vec<u32>> {
        self.tokenizer
            .apply_chat_template(
                messages,
                ChatOptions {
                    add_generation_prompt: true,
                    enable_thinking: self.enable_thinking,
                },
            )
            .map_err(|e| ContractError::Prompt {
                id: String::new(),
                message: e.to_string(),
            })
    }

    fn encode_text(&self, text: &str) -> conrub_contracts::Result<Vec<u32>> {
        self.tokenizer
            .encode(text)
            .map_err(|e| ContractError::Prompt {
                id: String::new(),
                message: e.to_string(),
            })
    }

    fn decode(&self, ids: &[u32]) -> conrub_contracts::Result<String> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| ContractError::Decode(e.to_string()))
    }
}
