"""select_kept invariants, the small pure helpers on hand-computed values, and config validation."""
from __future__ import annotations

import math

import pytest
import torch

from slime_sparse.kv import KVCompressConfig, gqa_reduce, pool1d, rkv_redundancy, select_kept


def cfg_with(sinks: int, window: int, budget: int = 64) -> KVCompressConfig:
    return KVCompressConfig(method="snapkv", budget=budget, window=window, n_sink=sinks)


# --------------------------------------------------------------------------------------------------------------
# select_kept
# --------------------------------------------------------------------------------------------------------------
def test_select_kept_hand_example():
    scores = torch.tensor([0.0, 9.0, 1.0, 7.0, 3.0, 8.0, 2.0, 5.0, 4.0, 0.5])
    # sinks {0}, window {8, 9}, top 3 of slots 1..7 by score: 1 (9.0), 5 (8.0), 3 (7.0)
    kept = select_kept(scores, budget=6, cfg=cfg_with(sinks=1, window=2))
    assert kept.tolist() == [0, 1, 3, 5, 8, 9]


@pytest.mark.parametrize("sinks,window,budget", [(0, 1, 5), (4, 8, 20), (2, 3, 5), (0, 6, 30)])
def test_select_kept_invariants_against_brute_force(sinks, window, budget):
    gen = torch.Generator().manual_seed(sinks * 100 + window)
    n = 37
    scores = torch.randn(3, 2, n, generator=gen)  # arbitrary leading dims
    kept = select_kept(scores, budget, cfg_with(sinks, window))
    assert kept.shape == (3, 2, budget) and kept.dtype == torch.long
    for a in range(3):
        for b in range(2):
            row = kept[a, b].tolist()
            assert row == sorted(set(row))  # sorted, no duplicates
            assert set(range(sinks)) <= set(row) and set(range(n - window, n)) <= set(row)
            # every dropped middle slot scores no higher than every kept middle slot
            middle = range(sinks, n - window)
            kept_mid = [scores[a, b, j].item() for j in middle if j in row]
            dropped = [scores[a, b, j].item() for j in middle if j not in row]
            assert len(kept_mid) == budget - sinks - window
            assert not dropped or not kept_mid or max(dropped) <= min(kept_mid)


def test_select_kept_ties_go_to_the_earlier_slot():
    cfg = cfg_with(sinks=1, window=2)
    flat = torch.zeros(12)
    assert select_kept(flat, 7, cfg).tolist() == [0, 1, 2, 3, 4, 10, 11]
    scores = torch.tensor([5.0, 1.0, 3.0, 3.0, 2.0, 3.0, 3.0, 1.0, 0.0, 0.0])
    # middle slots 1..7; three of the four 3.0s fit: the earliest three (2, 3, 5)
    assert select_kept(scores, 6, cfg).tolist() == [0, 2, 3, 5, 8, 9]
    # same answer with protected slots holding +inf, as score_layer returns them
    protected = scores.clone()
    protected[0] = protected[8:] = float("inf")
    assert select_kept(protected, 6, cfg).tolist() == [0, 2, 3, 5, 8, 9]


def test_select_kept_budget_at_least_n():
    scores = torch.randn(2, 3, 10)
    for budget in (10, 11, 100):
        kept = select_kept(scores, budget, cfg_with(0, 4))
        assert kept.shape == (2, 3, 10) and torch.equal(kept, torch.arange(10).expand(2, 3, 10))


def test_select_kept_bfloat16_scores():
    scores = torch.tensor([1.0, 4.0, 2.0, 3.0, 0.0, 0.0], dtype=torch.bfloat16)
    assert select_kept(scores, 4, cfg_with(0, 2)).tolist() == [1, 3, 4, 5]


def test_select_kept_rejects_budget_below_protected():
    with pytest.raises(ValueError, match="budget=5 must be >= sinks \\+ window"):
        select_kept(torch.randn(20), 5, cfg_with(sinks=2, window=4))


# --------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------
def test_pool1d_hand_values():
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0, 5.0]])
    assert pool1d(x, 3, "max").tolist() == [[3.0, 3.0, 3.0, 5.0, 5.0]]
    # average counts the zero padding: border = (0 + 1 + 3) / 3
    torch.testing.assert_close(pool1d(x, 3, "avg"), torch.tensor([[4 / 3, 2.0, 5 / 3, 7 / 3, 5 / 3]]))
    assert torch.equal(pool1d(x, 1, "max"), x)
    # a kernel longer than the row still keeps its length
    assert pool1d(x, 7, "max").tolist() == [[3.0, 5.0, 5.0, 5.0, 5.0]]


