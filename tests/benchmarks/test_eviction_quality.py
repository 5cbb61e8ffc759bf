"""benchmarks/eviction_quality.py on a tiny random Llama: each cell of the study is the training loop's
mismatch metrics of the engine's sparse log-probs against the dense policy, checked here against an
independent teacher-forced forward; the report averages seeds and pivots methods x budgets."""
import importlib.util
import os
import statistics

import pytest
import torch
from tests.helpers.engine_reference import dense_logprobs
from transformers import LlamaConfig, LlamaForCausalLM

from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout import SamplingParams
from slime_sparse.rollout.embedded import EmbeddedEngine

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks", "eviction_quality.py")
_spec = importlib.util.spec_from_file_location("eviction_quality", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TEMPERATURE = 0.8


def test_measure_equals_an_independent_recompute():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128)).eval()
    prompts = [torch.randint(0, 64, (n,)).tolist() for n in (12, 20, 9)]
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=24, ignore_eos=True)
    k3 = {}
    for method, budget in (("none", 0), ("rkv", 8), ("streaming", 8)):
        kv = KVCompressConfig() if method == "none" else KVCompressConfig(method=method, budget=budget, buffer=4,
                                                                          window=2)
        row = bench.measure(model, prompts, kv, params, seed=3)
        outs = EmbeddedEngine(model, kv, max_batch_size=len(prompts)).generate(prompts, params, seed=3)
        log_xi = torch.cat([dense_logprobs(model, o.prompt_ids, o.response_ids, TEMPERATURE)
                            - torch.tensor(o.logprobs) for o in outs]).double()  # log pi_old - log pi_sparse
        assert row["mismatch/tokens"] == log_xi.numel() == 3 * 24
        assert row["mismatch/k1"] == pytest.approx(-log_xi.mean().item(), abs=1e-6)
        assert row["mismatch/k3"] == pytest.approx((log_xi.exp() - 1 - log_xi).mean().item(), abs=1e-6)
        assert row["response_len_mean"] == 24 and row["prompt_len_mean"] == pytest.approx(41 / 3)
        assert (row["kv/savings"] == 0) == (method == "none")
        k3[method] = row["mismatch/k3"]
    assert k3["none"] < 1e-8 and min(k3["rkv"], k3["streaming"]) > 1e-4  # compression is what moves pi_sparse


def test_report_averages_seeds_and_pivots():
    def result(method, budget, seed, k3):
        return {"method": method, "budget": budget, "seed": seed, "mismatch/k3": k3, "mismatch/k1": k3 / 2,
                "mismatch/abs_log_xi": k3, "kv/savings": 0.5 if budget else 0.0, "response_len_mean": 100.0 + seed,
                "prompt_len_mean": 60.0}

    results = [result("none", 0, 0, 1e-9), result("rkv", 32, 0, 0.3), result("rkv", 32, 1, 0.5),
               result("h2o", 32, 0, 0.4), result("rkv", 64, 0, 0.1)]
    rows = {(r["method"], r["budget"]): r for r in bench.aggregate(results)}
    assert rows["rkv", 32]["seeds"] == 2 and rows["rkv", 32]["k3"] == pytest.approx(0.4)
    assert rows["rkv", 32]["k3_std"] == pytest.approx(statistics.stdev([0.3, 0.5]))
    assert rows["rkv", 32]["len"] == pytest.approx(100.5) and rows["rkv", 64]["k3_std"] == 0.0
    lines = bench.table(list(rows.values())).splitlines()
    assert "| budget | rkv | h2o |" in lines  # methods in the study's order, only those measured
    assert "| 32 | 0.4000 (0.1414) | 0.4000 (0.0000) |" in lines and "| 64 | 0.1000 (0.0000) |  |" in lines
    assert lines[-1].startswith("dense (no compression, the numerical floor): k3 1.0e-09")


def test_rows_name_a_method_and_its_preset():
    assert bench.row_config("none", 32, 16, 8) == KVCompressConfig()
    fork = bench.row_config("snapkv", 32, 16, None)
    assert (fork.method, fork.preset, fork.pooling, fork.window, fork.budget, fork.buffer) == (
        "snapkv", "sparse-rl-fork", "max", 8, 32, 16)
    kvpress = bench.row_config("snapkv@kvpress", 128, 16, None)
    assert (kvpress.preset, kvpress.pooling, kvpress.gqa_reduce, kvpress.window) == ("kvpress", "avg", "mean", 64)
    assert bench.row_config("snapkv@kvpress", 32, 16, 8).window == 8  # --window over the preset's
    assert bench.row_config("rkv@rkv-code", 32, 16, 8).mix_lambda == 0.07
    pyramid = bench.row_config("pyramidkv@kvpress", 32, 16, 8)
    assert (pyramid.schedule, pyramid.pyramid_beta, pyramid.window) == ("pyramid", 20.0, 8)
    with pytest.raises(ValueError, match="--kv-preset"):
        bench.row_config("keydiff@rkv-code", 32, 16, 8)


@pytest.mark.parametrize("response,answer", [
    ("3 x 4 is 12.\nAnswer: 12", "12"), ("so 7*8 = 56", "56"), ("Answer: **42**.", "42"), ("no idea", None),
    ("first 10, then Answer: 1,234", "1,234"),
])
def test_answer_extraction(response, answer):
    assert bench.extract_answer(response) == answer


def test_accuracy_counts_full_credit_only():
    class Partial:  # reasoning-gym's scorers give partial credit to near misses
        @staticmethod
        def score_answer(answer, entry):
            return 1.0 if answer == entry["answer"] else 0.5 if answer.lstrip("-") == entry["answer"] else 0.0

    entry = {"answer": "45"}
    assert bench.correct(Partial, entry, "Answer: 45") and not bench.correct(Partial, entry, "Answer: -45")
    assert not bench.correct(Partial, entry, "no number")


@pytest.mark.real_model  # reasoning-gym: the `real` extra
def test_accuracy_is_reasoning_gyms_full_credit():
    import reasoning_gym

    data = reasoning_gym.create_dataset("products", size=2, seed=0, **bench.TASK_ARGS["products"])
    entry = data[0]
    assert bench.correct(data, entry, f"steps...\nAnswer: {entry['answer']}")
    assert not bench.correct(data, entry, f"Answer: {int(entry['answer']) + 1}")
    assert not bench.correct(data, entry, "nothing")
