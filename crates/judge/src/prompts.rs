//! Our judge prompts (docs/METHOD.md §4, §5, §9), overridable from files.
//!
//! Each prompt is a system and a user template with `{name}` placeholders, substituted in one pass
//! (text inside a question or response is never itself substituted). The prompt *version* is a
//! hash of the templates, so an override changes every cache key automatically.

use std::path::Path;

use conrub_rubric::ScoringMode;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::cache::hex;
use crate::error::{JudgeError, Result};

/// A system + user prompt pair.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptTemplate {
    /// System message.
    pub system: String,
    /// User message template.
    pub user: String,
}

impl PromptTemplate {
    fn new(system: &str, user: &str) -> Self {
        Self {
            system: system.into(),
            user: user.into(),
        }
    }

    /// Reads `system = "..."` and `user = "..."` from a TOML file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| JudgeError::File {
            path: path.into(),
            source: e,
        })?;
        toml::from_str(&text).map_err(|e| JudgeError::Parse {
            path: path.into(),
            message: e.to_string().trim_end().to_string(),
        })
    }

    /// A short, stable hash of both templates.
    pub fn version(&self) -> String {
        let mut h = Sha256::new();
        h.update(self.system.as_bytes());
        h.update([0u8]);
        h.update(self.user.as_bytes());
        let d = h.finalize();
        hex(&d[..6])
    }

    /// `(system, user)` with the placeholders filled.
    pub fn render(&self, vars: &[(&str, &str)]) -> (String, String) {
        (fill(&self.system, vars), fill(&self.user, vars))
    }
}

