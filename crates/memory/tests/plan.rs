//! The memory plan's arithmetic on the released Qwen3 shapes (`conrub_models::KNOWN_SHAPES`):
//! parameter counts, KV bytes, the published run's peaks, the maxima and the plan's budget rules.

use conrub_memory::*;

fn shape(id: &str) -> ModelShape {
    conrub_models::known_shape(id).unwrap()
}

fn published(precision: Precision, checkpointing: bool, micro: usize) -> MemoryPlanInput {
    MemoryPlanInput {
        precision,
        activation_checkpointing: checkpointing,
        micro_batch_tokens: micro,
        ..MemoryPlanInput::new(shape("Qwen/Qwen3-4B-Instruct-2507"))
    }
}

#[test]
fn parameter_counts_match_the_released_models() {
    assert_eq!(shape("Qwen/Qwen3-0.6B").parameters(), 596_049_920);
    assert_eq!(
        conrub_models::ModelConfig::qwen3_0_6b()
            .shape()
            .parameters(),
        596_049_920
    );
    assert_eq!(shape("Qwen/Qwen3-4B").parameters(), 4_022_468_096);
    assert_eq!(shape("Qwen/Qwen3-4B-Instruct-2507"), shape("qwen/qwen3-4b"));
    assert_eq!(shape("Qwen/Qwen3-1.7B").parameters(), 1_720_574_976);
    assert_eq!(shape("Qwen/Qwen3-8B").parameters(), 8_190_735_360);
    assert_eq!(shape("Qwen/Qwen3-14B").parameters(), 14_768_307_200);
    assert_eq!(shape("Qwen/Qwen3-32B").parameters(), 32_762_123_264);
    assert!(conrub_models::known_shape("Qwen/Qwen2.5-7B").is_none());
}

#[test]
fn parts_add_up_to_the_peaks() {
    let plan = MemoryPlan::new(published(Precision::Bf16Mixed, true, 65536));
    let s = |ph: Phase| {
        plan.parts
            .iter()
            .filter(|p| p.phase == ph)
            .map(|p| p.bytes)
            .sum::<f64>()
    };
    let micro = s(Phase::MicroBatch) + s(Phase::HeadBackward).max(s(Phase::LayerBackward));
    let training = s(Phase::Always)
        + s(Phase::Training)
        + micro
            .max(s(Phase::GradientSum))
            .max(s(Phase::OptimizerStep));
    assert!((plan.training_peak - training).abs() < 1.0);
    assert!(plan.input.micro_batches_per_optimizer_step() > 1);
    assert!((plan.rollout_peak - s(Phase::Always) - s(Phase::Rollout)).abs() < 1.0);
    assert_eq!(plan.peak, plan.training_peak.max(plan.rollout_peak));
    let p = plan.parameters as f64;
    let get = |name: &str| plan.parts.iter().find(|x| x.name == name).unwrap().bytes;
    assert_eq!(get("weights_f32"), 4.0 * p);
    assert_eq!(get("gradients"), 4.0 * p);
    assert_eq!(get("adamw_moments"), 8.0 * p);
    assert_eq!(get("rollout_weights_bf16"), 2.0 * p);
    // 7 full-length rows of 1,024 + 8,192 tokens in a 65,536-token budget.
    assert_eq!(plan.micro_batch_rows, 7);
    assert_eq!(plan.micro_batch_tokens_used, 7 * 9216);
}

#[test]
fn acceptance_targets_for_qwen3_4b() {
    let mixed = MemoryPlan::new(published(Precision::Bf16Mixed, true, 16384));
    assert!(mixed.training_fits(), "{}", mixed.table());
    assert!(mixed.max_micro_batch_tokens >= 16384, "{}", mixed.table());
    let f32_plain = MemoryPlan::new(published(Precision::F32, false, 65536));
    assert!(
        !f32_plain.training_fits() && !f32_plain.fits(),
        "{}",
        f32_plain.table()
    );
    assert!(f32_plain.check(141_000_000_000).is_err());
}

#[test]
fn checkpointing_and_bf16_reduce_activations() {
    let act = |i: MemoryPlanInput| {
        let plan = MemoryPlan::new(i);
        plan.parts
            .iter()
            .filter(|p| p.phase == Phase::MicroBatch)
            .map(|p| p.bytes)
            .sum::<f64>()
    };
    for precision in [Precision::F32, Precision::Bf16Mixed] {
        let with = act(published(precision, true, 65536));
        let without = act(published(precision, false, 65536));
        assert!(with * 5.0 < without, "{precision}: {with} vs {without}");
    }
    let f32_layer = shape("Qwen/Qwen3-4B").layer_activation_bytes(4.0);
    let bf16_layer = shape("Qwen/Qwen3-4B").layer_activation_bytes(2.0);
    assert!(bf16_layer < f32_layer);
    assert!(
        act(published(Precision::Bf16Mixed, false, 65536))
            < act(published(Precision::F32, false, 65536))
    );
}

