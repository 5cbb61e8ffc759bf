"""Mismatch and KV metrics against hand values and a per-token python reference."""
import math
import random

import pytest
import torch

from slime_sparse.algo import kv_metrics, mismatch_metrics
from slime_sparse.types import KVStats


def reference_mismatch(old_rows, sparse_rows):
    """Token means over every listed token; chi2_seq over rows (slime's clamp of the summed log ratio)."""
    toks = [(o, s) for old, sp in zip(old_rows, sparse_rows) for o, s in zip(old, sp)]
    n = len(toks)
    clamp = lambda x: min(max(x, -20.0), 20.0)  # noqa: E731
    k3 = sum(math.exp(clamp(o - s)) - 1 - clamp(o - s) for o, s in toks) / n
    seqs = [sum(o - s for o, s in zip(old, sp)) for old, sp in zip(old_rows, sparse_rows) if old]
    return {
        "mismatch/k1": sum(s - o for o, s in toks) / n,
        "mismatch/k3": k3,
        "mismatch/abs_log_xi": sum(abs(o - s) for o, s in toks) / n,
        "mismatch/chi2_token": sum(math.exp(2 * clamp(o - s)) for o, s in toks) / n - 1,
        "mismatch/chi2_seq": sum(math.exp(2 * clamp(x)) - 1 for x in seqs) / len(seqs),
        "mismatch/sampler_ppl": math.exp(-sum(s for _, s in toks) / n),
        "mismatch/learner_ppl": math.exp(-sum(o for o, _ in toks) / n),
        "mismatch/tokens": float(n),
    }


def test_hand_computed():
    # One sequence, two tokens: log xi = [log 2, log 0.5]; logp_sparse = [-1, -2].
    sparse = torch.tensor([[-1.0, -2.0, 0.0]])
    old = sparse + torch.tensor([[math.log(2), math.log(0.5), 0.0]])
    m = mismatch_metrics(old, sparse, torch.tensor([[1, 1, 0]]))
    assert m["mismatch/k1"] == pytest.approx(0.0, abs=1e-7)  # -(log 2 + log 0.5) / 2
    assert m["mismatch/k3"] == pytest.approx(((2 - 1 - math.log(2)) + (0.5 - 1 - math.log(0.5))) / 2, rel=1e-6)
    assert m["mismatch/chi2_token"] == pytest.approx((4 + 0.25) / 2 - 1, rel=1e-6)
    assert m["mismatch/chi2_seq"] == pytest.approx(0.0, abs=1e-6)  # product of ratios = 1
    assert m["mismatch/sampler_ppl"] == pytest.approx(math.exp(1.5), rel=1e-6)
    assert m["mismatch/learner_ppl"] == pytest.approx(math.exp(-(-1 + math.log(2) - 2 + math.log(0.5)) / 2), rel=1e-6)
    assert m["mismatch/abs_log_xi"] == pytest.approx(math.log(2), rel=1e-6)
    assert m["mismatch/tokens"] == 2.0


@pytest.mark.parametrize("seed", range(3))
def test_random_ragged_against_reference(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(0, 9) for _ in range(7)]
    old_rows = [[-rng.expovariate(1.0) for _ in range(n)] for n in lengths]
    sparse_rows = [[o + rng.gauss(0, 0.5) for o in row] for row in old_rows]
    if lengths[0]:
        sparse_rows[0][0] = old_rows[0][0] - 30.0  # beyond the exp clamp
    width = max(lengths) + 1
    pad = lambda rows: torch.tensor([r + [float("nan")] * (width - len(r)) for r in rows], dtype=torch.float64)  # noqa: E731
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    got = mismatch_metrics(pad(old_rows), pad(sparse_rows), mask)
    want = reference_mismatch(old_rows, sparse_rows)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9), key
    assert got["mismatch/nonfinite_tokens"] == 0.0


def test_nonfinite_tokens_ignored_and_counted():
    inf, nan = float("inf"), float("nan")
    old = torch.tensor([[-1.0, -inf, -0.5], [nan, -2.0, -3.0]])
    sparse = torch.tensor([[-1.5, -1.0, -0.5], [-1.0, -2.5, inf]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # (1, 2) is padding: not counted
    got = mismatch_metrics(old, sparse, mask)
    want = reference_mismatch([[-1.0, -0.5], [-2.0]], [[-1.5, -0.5], [-2.5]])
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key
    assert got["mismatch/nonfinite_tokens"] == 2.0
    assert all(math.isfinite(v) for v in got.values())


def test_empty_mask():
    got = mismatch_metrics(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2))
    assert got["mismatch/k1"] == 0.0 and got["mismatch/chi2_token"] == 0.0 and got["mismatch/chi2_seq"] == 0.0
    assert got["mismatch/sampler_ppl"] == 1.0 and got["mismatch/tokens"] == 0.0


def test_kv_metrics():
    stats = [
        KVStats(dense_kv_tokens=1000, kept_kv_tokens=400, peak_kv_tokens=60, compressions=3),
        KVStats(dense_kv_tokens=200, kept_kv_tokens=200, peak_kv_tokens=20, compressions=0),
    ]
    got = kv_metrics(stats)
    assert got["kv/savings"] == pytest.approx(1 - 600 / 1200)  # token-weighted, not mean of 0.6 and 0.0
    assert got["kv/peak_tokens_max"] == 60.0 and got["kv/peak_tokens_mean"] == 40.0
    assert got["kv/compressions_mean"] == 1.5
    assert got["kv/dense_tokens"] == 1200.0 and got["kv/kept_tokens"] == 600.0
    empty = kv_metrics([])
    assert empty["kv/savings"] == 0.0 and empty["kv/peak_tokens_max"] == 0.0
