//! The rubric record of docs/METHOD.md §2: one per prompt, 6-12 equally weighted criteria.

use serde::{Deserialize, Deserializer, Serialize};

/// One chat message of a prompt (the workspace's one message type, from `conrub-base`; also
/// `conrub_models::Message`).
pub use conrub_base::Message;

/// Whether a criterion is prompt-specific content or one of the two fixed global controls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CriterionKind {
    /// A prompt-specific, atomic requirement.
    Content,
    /// One of the two controls appended to every rubric (factual correctness, appropriateness).
    GlobalControl,
}

/// The reference-coverage tag: does the reference answer cover this criterion? Construction-time
/// metadata only, never a reward label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Coverage {
    /// The reference answer covers the criterion.
    Yes,
    /// The criterion goes beyond the reference answer.
    No,
}

/// Where a criterion came from.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CriterionProvenance {
    /// Generators that supported the criterion's cluster (consensus construction), e.g. `["A", "B", "C"]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub generators: Vec<String>,
    /// The semantic cluster the criterion represents (consensus construction).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_id: Option<String>,
    /// Points or weight the criterion had in an imported dataset (kept for audit, unused by the reward).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_points: Option<f64>,
    /// Title the criterion had in an imported dataset (RaR).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_title: Option<String>,
    /// Tags the criterion had in an imported dataset (HealthBench `axis:`/`level:` tags).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub source_tags: Vec<String>,
}

impl CriterionProvenance {
    /// True when nothing is recorded (then the field is omitted from JSON).
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// One criterion: a positive, atomic, yes/no-checkable statement starting "The response ...".
///
/// In JSON: `id` (optional), `text`, `kind`, `reference_coverage` (optional, written as `null`) and
/// `provenance` (optional); any other field is an error that names it. The lexical test-double
/// judge's `keywords` / `contradictions`, which criteria used to carry, live in that judge's own
/// keyword file now (`conrub_judge::LexicalJudge`); a record that still has them is rejected with a
/// message saying so.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Criterion {
    /// Optional stable id (unique within the record when given).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The requirement, e.g. "The response recommends urgent assessment for chest pain at rest."
    pub text: String,
    /// Content criterion or global control.
    pub kind: CriterionKind,
    /// `yes`/`no`, or `null` when there is no reference answer and for global controls.
    pub reference_coverage: Option<Coverage>,
    /// Generators, cluster and imported metadata.
    #[serde(skip_serializing_if = "CriterionProvenance::is_empty")]
    pub provenance: CriterionProvenance,
}

/// The fields of a criterion in JSON, for "unknown field" errors.
const CRITERION_FIELDS: &[&str] = &["id", "text", "kind", "reference_coverage", "provenance"];

/// Fields criteria had before, and where they went.
const MOVED_CRITERION_FIELDS: &[&str] = &["keywords", "contradictions"];

impl<'de> Deserialize<'de> for Criterion {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_struct("Criterion", CRITERION_FIELDS, CriterionVisitor)
    }
}

struct CriterionVisitor;

/// The value of a field that moved: always an error, raised inside the field so that the error's
/// path names it (`criteria[0].keywords`).
struct MovedField(String);

impl<'de> serde::de::DeserializeSeed<'de> for MovedField {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, _: D) -> Result<(), D::Error> {
        Err(serde::de::Error::custom(format!(
            "`{}` is no longer a criterion field: the lexical test-double judge reads keywords and \
             contradictions from its own keyword file (`keywords = \"FILE.jsonl\"` in its judge config, \
             see configs/README.md); remove the field from the record",
            self.0
        )))
    }
}

