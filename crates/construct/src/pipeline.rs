//! One prompt through the seven steps, and a whole build over many prompts with bounded
//! concurrency and live progress counters.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use conrub_judge::{ChatClient, ClientConfig, JudgeCache};
use conrub_rubric::record::global_controls;
use conrub_rubric::{Coverage, Criterion, CriterionProvenance, RubricRecord};
use futures::StreamExt;
use serde::Serialize;

use crate::calls::{CallLog, CallRecord, Role};
use crate::config::BuildConfig;
use crate::counts::StageCounts;
use crate::error::Result;
use crate::input::PromptInput;
use crate::parse::{
    parse_audit, parse_generation, parse_grouping, parse_review, AuditAnswer, AuditDecision,
    AuditItem, ReviewAnswer, ReviewVerdict,
};
use crate::prompts::ConstructPrompts;
use crate::stages::{self, Candidate, Check, Consensus, Finish};

/// Every raw model output of one prompt (a line of `raw.jsonl`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PromptRaw {
    /// Prompt id.
    pub id: String,
    /// Generation calls by generator letter.
    pub generate: BTreeMap<String, CallLog>,
    /// Review calls by generator letter.
    pub review: BTreeMap<String, CallLog>,
    /// The grouping call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<CallLog>,
    /// The audit call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub audit: Option<CallLog>,
    /// The audit asked again without the question and reference, after a refusal.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub audit_blind: Option<CallLog>,
}

/// What happened to a generator's sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SampleStatus {
    /// Accepted by the review.
    Accepted,
    /// The generation call failed.
    GenerationFailed,
    /// Too few valid candidates.
    UnderSpecified,
    /// Not reviewed (another sample of the prompt was unusable).
    NotReviewed,
    /// The review call failed.
    ReviewFailed,
    /// Rejected on a contradiction verdict.
    RejectedContradiction,
    /// Rejected on a score below the threshold.
    RejectedScore,
}

/// One generator's sample.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SampleInfo {
    /// Criteria proposed.
    pub proposed: usize,
    /// Criteria that passed the checks.
    pub valid: usize,
    /// The review.
    pub review: Option<ReviewAnswer>,
    /// The outcome.
    pub status: SampleStatus,
}

/// One cluster and everything decided about it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClusterInfo {
    /// `K1`, `K2`, ... in the reviewer's order.
    pub id: String,
    /// Candidate ids.
    pub members: Vec<String>,
    /// Generator letters among the members.
    pub support: Vec<String>,
    /// The members' coverage tags.
    pub tags: Vec<Option<Coverage>>,
    /// Step 5.
    pub consensus: Consensus,
    /// Step 6: the longest member.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub representative: Option<String>,
    /// Step 6: the audit of the representative.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub audit: Option<AuditItem>,
    /// The text that went to the finish (the representative's or its rewrite).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Final outcome: `kept`, or why not.
    pub outcome: String,
    /// The criterion id in the final record when kept.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub criterion_id: Option<String>,
}

/// How a prompt ended.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Outcome {
    /// `kept`, `dropped` or `failed`.
    pub status: &'static str,
    /// The step where it was decided.
    pub stage: &'static str,
    /// Why (empty when kept).
    pub reason: String,
}

/// Cluster and support metadata of one prompt (a line of `clusters.jsonl`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PromptClusters {
    /// Prompt id.
    pub id: String,
    /// Source stratum.
    pub source: Option<String>,
    /// How it ended.
    pub outcome: Outcome,
    /// Samples by generator letter.
    pub samples: BTreeMap<String, SampleInfo>,
    /// Every proposed criterion with its check result and id.
    pub candidates: BTreeMap<String, Vec<Candidate>>,
    /// The clusters.
    pub clusters: Vec<ClusterInfo>,
}

/// Everything one prompt produced.
#[derive(Debug, Clone)]
pub struct PromptResult {
    /// The final record, when kept.
    pub record: Option<RubricRecord>,
    /// Raw outputs.
    pub raw: PromptRaw,
    /// Cluster metadata.
    pub clusters: PromptClusters,
    /// Counts.
    pub counts: StageCounts,
}

