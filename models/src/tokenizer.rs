//! `tokenizer.json` through the `tokenizers` crate, and the model's Jinja chat template rendered
//! with `minijinja` (Python-compatible string methods enabled) the way `apply_chat_template` does.

use std::path::Path;

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};
use serde::Deserialize;

use crate::error::{ModelError, Result};

/// One chat message (`role`, `content`): the workspace's one message type, shared with rubric
/// records (a record's `question` renders as is).
pub use conrub_base::Message;

/// Options of [`ChatTokenizer::apply_chat_template`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatOptions {
    /// Append the assistant header so the model answers next.
    pub add_generation_prompt: bool,
    /// `Some(false)` renders Qwen3's empty think block (thinking disabled); `None` leaves the
    /// variable undefined, as HF does when the argument is not passed.
    pub enable_thinking: Option<bool>,
}

impl Default for ChatOptions {
    fn default() -> Self {
        Self {
            add_generation_prompt: true,
            enable_thinking: None,
        }
    }
}

/// A tokenizer with its chat template and special tokens (any family's `tokenizer.json` and
/// Jinja template).
#[derive(Clone)]
pub struct ChatTokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    bos_token: Option<String>,
}

#[derive(Deserialize, Default)]
struct TokenizerConfig {
    #[serde(default)]
    chat_template: Option<serde_json::Value>,
    #[serde(default)]
    eos_token: Option<serde_json::Value>,
    #[serde(default)]
    pad_token: Option<serde_json::Value>,
    #[serde(default)]
    bos_token: Option<serde_json::Value>,
}

fn token_string(v: Option<serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(String::from),
        _ => None,
    }
}

impl ChatTokenizer {
    /// Loads `tokenizer.json` and, when present, `tokenizer_config.json` / `chat_template.jinja`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.exists() {
            return Err(ModelError::ModelDir {
                dir: dir.to_path_buf(),
                message: "no tokenizer.json".into(),
            });
        }
        let inner =
            tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| ModelError::Tokenizer {
                context: tok_path.display().to_string(),
                message: e.to_string(),
            })?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: TokenizerConfig = if cfg_path.exists() {
            let text =
                std::fs::read_to_string(&cfg_path).map_err(|e| ModelError::io(&cfg_path, e))?;
            serde_json::from_str(&text).map_err(|source| ModelError::Json {
                path: cfg_path.clone(),
                source,
            })?
        } else {
            TokenizerConfig::default()
        };
        let jinja_path = dir.join("chat_template.jinja");
        let chat_template = if jinja_path.exists() {
            Some(std::fs::read_to_string(&jinja_path).map_err(|e| ModelError::io(&jinja_path, e))?)
        } else {
            match cfg.chat_template {
                Some(serde_json::Value::String(s)) => Some(s),
                // A list of named templates: use the one called "default".
                Some(serde_json::Value::Array(list)) => list.iter().find_map(|t| {
                    (t.get("name")?.as_str()? == "default")
                        .then(|| t.get("template")?.as_str().map(String::from))?
                }),
                _ => None,
            }
        };
        Ok(Self {
            inner,
            chat_template,
            eos_token: token_string(cfg.eos_token),
            pad_token: token_string(cfg.pad_token),
            bos_token: token_string(cfg.bos_token),
        })
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The Jinja chat template, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Encodes text without adding special tokens (special-token strings in the text are parsed).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer {
                context: "encode".into(),
                message: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| ModelError::Tokenizer {
                context: "decode".into(),
                message: e.to_string(),
            })
    }

    /// The id of a token string.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The end-of-sequence id from `tokenizer_config.json` (`<|im_end|>` for Qwen3 chat models).
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_token.as_deref().and_then(|t| self.token_id(t))
    }

    /// The padding id from `tokenizer_config.json`.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad_token.as_deref().and_then(|t| self.token_id(t))
    }

    /// Renders the chat template to text.
    pub fn render_chat(&self, messages: &[Message], opts: ChatOptions) -> Result<String> {
        let template = self.chat_template.as_deref().ok_or_else(|| ModelError::Tokenizer {
            context: "chat template".into(),
            message: "the tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)".into(),
        })?;
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<Value, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
            },
        );
        let jinja_err = |e: JinjaError| ModelError::Tokenizer {
            context: "chat template".into(),
            message: format!("{e:#}"),
        };
        env.add_template("chat", template).map_err(jinja_err)?;
        let tmpl = env.get_template("chat").map_err(jinja_err)?;
        let mut ctx = serde_json::Map::new();
        ctx.insert(
            "messages".into(),
            serde_json::to_value(messages).expect("messages serialise"),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            opts.add_generation_prompt.into(),
        );
        if let Some(t) = opts.enable_thinking {
            ctx.insert("enable_thinking".into(), t.into());
        }
        for (k, v) in [
            ("eos_token", &self.eos_token),
            ("pad_token", &self.pad_token),
            ("bos_token", &self.bos_token),
        ] {
            if let Some(v) = v {
                ctx.insert(k.into(), v.clone().into());
            }
        }
        tmpl.render(Value::from_serialize(&ctx)).map_err(jinja_err)
    }

    /// Renders the chat template and encodes it, like HF's `apply_chat_template(tokenize=True)`.
    pub fn apply_chat_template(&self, messages: &[Message], opts: ChatOptions) -> Result<Vec<u32>> {
        self.encode(&self.render_chat(messages, opts)?)
    }
}
