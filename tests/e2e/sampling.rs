//! One sampling parameter type, every path that samples: the table turns each knob of
//! `SamplingParams` on in turn (then all at once), and each path must agree with the host rule
//! (`conrub_contracts::sample_token`): the tensor sampler (`sample_rows_by_tensor_ops`, with
//! the penalty as tensor ops), flex's pass over the logits' buffer, the CubeCL kernel (wgpu: lavapipe in CI) and the SGLang request (the knob's value under
//! its SGLang name). A new field of `SamplingParams` without a row here fails the first test.
//!
//! Draws are compared where the host's choice is stable: the device paths sum in f32, so a
//! uniform draw within rounding of a boundary between two tokens may pick the neighbour; such
//! draws (the host's token changes within ±0.002 of `u`) are left out, and at least half of the
//! rows must remain.

use std::collections::BTreeSet;

use burn::tensor::{Tensor, TensorData};
use conrub_contracts::{sample_token, sequence_rng};
use conrub_kernels::KernelOps;
use conrub_rollout::{sample_on_device, Decoding, SamplingConfig, SamplingParams};
use rand::{Rng, SeedableRng};

/// A knob: its field, how the row turns it on, and the value the SGLang request must carry.
type Knob = (&'static str, fn(&mut SamplingParams), f64);

/// Every knob of the rule, each set away from its default.
const KNOBS: &[Knob] = &[
    ("temperature", |p| p.temperature = 0.7, 0.7),
    ("top_p", |p| p.top_p = 0.8, 0.8),
    ("top_k", |p| p.top_k = Some(5), 5.0),
    ("min_p", |p| p.min_p = 0.1, 0.1),
    ("repetition_penalty", |p| p.repetition_penalty = 1.3, 1.3),
];

const ROWS: usize = 48;
const VOCAB: usize = 16;

/// The table's rows: each knob alone, then all of them.
fn table() -> Vec<(String, SamplingParams)> {
    let mut rows: Vec<(String, SamplingParams)> = KNOBS
        .iter()
        .map(|(name, set, _)| {
            let mut p = SamplingParams::default();
            set(&mut p);
            (name.to_string(), p)
        })
        .collect();
    let mut all = SamplingParams::default();
    for (_, set, _) in KNOBS {
        set(&mut all);
    }
    rows.push(("all".into(), all));
    rows
}

/// Seeded logits `[ROWS, VOCAB]` and each row's seen ids (what a repetition penalty touches).
fn inputs() -> (Vec<f32>, Vec<Vec<u32>>) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let logits = (0..ROWS * VOCAB)
        .map(|_| rng.random_range(-3.0f32..3.0))
        .collect();
    let seen = (0..ROWS)
        .map(|r| vec![(r % VOCAB) as u32, ((r * 7 + 3) % VOCAB) as u32])
        .collect();
    (logits, seen)
}

/// The host rule's draws `(token, logprob)` per row at each row's uniform `u`, and whether the
/// draw is stable (the same token within ±0.002 of `u`).
fn host_draws(
    cfg: &SamplingConfig,
    logits: &[f32],
    seen: &[Vec<u32>],
) -> Vec<((u32, f32), f64, bool)> {
    (0..ROWS)
        .map(|r| {
            let row = &logits[r * VOCAB..(r + 1) * VOCAB];
            let mut rng = sequence_rng(11, r as u64);
            let u: f64 = rng.clone().random();
            let drawn = sample_token(row, &seen[r], cfg, &mut rng);
            let at = |v: f64| {
                let mut row = row.to_vec();
                let penalty = cfg.decoding.repetition_penalty();
                if penalty != 1.0 {
                    conrub_kernels::sampling::penalize_row(&mut row, &seen[r], penalty);
                }
                conrub_kernels::sampling::sample_row(&row, &cfg.decoding, v.clamp(0.0, 0.999_999)).0
            };
            (
                drawn,
                u,
                at(u - 0.002) == drawn.0 && at(u + 0.002) == drawn.0,
            )
        })
        .collect()
}

/// Which sampler of a backend runs.
#[derive(Clone, Copy)]
enum Path {
    /// The backend's own (`sample_on_device`: flex's buffer pass, the CubeCL kernel).
    Backend,
    /// The tensor sampler every backend has (`sample_rows_by_tensor_ops`).
    TensorOps,
}