#[test]
fn peaks_grow_with_the_settings() {
    // Small micro-batches are bounded by the gradient sum (two sets of f32 gradients), so the
    // training peak grows weakly at first, and strictly once activations dominate.
    let peaks: Vec<f64> = [9216, 18432, 36864, 73728, 147456]
        .iter()
        .map(|&m| MemoryPlan::new(published(Precision::Bf16Mixed, true, m)).training_peak)
        .collect();
    assert!(
        peaks.windows(2).all(|w| w[1] >= w[0]) && peaks[4] > peaks[2] && peaks[2] > peaks[0],
        "{peaks:?}"
    );
    // A small call's pool is capped at its rows at full length; beyond that, more rows
    // decoding at once mean a larger transient, so fewer full-length rows in the pool.
    let four = MemoryPlan::new(MemoryPlanInput {
        rollout_prompts_per_call: 4,
        ..published(Precision::Bf16Mixed, true, 16384)
    });
    assert_eq!(four.max_rollout_rows, 32, "{}", four.table());
    let mut last = usize::MAX;
    for prompts in [8, 16, 32] {
        let plan = MemoryPlan::new(MemoryPlanInput {
            rollout_prompts_per_call: prompts,
            ..published(Precision::Bf16Mixed, true, 16384)
        });
        assert!(
            plan.max_rollout_rows <= last && plan.rollout_fits(),
            "{}",
            plan.table()
        );
        last = plan.max_rollout_rows;
    }
    let small = MemoryPlan::new(MemoryPlanInput {
        max_response_tokens: 1024,
        ..published(Precision::Bf16Mixed, true, 16384)
    });
    let large = MemoryPlan::new(published(Precision::Bf16Mixed, true, 16384));
    assert!(small.max_rollout_rows > large.max_rollout_rows);
    let big_gpu = MemoryPlan::new(MemoryPlanInput {
        gpu_memory_gb: 282.0,
        ..published(Precision::Bf16Mixed, true, 16384)
    });
    assert!(
        big_gpu.max_micro_batch_tokens > large.max_micro_batch_tokens
            && big_gpu.max_rollout_rows > large.max_rollout_rows
    );
}

#[test]
fn rollouts_on_servers_leave_the_learner_its_training_peak() {
    let input = MemoryPlanInput {
        rollout_in_process: false,
        ..published(Precision::Bf16Mixed, true, 65536)
    };
    let plan = MemoryPlan::new(input);
    assert!(plan.parts.iter().all(|p| p.phase != Phase::Rollout));
    assert_eq!((plan.kv_pool_blocks, plan.max_rollout_rows), (0, 0));
    assert_eq!(plan.peak, plan.training_peak);
    assert!(plan.rollout_fits() && plan.fits(), "{}", plan.table());
    let local = MemoryPlan::new(published(Precision::Bf16Mixed, true, 65536));
    assert_eq!(local.training_peak, plan.training_peak);
    assert!(local.peak > plan.peak);
}

#[test]
fn a_plan_that_fits_nothing_says_so() {
    let plan = MemoryPlan::new(MemoryPlanInput {
        gpu_memory_gb: 8.0,
        ..published(Precision::F32, false, 65536)
    });
    assert_eq!(plan.max_micro_batch_tokens, 0);
    assert_eq!(plan.max_rollout_rows, 0);
    let err = plan.check(8_000_000_000).unwrap_err().to_string();
    assert!(
        err.contains("not even one full-length row") && err.contains("rollout call"),
        "{err}"
    );
    assert!(
        err.contains("bf16-mixed") && err.contains("activation_checkpointing = true"),
        "{err}"
    );
    let mixed = MemoryPlan::new(MemoryPlanInput {
        gpu_memory_gb: 8.0,
        ..published(Precision::Bf16Mixed, true, 65536)
    });
    let err = mixed.check(8_000_000_000).unwrap_err().to_string();
    assert!(
        !err.contains("bf16-mixed\"") && !err.contains("activation_checkpointing"),
        "{err}"
    );
    // A tiny model fits a small device and the whole step in one micro-batch.
    let tiny = MemoryPlan::new(MemoryPlanInput {
        model: conrub_models::ModelConfig::tiny(151_936).shape(),
        gpu_memory_gb: 80.0,
        max_response_tokens: 256,
        ..MemoryPlanInput::new(shape("Qwen/Qwen3-0.6B"))
    });
    assert!(tiny.fits(), "{}", tiny.table());
    assert_eq!(
        tiny.max_micro_batch_tokens,
        (tiny.input.step_rows() * 1280).next_multiple_of(1024)
    );
}

#[test]
fn json_has_the_documented_keys() {
    let v = MemoryPlan::new(published(Precision::Bf16Mixed, true, 65536)).to_json();
    for key in [
        "fits",
        "peak_gb",
        "parts",
        "max_micro_batch_tokens",
        "max_rollout_rows",
        "inputs",
    ] {
        assert!(v.get(key).is_some(), "{key}");
    }
    assert_eq!(v["inputs"]["precision"], "bf16-mixed");
    assert_eq!(v["inputs"]["model"]["hidden_size"], 2560);
    assert!(v["parts"]["kv_cache"].as_f64().unwrap() > 0.0);
}
