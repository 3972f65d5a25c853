//! Reward functions beside the rubric judge (`[[reward.functions]]`): their config entry
//! ([`RewardFunctionSpec`]) and the verifiable checks ([`AnswerCheck`]) that give a response 1
//! or 0 against a prompt's `ground_truth` (exact or numeric match) or a pattern (regex, format).
//!
//! A check that finds no answer in a response gives 0 (a wrong answer); only a prompt without the
//! ground truth its check needs cannot be scored, and training refuses such records up front.

use regex::Regex;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Result, RubricError};

fn one() -> f64 {
    1.0
}

/// One entry of `[[reward.functions]]`: a kind, a weight, an optional name and the kind's own
/// options (every other key of the entry, checked by the kind).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RewardFunctionSpec {
    /// The registered kind: `rubric`, `exact`, `numeric`, `regex`, `format`, `http`, or an
    /// embedder's own.
    pub kind: String,
    /// Names the function in samples and errors (its kind by default; unique in the list).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Its weight in the mix (finite, not zero; default 1).
    #[serde(default = "one")]
    pub weight: f64,
    /// The kind's options.
    #[serde(flatten)]
    pub options: serde_json::Map<String, serde_json::Value>,
}

impl RewardFunctionSpec {
    /// An entry of `kind` with weight `weight` and no options.
    pub fn new(kind: impl Into<String>, weight: f64) -> Self {
        Self {
            kind: kind.into(),
            name: None,
            weight,
            options: Default::default(),
        }
    }

    /// Adds the option `key = value`.
    pub fn with(mut self, key: &str, value: impl Into<serde_json::Value>) -> Self {
        self.options.insert(key.into(), value.into());
        self
    }

    /// The name in samples and errors: `name`, else the kind.
    pub fn name(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.kind)
    }

    /// The kind's options as `O` (a struct that denies unknown fields); errors name the key
    /// under `at` (e.g. `reward.functions[1]`).
    pub fn options<O: DeserializeOwned>(&self, at: &str) -> Result<O> {
        let value = serde_json::Value::Object(self.options.clone());
        serde_path_to_error::deserialize(value).map_err(|e| {
            let path = e.path().to_string();
            let field = if path == "." {
                at.to_string()
            } else {
                format!("{at}.{path}")
            };
            RubricError::Config {
                field,
                message: format!("{} (kind `{}`)", e.into_inner(), self.kind),
            }
        })
    }
}

/// Where a check finds the answer in a response.
#[derive(Debug, Clone)]
pub enum Extract {
    /// The whole response, trimmed.
    Whole,
    /// The last non-empty line.
    LastLine,
    /// The content of the last `\boxed{...}` (braces balanced).
    Boxed,
    /// The last number (numeric checks' default).
    LastNumber,
    /// The last match of a regex: its first capture group, or the whole match without groups.
    Pattern(Regex),
}

/// The options of `exact` and `numeric`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct AnswerOptions {
    extract: Option<String>,
    pattern: Option<String>,
    #[serde(default)]
    case_sensitive: bool,
    tolerance: Option<f64>,
    relative_tolerance: Option<f64>,
}

/// The options of `regex` and `format`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PatternOptions {
    pattern: String,
}

/// A verifiable reward: 1 when the response passes, else 0.
#[derive(Debug, Clone)]
pub enum AnswerCheck {
    /// The extracted answer equals the ground truth after normalising both (surrounding space,
    /// runs of whitespace, one trailing period; case unless `case_sensitive`).
    Exact {
        /// Where the answer is (default: the whole response).
        extract: Extract,
        /// Compare case.
        case_sensitive: bool,
    },
    /// The last number of the extracted answer is within `max(tolerance, relative_tolerance *
    /// |truth|)` of the ground truth's number.
    Numeric {
        /// Where the answer is (default: the whole response's last number).
        extract: Extract,
        /// Absolute tolerance (default 1e-6).
        tolerance: f64,
        /// Relative tolerance (default 0).
        relative_tolerance: f64,
    },
    /// The pattern is found somewhere in the response.
    Regex(Regex),
    /// The whole response matches the pattern (`.` also matches newlines).
    Format(Regex),
}

/// A number: sign, ASCII digits (thousands may be grouped by commas), decimals, exponent.
const NUMBER: &str = r"[-+]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|[-+]?\.[0-9]+(?:[eE][-+]?[0-9]+)?";

fn config_error(field: String, message: impl Into<String>) -> RubricError {
    RubricError::Config {
        field,
        message: message.into(),
    }
}

fn compile(pattern: &str, field: String) -> Result<Regex> {
    Regex::new(pattern).map_err(|e| config_error(field, format!("not a regex: {e}")))
}

