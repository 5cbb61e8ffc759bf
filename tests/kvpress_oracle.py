"""Run NVIDIA kvpress (0.5.5, in its own environment: it needs transformers < 5.3) on a tiny random Llama and save
what its presses keep, for tests/test_kv_oracle.py. Nothing of slime_sparse is imported here.

    .cache/kvpress-venv/bin/python tests/kvpress_oracle.py OUT.pt

Saved: the post-RoPE keys of every layer [Hkv, n, d] and the post-RoPE queries of the last `window` tokens
[Hq, w, d] (q_proj + RoPE of the attention's own inputs, as kvpress's SnapKV computes them), then per press the
positions its compressed cache kept per layer and KV head (found by matching kept keys to the full keys), KeyDiff's
scores, and PyramidKVPress.get_layer_budget over a grid of budgets.
"""
from __future__ import annotations

import sys

import torch
from kvpress import KeyDiffPress, PyramidKVPress, SnapKVPress
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import rotate_half

N_TOKENS, WINDOW, KERNEL = 48, 8, 5
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, attn_implementation="eager")


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()


def dense_keys_and_queries(model, input_ids):
    """Per layer: keys [Hkv, n, d] from a dense cache, queries [Hq, WINDOW, d] of the last WINDOW tokens."""
    queries = {}

    def capture(module, args, kwargs):
        h = kwargs["hidden_states"][:, -WINDOW:]
        cos, sin = kwargs["position_embeddings"]
        q = module.q_proj(h).view(1, WINDOW, -1, module.head_dim).transpose(1, 2)
        cos, sin = cos[:, -WINDOW:].unsqueeze(1), sin[:, -WINDOW:].unsqueeze(1)
        queries[module.layer_idx] = ((q * cos) + (rotate_half(q) * sin))[0].detach()

    hooks = [layer.self_attn.register_forward_pre_hook(capture, with_kwargs=True) for layer in model.model.layers]
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids, past_key_values=cache, use_cache=True)
    for h in hooks:
        h.remove()
    keys = [cache.layers[i].keys[0].clone() for i in range(len(model.model.layers))]
    return keys, [queries[i] for i in range(len(keys))]


def kept_by_press(model, input_ids, press, full_keys) -> list[torch.Tensor]:
    """Per layer [Hkv, kept] positions (sorted) that `press` kept in prefill."""
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids, past_key_values=cache, use_cache=True)
    out = []
    for layer, full in enumerate(full_keys):
        compressed = cache.layers[layer].keys[0]  # [Hkv, kept, d]
        equal = (compressed[:, :, None, :] == full[:, None, :, :]).all(-1)  # [Hkv, kept, n]
        if not bool((equal.sum(-1) == 1).all()):
            raise RuntimeError(f"layer {layer}: a kept key matches no / several original keys")
        out.append(equal.float().argmax(-1).sort(dim=-1).values)
    return out


def main(path: str) -> None:
    model = tiny_model()
    input_ids = torch.randint(0, CONFIG["vocab_size"], (1, N_TOKENS), generator=torch.Generator().manual_seed(1))
    keys, queries = dense_keys_and_queries(model, input_ids)
    ratio = 0.5  # SnapKV keeps int(48 * 0.5) = 24 per layer and head; PyramidKV its per-layer budgets
    snap = SnapKVPress(compression_ratio=ratio, window_size=WINDOW, kernel_size=KERNEL)
    pyramid = PyramidKVPress(compression_ratio=ratio, window_size=WINDOW, kernel_size=KERNEL, beta=20)
    attn = model.model.layers[0].self_attn
    layer_budget = {}
    for selectable in (20, 24, 57, 100, 448):  # budgets where kvpress's pyramid is uncapped (q_len large)
        for beta in (2, 10, 20):
            press = PyramidKVPress(compression_ratio=1 - selectable / 10_000, window_size=WINDOW, beta=beta)
            budgets = []
            for layer in model.model.layers:
                budgets.append(press.get_layer_budget(layer.self_attn, 10_000))
            layer_budget[(selectable, beta)] = budgets
    keydiff = KeyDiffPress()
    keydiff_scores = [keydiff.score(attn, None, k[None], None, None, {})[0] for k in keys]
    torch.save({
        "config": CONFIG, "window": WINDOW, "kernel_size": KERNEL, "keys": keys, "queries": queries,
        "snapkv_kept": kept_by_press(model, input_ids, snap, keys),
        "pyramidkv_kept": kept_by_press(model, input_ids, pyramid, keys),
        "pyramid_layer_budget": layer_budget, "keydiff_scores": keydiff_scores,
        "keydiff_kept": kept_by_press(model, input_ids, KeyDiffPress(compression_ratio=ratio), keys),
    }, path)


if __name__ == "__main__":
    main(sys.argv[1])
