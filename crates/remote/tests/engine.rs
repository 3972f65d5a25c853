//! The SGLang engine against the scripted server: weight updates with checksums, checked
//! replies, colocation, and every injected fault as an error naming the server and the field.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use burn::backend::Flex;
use conrub_contracts::{RolloutEngine, RolloutRequest};
use conrub_models::{CausalLm, ModelConfig};
use conrub_remote::testing::{Event, Fault, ScriptedSglang, SCRIPTED_LOGPROB};
use conrub_remote::{SglangConfig, SglangEngine, WeightWriter};
use conrub_rollout::{Decoding, FinishReason, SamplingConfig, SamplingParams};

type P = CausalLm<Flex>;

fn model() -> P {
    CausalLm::random(&ModelConfig::tiny(64), 0.1, 1, &Default::default())
}

/// Writes a `model.safetensors` whose bytes say which write it was.
fn writer(count: Arc<AtomicU64>) -> WeightWriter<P> {
    Arc::new(move |_policy: &P, dir: &Path| {
        let n = count.fetch_add(1, Ordering::SeqCst);
        let bytes = format!("weights #{n}").into_bytes();
        std::fs::write(dir.join("model.safetensors"), &bytes)?;
        Ok(bytes.len() as u64)
    })
}

fn engine(urls: Vec<String>, dir: &Path, colocate: bool) -> SglangEngine<P> {
    let cfg = SglangConfig {
        urls,
        timeout_secs: 2.0,
        max_retries: 1,
        backoff_secs: 0.01,
        concurrency: 3,
        colocate,
        vocab_size: 64,
        weights_dir: dir.to_path_buf(),
    };
    SglangEngine::new(cfg, writer(Arc::new(AtomicU64::new(0))), runtime()).unwrap()
}

/// The tests' one runtime (a program has one; the engine calls on its handle).
fn runtime() -> tokio::runtime::Handle {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    })
    .handle()
    .clone()
}

fn sampling() -> SamplingConfig {
    SamplingConfig {
        max_new_tokens: 6,
        decoding: Decoding::Sample(SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            min_p: 0.0,
            repetition_penalty: 1.0,
        }),
        seed: 0,
        stop_ids: vec![2],
        first_stream: 0,
    }
}

fn rollout(e: &SglangEngine<P>, m: &P) -> conrub_contracts::Result<conrub_contracts::RolloutBatch> {
    let prompts = vec![vec![5, 6], vec![7], vec![8, 9, 3]];
    let s = sampling();
    let request = RolloutRequest {
        prompts: &prompts,
        group_size: 4,
        sampling: &s,
        step: 0,
        first_group: 0,
    };
    RolloutEngine::<Flex, P>::rollout(e, m, &request, &Default::default())
}

fn sync(
    e: &SglangEngine<P>,
    m: &P,
    v: u64,
) -> conrub_contracts::Result<conrub_contracts::WeightSync> {
    RolloutEngine::<Flex, P>::sync_weights(e, m, v)
}