impl AnswerCheck {
    /// The check of a `exact`, `numeric`, `regex` or `format` entry; `None` for other kinds.
    /// `at` names the entry in errors (`reward.functions[1]`).
    pub fn from_spec(spec: &RewardFunctionSpec, at: &str) -> Result<Option<Self>> {
        let check = match spec.kind.as_str() {
            "exact" | "numeric" => {
                let o: AnswerOptions = spec.options(at)?;
                let extract = extraction(&o, spec.kind == "numeric", at)?;
                if spec.kind == "exact" {
                    if let Some(field) = o
                        .tolerance
                        .map(|_| "tolerance")
                        .or(o.relative_tolerance.map(|_| "relative_tolerance"))
                    {
                        let why = "only `numeric` functions have tolerances";
                        return Err(config_error(format!("{at}.{field}"), why));
                    }
                    AnswerCheck::Exact {
                        extract,
                        case_sensitive: o.case_sensitive,
                    }
                } else {
                    if o.case_sensitive {
                        let why = "only `exact` functions compare case";
                        return Err(config_error(format!("{at}.case_sensitive"), why));
                    }
                    let tolerance = tolerance_ok(o.tolerance.unwrap_or(1e-6), at, "tolerance")?;
                    let relative = o.relative_tolerance.unwrap_or(0.0);
                    let relative_tolerance = tolerance_ok(relative, at, "relative_tolerance")?;
                    AnswerCheck::Numeric {
                        extract,
                        tolerance,
                        relative_tolerance,
                    }
                }
            }
            "regex" => {
                let o: PatternOptions = spec.options(at)?;
                AnswerCheck::Regex(compile(&o.pattern, format!("{at}.pattern"))?)
            }
            "format" => {
                let o: PatternOptions = spec.options(at)?;
                let anchored = format!(r"\A(?s:{})\z", o.pattern);
                AnswerCheck::Format(compile(&anchored, format!("{at}.pattern"))?)
            }
            _ => return Ok(None),
        };
        Ok(Some(check))
    }

    /// Whether the check compares against a prompt's `ground_truth`.
    pub fn needs_ground_truth(&self) -> bool {
        matches!(
            self,
            AnswerCheck::Exact { .. } | AnswerCheck::Numeric { .. }
        )
    }

    /// Checks a prompt's ground truth before training: present where needed, and one number
    /// for a numeric check.
    pub fn check_ground_truth(&self, truth: Option<&str>) -> Result<()> {
        match self {
            AnswerCheck::Exact { .. } => required(truth).map(|_| ()),
            AnswerCheck::Numeric { .. } => numeric_truth(required(truth)?).map(|_| ()),
            AnswerCheck::Regex(_) | AnswerCheck::Format(_) => Ok(()),
        }
    }

    /// Whether `response` passes against `truth`; `Err` when the prompt has no usable ground
    /// truth (the response is then unscored, never 0).
    pub fn passes(&self, response: &str, truth: Option<&str>) -> Result<bool> {
        Ok(match self {
            AnswerCheck::Exact {
                extract,
                case_sensitive,
            } => {
                let truth = required(truth)?;
                extract
                    .find(response)
                    .is_some_and(|a| same_answer(&a, truth, *case_sensitive))
            }
            AnswerCheck::Numeric {
                extract,
                tolerance,
                relative_tolerance,
            } => {
                let want = numeric_truth(required(truth)?)?;
                let got = extract.find(response).and_then(|a| last_number(&a));
                got.is_some_and(|x| {
                    (x - want).abs() <= tolerance.max(relative_tolerance * want.abs())
                })
            }
            AnswerCheck::Regex(re) => re.is_match(response),
            AnswerCheck::Format(re) => re.is_match(response),
        })
    }
}

/// The ground truth a comparing check needs.
fn required(truth: Option<&str>) -> Result<&str> {
    truth.ok_or(RubricError::MissingGroundTruth)
}

/// A numeric check's ground truth: one number.
fn numeric_truth(truth: &str) -> Result<f64> {
    parse_number(truth.trim()).ok_or_else(|| RubricError::GroundTruthNotANumber {
        truth: truth.to_string(),
    })
}

fn extraction(o: &AnswerOptions, numeric: bool, at: &str) -> Result<Extract> {
    let field = || format!("{at}.extract");
    Ok(match (o.extract.as_deref(), &o.pattern) {
        (None | Some("pattern"), Some(p)) => Extract::Pattern(compile(p, format!("{at}.pattern"))?),
        (Some("pattern"), None) => {
            return Err(config_error(
                field(),
                "`pattern` extraction needs a `pattern`",
            ))
        }
        (Some(other), Some(_)) => {
            let why = format!("`extract = \"{other}\"` and a `pattern` contradict each other");
            return Err(config_error(field(), why));
        }
        (None, None) if numeric => Extract::LastNumber,
        (None | Some("whole"), None) => Extract::Whole,
        (Some("last-line"), None) => Extract::LastLine,
        (Some("boxed"), None) => Extract::Boxed,
        (Some("last-number"), None) => Extract::LastNumber,
        (Some(other), None) => {
            let why = format!(
                "`{other}` is not an extraction (allowed: whole, last-line, boxed, last-number, pattern)"
            );
            return Err(config_error(field(), why));
        }
    })
}

