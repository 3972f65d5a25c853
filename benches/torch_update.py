"""PyTorch baseline for `cargo bench --bench learner`: one GRPO update (forward, TRL's GRPO loss via
GRPOTrainer._compute_loss, backward, AdamW step) on a random Qwen3 of the demo shape (hidden 64,
2 layers, 4 query / 2 KV heads, head_dim 16, full 151,936-token vocabulary), CPU, float32.

Two ways to get the log-probabilities, each timed (only completion positions reach the head in
both, as in conrub):
- `fused`: what GRPOTrainer runs by default in TRL 1.x: `add_fused_lm_head` (a tiled LM head with
  log-probs and entropy, no `[tokens, vocab]` logits) through
  `GRPOTrainer._get_per_token_logps_and_entropies`. Skipped on a TRL without it.
- `logits`: the completion positions' logits (`logits_to_keep`) and TRL's `selective_log_softmax`
  and `entropy_from_logits`, GRPOTrainer's path before the fused head.
- `plain`: the same logits through one `log_softmax`, a `gather`, and the entropy from that same
  `log_softmax` (what a PyTorch user writes by hand; the fastest of the three on a CPU here).
The loss, backward and AdamW are TRL's / PyTorch's in all three. The last line,
`best: NAME TOKENS_PER_S`, is the fastest variant: the baseline the bench compares to.

Usage: python3 benches/torch_update.py ROWS PROMPT_LEN RESPONSE_LEN [VARIANTS, default plain,logits,fused]
"""
import sys
import time
from collections import defaultdict
from types import SimpleNamespace

import contextlib

import torch
import transformers
import trl
from trl.trainer import utils as trl_utils
from trl.trainer.grpo_trainer import GRPOTrainer

rows, plen, rlen = (int(x) for x in sys.argv[1:4])
variants = (sys.argv[4] if len(sys.argv) > 4 else "plain,logits,fused").split(",")
torch.manual_seed(0)
cfg = transformers.Qwen3Config(
    vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
    rms_norm_eps=1e-6, attn_implementation="eager")
model = transformers.Qwen3ForCausalLM(cfg).float()
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=3e-6, weight_decay=0.1)
prompt = torch.randint(0, 150000, (rows, plen))
completion = torch.randint(0, 150000, (rows, rlen))
ids = torch.cat([prompt, completion], 1)
mask = torch.ones(rows, rlen)
adv = torch.tensor([((i % 8) - 3.5) / 2.3 for i in range(rows)])


HAS_FUSED = hasattr(trl_utils, "add_fused_lm_head")
if HAS_FUSED:
    # Patches `forward`; the plain forward stays reachable (fused_lm_head=False).
    trl_utils.add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
VARIANT = "plain"


class Accel:
    num_processes = 1
    sync_gradients = True
    is_main_process = True
    def gather(self, x): return x
    gather_for_metrics = gather
    def reduce(self, x, reduction="sum"): return x
    def autocast(self): return contextlib.nullcontext()


def logps_and_entropy(*_args, **_kwargs):
    """The older TRL's path: completion logits only, then selective_log_softmax."""
    logits = model(input_ids=ids, logits_to_keep=rlen + 1).logits[:, :-1, :]
    with torch.no_grad():  # telemetry only, as in conrub
        entropy = trl_utils.entropy_from_logits(logits)
    return trl_utils.selective_log_softmax(logits, completion), entropy, None


def plain_logps_and_entropy(*_args, **_kwargs):
    """By hand: one log_softmax of the completion logits, a gather, the entropy from the same tensor."""
    logp = torch.log_softmax(model(input_ids=ids, logits_to_keep=rlen + 1).logits[:, :-1, :], -1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, completion.unsqueeze(-1)).squeeze(-1), entropy, None


def trainer():
    s = SimpleNamespace(
        aux_loss_enabled=False, accelerator=Accel(), temperature=1.0)
    if VARIANT == "fused":
        s._get_per_token_logps_and_entropies = lambda *a, **k: GRPOTrainer._get_per_token_logps_and_entropies(s, *a, **k)
    elif VARIANT == "logits":
        s._get_per_token_logps_and_entropies = logps_and_entropy
    else:
        s._get_per_token_logps_and_entropies = plain_logps_and_entropy
    return s


def step(old):
    s = trainer()
    s.__dict__.update(
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=0.0, loss_type="grpo", epsilon_low=0.2, epsilon_high=0.28,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False), use_vllm=False,
        vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=rlen, _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)))
    inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones(rows, plen), "completion_ids": completion,
              "completion_mask": mask, "advantages": adv, "old_per_token_logps": old}
    loss = GRPOTrainer._compute_loss(s, model, inputs)
    opt.zero_grad()
    loss.backward()
    opt.step()


best = None
print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, threads {torch.get_num_threads()}")
for variant in variants:
    if variant == "fused" and not HAS_FUSED:
        print("fused: skipped (this TRL has no add_fused_lm_head)")
        continue
    VARIANT = variant
    with torch.no_grad():
        old = trainer()._get_per_token_logps_and_entropies(model, ids, torch.ones_like(ids), rlen)[0]
    step(old)
    # At least 3 timed steps, or 1 when a step takes over 10 s.
    t = time.perf_counter()
    n = 0
    while n < 3 and not (n >= 1 and time.perf_counter() - t > 10.0):
        step(old)
        n += 1
    dt = (time.perf_counter() - t) / n
    tps = rows * rlen / dt
    print(f"{variant}: update {dt * 1e3:.1f} ms/step, {tps:.0f} response tokens/s ({n} timed steps)")
    if best is None or tps > best[1]:
        best = (variant, tps)
print(f"best: {best[0]} {best[1]:.1f}")
