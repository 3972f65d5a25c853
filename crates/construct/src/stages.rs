//! The deterministic steps of construction (docs/METHOD.md §3, steps 2, 4-7 without the model calls):
//! candidate checks, cleaning the reviewer's grouping, the consensus filter, the representative
//! choice, and the finish (exact dedup, cap under dimension quotas). Plain code, no model decisions.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use conrub_rubric::validate::is_problematic_negative;
use conrub_rubric::Coverage;
use serde::{Deserialize, Serialize};

use crate::config::BuildSettings;
use crate::parse::RawCandidate;

/// What the deterministic checks made of one proposed criterion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Check {
    /// Valid: it gets an id and goes on.
    Ok,
    /// No text.
    Empty,
    /// Fewer words than `min_words`.
    UnderSpecified,
    /// Not starting "The response", several lines, too long, or a bad coverage tag.
    Malformed,
    /// The same text (case and spacing aside) as an earlier candidate of the same sample.
    Duplicate,
    /// A word sequence repeating inside the text (degenerate output).
    Repetitive,
    /// Beyond `candidates_max` valid candidates.
    OverLimit,
}

/// One proposed criterion after the checks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// `A3`: generator letter and index among the sample's valid candidates (valid ones only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The cleaned text (the raw text when it could not be cleaned).
    pub text: String,
    /// The coverage tag (`None` without a reference answer).
    pub coverage: Option<Coverage>,
    /// The check result.
    pub check: Check,
}

/// Lower-cased, whitespace-collapsed text without a final period: the key of exact duplicates.
pub fn dedup_key(text: &str) -> String {
    let t = text
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase();
    t.trim_end_matches(['.', ' ']).to_string()
}

/// Trims, removes list markers (`1.`, `-`, `*`), collapses spaces and capitalises a leading
/// "the response".
pub fn clean_text(text: &str) -> String {
    let mut t = text.trim();
    let digits = t.chars().take_while(char::is_ascii_digit).count();
    if digits > 0 && t[digits..].starts_with(['.', ')']) {
        t = t[digits + 1..].trim_start();
    } else if t.starts_with(['-', '*', '•']) {
        t = t.trim_start_matches(['-', '*', '•']).trim_start();
    }
    let t = t.split_whitespace().collect::<Vec<_>>().join(" ");
    match t.get(..12) {
        Some(head) if head.eq_ignore_ascii_case("the response") => {
            format!("The response{}", &t[12..])
        }
        _ => t,
    }
}

fn starts_with_the_response(t: &str) -> bool {
    t.len() > 13 && t.starts_with("The response") && t[12..].starts_with(' ')
}

/// True when a word trigram occurs three or more times (a generation loop).
pub fn is_repetitive(text: &str) -> bool {
    let words: Vec<String> = text.split_whitespace().map(|w| w.to_lowercase()).collect();
    let mut counts: HashMap<&[String], usize> = HashMap::new();
    words.windows(3).any(|w| {
        let c = counts.entry(w).or_insert(0);
        *c += 1;
        *c >= 3
    })
}

fn coverage_of(tag: Option<&str>) -> Result<Coverage, ()> {
    match tag {
        Some("yes") | Some("y") | Some("covered") => Ok(Coverage::Yes),
        Some("no") | Some("n") | Some("not covered") | Some("beyond") => Ok(Coverage::No),
        _ => Err(()),
    }
}

/// Step 2: checks one generator's proposals in order and ids the valid ones `{letter}{n}`.
pub fn check_sample(
    letter: char,
    raw: &[RawCandidate],
    has_reference: bool,
    s: &BuildSettings,
) -> Vec<Candidate> {
    let mut seen = HashSet::new();
    let mut valid = 0usize;
    raw.iter()
        .map(|r| {
            let original = r.text.clone().unwrap_or_default();
            let text = clean_text(&original);
            let coverage = if has_reference {
                coverage_of(r.coverage.as_deref()).ok()
            } else {
                None
            };
            let check = if text.is_empty() {
                Check::Empty
            } else if !starts_with_the_response(&text)
                || original.trim().contains('\n')
                || text.chars().count() > s.max_chars
                || (has_reference && coverage.is_none())
            {
                Check::Malformed
            } else if text.split_whitespace().count() < s.min_words {
                Check::UnderSpecified
            } else if is_repetitive(&text) {
                Check::Repetitive
            } else if !seen.insert(dedup_key(&text)) {
                Check::Duplicate
            } else if valid >= s.candidates_max {
                Check::OverLimit
            } else {
                Check::Ok
            };
            let id = (check == Check::Ok).then(|| {
                valid += 1;
                format!("{letter}{valid}")
            });
            Candidate {
                id,
                text: if text.is_empty() { original } else { text },
                coverage,
                check,
            }
        })
        .collect()
}

