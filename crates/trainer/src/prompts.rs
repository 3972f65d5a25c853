//! The run's prompts before the first step: those longer than `data.max_prompt_tokens` once
//! rendered with the policy's chat template are dropped and counted (verl's
//! `filter_overlong_prompts`), or stop the run (`data.overlong_prompts = "error"`).

use conrub_config::OverlongPrompts;
use conrub_contracts::TextCodec;
use conrub_grpo::GrpoError;
use conrub_rewards::TaskPrompt;

use crate::error::Result;

/// What [`drop_overlong`] dropped.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Overlong {
    /// Prompts dropped.
    pub dropped: usize,
    /// Prompts read.
    pub of: usize,
    /// The longest one's length in tokens.
    pub longest: usize,
    /// The first few dropped ids.
    pub ids: Vec<String>,
}

/// `prompts` without those longer than `max` tokens as `codec` renders them (in order), and
/// what was dropped; with `OverlongPrompts::Error` the first such prompt is an error naming it.
pub fn drop_overlong<T: TaskPrompt>(
    prompts: Vec<T>,
    codec: &dyn TextCodec,
    max: usize,
    policy: OverlongPrompts,
) -> Result<(Vec<T>, Overlong)> {
    let mut report = Overlong {
        of: prompts.len(),
        ..Default::default()
    };
    let mut kept = Vec::with_capacity(prompts.len());
    for p in prompts {
        let len = codec.encode_prompt(p.messages())?.len();
        if len <= max {
            kept.push(p);
            continue;
        }
        if policy == OverlongPrompts::Error {
            return Err(GrpoError::config(
                "data.max_prompt_tokens",
                format!(
                    "prompt {} renders to {len} tokens, over {max} (data.overlong_prompts = \"drop\" drops such prompts)",
                    p.id()
                ),
            )
            .into());
        }
        report.dropped += 1;
        report.longest = report.longest.max(len);
        if report.ids.len() < 5 {
            report.ids.push(p.id().to_string());
        }
    }
    if kept.is_empty() {
        return Err(GrpoError::config(
            "data.max_prompt_tokens",
            format!(
                "every one of the {} prompts is longer than {max} tokens",
                report.of
            ),
        )
        .into());
    }
    Ok((kept, report))
}

/// Without `data.max_prompt_tokens` the memory plan assumes prompts of at most
/// [`conrub_memory::DEFAULT_MAX_PROMPT_TOKENS`] tokens: a longer prompt is said at load, naming
/// it, rather than found as a stall or an out-of-memory error steps later (a 400k-token prompt
/// ran for 400 s without a step or a word). The warning, when there is one.
pub fn over_the_plan<T: TaskPrompt>(
    prompts: &[T],
    codec: &dyn TextCodec,
) -> Result<Option<String>> {
    let planned = conrub_memory::DEFAULT_MAX_PROMPT_TOKENS;
    let mut longest: Option<(usize, &T)> = None;
    for p in prompts {
        let len = codec.encode_prompt(p.messages())?.len();
        if len > planned && longest.is_none_or(|(l, _)| len > l) {
            longest = Some((len, p));
        }
    }
    Ok(longest.map(|(len, p)| {
        format!(
            "prompt {} renders to {len} tokens, over the {planned} the memory plan assumes without data.max_prompt_tokens: set it to drop longer prompts, or to {len} to plan for them (`conrub plan` then says whether they fit)",
            p.id()
        )
    }))
}

impl Overlong {
    /// The log line of a filter that dropped something.
    pub fn line(&self, max: usize) -> Option<String> {
        (self.dropped > 0).then(|| {
            format!(
                "data.max_prompt_tokens = {max}: dropped {} of {} prompts (the longest {} tokens; {}{})",
                self.dropped,
                self.of,
                self.longest,
                self.ids.join(", "),
                if self.dropped > self.ids.len() { ", ..." } else { "" }
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use conrub_rubric::Message;

    /// A codec of one token per character.
    struct Chars;

    impl TextCodec for Chars {
        fn encode_prompt(&self, messages: &[Message]) -> conrub_contracts::Result<Vec<u32>> {
            Ok(messages
                .iter()
                .flat_map(|m| m.content.chars().map(|c| c as u32))
                .collect())
        }

        fn decode(&self, ids: &[u32]) -> conrub_contracts::Result<String> {
            Ok(ids.iter().filter_map(|&i| char::from_u32(i)).collect())
        }

        fn encode_text(&self, text: &str) -> conrub_contracts::Result<Vec<u32>> {
            Ok(text.chars().map(|c| c as u32).collect())
        }
    }

    /// A one-message prompt.
    #[derive(Clone, Debug)]
    struct Prompt(String, Vec<Message>);

    impl TaskPrompt for Prompt {
        fn id(&self) -> &str {
            &self.0
        }

        fn messages(&self) -> &[Message] {
            &self.1
        }
    }

    fn record(id: &str, question: &str) -> Prompt {
        Prompt(id.into(), vec![Message::user(question)])
    }

    /// Issue 53, item 6: a prompt longer than the plan's assumption ran without a word.
    #[test]
    fn a_prompt_over_the_planned_length_is_named() {
        let planned = conrub_memory::DEFAULT_MAX_PROMPT_TOKENS;
        let prompts = vec![record("a", "ab"), record("long", &"x".repeat(planned + 7))];
        let line = over_the_plan(&prompts, &Chars).unwrap().unwrap();
        let want = format!(
            "prompt long renders to {} tokens, over the {planned}",
            planned + 7
        );
        assert!(line.starts_with(&want), "{line}");
        assert_eq!(over_the_plan(&prompts[..1], &Chars).unwrap(), None);
    }

    #[test]
    fn prompts_over_the_limit_are_dropped_and_counted_or_refused() {
        let prompts = vec![record("a", "abc"), record("b", "abcdef"), record("c", "ab")];
        let (kept, report) =
            drop_overlong(prompts.clone(), &Chars, 3, OverlongPrompts::Drop).unwrap();
        assert_eq!(kept.iter().map(|r| r.id()).collect::<Vec<_>>(), ["a", "c"]);
        assert_eq!(
            report.line(3).unwrap(),
            "data.max_prompt_tokens = 3: dropped 1 of 3 prompts (the longest 6 tokens; b)"
        );
        let (_, none) = drop_overlong(prompts.clone(), &Chars, 6, OverlongPrompts::Drop).unwrap();
        assert_eq!(none.line(6), None);
        let e = drop_overlong(prompts.clone(), &Chars, 3, OverlongPrompts::Error)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("data.max_prompt_tokens: prompt b renders to 6 tokens, over 3"),
            "{e}"
        );
        let e = drop_overlong(prompts, &Chars, 1, OverlongPrompts::Drop)
            .unwrap_err()
            .to_string();
        assert!(e.contains("every one of the 3 prompts"), "{e}");
    }
}
