import itertools
import random

import pytest

from slime_sparse.backends.batching import balance_by_tokens, length_groups


def test_length_groups_are_the_cheapest_split_within_the_budget():
    """Against every split of the sorted rows into contiguous parts (brute force) that keeps each part within
    max_tokens padded tokens (or a single row), and every row once."""
    rng = random.Random(0)
    for _ in range(60):
        lengths = [rng.choice([rng.randint(8, 14), rng.randint(40, 95)]) for _ in range(rng.randint(1, 9))]
        overhead = rng.choice([0, 10, 256, 10_000])
        max_tokens = rng.choice([None, 60, 200, 10_000])
        parts = length_groups(lengths, overhead, max_tokens)
        assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
        padded = lambda p: len(p) * max(lengths[i] for i in p)  # noqa: E731
        fits = lambda p: max_tokens is None or len(p) == 1 or padded(p) <= max_tokens  # noqa: E731
        cost = lambda ps: sum(padded(p) + overhead for p in ps)  # noqa: E731
        order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
        splits = ([order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))]
                  for k in range(len(order)) for cuts in itertools.combinations(range(1, len(order)), k))
        assert all(fits(p) for p in parts)
        assert cost(parts) == min(cost(s) for s in splits if all(fits(p) for p in s))
    assert length_groups([12] * 16 + [90] * 16, 256) == [list(range(16)), list(range(16, 32))]  # bare | worked
    assert len(length_groups([12, 90], overhead=10_000)) == 1  # a part costs more than the padding it saves


def test_length_groups_sort_and_bound():
    assert length_groups([50, 1, 1], 0, max_tokens=10) == [[1, 2], [0]]  # a row over the budget alone
    assert length_groups([5, 7, 3, 9], 100) == [[2, 0, 1, 3]]  # padding is cheaper than a part
    assert length_groups([5, 7, 3, 9], 100, max_tokens=16) == [[2], [0, 1], [3]]  # 3 x 7 > 16: parts despite that
    with pytest.raises(ValueError, match="max_tokens must be > 0"):
        length_groups([1], 0, max_tokens=0)


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
