//! The build config (TOML): three generators, a reviewer, the construction settings, source
//! quotas and per-dimension caps. Unknown keys are errors that name the key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use conrub_judge::ClientConfig;
use serde::{Deserialize, Serialize};

use crate::error::{ConstructError, Result};

/// The three generator endpoints, lettered as in candidate ids (`A3`, `B1`, `C7`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Generators {
    /// Generator A.
    #[serde(rename = "A")]
    pub a: ClientConfig,
    /// Generator B.
    #[serde(rename = "B")]
    pub b: ClientConfig,
    /// Generator C.
    #[serde(rename = "C")]
    pub c: ClientConfig,
}

impl Generators {
    /// `(letter, settings)` in order.
    pub fn lettered(&self) -> [(char, &ClientConfig); 3] {
        [('A', &self.a), ('B', &self.b), ('C', &self.c)]
    }
}

fn d_seed() -> u64 {
    1234
}
fn d_min_score() -> u32 {
    8
}
fn d_candidates_min() -> usize {
    5
}
fn d_candidates_max() -> usize {
    30
}
fn d_min_words() -> usize {
    5
}
fn d_max_chars() -> usize {
    400
}
fn d_max_content() -> usize {
    10
}
fn d_prompt_concurrency() -> usize {
    64
}

/// Construction settings (the `[build]` table). The method fixes the review threshold (8) and
/// the cap (10 content criteria); the rest are our defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BuildSettings {
    /// Seed of the per-stratum prompt sampling when a quota is smaller than the stratum.
    #[serde(default = "d_seed")]
    pub seed: u64,
    /// Cache database (relative to the config file); default `<out>/cache.sqlite`.
    #[serde(default)]
    pub cache: Option<PathBuf>,
    /// A sample whose review score is below this is rejected (method: 8).
    #[serde(default = "d_min_score")]
    pub min_review_score: u32,
    /// A generator sample with fewer valid candidates than this after the deterministic checks
    /// is rejected as under-specified.
    #[serde(default = "d_candidates_min")]
    pub candidates_min: usize,
    /// Candidates kept per generator sample (the prompt asks for 20-30); later ones are dropped.
    #[serde(default = "d_candidates_max")]
    pub candidates_max: usize,
    /// A candidate with fewer words is under-specified.
    #[serde(default = "d_min_words")]
    pub min_words: usize,
    /// A candidate longer than this (characters) is malformed.
    #[serde(default = "d_max_chars")]
    pub max_chars: usize,
    /// Content criteria kept per prompt (method: 10).
    #[serde(default = "d_max_content")]
    pub max_content: usize,
    /// Prompts in flight at once (each makes up to 8 calls; endpoint `concurrency` bounds the rest).
    #[serde(default = "d_prompt_concurrency")]
    pub prompt_concurrency: usize,
}

impl Default for BuildSettings {
    fn default() -> Self {
        toml::from_str("").expect("every field has a default")
    }
}