impl<'de> serde::de::Visitor<'de> for CriterionVisitor {
    type Value = Criterion;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a criterion object {text, kind, ...}")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Criterion, A::Error> {
        use serde::de::Error;
        let mut id: Option<Option<String>> = None;
        let mut text: Option<String> = None;
        let mut kind: Option<CriterionKind> = None;
        let mut reference_coverage: Option<Option<Coverage>> = None;
        let mut provenance: Option<CriterionProvenance> = None;
        fn set<T, E: Error>(slot: &mut Option<T>, name: &'static str, v: T) -> Result<(), E> {
            match slot.replace(v) {
                Some(_) => Err(E::duplicate_field(name)),
                None => Ok(()),
            }
        }
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "id" => set(&mut id, "id", map.next_value()?)?,
                "text" => set(&mut text, "text", map.next_value()?)?,
                "kind" => set(&mut kind, "kind", map.next_value()?)?,
                "reference_coverage" => set(
                    &mut reference_coverage,
                    "reference_coverage",
                    map.next_value()?,
                )?,
                "provenance" => set(&mut provenance, "provenance", map.next_value()?)?,
                k if MOVED_CRITERION_FIELDS.contains(&k) => {
                    map.next_value_seed(MovedField(key.clone()))?
                }
                other => return Err(A::Error::unknown_field(other, CRITERION_FIELDS)),
            }
        }
        Ok(Criterion {
            id: id.flatten(),
            text: text.ok_or_else(|| A::Error::missing_field("text"))?,
            kind: kind.ok_or_else(|| A::Error::missing_field("kind"))?,
            reference_coverage: reference_coverage.flatten(),
            provenance: provenance.unwrap_or_default(),
        })
    }
}

impl Criterion {
    /// A content criterion with no metadata.
    pub fn content(text: impl Into<String>) -> Self {
        Self {
            id: None,
            text: text.into(),
            kind: CriterionKind::Content,
            reference_coverage: None,
            provenance: CriterionProvenance::default(),
        }
    }

    fn global(id: &str, text: &str) -> Self {
        Self {
            id: Some(id.into()),
            kind: CriterionKind::GlobalControl,
            ..Self::content(text)
        }
    }
}

/// Text of the global control for overall factual correctness.
pub const GLOBAL_FACTUAL: &str =
    "The response is factually accurate throughout: every medical or factual claim it makes is correct.";
/// Text of the global control for response appropriateness.
pub const GLOBAL_APPROPRIATE: &str =
    "The response is appropriate to the request: it answers what was asked, \
at a suitable level of detail, safely, and in a clear, usable form.";

/// The two global controls appended to every rubric, in their fixed order.
pub fn global_controls() -> [Criterion; 2] {
    [
        Criterion::global("global-factual", GLOBAL_FACTUAL),
        Criterion::global("global-appropriate", GLOBAL_APPROPRIATE),
    ]
}

/// Where an imported record came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceProvenance {
    /// `rar`, `rubrichub`, `healthbench` or `conrub-build`.
    pub format: String,
    /// File name the record was read from.
    pub file: String,
    /// 1-based line (or row) in that file.
    pub line: usize,
    /// The id the record had there, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_id: Option<String>,
    /// Other source metadata kept verbatim (e.g. HealthBench `example_tags`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra: Option<serde_json::Value>,
}

/// One prompt with its rubric.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RubricRecord {
    /// Unique prompt id.
    pub id: String,
    /// The prompt as chat messages; a plain string is read as one user message.
    #[serde(deserialize_with = "question_messages")]
    pub question: Vec<Message>,
    /// Optional reference answer (construction only; judges never see it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference_answer: Option<String>,
    /// Optional short final answer that verifiable reward functions (`exact`, `numeric` in
    /// `[[reward.functions]]`) compare responses to; judges never see it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ground_truth: Option<String>,
    /// Source stratum, e.g. `rar-medicine`, `rubrichub-medical`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The ordered criteria: content first, then the two global controls.
    pub criteria: Vec<Criterion>,
    /// Where the record came from when imported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provenance: Option<SourceProvenance>,
}

impl RubricRecord {
    /// Number of content criteria.
    pub fn content_count(&self) -> usize {
        self.criteria
            .iter()
            .filter(|c| c.kind == CriterionKind::Content)
            .count()
    }

    /// Number of global controls.
    pub fn global_count(&self) -> usize {
        self.criteria.len() - self.content_count()
    }

    /// The question as plain text for a judge prompt: the content of a single user message, or
    /// `role: content` blocks for a conversation.
    pub fn question_text(&self) -> String {
        messages_text(&self.question)
    }

    /// The criterion texts in order.
    pub fn criterion_texts(&self) -> Vec<String> {
        self.criteria.iter().map(|c| c.text.clone()).collect()
    }
}

/// Chat messages as plain text for a judge prompt: the content of a single user message, or
/// `[role]` blocks for a conversation.
pub fn messages_text(messages: &[Message]) -> String {
    match messages {
        [m] if m.role == "user" => m.content.clone(),
        msgs => msgs
            .iter()
            .map(|m| format!("[{}]\n{}", m.role, m.content))
            .collect::<Vec<_>>()
            .join("\n\n"),
    }
}