fn tolerance_ok(t: f64, at: &str, key: &str) -> Result<f64> {
    if t.is_finite() && t >= 0.0 {
        Ok(t)
    } else {
        let why = format!("{t} is not a finite tolerance >= 0");
        Err(config_error(format!("{at}.{key}"), why))
    }
}

impl Extract {
    /// The answer in `response`, if there is one.
    pub fn find(&self, response: &str) -> Option<String> {
        match self {
            Extract::Whole => Some(response.trim().to_string()),
            Extract::LastLine => response
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map(|l| l.trim().to_string()),
            Extract::Boxed => last_boxed(response),
            Extract::LastNumber => number_matches(response).pop().map(|(s, _)| s),
            Extract::Pattern(re) => re.captures_iter(response).last().map(|c| {
                c.get(1)
                    .or_else(|| c.get(0))
                    .map_or(String::new(), |m| m.as_str().to_string())
            }),
        }
    }
}

/// The content of the last `\boxed{...}` with balanced braces.
fn last_boxed(text: &str) -> Option<String> {
    let start = text.rfind("\\boxed{")? + "\\boxed{".len();
    let mut depth = 1usize;
    for (i, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(text[start..start + i].trim().to_string());
                }
            }
            _ => {}
        }
    }
    None
}

fn number_regex() -> &'static Regex {
    static RE: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    RE.get_or_init(|| Regex::new(NUMBER).expect("the number pattern compiles"))
}

/// The numbers of `text` as (text, value), in order. A sign right after a letter or digit is a
/// hyphen, not a sign ("3-4 days" holds 3 and 4).
fn number_matches(text: &str) -> Vec<(String, f64)> {
    number_regex()
        .find_iter(text)
        .filter_map(|m| {
            let mut s = m.as_str();
            let before = text[..m.start()].chars().next_back();
            if s.starts_with(['-', '+']) && before.is_some_and(char::is_alphanumeric) {
                s = &s[1..];
            }
            let value = s.replace(',', "").parse::<f64>().ok()?;
            Some((s.to_string(), value))
        })
        .collect()
}

fn last_number(text: &str) -> Option<f64> {
    number_matches(text).last().map(|(_, v)| *v)
}

/// `text` as exactly one number (thousands commas allowed), else `None`.
pub fn parse_number(text: &str) -> Option<f64> {
    let m = number_regex().find(text)?;
    (m.start() == 0 && m.end() == text.len())
        .then(|| text.replace(',', "").parse::<f64>().ok())
        .flatten()
        .filter(|v| v.is_finite())
}

fn normalise(text: &str, case_sensitive: bool) -> String {
    let words: Vec<&str> = text.split_whitespace().collect();
    let joined = words.join(" ");
    let trimmed = joined.strip_suffix('.').unwrap_or(&joined).trim_end();
    if case_sensitive {
        trimmed.to_string()
    } else {
        trimmed.to_lowercase()
    }
}