fn sha(path: &Path) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(std::fs::read(path).unwrap());
    d.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn weights_go_to_every_server_and_rollouts_come_back_checked() {
    let (a, b) = (ScriptedSglang::start(), ScriptedSglang::start());
    let tmp = tempfile::tempdir().unwrap();
    let e = engine(vec![a.url.clone(), b.url.clone()], tmp.path(), true);
    let m = model();
    let s0 = sync(&e, &m, 0).unwrap();
    assert!(s0.bytes > 0);
    assert_eq!(sync(&e, &m, 0).unwrap().bytes, 0, "already at version 0");
    let batch = rollout(&e, &m).unwrap();
    assert_eq!(batch.rows(), 12);
    for (t, l) in batch.responses.iter().zip(&batch.logprobs) {
        assert!(
            t.iter().all(|id| (10..=16).contains(id) || *id == 2),
            "{t:?}"
        );
        assert!(l
            .iter()
            .all(|x| (*x as f64 - SCRIPTED_LOGPROB).abs() < 1e-6));
    }
    let stops = batch
        .finish_reasons
        .iter()
        .filter(|f| **f == FinishReason::Stop);
    assert!(stops.count() > 0);
    // Groups 0 and 2 on the first server, group 1 on the second.
    let generates = |s: &ScriptedSglang| {
        s.state
            .events()
            .iter()
            .filter(|e| matches!(e, Event::Generate { .. }))
            .count()
    };
    assert_eq!((generates(&a), generates(&b)), (2, 1));
    RolloutEngine::<Flex, P>::release(&e).unwrap();
    RolloutEngine::<Flex, P>::release(&e).unwrap();
    for v in 1..=3 {
        sync(&e, &m, v).unwrap();
    }
    // Each server: the update, its generations, one release, then resume + update per version.
    let dir = |v: u64| tmp.path().join(format!("step-{v:06}"));
    for s in [&a, &b] {
        let ev = s.state.events();
        let kinds: Vec<&str> = ev
            .iter()
            .map(|e| match e {
                Event::Generate { .. } => "generate",
                Event::Update { .. } => "update",
                Event::Release => "release",
                Event::Resume => "resume",
            })
            .filter(|k| *k != "generate")
            .collect();
        assert_eq!(
            kinds,
            ["update", "release", "resume", "update", "update", "update"]
        );
        let Some(Event::Update { version, sha256 }) = ev.last() else {
            panic!("{ev:?}")
        };
        assert_eq!(version, "step-000003");
        assert_eq!(sha256, &sha(&dir(3).join("model.safetensors")));
    }
    // Two versions kept.
    assert!(!dir(0).exists() && !dir(1).exists() && dir(2).exists() && dir(3).exists());
}

#[test]
fn every_fault_is_an_error_naming_the_server_and_the_field() {
    let s = ScriptedSglang::start();
    let tmp = tempfile::tempdir().unwrap();
    let m = model();
    let url = s.url.clone();
    let cases = [
        (Fault::Refuse, "/generate: HTTP 503: overloaded (after 2 attempts)"),
        (Fault::Slow(3000), "/generate: no reply within 2 s (after 2 attempts)"),
        (Fault::Malformed, "/generate (body): not JSON"),
        (Fault::WrongCount, "(body): 3 outputs for n = 4"),
        (Fault::OutOfVocab, "[0].output_ids[0]: id 1073741824 is outside the vocabulary of 64"),
        (Fault::Stale, "[0].meta_info.weight_version: \"step-000014\" but the weights sent last are \"step-000015\": a reply from stale weights"),
    ];
    for (i, (fault, want)) in cases.into_iter().enumerate() {
        let e = engine(vec![url.clone()], tmp.path(), false);
        sync(&e, &m, 10 + i as u64).unwrap();
        s.state.set_fault(Some(fault));
        let err = rollout(&e, &m).unwrap_err().to_string();
        s.state.set_fault(None);
        assert!(
            err.contains(&format!("{url}: ")) && err.contains(want),
            "{fault:?}: {err}"
        );
    }
    // A failed weight update stops the run; the engine then knows no version, so the next
    // sync tries again.
    let e = engine(vec![url.clone()], tmp.path(), false);
    s.state.set_fault(Some(Fault::FailUpdate));
    let err = sync(&e, &m, 1).unwrap_err().to_string();
    assert!(
        err.contains(&format!("{url}: weight update to "))
            && err.contains("Failed to update weights: out of memory"),
        "{err}"
    );
    s.state.set_fault(None);
    assert!(sync(&e, &m, 1).unwrap().bytes > 0);
    // Nobody listening: refused, retried, named.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let e = engine(vec![dead.clone()], tmp.path(), false);
    let err = sync(&e, &m, 0).unwrap_err().to_string();
    assert!(
        err.starts_with(&format!(
            "rollout engine: {dead}: /update_weights_from_disk"
        )),
        "{err}"
    );
}