/// The dimensions the audit assigns and their default caps per prompt.
pub fn default_dimensions() -> BTreeMap<String, usize> {
    [
        ("diagnosis", 4),
        ("management", 4),
        ("safety", 3),
        ("practical", 3),
        ("communication", 2),
        ("other", 2),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// A whole build config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BuildConfig {
    /// The three generator LLMs (they must be different models).
    pub generators: Generators,
    /// The reviewer LLM: sample review, semantic grouping and criterion audit.
    pub reviewer: ClientConfig,
    /// Construction settings.
    #[serde(default)]
    pub build: BuildSettings,
    /// Most prompts taken per source stratum; strata not listed are skipped. Empty: take all.
    #[serde(default)]
    pub quotas: BTreeMap<String, usize>,
    /// Most content criteria per dimension in a final rubric (the audit assigns dimensions; an
    /// unknown one counts as `other`).
    #[serde(default = "default_dimensions")]
    pub dimensions: BTreeMap<String, usize>,
    /// Directory relative paths resolve against.
    #[serde(skip)]
    pub base_dir: PathBuf,
}

impl BuildConfig {
    /// Parses TOML; `base_dir` resolves relative paths.
    pub fn from_toml(text: &str, base_dir: &Path) -> Result<Self> {
        let mut cfg: BuildConfig = toml::from_str(text).map_err(|e| ConstructError::Toml {
            message: e.to_string().trim_end().to_string(),
        })?;
        cfg.base_dir = base_dir.to_path_buf();
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads and checks a config file; errors name the file and the key.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| ConstructError::file(path, e))?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Self::from_toml(&text, &base).map_err(|e| ConstructError::InFile {
            path: path.to_path_buf(),
            source: Box::new(e),
        })
    }

    /// Checks ranges and that the three generators are different models.
    pub fn validate(&self) -> Result<()> {
        let named =
            |role: &str, e: conrub_judge::JudgeError| ConstructError::config(role, e.to_string());
        for (letter, g) in self.generators.lettered() {
            g.validate()
                .map_err(|e| named(&format!("generators.{letter}"), e))?;
        }
        self.reviewer.validate().map_err(|e| named("reviewer", e))?;
        let gens = self.generators.lettered();
        for i in 0..3 {
            for j in 0..i {
                if gens[i].1.model == gens[j].1.model {
                    return Err(ConstructError::config(
                        format!("generators.{}.model", gens[i].0),
                        format!(
                            "`{}` is also generator {}; consensus needs three different LLMs",
                            gens[i].1.model, gens[j].0
                        ),
                    ));
                }
            }
        }
        let b = &self.build;
        if b.min_review_score > 10 {
            return Err(ConstructError::config(
                "build.min_review_score",
                "scores run from 0 to 10",
            ));
        }
        if b.candidates_min == 0 || b.candidates_min > b.candidates_max {
            return Err(ConstructError::config(
                "build.candidates_min",
                "need 1 <= candidates_min <= candidates_max",
            ));
        }
        if b.max_content == 0 || b.max_content > conrub_rubric::validate::MAX_CONTENT {
            return Err(ConstructError::config(
                "build.max_content",
                "must be 1-10 (a record holds at most 10 content criteria)",
            ));
        }
        if b.prompt_concurrency == 0 {
            return Err(ConstructError::config(
                "build.prompt_concurrency",
                "must be at least 1",
            ));
        }
        if !self.dimensions.contains_key("other") {
            return Err(ConstructError::config(
                "dimensions.other",
                "an `other` cap is needed for criteria without a known dimension",
            ));
        }
        Ok(())
    }

    /// The cache database for an output directory.
    pub fn cache_path(&self, out_dir: &Path) -> PathBuf {
        match &self.build.cache {
            Some(p) => self.base_dir.join(p),
            None => out_dir.join("cache.sqlite"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toml_for(models: [&str; 3]) -> String {
        let mut s = String::new();
        for (l, m) in ['A', 'B', 'C'].iter().zip(models) {
            s.push_str(&format!(
                "[generators.{l}]\nurls = [\"http://127.0.0.1:1/v1\"]\nmodel = \"{m}\"\n"
            ));
        }
        s.push_str("[reviewer]\nurls = [\"http://127.0.0.1:1/v1\"]\nmodel = \"rev\"\n");
        s
    }

    #[test]
    fn defaults_and_errors_name_the_key() {
        let c = BuildConfig::from_toml(&toml_for(["a", "b", "c"]), Path::new("/cfg")).unwrap();
        assert_eq!(
            (c.build.min_review_score, c.build.max_content, c.build.seed),
            (8, 10, 1234)
        );
        assert_eq!(c.dimensions["safety"], 3);
        assert_eq!(
            c.cache_path(Path::new("/out")),
            PathBuf::from("/out/cache.sqlite")
        );
        let same = BuildConfig::from_toml(&toml_for(["a", "b", "a"]), Path::new(""))
            .unwrap_err()
            .to_string();
        assert!(
            same.contains("generators.C.model") && same.contains("three different"),
            "{same}"
        );
        let typo = BuildConfig::from_toml(
            &format!(
                "{}[build]\nmin_reveiw_score = 7\n",
                toml_for(["a", "b", "c"])
            ),
            Path::new(""),
        )
        .unwrap_err()
        .to_string();
        assert!(typo.contains("min_reveiw_score"), "{typo}");
        let bad = BuildConfig::from_toml(
            &format!("{}[build]\nmax_content = 12\n", toml_for(["a", "b", "c"])),
            Path::new(""),
        )
        .unwrap_err()
        .to_string();
        assert!(bad.contains("build.max_content"), "{bad}");
    }
}
