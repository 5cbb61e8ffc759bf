"""The budget rule every engine follows (slime_sparse.kv.schedule): when a cache compresses, what that bounds.

References: the rule as the design states it (compress back to B at B + buffer; SnapKV also right after prefill),
and a step-by-step simulation of one cache for the peak.
"""
from __future__ import annotations

import pytest

from slime_sparse.kv import METHODS, TRAITS, KVCompressConfig, peak_slots, row_capacity, should_compress


def test_trigger_fires_at_budget_plus_buffer():
    cfg = KVCompressConfig(method="rkv", budget=16, buffer=4, window=4, granularity="model")
    assert not should_compress(19, cfg)
    assert should_compress(20, cfg) and should_compress(50, cfg)
    assert not should_compress(10_000, KVCompressConfig(method="none"))
    snap = KVCompressConfig(method="snapkv", budget=16, buffer=4, window=4, granularity="model")
    assert should_compress(17, snap, first_decode=True)  # SnapKV: the prompt is cut to B after prefill
    assert not should_compress(16, snap, first_decode=True) and not should_compress(17, snap, first_decode=False)
    assert not should_compress(17, cfg, first_decode=True)  # other methods wait for B + buffer


def test_every_method_has_traits_and_only_snapkv_and_pyramidkv_compress_after_prefill():
    assert set(TRAITS) == set(METHODS)
    assert [m for m in METHODS if TRAITS[m].compresses_after_prefill] == ["snapkv", "pyramidkv"]
    assert [m for m in METHODS if TRAITS[m].tracks_mass] == ["h2o"]
    assert KVCompressConfig(method="streaming").sinks == 4 and KVCompressConfig(method="rkv").sinks == 0


def test_row_capacity_is_budget_plus_buffer_or_the_whole_sequence():
    cfg = KVCompressConfig(method="h2o", budget=16, buffer=4, window=4)
    assert row_capacity(cfg, 100) == 20 and row_capacity(cfg, 12) == 12
    assert row_capacity(KVCompressConfig(method="none"), 100) == 100


def simulated_peak(cache_len: int, writes: int, cfg: KVCompressConfig, first_decode: bool) -> int:
    """One slot written per step, the trigger asked before every write."""
    peak = cache_len
    for step in range(writes):
        if cfg.enabled and (cache_len >= cfg.budget + cfg.buffer
                            or (cfg.method == "snapkv" and step == 0 and first_decode and cache_len > cfg.budget)):
            cache_len = cfg.budget
        cache_len += 1
        peak = max(peak, cache_len)
    return peak


@pytest.mark.parametrize("method", ["none", "rkv", "snapkv"])
def test_peak_slots_equals_a_step_by_step_simulation(method):
    cfg = KVCompressConfig(method=method, budget=8, buffer=3, window=2)
    for cache_len in range(0, 20):
        for writes in range(0, 15):
            for first in (False, True):
                assert peak_slots(cache_len, writes, cfg, first) == simulated_peak(cache_len, writes, cfg, first), (
                    cache_len, writes, first)
    with pytest.raises(ValueError, match="writes"):
        peak_slots(3, -1, cfg)
