"""Bytes per response token of the eviction record (`slime_sparse.kv.record`) the engine ships with each sample.

Measured: a tiny Qwen2 sampled by the embedded engine under each method and granularity (the records' own nbytes).
Formula (steady state): one compression per `buffer` decode tokens, each one bit per held slot (budget + buffer) per
layer and KV head (head granularity), per layer (layer), or once (model / StreamingLLM), plus a 4-byte start; the
"positions" column is what int16 kept positions would cost instead.

SGLang (`sglang_patches/evictions.py`): what meta_info["sparse_kv_evictions"] costs in the /generate answer (compact
JSON, as SGLang's orjson writes it), for a request stepped through the plugin's trigger and encoder with random
kept sets (the size does not depend on which slots stay), next to the record it decodes to and to what the answer
already carries per token (the per-token cache sizes and the log-prob entries).

    python benchmarks/eviction_record_bytes.py
"""
from __future__ import annotations

import json

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from sglang_patches.evictions import append_at, decode_evictions, eviction_entry
from slime_sparse.kv import GRANULARITIES, KVCompressConfig, should_compress
from slime_sparse.rollout import SamplingParams
from slime_sparse.rollout.embedded import EmbeddedEngine

# name: (layers, KV heads)
MODELS = {"Qwen2.5-0.5B": (24, 2), "Qwen2.5-7B": (28, 4), "Llama-3-8B": (32, 8)}


def formula_bytes_per_token(layers: int, heads: int, budget: int, buffer: int, granularity: str,
                            positions: bool = False) -> float:
    stored = {"head": layers * heads, "layer": layers, "model": 1}[granularity]
    per_set = budget * 2 if positions else (budget + buffer) / 8
    return (stored * per_set + 4) / buffer


def measured(method: str, granularity: str) -> tuple[float, int]:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = Qwen2ForCausalLM(cfg).eval()
    kv = KVCompressConfig(method=method, budget=64, buffer=16, window=8, granularity=granularity)
    engine = EmbeddedEngine(model, kv, max_batch_size=8)
    prompts = [list(range(3, 3 + 40 + i)) for i in range(8)]
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=256, ignore_eos=True), seed=0)
    nbytes = sum(o.evictions.nbytes for o in outs if o.evictions is not None)
    tokens = sum(len(o.response_ids) for o in outs)
    return nbytes / tokens, sum(o.kv.compressions for o in outs)


def sglang_wire_bytes(prompt_len: int, n_tokens: int, budget: int, buffer: int) -> dict[str, float]:
    """Bytes per output token of one request's eviction entries on the wire (and of its decoded record)."""
    cfg = KVCompressConfig(method="rkv", budget=budget, buffer=buffer, window=8, granularity="model")
    g = torch.Generator().manual_seed(0)
    history: list = []
    length, evicted = prompt_len, 0  # the row's slots; tokens evicted so far (sglang_patches.runtime)
    for i in range(1, n_tokens):  # the decode step producing output token i
        if should_compress(length, cfg, first_decode=i == 1):
            kept = torch.randperm(length, generator=g)[:budget].sort().values
            append_at(history, i, eviction_entry(length + evicted, length, kept))
            evicted, length = evicted + length - budget, budget
        length += 1
    def compact(obj) -> int:
        return len(json.dumps(obj, separators=(",", ":")))
    record = decode_evictions(history)
    return {
        "wire": compact(history) / n_tokens,
        "record": record.nbytes / n_tokens,
        "compressions": float(record.starts.numel()),
        "kept_sizes": compact([prompt_len + 500] * n_tokens) / n_tokens,  # ~3-4 digits a token
        "logprobs": compact([[-0.123456789, 12345, None]] * n_tokens) / n_tokens,
    }


def main() -> None:
    torch.set_num_threads(1)
    print("measured: tiny Qwen2 (4 layers, 2 KV heads), budget 64, buffer 16, 8 samples x 256 tokens")
    print(f"{'method':<10} {'granularity':<11} {'bytes/token':>11} {'steady':>8} {'compressions':>12}")
    for method in ("rkv", "snapkv", "h2o", "streaming"):
        for granularity in GRANULARITIES:
            per_token, compressions = measured(method, granularity)
            shared = "model" if method == "streaming" else granularity  # positions only: one set for all
            expect = formula_bytes_per_token(4, 2, 64, 16, shared)
            print(f"{method:<10} {granularity:<11} {per_token:>11.1f} {expect:>8.1f} {compressions:>12}")
    print("\nformula: budget 512, buffer 128 (the paper's R-KV); bytes per response token (a token's id + log-prob: 8)")
    print(f"{'model':<14} {'head':>8} {'layer':>8} {'model':>8}   {'positions (int16), head':>24}")
    for name, (layers, heads) in MODELS.items():
        row = [formula_bytes_per_token(layers, heads, 512, 128, g) for g in GRANULARITIES]
        positions = formula_bytes_per_token(layers, heads, 512, 128, "head", positions=True)
        print(f"{name:<14} " + " ".join(f"{b:>8.1f}" for b in row) + f"   {positions:>24.1f}")
    print("\nSGLang /generate answer, bytes per output token (compact JSON; granularity model, prompt 512)")
    print(f"{'budget':>6} {'buffer':>6} {'tokens':>6} {'evictions':>9} {'record':>7} {'compr.':>6}   "
          f"{'sparse_kv_kept':>14} {'logprob entries':>15}")
    for budget, buffer, n_tokens in ((512, 128, 8192), (2048, 256, 8192), (64, 16, 1024)):
        b = sglang_wire_bytes(512, n_tokens, budget, buffer)
        print(f"{budget:>6} {buffer:>6} {n_tokens:>6} {b['wire']:>9.2f} {b['record']:>7.2f} {b['compressions']:>6.0f}   "
              f"{b['kept_sizes']:>14.2f} {b['logprobs']:>15.2f}")


if __name__ == "__main__":
    main()
