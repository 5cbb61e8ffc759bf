import random

import pytest

from slime_sparse.backends.batching import balance_by_tokens, pack_by_tokens


def test_pack_respects_budget_and_order():
    lengths = [5, 7, 3, 9, 2, 2, 8]
    batches = pack_by_tokens(lengths, max_tokens=16)
    assert [i for b in batches for i in b] == list(range(len(lengths)))
    for b in batches:
        assert len(b) * max(lengths[i] for i in b) <= 16 or len(b) == 1
    # greedy by hand: [5,7]->14 ok, +3 -> 3*7=21 > 16 -> cut; [3,9]=18>16 -> [3]; [9]; [2,2,8]=24>16 -> [9] alone...
    assert batches == [[0, 1], [2], [3], [4, 5], [6]]


def test_pack_oversized_sample_gets_own_batch():
    assert pack_by_tokens([50, 1, 1], max_tokens=10) == [[0], [1, 2]]
    with pytest.raises(ValueError):
        pack_by_tokens([1], 0)


def test_balance_equal_sizes_and_tokens():
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(64)]
    parts = balance_by_tokens(lengths, 4)
    assert sorted(i for p in parts for i in p) == list(range(64))
    assert {len(p) for p in parts} == {16}
    sums = [sum(lengths[i] for i in p) for p in parts]
    # LPT with equal counts is within one max item of perfect balance
    assert max(sums) - min(sums) <= max(lengths)
    naive = [sum(lengths[i::4]) for i in range(4)]
    assert max(sums) - min(sums) <= max(naive) - min(naive)


def test_balance_uneven_count():
    parts = balance_by_tokens([3, 1, 2, 5, 4], 2)
    assert sorted(len(p) for p in parts) == [2, 3]
    assert sorted(i for p in parts for i in p) == [0, 1, 2, 3, 4]
