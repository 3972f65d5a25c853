"""torch's causal attention on the GPU, for `conrub bench attention` to be read against.

`scripts/gpu-check.sh --only bench` runs this next to `conrub bench attention` on the same GPU:
the same shapes (batch 1, GQA 32/8 x 128, bf16, causal, 2k and 8k tokens), the same FLOP
convention (a causal forward is 2 * 2 * b * heads * t^2 * head_dim / 2 FLOPs; forward +
backward 3.5 times that) and medians of the same number of timed calls after one untimed call.

`torch.nn.functional.scaled_dot_product_attention` runs under `sdpa_kernel(FLASH_ATTENTION)`
(FlashAttention-2 inside torch; the script says so and falls back to torch's default choice
when the flash backend refuses the inputs). K and V are repeated to the query heads first
(`repeat_interleave`, outside the timing), so every torch version's flash path takes them.

Prints one JSON line per case: {"bench": "attention", "impl": "torch-sdpa", "op", "tokens",
"secs", "tflops", "backend"}.

Usage: python3 benches/gpu/sdpa.py [--seq 2048,8192] [--heads 32,8,128] [--iters 5]
       [--device cuda:0] [--dtype bf16]   (--device cpu --seq 256 checks the script without a GPU)
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(fn, iters, device):
    fn()
    sync(device)
    times = []
    for _ in range(max(iters, 1)):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def flash_context():
    """The flash backend where this torch has the selector, else torch's default."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION), "flash"
    except ImportError:
        import contextlib
        return contextlib.nullcontext(), "default"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", default="2048,8192")
    ap.add_argument("--heads", default="32,8,128")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bf16")
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    h, kv, d = (int(x) for x in a.heads.split(","))
    gen = torch.Generator(device="cpu").manual_seed(0)
    for t in (int(x) for x in a.seq.split(",")):
        def rand(heads):
            x = torch.rand(1, heads, t, d, generator=gen) * 2 - 1
            return x.to(device=device, dtype=dtype)
        q = rand(h).requires_grad_()
        k = rand(kv).repeat_interleave(h // kv, dim=1).detach().requires_grad_()
        v = rand(kv).repeat_interleave(h // kv, dim=1).detach().requires_grad_()
        g = rand(h)
        flops = 2.0 * h * t * t * d
        context, backend = flash_context()
        try:
            with context:
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
        except RuntimeError as e:
            import contextlib
            context, backend = contextlib.nullcontext(), f"default ({str(e).splitlines()[0][:80]})"

        def forward():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def forward_backward():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(g)

        with context:
            for op, fn, mult in [("forward", forward, 1.0),
                                 ("forward+backward", forward_backward, 3.5)]:
                secs = median(fn, a.iters, device)
                print(json.dumps({"bench": "attention", "impl": "torch-sdpa", "op": op,
                                  "tokens": t, "heads": [h, kv, d], "dtype": a.dtype,
                                  "secs": secs, "tflops": mult * flops / secs / 1e12,
                                  "backend": backend, "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
