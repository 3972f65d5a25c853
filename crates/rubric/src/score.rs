//! From judge labels to exact rewards (docs/METHOD.md §4).
//!
//! A reward is kept as a rational `num / den` of small integers and turned into `f64` by one
//! correctly rounded division, so two responses with the same verdict profile (and the same length
//! penalty) get bit-identical rewards, and exact-tie detection is well defined.

use serde::{Deserialize, Serialize};

use crate::error::{Result, RubricError};

/// How labels are scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScoringMode {
    /// `yes` (1) / `no` (0); reward = fraction of `yes`.
    Binary,
    /// `correct` (+1) / `missing` (0) / `wrong` (-1); reward = mean, in [-1, 1]. The method's default.
    #[default]
    ThreeState,
}

impl ScoringMode {
    /// The labels a judge may give in this mode, in prompt order.
    pub fn labels(self) -> &'static [Label] {
        match self {
            ScoringMode::Binary => &[Label::Yes, Label::No],
            ScoringMode::ThreeState => &[Label::Correct, Label::Missing, Label::Wrong],
        }
    }

    /// `binary` or `three-state`.
    pub fn as_str(self) -> &'static str {
        match self {
            ScoringMode::Binary => "binary",
            ScoringMode::ThreeState => "three-state",
        }
    }
}

impl std::str::FromStr for ScoringMode {
    type Err = RubricError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "binary" => Ok(Self::Binary),
            "three-state" | "three_state" | "threestate" => Ok(Self::ThreeState),
            other => Err(RubricError::Config {
                field: "mode".into(),
                message: format!("`{other}` is not a scoring mode (allowed: three-state, binary)"),
            }),
        }
    }
}

/// A judge's verdict on one criterion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Label {
    /// Binary: the response states or clearly implies the required content, correctly.
    Yes,
    /// Binary: anything else.
    No,
    /// Three-state: the point is addressed correctly (+1).
    Correct,
    /// Three-state: nothing useful is said about the point (0).
    Missing,
    /// Three-state: a factual error, fabrication, contradiction, reversal or substitution (-1).
    Wrong,
}

impl Label {
    /// The label's integer score.
    pub fn score(self) -> i64 {
        match self {
            Label::Yes | Label::Correct => 1,
            Label::No | Label::Missing => 0,
            Label::Wrong => -1,
        }
    }

    /// The label as the judge writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Label::Yes => "yes",
            Label::No => "no",
            Label::Correct => "correct",
            Label::Missing => "missing",
            Label::Wrong => "wrong",
        }
    }

    /// Parses a label of `mode`, ignoring case, surrounding space, quotes and a trailing period.
    /// A label of the other mode is rejected.
    pub fn parse(text: &str, mode: ScoringMode) -> Option<Label> {
        let t = text
            .trim()
            .trim_matches(|c: char| c == '"' || c == '\'' || c == '.' || c == '*')
            .trim()
            .to_ascii_lowercase();
        mode.labels().iter().copied().find(|l| l.as_str() == t)
    }
}

/// The soft overlength penalty: 0 up to `max_tokens - buffer_tokens`, then linear down to -1 at
/// `max_tokens`, and -1 beyond.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LengthPenalty {
    /// Whether the penalty is applied at all.
    pub enabled: bool,
    /// Lmax: the rollout's response-length limit in tokens (8,192 in the published run).
    pub max_tokens: u32,
    /// Lbuf: the length of the linear ramp in tokens. Not fixed by the method; 1,024 by default.
    pub buffer_tokens: u32,
}

impl Default for LengthPenalty {
    fn default() -> Self {
        Self {
            enabled: true,
            max_tokens: 8192,
            buffer_tokens: 1024,
        }
    }
}

impl LengthPenalty {
    /// No penalty.
    pub fn disabled() -> Self {
        Self {
            enabled: false,
            ..Self::default()
        }
    }

    /// Checks `0 < buffer_tokens <= max_tokens`.
    pub fn validate(&self) -> Result<()> {
        if self.enabled && (self.buffer_tokens == 0 || self.buffer_tokens > self.max_tokens) {
            return Err(RubricError::Config {
                field: "length_penalty.buffer_tokens".into(),
                message: format!(
                    "must be in 1..={} (max_tokens), got {}",
                    self.max_tokens, self.buffer_tokens
                ),
            });
        }
        Ok(())
    }