/// One-pass `{name}` substitution; unknown names are left as they are.
pub fn fill(template: &str, vars: &[(&str, &str)]) -> String {
    let mut out =
        String::with_capacity(template.len() + vars.iter().map(|(_, v)| v.len()).sum::<usize>());
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        out.push_str(&rest[..start]);
        let after = &rest[start + 1..];
        match after.find('}') {
            Some(end)
                if after[..end]
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_')
                    && end > 0 =>
            {
                let name = &after[..end];
                match vars.iter().find(|(k, _)| *k == name) {
                    Some((_, v)) => out.push_str(v),
                    None => out.push_str(&rest[start..start + end + 2]),
                }
                rest = &after[end + 1..];
            }
            _ => {
                out.push('{');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Numbered criteria, one per line: `1. The response ...`.
pub fn numbered(criteria: &[String]) -> String {
    criteria
        .iter()
        .enumerate()
        .map(|(i, c)| format!("{}. {}", i + 1, c.trim()))
        .collect::<Vec<_>>()
        .join("\n")
}

const SYSTEM: &str = "You are a meticulous grader of medical and other open-ended answers. You apply the \
given checklist literally and consistently, you never reward what an answer merely might have meant, and you \
reply with JSON only.";

const THREE_STATE_LABELS: &str = r#"Use exactly one of three labels per criterion:
- "correct": the response deals with the point of the criterion and what it says about it is accurate. Informal or loose wording still counts as correct as long as it is not false.
- "missing": the response says nothing useful about the point: it is absent, too vague to count, or only hinted at.
- "wrong": what the response says about the point is false: a factual error, an invented fact or source, a contradiction, a reversed recommendation, or a different drug, dose, test or diagnosis substituted for the right one."#;

const BINARY_LABELS: &str = r#"Use exactly one of two labels per criterion:
- "yes": the response states or clearly implies what the criterion requires, and states it correctly.
- "no": anything else: the point is absent, too vague, only partly there, or stated incorrectly."#;

const CRITERIA_USER: &str = r#"Grade the RESPONSE below against each numbered CRITERION.

{labels}

Judge every criterion on its own, using only what the response itself says. The criteria are the checklist; do not add requirements of your own.

QUESTION:
<<<
{question}
>>>

RESPONSE:
<<<
{response}
>>>

CRITERIA ({n}):
{criteria}

Reply with a JSON array of exactly {n} labels, one per criterion in the order given, for example {example}. Write nothing else."#;

const PAIRWISE_USER: &str = r#"Two candidate responses, A and B, answer the same QUESTION. Decide which one is better.

The numbered CRITERIA are your main yardstick: for each criterion, say which response meets it better ("A", "B", or "same" when they meet it equally well or equally badly). A clear medical error, unsafe advice, or a self-contradiction counts against a response even when no criterion mentions it. Length, formatting, tone and style on their own are never a reason to prefer a response. When neither response is clearly better, the verdict is "same".

QUESTION:
<<<
{question}
>>>

CRITERIA ({n}):
{criteria}

RESPONSE A:
<<<
{response_a}
>>>

RESPONSE B:
<<<
{response_b}
>>>

Reply with one JSON object and nothing else:
{"criteria": [one of "A", "B", "same" for each of the {n} criteria, in order], "verdict": "A" or "B" or "same", "confidence": a number between 0 and 1, "reason": "one short sentence"}"#;

const SINGLE_USER: &str = r#"QUESTION:
<<<
{question}
>>>

RESPONSE:
<<<
{response}
>>>

CRITERION: {criterion}

{labels}

Which label fits this criterion? Answer with the label alone, in lower case."#;

const SINGLE_BINARY_LABELS: &str = r#"Labels: "yes" if the response states or clearly implies what the criterion requires, correctly; "no" for anything else (absent, vague, partial or incorrect)."#;

const SINGLE_THREE_STATE_LABELS: &str = r#"Labels: "correct" if the response deals with the point accurately (loose wording that is not false counts); "missing" if it says nothing useful about it; "wrong" if it states something false about it (an error, fabrication, contradiction, reversal or substitution)."#;

/// Every prompt a judge uses.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptSet {
    /// All criteria of one response at once, binary labels.
    pub criteria_binary: PromptTemplate,
    /// All criteria of one response at once, three-state labels.
    pub criteria_three_state: PromptTemplate,
    /// One pairwise comparison.
    pub pairwise: PromptTemplate,
    /// One criterion, binary (the cheap log-probability-margin mode).
    pub single_binary: PromptTemplate,
    /// One criterion, three-state (the cheap log-probability-margin mode).
    pub single_three_state: PromptTemplate,
}

impl Default for PromptSet {
    fn default() -> Self {
        let criteria = |labels: &str, example: &str| {
            PromptTemplate::new(
                SYSTEM,
                &fill(CRITERIA_USER, &[("labels", labels), ("example", example)]),
            )
        };
        let single =
            |labels: &str| PromptTemplate::new(SYSTEM, &fill(SINGLE_USER, &[("labels", labels)]));
        Self {
            criteria_binary: criteria(BINARY_LABELS, r#"["yes", "no", "yes"]"#),
            criteria_three_state: criteria(
                THREE_STATE_LABELS,
                r#"["correct", "missing", "wrong"]"#,
            ),
            pairwise: PromptTemplate::new(SYSTEM, PAIRWISE_USER),
            single_binary: single(SINGLE_BINARY_LABELS),
            single_three_state: single(SINGLE_THREE_STATE_LABELS),
        }
    }
}

pub use conrub_settings::PromptOverrides;

impl PromptSet {
    /// The built-in prompts with the given files swapped in (relative paths against `base`).
    pub fn with_overrides(o: &PromptOverrides, base: &Path) -> Result<Self> {
        let mut set = Self::default();
        let load = |p: &Option<std::path::PathBuf>, slot: &mut PromptTemplate| -> Result<()> {
            if let Some(p) = p {
                *slot = PromptTemplate::from_file(&base.join(p))?;
            }
            Ok(())
        };
        load(&o.criteria_binary, &mut set.criteria_binary)?;
        load(&o.criteria_three_state, &mut set.criteria_three_state)?;
        load(&o.pairwise, &mut set.pairwise)?;
        load(&o.single_binary, &mut set.single_binary)?;
        load(&o.single_three_state, &mut set.single_three_state)?;
        Ok(set)
    }

    /// The all-criteria prompt of a scoring mode.
    pub fn criteria(&self, mode: ScoringMode) -> &PromptTemplate {
        match mode {
            ScoringMode::Binary => &self.criteria_binary,
            ScoringMode::ThreeState => &self.criteria_three_state,
        }
    }

    /// The one-criterion prompt of a scoring mode.
    pub fn single(&self, mode: ScoringMode) -> &PromptTemplate {
        match mode {
            ScoringMode::Binary => &self.single_binary,
            ScoringMode::ThreeState => &self.single_three_state,
        }
    }

    /// Renders the all-criteria prompt.
    pub fn render_criteria(
        &self,
        mode: ScoringMode,
        question: &str,
        response: &str,
        criteria: &[String],
    ) -> (String, String) {
        let n = criteria.len().to_string();
        self.criteria(mode).render(&[
            ("question", question),
            ("response", response),
            ("criteria", &numbered(criteria)),
            ("n", &n),
        ])
    }

    /// Renders the pairwise prompt with `a` shown first.
    pub fn render_pairwise(
        &self,
        question: &str,
        criteria: &[String],
        a: &str,
        b: &str,
    ) -> (String, String) {
        let n = criteria.len().to_string();
        self.pairwise.render(&[
            ("question", question),
            ("criteria", &numbered(criteria)),
            ("n", &n),
            ("response_a", a),
            ("response_b", b),
        ])
    }

    /// Renders the one-criterion prompt.
    pub fn render_single(
        &self,
        mode: ScoringMode,
        question: &str,
        response: &str,
        criterion: &str,
    ) -> (String, String) {
        self.single(mode).render(&[
            ("question", question),
            ("response", response),
            ("criterion", criterion.trim()),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_pass_substitution_never_rewrites_inserted_text() {
        let t = PromptTemplate::new(
            "s",
            "Q: {question}\nR: {response}\n{unknown} {not a name} {}",
        );
        let (_, u) = t.render(&[
            ("question", "what is {response}?"),
            ("response", "it {question}"),
        ]);
        assert_eq!(
            u,
            "Q: what is {response}?\nR: it {question}\n{unknown} {not a name} {}"
        );
    }

    #[test]
    fn built_in_prompts_carry_the_label_semantics_and_fill_everything() {
        let p = PromptSet::default();
        let (_, u) = p.render_criteria(
            ScoringMode::ThreeState,
            "Q?",
            "R.",
            &["The response a.".into(), "The response b.".into()],
        );
        assert!(u.contains("1. The response a.\n2. The response b."));
        assert!(
            u.contains("exactly 2 labels")
                && u.contains("\"wrong\"")
                && u.contains("reversed recommendation")
        );
        assert!(!u.contains("{n}") && !u.contains("{labels}") && !u.contains("{example}"));
        let (_, u) = p.render_pairwise("Q?", &["The response a.".into()], "first", "second");
        assert!(u.contains("RESPONSE A:\n<<<\nfirst") && u.contains("RESPONSE B:\n<<<\nsecond"));
        assert!(u.contains("never a reason"));
        assert_ne!(
            p.criteria_binary.version(),
            p.criteria_three_state.version()
        );
    }

    #[test]
    fn overrides_load_from_toml_and_change_the_version() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(
            d.path().join("p.toml"),
            "system = \"S\"\nuser = \"U {question}\"\n",
        )
        .unwrap();
        let o = PromptOverrides {
            pairwise: Some("p.toml".into()),
            ..Default::default()
        };
        let set = PromptSet::with_overrides(&o, d.path()).unwrap();
        assert_eq!(set.pairwise.user, "U {question}");
        assert_ne!(
            set.pairwise.version(),
            PromptSet::default().pairwise.version()
        );
        let o = PromptOverrides {
            pairwise: Some("missing.toml".into()),
            ..Default::default()
        };
        assert!(PromptSet::with_overrides(&o, d.path())
            .unwrap_err()
            .to_string()
            .contains("missing.toml"));
    }
}
