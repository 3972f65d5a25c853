"""Golden values for conrub-grpo from Hugging Face TRL's GRPO implementation.

Run: python3 crates/grpo/testdata/trl_golden.py   (needs torch, trl; tested with trl 1.16.0)
Writes crates/grpo/testdata/trl_golden.json.

- Advantages: TRL's own `nanstd` and its group normalisation (GRPOTrainer, `scale_rewards="group"`,
  one reward function, NaN for unscorable completions, `nan_to_num` afterwards), and the same
  rewards under `scale_rewards="none"` (mean subtracted, no division).
- Loss: `GRPOTrainer._compute_loss` itself, called on a stand-in trainer object whose
  `_get_per_token_logps_and_entropies` returns fixed random log-probs, for loss_type grpo / bnpo /
  dr_grpo, epsilon 0.2, epsilon_high 0.28, with and without a k3 KL term; the value, the gradient
  with respect to the log-probs, and TRL's clip-ratio metrics are stored.
- GSPO: the same with `importance_sampling_level="sequence"` (loss_type grpo, with and without KL).
- Masked truncation: the completion mask as `mask_truncated_completions=True` makes it in
  `_generate_and_score_completions` (`completion_mask * (~is_truncated).unsqueeze(1).int()`, a
  response truncated when it fills `max_completion_length` without an EOS: rows 0 and 4 here),
  then `_compute_loss` on it, for loss types grpo, bnpo and dr_grpo with KL.
"""
import json
import os
from collections import defaultdict
from types import SimpleNamespace

import torch
import trl
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import nanstd

torch.manual_seed(20261130)
out = {"trl_version": trl.__version__, "torch_version": torch.__version__}

# ---- advantages -------------------------------------------------------------------------------
G, K = 5, 8
rewards = torch.randint(-6, 7, (G, K)).double() / 6.0
rewards[1, 3] = float("nan")            # one unscored response
rewards[2, :] = 0.5                     # an exact tie
rewards[3, :7] = float("nan")           # only one scored response
rewards[4, 0] = float("nan")
rewards[4, 5] = float("nan")
flat = rewards.view(-1)
mean = torch.nanmean(rewards, dim=1).repeat_interleave(K)
std = nanstd(rewards, dim=1).repeat_interleave(K)
adv = torch.nan_to_num((flat - mean) / (std + 1e-4), nan=0.0)
# scale_rewards="none" (the Dr. GRPO recipe): the group mean is subtracted, nothing is divided.
unscaled = torch.nan_to_num(flat - mean, nan=0.0)
out["advantages"] = {
    "k": K,
    "rewards": [[None if torch.isnan(x) else x.item() for x in row] for row in rewards],
    "advantages": adv.view(G, K).tolist(),
    "advantages_unscaled": unscaled.view(G, K).tolist(),
}

# ---- loss -------------------------------------------------------------------------------------
N, T = 8, 11
lengths = [11, 7, 1, 0, 11, 4, 9, 2]     # one empty response, one single-token response
mask = torch.zeros(N, T)
for i, n in enumerate(lengths):
    mask[i, :n] = 1.0
logp0 = -torch.rand(N, T).double() * 3.0
old = (logp0 + torch.randn(N, T).double() * 0.4).float()   # ratios far enough from 1 to clip both sides
ref = (logp0 + torch.randn(N, T).double() * 0.2).float()
advantages = torch.tensor([1.3, -0.7, 0.4, 0.0, -1.6, 2.0, -0.2, 0.9])


class Accel:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def stand_in(loss_type, beta, logp, level="token"):
    s = SimpleNamespace()
    s._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
    s.aux_loss_enabled = False
    s.top_entropy_quantile = 1.0
    s.off_policy_mask_threshold = None
    s.importance_sampling_level = level
    s.beta = beta
    s.loss_type = loss_type
    s.epsilon_low, s.epsilon_high = 0.2, 0.28
    s.args = SimpleNamespace(delta=None, use_bias_correction_kl=False)
    s.use_vllm = False
    s.vllm_importance_sampling_correction = False
    s.model = SimpleNamespace(training=True)
    s.current_gradient_accumulation_steps = 1
    s.max_completion_length = T
    s._entropy_bonus_enabled = False
    s._metrics = defaultdict(lambda: defaultdict(list))
    s.accelerator = Accel()
    return s


# A response is truncated when it fills the completion length with no EOS (here: lengths = T).
is_truncated = torch.tensor([n == T for n in lengths])
truncation_masked = mask * (~is_truncated).unsqueeze(1).int()
settings = [(lt, beta, "token", False) for lt in ["grpo", "bnpo", "dr_grpo"] for beta in [0.0, 0.04]]
settings += [("grpo", beta, "sequence", False) for beta in [0.0, 0.04]]
settings += [(lt, 0.04, "token", True) for lt in ["grpo", "bnpo", "dr_grpo"]]
cases = []
for loss_type, beta, level, mask_truncated in settings:
        logp = logp0.float().clone().requires_grad_(True)
        s = stand_in(loss_type, beta, logp, level)
        inputs = {
            "prompt_ids": torch.zeros(N, 1, dtype=torch.long),
            "prompt_mask": torch.ones(N, 1),
            "completion_ids": torch.zeros(N, T, dtype=torch.long),
            "completion_mask": truncation_masked if mask_truncated else mask,
            "advantages": advantages,
            "old_per_token_logps": old,
            "ref_per_token_logps": ref,
        }
        loss = GRPOTrainer._compute_loss(s, None, inputs)
        loss.backward()
        m = s._metrics["train"]
        cases.append({
            "loss_type": loss_type,
            "beta": beta,
            "importance_sampling_level": level,
            "mask_truncated": mask_truncated,
            "loss": loss.item(),
            "grad": logp.grad.tolist(),
            "clip_low": m["clip_ratio/low_mean"][0],
            "clip_high": m["clip_ratio/high_mean"][0],
            "kl": m["kl"][0] if beta != 0.0 else None,
        })
out["loss"] = {
    "logp": logp0.float().tolist(),
    "logp_old": old.tolist(),
    "logp_ref": ref.tolist(),
    "mask": mask.tolist(),
    "truncated": is_truncated.tolist(),
    "advantages": advantages.tolist(),
    "max_completion_length": T,
    "cases": cases,
}

path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trl_golden.json")
with open(path, "w") as f:
    json.dump(out, f, indent=1)
print("wrote", path, [(c["loss_type"], c["beta"], c["importance_sampling_level"], c["mask_truncated"], round(c["loss"], 6), round(c["clip_low"], 3), round(c["clip_high"], 3)) for c in cases])