    /// The penalty as `numerator / buffer_tokens`; numerator in `[-buffer_tokens, 0]`.
    fn numerator(&self, len: u32) -> (i64, i64) {
        if !self.enabled {
            return (0, 1);
        }
        let (lmax, lbuf, l) = (
            self.max_tokens as i64,
            self.buffer_tokens as i64,
            len as i64,
        );
        let num = if l <= lmax - lbuf {
            0
        } else if l > lmax {
            -lbuf
        } else {
            lmax - lbuf - l
        };
        (num, lbuf)
    }

    /// The penalty for a response of `len` tokens, in [-1, 0].
    pub fn value(&self, len: u32) -> f64 {
        let (n, d) = self.numerator(len);
        n as f64 / d as f64
    }
}

/// An exact reward `num / den`. Serialised as `{"value": num/den, "num": .., "den": ..}`.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct Reward {
    /// Numerator.
    pub num: i64,
    /// Denominator (positive).
    pub den: i64,
}

impl Serialize for Reward {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("Reward", 3)?;
        st.serialize_field("value", &self.value())?;
        st.serialize_field("num", &self.num)?;
        st.serialize_field("den", &self.den)?;
        st.end()
    }
}

impl Reward {
    /// The reward as one correctly rounded division (numerator and denominator are exact in f64).
    pub fn value(&self) -> f64 {
        self.num as f64 / self.den as f64
    }
}

impl PartialEq for Reward {
    /// Exact rational equality.
    fn eq(&self, other: &Self) -> bool {
        self.num as i128 * other.den as i128 == other.num as i128 * self.den as i128
    }
}

/// A scored response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScoredResponse {
    /// One label per judged criterion, in criterion order.
    pub labels: Vec<Label>,
    /// The labels' integer scores.
    pub scores: Vec<i64>,
    /// Mean criterion score (fraction of `yes` in binary mode).
    pub criteria_mean: f64,
    /// The overlength penalty added to the mean, in [-1, 0].
    pub length_penalty: f64,
    /// Mean plus penalty, exact.
    pub reward: Reward,
}

/// Why a response has no reward.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnscoredReason {
    /// What went wrong on the last attempt.
    pub message: String,
    /// How many judge attempts were made.
    pub attempts: u32,
}

/// A reward given as a float (a reward server, a reward model): no exact fraction behind it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ValueScore {
    /// The reward, finite; `-0.0` is stored as `0.0`.
    pub reward: f64,
}

/// One reward function's part of a [`MixedScore`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RewardPart {
    /// The function's name (`reward.functions[i].name`, its kind by default).
    pub name: String,
    /// Its weight in the mix.
    pub weight: f64,
    /// What it gave the response (scored: every part of a mixed score is).
    pub score: ResponseScore,
}

/// A weighted mix of reward functions (`[[reward.functions]]`): `reward` is
/// `0.0 + w_1 v_1 + w_2 v_2 + ...` in f64, left to right in the list's order, each `v_i` the
/// part's reward (an exact fraction rounded once, or a server's float). Responses whose parts
/// give the same values get bit-identical rewards, so the exact-tie test stays well defined.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MixedScore {
    /// The mixed reward.
    pub reward: f64,
    /// Every function's part, in the list's order.
    pub parts: Vec<RewardPart>,
}

impl MixedScore {
    /// Mixes scored parts: the weighted sum in order, from `0.0` (so a `-0.0` term never
    /// survives). `None` when a part is unscored or the sum is not finite (huge values).
    pub fn mix(parts: Vec<RewardPart>) -> Option<Self> {
        let mut reward = 0.0;
        for p in &parts {
            reward += p.weight * p.score.reward()?;
        }
        reward.is_finite().then_some(Self { reward, parts })
    }
}

/// A response's outcome: a reward, or *unscored* (never the same as reward 0: no advantage, excluded
/// from its group's statistics, and its group is incomplete).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum ResponseScore {
    /// Labels were obtained and scored (or an exact reward was given directly).
    Scored(ScoredResponse),
    /// No valid labels within the retry budget.
    Unscored(UnscoredReason),
    /// A float reward (a reward server).
    Value(ValueScore),
    /// A weighted mix of reward functions.
    Mixed(MixedScore),
}