fn same_answer(answer: &str, truth: &str, case_sensitive: bool) -> bool {
    normalise(answer, case_sensitive) == normalise(truth, case_sensitive)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(spec: RewardFunctionSpec) -> AnswerCheck {
        AnswerCheck::from_spec(&spec, "reward.functions[0]")
            .unwrap()
            .unwrap()
    }

    fn err(spec: RewardFunctionSpec) -> String {
        AnswerCheck::from_spec(&spec, "reward.functions[2]")
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn exact_match_normalises_space_case_and_a_final_period() {
        let c = check(RewardFunctionSpec::new("exact", 1.0));
        assert_eq!(
            c.passes("  Metformin.\n", Some("metformin")).ok(),
            Some(true)
        );
        assert_eq!(
            c.passes("metformin  XR", Some("Metformin XR")).ok(),
            Some(true)
        );
        assert_eq!(
            c.passes("metformin, probably", Some("metformin")).ok(),
            Some(false)
        );
        let cs = check(RewardFunctionSpec::new("exact", 1.0).with("case_sensitive", true));
        assert_eq!(cs.passes("Metformin", Some("metformin")).ok(), Some(false));
        let line = check(RewardFunctionSpec::new("exact", 1.0).with("extract", "last-line"));
        assert_eq!(
            line.passes("Thinking...\n\nAnswer B\n", Some("answer b"))
                .ok(),
            Some(true)
        );
        let boxed = check(RewardFunctionSpec::new("exact", 1.0).with("extract", "boxed"));
        assert_eq!(
            boxed
                .passes(
                    r"so \boxed{x} then \boxed{\frac{1}{2}}",
                    Some(r"\frac{1}{2}")
                )
                .ok(),
            Some(true)
        );
        assert_eq!(boxed.passes("no box", Some("x")).ok(), Some(false));
        let tagged =
            check(RewardFunctionSpec::new("exact", 1.0).with("pattern", r"<answer>(.*?)</answer>"));
        assert_eq!(
            tagged
                .passes("<answer>A</answer> <answer>c</answer>", Some("C"))
                .ok(),
            Some(true)
        );
    }

    #[test]
    fn numeric_match_takes_the_last_number_within_the_tolerance() {
        let c = check(RewardFunctionSpec::new("numeric", 1.0).with("tolerance", 0.5));
        assert_eq!(c.passes("chew 300 mg", Some("300")).ok(), Some(true));
        assert_eq!(c.passes("about 1,200.4 mg", Some("1200")).ok(), Some(true));
        assert_eq!(
            c.passes("between 299 and 301.5", Some("300")).ok(),
            Some(false)
        );
        assert_eq!(c.passes("no number here", Some("300")).ok(), Some(false));
        // A hyphen after a digit is not a minus sign.
        assert_eq!(c.passes("3-4 days", Some("4")).ok(), Some(true));
        assert_eq!(c.passes("it fell to -4", Some("-4")).ok(), Some(true));
        let rel = check(RewardFunctionSpec::new("numeric", 1.0).with("relative_tolerance", 0.01));
        assert_eq!(rel.passes("1009", Some("1000")).ok(), Some(true));
        assert_eq!(rel.passes("1011", Some("1000")).ok(), Some(false));
        assert_eq!(rel.passes("2.5e3", Some("2500")).ok(), Some(true));
    }

    #[test]
    fn regex_searches_and_format_matches_the_whole_response() {
        let r = check(RewardFunctionSpec::new("regex", 1.0).with("pattern", r"(?i)emergency"));
        assert_eq!(r.passes("Call EMERGENCY services", None).ok(), Some(true));
        assert_eq!(r.passes("rest", None).ok(), Some(false));
        let f = check(
            RewardFunctionSpec::new("format", 1.0).with("pattern", r"<think>.*</think>\s*\S.*"),
        );
        assert_eq!(
            f.passes("<think>a\nb</think>\nAnswer", None).ok(),
            Some(true)
        );
        assert_eq!(
            f.passes("Answer <think>x</think> y", None).ok(),
            Some(false)
        );
        assert!(!r.needs_ground_truth() && !f.needs_ground_truth());
    }

    #[test]
    fn ground_truth_is_required_and_numeric_truth_is_one_number() {
        let n = check(RewardFunctionSpec::new("numeric", 1.0));
        assert!(n
            .check_ground_truth(None)
            .unwrap_err()
            .to_string()
            .contains("ground_truth"));
        assert!(n.check_ground_truth(Some("300 mg")).is_err());
        assert!(n.check_ground_truth(Some(" 1,500 ")).is_ok());
        assert!(n.passes("300", None).is_err());
        assert!(check(RewardFunctionSpec::new("exact", 1.0))
            .check_ground_truth(Some("any text"))
            .is_ok());
    }

    #[test]
    fn bad_options_name_the_key() {
        let e = err(RewardFunctionSpec::new("numeric", 1.0).with("tolerence", 0.1));
        assert!(
            e.contains("reward.functions[2]") && e.contains("tolerence"),
            "{e}"
        );
        let e = err(RewardFunctionSpec::new("exact", 1.0).with("tolerance", 0.1));
        assert!(e.contains("reward.functions[2].tolerance"), "{e}");
        let e = err(RewardFunctionSpec::new("regex", 1.0).with("pattern", "(unclosed"));
        assert!(e.contains("reward.functions[2].pattern"), "{e}");
        let e = err(RewardFunctionSpec::new("regex", 1.0));
        assert!(e.contains("pattern"), "{e}");
        let e = err(RewardFunctionSpec::new("numeric", 1.0).with("tolerance", -1.0));
        assert!(e.contains("reward.functions[2].tolerance"), "{e}");
        let e = err(RewardFunctionSpec::new("exact", 1.0).with("extract", "first-word"));
        assert!(
            e.contains("reward.functions[2].extract") && e.contains("last-line"),
            "{e}"
        );
        assert!(
            AnswerCheck::from_spec(&RewardFunctionSpec::new("http", 1.0), "x")
                .unwrap()
                .is_none()
        );
    }
}