/// The reviewer's grouping after cleaning.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CleanGrouping {
    /// Non-empty groups of known ids, each id in at most one group, in the reviewer's order.
    pub groups: Vec<Vec<String>>,
    /// Ids the reviewer named that are not valid candidates.
    pub unknown_ids: usize,
    /// Ids already placed in an earlier group (the first placement wins).
    pub repeated_ids: usize,
}

/// Step 4 (deterministic part): drops unknown and repeated ids and empty groups.
pub fn clean_grouping(groups: &[Vec<String>], valid: &HashSet<&str>) -> CleanGrouping {
    let mut placed = HashSet::new();
    let mut out = CleanGrouping::default();
    for g in groups {
        let mut members = Vec::new();
        for id in g {
            if !valid.contains(id.as_str()) {
                out.unknown_ids += 1;
            } else if !placed.insert(id.clone()) {
                out.repeated_ids += 1;
            } else {
                members.push(id.clone());
            }
        }
        if !members.is_empty() {
            out.groups.push(members);
        }
    }
    out
}

/// Step 5's outcome for a cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Consensus {
    /// All three generators support it and the tags agree.
    Kept,
    /// Fewer than three generators support it.
    PartialSupport,
    /// Members disagree on the reference-coverage tag.
    TagDisagreement,
}

/// The generator letters of a cluster's members, sorted.
pub fn support(members: &[String]) -> Vec<char> {
    members
        .iter()
        .filter_map(|m| m.chars().next())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// Step 5: unanimous support, and where tags exist, one tag for all members.
pub fn consensus(members: &[String], tags: &[Option<Coverage>], generators: usize) -> Consensus {
    if support(members).len() < generators {
        Consensus::PartialSupport
    } else if tags.iter().any(|t| *t != tags[0]) {
        Consensus::TagDisagreement
    } else {
        Consensus::Kept
    }
}

/// Step 6's initial text: the longest member (in characters); the first one on a tie.
pub fn representative<'a>(members: &'a [String], text_of: impl Fn(&str) -> &'a str) -> &'a str {
    let mut best = &members[0];
    for m in &members[1..] {
        if text_of(m).chars().count() > text_of(best).chars().count() {
            best = m;
        }
    }
    best
}

/// What the finish did with a surviving criterion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// In the final rubric.
    Kept,
    /// The same text as an earlier kept criterion.
    Duplicate,
    /// Its dimension's quota or the content cap was full.
    OverQuota,
}

/// Step 7: walks `(text, dimension)` in cluster order, removes exact duplicates, and keeps at most
/// `max_content` criteria with at most `quotas[dimension]` per dimension (unknown dimensions
/// count as `other`).
pub fn finish(
    items: &[(String, String)],
    quotas: &BTreeMap<String, usize>,
    max_content: usize,
) -> Vec<Finish> {
    let mut seen = HashSet::new();
    let mut used: BTreeMap<&str, usize> = BTreeMap::new();
    let mut kept = 0;
    items
        .iter()
        .map(|(text, dim)| {
            if !seen.insert(dedup_key(text)) {
                return Finish::Duplicate;
            }
            let dim = if quotas.contains_key(dim.as_str()) {
                dim.as_str()
            } else {
                "other"
            };
            let n = used.entry(dim).or_insert(0);
            if kept >= max_content || *n >= quotas.get(dim).copied().unwrap_or(0) {
                return Finish::OverQuota;
            }
            *n += 1;
            kept += 1;
            Finish::Kept
        })
        .collect()
}

