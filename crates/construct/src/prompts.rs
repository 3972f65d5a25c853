//! Our prompts for the four model roles of consensus construction (docs/METHOD.md §3): criterion
//! generation, sample review, semantic grouping and the criterion audit (with a variant that
//! omits the clinical context, for endpoints that refuse it). Placeholders are filled in one pass;
//! each template's version (a hash of its text) goes into the manifest and every cache key.

use conrub_judge::prompts::fill;
use conrub_judge::PromptTemplate;

const GENERATE_SYSTEM: &str = "You write grading rubrics for answers to medical and other open-ended questions. \
A rubric is a list of criteria. Each criterion is one positive, atomic requirement that a grader can check with a \
plain yes or no by reading an answer, and it begins with \"The response\". Criteria say what a good answer must \
contain: specific facts, correct recommendations, safety warnings the situation calls for, useful practical steps, \
and clear communication where it matters. Never write a criterion that is met by leaving something out (\"The \
response does not mention X\"); when something must be avoided, ask for the correct statement instead (\"The \
response states that X is contraindicated in pregnancy\"). Never join two requirements in one criterion, and never \
refer to a reference answer inside a criterion.";

const GENERATE_USER: &str = "QUESTION:\n<<<\n{question}\n>>>\n\nREFERENCE ANSWER:\n<<<\n{reference}\n>>>\n\n\
Write between {min} and {max} criteria for grading answers to this question. {coverage_rule}\n\n\
Reply with JSON only, in this shape:\n\
{\"criteria\": [{\"text\": \"The response ...\", \"coverage\": \"yes\"}, {\"text\": \"The response ...\", \"coverage\": \"no\"}]}";

/// The coverage instruction when a reference answer exists.
pub const COVERAGE_WITH_REFERENCE: &str = "Tag each criterion with \"coverage\": \"yes\" when the reference answer \
covers the point and \"no\" when the point goes beyond it. Include some correct and useful criteria that go beyond \
the reference (tagged \"no\").";
/// The coverage instruction without a reference answer.
pub const COVERAGE_WITHOUT_REFERENCE: &str =
    "There is no reference answer: rely on established knowledge and set \"coverage\" to null for every criterion.";
/// What the reference block says when there is none.
pub const NO_REFERENCE: &str = "(none)";

const REVIEW_SYSTEM: &str = "You are a senior clinician checking a draft grading rubric before it is used to grade \
answers. Read the question, the reference answer (when given) and the draft criteria. Give the verdict \
\"contradiction\" when any criterion requires something medically wrong or unsafe, when criteria contradict each \
other, or when a criterion conflicts with the reference answer; otherwise give \"consistent\". Then score from 0 to \
10 how well the criteria, taken together, match what a correct and complete answer to this question needs: 10 when \
every criterion is correct, relevant and checkable; below 8 when the list has notable errors, irrelevant or \
uncheckable items, or misses the point of the question.";

const REVIEW_USER: &str =
    "QUESTION:\n<<<\n{question}\n>>>\n\nREFERENCE ANSWER:\n<<<\n{reference}\n>>>\n\n\
DRAFT CRITERIA ({n}):\n{candidates}\n\n\
Reply with JSON only, in this shape:\n\
{\"verdict\": \"consistent\", \"score\": 9, \"problems\": [\"one short line per problem found\"]}";

const GROUP_SYSTEM: &str = "You group grading criteria that several authors wrote independently for the same \
question. Two criteria belong in the same group when they require the same proposition of an answer, so that an \
answer meeting one necessarily meets the other. Different wording does not matter; a different, broader or \
narrower requirement does. Every criterion id may appear in at most one group. A criterion that matches no other \
may be left out.";

const GROUP_USER: &str = "QUESTION:\n<<<\n{question}\n>>>\n\n\
CRITERIA ({n}); each id is the author's letter and a number:\n{candidates}\n\n\
Reply with JSON only, in this shape:\n\
{\"groups\": [[\"A1\", \"B4\", \"C2\"], [\"A2\", \"C5\"]]}";

const AUDIT_SYSTEM: &str = "You audit the criteria of a grading rubric one at a time. Give each criterion a \
category: direct_medical_fact, safety_constraint, wrong_option_explanation, communication_format, \
supplementary_valid, problematic_negative (it is met by leaving something out, such as \"does not mention X\"), \
ambiguous_non_atomic, or low_value. Then decide: \"keep\" when it is correct, positive, atomic and clear as \
written; \"rewrite\" when the requirement is valid but its wording is not, and give the new text as one clear \
positive requirement starting \"The response\" (a problematic negative becomes a requirement to state the relevant \
fact, for example \"The response states that X is contraindicated\"); \"drop\" when it is wrong, irrelevant or of \
little value; \"manual_review\" when an expert is needed to tell. Also give its dimension, one of: {dimensions}.";

const AUDIT_USER: &str = "QUESTION:\n<<<\n{question}\n>>>\n\nREFERENCE ANSWER:\n<<<\n{reference}\n>>>\n\n\
CRITERIA ({n}):\n{criteria}\n\n\
Reply with JSON only, one entry per criterion in the same order, in this shape:\n\
{\"audit\": [{\"id\": \"R1\", \"category\": \"direct_medical_fact\", \"dimension\": \"diagnosis\", \"decision\": \"keep\", \"rewrite\": null}]}";

