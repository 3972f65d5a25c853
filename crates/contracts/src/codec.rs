//! Text side of the policy: prompt rendering and response decoding, so the learner can hand text to
//! judges without knowing the tokenizer.

use conrub_base::Message;

use crate::error::Result;

/// Turns prompts into ids and response ids into text.
pub trait TextCodec: Send + Sync {
    /// Prompt ids for chat messages (with the generation prompt).
    fn encode_prompt(&self, messages: &[Message]) -> Result<Vec<u32>>;
    /// Response text (special tokens such as the stop token dropped).
    fn decode(&self, ids: &[u32]) -> Result<String>;
    /// Ids of plain text, no template and no special tokens added (a reference answer the
    /// supervised warm-up trains on). The default refuses: a codec that only renders chats
    /// cannot warm up.
    fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        let _ = text;
        Err(crate::error::ContractError::Unsupported {
            key: "warmup".into(),
            message: "this policy's codec does not implement TextCodec::encode_text".into(),
        })
    }
}

/// A shared codec is a codec (one per data-parallel rank, one tokenizer).
impl<C: TextCodec + ?Sized> TextCodec for std::sync::Arc<C> {
    fn encode_prompt(&self, messages: &[Message]) -> Result<Vec<u32>> {
        (**self).encode_prompt(messages)
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        (**self).decode(ids)
    }

    fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        (**self).encode_text(text)
    }
}
