//! Agreement of a probe with the judge it was distilled from: accuracy, macro-F1, Cohen's kappa,
//! per-class precision and recall, and calibration (expected calibration error over ten
//! confidence bins, and the multi-class Brier score).

use std::collections::BTreeMap;

use conrub_rubric::Label;
use serde::{Deserialize, Serialize};

/// One class's agreement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClassAgreement {
    /// Rows the reference judge gave this label.
    pub support: u64,
    /// Of the rows the probe gave this label, the share the judge agrees with.
    pub precision: f64,
    /// Of the judge's rows of this label, the share the probe found.
    pub recall: f64,
    /// Harmonic mean of the two.
    pub f1: f64,
}

/// How well predictions agree with reference labels.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Agreement {
    /// Rows compared.
    pub rows: u64,
    /// Share of rows with the same label.
    pub accuracy: f64,
    /// Unweighted mean of the per-class F1.
    pub macro_f1: f64,
    /// Cohen's kappa: agreement beyond what the two label distributions give by chance (0 is
    /// chance, 1 is perfect).
    pub kappa: f64,
    /// Per class, by label name.
    pub per_class: BTreeMap<String, ClassAgreement>,
    /// `confusion[reference][predicted]`, classes in label-set order.
    pub confusion: Vec<Vec<u64>>,
    /// Expected calibration error of the top-class probability (10 equal-width bins).
    pub ece: f64,
    /// Mean squared distance of the probability vector from the one-hot reference.
    pub brier: f64,
}

/// Agreement of `predicted` (with class probabilities `probs`) against `reference`, both class
/// indices into `labels`.
pub fn agreement(
    labels: &[Label],
    reference: &[usize],
    predicted: &[usize],
    probs: &[Vec<f64>],
) -> Agreement {
    let c = labels.len();
    let n = reference.len();
    let mut confusion = vec![vec![0u64; c]; c];
    for (&r, &p) in reference.iter().zip(predicted) {
        confusion[r][p] += 1;
    }
    let nf = n.max(1) as f64;
    let correct: u64 = (0..c).map(|k| confusion[k][k]).sum();
    let accuracy = correct as f64 / nf;
    let row = |k: usize| confusion[k].iter().sum::<u64>() as f64;
    let col = |k: usize| (0..c).map(|r| confusion[r][k]).sum::<u64>() as f64;
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let mut per_class = BTreeMap::new();
    let mut f1_sum = 0.0;
    for (k, label) in labels.iter().enumerate() {
        let tp = confusion[k][k] as f64;
        let precision = ratio(tp, col(k));
        let recall = ratio(tp, row(k));
        let f1 = ratio(2.0 * precision * recall, precision + recall);
        f1_sum += f1;
        per_class.insert(
            label.as_str().to_string(),
            ClassAgreement {
                support: row(k) as u64,
                precision,
                recall,
                f1,
            },
        );
    }
    let chance: f64 = (0..c).map(|k| row(k) * col(k)).sum::<f64>() / (nf * nf);
    let kappa = if (1.0 - chance).abs() < 1e-12 {
        0.0
    } else {
        (accuracy - chance) / (1.0 - chance)
    };
    let mut bins = [(0.0f64, 0.0f64, 0u64); 10];
    let mut brier = 0.0;
    for ((&r, &p), pr) in reference.iter().zip(predicted).zip(probs) {
        let conf = pr[p];
        let b = ((conf * 10.0) as usize).min(9);
        bins[b].0 += conf;
        bins[b].1 += (r == p) as u8 as f64;
        bins[b].2 += 1;
        brier += pr
            .iter()
            .enumerate()
            .map(|(k, &q)| (q - (k == r) as u8 as f64).powi(2))
            .sum::<f64>();
    }
    let ece = bins
        .iter()
        .filter(|b| b.2 > 0)
        .map(|&(conf, hit, k)| (k as f64 / nf) * (conf / k as f64 - hit / k as f64).abs())
        .sum();
    Agreement {
        rows: n as u64,
        accuracy,
        macro_f1: f1_sum / c.max(1) as f64,
        kappa,
        per_class,
        confusion,
        ece,
        brier: brier / nf,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kappa_f1_and_calibration_by_hand() {
        let labels = [Label::Correct, Label::Missing, Label::Wrong];
        // 10 rows: reference 5 correct, 3 missing, 2 wrong.
        let reference = [0, 0, 0, 0, 0, 1, 1, 1, 2, 2];
        let predicted = [0, 0, 0, 0, 1, 1, 1, 0, 2, 1];
        let probs: Vec<Vec<f64>> = predicted
            .iter()
            .map(|&p| {
                let mut v = vec![0.2; 3];
                v[p] = 0.6;
                v
            })
            .collect();
        let a = agreement(&labels, &reference, &predicted, &probs);
        assert_eq!(
            a.confusion,
            vec![vec![4, 1, 0], vec![1, 2, 0], vec![0, 1, 1]]
        );
        assert!((a.accuracy - 0.7).abs() < 1e-12);
        // Chance agreement: (5·5 + 3·4 + 2·1) / 100 = 0.39.
        assert!((a.kappa - (0.7 - 0.39) / 0.61).abs() < 1e-12);
        let f1 = |p: f64, r: f64| 2.0 * p * r / (p + r);
        let macro_f1 = (f1(0.8, 0.8) + f1(0.5, 2.0 / 3.0) + f1(1.0, 0.5)) / 3.0;
        assert!((a.macro_f1 - macro_f1).abs() < 1e-12);
        assert_eq!(a.per_class["wrong"].support, 2);
        // Every row has confidence 0.6 and 70% are right: ECE = |0.6 - 0.7|.
        assert!((a.ece - 0.1).abs() < 1e-12);
        // Right rows: 0.4² + 0.2² + 0.2² = 0.24; wrong rows: 0.6² + 0.8² + 0.2² = 1.04.
        assert!((a.brier - (7.0 * 0.24 + 3.0 * 1.04) / 10.0).abs() < 1e-12);
        // Labels independent of the reference give kappa 0.
        let a = agreement(
            &labels[..2],
            &[0, 0, 1, 1],
            &[0, 1, 0, 1],
            &vec![vec![0.5, 0.5]; 4],
        );
        assert!(a.kappa.abs() < 1e-12);
    }
}
