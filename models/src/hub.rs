//! Resolving `--model` arguments: a local directory as is, or a Hugging Face model id through the
//! hub cache (`HF_HOME`, `HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_OFFLINE` honoured).

use std::path::{Path, PathBuf};

use crate::error::{ModelError, Result};

/// Files fetched for a model id (optional ones may be absent on the hub).
const REQUIRED: &[&str] = &["config.json"];
const OPTIONAL: &[&str] = &[
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
];

/// Returns a local directory holding the model: `model` itself when it is a directory, otherwise
/// the hub snapshot directory of model id `model` (downloaded into the cache if needed).
pub fn resolve_model_dir(model: &str) -> Result<PathBuf> {
    let path = Path::new(model);
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    if path.exists() {
        return Err(ModelError::ModelDir {
            dir: path.to_path_buf(),
            message: "is a file; pass the model directory (with config.json and *.safetensors)"
                .into(),
        });
    }
    if model.starts_with('.') || model.starts_with('/') || model.split('/').count() != 2 {
        return Err(ModelError::ModelDir {
            dir: path.to_path_buf(),
            message: "no such directory (and not a hub id of the form `owner/name`)".into(),
        });
    }
    // `runs/nope` has a hub id's shape, but `runs/` is a folder here: a mistyped local path, not
    // a model to look up on the hub (which would fail offline with a DNS error).
    if let Some(parent) = path.parent().filter(|p| p.is_dir()) {
        return Err(ModelError::ModelDir {
            dir: path.to_path_buf(),
            message: format!(
                "no such directory (`{}` is a local folder, so this names a path, not a hub id)",
                parent.display()
            ),
        });
    }
    fetch(model)
}

#[cfg(feature = "hub")]
fn fetch(model: &str) -> Result<PathBuf> {
    use hf_hub::api::sync::ApiBuilder;
    use hf_hub::{Cache, Repo};

    let offline =
        std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
    let cache = Cache::from_env();
    let cached = cache.repo(Repo::model(model.to_string()));
    let hub_err = |what: String| {
        ModelError::Hub {
        model: model.to_string(),
        message: format!(
            "{what}. Download it where the hub is reachable (e.g. `huggingface-cli download {model}`) \
             into the cache at {} (set HF_HOME to use another), set HF_TOKEN for gated models, or pass \
             a local directory to --model",
            cache.path().display()
        ),
    }
    };
    // Fully cached: use it without touching the network.
    let weights_cached = cached
        .get("model.safetensors")
        .or_else(|| cached.get("model.safetensors.index.json"));
    if let (Some(config), Some(_)) = (cached.get("config.json"), weights_cached.as_ref()) {
        let dir = config
            .parent()
            .expect("cached file has a parent")
            .to_path_buf();
        if let Some(index) = cached.get("model.safetensors.index.json") {
            if let Some(shard) = missing_shard(&index, &dir)? {
                return Err(hub_err(format!("shard {shard} is missing from the cache")));
            }
        }
        return Ok(dir);
    }
    if offline {
        return Err(hub_err(
            "not in the local hub cache and HF_HUB_OFFLINE is set".into(),
        ));
    }
    let token = std::env::var("HF_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
        .or_else(|| cache.token());
    let api = ApiBuilder::from_env()
        .with_token(token)
        .with_progress(false)
        .build()
        .map_err(|e| hub_err(format!("cannot start the hub client: {e}")))?;
    let repo = api.model(model.to_string());
    let mut dir = None;
    for file in REQUIRED {
        let p = repo
            .get(file)
            .map_err(|e| hub_err(format!("could not download {file}: {e}")))?;
        dir = p.parent().map(Path::to_path_buf);
    }
    for file in OPTIONAL {
        let _ = repo.get(file);
    }
    match repo.get("model.safetensors") {
        Ok(_) => {}
        Err(_) => {
            let index = repo.get("model.safetensors.index.json").map_err(|e| {
                hub_err(format!(
                    "could not download model.safetensors or its index: {e}"
                ))
            })?;
            for shard in shard_names(&index)? {
                repo.get(&shard)
                    .map_err(|e| hub_err(format!("could not download {shard}: {e}")))?;
            }
        }
    }
    Ok(dir.expect("config.json was downloaded"))
}

#[cfg(not(feature = "hub"))]
fn fetch(model: &str) -> Result<PathBuf> {
    Err(ModelError::Hub {
        model: model.to_string(),
        message: "this build has no hub support (feature `hub`); pass a local directory".into(),
    })
}

#[cfg(feature = "hub")]
fn shard_names(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).map_err(|e| ModelError::io(index, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: index.to_path_buf(),
        source,
    })?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| ModelError::Weights {
            file: index.to_path_buf(),
            tensor: "weight_map".into(),
            message: "the index has no weight_map".into(),
        })?;
    let mut shards: Vec<String> = map
        .values()
        .filter_map(|s| s.as_str().map(String::from))
        .collect();
    shards.sort();
    shards.dedup();
    Ok(shards)
}

#[cfg(feature = "hub")]
/// The first shard named by `index` that is not in `dir`.
fn missing_shard(index: &Path, dir: &Path) -> Result<Option<String>> {
    Ok(shard_names(index)?
        .into_iter()
        .find(|shard| !dir.join(shard).exists()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_directory_is_used_as_is() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            resolve_model_dir(dir.path().to_str().unwrap()).unwrap(),
            dir.path()
        );
    }

    #[test]
    fn missing_local_path_is_a_clear_error() {
        let err = resolve_model_dir("./no/such/model")
            .unwrap_err()
            .to_string();
        assert!(err.contains("no such directory"), "{err}");
    }

    /// Issue 53, item 16: `--model runs/nope` went to the hub and failed with a DNS error.
    #[test]
    fn a_mistyped_path_under_a_local_folder_is_not_a_hub_id() {
        // Tests run in the crate's folder, which has `src/`.
        assert!(Path::new("src").is_dir());
        let err = resolve_model_dir("src/nope").unwrap_err().to_string();
        assert!(
            err.contains("no such directory") && err.contains("`src` is a local folder"),
            "{err}"
        );
    }

    #[cfg(feature = "hub")]
    #[test]
    fn offline_without_cache_says_what_to_do() {
        let home = tempfile::tempdir().unwrap();
        // Environment changes are process-wide; this is the only test that sets these variables.
        unsafe {
            std::env::set_var("HF_HOME", home.path());
            std::env::set_var("HF_HUB_OFFLINE", "1");
        }
        let err = resolve_model_dir("Qwen/Qwen3-0.6B")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("HF_HUB_OFFLINE") && err.contains("--model"),
            "{err}"
        );
    }
}