impl ResponseScore {
    /// The reward value, or `None` when unscored.
    pub fn reward(&self) -> Option<f64> {
        match self {
            ResponseScore::Scored(s) => Some(s.reward.value()),
            ResponseScore::Unscored(_) => None,
            ResponseScore::Value(v) => Some(v.reward),
            ResponseScore::Mixed(m) => Some(m.reward),
        }
    }

    /// A float reward; `None` unless finite. `-0.0` becomes `0.0`, so that equal rewards are
    /// equal bit for bit.
    pub fn value(reward: f64) -> Option<Self> {
        reward
            .is_finite()
            .then_some(ResponseScore::Value(ValueScore {
                reward: reward + 0.0,
            }))
    }

    /// Unscored, with what went wrong and after how many attempts.
    pub fn unscored(message: impl Into<String>, attempts: u32) -> Self {
        ResponseScore::Unscored(UnscoredReason {
            message: message.into(),
            attempts,
        })
    }

    /// A reward given directly (a verifiable check, a reward model): `num / den` exactly, with
    /// no labels and no length penalty. `den` must be positive.
    pub fn exact(num: i64, den: i64) -> Self {
        assert!(
            den > 0,
            "ResponseScore::exact: denominator {den} is not positive"
        );
        let reward = Reward { num, den };
        ResponseScore::Scored(ScoredResponse {
            labels: vec![],
            scores: vec![],
            criteria_mean: reward.value(),
            length_penalty: 0.0,
            reward,
        })
    }

    /// True when scored.
    pub fn is_scored(&self) -> bool {
        !matches!(self, ResponseScore::Unscored(_))
    }

    /// The rubric labels behind the score: a judged score's own, or those of a mix's first
    /// judged part; empty for other rewards.
    pub fn labels(&self) -> &[Label] {
        match self {
            ResponseScore::Scored(s) => &s.labels,
            ResponseScore::Mixed(m) => m
                .parts
                .iter()
                .map(|p| p.score.labels())
                .find(|l| !l.is_empty())
                .unwrap_or(&[]),
            _ => &[],
        }
    }
}

