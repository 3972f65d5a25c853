//! Filter counts at every step of construction, summed over prompts.

use serde::Serialize;

macro_rules! stage_counts {
    ($($(#[doc = $doc:literal])* $name:ident,)*) => {
        /// Counts of one prompt or of a whole build; every step's inputs and drops.
        #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
        pub struct StageCounts {
            $($(#[doc = $doc])* pub $name: u64,)*
        }

        impl StageCounts {
            /// Adds another prompt's counts.
            pub fn add(&mut self, o: &StageCounts) {
                $(self.$name += o.$name;)*
            }

            /// `(name, value)` pairs in declaration order.
            pub fn pairs(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name),)*]
            }
        }
    };
}

stage_counts! {
    /// Prompts processed.
    prompts,
    /// Prompts with a final rubric.
    prompts_kept,
    /// Prompts whose rubric came out empty or whose samples were rejected.
    prompts_dropped,
    /// Prompts stopped by a model call that failed after its retries (a rerun retries them).
    prompts_failed,
    /// Step 1: generator samples asked for.
    samples,
    /// Step 1: generator calls that failed.
    samples_failed,
    /// Step 1: criteria proposed.
    candidates_proposed,
    /// Step 2: dropped, no text.
    candidates_empty,
    /// Step 2: dropped, too few words.
    candidates_under_specified,
    /// Step 2: dropped, malformed (prefix, lines, length, tag).
    candidates_malformed,
    /// Step 2: dropped, repeats an earlier candidate of the same sample.
    candidates_duplicate,
    /// Step 2: dropped, internally repetitive text.
    candidates_repetitive,
    /// Step 2: dropped, beyond the per-sample limit.
    candidates_over_limit,
    /// Step 2: candidates that passed.
    candidates_valid,
    /// Step 2: samples with too few valid candidates.
    samples_under_specified,
    /// Step 3: samples reviewed.
    reviews,
    /// Step 3: review calls that failed.
    reviews_failed,
    /// Step 3: samples rejected on a contradiction verdict.
    samples_rejected_contradiction,
    /// Step 3: samples rejected on a score below the threshold.
    samples_rejected_score,
    /// Step 3: samples accepted.
    samples_accepted,
    /// Step 4: grouping calls.
    groupings,
    /// Step 4: grouping calls that failed.
    groupings_failed,
    /// Step 4: ids the reviewer named that do not exist.
    grouping_unknown_ids,
    /// Step 4: ids the reviewer placed twice (first placement kept).
    grouping_repeated_ids,
    /// Step 4: valid candidates placed in no group.
    candidates_ungrouped,
    /// Step 4: clusters formed.
    clusters,
    /// Step 5: clusters without all three generators.
    clusters_partial_support,
    /// Step 5: clusters whose coverage tags disagree.
    clusters_tag_disagreement,
    /// Step 5: clusters that passed the consensus filter.
    clusters_consensus,
    /// Step 6: audit calls.
    audits,
    /// Step 6: audit calls that failed.
    audits_failed,
    /// Step 6: audits refused with the clinical context and asked again without it.
    audit_refusals,
    /// Step 6: keep decisions.
    audit_keep,
    /// Step 6: rewrite decisions.
    audit_rewrite,
    /// Step 6: drop decisions.
    audit_drop,
    /// Step 6: manual-review decisions.
    audit_manual_review,
    /// Step 6: criteria the audit answer left out (treated as manual review).
    audit_missing,
    /// Step 6: rewrites that are not a usable criterion (dropped).
    rewrites_invalid,
    /// Step 6: kept texts that reward silence (dropped by the deterministic check).
    negatives_dropped,
    /// Step 7: exact duplicates removed.
    duplicates_removed,
    /// Step 7: criteria over a dimension quota or the content cap.
    over_quota,
    /// Step 7: content criteria in final rubrics.
    content_criteria,
    /// Step 7: global controls appended.
    global_controls,
}