/// Deserialises a prompt given as a plain string (one user message) or as chat messages.
pub fn question_messages<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Message>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Question {
        Text(String),
        Messages(Vec<Message>),
    }
    match Question::deserialize(d) {
        Ok(Question::Text(t)) => Ok(vec![Message::user(t)]),
        Ok(Question::Messages(m)) => Ok(m),
        Err(_) => Err(serde::de::Error::custom(
            "expected a string or an array of {\"role\", \"content\"} messages",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn question_accepts_text_or_messages_and_round_trips() {
        let a: RubricRecord = serde_json::from_str(
            r#"{"id":"p1","question":"Is it safe?","criteria":[{"text":"The response says yes.","kind":"content","reference_coverage":"yes"}]}"#,
        )
        .unwrap();
        assert_eq!(a.question, vec![Message::user("Is it safe?")]);
        assert_eq!(a.criteria[0].reference_coverage, Some(Coverage::Yes));
        let json = serde_json::to_string(&a).unwrap();
        // The coverage tag is always written, null included, as docs/METHOD.md §2 asks.
        assert!(json.contains("\"reference_coverage\":\"yes\""), "{json}");
        let b: RubricRecord = serde_json::from_str(&json).unwrap();
        assert_eq!(a, b);
        let g = serde_json::to_string(&global_controls()[0]).unwrap();
        assert!(
            g.contains("\"reference_coverage\":null") && g.contains("global_control"),
            "{g}"
        );
    }

    #[test]
    fn criteria_reject_the_lexical_judge_fields_and_unknown_ones() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.jsonl");
        let line = |extra: &str| {
            format!(
                r#"{{"id":"a","question":"q","criteria":[{{"text":"The response says t7.","kind":"content"{extra}}}]}}"#
            )
        };
        std::fs::write(&p, line(r#","keywords":["t7"]"#) + "\n").unwrap();
        let e = crate::io::read_rubrics(&p).unwrap_err().to_string();
        assert!(
            e.contains("r.jsonl:1: criteria[0].keywords: `keywords` is no longer a criterion field: the lexical test-double judge reads keywords and contradictions from its own keyword file"),
            "{e}"
        );
        std::fs::write(&p, line(r#","contradictions":[]"#) + "\n").unwrap();
        let e = crate::io::read_rubrics(&p).unwrap_err().to_string();
        assert!(e.contains("r.jsonl:1: criteria[0].contradictions: `contradictions` is no longer a criterion field"), "{e}");
        std::fs::write(&p, line(r#","weight":2"#) + "\n").unwrap();
        let e = crate::io::read_rubrics(&p).unwrap_err().to_string();
        assert!(
            e.contains("unknown field `weight`, expected one of `id`, `text`, `kind`, `reference_coverage`, `provenance`"),
            "{e}"
        );
        std::fs::write(&p, line(r#","kind":"content""#) + "\n").unwrap();
        assert!(crate::io::read_rubrics(&p)
            .unwrap_err()
            .to_string()
            .contains("duplicate field `kind`"));
        std::fs::write(
            &p,
            r#"{"id":"a","question":"q","criteria":[{"kind":"content"}]}"#.to_string() + "\n",
        )
        .unwrap();
        assert!(crate::io::read_rubrics(&p)
            .unwrap_err()
            .to_string()
            .contains("criteria[0]: missing field `text`"));
        // What users write round-trips, and nothing judge-specific is written.
        let c = Criterion {
            id: Some("c1".into()),
            ..Criterion::content("The response says t7.")
        };
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(
            json,
            r#"{"id":"c1","text":"The response says t7.","kind":"content","reference_coverage":null}"#
        );
        assert_eq!(serde_json::from_str::<Criterion>(&json).unwrap(), c);
        let with_null_id: Criterion =
            serde_json::from_str(r#"{"id":null,"text":"t","kind":"global_control"}"#).unwrap();
        assert_eq!(
            (with_null_id.id, with_null_id.kind),
            (None, CriterionKind::GlobalControl)
        );
    }

    #[test]
    fn conversation_question_text_names_roles() {
        let r = RubricRecord {
            id: "x".into(),
            question: vec![
                Message {
                    role: "system".into(),
                    content: "Be brief.".into(),
                },
                Message::user("Hi"),
            ],
            reference_answer: None,
            ground_truth: None,
            source: None,
            criteria: vec![],
            provenance: None,
        };
        assert_eq!(r.question_text(), "[system]\nBe brief.\n\n[user]\nHi");
    }
}