/// Why a rewrite or a kept text cannot stand (`None`: it can).
pub fn unusable_text(text: &str, s: &BuildSettings) -> Option<&'static str> {
    let t = clean_text(text);
    if !starts_with_the_response(&t)
        || t.chars().count() > s.max_chars
        || t.split_whitespace().count() < s.min_words
    {
        Some("rewrite_invalid")
    } else if is_problematic_negative(&t) {
        Some("problematic_negative")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(text: &str, cov: Option<&str>) -> RawCandidate {
        RawCandidate {
            text: Some(text.into()),
            coverage: cov.map(str::to_string),
        }
    }

    #[test]
    fn checks_classify_and_number_valid_candidates() {
        let s = BuildSettings {
            candidates_max: 3,
            ..Default::default()
        };
        let out = check_sample(
            'B',
            &[
                raw(
                    "1. the response names aspirin as the first drug.",
                    Some("yes"),
                ),
                RawCandidate {
                    text: None,
                    coverage: Some("yes".into()),
                },
                raw("Names aspirin as the first drug.", Some("yes")),
                raw("The response is good.", Some("yes")),
                raw("The response names aspirin as the first drug", Some("no")),
                raw(
                    "The response gives the dose of aspirin in mg.",
                    Some("maybe"),
                ),
                raw(
                    "The response says take it take it take it take it daily.",
                    Some("no"),
                ),
                raw("The response gives the dose of aspirin in mg.", Some("no")),
                raw("The response explains why aspirin helps here.", Some("yes")),
                raw(
                    "The response lists three aspirin side effects clearly.",
                    Some("yes"),
                ),
            ],
            true,
            &s,
        );
        let checks: Vec<Check> = out.iter().map(|c| c.check).collect();
        use Check::*;
        assert_eq!(
            checks,
            [
                Ok,
                Empty,
                Malformed,
                UnderSpecified,
                Duplicate,
                Malformed,
                Repetitive,
                Ok,
                Ok,
                OverLimit
            ]
        );
        assert_eq!(out[0].text, "The response names aspirin as the first drug.");
        assert_eq!(out[0].id.as_deref(), Some("B1"));
        assert_eq!(
            (out[7].id.as_deref(), out[7].coverage),
            (Some("B2"), Some(Coverage::No))
        );
        // Without a reference the tags are ignored.
        let no_ref = check_sample(
            'A',
            &[raw("The response gives the dose in mg.", None)],
            false,
            &s,
        );
        assert_eq!((no_ref[0].check, no_ref[0].coverage), (Ok, None));
    }

    #[test]
    fn grouping_consensus_representative_and_finish() {
        let valid: HashSet<&str> = ["A1", "A2", "B1", "C1", "C2"].into();
        let g = clean_grouping(
            &[
                vec!["A1".into(), "B1".into(), "Z9".into(), "C1".into()],
                vec!["A1".into(), "A2".into()],
                vec!["Q".into()],
            ],
            &valid,
        );
        assert_eq!(g.groups, vec![vec!["A1", "B1", "C1"], vec!["A2"]]);
        assert_eq!((g.unknown_ids, g.repeated_ids), (2, 1));
        let y = Some(Coverage::Yes);
        assert_eq!(consensus(&g.groups[0], &[y, y, y], 3), Consensus::Kept);
        assert_eq!(
            consensus(&g.groups[0], &[y, Some(Coverage::No), y], 3),
            Consensus::TagDisagreement
        );
        assert_eq!(consensus(&g.groups[1], &[y], 3), Consensus::PartialSupport);
        let texts: HashMap<&str, &str> = [("A1", "abc"), ("B1", "abcd"), ("C1", "wxyz")].into();
        assert_eq!(representative(&g.groups[0], |id| texts[id]), "B1");

        let q: BTreeMap<String, usize> =
            [("safety".to_string(), 1), ("other".to_string(), 5)].into();
        let items: Vec<(String, String)> = [
            ("The response a.", "safety"),
            ("the response  A", "other"),
            ("The response b.", "safety"),
            ("The response c.", "whatever"),
            ("The response d.", "other"),
            ("The response e.", "other"),
        ]
        .iter()
        .map(|(t, d)| (t.to_string(), d.to_string()))
        .collect();
        use Finish::*;
        assert_eq!(
            finish(&items, &q, 3),
            [Kept, Duplicate, OverQuota, Kept, Kept, OverQuota]
        );
    }

    #[test]
    fn unusable_texts() {
        let s = BuildSettings::default();
        assert_eq!(
            unusable_text(
                "The response states that warfarin is contraindicated in pregnancy.",
                &s
            ),
            None
        );
        assert_eq!(
            unusable_text("The response does not mention herbal remedies at all.", &s),
            Some("problematic_negative")
        );
        assert_eq!(
            unusable_text("Mentions the dose.", &s),
            Some("rewrite_invalid")
        );
    }
}