const AUDIT_BLIND_USER: &str = "The question and reference answer are withheld; judge each criterion on its own \
wording and on established knowledge.\n\n\
CRITERIA ({n}):\n{criteria}\n\n\
Reply with JSON only, one entry per criterion in the same order, in this shape:\n\
{\"audit\": [{\"id\": \"R1\", \"category\": \"direct_medical_fact\", \"dimension\": \"diagnosis\", \"decision\": \"keep\", \"rewrite\": null}]}";

/// The construction prompts.
#[derive(Debug, Clone, PartialEq)]
pub struct ConstructPrompts {
    /// Criterion generation (each generator).
    pub generate: PromptTemplate,
    /// Sample review.
    pub review: PromptTemplate,
    /// Semantic grouping.
    pub group: PromptTemplate,
    /// Criterion audit with the question and reference.
    pub audit: PromptTemplate,
    /// Criterion audit without them (after a refusal).
    pub audit_blind: PromptTemplate,
}

impl Default for ConstructPrompts {
    fn default() -> Self {
        let t = |system: &str, user: &str| PromptTemplate {
            system: system.into(),
            user: user.into(),
        };
        Self {
            generate: t(GENERATE_SYSTEM, GENERATE_USER),
            review: t(REVIEW_SYSTEM, REVIEW_USER),
            group: t(GROUP_SYSTEM, GROUP_USER),
            audit: t(AUDIT_SYSTEM, AUDIT_USER),
            audit_blind: t(AUDIT_SYSTEM, AUDIT_BLIND_USER),
        }
    }
}

/// Rendered system and user messages.
pub type Rendered = (String, String);

impl ConstructPrompts {
    /// `(role, template)` of every prompt, in pipeline order.
    pub fn templates(&self) -> [(&'static str, &PromptTemplate); 5] {
        [
            ("generate", &self.generate),
            ("review", &self.review),
            ("group", &self.group),
            ("audit", &self.audit),
            ("audit_blind", &self.audit_blind),
        ]
    }

    /// `(role, version)` of every template, for the manifest and the cache keys.
    pub fn versions(&self) -> Vec<(&'static str, String)> {
        self.templates()
            .into_iter()
            .map(|(k, t)| (k, t.version()))
            .collect()
    }

    /// The generation prompt.
    pub fn render_generate(
        &self,
        question: &str,
        reference: Option<&str>,
        min: usize,
        max: usize,
    ) -> Rendered {
        let (min, max) = (min.to_string(), max.to_string());
        let rule = if reference.is_some() {
            COVERAGE_WITH_REFERENCE
        } else {
            COVERAGE_WITHOUT_REFERENCE
        };
        self.generate.render(&[
            ("question", question),
            ("reference", reference.unwrap_or(NO_REFERENCE)),
            ("min", &min),
            ("max", &max),
            ("coverage_rule", rule),
        ])
    }

    /// The review prompt for one generator's candidates (numbered 1..n).
    pub fn render_review(
        &self,
        question: &str,
        reference: Option<&str>,
        candidates: &[&str],
    ) -> Rendered {
        let list: Vec<String> = candidates
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{}. {c}", i + 1))
            .collect();
        let n = candidates.len().to_string();
        self.review.render(&[
            ("question", question),
            ("reference", reference.unwrap_or(NO_REFERENCE)),
            ("n", &n),
            ("candidates", &list.join("\n")),
        ])
    }

    /// The grouping prompt over `(id, text)` candidates of all accepted samples.
    pub fn render_group(&self, question: &str, candidates: &[(String, String)]) -> Rendered {
        let list: Vec<String> = candidates
            .iter()
            .map(|(id, t)| format!("{id}: {t}"))
            .collect();
        let n = candidates.len().to_string();
        self.group.render(&[
            ("question", question),
            ("n", &n),
            ("candidates", &list.join("\n")),
        ])
    }

    /// The audit prompt over representatives `R1..Rn`; `context` is `None` for the blind variant.
    pub fn render_audit(
        &self,
        context: Option<(&str, Option<&str>)>,
        criteria: &[&str],
        dimensions: &[&str],
    ) -> Rendered {
        let list: Vec<String> = criteria
            .iter()
            .enumerate()
            .map(|(i, c)| format!("R{}: {c}", i + 1))
            .collect();
        let (n, list, dims) = (
            criteria.len().to_string(),
            list.join("\n"),
            dimensions.join(", "),
        );
        let system = fill(&self.audit.system, &[("dimensions", &dims)]);
        let user = match context {
            Some((question, reference)) => fill(
                &self.audit.user,
                &[
                    ("question", question),
                    ("reference", reference.unwrap_or(NO_REFERENCE)),
                    ("n", &n),
                    ("criteria", &list),
                ],
            ),
            None => fill(&self.audit_blind.user, &[("n", &n), ("criteria", &list)]),
        };
        (system, user)
    }
}
