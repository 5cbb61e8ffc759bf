"""Scores and selections of every KV-compression method against references re-derived here with explicit
python loops over heads and tokens (float64 python math, no torch kernels, none of the library's helpers)."""
from __future__ import annotations

import math

import pytest
import torch

from slime_sparse.kv import KVCompressConfig, compress_indices, score_layer
from slime_sparse.kv.methods.rkv import newest_duplicate

# --------------------------------------------------------------------------------------------------------------
# Independent reference (lists of python floats)
# --------------------------------------------------------------------------------------------------------------


def ref_softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    exps = [math.exp(x - top) for x in xs]
    total = sum(exps)
    return [e / total for e in exps]


def ref_logits(keys: list, queries: list, q_head: int, group: int) -> list[list[float]]:
    """[w][n] scaled dot products of one query head with the keys of its KV head (q_head // group)."""
    kv = keys[q_head // group]
    d = len(kv[0])
    return [[sum(q[t] * k[t] for t in range(d)) / math.sqrt(d) for k in kv] for q in queries[q_head]]


def ref_pool(xs: list[float], kernel: int, how: str) -> list[float]:
    r = kernel // 2
    out = []
    for j in range(len(xs)):
        inside = [xs[t] for t in range(j - r, j + r + 1) if 0 <= t < len(xs)]
        out.append(max(inside) if how == "max" else sum(inside) / kernel)  # avg: zero padding counts
    return out


def ref_reduce(rows: list[list[float]], how: str) -> list[float]:
    """Reduce several equally long rows element-wise."""
    cols = list(zip(*rows))
    return [max(c) if how == "max" else sum(c) / len(c) for c in cols]


def ref_window_mass(keys: list, queries: list, q_head: int, group: int) -> list[float]:
    """Sum over the window queries of causal softmax attention (query i at slot n - w + i)."""
    n, w = len(keys[0]), len(queries[0])
    mass = [0.0] * n
    for i, row in enumerate(ref_logits(keys, queries, q_head, group)):
        pos = n - w + i
        probs = ref_softmax(row[: pos + 1])
        for j in range(pos + 1):
            mass[j] += probs[j]
    return mass


def ref_snapkv(cfg: KVCompressConfig, keys: list, queries: list) -> list[list[float]]:
    """Per KV head, scores of slots [0, n - window)."""
    n_kv, n, n_q = len(keys), len(keys[0]), len(queries)
    group, m = n_q // n_kv, n - cfg.window
    out = []
    for kv in range(n_kv):
        pooled = [
            ref_pool(ref_window_mass(keys, queries, h, group)[:m], cfg.kernel_size, cfg.pooling)
            for h in range(kv * group, (kv + 1) * group)
        ]
        out.append(ref_reduce(pooled, cfg.gqa_reduce))
    return out


def ref_h2o(cfg: KVCompressConfig, keys: list, queries: list) -> list[list[float]]:
    n_kv, n, n_q = len(keys), len(keys[0]), len(queries)
    group, m = n_q // n_kv, n - cfg.window
    return [
        ref_reduce([ref_window_mass(keys, queries, h, group)[:m] for h in range(kv * group, (kv + 1) * group)],
                   cfg.gqa_reduce)
        for kv in range(n_kv)
    ]


def ref_redundancy(keys_one_head: list[list[float]], threshold: float) -> list[float]:
    """R-KV's cal_similarity, written out: cosine sims, zero diagonal, zero each row's newest near-duplicate
    (index 0 when the row has none), column mean over n rows, softmax over columns."""
    n = len(keys_one_head)
    unit = []
    for k in keys_one_head:
        norm = math.sqrt(sum(x * x for x in k))
        unit.append([x / (norm + 1e-8) for x in k])
    sim = [[0.0 if i == j else sum(a * b for a, b in zip(unit[i], unit[j])) for j in range(n)] for i in range(n)]
    for i in range(n):
        near = [j for j in range(n) if sim[i][j] > threshold]
        sim[i][max(near) if near else 0] = 0.0
    return ref_softmax([sum(sim[i][j] for i in range(n)) / n for j in range(n)])


def ref_rkv(cfg: KVCompressConfig, keys: list, queries: list) -> list[list[float]]:
    n_kv, n, n_q, w = len(keys), len(keys[0]), len(queries), len(queries[0])
    group, m = n_q // n_kv, n - cfg.window
    out = []
    for kv in range(n_kv):
        per_head = [ref_logits(keys, queries, h, group) for h in range(kv * group, (kv + 1) * group)]
        importance = [0.0] * m
        for i in range(w):
            reduced = ref_reduce([per_head[g][i] for g in range(group)], cfg.gqa_reduce)  # logits, pre-softmax
            probs = ref_softmax(reduced[:m])  # window keys left out of the normalisation
            for j in range(m):
                importance[j] += probs[j] / w
        importance = ref_pool(importance, cfg.kernel_size, cfg.pooling)
        redundancy = ref_redundancy(keys[kv], cfg.sim_threshold)
        out.append([cfg.mix_lambda * importance[j] - (1 - cfg.mix_lambda) * redundancy[j] for j in range(m)])
    return out


def ref_select(middle_scores: list[float], n: int, budget: int, sinks: int, window: int) -> list[int]:
    """middle_scores[j] scores slot j for j in [0, n - window) (slots < sinks are ignored)."""
    if n <= budget:
        return list(range(n))
    middle = sorted(range(sinks, n - window), key=lambda j: (-middle_scores[j], j))
    return sorted(set(range(sinks)) | set(middle[: budget - sinks - window]) | set(range(n - window, n)))


REFERENCES = {"snapkv": ref_snapkv, "rkv": ref_rkv, "h2o": ref_h2o}


def make_inputs(seed: int, n_kv: int, group: int, n: int, w: int, d: int = 8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(n_kv, n, d, generator=gen)
    # Near-duplicate keys (cosine > 0.5) so R-KV's redundancy path is exercised.
    keys[:, n // 2 : n // 2 + 4] = keys[:, 2:6] + 0.3 * torch.randn(n_kv, 4, d, generator=gen)
    queries = 1.5 * torch.randn(n_kv * group, w, d, generator=gen)
    return keys.to(dtype), queries.to(dtype)


def as_lists(t: torch.Tensor) -> list:
    return t.double().tolist()


# --------------------------------------------------------------------------------------------------------------
# Per-method scores and per-head selections
# --------------------------------------------------------------------------------------------------------------
CASES = [
    # method, gqa_reduce, pooling, kernel, sinks, window, w
    ("snapkv", "mean", "avg", 5, 0, 4, 4),
    ("snapkv", "max", "max", 3, 2, 4, 3),
    ("rkv", "max", "max", 7, 0, 4, 4),
    ("rkv", "mean", "avg", 3, 1, 5, 5),
    ("rkv", "max", "max", 5, 0, 6, 3),
    ("h2o", "mean", "max", 7, 0, 4, 4),
    ("h2o", "max", "max", 7, 3, 3, 2),
]


@pytest.mark.parametrize("method,gqa,pooling,kernel,sinks,window,w", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_method_matches_reference(method, gqa, pooling, kernel, sinks, window, w, dtype):
    n_kv, group, n, budget = 2, 2, 32, 16
    cfg = KVCompressConfig(method=method, budget=budget, window=window, kernel_size=kernel, pooling=pooling,
                           gqa_reduce=gqa, n_sink=sinks, mix_lambda=0.3, sim_threshold=0.5)
    for seed in range(3):
        keys, queries = make_inputs(seed, n_kv, group, n, w, dtype=dtype)
        ref = REFERENCES[method](cfg, as_lists(keys), as_lists(queries))
        scores = score_layer(cfg, keys, queries)
        assert scores.dtype == torch.float32 and scores.shape == (n_kv, n)
        m = n - window
        torch.testing.assert_close(scores[:, sinks:m].double(), torch.tensor(ref, dtype=torch.float64)[:, sinks:],
                                   rtol=1e-4, atol=1e-6)
        assert torch.isinf(scores[:, :sinks]).all() and torch.isinf(scores[:, m:]).all()  # protected slots

        kept = compress_indices(cfg, [keys], [queries])[0]
        assert kept.dtype == torch.long and kept.shape == (n_kv, budget)
        for head in range(n_kv):
            assert kept[head].tolist() == ref_select(ref[head], n, budget, sinks, window), (seed, head)


def test_h2o_uses_given_attention_mass():
    n_kv, n, budget, window = 3, 20, 10, 3
    cfg = KVCompressConfig(method="h2o", budget=budget, window=window, n_sink=1)
    keys, queries = make_inputs(0, n_kv, 2, n, 2)
    mass = torch.rand(n_kv, n, generator=torch.Generator().manual_seed(1))
    kept = compress_indices(cfg, [keys], [queries], attn_mass=[mass])[0]
    for head in range(n_kv):
        assert kept[head].tolist() == ref_select(mass[head].tolist(), n, budget, 1, window)
    # The queries are not needed when the mass is given.
    empty = queries[:, :0]
    assert torch.equal(compress_indices(cfg, [keys], [empty], attn_mass=[mass])[0], kept)


@pytest.mark.parametrize("n_sink,sinks", [(None, 4), (2, 2)])
def test_streaming_keeps_sinks_and_most_recent(n_sink, sinks):
    n, budget, window = 30, 12, 3
    cfg = KVCompressConfig(method="streaming", budget=budget, window=window, n_sink=n_sink)
    assert cfg.sinks == sinks  # None -> streaming's default of 4 sinks
    keys, queries = make_inputs(0, 2, 2, n, 0)
    kept = compress_indices(cfg, [keys], [queries])[0]
    expected = list(range(sinks)) + list(range(n - (budget - sinks), n))
    assert kept.tolist() == [expected, expected]


def test_rkv_newest_near_duplicate_survives():
    """Three copies of a pattern among orthogonal keys: R-KV keeps the newest copy, drops the older ones."""
    d, n, window = 16, 12, 2
    keys = torch.eye(d)[:n].clone()
    pattern = torch.ones(d) / 4
    for slot in (1, 4, 7):
        keys[slot] = pattern
    keys = keys.unsqueeze(0)  # one KV head
    queries = torch.zeros(1, window, d)  # uniform attention: importance is flat, redundancy decides
    cfg = KVCompressConfig(method="rkv", budget=n - 2, window=window, mix_lambda=0.1, kernel_size=1)
    kept = compress_indices(cfg, [keys], [queries])[0][0].tolist()
    assert 7 in kept and 1 not in kept and 4 not in kept


def test_newest_duplicate_is_the_last_slot_over_threshold_else_zero():
    """Against a loop over every row: the largest j with sim > threshold (strictly), else R-KV's fallback 0."""
    sim = torch.rand(2, 3, 40, 40, generator=torch.Generator().manual_seed(0))  # leading dims: [layers, heads]
    sim[0, 0, 5] = 0.0  # a row without near-duplicate: R-KV's fallback index 0
    sim[0, 1, 6] = 0.0
    sim[0, 1, 6, 0] = 0.9  # the only near-duplicate is slot 0
    sim[1, 2, 7] = 0.0
    sim[1, 2, 7, [3, 39]] = 0.7  # equal to the threshold: not a near-duplicate (R-KV compares with >)
    sim[1, 2, 7, 20] = 0.71
    expected = [[[max((j for j in range(40) if sim[a, h, i, j] > 0.7), default=0) for i in range(40)]
                 for h in range(3)] for a in range(2)]
    got = newest_duplicate(sim, 0.7)
    assert got.dtype == torch.long and got.tolist() == expected
    assert got[1, 2, 7] == 20 and got[0, 0, 5] == 0 and got[0, 1, 6] == 0


# --------------------------------------------------------------------------------------------------------------
# Granularity: per layer and whole-model sets (mean of per-head scores, then mean over layers)
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["snapkv", "rkv", "h2o"])
@pytest.mark.parametrize("granularity", ["head", "layer", "model"])
def test_granularity(method, granularity):
    n_layers, n_kv, group, n, w, budget, window = 3, 2, 2, 24, 4, 12, 4
    cfg = KVCompressConfig(method=method, budget=budget, window=window, kernel_size=3, gqa_reduce="max",
                           granularity=granularity, mix_lambda=0.5)
    layers = [make_inputs(10 + layer, n_kv, group, n, w) for layer in range(n_layers)]
    refs = [REFERENCES[method](cfg, as_lists(k), as_lists(q)) for k, q in layers]
    kept = compress_indices(cfg, [k for k, _ in layers], [q for _, q in layers])
    assert len(kept) == n_layers

    head_means = [[sum(col) / n_kv for col in zip(*ref)] for ref in refs]
    for layer in range(n_layers):
        if granularity == "head":
            expected = [ref_select(refs[layer][h], n, budget, 0, window) for h in range(n_kv)]
        elif granularity == "layer":
            expected = [ref_select(head_means[layer], n, budget, 0, window)] * n_kv
        else:
            model_mean = [sum(col) / n_layers for col in zip(*head_means)]
            expected = [ref_select(model_mean, n, budget, 0, window)] * n_kv
        assert kept[layer].tolist() == expected, layer


def test_model_granularity_is_shared_and_head_granularity_is_not():
    cfg_head = KVCompressConfig(method="snapkv", budget=10, window=2, kernel_size=1)
    cfg_model = KVCompressConfig(method="snapkv", budget=10, window=2, kernel_size=1, granularity="model")
    layers = [make_inputs(seed, 4, 1, 30, 2) for seed in range(2)]
    keys, queries = [k for k, _ in layers], [q for _, q in layers]
    per_head = compress_indices(cfg_head, keys, queries)
    shared = compress_indices(cfg_model, keys, queries)
    assert not all(torch.equal(per_head[0][0], per_head[0][h]) for h in range(4))  # heads really differ
    assert all(torch.equal(shared[0], s) for s in shared)
    assert all(torch.equal(shared[0][0], row) for row in shared[0])


def test_budget_at_least_n_keeps_everything():
    for method in ("snapkv", "rkv", "h2o", "streaming"):
        cfg = KVCompressConfig(method=method, budget=16, window=4)
        keys, queries = make_inputs(0, 2, 2, 16, 4)
        kept = compress_indices(cfg, [keys], [queries])[0]
        assert kept.tolist() == [list(range(16))] * 2
        kept = compress_indices(cfg, [keys[:, :5]], [queries[:, :3]], budget=8)[0]
        assert kept.tolist() == [list(range(5))] * 2


def test_cache_shorter_than_window_is_all_protected():
    for method in ("snapkv", "rkv", "h2o", "streaming"):
        cfg = KVCompressConfig(method=method, budget=16, window=8)
        keys, queries = torch.randn(2, 3, 8), torch.randn(4, 3, 8)
        assert torch.isinf(score_layer(cfg, keys, queries)).all()
        assert compress_indices(cfg, [keys], [queries])[0].tolist() == [[0, 1, 2]] * 2


def test_budget_override_and_window_shorter_than_config():
    """The engine may pass a budget and fewer observed queries than cfg.window (early in decoding)."""
    cfg = KVCompressConfig(method="snapkv", budget=100, window=6, kernel_size=3, pooling="max")
    keys, queries = make_inputs(3, 2, 2, 30, 2)
    kept = compress_indices(cfg, [keys], [queries], budget=14)[0]
    ref = ref_snapkv(cfg, as_lists(keys), as_lists(queries))
    assert kept.tolist() == [ref_select(ref[h], 30, 14, 0, 6) for h in range(2)]


# --------------------------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------------------------
def test_score_layer_rejects_bad_input():
    keys, queries = make_inputs(0, 2, 2, 20, 4)
    with pytest.raises(ValueError, match="--kv-method=none"):
        score_layer(KVCompressConfig(method="none"), keys, queries)
    with pytest.raises(ValueError, match="--kv-method"):
        score_layer(KVCompressConfig(method="quest"), keys, queries)
    with pytest.raises(ValueError, match="--kv-window"):
        score_layer(KVCompressConfig(method="snapkv", window=3), keys, queries)
    with pytest.raises(ValueError, match="--kv-gqa-reduce"):
        score_layer(KVCompressConfig(method="snapkv", gqa_reduce="sum"), keys, queries)
    with pytest.raises(ValueError, match="not a multiple"):
        score_layer(KVCompressConfig(method="snapkv"), keys, queries[:3])
    with pytest.raises(ValueError, match="at least one observed query"):
        score_layer(KVCompressConfig(method="rkv"), keys, queries[:, :0])
    with pytest.raises(ValueError, match="attn_mass"):
        score_layer(KVCompressConfig(method="h2o"), keys, queries, attn_mass=torch.ones(2, 19))
    with pytest.raises(ValueError, match="keys must be"):
        score_layer(KVCompressConfig(method="rkv"), keys[0], queries)


def test_compress_indices_rejects_bad_input():
    keys, queries = make_inputs(0, 2, 2, 20, 4)
    cfg = KVCompressConfig(method="snapkv", budget=10, window=4)
    with pytest.raises(ValueError, match="layers of queries"):
        compress_indices(cfg, [keys, keys], [queries])
    with pytest.raises(ValueError, match="--kv-granularity=model"):
        compress_indices(KVCompressConfig(method="snapkv", budget=10, window=4, granularity="model"),
                         [keys, keys[:, :18]], [queries, queries])
    with pytest.raises(ValueError, match="--kv-budget"):
        compress_indices(KVCompressConfig(method="snapkv", budget=4, window=4), [keys], [queries])
    with pytest.raises(ValueError, match="budget=3"):
        compress_indices(cfg, [keys], [queries], budget=3)
