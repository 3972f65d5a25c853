//! Multiple-choice datasets: MedMCQA, PubMedQA and MMLU rows, and our prompt template per format.

use serde::Deserialize;
use serde_json::Value;

use crate::error::EvalError;

/// A supported multiple-choice format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum McqFormat {
    /// MedMCQA rows: `question`, `opa`..`opd`, `cop` (the correct option: 1-4 in the released JSON,
    /// 0-3 in some conversions; [`load_items`] reads it as 0-based when any row has `cop` 0).
    MedMcqa,
    /// PubMedQA rows: `question` (or `QUESTION`), `context`/`CONTEXTS` (a string, a list, or
    /// `{"contexts": [...]}`), `final_decision` (`yes` | `no` | `maybe`).
    PubMedQa,
    /// MMLU rows: `question`, `choices` (list), `answer` (index or letter).
    Mmlu,
}

impl std::str::FromStr for McqFormat {
    type Err = EvalError;
    fn from_str(s: &str) -> Result<Self, EvalError> {
        match s {
            "medmcqa" => Ok(Self::MedMcqa),
            "pubmedqa" => Ok(Self::PubMedQa),
            "mmlu" => Ok(Self::Mmlu),
            other => Err(EvalError::UnknownFormat(other.to_string())),
        }
    }
}

/// One question ready for prompting.
#[derive(Debug, Clone, PartialEq)]
pub struct McqItem {
    /// Id (from the row, else its line).
    pub id: String,
    /// The user prompt.
    pub prompt: String,
    /// Option labels the answer is extracted against.
    pub labels: Vec<String>,
    /// Index of the gold option.
    pub gold: usize,
    /// Subject or topic, for breakdowns.
    pub subject: Option<String>,
}

const LETTERS: [&str; 10] = ["A", "B", "C", "D", "E", "F", "G", "H", "I", "J"];

fn lettered(question: &str, options: &[String]) -> String {
    let mut p = format!("{}\n\n", question.trim());
    for (l, o) in LETTERS.iter().zip(options) {
        p += &format!("{l}. {}\n", o.trim());
    }
    p + "\nChoose the single best option. Reply with a short explanation if you like, then end with \"The answer is X\", where X is the option letter."
}

fn text(v: &Value, keys: &[&str]) -> Option<String> {
    keys.iter().find_map(|k| v.get(*k)).and_then(|x| match x {
        Value::String(s) => Some(s.clone()),
        Value::Array(a) => Some(
            a.iter()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        Value::Object(o) => o.get("contexts").map(|c| {
            c.as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .collect::<Vec<_>>()
                        .join("\n")
                })
                .unwrap_or_default()
        }),
        _ => None,
    })
}

fn index(v: &Value, n: usize, one_based: bool) -> Option<usize> {
    match v {
        Value::Number(x) => {
            let i = x.as_u64()? as usize;
            let i = if one_based { i.checked_sub(1)? } else { i };
            (i < n).then_some(i)
        }
        Value::String(s) => {
            let s = s.trim();
            LETTERS
                .iter()
                .position(|l| l.eq_ignore_ascii_case(s))
                .or_else(|| {
                    s.parse::<usize>()
                        .ok()
                        .and_then(|i| index(&Value::from(i), n, one_based))
                })
        }
        _ => None,
    }
}

/// Parses one row; `line` names it in errors; `medmcqa_one_based` says how to read MedMCQA's `cop`.
pub fn load_row(
    format: McqFormat,
    row: &str,
    line: usize,
    medmcqa_one_based: bool,
) -> Result<McqItem, EvalError> {
    #[derive(Deserialize)]
    struct Any(Value);
    let v: Value = serde_json::from_str::<Any>(row)
        .map_err(|e| EvalError::Row {
            line,
            message: e.to_string(),
        })?
        .0;
    let id = v
        .get("id")
        .and_then(|x| {
            x.as_str()
                .map(str::to_string)
                .or_else(|| x.as_u64().map(|n| n.to_string()))
        })
        .unwrap_or_else(|| format!("line-{line}"));
    let field = |k: &str| EvalError::Row {
        line,
        message: format!("missing or invalid field `{k}`"),
    };
    match format {
        McqFormat::MedMcqa => {
            let q = text(&v, &["question"]).ok_or_else(|| field("question"))?;
            let opts: Vec<String> = ["opa", "opb", "opc", "opd"]
                .iter()
                .map(|k| text(&v, &[k]).ok_or_else(|| field(k)))
                .collect::<Result<_, _>>()?;
            let gold = v
                .get("cop")
                .and_then(|c| index(c, 4, medmcqa_one_based))
                .ok_or_else(|| field("cop"))?;
            Ok(McqItem {
                id,
                prompt: lettered(&q, &opts),
                labels: LETTERS[..4].iter().map(|s| s.to_string()).collect(),
                gold,
                subject: text(&v, &["subject_name"]),
            })
        }
        McqFormat::Mmlu => {
            let q = text(&v, &["question"]).ok_or_else(|| field("question"))?;
            let opts: Vec<String> = v
                .get("choices")
                .and_then(Value::as_array)
                .ok_or_else(|| field("choices"))?
                .iter()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect();
            if opts.len() < 2 || opts.len() > LETTERS.len() {
                return Err(field("choices"));
            }
            let gold = v
                .get("answer")
                .and_then(|a| index(a, opts.len(), false))
                .ok_or_else(|| field("answer"))?;
            Ok(McqItem {
                id,
                labels: LETTERS[..opts.len()]
                    .iter()
                    .map(|s| s.to_string())
                    .collect(),
                prompt: lettered(&q, &opts),
                gold,
                subject: text(&v, &["subject"]),
            })
        }
        McqFormat::PubMedQa => {
            let q = text(&v, &["question", "QUESTION"]).ok_or_else(|| field("question"))?;
            let ctx = text(&v, &["context", "CONTEXTS", "contexts"]).unwrap_or_default();
            let labels = vec!["yes".to_string(), "no".to_string(), "maybe".to_string()];
            let gold_text = text(&v, &["final_decision"]).ok_or_else(|| field("final_decision"))?;
            let gold = labels
                .iter()
                .position(|l| l.eq_ignore_ascii_case(gold_text.trim()))
                .ok_or_else(|| field("final_decision"))?;
            let prompt = format!(
                "Context:\n{}\n\nQuestion: {}\n\nBased on the context, answer yes, no or maybe. Reply with a short explanation if you like, then end with \"The answer is yes\", \"The answer is no\" or \"The answer is maybe\".",
                ctx.trim(),
                q.trim()
            );
            Ok(McqItem {
                id,
                prompt,
                labels,
                gold,
                subject: None,
            })
        }
    }
}

