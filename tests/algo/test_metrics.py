"""The loop's metrics (slime_sparse/algo/metrics.py). Mismatch and KV metrics against hand values and a per-token
python reference; the mismatch statistics (one function for the total and both parts of the split) against python
references written from their definitions, the quantiles against torch.quantile, and the documented alarms at their
bounds."""
from __future__ import annotations

import math
import random

import pytest
import torch

from slime_sparse.algo import (MISMATCH_ALARMS, crossed_alarms, kv_metrics, log_ratio_stats, mismatch_metrics,
                               mismatch_split_metrics)
from slime_sparse.algo.metrics import quantile
from slime_sparse.types import KVStats


# ---------------------------------------------------------------------------------------------- mismatch and KV metrics
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


# --------------------------------------------------------------------------------------- mismatch statistics and alarms
def ref_quantile(values: list[float], q: float) -> float:
    """The 'linear' definition: the order statistic at position q (n - 1), interpolated."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def reference_stats(rows: list[list[float]], token_bounds=(0.5, 1.5), veto=1e-4) -> dict[str, float]:
    """log_ratio_stats of ragged rows of per-token log ratios l, from the definitions."""
    c = lambda x: min(max(x, -20.0), 20.0)  # noqa: E731
    toks = [l for row in rows for l in row]
    n = len(toks)
    seqs = [row for row in rows if row]
    low, high = token_bounds
    return {
        "k1": sum(-l for l in toks) / n,
        "k3": sum(math.exp(c(l)) - 1 - c(l) for l in toks) / n,
        "abs_log_xi": sum(abs(l) for l in toks) / n,
        "abs_log_xi_p99": ref_quantile([abs(l) for l in toks], 0.99),
        "abs_log_xi_p999": ref_quantile([abs(l) for l in toks], 0.999),
        "xi_p5": ref_quantile([math.exp(c(l)) for l in toks], 0.05),
        "chi2_token": sum(math.exp(2 * c(l)) for l in toks) / n - 1,
        "chi2_seq": sum(math.exp(2 * c(sum(row))) - 1 for row in seqs) / len(seqs),
        "token_mask_frac": sum((low is not None and math.exp(c(l)) < low) or (high is not None and math.exp(c(l)) > high)
                               for l in toks) / n,
        "veto_seq_frac": sum(any(l < math.log(veto) for l in row) for row in seqs) / len(seqs),
    }


def ragged(seed: int, batch: int = 9, max_len: int = 40):
    rng = random.Random(seed)
    rows = [[rng.gauss(0.0, 0.4) for _ in range(rng.randint(0, max_len))] for _ in range(batch)]
    rows[1] = rows[1] + [math.log(1e-5), 3.0] if rows[1] else [math.log(1e-5)]  # a vetoable token, a large one
    return rows


def to_tensors(rows, fill=float("nan")):
    width = max(map(len, rows)) + 1
    values = torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=torch.float64)
    valid = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows])
    return values, valid


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bounds, veto", [((0.5, 1.5), 1e-4), ((0.8, None), 1e-3), ((None, 1.2), 1e-6)])
def test_log_ratio_stats_against_reference(seed, bounds, veto):
    rows = ragged(seed)
    values, valid = to_tensors(rows)
    got = {k: float(v) for k, v in log_ratio_stats(values, valid, token_bounds=bounds, veto=veto).items()}
    want = reference_stats(rows, bounds, veto)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key


def test_quantile_matches_torch_and_handles_edges():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 1000):
        x = torch.randn(n, generator=g, dtype=torch.float64)
        for q in (0.0, 0.05, 0.5, 0.99, 0.999, 1.0):
            assert float(quantile(x, q)) == pytest.approx(float(torch.quantile(x, q)), rel=1e-12, abs=1e-15)
    assert float(quantile(torch.zeros(0), 0.5)) == 0.0


def test_stats_of_an_empty_mask_are_zero():
    got = log_ratio_stats(torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.bool))
    assert all(float(v) == 0.0 for v in got.values())


def test_xi_p5_is_sparrows_tail_statistic():
    """95 tokens at xi = 1 and 5 at xi = 0.5: the 5th percentile sits at the boundary."""
    l = torch.tensor([[0.0] * 95 + [math.log(0.5)] * 5], dtype=torch.float64)
    p5 = float(log_ratio_stats(l, torch.ones_like(l, dtype=torch.bool))["xi_p5"])
    assert p5 == pytest.approx(ref_quantile([1.0] * 95 + [0.5] * 5, 0.05))
    assert 0.5 < p5 < 1.0


def test_mismatch_metrics_keep_their_old_keys_and_add_the_new():
    rows = ragged(0)
    l, valid = to_tensors(rows, fill=0.0)
    old = -torch.rand_like(l) - 0.1
    m = mismatch_metrics(old, old - l, valid)
    want = reference_stats(rows)
    for key in want:
        assert m[f"mismatch/{key}"] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    for key in ("sampler_ppl", "learner_ppl", "tokens", "nonfinite_tokens"):
        assert f"mismatch/{key}" in m


def test_split_parts_add_up_and_are_each_the_stats_of_their_part():
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(6, 30)
    mask[2, 10:] = 0
    mask[4, 1:] = 0  # length 1
    old = -torch.rand(6, 30, generator=g, dtype=torch.float64) * 3
    shadow = old + 0.3 * torch.randn(6, 30, generator=g, dtype=torch.float64)  # what eviction changes
    sparse = shadow + 1e-3 * torch.randn(6, 30, generator=g, dtype=torch.float64)  # the numeric part
    split = mismatch_split_metrics(old, shadow, sparse, mask)
    total = mismatch_metrics(old, sparse, mask)
    # per token log xi = sparsity + numeric, so the linear statistic (k1) adds up exactly
    assert split["mismatch/sparsity/k1"] + split["mismatch/numeric/k1"] == pytest.approx(total["mismatch/k1"], rel=1e-12)
    on = mask > 0
    for part, l in (("sparsity", old - shadow), ("numeric", shadow - sparse)):
        want = {k: float(v) for k, v in log_ratio_stats(torch.where(on, l, 0.0), on).items()}
        for key, value in want.items():
            assert split[f"mismatch/{part}/{key}"] == pytest.approx(value, rel=1e-12), (part, key)
    assert split["mismatch/numeric/abs_log_xi"] < 1e-2 < split["mismatch/sparsity/abs_log_xi"]
    # a token non-finite in any of the three policies is left out of both parts
    shadow[0, 0] = float("-inf")
    split2 = mismatch_split_metrics(old, shadow, sparse, mask)
    assert all(math.isfinite(v) for v in split2.values())


@pytest.mark.parametrize("alarm", MISMATCH_ALARMS, ids=lambda a: a.key)
def test_each_alarm_fires_outside_its_documented_bounds_only(alarm):
    inside = 1.0 if alarm.low <= 1.0 <= alarm.high else (alarm.low + 1e-3 if math.isfinite(alarm.low) else
                                                          alarm.high - 1e-3)
    inside = {"mismatch/k1": 0.0, "mismatch/abs_log_xi": 0.05, "correction/veto_seq_frac": 0.05,
              "mismatch/chi2_token": 0.5}.get(alarm.key, inside)
    assert crossed_alarms({alarm.key: inside}) == []
    for outside in ([alarm.low - 1e-3] if math.isfinite(alarm.low) else []) + (
            [alarm.high + 1e-3] if math.isfinite(alarm.high) else []):
        (key, line), = crossed_alarms({alarm.key: outside})
        assert key == alarm.key and alarm.key in line and f"{outside:.4g}" in line


def test_the_documented_alarm_values():
    """verl's troubleshooting bounds, slime's CI bound, Sparrow's p5."""
    fired = dict(crossed_alarms({"correction/is_mean": 2.5, "correction/is_ess": 0.2, "correction/veto_seq_frac": 0.2,
                                 "mismatch/chi2_token": 1.5, "mismatch/k1": -0.2, "mismatch/abs_log_xi": 0.15,
                                 "mismatch/xi_p5": 0.8, "mismatch/k3": 9.0}))
    assert set(fired) == {a.key for a in MISMATCH_ALARMS}
    assert crossed_alarms({"correction/is_mean": 0.5, "correction/is_ess": 0.3, "correction/veto_seq_frac": 0.1,
                           "mismatch/chi2_token": 1.0, "mismatch/k1": 0.1, "mismatch/abs_log_xi": 0.1,
                           "mismatch/xi_p5": 0.86}) == []
    assert crossed_alarms({"mismatch/k1": float("nan")}) == []