/// Backend `B`'s draws on its device under `cfg` at the host's uniforms.
fn device_draws<B: KernelOps>(
    device: &B::Device,
    path: Path,
    cfg: &SamplingConfig,
    logits: &[f32],
    seen: &[Vec<u32>],
    uniforms: &[f64],
) -> Vec<(u32, f32)> {
    let t = Tensor::<B, 2>::from_data(TensorData::new(logits.to_vec(), [ROWS, VOCAB]), device);
    let seen: Vec<&[u32]> = seen.iter().map(Vec::as_slice).collect();
    let (tok, lp) = match path {
        Path::Backend => sample_on_device::<B>(t, &seen, cfg, uniforms),
        Path::TensorOps => {
            let penalty = cfg.decoding.repetition_penalty();
            let t = conrub_kernels::sampling::penalize_rows_by_tensors(t, &seen, penalty);
            let (tok, lp) = conrub_kernels::sampling::sample_rows_by_tensor_ops::<B>(
                t.into_primitive().tensor(),
                &cfg.decoding,
                uniforms,
            );
            (
                Tensor::from_primitive(tok),
                Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(lp)),
            )
        }
    };
    let tok: Vec<i64> = tok.into_data().convert::<i64>().to_vec().unwrap();
    let lp: Vec<f32> = lp.into_data().convert::<f32>().to_vec().unwrap();
    tok.into_iter().map(|t| t as u32).zip(lp).collect()
}

/// Checks one backend against the host over the table.
fn agrees_with_host<B: KernelOps>(name: &str, device: &B::Device, path: Path) {
    let (logits, seen) = inputs();
    for (knob, params) in table() {
        let cfg = SamplingConfig {
            decoding: Decoding::Sample(params),
            ..SamplingConfig::default()
        };
        let host = host_draws(&cfg, &logits, &seen);
        let uniforms: Vec<f64> = host.iter().map(|h| h.1).collect();
        let got = device_draws::<B>(device, path, &cfg, &logits, &seen, &uniforms);
        let mut compared = 0;
        for (r, (((tok, lp), _, stable), (dt, dlp))) in host.iter().zip(&got).enumerate() {
            if !stable {
                continue;
            }
            compared += 1;
            assert_eq!(
                *dt, *tok,
                "{name}, {knob}: row {r} drew {dt}, the host {tok}"
            );
            assert!(
                (dlp - lp).abs() < 1e-4,
                "{name}, {knob}: row {r} log-prob {dlp} vs the host's {lp}"
            );
        }
        assert!(
            compared >= ROWS / 2,
            "{name}, {knob}: {compared} stable rows of {ROWS}"
        );
    }
}

/// The table has a row for every field of `SamplingParams`.
#[test]
fn the_table_covers_every_knob() {
    let fields: BTreeSet<String> = serde_json::to_value(SamplingParams::default())
        .unwrap()
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let rows: BTreeSet<String> = KNOBS.iter().map(|k| k.0.to_string()).collect();
    assert_eq!(
        rows, fields,
        "give every knob of SamplingParams a row in KNOBS"
    );
    for (knob, params) in table() {
        params
            .validate("")
            .unwrap_or_else(|e| panic!("{knob}: {e}"));
    }
}

/// The tensor sampler and flex's buffer pass agree with the host rule.
#[test]
fn the_cpu_samplers_agree_with_the_host_rule() {
    let device = Default::default();
    agrees_with_host::<burn::backend::Flex>("tensor ops", &device, Path::TensorOps);
    agrees_with_host::<burn::backend::Flex>("flex", &device, Path::Backend);
}

/// The CubeCL kernel agrees with the host rule.
#[cfg(feature = "wgpu")]
#[test]
fn the_cubecl_kernel_agrees_with_the_host_rule() {
    if !conrub_kernels::wgpu_adapter_or_skip("the_cubecl_kernel_agrees_with_the_host_rule") {
        return;
    }
    agrees_with_host::<burn::backend::Wgpu>("wgpu", &Default::default(), Path::Backend);
}

/// The SGLang request carries each knob under its name (greedy as temperature 0).
#[test]
fn the_sglang_request_carries_every_knob() {
    for (name, set, want) in KNOBS {
        let mut p = SamplingParams::default();
        set(&mut p);
        let cfg = SamplingConfig {
            decoding: Decoding::Sample(p),
            ..SamplingConfig::default()
        };
        let body = conrub_remote::protocol::generate_body(&[1, 2], 4, &cfg);
        let got = body["sampling_params"][*name].as_f64().unwrap();
        assert!(
            (got - want).abs() < 1e-6,
            "{name}: {got} in the request, {want} set"
        );
    }
    let body = conrub_remote::protocol::generate_body(&[1], 1, &SamplingConfig::greedy(4));
    assert_eq!(body["sampling_params"]["temperature"], 0.0);
}
