//! `conrub tokenize`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use conrub_models::{resolve_model_dir, ChatOptions, ChatTokenizer};

/// Arguments of `conrub tokenize`.
#[derive(Args)]
#[command(group = clap::ArgGroup::new("input").required(true).args(["text", "messages"]))]
pub struct TokenizeArgs {
    /// Model directory (tokenizer files suffice) or hub id.
    #[arg(long)]
    pub model: String,
    /// Raw text, encoded without a chat template.
    #[arg(long)]
    pub text: Option<String>,
    /// JSON file with chat messages, rendered with the chat template and a generation prompt.
    #[arg(long)]
    pub messages: Option<PathBuf>,
    /// Render the template with `enable_thinking=False`.
    #[arg(long)]
    pub no_thinking: bool,
    /// Print `{"ids": [...]}`.
    #[arg(long)]
    pub json: bool,
}

/// Runs the command.
pub fn run(args: TokenizeArgs) -> Result<()> {
    let dir = resolve_model_dir(&args.model)?;
    let tok = ChatTokenizer::from_dir(&dir)?;
    let ids = match (&args.text, &args.messages) {
        (Some(text), _) => tok.encode(text)?,
        (None, Some(path)) => {
            let messages = super::read_messages(path)?;
            let opts = ChatOptions {
                add_generation_prompt: true,
                enable_thinking: args.no_thinking.then_some(false),
            };
            tok.apply_chat_template(&messages, opts)?
        }
        (None, None) => unreachable!("clap requires one input"),
    };
    if args.json {
        outln!("{}", serde_json::json!({ "ids": ids }));
    } else {
        outln!(
            "{}",
            ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
        );
    }
    Ok(())
}
