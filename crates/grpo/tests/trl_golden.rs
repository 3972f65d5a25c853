//! Advantages, loss values, gradients and clip fractions against Hugging Face TRL's GRPO
//! (`testdata/trl_golden.py`, TRL 1.16.0): loss types grpo / bnpo / dr_grpo, epsilon 0.2,
//! epsilon_high 0.28, `scale_rewards` "group" and "none", with and without the k3 KL term;
//! GSPO's sequence-level ratio (`learner.loss = "gspo"`, TRL's `importance_sampling_level =
//! "sequence"`) and masked truncated responses (`learner.mask_truncated`, TRL's
//! `mask_truncated_completions`).

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Tensor, TensorData};
use conrub_grpo::{
    mask_rows, AdvantageEstimator, Aggregation, Clip, GroupRelative, ImportanceLevel, KlEstimator,
    PolicyLoss, ScaleRewards, SurrogateBatch,
};
use serde_json::Value;

type B = Autodiff<Flex>;

fn golden() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/trl_golden.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn matrix(v: &Value) -> (Vec<f32>, [usize; 2]) {
    let rows = v.as_array().unwrap();
    let cols = rows[0].as_array().unwrap().len();
    let data = rows
        .iter()
        .flat_map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
        })
        .collect();
    (data, [rows.len(), cols])
}

fn tensor2(v: &Value) -> Tensor<B, 2> {
    let (d, s) = matrix(v);
    Tensor::from_data(TensorData::new(d, s), &Default::default())
}

#[test]
fn advantages_match_trl_with_and_without_std_scaling() {
    let g = golden();
    let a = &g["advantages"];
    for (scale, key) in [
        (ScaleRewards::Group, "advantages"),
        (ScaleRewards::None, "advantages_unscaled"),
    ] {
        let wanted = a[key].as_array().unwrap();
        assert_eq!(wanted.len(), 5, "{key}");
        for (rewards, want) in a["rewards"].as_array().unwrap().iter().zip(wanted) {
            let r: Vec<Option<f64>> = rewards
                .as_array()
                .unwrap()
                .iter()
                .map(Value::as_f64)
                .collect();
            let got = GroupRelative { scale }.advantages(&r);
            for (x, y) in got.iter().zip(want.as_array().unwrap()) {
                let y = y.as_f64().unwrap();
                // TRL's nanstd computes Bessel's factor count / (count - 1) in float32 (integer
                // tensors divide to float32), so its f64 advantages carry a ~2e-8 relative error.
                assert!(
                    (x - y).abs() <= 1e-7 * y.abs().max(1.0),
                    "{scale:?} {r:?}: {got:?} vs {want}"
                );
            }
        }
    }
    // The two settings differ wherever a group has signal.
    assert_ne!(a["advantages"], a["advantages_unscaled"]);
}

#[test]
fn loss_values_gradients_and_clip_fractions_match_trl() {
    let g = golden();
    let l = &g["loss"];
    let t = l["max_completion_length"].as_u64().unwrap() as usize;
    let adv: Vec<f32> = l["advantages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    for case in l["cases"].as_array().unwrap() {
        let loss_type = case["loss_type"].as_str().unwrap();
        let beta = case["beta"].as_f64().unwrap();
        let aggregation = match loss_type {
            "grpo" => Aggregation::SequenceMean,
            "bnpo" => Aggregation::GlobalTokenMean,
            "dr_grpo" => Aggregation::DrGrpo,
            other => panic!("{other}"),
        };
        let sequence = case["importance_sampling_level"] == "sequence";
        let mask_truncated = case["mask_truncated"].as_bool().unwrap();
        // The learner's own rule: rows of truncated responses leave the loss mask.
        let keep: Vec<bool> = l["truncated"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| !(mask_truncated && t.as_bool().unwrap()))
            .collect();
        let logp = tensor2(&l["logp"]).require_grad();
        let batch = SurrogateBatch {
            logp: logp.clone(),
            logp_old: tensor2(&l["logp_old"]),
            advantages: Tensor::from_data(
                TensorData::new(adv.clone(), [adv.len()]),
                &Default::default(),
            ),
            mask: mask_rows(tensor2(&l["mask"]), &keep),
            logp_ref: Some(tensor2(&l["logp_ref"])),
            logp_engine: None,
        };
        let out = PolicyLoss {
            clip: Clip::default(),
            aggregation,
            kl_beta: beta,
            max_response_tokens: t,
            tis_cap: None,
            kl_estimator: KlEstimator::K3,
            importance: if sequence {
                ImportanceLevel::Sequence
            } else {
                ImportanceLevel::Token
            },
        }
        .compute(batch);
        let case_name =
            format!("{loss_type} beta {beta} sequence {sequence} masked {mask_truncated}");
        let loss_type = case_name.as_str();
        let value = out.loss.clone().into_scalar() as f64;
        let want = case["loss"].as_f64().unwrap();
        assert!(
            (value - want).abs() < 1e-6,
            "{loss_type} beta {beta}: loss {value} vs TRL {want}"
        );
        let grads = out.loss.backward();
        let grad = logp
            .grad(&grads)
            .unwrap()
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .unwrap();
        let (want_grad, _) = matrix(&case["grad"]);
        let max_abs = want_grad.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (i, (x, y)) in grad.iter().zip(&want_grad).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * max_abs,
                "{loss_type} beta {beta}: grad[{i}] {x} vs TRL {y}"
            );
        }
        assert!(want_grad.iter().any(|x| *x != 0.0));
        if beta != 0.0 {
            let kl = out.kl.clone().unwrap().into_scalar() as f64;
            assert!(
                (kl - case["kl"].as_f64().unwrap()).abs() < 1e-6,
                "{loss_type}: kl {kl}"
            );
        }
        let low = out.clip_low.into_scalar() as f64;
        let high = out.clip_high.into_scalar() as f64;
        if sequence {
            // TRL averages its sequence-level clip indicators over responses; ours count tokens
            // (a clipped response counts its tokens), the same for every loss.
            assert!(low > 0.0 && high > 0.0, "{loss_type}: both sides clip");
            continue;
        }
        assert!(
            (low - case["clip_low"].as_f64().unwrap()).abs() < 1e-6,
            "{loss_type}: clip low {low}"
        );
        assert!(
            (high - case["clip_high"].as_f64().unwrap()).abs() < 1e-6,
            "{loss_type}: clip high {high}"
        );
        assert!(low > 0.0 && high > 0.0, "both clip sides are exercised");
    }
}

#[test]
fn dpo_term_matches_the_formula() {
    use conrub_grpo::dpo_pair_loss;
    let d = |v: &[f32]| {
        Tensor::<B, 1>::from_data(TensorData::new(v.to_vec(), [v.len()]), &Default::default())
    };
    let (w, l, wo, lo) = (
        [-10.0f32, -20.0],
        [-12.0f32, -19.0],
        [-10.5f32, -20.0],
        [-12.0f32, -19.5],
    );
    let got = dpo_pair_loss(d(&w), d(&l), d(&wo), d(&lo), 2.0, 256).into_scalar() as f64;
    let want: f64 = (0..2)
        .map(|i| {
            let delta = ((w[i] - l[i]) - (wo[i] - lo[i])) as f64;
            -(1.0 / (1.0 + (-2.0 * delta).exp())).ln()
        })
        .sum::<f64>()
        / 256.0;
    assert!((got - want).abs() < 1e-7, "{got} vs {want}");
}