/// Parses a JSONL file's text. For MedMCQA, `cop` is read as 1-based unless some row has `cop` 0.
pub fn load_items(format: McqFormat, text: &str) -> Result<Vec<McqItem>, EvalError> {
    let rows: Vec<(usize, &str)> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| (i + 1, l))
        .collect();
    let one_based = format == McqFormat::MedMcqa
        && !rows.iter().any(|(_, l)| {
            serde_json::from_str::<Value>(l)
                .ok()
                .and_then(|v| v.get("cop").and_then(Value::as_u64))
                == Some(0)
        });
    rows.into_iter()
        .map(|(line, l)| load_row(format, l, line, one_based))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mcq::extract_choice;

    #[test]
    fn formats_parse_and_the_prompt_matches_the_extractor() {
        let med = r#"{"id":"m1","question":"Drug of choice for absence seizures?","opa":"Phenytoin","opb":"Ethosuximide","opc":"Carbamazepine","opd":"Gabapentin","cop":2,"subject_name":"Pharmacology"}"#;
        let items = load_items(McqFormat::MedMcqa, med).unwrap();
        assert_eq!(items[0].gold, 1, "cop 2 is option B when no row has cop 0");
        assert!(
            items[0].prompt.contains("B. Ethosuximide")
                && items[0].prompt.contains("The answer is X")
        );
        let labels: Vec<&str> = items[0].labels.iter().map(String::as_str).collect();
        assert_eq!(
            extract_choice(
                "Absence seizures respond to ethosuximide. The answer is B",
                &labels
            ),
            Some(items[0].gold)
        );

        let zero = "{\"question\":\"q\",\"opa\":\"a\",\"opb\":\"b\",\"opc\":\"c\",\"opd\":\"d\",\"cop\":0}\n{\"question\":\"q2\",\"opa\":\"a\",\"opb\":\"b\",\"opc\":\"c\",\"opd\":\"d\",\"cop\":3}";
        let items = load_items(McqFormat::MedMcqa, zero).unwrap();
        assert_eq!(
            (items[0].gold, items[1].gold),
            (0, 3),
            "0-based when a cop of 0 appears"
        );

        let mmlu = r#"{"question":"Which vitamin deficiency causes scurvy?","choices":["A","B12","C","D"],"answer":2,"subject":"clinical_knowledge"}"#;
        let items = load_items(McqFormat::Mmlu, mmlu).unwrap();
        assert_eq!(
            (items[0].gold, items[0].subject.as_deref()),
            (2, Some("clinical_knowledge"))
        );

        let pq = r#"{"QUESTION":"Does aspirin reduce recurrent stroke?","CONTEXTS":["Trial 1 ...","Trial 2 ..."],"final_decision":"yes"}"#;
        let items = load_items(McqFormat::PubMedQa, pq).unwrap();
        assert_eq!(items[0].gold, 0);
        assert!(items[0].prompt.contains("Trial 1 ...\nTrial 2 ..."));

        let e = load_items(
            McqFormat::Mmlu,
            "{\"question\":\"q\",\"choices\":[\"x\",\"y\"],\"answer\":5}",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("line 1") && e.contains("`answer`"), "{e}");
        assert!("csv"
            .parse::<McqFormat>()
            .unwrap_err()
            .to_string()
            .contains("medmcqa, pubmedqa, mmlu"));
    }
}
