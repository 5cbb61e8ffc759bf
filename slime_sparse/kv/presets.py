"""Named KV-compression presets: the knob values of each reference implementation, and where each value was read.
A config starts from one through `FromPreset` (slime_sparse/utils/presets.py), the mechanism the sparsity
correction's presets (the paper's, verl's) share.

A preset sets only the knobs that define *how* a method scores (window, pooling, GQA reduction, mixing weights,
pyramid shape), never the experiment (method, budget, buffer) nor the engine's layout (granularity): those stay
the run's. `--kv-preset NAME` starts from a preset's values and other `--kv-*` flags override them
(`KVCompressConfig.from_preset`); unset, the knobs are the dataclass defaults, which are `sparse-rl-fork`'s.

Why that default: it is what the Sparse-RL results (arXiv 2601.10079) were produced with, and what this project
ran before presets existed (max pooling, max over the GQA group, window 8, kernel 7), so the default changes no
behaviour. kvpress's conventions (average pooling, mean over the GQA group, window 64, kernel 5) select other
tokens.

Two rules no knob holds are the preset's too (`KVPreset.pyramid`, `KVPreset.no_window`), because they are how the
reference defines a method rather than a setting of it. Ours, under every other preset: a PyramidKV pyramid spans
only what a layer selects (the window and sinks stay out of it and every layer adds them), so its mean is exactly
B and it never needs a fallback (kv/budgets.py); every method keeps the last `window` slots. kvpress's: its
pyramid spans the whole budget, window included, capped and with a uniform fallback (kv/budgets.py
`kvpress_layer_budget`), and its KeyDiff and StreamingLLM protect no recent slots (ScorerPress.compress takes the
top-k over every position).

What equals kvpress 0.5.5 under `kvpress` (tests/kv/test_kvpress_oracle.py, against kvpress run in its own environment,
every layer and KV head, several prompt lengths and ratios), with --kv-budget = q_len * (1 - compression_ratio)
an integer and the prompt compressed by `compress_indices(cfg, keys, queries)`:
- the kept slots of SnapKV, StreamingLLM (n_sink 4), KeyDiff (prefill, and a DecodingPress compression) and
  PyramidKV (its per-layer budgets included: pyramid, cap at the cache length minus the window, fallback);
- PyramidKVPress.get_layer_budget itself, over prompt lengths 40-4096, ratios 0.25-0.875, beta 2-20, windows 8
  and 64, 4-28 layers.
What does not:
- a budget that does not exceed window + sinks is refused (kvpress keeps its top-B slots, the window's among them);
- the embedded engine fixes a run's per-layer budgets before it sees a prompt (its cache rows are sized by them):
  kvpress's pyramid without the cap, which binds only when the top layer's budget reaches the cache length minus
  the window, so on such short caches the engine's budgets are not kvpress's;
- kvpress compresses once, after prefill (or every `compression_interval` decode steps under DecodingPress); the
  engines here also compress every --kv-buffer decode tokens (kv/schedule.py), each time scored afresh;
- ties: kvpress's top-k leaves their order to torch; ours go to the earlier slot (none met in the tests).

Known differences from the other references that no knob reproduces (deliberate, one rule for every method):
- the fork's SnapKV / PyramidKV normalise the window's softmax over the scored slots only (its
  `fix_obs_window=True`); ours over every slot, causally, as SnapKV's paper and kvpress do (R-KV's importance
  does normalise over the scored slots, as R-KV and the fork);
- the fork's PyramidKV budgets average B - window (its layer budget re-counts the window inside the pyramid);
  ours average exactly B (kv/budgets.py), so pyramid and uniform rows compare at an equal mean budget;
- the fork constructs its KVCluster without num_hidden_layers / layer_idx (tp_worker.py below), so its pyramidkv
  branch cannot run as shipped: `pyramid_beta` 10 is read from its code, not from a run.
"""
from __future__ import annotations

from dataclasses import dataclass

from slime_sparse.utils.presets import Preset


@dataclass(frozen=True)
class KVPreset(Preset):
    """A KV-compression preset: besides its knob values, the methods it covers and two rules of the reference's
    that no knob holds."""

    methods: tuple[str, ...] = ()  # the methods the reference implements (a preset for another method is an error)
    pyramid: str = "mean"  # PyramidKV's per-layer budgets: "mean" (ours) | "kvpress" (kv/budgets.py)
    no_window: tuple[str, ...] = ()  # methods whose reference keeps no recent slots unscored (config.protected_window)


PRESETS: dict[str, KVPreset] = {
    "sparse-rl-fork": KVPreset(
        reference=(
            "the Sparse-RL authors' SGLang fork, lsjia/Sparse-RL @ 182c0b2: sglang-kvc/python/sglang/srt/managers/"
            "tp_worker.py forward_batch_generation builds KVCluster(window_size=--compress-max-window (server_args.py "
            "default 8), attn_pooling='max', pooling='maxpool', mix_alpha=0.1); sglang-kvc/python/sglang/compress/"
            "r1kv_utils.py KVCluster defaults kernel_size=7, sim_threshold=0.5, first_tokens=4 (StreamingLLM), and "
            "PyramidKV min = (B - window) // 10, i.e. beta 10"),
        methods=("rkv", "snapkv", "streaming", "h2o", "pyramidkv"),
        values=dict(window=8, kernel_size=7, pooling="max", gqa_reduce="max", mix_lambda=0.1, sim_threshold=0.5,
                    pyramid_beta=10.0),
    ),
    "rkv-code": KVPreset(
        reference=(
            "R-KV's code, Zefan-Cai/R-KV @ 31cf555: rkv/compression/r1_kv.py R1KV.__init__ window_size=8, "
            "kernel_size=7, mix_lambda=0.07 (its README says 0.1), F.max_pool1d; rkv/utils.py "
            "compute_attention_scores takes the max over a GQA group's query heads, cal_similarity threshold 0.5"),
        methods=("rkv",),
        values=dict(window=8, kernel_size=7, pooling="max", gqa_reduce="max", mix_lambda=0.07, sim_threshold=0.5),
    ),
    "kvpress": KVPreset(
        reference=(
            "NVIDIA kvpress 0.5.5 (PyPI): presses/snapkv_press.py SnapKVPress window_size=64, kernel_size=5, "
            "F.avg_pool1d, scores averaged over the GQA group; presses/pyramidkv_press.py PyramidKVPress beta=20 "
            "(window 64, kernel 5); presses/keydiff_press.py KeyDiffPress (no knobs); presses/streaming_llm_press.py "
            "StreamingLLMPress n_sink=4; presses/pyramidkv_press.py get_layer_budget (pyramid); "
            "presses/scorer_press.py ScorerPress.compress, a top-k over every position, which KeyDiffPress and "
            "StreamingLLMPress use and DecodingPress calls (no_window)"),
        methods=("snapkv", "pyramidkv", "keydiff", "streaming"),
        values=dict(window=64, kernel_size=5, pooling="avg", gqa_reduce="mean", pyramid_beta=20.0),
        pyramid="kvpress",
        no_window=("keydiff", "streaming"),
    ),
}