/// Live counters for a progress display.
#[derive(Debug, Default)]
pub struct Progress {
    /// Prompts in the build.
    pub total: AtomicU64,
    /// Prompts whose samples are generated.
    pub generated: AtomicU64,
    /// Prompts whose samples are reviewed.
    pub reviewed: AtomicU64,
    /// Prompts grouped.
    pub grouped: AtomicU64,
    /// Prompts audited.
    pub audited: AtomicU64,
    /// Prompts finished.
    pub done: AtomicU64,
    /// Of those, with a rubric.
    pub kept: AtomicU64,
    /// Of those, dropped by a filter.
    pub dropped: AtomicU64,
    /// Of those, stopped by a failed call.
    pub failed: AtomicU64,
}

impl Progress {
    fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// A one-line summary: per-stage counts.
    pub fn line(&self) -> String {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        format!(
            "generated {} reviewed {} grouped {} audited {} | kept {} dropped {} failed {}",
            g(&self.generated),
            g(&self.reviewed),
            g(&self.grouped),
            g(&self.audited),
            g(&self.kept),
            g(&self.dropped),
            g(&self.failed)
        )
    }
}

/// The construction pipeline: three generators, a reviewer, the cache and the settings.
pub struct Builder {
    cfg: BuildConfig,
    generators: Vec<(char, Role)>,
    reviewer: Role,
    cache: Arc<JudgeCache>,
    prompts: ConstructPrompts,
    dimensions: Vec<String>,
    versions: HashMap<&'static str, String>,
}

fn client(c: &ClientConfig) -> Result<Arc<ChatClient>> {
    Ok(Arc::new(ChatClient::new(c.clone())?))
}

struct Ctx<'a> {
    p: &'a PromptInput,
    question: String,
    raw: PromptRaw,
    counts: StageCounts,
    samples: BTreeMap<String, SampleInfo>,
    candidates: BTreeMap<String, Vec<Candidate>>,
    clusters: Vec<ClusterInfo>,
}

impl Builder {
    /// Builds the clients (API keys from their environment variables) and opens the cache.
    pub fn new(cfg: BuildConfig, cache: Arc<JudgeCache>) -> Result<Self> {
        cfg.validate()?;
        let generators = cfg
            .generators
            .lettered()
            .into_iter()
            .map(|(l, c)| Ok((l, Role::new(format!("generator-{l}"), client(c)?))))
            .collect::<Result<Vec<_>>>()?;
        let reviewer = Role::new("reviewer", client(&cfg.reviewer)?);
        let prompts = ConstructPrompts::default();
        let versions = prompts.versions().into_iter().collect();
        let dimensions = cfg.dimensions.keys().cloned().collect();
        Ok(Self {
            cfg,
            generators,
            reviewer,
            cache,
            prompts,
            dimensions,
            versions,
        })
    }

    /// The config.
    pub fn config(&self) -> &BuildConfig {
        &self.cfg
    }

    /// The prompts.
    pub fn prompts(&self) -> &ConstructPrompts {
        &self.prompts
    }

    /// The cache.
    pub fn cache(&self) -> &JudgeCache {
        &self.cache
    }

    /// All roles: the generators, then the reviewer.
    pub fn roles(&self) -> Vec<&Role> {
        self.generators
            .iter()
            .map(|(_, r)| r)
            .chain([&self.reviewer])
            .collect()
    }

