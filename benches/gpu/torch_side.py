"""PyTorch's side of conrub's GPU benchmark (`benches/gpu/compare.py` runs both sides).

What a PyTorch user runs instead of conrub, on the same GPU and the same tokens:

- `train`: one training step (forward, backward, AdamW) of a Qwen3-shaped model from
  transformers with random weights: f32 master weights under bf16 autocast (conrub's
  `bf16-mixed`), `sdpa` attention, fused AdamW (foreach on the CPU, where fused is not built),
  gradient checkpointing when asked (conrub's per-layer activation checkpointing). The loss is
  the sum of the target tokens' log-probabilities weighted like conrub's bench, computed in
  chunks of the sequence whose logits are recomputed in the backward (what Liger's fused linear
  cross-entropy does), so the `[tokens, 151,936]` logits never exist whole.
- `rollout`: `generate` with a static cache, `rows` prompts of `prompt` tokens, exactly `new`
  new tokens each (end-of-sequence ignored), sampling at temperature 1, bf16 weights.

Each run prints one JSON line (and appends it to `--out`): seconds of the first (cold) step and
of the timed ones, tokens/s, model FLOPs and MFU against `--peak-tflops` (989: an H100/H200's
dense bf16), or `{"skipped": why}` when the shape does not fit the device.

Usage: python3 benches/gpu/torch_side.py train --shape 0.6b --rows 8 --seq 2048 [--checkpointing]
       python3 benches/gpu/torch_side.py rollout --shape 0.6b --rows 64 --prompt 256 --new 1024
       (--device cpu --shape tiny checks the script without a GPU)
"""
import argparse
import json
import math
import sys
import time

import torch
import transformers

# The shapes conrub's `bench` names (Qwen/Qwen3-0.6B and Qwen/Qwen3-4B's configs; `tiny` is
# for checking the script on a CPU).
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 tie_word_embeddings=True),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               tie_word_embeddings=True),
}
VOCAB = 151_936


def config(shape):
    return transformers.Qwen3Config(vocab_size=VOCAB, max_position_embeddings=40_960,
                                    rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                                    attn_implementation="sdpa", **SHAPES[shape])


def matmul_params(shape):
    """Weights that take part in matmuls per token: every projection plus the LM head."""
    s = SHAPES[shape]
    h, i, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    q = s["num_attention_heads"] * s["head_dim"]
    kv = s["num_key_value_heads"] * s["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    return layers * per_layer + VOCAB * h


def train_flops(shape, rows, seq):
    """Model FLOPs of one training step: 3 x forward (forward + backward), forward = 2 x matmul
    weights per token plus causal attention's QK^T and PV (2 x 2 x heads x head_dim x the mean
    context, seq / 2, per layer). Recomputation under checkpointing is not counted (MFU, not
    hardware FLOPs utilisation). conrub's `bench` uses the same formula."""
    s = SHAPES[shape]
    attn = 2 * 2 * s["num_hidden_layers"] * s["num_attention_heads"] * s["head_dim"] * (seq / 2)
    return 3 * rows * seq * (2 * matmul_params(shape) + attn)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def emit(record, out):
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def chunked_logprob_loss(model, hidden, targets, weights, chunk):
    """sum(weights * log p(targets)) over the sequence, `chunk` positions at a time; each chunk's
    logits are recomputed in the backward (torch.utils.checkpoint), so one chunk's live at once."""
    head = model.lm_head

    def part(h, t, w):
        logits = head(h).float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
        return (lp * w).sum()

    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, hidden.shape[1], chunk):
        e = min(s + chunk, hidden.shape[1])
        total = total + torch.utils.checkpoint.checkpoint(
            part, hidden[:, s:e], targets[:, s:e], weights[:, s:e], use_reentrant=False)
    return total


def train(args, device):
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config(args.shape)).to(device)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-6, weight_decay=0.1, fused=fused,
                            foreach=not fused)
    g = torch.Generator().manual_seed(1)
    # conrub's layout: `seq` tokens in, the log-probabilities of tokens 1.. (predicted at the
    # positions before them) weighted by -1 / their count.
    ids = torch.randint(0, 150_000, (args.rows, args.seq), generator=g).to(device)
    targets = ids[:, 1:]
    n = args.rows * (args.seq - 1)
    weights = torch.full((args.rows, args.seq - 1), -1.0 / n, device=device)
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16)

    def step():
        with autocast:
            hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
            loss = chunked_logprob_loss(model, hidden, targets, weights, args.chunk)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)

    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    secs = min(times) if times else first
    tokens = args.rows * args.seq
    flops = train_flops(args.shape, args.rows, args.seq)
    return dict(first_step_secs=first, secs=secs, tokens_per_s=tokens / secs,
                tflops=flops / secs / 1e12, mfu=flops / secs / (args.peak_tflops * 1e12),
                peak_memory_gb=(torch.cuda.max_memory_allocated(device) / 1e9
                                if device.type == "cuda" else None))


def rollout(args, device):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = transformers.Qwen3ForCausalLM(config(args.shape)).to(device=device, dtype=dtype)
    model.eval()
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, 150_000, (args.rows, args.prompt), generator=g).to(device)
    kwargs = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=True,
                  temperature=1.0, top_p=1.0, top_k=0, eos_token_id=None, pad_token_id=0,
                  cache_implementation="static")

    def run():
        with torch.no_grad():
            out = model.generate(prompts, **kwargs)
        sync(device)
        return out

    t0 = time.perf_counter()
    out = run()
    first = time.perf_counter() - t0
    assert out.shape == (args.rows, args.prompt + args.new), out.shape
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    secs = min(times) if times else first
    return dict(first_secs=first, secs=secs, tokens_per_s=args.rows * args.new / secs)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["train", "rollout"])
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=1024, help="loss chunk (positions)")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--iters", type=int, default=2, help="timed runs after the first")
    p.add_argument("--device", default="cuda")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--out", default=None, help="also append the JSON line here")
    args = p.parse_args()
    device = torch.device(args.device)
    record = dict(side="pytorch", what=args.what, shape=args.shape, rows=args.rows,
                  device=(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
                  torch=torch.__version__, transformers=transformers.__version__)
    if args.what == "train":
        record.update(seq=args.seq, checkpointing=args.checkpointing, loss_chunk=args.chunk)
    else:
        record.update(prompt=args.prompt, new=args.new)
    try:
        record.update(train(args, device) if args.what == "train" else rollout(args, device))
    except torch.cuda.OutOfMemoryError as e:
        record["skipped"] = f"out of memory: {str(e).splitlines()[0]}"
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
