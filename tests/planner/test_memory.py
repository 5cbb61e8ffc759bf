"""tools/plan_memory.py's arithmetic against independent references: HF's own parameter count (and Qwen2.5-7B's
published 7,615,616,512), the bytes the embedded engine really allocates, and hand-computed KV peaks."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout.embedded import EmbeddedEngine
from slime_sparse.rollout.sampling import SamplingParams
from slime_sparse.kv import layer_budgets
from slime_sparse.planner.memory import (GIB, layer_peak_slots, peak_kv_bytes, peak_kv_slots, plan_learner,
                                         plan_rollout)
from slime_sparse.utils.model_shape import ModelShape

QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
             "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}


@pytest.mark.parametrize("make", [
    lambda: Qwen2ForCausalLM(Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    lambda: LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)),
], ids=["qwen2-tied-bias", "llama-untied"])
def test_parameter_count_equals_hf(make):
    model = make()
    assert ModelShape.from_hf_config(model.config.to_dict()).num_parameters() == model.num_parameters()


def test_parameter_count_of_qwen25_7b_is_the_published_one():
    assert ModelShape.from_hf_config(QWEN25_7B).num_parameters() == 7_615_616_512


@pytest.mark.parametrize("kv", [None, KVCompressConfig(method="rkv", budget=8, buffer=4, window=4)])
def test_embedded_engine_allocates_what_the_plan_says(kv):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    engine = EmbeddedEngine(model, kv, max_batch_size=2, device=torch.device("cpu"))
    engine.generate([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], SamplingParams(temperature=1.0, max_new_tokens=20,
                                                                        ignore_eos=True), seed=0)
    shape = ModelShape.from_hf_config(model.config.to_dict())
    slots = peak_kv_slots(5, 20, kv, engine="embedded")
    assert slots == (12 if kv else 25)
    assert engine.last_kv_cache_bytes == 2 * slots * shape.kv_bytes_per_token(dtype_bytes=4)  # 2 rows, fp32


def test_sglang_peaks_by_hand():
    rkv = KVCompressConfig(method="rkv", budget=64, buffer=16, window=8)
    assert peak_kv_slots(100, 1000, None) == 1099  # dense: the last sampled token is never written
    assert peak_kv_slots(100, 1000, rkv) == 100  # prefilled densely, compacted to 64 at the first decode step
    assert peak_kv_slots(10, 1000, rkv) == 80  # grows to budget + buffer, compacted back to 64
    assert peak_kv_slots(10, 20, rkv) == 29  # never reaches the trigger: dense
    with pytest.raises(ValueError, match="engine"):
        peak_kv_slots(10, 20, rkv, engine="vllm")


def test_rollout_plan_by_hand():
    shape = ModelShape.from_hf_config(QWEN25_7B)
    rkv = KVCompressConfig(method="rkv", budget=512, buffer=128, window=8)
    common = dict(gpu_bytes=80 * GIB, mem_fraction_static=0.8, dtype_bytes=2, prompt_len=512, max_new_tokens=8192)
    dense, sparse = plan_rollout(shape, kv=None, **common), plan_rollout(shape, kv=rkv, **common)
    per_token = 2 * 28 * 4 * 128 * 2  # K and V, layers, KV heads, head_dim, bf16
    pool = int(80 * GIB * 0.8) - 7_615_616_512 * 2
    assert dense.kv_bytes_per_token == sparse.kv_bytes_per_token == per_token == 57344
    assert dense.max_requests == pool // (8703 * per_token)
    ring = 28 * 8 * 28 * 128 * 2  # layers, window, query heads, head_dim, bf16
    assert sparse.max_requests == pool // (640 * per_token + ring)
    assert sparse.max_requests > 13 * dense.max_requests  # budget 640 of 8703 slots
    with pytest.raises(ValueError, match="do not fit"):
        plan_rollout(shape, kv=None, **{**common, "gpu_bytes": 16 * GIB})


def test_learner_plan_by_hand():
    shape = ModelShape.from_hf_config(QWEN25_7B)
    n = 7_615_616_512
    assert plan_learner(shape, tp=2, pp=1, dp=4).bytes_per_gpu == int((n // 2) * (2 + 4 + 12 / 4))
    assert plan_learner(shape, tp=1, pp=2, dp=1, with_ref=True).bytes_per_gpu == int((n // 2) * (2 + 4 + 12 + 2))
    with pytest.raises(ValueError, match="tp, pp and dp"):
        plan_learner(shape, tp=0, pp=1, dp=1)


def test_cli_prints_the_plan(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B))
    spec = importlib.util.spec_from_file_location("plan_memory", Path(__file__).parents[2] / "tools" / "plan_memory.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--hf-config", str(tmp_path), "--prompt-len", "512", "--max-new-tokens", "8192",
                      "--learner-layouts", "2x1x4"]) == 0
    out = capsys.readouterr().out
    shape = ModelShape.from_hf_config(QWEN25_7B)
    from slime_sparse.rollout.sglang.config import SGLangEngineConfig

    dense = plan_rollout(shape, kv=None, gpu_bytes=80 * GIB, mem_fraction_static=SGLangEngineConfig.mem_fraction_static,
                         dtype_bytes=2, prompt_len=512, max_new_tokens=8192)
    assert "7.62B parameters" in out and f"{dense.max_requests:,}" in out and "2x1x4" in out


def test_per_layer_budgets_by_hand():
    """Qwen2.5-7B, a PyramidKV pyramid of mean 512: every layer fills to the largest budget + buffer before the first
    compression (the fullest layer's trigger), so a sequence that reaches it peaks there in every layer, paged or
    not; a short one holds what it wrote; SGLang cannot hold per-layer budgets."""
    shape = ModelShape.from_hf_config(QWEN25_7B)
    pyr = KVCompressConfig(method="pyramidkv", budget=512, buffer=128, window=8, pyramid_beta=10)
    budgets = layer_budgets(pyr, 28)
    assert (budgets[0], budgets[-1], sum(budgets)) == (8 + 1008 - 50, 8 + 50, 28 * 512)  # S = 504, top 504 // 10
    peak = budgets[0] + 128
    rkv_pyr = dataclasses.replace(pyr, method="rkv", budget_schedule="pyramid")  # no cut after prefill
    assert layer_peak_slots(128, 8192, rkv_pyr, 28) == (peak,) * 28
    assert layer_peak_slots(128, 500, rkv_pyr, 28) == (627,) * 28  # 128 + 499 writes, under the trigger: dense
    # PyramidKV cuts the prompt after prefill (layers over budget only), then every layer grows until the fullest
    # (still the whole prompt) reaches the trigger
    assert layer_peak_slots(128, 8192, pyr, 28) == tuple(min(128, b) + peak - 128 for b in budgets)
    assert layer_peak_slots(2000, 10, pyr, 28) == (2000,) * 28  # a long prompt is prefilled whole first
    per_layer_token = 2 * 4 * 128 * 2
    assert peak_kv_bytes(shape, 128, 8192, rkv_pyr, 2, "paged") == 28 * peak * per_layer_token
    assert peak_kv_bytes(shape, 128, 8192, pyr, 2, "embedded") == 28 * peak * per_layer_token
    with pytest.raises(ValueError, match="--kv-budget-schedule=pyramid: SGLang"):
        peak_kv_bytes(shape, 128, 8192, pyr, 2, "sglang")
    common = dict(gpu_bytes=80 * GIB, mem_fraction_static=0.8, dtype_bytes=2, prompt_len=128, max_new_tokens=8192)
    assert plan_rollout(shape, kv=pyr, engine="paged", **common).peak_slots == peak
    # the peak per layer under the schedule equals a step-by-step simulation of the row (kv.schedule)
    explicit = KVCompressConfig(method="rkv", budget=16, buffer=4, window=2, budget_schedule="explicit",
                                layer_budgets=(30, 16, 6))
    fills, peaks = [5, 5, 5], [5, 5, 5]
    for _ in range(80 - 1):
        if max(fills) >= 30 + 4:
            fills = [min(f, b) for f, b in zip(fills, (30, 16, 6))]
        fills = [f + 1 for f in fills]
        peaks = [max(p, f) for p, f in zip(peaks, fills)]
    assert layer_peak_slots(5, 80, explicit, 3) == tuple(peaks) == (34, 34, 34)
