//! The reward and tie path of one step: judge rewards with dropout, exact-tie detection, tie modes
//! and tie telemetry.

use std::sync::Arc;

use async_trait::async_trait;
use conrub_grpo::{
    record_group, GroupRelative, PairRecord, TieAwareAdvantages, TieBreaker, TieMode, TieOutcome,
    TieStats, TieStatus, TiedGroup,
};
use conrub_judge::{LexicalJudge, PairOutcome};
use conrub_rewards::{JudgeRewards, RewardSource};
use conrub_rubric::{read_rubrics, LengthPenalty, RubricDropout, ScoringMode};

struct FixedBreaker;

#[async_trait]
impl TieBreaker for FixedBreaker {
    async fn break_tie(&self, g: &TiedGroup<'_>) -> TieOutcome {
        let mut advantages = vec![0.0; g.responses.len()];
        advantages[0] = 1.0;
        advantages[1] = -1.0;
        let rec = |a, b, outcome| PairRecord {
            a,
            b,
            outcome,
            winner_longer: (outcome == PairOutcome::PreferA).then_some(true),
            comparison: None,
        };
        TieOutcome {
            advantages,
            pairs: vec![
                rec(0, 1, PairOutcome::PreferA),
                rec(2, 3, PairOutcome::Same),
                rec(4, 5, PairOutcome::OrderFlip),
                rec(6, 7, PairOutcome::Invalid),
            ],
        }
    }
}

fn stage(mode: TieMode) -> TieAwareAdvantages {
    TieAwareAdvantages::new(
        Box::new(GroupRelative::default()),
        mode,
        Box::new(FixedBreaker),
    )
}

fn group<'a>(responses: &'a [String], lengths: &'a [u32], criteria: &'a [String]) -> TiedGroup<'a> {
    TiedGroup {
        group_key: "med-0001/0",
        question: "q",
        criteria,
        responses,
        lengths,
    }
}

#[tokio::test]
async fn judge_rewards_share_one_dropout_subset_per_group() {
    let rubrics = read_rubrics(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../data/samples/rubrics.jsonl"
    )))
    .unwrap();
    let record = rubrics.get("med-0001").unwrap();
    let source = JudgeRewards {
        judge: Arc::new(
            LexicalJudge::from_file(std::path::Path::new(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../data/samples/lexical-keywords.jsonl"
            )))
            .unwrap(),
        ),
        mode: ScoringMode::ThreeState,
        penalty: LengthPenalty {
            enabled: true,
            max_tokens: 100,
            buffer_tokens: 50,
        },
        dropout: Some(RubricDropout::default()),
        seed: 1234,
    };
    let responses: Vec<String> = vec![
        "Call 911 now, this may be a heart attack; chew aspirin.".into(),
        "Rest.".into(),
    ];
    let a = source.score_group(record, &responses, &[10, 75], 3).await;
    let b = source.score_group(record, &responses, &[10, 75], 3).await;
    assert_eq!(
        (&a.scores, &a.criteria),
        (&b.scores, &b.criteria),
        "same step, same subset and scores"
    );
    let n = record.criteria.len();
    assert!(
        a.criteria.len() < n && a.criteria.len() >= n / 2,
        "30-50% of {n} dropped: kept {}",
        a.criteria.len()
    );
    for s in &a.scores {
        match s {
            conrub_rubric::ResponseScore::Scored(x) => assert_eq!(x.labels.len(), a.criteria.len()),
            other => panic!("{other:?}"),
        }
    }
    // The second response is 75 tokens: penalty (100 - 50 - 75) / 50 = -0.5.
    let conrub_rubric::ResponseScore::Scored(s) = &a.scores[1] else {
        panic!()
    };
    assert_eq!(s.length_penalty, -0.5);
    let other_step = source.score_group(record, &responses, &[10, 75], 4).await;
    let differs = (0..20).any(|step| {
        futures::executor::block_on(source.score_group(record, &responses, &[10, 75], step))
            .criteria
            != a.criteria
    });
    assert!(
        differs || other_step.criteria != a.criteria,
        "subsets change with the step"
    );
}

#[tokio::test]
async fn tie_modes_and_statistics() {
    let responses: Vec<String> = (0..8).map(|i| format!("answer {i}")).collect();
    let lengths = [9u32, 3, 4, 4, 4, 4, 4, 4];
    let criteria = vec!["c".to_string()];
    let g = group(&responses, &lengths, &criteria);
    let tied = [Some(1.0); 8];

    let out = stage(TieMode::Pairwise).group(&tied, 8, &g).await;
    assert_eq!(out.status, TieStatus::Tied);
    assert_eq!(&out.advantages[..3], &[1.0, -1.0, 0.0]);
    assert_eq!(out.accepted_pairs(), vec![(0, 1)]);

    let off = stage(TieMode::Off).group(&tied, 8, &g).await;
    assert_eq!(
        (off.status, off.advantages.clone(), off.pairs.len()),
        (TieStatus::TiedUnbroken, vec![0.0; 8], 0)
    );

    let dpo = stage(TieMode::GrpoDpo).group(&tied, 8, &g).await;
    assert_eq!(
        dpo.advantages,
        vec![0.0; 8],
        "GRPO+DPO keeps vanilla advantages"
    );
    assert_eq!(dpo.accepted_pairs(), vec![(0, 1)]);

    let mut incomplete = tied;
    incomplete[7] = None;
    let not_tied = stage(TieMode::Pairwise).group(&incomplete, 8, &g).await;
    assert_eq!(
        not_tied.status,
        TieStatus::NotTied,
        "an unscored response breaks completeness"
    );
    assert_eq!(
        not_tied.advantages,
        vec![0.0; 8],
        "equal scored rewards still give vanilla zeros"
    );

    let mixed = [
        Some(1.0),
        Some(0.5),
        Some(1.0),
        Some(1.0),
        Some(1.0),
        Some(1.0),
        Some(1.0),
        Some(1.0),
    ];
    let vanilla = stage(TieMode::Pairwise).group(&mixed, 8, &g).await;
    assert_eq!(vanilla.status, TieStatus::NotTied);
    assert!(vanilla.advantages[1] < 0.0 && vanilla.advantages[0] > 0.0);

    let mut stats = TieStats::default();
    record_group(&mut stats, &out, Some(1.0));
    record_group(&mut stats, &vanilla, None);
    record_group(&mut stats, &off, Some(0.75));
    assert_eq!((stats.groups, stats.tied_groups), (3, 2));
    assert_eq!(
        (
            stats.accepted,
            stats.same,
            stats.order_flips,
            stats.invalid,
            stats.pairwise_calls
        ),
        (1, 1, 1, 1, 8)
    );
    assert_eq!(
        (
            stats.groups_with_direction,
            stats.responses_with_direction,
            stats.winner_longer
        ),
        (1, 2, 1)
    );
    assert_eq!(
        stats.tied_reward_histogram[19], 1,
        "reward 1.0 lands in the last bin"
    );
    assert_eq!(
        stats.tied_reward_histogram[17], 1,
        "reward 0.75 in [0.7, 0.8)"
    );
    assert!((stats.tie_rate() - 2.0 / 3.0).abs() < 1e-12);
}
