//! One module per subcommand.

pub mod allreduce;
pub mod bench;
pub mod distill;
pub mod eval;
pub mod generate;
pub mod judge_pair;
pub mod judging;
pub mod kernel_warmup;
pub mod kernels;
pub mod kernels_compile;
pub mod logprobs;
pub mod plan;
pub mod plot;
pub mod rubrics;
pub mod samples;
pub mod score;
pub mod tokenize;
pub mod train;

use std::path::Path;

use anyhow::{bail, Context, Result};
use conrub_rubric::Message;

/// Refuses an output path that is one of the command's inputs (the same file by any spelling,
/// a link included): writing it would replace what the command reads. Each input comes with
/// the flag that named it, for the message.
pub fn refuse_output_over_inputs(out: &Path, inputs: &[(&str, &Path)]) -> Result<()> {
    let same = |x: &Path, y: &Path| match (x.canonicalize(), y.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => x == y,
    };
    if let Some((flag, _)) = inputs.iter().find(|(_, input)| same(out, input)) {
        bail!(
            "{}: the output is the {flag} file; write it to another file",
            out.display()
        );
    }
    Ok(())
}

/// Refuses `learner.estimator` / `learner.loss` names the built-in registry lacks (an
/// embedder's own names are valid in a config, not for `conrub train` and `conrub plan`), before
/// anything loads.
pub fn check_plugins(cfg: &conrub_config::TrainConfig) -> Result<()> {
    conrub_grpo::Registry::<burn::backend::Flex>::builtin()
        .check_names(&cfg.learner)
        .map_err(|e| anyhow::anyhow!("{}: {e}", cfg.path.display()))
}

/// Prints lines to standard output; a closed pipe (`conrub ... | head`) ends quietly.
pub fn print_lines(lines: impl IntoIterator<Item = String>) -> Result<()> {
    use std::io::Write;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let result = (|| -> std::io::Result<()> {
        for l in lines {
            writeln!(out, "{l}")?;
        }
        out.flush()
    })();
    match result {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

/// Parses `--ids 1,2,3`.
pub fn parse_ids(text: &str) -> Result<Vec<u32>> {
    let ids = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .enumerate()
        .map(|(i, s)| {
            s.parse::<u32>()
                .with_context(|| format!("--ids: item {} (`{s}`) is not a token id", i + 1))
        })
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("--ids: no token ids given");
    }
    Ok(ids)
}

/// Reads a JSON array of `{role, content}` messages.
pub fn read_messages(path: &Path) -> Result<Vec<Message>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let messages: Vec<Message> = serde_json::from_str(&text).with_context(|| {
        format!(
            "{}: expected a JSON array of {{\"role\": ..., \"content\": ...}} messages",
            path.display()
        )
    })?;
    if messages.is_empty() {
        bail!("{}: no messages", path.display());
    }
    Ok(messages)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_parse_and_errors_name_the_item() {
        assert_eq!(parse_ids("1, 2,3").unwrap(), vec![1, 2, 3]);
        let err = parse_ids("1,x").unwrap_err().to_string();
        assert!(err.contains("item 2") && err.contains("`x`"), "{err}");
        assert!(parse_ids(",").is_err());
    }
}
