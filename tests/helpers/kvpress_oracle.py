"""Run NVIDIA kvpress (0.5.5, in its own environment: it needs transformers < 5.3) on tiny random models and save
what its presses keep, for tests/kv/test_kvpress_oracle.py. Nothing of slime_sparse is imported here.

    .cache/kvpress-venv/bin/python tests/helpers/kvpress_oracle.py tests/helpers/data/kvpress_oracle.pt    # the golden
    .cache/kvpress-venv/bin/python tests/helpers/kvpress_oracle.py OUT.pt --arch qwen2 --seed 7 \\
        --lengths 56,96,136 --ratios 0.375,0.5,0.625                                             # held-out cases

Saved, per prompt length n: the post-RoPE keys of every layer [Hkv, n, d] and the post-RoPE queries of the last
`window` tokens [Hq, w, d] (q_proj + RoPE of the attention's own inputs, as kvpress's SnapKV computes them). Per
case (press, n, compression ratio, PyramidKV's beta) the slots its compressed prefill cache kept, as a bool mask
[layers, Hkv, n] (found by matching kept keys to the full keys). One decode-time compression of KeyDiffPress under
DecodingPress (the keys it was handed and what it kept). PyramidKVPress.get_layer_budget over a grid of prompt
lengths, ratios, betas, windows and depths.
"""
from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import torch
from kvpress import DecodingPress, KeyDiffPress, PyramidKVPress, SnapKVPress, StreamingLLMPress
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama.modeling_llama import rotate_half

WINDOW, KERNEL, N_SINK = 8, 5, 4
CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, attn_implementation="eager")
ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
BETAS = (2, 20)  # a gentle pyramid and kvpress's default (which falls back to uniform budgets on short prompts)
# get_layer_budget's grid: q_len x ratio x beta x window x depth (ratios whose q_len * (1 - ratio) is exact)
GRID = dict(q_len=(40, 64, 100, 200, 600, 4096), ratio=(0.25, 0.5, 0.75, 0.875), beta=(2, 10, 20),
            window=(8, 64), layers=(4, 5, 28))


def tiny_model(arch: str, seed: int):
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    return model_cls(config_cls(**CONFIG)).eval()


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


def kept_mask(compressed: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """[Hkv, n] bool: which of the full keys [Hkv, n, d] the compressed ones [Hkv, kept, d] are."""
    equal = (compressed[:, :, None, :] == full[:, None, :, :]).all(-1)  # [Hkv, kept, n]
    if not bool((equal.sum(-1) == 1).all()):
        raise RuntimeError("a kept key matches no / several original keys")
    return equal.any(1)


def kept_by_press(model, input_ids, press, full_keys) -> torch.Tensor:
    """[layers, Hkv, n] bool: what `press` kept in prefill."""
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids, past_key_values=cache, use_cache=True)
    return torch.stack([kept_mask(cache.layers[layer].keys[0], full) for layer, full in enumerate(full_keys)])


class RecordingKeyDiff(KeyDiffPress):
    """KeyDiffPress that records, per layer, the keys it was handed and the keys it kept."""

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        kept_keys, kept_values = super().compress(module, hidden_states, keys, values, attentions, kwargs)
        self.seen[module.layer_idx] = (keys[0].clone(), kept_keys[0].clone())
        return kept_keys, kept_values


def keydiff_decode(model, input_ids, target: int) -> dict:
    """Prefill input_ids[:, :-1] (DecodingPress leaves prefill alone), then decode the last token: with
    compression_interval=1 that step compresses every layer to `target` slots by KeyDiffPress's
    ScorerPress.compress."""
    base = RecordingKeyDiff()
    base.seen = {}
    press = DecodingPress(base_press=base, compression_interval=1, target_size=target)
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids[:, :-1], past_key_values=cache, use_cache=True)
        model(input_ids[:, -1:], past_key_values=cache, use_cache=True)
    layers = range(len(model.model.layers))
    keys = [base.seen[layer][0] for layer in layers]
    return {"keys": keys, "target": target, "kept": torch.stack([kept_mask(base.seen[layer][1], keys[layer])
                                                                 for layer in layers])}


def layer_budget_grid() -> dict:
    out = {}
    for q_len in GRID["q_len"]:
        for ratio in GRID["ratio"]:
            for beta in GRID["beta"]:
                for window in GRID["window"]:
                    press = PyramidKVPress(compression_ratio=ratio, window_size=window, beta=beta)
                    for layers in GRID["layers"]:
                        config = SimpleNamespace(num_hidden_layers=layers)
                        out[(q_len, ratio, beta, window, layers)] = [
                            press.get_layer_budget(SimpleNamespace(config=config, layer_idx=i), q_len)
                            for i in range(layers)]
    return out


def presses(ratio: float):
    """(name, beta, press) of every prefill case at this ratio."""
    yield "snapkv", None, SnapKVPress(compression_ratio=ratio, window_size=WINDOW, kernel_size=KERNEL)
    yield "streaming", None, StreamingLLMPress(compression_ratio=ratio, n_sink=N_SINK)
    yield "keydiff", None, KeyDiffPress(compression_ratio=ratio)
    for beta in BETAS:
        yield "pyramidkv", beta, PyramidKVPress(compression_ratio=ratio, window_size=WINDOW, kernel_size=KERNEL,
                                                beta=beta)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--arch", choices=tuple(ARCHS), default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lengths", default="40,64,100", help="prompt lengths n, comma-separated")
    p.add_argument("--ratios", default="0.25,0.5,0.75", help="compression ratios (n * (1 - r) must be an integer)")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    ratios = [float(x) for x in args.ratios.split(",")]
    model = tiny_model(args.arch, args.seed)
    generator = torch.Generator().manual_seed(args.seed + 1)
    prompts, cases = {}, []
    for n in lengths:
        input_ids = torch.randint(0, CONFIG["vocab_size"], (1, n), generator=generator)
        keys, queries = dense_keys_and_queries(model, input_ids)
        prompts[n] = {"keys": keys, "queries": queries}
        for ratio in ratios:
            if n * (1 - ratio) != int(n * (1 - ratio)):
                raise SystemExit(f"--ratios: {n} x (1 - {ratio}) is not an integer")
            for method, beta, press in presses(ratio):
                cases.append({"method": method, "n": n, "ratio": ratio, "beta": beta,
                              "kept": kept_by_press(model, input_ids, press, keys)})
    decode_ids = torch.randint(0, CONFIG["vocab_size"], (1, lengths[0] + 1), generator=generator)
    torch.save({
        "arch": args.arch, "config": CONFIG, "window": WINDOW, "kernel_size": KERNEL, "n_sink": N_SINK,
        "prompts": prompts, "cases": cases, "layer_budget": layer_budget_grid(),
        "keydiff_decode": keydiff_decode(model, decode_ids, target=lengths[0] // 2),
    }, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
