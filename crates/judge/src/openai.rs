//! Criterion and pairwise judging through an OpenAI-compatible endpoint, with the judge cache.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use conrub_rubric::Label;

use crate::cache::{CacheKey, JudgeCache};
use crate::client::ChatClient;
use crate::judge::{
    CriterionJudge, CriterionRequest, CriterionVerdict, PairRequest, PairVerdict, PairwiseJudge,
};
use crate::parse::{parse_labels, parse_pair, PairAnswer};
use crate::prompts::PromptSet;

/// A judge served over HTTP (SGLang, vLLM, OpenAI).
#[derive(Debug, Clone)]
pub struct OpenAiJudge {
    client: Arc<ChatClient>,
    prompts: PromptSet,
    cache: Option<Arc<JudgeCache>>,
}

impl OpenAiJudge {
    /// A judge on `client` with `prompts`, caching in `cache` when given.
    pub fn new(
        client: Arc<ChatClient>,
        prompts: PromptSet,
        cache: Option<Arc<JudgeCache>>,
    ) -> Self {
        Self {
            client,
            prompts,
            cache,
        }
    }

    /// The HTTP client (for its counters).
    pub fn client(&self) -> &ChatClient {
        &self.client
    }

    fn criteria_key(&self, r: &CriterionRequest) -> CacheKey {
        r.cache_key(
            &self.client.config().model,
            &self.prompts.criteria(r.mode).version(),
        )
    }

    fn pair_key(&self, r: &PairRequest) -> CacheKey {
        let version = self.prompts.pairwise.version();
        let n = r.criteria.len().to_string();
        let mut parts: Vec<&str> = vec![
            "pair",
            &self.client.config().model,
            &version,
            &r.question,
            &r.first,
            &r.second,
            &n,
        ];
        parts.extend(r.criteria.iter().map(String::as_str));
        CacheKey::of(&parts)
    }
}

#[async_trait]
impl CriterionJudge for OpenAiJudge {
    fn id(&self) -> String {
        format!("openai:{}", self.client.config().model)
    }

    async fn judge(&self, r: &CriterionRequest) -> CriterionVerdict {
        let start = Instant::now();
        let key = self.criteria_key(r);
        if let Some((labels, raw)) = self
            .cache
            .as_ref()
            .and_then(|c| c.get_parsed::<Vec<Label>>(&key))
        {
            if labels.len() == r.criteria.len() {
                let mut v = CriterionVerdict::labelled(labels, vec![raw], 0, start.elapsed());
                v.cached = true;
                return v;
            }
        }
        let (system, user) =
            self.prompts
                .render_criteria(r.mode, &r.question, &r.response, &r.criteria);
        let n = r.criteria.len();
        let out = self
            .client
            .chat_parsed(&system, &user, |text| parse_labels(text, n, r.mode))
            .await;
        match out.result {
            Ok(labels) => {
                if let Some(c) = &self.cache {
                    c.put_criteria(
                        &key,
                        &CriterionJudge::id(self),
                        r,
                        &labels,
                        out.raw_outputs.last().map_or("", String::as_str),
                    );
                }
                CriterionVerdict::labelled(labels, out.raw_outputs, out.attempts, out.latency)
            }
            Err(e) => CriterionVerdict::failed(e.0, out.raw_outputs, out.attempts, out.latency),
        }
    }
}

#[async_trait]
impl PairwiseJudge for OpenAiJudge {
    fn id(&self) -> String {
        format!("openai:{}", self.client.config().model)
    }

    async fn compare(&self, r: &PairRequest) -> PairVerdict {
        let start = Instant::now();
        let key = self.pair_key(r);
        if let Some((answer, raw)) = self
            .cache
            .as_ref()
            .and_then(|c| c.get_parsed::<PairAnswer>(&key))
        {
            return PairVerdict {
                answer: Some(answer),
                error: None,
                raw_outputs: vec![raw],
                attempts: 0,
                latency_ms: start.elapsed().as_secs_f64() * 1e3,
                cached: true,
            };
        }
        let (system, user) =
            self.prompts
                .render_pairwise(&r.question, &r.criteria, &r.first, &r.second);
        let n = r.criteria.len();
        let out = self
            .client
            .chat_parsed(&system, &user, |text| parse_pair(text, n))
            .await;
        let latency_ms = out.latency.as_secs_f64() * 1e3;
        match out.result {
            Ok(answer) => {
                if let Some(c) = &self.cache {
                    c.put_parsed(
                        &key,
                        &PairwiseJudge::id(self),
                        "pair",
                        &answer,
                        out.raw_outputs.last().map_or("", String::as_str),
                    );
                }
                PairVerdict {
                    answer: Some(answer),
                    error: None,
                    raw_outputs: out.raw_outputs,
                    attempts: out.attempts,
                    latency_ms,
                    cached: false,
                }
            }
            Err(e) => PairVerdict {
                answer: None,
                error: Some(e.0),
                raw_outputs: out.raw_outputs,
                attempts: out.attempts,
                latency_ms,
                cached: false,
            },
        }
    }
}