/// Scores one response: `labels` must hold exactly `n_criteria` labels of `mode`;
/// `response_tokens` is the response length for the overlength penalty.
pub fn score_labels(
    labels: &[Label],
    n_criteria: usize,
    mode: ScoringMode,
    response_tokens: u32,
    penalty: &LengthPenalty,
) -> Result<ScoredResponse> {
    if n_criteria == 0 {
        return Err(RubricError::Labels(
            "cannot score against zero criteria".into(),
        ));
    }
    if labels.len() != n_criteria {
        return Err(RubricError::Labels(format!(
            "expected {n_criteria} labels, got {}",
            labels.len()
        )));
    }
    if let Some(bad) = labels.iter().find(|l| !mode.labels().contains(l)) {
        return Err(RubricError::Labels(format!(
            "label `{}` is not a {} label",
            bad.as_str(),
            mode.as_str()
        )));
    }
    let scores: Vec<i64> = labels.iter().map(|l| l.score()).collect();
    // Integer sum in criterion order, then one division per quantity.
    let sum: i64 = scores.iter().sum();
    let n = n_criteria as i64;
    let (p_num, p_den) = penalty.numerator(response_tokens);
    let reward = Reward {
        num: sum * p_den + p_num * n,
        den: n * p_den,
    };
    Ok(ScoredResponse {
        labels: labels.to_vec(),
        scores,
        criteria_mean: sum as f64 / n as f64,
        length_penalty: p_num as f64 / p_den as f64,
        reward,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use Label::*;

    #[test]
    fn three_state_and_binary_means() {
        let p = LengthPenalty::disabled();
        let s = score_labels(
            &[Correct, Wrong, Missing, Correct],
            4,
            ScoringMode::ThreeState,
            10,
            &p,
        )
        .unwrap();
        assert_eq!(s.scores, vec![1, -1, 0, 1]);
        assert_eq!(s.reward.value(), 0.25);
        let s = score_labels(&[Yes, No, Yes], 3, ScoringMode::Binary, 10, &p).unwrap();
        assert_eq!(s.reward.value(), 2.0 / 3.0);
        let all_wrong = score_labels(&[Wrong; 6], 6, ScoringMode::ThreeState, 10, &p).unwrap();
        assert_eq!(all_wrong.reward.value(), -1.0);
    }

    #[test]
    fn labels_must_match_count_and_mode() {
        let p = LengthPenalty::disabled();
        assert!(score_labels(&[Correct], 2, ScoringMode::ThreeState, 1, &p).is_err());
        let e = score_labels(&[Yes, Correct], 2, ScoringMode::ThreeState, 1, &p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`yes` is not a three-state label"), "{e}");
        assert!(score_labels(&[], 0, ScoringMode::Binary, 1, &p).is_err());
        assert_eq!(
            Label::parse(" \"Correct.\" ", ScoringMode::ThreeState),
            Some(Correct)
        );
        assert_eq!(Label::parse("yes", ScoringMode::ThreeState), None);
        assert_eq!(Label::parse("partially", ScoringMode::ThreeState), None);
    }

    #[test]
    fn overlength_penalty_ramp() {
        let p = LengthPenalty {
            enabled: true,
            max_tokens: 100,
            buffer_tokens: 20,
        };
        assert_eq!(p.value(0), 0.0);
        assert_eq!(p.value(80), 0.0);
        assert_eq!(p.value(81), -1.0 / 20.0);
        assert_eq!(p.value(90), -0.5);
        assert_eq!(p.value(100), -1.0);
        assert_eq!(p.value(101), -1.0);
        assert_eq!(p.value(5000), -1.0);
        let s = score_labels(&[Correct, Correct], 2, ScoringMode::ThreeState, 90, &p).unwrap();
        assert_eq!(s.reward.value(), 0.5);
        assert_eq!(s.length_penalty, -0.5);
        assert!(LengthPenalty {
            enabled: true,
            max_tokens: 10,
            buffer_tokens: 11
        }
        .validate()
        .is_err());
    }

    #[test]
    fn equal_verdict_profiles_are_bit_identical() {
        // The same multiset of scores in any order, and equal rationals with different
        // denominators, must give the same f64 bits; naive float accumulation does not always.
        let p = LengthPenalty {
            enabled: true,
            max_tokens: 8192,
            buffer_tokens: 1000,
        };
        let a = score_labels(
            &[Correct, Missing, Wrong, Correct, Correct, Missing, Correct],
            7,
            ScoringMode::ThreeState,
            7500,
            &p,
        )
        .unwrap();
        let b = score_labels(
            &[Wrong, Correct, Correct, Missing, Correct, Correct, Missing],
            7,
            ScoringMode::ThreeState,
            7500,
            &p,
        )
        .unwrap();
        assert_eq!(a.reward.value().to_bits(), b.reward.value().to_bits());
        // 3/7 - 308/1000 computed the naive way is not the exact-rational value everywhere;
        // ours is the single rounding of (3*1000 - 308*7) / 7000.
        assert_eq!(a.reward.value(), (3.0 * 1000.0 - 308.0 * 7.0) / 7000.0);
        let half_a = score_labels(&[Correct, Missing], 2, ScoringMode::ThreeState, 1, &p).unwrap();
        let half_b = score_labels(
            &[Correct, Correct, Missing, Missing],
            4,
            ScoringMode::ThreeState,
            1,
            &p,
        )
        .unwrap();
        assert_eq!(half_a.reward, half_b.reward);
        assert_eq!(
            half_a.reward.value().to_bits(),
            half_b.reward.value().to_bits()
        );
        // Exhaustive check over small rubrics: equal rationals <=> equal bits.
        let mut seen: Vec<(Reward, u64)> = Vec::new();
        for n in 1..=12i64 {
            for s in -n..=n {
                for l in [0u32, 7200, 7300, 8000, 9000] {
                    let labels: Vec<Label> = (0..n)
                        .map(|i| {
                            if i < s.abs() {
                                if s > 0 {
                                    Correct
                                } else {
                                    Wrong
                                }
                            } else {
                                Missing
                            }
                        })
                        .collect();
                    let r = score_labels(&labels, n as usize, ScoringMode::ThreeState, l, &p)
                        .unwrap()
                        .reward;
                    for (q, bits) in &seen {
                        assert_eq!(*q == r, *bits == r.value().to_bits(), "{q:?} vs {r:?}");
                    }
                    seen.push((r, r.value().to_bits()));
                }
            }
        }
    }

    #[test]
    fn unscored_is_not_zero() {
        let u = ResponseScore::Unscored(UnscoredReason {
            message: "garbage".into(),
            attempts: 9,
        });
        assert_eq!(u.reward(), None);
        let json = serde_json::to_string(&u).unwrap();
        assert!(json.contains("\"status\":\"unscored\""), "{json}");
    }
}
