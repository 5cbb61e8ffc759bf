"""Our KV selection against NVIDIA kvpress 0.5.5, an independent implementation run in its own environment
(tests/kvpress_env.py: it needs transformers < 5.3).

tests/data/kvpress_oracle.pt is what tests/kvpress_oracle.py saved from kvpress's presses on a tiny random Llama
(keys, queries, and what each press kept per layer and KV head); the slow test regenerates it with kvpress and
checks it is still that. Under the `kvpress` preset's conventions (average pooling, mean over the GQA group) our
SnapKV keeps exactly kvpress's tokens head for head, and our selection under per-layer budgets keeps exactly what
kvpress's PyramidKVPress keeps at its own per-layer budgets; under the default `sparse-rl-fork` preset (max pooling,
max over the group) it does not. KeyDiff's scores equal KeyDiffPress's. PyramidKV's budget shape equals
PyramidKVPress.get_layer_budget on the selectable part of the budget (ours keeps the protected slots out of the
pyramid: kvpress falls back to uniform budgets where the top layer would fall below its window, ours never has to).
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from slime_sparse.kv import KVCompressConfig, compress_indices, pyramid

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "data" / "kvpress_oracle.pt"


@pytest.fixture(scope="module")
def oracle():
    return torch.load(GOLDEN)


def kvpress_conventions(oracle, method: str, budget: int, **knobs) -> KVCompressConfig:
    return KVCompressConfig.from_preset("kvpress", method=method, budget=budget, window=oracle["window"],
                                        kernel_size=oracle["kernel_size"], **knobs)


def test_snapkv_equals_kvpress_head_for_head_under_its_conventions(oracle):
    cfg = kvpress_conventions(oracle, "snapkv", 24)
    assert (cfg.pooling, cfg.gqa_reduce) == ("avg", "mean")
    ours = compress_indices(cfg, oracle["keys"], oracle["queries"])
    for layer, (mine, theirs) in enumerate(zip(ours, oracle["snapkv_kept"])):
        assert torch.equal(mine, theirs), layer


def test_default_preset_selects_other_tokens_than_kvpress(oracle):
    """Why presets are named: the defaults (the authors' fork: max pooling, max over the group, kernel 7) are not
    kvpress's, and they keep other tokens on the same keys and queries."""
    cfg = KVCompressConfig(method="snapkv", budget=24, window=oracle["window"])
    assert cfg.preset == "sparse-rl-fork"
    ours = compress_indices(cfg, oracle["keys"], oracle["queries"])
    assert any(not torch.equal(m, t) for m, t in zip(ours, oracle["snapkv_kept"]))


def test_per_layer_budgets_equal_kvpress_pyramidkv(oracle):
    theirs = oracle["pyramidkv_kept"]
    budgets = [k.shape[-1] for k in theirs]
    assert budgets == [40, 29, 19, 8] and sum(budgets) == 4 * 24  # kvpress's pyramid at 48 tokens, ratio 0.5
    cfg = kvpress_conventions(oracle, "pyramidkv", 24, budget_schedule="explicit", layer_budgets=tuple(budgets))
    ours = compress_indices(cfg, oracle["keys"], oracle["queries"])  # budgets from the schedule
    for layer, (mine, t) in enumerate(zip(ours, theirs)):
        assert torch.equal(mine, t), layer
    again = compress_indices(kvpress_conventions(oracle, "snapkv", 24), oracle["keys"], oracle["queries"],
                             budget=budgets)  # or passed per call
    assert all(torch.equal(a, t) for a, t in zip(again, theirs))


def test_keydiff_scores_equal_kvpress(oracle):
    window = oracle["window"]
    cfg = KVCompressConfig(method="keydiff", budget=24, window=window)
    for layer, (keys, theirs) in enumerate(zip(oracle["keys"], oracle["keydiff_scores"])):
        mine = cfg.scorer.score(keys, None)
        torch.testing.assert_close(mine[:, :-window], theirs[:, :-window].float(), rtol=1e-5, atol=1e-6)
        assert torch.isinf(mine[:, -window:]).all()  # the window is protected, as every method's
        # without protection our ranking is KeyDiffPress's: its kept set is our top 24
        top = theirs.float().topk(24, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(top, oracle["keydiff_kept"][layer]), layer


def test_pyramid_shape_equals_kvpress_layer_budgets(oracle):
    compared = 0
    for (selectable, beta), theirs in oracle["pyramid_layer_budget"].items():
        layers = len(theirs)
        if selectable / beta < oracle["window"]:  # kvpress falls back to uniform budgets there
            assert theirs == [selectable] * layers
            continue
        mine = pyramid(selectable, layers, beta)
        assert sum(mine) == selectable * layers  # ours exactly; kvpress's round() may drift by one
        assert all(abs(a - b) <= 1 for a, b in zip(mine, theirs)), (selectable, beta, mine, theirs)
        compared += 1
    assert compared >= 5


@pytest.mark.slow
@pytest.mark.kvpress
def test_golden_file_is_what_kvpress_computes(tmp_path):
    from kvpress_env import kvpress_python

    out = tmp_path / "oracle.pt"
    subprocess.run([str(kvpress_python()), str(HERE / "kvpress_oracle.py"), str(out)], check=True, cwd=tmp_path,
                   timeout=600)
    fresh, golden = torch.load(out), torch.load(GOLDEN)
    assert fresh.keys() == golden.keys()
    for key in ("keys", "queries", "snapkv_kept", "pyramidkv_kept", "keydiff_kept", "keydiff_scores"):
        assert all(torch.equal(a, b) for a, b in zip(fresh[key], golden[key])), key
    assert fresh["pyramid_layer_budget"] == golden["pyramid_layer_budget"]
