//! Stop strings (`learner.stop`): a response ends where its text first contains one of them,
//! whatever the engine sampled after. Applied to every engine's rollouts on the host, so every
//! backend and engine ends responses alike: the tokens up to the one that completes the stop
//! string are kept (the policy learns to emit it), the rest and their log-probabilities are
//! dropped, and the finish reason becomes `stop`. The text the judges read ends before the stop
//! string, as vLLM and SGLang return it.

use conrub_contracts::{FinishReason, RolloutBatch, TextCodec};

use crate::error::Result;

/// The number of leading tokens of `tokens` whose text first contains one of `stops`, with the
/// text before that stop string; `None` when the text never contains one. Once a prefix's text
/// contains a stop string every longer prefix's does (a longer prefix can only turn a trailing
/// U+FFFD of a partial UTF-8 sequence into its character, which a stop string never holds:
/// `LearnerConfig::validate` refuses one that does), so the shortest such prefix is found by
/// bisection, in a logarithmic number of decodes.
pub fn stop_point(
    codec: &dyn TextCodec,
    tokens: &[u32],
    stops: &[String],
) -> Result<Option<(usize, String)>> {
    let first_stop = |text: &str| -> Option<usize> {
        stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| text.find(s.as_str()))
            .min()
    };
    let full = codec.decode(tokens)?;
    if first_stop(&full).is_none() {
        return Ok(None);
    }
    // The shortest prefix whose text holds a stop string: `lo` never does, `hi` does.
    let (mut lo, mut hi) = (0usize, tokens.len());
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if first_stop(&codec.decode(&tokens[..mid])?).is_some() {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    let text = codec.decode(&tokens[..hi])?;
    let at = first_stop(&text).expect("the prefix holds a stop string");
    Ok(Some((hi, text[..at].to_string())))
}

/// Cuts every response of `batch` at its first stop string ([`stop_point`]); `texts` (the
/// decoded responses) become the text before it. Returns the responses cut.
pub fn cut_at_stop_strings(
    batch: &mut RolloutBatch,
    texts: &mut [String],
    codec: &dyn TextCodec,
    stops: &[String],
) -> Result<usize> {
    if stops.is_empty() {
        return Ok(0);
    }
    let mut cut = 0;
    for (r, text) in texts.iter_mut().enumerate() {
        if let Some((keep, before)) = stop_point(codec, &batch.responses[r], stops)? {
            batch.responses[r].truncate(keep);
            batch.logprobs[r].truncate(keep);
            batch.finish_reasons[r] = FinishReason::Stop;
            *text = before;
            cut += 1;
        }
    }
    Ok(cut)
}

#[cfg(test)]
mod tests {
    use super::*;
    use conrub_contracts::{Generation, Message};

    /// One token per character (ids are code points).
    struct Chars;

    impl TextCodec for Chars {
        fn encode_prompt(&self, messages: &[Message]) -> conrub_contracts::Result<Vec<u32>> {
            Ok(messages[0].content.chars().map(|c| c as u32).collect())
        }

        fn decode(&self, ids: &[u32]) -> conrub_contracts::Result<String> {
            Ok(ids.iter().filter_map(|&i| char::from_u32(i)).collect())
        }
    }

    fn ids(s: &str) -> Vec<u32> {
        s.chars().map(|c| c as u32).collect()
    }

    #[test]
    fn responses_end_at_the_first_stop_string() {
        let stops = vec!["</answer>".to_string(), "\n\n".to_string()];
        let mut batch = RolloutBatch::new(2, vec![vec![1]]);
        for text in ["A: 42</answer> and more", "no stop here"] {
            let tokens = ids(text);
            batch.push(Generation {
                logprobs: vec![-0.5; tokens.len()],
                tokens,
                finish_reason: FinishReason::Length,
            });
        }
        let mut texts: Vec<String> = vec!["A: 42</answer> and more".into(), "no stop here".into()];
        assert_eq!(
            cut_at_stop_strings(&mut batch, &mut texts, &Chars, &stops).unwrap(),
            1
        );
        // Kept: "A: 42</answer>", 14 tokens, the last completing the stop string.
        assert_eq!(batch.responses[0], ids("A: 42</answer>"));
        assert_eq!(batch.logprobs[0].len(), 14);
        assert_eq!(batch.finish_reasons[0], FinishReason::Stop);
        assert_eq!(texts[0], "A: 42");
        assert_eq!(batch.responses[1], ids("no stop here"));
        assert_eq!(batch.finish_reasons[1], FinishReason::Length);
        assert_eq!(texts[1], "no stop here");
        // The earliest of several stop strings wins.
        let (n, before) = stop_point(&Chars, &ids("x\n\ny</answer>"), &stops)
            .unwrap()
            .unwrap();
        assert_eq!((n, before.as_str()), (3, "x"));
        assert_eq!(stop_point(&Chars, &ids("abc"), &[]).unwrap(), None);
    }
}
