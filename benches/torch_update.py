"""PyTorch baseline for `cargo bench --bench learner`: one GRPO update (forward, TRL's GRPO loss via
GRPOTrainer._compute_loss, backward, AdamW step) on a random Qwen3 of the demo shape (hidden 64,
2 layers, 4 query / 2 KV heads, head_dim 16, full 151,936-token vocabulary), CPU, float32.

Usage: python3 benches/torch_update.py ROWS PROMPT_LEN RESPONSE_LEN
"""
import sys
import time
from collections import defaultdict
from types import SimpleNamespace

import torch
import transformers
from trl.trainer.grpo_trainer import GRPOTrainer

rows, plen, rlen = (int(x) for x in sys.argv[1:4])
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


def logps(m):
    logits = m(input_ids=ids).logits[:, plen - 1:-1, :]
    return torch.log_softmax(logits, -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)


with torch.no_grad():
    old = logps(model)


class Accel:
    num_processes = 1
    sync_gradients = True
    def gather(self, x): return x
    gather_for_metrics = gather
    def reduce(self, x, reduction="sum"): return x


def step():
    lp = logps(model)
    s = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=0.0, loss_type="grpo", epsilon_low=0.2, epsilon_high=0.28,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False), use_vllm=False,
        vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=rlen, _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)), accelerator=Accel())
    inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones(rows, plen), "completion_ids": completion,
              "completion_mask": mask, "advantages": adv, "old_per_token_logps": old}
    loss = GRPOTrainer._compute_loss(s, None, inputs)
    opt.zero_grad()
    loss.backward()
    opt.step()


step()
n = 5
t = time.perf_counter()
for _ in range(n):
    step()
dt = (time.perf_counter() - t) / n
print(f"torch {torch.__version__} (threads {torch.get_num_threads()}) update: {dt * 1e3:.1f} ms/step, {rows * rlen / dt:.0f} response tokens/s")
