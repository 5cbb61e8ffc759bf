"""benchmarks/numeric_mismatch.py: its figures on hand-made log-probs, and one CI-sized measurement on a tiny model."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout import SamplingParams

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "numeric_mismatch.py"
_spec = importlib.util.spec_from_file_location("numeric_mismatch", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_figures_count_what_the_mis_preset_would_mask_and_veto():
    sampler = [torch.zeros(4), torch.zeros(3)]
    recompute = [torch.tensor([0.0, 0.1, math.log(0.4), 0.0]),  # one token below the mask's 0.5
                 torch.tensor([math.log(1.6), -10.0, 0.0])]  # one above 1.5, one below the veto's 1e-4
    s = bench.numeric_stats(recompute, sampler)
    assert (s["tokens"], s["sequences"], s["masked_tokens"], s["vetoed_seqs"]) == (7, 2, 3, 1)
    assert math.isclose(s["max"], 10.0)
    assert math.isclose(s["mean_abs"], (0.1 - math.log(0.4) + math.log(1.6) + 10) / 7, rel_tol=1e-6)
    d = torch.tensor([0.0, 0.1, math.log(0.4), 0.0, math.log(1.6), -10.0, 0.0], dtype=torch.float64)
    assert math.isclose(s["k3"], float((d.exp() - 1 - d).mean()), rel_tol=1e-6)


def test_fp32_numeric_part_is_float_noise_and_the_sparse_policy_is_not():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256)).eval()
    prompts = [torch.randint(1, 256, (20,)).tolist()] * 2 + [torch.randint(1, 256, (28,)).tolist()] * 2
    params = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True)
    dense = bench.measure(model, prompts, params, KVCompressConfig(), fp32_lm_head=False, seed=0)
    assert dense["numeric"]["tokens"] == 160 and dense["numeric"]["max"] < 1e-4 and "sparse_vs_dense" not in dense
    rkv = KVCompressConfig(method="rkv", budget=12, buffer=4, window=4)
    sparse = bench.measure(model, prompts, params, rkv, fp32_lm_head=True, seed=0)
    assert sparse["numeric"]["max"] < 1e-4  # the shadow recompute under the sampler's own record
    assert sparse["sparse_vs_dense"]["max"] > 0.1
