//! A whole build: read and select prompts, run the pipeline, validate, write the artifacts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use conrub_judge::JudgeCache;
use conrub_rubric::{validate_records, RubricRecord};
use futures::StreamExt;
use serde::Serialize;
use serde_json::json;

use crate::artifacts::{self, sha256_hex, BuildStats};
use crate::config::BuildConfig;
use crate::error::{ConstructError, Result};
use crate::input::{read_prompts, InputFormat};
use crate::pipeline::{Builder, Progress};

/// What to build.
#[derive(Debug, Clone)]
pub struct BuildRequest {
    /// The prompt file.
    pub input: PathBuf,
    /// Its format.
    pub format: InputFormat,
    /// The output folder.
    pub out_dir: PathBuf,
    /// Build only the first N selected prompts.
    pub limit: Option<usize>,
}

/// Calls of one role.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RoleSummary {
    /// The model.
    pub model: String,
    /// Logical calls.
    pub calls: u64,
    /// Answered from the cache.
    pub cached: u64,
    /// Failed after retries.
    pub failed: u64,
    /// HTTP requests sent.
    pub requests: u64,
    /// Retries.
    pub retries: u64,
}

/// The result of a build.
#[derive(Debug, Clone)]
pub struct BuildSummary {
    /// Statistics (also in `stats.json`).
    pub stats: BuildStats,
    /// `(file, sha256)` of the deterministic artifacts.
    pub files: Vec<(String, String)>,
    /// Calls per role.
    pub roles: BTreeMap<String, RoleSummary>,
    /// Wall time of the pipeline in seconds.
    pub seconds: f64,
    /// The output folder.
    pub out_dir: PathBuf,
}

impl BuildSummary {
    /// Prompts stopped by failed calls (a rerun retries exactly those calls).
    pub fn failed(&self) -> u64 {
        self.stats.counts.prompts_failed
    }
}

/// Runs a build. Every model call goes through the cache at [`BuildConfig::cache_path`], so an
/// interrupted build started again repeats no answered call and writes the same bytes.
pub async fn build(
    cfg: BuildConfig,
    req: &BuildRequest,
    progress: Arc<Progress>,
) -> Result<BuildSummary> {
    let started_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let input_bytes = std::fs::read(&req.input).map_err(|e| ConstructError::file(&req.input, e))?;
    let (prompts, input_report) = read_prompts(
        &req.input,
        req.format,
        &cfg.quotas,
        cfg.build.seed,
        req.limit,
    )?;
    if prompts.is_empty() {
        return Err(ConstructError::file(
            &req.input,
            "no prompts selected (check the file, its format and the quotas)",
        ));
    }
    std::fs::create_dir_all(&req.out_dir).map_err(|e| ConstructError::file(&req.out_dir, e))?;
    let cache_path = cfg.cache_path(&req.out_dir);
    let cache = Arc::new(JudgeCache::open(&cache_path)?);
    let builder = Arc::new(Builder::new(cfg, cache)?);

    // Results arrive in input order; each is written out and folded into the statistics at once,
    // so memory stays bounded by the prompts in flight.
    let t0 = Instant::now();
    let mut writer = artifacts::StreamWriter::create(&req.out_dir)?;
    let mut acc = artifacts::StatsAcc::new(&input_report);
    let mut records: Vec<RubricRecord> = Vec::new();
    let n_prompts = prompts.len();
    let mut results = builder.stream(prompts, progress);
    while let Some(r) = results.next().await {
        writer.push(&r)?;
        acc.add(&r);
        records.extend(r.record);
    }
    let seconds = t0.elapsed().as_secs_f64();

    let numbered: Vec<(usize, RubricRecord)> = records
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, r)| (i + 1, r))
        .collect();
    let validation = validate_records(&numbered);
    let stats = acc.finish(&validation);
    let cfg = builder.config();
    let models: Vec<(String, String)> = builder
        .roles()
        .iter()
        .map(|r| (r.name.clone(), r.client.config().model.clone()))
        .collect();
    let versions = builder.prompts().versions();
    let card = artifacts::card(&stats, &models, &versions);
    let mut files = writer.commit()?;
    files.extend(artifacts::write_outputs(
        &req.out_dir,
        &records,
        &validation,
        &stats,
        &card,
    )?);

    let mut roles = BTreeMap::new();
    let mut models_json = serde_json::Map::new();
    for r in builder.roles() {
        let c = r.client.config();
        let http = r.client.stats();
        let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        roles.insert(
            r.name.clone(),
            RoleSummary {
                model: c.model.clone(),
                calls: g(&r.counters.calls),
                cached: g(&r.counters.cached),
                failed: g(&r.counters.failed),
                requests: http.requests,
                retries: http.retries,
            },
        );
        let urls: Vec<String> = c.urls.iter().map(|u| conrub_base::shown_url(u)).collect();
        models_json.insert(
            r.name.clone(),
            json!({
                "model": c.model, "urls": urls, "temperature": c.temperature, "max_tokens": c.max_tokens,
                "concurrency": c.concurrency, "timeout_secs": c.timeout_secs, "max_retries": c.max_retries,
                "api_key_env": c.api_key_env, "http": http,
            }),
        );
    }
    let cache_stats = builder.cache().stats();
    let manifest = json!({
        "tool": format!("conrub-construct {}", env!("CARGO_PKG_VERSION")),
        "started_unix": started_unix,
        "input": {
            "path": req.input, "format": req.format, "sha256": sha256_hex(&input_bytes), "rows": input_report.rows,
            "selected": input_report.selected, "limit": req.limit,
        },
        "seed": cfg.build.seed,
        "settings": cfg.build,
        "quotas": cfg.quotas,
        "dimensions": cfg.dimensions,
        "models": models_json,
        "prompt_versions": versions.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "prompts": builder.prompts().templates().into_iter()
            .map(|(k, t)| (k.to_string(), json!({"system": t.system, "user": t.user})))
            .collect::<serde_json::Map<_, _>>(),
        "calls": roles,
        "cache": {
            "path": cache_path, "hits": cache_stats.hits, "misses": cache_stats.misses, "writes": cache_stats.writes,
            "errors": cache_stats.errors,
        },
        "timings": {
            "pipeline_secs": seconds,
            "prompts_per_sec": n_prompts as f64 / seconds.max(1e-9),
        },
        "outcome": {
            "prompts": n_prompts, "kept": stats.counts.prompts_kept, "dropped": stats.counts.prompts_dropped,
            "failed": stats.counts.prompts_failed,
        },
        "files": files.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
    });
    artifacts::write_manifest(&req.out_dir, &manifest)?;
    Ok(BuildSummary {
        stats,
        files,
        roles,
        seconds,
        out_dir: req.out_dir.clone(),
    })
}

/// Paths of a build's artifacts in `dir`.
pub fn artifact_paths(dir: &Path) -> Vec<PathBuf> {
    [
        "rubrics.jsonl",
        "raw.jsonl",
        "clusters.jsonl",
        "validation.json",
        "stats.json",
        "card.md",
        "manifest.json",
    ]
    .iter()
    .map(|f| dir.join(f))
    .collect()
}