    /// Runs every prompt as its own task (so the work spreads over the runtime's threads), at
    /// most `prompt_concurrency` at once; yields results in input order.
    pub fn stream(
        self: &Arc<Self>,
        prompts: Vec<PromptInput>,
        progress: Arc<Progress>,
    ) -> impl futures::Stream<Item = PromptResult> + Send + 'static {
        progress
            .total
            .store(prompts.len() as u64, Ordering::Relaxed);
        let me = self.clone();
        futures::stream::iter(prompts)
            .map(move |p| {
                let (b, progress) = (me.clone(), progress.clone());
                tokio::spawn(async move { b.build_prompt(&p, &progress).await })
            })
            .buffered(self.cfg.build.prompt_concurrency)
            .map(|r| r.expect("a prompt task panicked"))
    }

    /// Steps 1-7 for one prompt.
    pub async fn build_prompt(&self, p: &PromptInput, progress: &Progress) -> PromptResult {
        let mut cx = Ctx {
            p,
            question: p.question_text(),
            raw: PromptRaw {
                id: p.id.clone(),
                ..Default::default()
            },
            counts: StageCounts {
                prompts: 1,
                ..Default::default()
            },
            samples: BTreeMap::new(),
            candidates: BTreeMap::new(),
            clusters: Vec::new(),
        };
        let result = self.steps(&mut cx, progress).await;
        let (record, outcome) = match result {
            Ok(record) => {
                cx.counts.prompts_kept = 1;
                Progress::bump(&progress.kept);
                (
                    Some(record),
                    Outcome {
                        status: "kept",
                        stage: "finish",
                        reason: String::new(),
                    },
                )
            }
            Err(Stop {
                status,
                stage,
                reason,
            }) => {
                if status == "failed" {
                    cx.counts.prompts_failed = 1;
                    Progress::bump(&progress.failed);
                } else {
                    cx.counts.prompts_dropped = 1;
                    Progress::bump(&progress.dropped);
                }
                (
                    None,
                    Outcome {
                        status,
                        stage,
                        reason,
                    },
                )
            }
        };
        Progress::bump(&progress.done);
        PromptResult {
            record,
            clusters: PromptClusters {
                id: p.id.clone(),
                source: p.source.clone(),
                outcome,
                samples: cx.samples,
                candidates: cx.candidates,
                clusters: cx.clusters,
            },
            raw: cx.raw,
            counts: cx.counts,
        }
    }

    /// Steps 1-7 for one prompt: each stage records what it saw in `cx` and stops the prompt
    /// (failed or dropped) or hands on.
    async fn steps(&self, cx: &mut Ctx<'_>, progress: &Progress) -> StageResult<RubricRecord> {
        self.generate(cx, progress).await?;
        self.review(cx, progress).await?;
        let groups = self.group(cx, progress).await?;
        let survivors = self.consensus(cx, groups)?;
        let items = self.audit(cx, progress, &survivors).await?;
        let finishing = self.apply_audit(cx, &survivors, &items);
        self.finish(cx, &finishing)
    }

    /// Steps 1-2: every generator proposes candidates, which are checked one by one; a failed
    /// call fails the prompt, an under-specified sample drops it.
    async fn generate(&self, cx: &mut Ctx<'_>, progress: &Progress) -> StageResult<()> {
        let s = &self.cfg.build;
        let reference = cx.p.reference_answer.as_deref();
        let cache = &*self.cache;
        // The method asks for 20-30 criteria; the upper end follows `candidates_max`.
        let gen_prompt = self.prompts.render_generate(
            &cx.question,
            reference,
            20.min(s.candidates_max),
            s.candidates_max,
        );
        let version = &self.versions["generate"];
        let calls = self
            .generators
            .iter()
            .map(|(_, role)| role.call(cache, "generate", version, &gen_prompt, parse_generation));
        let answers = futures::future::join_all(calls).await;
        Progress::bump(&progress.generated);
        let mut failed = Vec::new();
        for ((letter, _), answer) in self.generators.iter().zip(answers) {
            let l = letter.to_string();
            cx.counts.samples += 1;
            match answer {
                Ok((rec, _)) => {
                    cx.raw.generate.insert(l.clone(), CallLog::of(&rec));
                    let checked =
                        stages::check_sample(*letter, &rec.answer, reference.is_some(), s);
                    let valid = checked.iter().filter(|c| c.check == Check::Ok).count();
                    cx.counts.candidates_proposed += checked.len() as u64;
                    count_checks(&mut cx.counts, &checked);
                    let status = if valid < s.candidates_min {
                        cx.counts.samples_under_specified += 1;
                        SampleStatus::UnderSpecified
                    } else {
                        SampleStatus::NotReviewed
                    };
                    cx.samples.insert(
                        l.clone(),
                        SampleInfo {
                            proposed: checked.len(),
                            valid,
                            review: None,
                            status,
                        },
                    );
                    cx.candidates.insert(l, checked);
                }
                Err(f) => {
                    cx.counts.samples_failed += 1;
                    cx.raw.generate.insert(l.clone(), f.clone());
                    cx.samples.insert(
                        l.clone(),
                        SampleInfo {
                            proposed: 0,
                            valid: 0,
                            review: None,
                            status: SampleStatus::GenerationFailed,
                        },
                    );
                    failed.push(format!("generator {l}: {}", f.error()));
                }
            }
        }
        if !failed.is_empty() {
            return Err(Stop::failed("generate", failed.join("; ")));
        }
        let short: Vec<&String> = cx
            .samples
            .iter()
            .filter(|(_, i)| i.status == SampleStatus::UnderSpecified)
            .map(|(l, _)| l)
            .collect();
        if !short.is_empty() {
            let names: Vec<&str> = short.iter().map(|s| s.as_str()).collect();
            return Err(Stop::dropped(
                "checks",
                format!("under-specified sample from generator {}", names.join(", ")),
            ));
        }
        Ok(())
    }

    /// Step 3: the reviewer reads each sample; a contradiction or a low score drops the prompt.
    async fn review(&self, cx: &mut Ctx<'_>, progress: &Progress) -> StageResult<()> {
        let s = &self.cfg.build;
        let reference = cx.p.reference_answer.as_deref();
        let cache = &*self.cache;
        let version = &self.versions["review"];
        let rendered: Vec<(String, (String, String))> = cx
            .candidates
            .iter()
            .map(|(l, cands)| {
                let texts: Vec<&str> = cands
                    .iter()
                    .filter(|c| c.check == Check::Ok)
                    .map(|c| c.text.as_str())
                    .collect();
                (
                    l.clone(),
                    self.prompts.render_review(&cx.question, reference, &texts),
                )
            })
            .collect();
        let calls = rendered.iter().map(|(_, r)| {
            self.reviewer
                .call(cache, "review", version, r, parse_review)
        });
        let reviews = futures::future::join_all(calls).await;
        Progress::bump(&progress.reviewed);
        let mut failed = Vec::new();
        let mut rejected = Vec::new();
        for ((l, _), review) in rendered.iter().zip(reviews) {
            cx.counts.reviews += 1;
            let info = cx.samples.get_mut(l).expect("every sample has an entry");
            match review {
                Ok((rec, _)) => {
                    cx.raw.review.insert(l.clone(), CallLog::of(&rec));
                    let r = rec.answer;
                    info.status = if r.verdict == ReviewVerdict::Contradiction {
                        cx.counts.samples_rejected_contradiction += 1;
                        rejected.push(format!("generator {l}: contradiction"));
                        SampleStatus::RejectedContradiction
                    } else if r.score < s.min_review_score {
                        cx.counts.samples_rejected_score += 1;
                        rejected.push(format!(
                            "generator {l}: score {} < {}",
                            r.score, s.min_review_score
                        ));
                        SampleStatus::RejectedScore
                    } else {
                        cx.counts.samples_accepted += 1;
                        SampleStatus::Accepted
                    };
                    info.review = Some(r);
                }
                Err(f) => {
                    cx.counts.reviews_failed += 1;
                    cx.raw.review.insert(l.clone(), f.clone());
                    info.status = SampleStatus::ReviewFailed;
                    failed.push(format!("review of generator {l}: {}", f.error()));
                }
            }
        }
        if !failed.is_empty() {
            return Err(Stop::failed("review", failed.join("; ")));
        }
        if !rejected.is_empty() {
            return Err(Stop::dropped(
                "review",
                format!("sample rejected: {}", rejected.join("; ")),
            ));
        }
        Ok(())
    }

    /// Step 4: the reviewer groups the valid candidates of all samples into clusters.
    async fn group(&self, cx: &mut Ctx<'_>, progress: &Progress) -> StageResult<Vec<Vec<String>>> {
        let cache = &*self.cache;
        let valid: Vec<(String, String)> = cx
            .candidates
            .values()
            .flatten()
            .filter_map(|c| c.id.clone().map(|id| (id, c.text.clone())))
            .collect();
        let by_id: HashMap<&str, &Candidate> = cx
            .candidates
            .values()
            .flatten()
            .filter_map(|c| c.id.as_deref().map(|id| (id, c)))
            .collect();
        let rendered = self.prompts.render_group(&cx.question, &valid);
        cx.counts.groupings += 1;
        let grouping = self
            .reviewer
            .call(
                cache,
                "group",
                &self.versions["group"],
                &rendered,
                parse_grouping,
            )
            .await;
        Progress::bump(&progress.grouped);
        let groups = match grouping {
            Ok((rec, _)) => {
                cx.raw.group = Some(CallLog::of(&rec));
                rec.answer
            }
            Err(f) => {
                cx.counts.groupings_failed += 1;
                cx.raw.group = Some(f.clone());
                return Err(Stop::failed("group", f.error().to_string()));
            }
        };
        let ids: HashSet<&str> = by_id.keys().copied().collect();
        let clean = stages::clean_grouping(&groups, &ids);
        cx.counts.grouping_unknown_ids += clean.unknown_ids as u64;
        cx.counts.grouping_repeated_ids += clean.repeated_ids as u64;
        cx.counts.candidates_ungrouped +=
            (ids.len() - clean.groups.iter().map(Vec::len).sum::<usize>()) as u64;
        cx.counts.clusters += clean.groups.len() as u64;
        Ok(clean.groups)
    }

    /// Steps 5 and 6: the consensus filter and a representative per surviving cluster; returns
    /// the indices in `cx.clusters` of the survivors.
    fn consensus(&self, cx: &mut Ctx<'_>, groups: Vec<Vec<String>>) -> StageResult<Vec<usize>> {
        let by_id: HashMap<&str, &Candidate> = cx
            .candidates
            .values()
            .flatten()
            .filter_map(|c| c.id.as_deref().map(|id| (id, c)))
            .collect();
        let n_gen = self.generators.len();
        let mut survivors = Vec::new();
        for (k, members) in groups.into_iter().enumerate() {
            let tags: Vec<Option<Coverage>> =
                members.iter().map(|m| by_id[m.as_str()].coverage).collect();
            let consensus = stages::consensus(&members, &tags, n_gen);
            let (outcome, representative) = match consensus {
                Consensus::Kept => {
                    cx.counts.clusters_consensus += 1;
                    survivors.push(cx.clusters.len());
                    (
                        "pending",
                        Some(
                            stages::representative(&members, |id| by_id[id].text.as_str())
                                .to_string(),
                        ),
                    )
                }
                Consensus::PartialSupport => {
                    cx.counts.clusters_partial_support += 1;
                    ("partial_support", None)
                }
                Consensus::TagDisagreement => {
                    cx.counts.clusters_tag_disagreement += 1;
                    ("tag_disagreement", None)
                }
            };
            cx.clusters.push(ClusterInfo {
                id: format!("K{}", k + 1),
                support: stages::support(&members)
                    .into_iter()
                    .map(String::from)
                    .collect(),
                members,
                tags,
                consensus,
                text: representative
                    .as_ref()
                    .map(|r| by_id[r.as_str()].text.clone()),
                representative,
                audit: None,
                outcome: outcome.into(),
                criterion_id: None,
            });
        }
        if survivors.is_empty() {
            return Err(Stop::dropped(
                "consensus",
                "no cluster has all three generators and agreeing tags",
            ));
        }
        Ok(survivors)
    }

    /// Step 6: the audit of the survivors' texts, asked again without the clinical context after
    /// a refusal.
    async fn audit(
        &self,
        cx: &mut Ctx<'_>,
        progress: &Progress,
        survivors: &[usize],
    ) -> StageResult<Vec<AuditItem>> {
        let reference = cx.p.reference_answer.as_deref();
        let cache = &*self.cache;
        let texts: Vec<&str> = survivors
            .iter()
            .map(|&i| cx.clusters[i].text.as_deref().unwrap_or(""))
            .collect();
        let dims: Vec<&str> = self.dimensions.iter().map(String::as_str).collect();
        let rendered = self
            .prompts
            .render_audit(Some((&cx.question, reference)), &texts, &dims);
        cx.counts.audits += 1;
        let mut audit = self
            .reviewer
            .call(
                cache,
                "audit",
                &self.versions["audit"],
                &rendered,
                parse_audit,
            )
            .await;
        if let Ok((rec, _)) = &audit {
            cx.raw.audit = Some(CallLog::of(rec));
            if rec.answer == AuditAnswer::Refused {
                cx.counts.audit_refusals += 1;
                let blind = self.prompts.render_audit(None, &texts, &dims);
                audit = self
                    .reviewer
                    .call(
                        cache,
                        "audit_blind",
                        &self.versions["audit_blind"],
                        &blind,
                        parse_audit,
                    )
                    .await;
                cx.raw.audit_blind = Some(match &audit {
                    Ok((rec, _)) => CallLog::of(rec),
                    Err(f) => f.clone(),
                });
            }
        }
        Progress::bump(&progress.audited);
        let items = match audit {
            Ok((
                CallRecord {
                    answer: AuditAnswer::Items(items),
                    ..
                },
                _,
            )) => items,
            Ok(_) => {
                cx.counts.audits_failed += 1;
                return Err(Stop::failed(
                    "audit",
                    "the audit was refused with and without the clinical context",
                ));
            }
            Err(f) => {
                cx.counts.audits_failed += 1;
                if cx.raw.audit.is_none() {
                    cx.raw.audit = Some(f.clone());
                }
                return Err(Stop::failed("audit", f.error().to_string()));
            }
        };
        Ok(items)
    }

    /// Step 6, applied: each survivor kept, rewritten or dropped by its audit item; returns
    /// `(cluster index, text, dimension)` of those that go on to the finish.
    fn apply_audit(
        &self,
        cx: &mut Ctx<'_>,
        survivors: &[usize],
        items: &[AuditItem],
    ) -> Vec<(usize, String, String)> {
        let s = &self.cfg.build;
        // Match items to R1..Rn by id; a list of the right length without usable ids by position.
        let by_rid: HashMap<&str, &AuditItem> =
            items.iter().map(|it| (it.id.as_str(), it)).collect();
        let positional = items.len() == survivors.len()
            && (1..=survivors.len()).any(|i| !by_rid.contains_key(format!("R{i}").as_str()));
        let mut finishing: Vec<(usize, String, String)> = Vec::new();
        for (pos, &ci) in survivors.iter().enumerate() {
            let item = if positional {
                items.get(pos)
            } else {
                by_rid.get(format!("R{}", pos + 1).as_str()).copied()
            };
            let cluster = &mut cx.clusters[ci];
            let Some(item) = item else {
                cx.counts.audit_missing += 1;
                cluster.outcome = "audit_missing".into();
                continue;
            };
            cluster.audit = Some(item.clone());
            let text = match item.decision {
                AuditDecision::Keep => {
                    cx.counts.audit_keep += 1;
                    if item.category == "problematic_negative" {
                        cx.counts.negatives_dropped += 1;
                        cluster.outcome = "problematic_negative".into();
                        continue;
                    }
                    cluster.text.clone().unwrap_or_default()
                }
                AuditDecision::Rewrite => {
                    cx.counts.audit_rewrite += 1;
                    match &item.rewrite {
                        Some(t) => stages::clean_text(t),
                        None => {
                            cx.counts.rewrites_invalid += 1;
                            cluster.outcome = "rewrite_invalid".into();
                            continue;
                        }
                    }
                }
                AuditDecision::Drop => {
                    cx.counts.audit_drop += 1;
                    cluster.outcome = "audit_drop".into();
                    continue;
                }
                AuditDecision::ManualReview => {
                    cx.counts.audit_manual_review += 1;
                    cluster.outcome = "audit_manual_review".into();
                    continue;
                }
            };
            match stages::unusable_text(&text, s) {
                Some("problematic_negative") => {
                    cx.counts.negatives_dropped += 1;
                    cluster.outcome = "problematic_negative".into();
                }
                Some(_) => {
                    cx.counts.rewrites_invalid += 1;
                    cluster.outcome = "rewrite_invalid".into();
                }
                None => {
                    cluster.text = Some(text.clone());
                    finishing.push((ci, text, item.dimension.clone()));
                }
            }
        }
        finishing
    }

    /// Step 7: exact dedup, the cap under the dimension quotas and the two global controls.
    fn finish(
        &self,
        cx: &mut Ctx<'_>,
        finishing: &[(usize, String, String)],
    ) -> StageResult<RubricRecord> {
        let s = &self.cfg.build;
        let p = cx.p;
        let reference = p.reference_answer.as_deref();
        let items: Vec<(String, String)> = finishing
            .iter()
            .map(|(_, t, d)| (t.clone(), d.clone()))
            .collect();
        let decisions = stages::finish(&items, &self.cfg.dimensions, s.max_content);
        let mut criteria = Vec::new();
        for ((ci, text, _), d) in finishing.iter().zip(decisions) {
            let cluster = &mut cx.clusters[*ci];
            match d {
                Finish::Duplicate => {
                    cx.counts.duplicates_removed += 1;
                    cluster.outcome = "duplicate".into();
                }
                Finish::OverQuota => {
                    cx.counts.over_quota += 1;
                    cluster.outcome = "over_quota".into();
                }
                Finish::Kept => {
                    let id = format!("c{}", criteria.len() + 1);
                    cluster.outcome = "kept".into();
                    cluster.criterion_id = Some(id.clone());
                    criteria.push(Criterion {
                        id: Some(id),
                        reference_coverage: if reference.is_some() {
                            cluster.tags[0]
                        } else {
                            None
                        },
                        provenance: CriterionProvenance {
                            generators: cluster.support.clone(),
                            cluster_id: Some(cluster.id.clone()),
                            ..Default::default()
                        },
                        ..Criterion::content(text.clone())
                    });
                }
            }
        }
        if criteria.is_empty() {
            return Err(Stop::dropped(
                "finish",
                "no criterion survived the audit and the finish",
            ));
        }
        cx.counts.content_criteria = criteria.len() as u64;
        criteria.extend(global_controls());
        cx.counts.global_controls = 2;
        Ok(RubricRecord {
            id: p.id.clone(),
            question: p.question.clone(),
            reference_answer: p.reference_answer.clone(),
            ground_truth: None,
            source: p.source.clone(),
            criteria,
            provenance: Some(p.provenance.clone()),
        })
    }
}