def test_gqa_reduce_groups_consecutive_query_heads():
    x = torch.tensor([[1.0, 8.0], [3.0, 2.0], [5.0, 5.0], [7.0, 1.0]])  # 4 query heads, 2 KV heads
    assert gqa_reduce(x, 2, "mean").tolist() == [[2.0, 5.0], [6.0, 3.0]]
    assert gqa_reduce(x, 2, "max").tolist() == [[3.0, 8.0], [7.0, 5.0]]
    assert torch.equal(gqa_reduce(x, 4, "max"), x)
    with pytest.raises(ValueError, match="how='sum'"):
        gqa_reduce(x, 2, "sum")
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        gqa_reduce(x, 3, "mean")


def softmax(xs):
    exps = [math.exp(x) for x in xs]
    return [e / sum(exps) for e in exps]


def test_rkv_redundancy_three_copies():
    """Three identical keys: S = 1 off the diagonal. Newest near-duplicates: row 0 -> 2, row 1 -> 2, row 2 -> 1.
    Column means over 3 rows: slot 0: (1 + 1) / 3, slot 1: (1 + 0) / 3, slot 2: (0 + 0) / 3."""
    keys = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]])
    expected = softmax([2 / 3, 1 / 3, 0.0])
    torch.testing.assert_close(rkv_redundancy(keys, 0.5), torch.tensor([expected]))


def test_rkv_redundancy_chain_and_row_without_duplicate():
    """cos(k0, k1) = 0.6, cos(k1, k2) = 0.8, cos(k0, k2) = 0; k3 has cosine 0.3 with k0 and no near-duplicate,
    so (as in R-KV's reference) its row marks index 0: its similarity to slot 0 is zeroed too."""
    s = math.sqrt(1 - 0.09)
    keys = torch.tensor([[[1.0, 0.0, 0.0], [0.6, 0.8, 0.0], [0.0, 1.0, 0.0], [0.3, 0.0, s]]])
    sim = [
        [0.0, 0.6, 0.0, 0.3],
        [0.6, 0.0, 0.8, 0.18],
        [0.0, 0.8, 0.0, 0.0],
        [0.3, 0.18, 0.0, 0.0],
    ]
    sim[0][1] = 0.0  # row 0: near-duplicates {1}
    sim[1][2] = 0.0  # row 1: near-duplicates {0, 2}, newest 2
    sim[2][1] = 0.0  # row 2: near-duplicates {1}
    sim[3][0] = 0.0  # row 3: none -> R-KV's fallback index 0
    expected = softmax([sum(sim[i][j] for i in range(4)) / 4 for j in range(4)])
    torch.testing.assert_close(rkv_redundancy(keys, 0.5), torch.tensor([expected]), rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------------------------
# Config validation names the flag
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,flag",
    [
        (dict(method="quest"), "--kv-method"),
        (dict(method="rkv", gqa_reduce="sum"), "--kv-gqa-reduce"),
        (dict(method="rkv", granularity="token"), "--kv-granularity"),
        (dict(method="rkv", pooling="min"), "--kv-pooling"),
        (dict(method="rkv", window=0), "--kv-window"),
        (dict(method="rkv", buffer=0), "--kv-buffer"),
        (dict(method="rkv", kernel_size=4), "--kv-kernel-size"),
        (dict(method="rkv", mix_lambda=1.5), "--kv-mix-lambda"),
        (dict(method="rkv", n_sink=-1), "--kv-n-sink"),
        (dict(method="streaming", budget=10, window=6), "--kv-budget"),
    ],
)
def test_config_validation_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        KVCompressConfig(**kwargs).validate()


def test_rkv_redundancy_in_half_precision_finds_near_duplicates_as_in_fp32():
    """On bf16 keys the near-duplicate search runs in bf16 (R-KV's own precision) while the sums stay fp32: the fp32
    computation's redundancy on the same (bf16-representable) keys, but where a similarity lies within bf16's rounding
    of the threshold (then the fallback j* = 0 and a real duplicate trade places: a few 1e-5 at slot 0 here)."""
    torch.manual_seed(0)
    keys = torch.randn(3, 2, 120, 32)
    keys[:, :, 40:50] = keys[:, :, 5:15] + 0.05 * torch.randn(3, 2, 10, 32)  # near-duplicates, well over 0.5
    half = keys.bfloat16()
    diff = (rkv_redundancy(half, 0.5) - rkv_redundancy(half.float(), 0.5)).abs()
    assert diff.max() < 1e-4 and (diff > 1e-7).float().mean() < 0.25  # values are ~1 / 120
    # the duplicates are found: the older copies are charged, the newest ones are not
    red = rkv_redundancy(half, 0.5)
    assert (red[..., 5:15].mean() > red[..., 40:50].mean()) and (red[..., 5:15].mean() > red[..., 60:].mean())
