//! Peak memory and time of one learner update (forward, fused head, GRPO-style loss, backward,
//! AdamW) of a Qwen3-shaped model with few layers, at T = 512 ... 8,192 tokens, three ways:
//! the naive attention graph, the fused attention, and fused attention with per-layer activation
//! checkpointing. Prints the peaks, the growth exponent of peak memory in T (least squares of
//! log peak on log T over 1k..8k) and the time ratios against naive.
//!
//! Each measurement runs in a fresh child process; the peak is the most heap bytes held at once
//! (a counting allocator; the model, its optimizer state from a first warm-up update and the batch
//! are excluded as the baseline).
//!
//! `cargo bench --profile test --bench attention` (`CONRUB_BENCH_T=512,1024` picks lengths;
//! `CONRUB_BENCH_ITERS` timed updates, default 1 after one warm-up).

use std::process::Command;

#[path = "common/peak.rs"]
mod peak;

#[path = "common/attention_update.rs"]
mod attention_update;
use attention_update::{config, measure, predicted, MODES};

fn child(mode: &str, t: usize) {
    let iters: usize = std::env::var("CONRUB_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let (secs, peak) = measure(mode, t, iters, 1);
    println!("RESULT {secs} {peak}");
}

fn run_child(mode: &str, t: usize) -> Result<(f64, u64), String> {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--child", mode, &t.to_string()])
        .output()
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("RESULT "))
        .ok_or_else(|| {
            format!(
                "failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            )
        })?;
    let f: Vec<&str> = line.split_whitespace().collect();
    Ok((f[1].parse().unwrap(), f[2].parse().unwrap()))
}

/// Least-squares slope of ln(peak) on ln(T).
fn exponent(points: &[(usize, u64)]) -> f64 {
    let xs: Vec<f64> = points.iter().map(|p| (p.0 as f64).ln()).collect();
    let ys: Vec<f64> = points.iter().map(|p| (p.1.max(1) as f64).ln()).collect();
    let (mx, my) = (
        xs.iter().sum::<f64>() / xs.len() as f64,
        ys.iter().sum::<f64>() / ys.len() as f64,
    );
    let num: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let den: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
    num / den
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--child") {
        child(&args[i + 1], args[i + 2].parse().unwrap());
        return;
    }
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let ts: Vec<usize> = std::env::var("CONRUB_BENCH_T")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![512, 1024, 2048, 4096, 8192]);
    let c = config();
    println!(
        "one update of a Qwen3-shaped model (hidden {}, {} layers, {} heads / {} KV heads x {}, vocab {}), 1 sequence, flex CPU",
        c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads(), c.head_dim(), c.vocab_size
    );
    println!(
        "{:<11} {:>6} {:>9} {:>12} {:>12} {:>12}",
        "mode", "T", "seconds", "peak MB", "plan MB", "plan/peak"
    );
    let mut results: Vec<Vec<Option<(f64, u64)>>> = vec![Vec::new(); MODES.len()];
    for &t in &ts {
        for (m, mode) in MODES.iter().enumerate() {
            let r = run_child(mode, t);
            match &r {
                Ok((s, p)) => {
                    let (plan, ratio) = match predicted(mode, t, 1) {
                        Some(b) => (format!("{:.1}", b / 1e6), format!("{:.2}", b / *p as f64)),
                        None => ("-".into(), "-".into()),
                    };
                    println!(
                        "{mode:<11} {t:>6} {s:>9.3} {:>12.1} {plan:>12} {ratio:>12}",
                        *p as f64 / 1e6
                    )
                }
                Err(e) => println!("{mode:<11} {t:>6} {e}"),
            }
            results[m].push(r.ok());
        }
    }
    for (m, mode) in MODES.iter().enumerate() {
        let pts: Vec<(usize, u64)> = ts
            .iter()
            .zip(&results[m])
            .filter(|(t, _)| **t >= 1024)
            .filter_map(|(t, r)| r.map(|r| (*t, r.1)))
            .collect();
        if pts.len() >= 2 {
            println!(
                "{mode:<11} peak memory grows as T^{:.2} (T >= 1024)",
                exponent(&pts)
            );
        }
    }
    for (i, &t) in ts.iter().enumerate() {
        if let Some((naive, _)) = results[0][i] {
            let ratio = |m: usize| {
                results[m][i]
                    .map(|r| format!("{:.2}x", r.0 / naive))
                    .unwrap_or_else(|| "-".into())
            };
            println!(
                "T = {t:>5}: time vs naive: fused {}, fused+ckpt {}",
                ratio(1),
                ratio(2)
            );
        }
    }
}