/// Why a prompt stopped before its rubric, and at which stage.
struct Stop {
    /// `failed` (a call failed) or `dropped` (a filter removed the prompt).
    status: &'static str,
    stage: &'static str,
    reason: String,
}

impl Stop {
    fn failed(stage: &'static str, reason: impl Into<String>) -> Self {
        let reason = reason.into();
        Self {
            status: "failed",
            stage,
            reason,
        }
    }

    fn dropped(stage: &'static str, reason: impl Into<String>) -> Self {
        let reason = reason.into();
        Self {
            status: "dropped",
            stage,
            reason,
        }
    }
}

type StageResult<T> = std::result::Result<T, Stop>;

/// Counts each checked candidate under its check.
fn count_checks(counts: &mut StageCounts, checked: &[Candidate]) {
    for c in checked {
        let slot = match c.check {
            Check::Ok => &mut counts.candidates_valid,
            Check::Empty => &mut counts.candidates_empty,
            Check::UnderSpecified => &mut counts.candidates_under_specified,
            Check::Malformed => &mut counts.candidates_malformed,
            Check::Duplicate => &mut counts.candidates_duplicate,
            Check::Repetitive => &mut counts.candidates_repetitive,
            Check::OverLimit => &mut counts.candidates_over_limit,
        };
        *slot += 1;
    }
}
