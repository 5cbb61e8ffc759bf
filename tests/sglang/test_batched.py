"""The SGLang plugin's batched compaction (#37) against the per-request compaction it replaced
(tests/helpers/sglang_reference.py), on twin worlds built from one seed: the same kept slots (req_to_token), the same freed
slots in the same order (the allocator's free list), the same lengths and Req fields, and the same eviction records
once SGLang's IPC has pickled them; for every method and preset the plugin supports (granularity 'model', the only
one it can express). Then: a compaction waits for nothing and reads nothing back from the device.

Slow set (SGLang's own pool classes): `python -m pytest -q -p no:cacheprovider -m sglang tests/sglang/test_batched.py`.
"""
from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch
from tests.helpers.sglang_pools import replica_pools, sglang_pools
from tests.helpers.sglang_reference import compact_batch_per_request

from sglang_patches.evictions import EVICTIONS_INFO_KEY, PendingEntry
from sglang_patches.runtime import EVICTED_ATTR, SparseKVRuntime, bucket, evicted_count
from sglang_patches.settings import DENSE_REQUEST_PARAM, check_sglang_kv_config
from slime_sparse.kv import KVCompressConfig
from slime_sparse.utils.op_audit import CaptureGuard, OpCounter

L, HQ, HKV, D, MAX_LEN = 2, 4, 2, 8, 96
BUDGET, BUFFER, WINDOW = 12, 4, 3
TRIGGER = BUDGET + BUFFER


def kv(method: str, preset: str | None = None, **knobs) -> KVCompressConfig:
    base = dict(method=method, budget=BUDGET, buffer=BUFFER, window=WINDOW, granularity="model", **knobs)
    cfg = KVCompressConfig.from_preset(preset, **base) if preset else KVCompressConfig(**base)
    check_sglang_kv_config(cfg)  # what a server would accept
    return cfg


# every method the plugin runs (PyramidKV at one budget: SGLang refuses a pyramid) and every preset that has it
CONFIGS = {
    "snapkv": kv("snapkv", kernel_size=3), "snapkv-kvpress": kv("snapkv", "kvpress", kernel_size=3),
    "snapkv-fork": kv("snapkv", "sparse-rl-fork"), "rkv": kv("rkv", n_sink=2), "rkv-fork": kv("rkv", "sparse-rl-fork"),
    "rkv-code": kv("rkv", "rkv-code"), "streaming": kv("streaming"), "streaming-kvpress": kv("streaming", "kvpress"),
    "h2o": kv("h2o"), "h2o-fork": kv("h2o", "sparse-rl-fork"), "pyramidkv": kv("pyramidkv", budget_schedule="uniform"),
    "keydiff": kv("keydiff"), "keydiff-kvpress": kv("keydiff", "kvpress"),
}


def world(cfg: KVCompressConfig, lengths: list[int], generated: list[int], evicted: list[int],
          dense: frozenset[int] = frozenset(), seed: int = 0, make_pools=replica_pools, device: str = "cpu"):
    """A decode batch about to run prepare_for_decode: request i holds lengths[i] slots (a random subset of the pool,
    as after earlier compactions), has generated[i] tokens and evicted[i] so far; random keys and query rings."""
    g = torch.Generator().manual_seed(seed)
    size = sum(lengths) + 7
    if make_pools is replica_pools:
        pools = replica_pools(len(lengths), size, L, HKV, D, MAX_LEN, device=device)
    else:
        pools = make_pools(len(lengths), size, L, HKV, D, MAX_LEN)
    req_to_token_pool, kv_pool, allocator = pools
    runtime = SparseKVRuntime.allocate(cfg, *pools, num_q_heads=HQ, dtype=torch.float32).attach()
    if device != "meta":
        runtime.rings.copy_(torch.randn(runtime.rings.shape, generator=g))
        for layer in range(L):
            kv_pool.get_key_buffer(layer).copy_(torch.randn(kv_pool.get_key_buffer(layer).shape, generator=g))
    taken = allocator.alloc(sum(lengths))
    if device != "meta":
        taken = taken[torch.randperm(taken.numel(), generator=g)]
    reqs, offset = [], 0
    for i, (n, gen, ev) in enumerate(zip(lengths, generated, evicted)):
        req_to_token_pool.req_to_token[i + 1, :n] = taken[offset: offset + n].to(torch.int32)
        offset += n
        custom = {DENSE_REQUEST_PARAM: True} if i in dense else None
        reqs.append(SimpleNamespace(rid=f"r{i}", origin_input_ids=[0] * (n + ev - gen + 1), output_ids=[0] * gen,
                                    req_pool_idx=i + 1, kv_committed_len=n, kv_allocated_len=n, customized_info=None,
                                    sampling_params=SimpleNamespace(custom_params=custom), **{EVICTED_ATTR: ev}))
    lens = torch.tensor(lengths, dtype=torch.int64)
    batch = SimpleNamespace(reqs=reqs, seq_lens=lens.to(device), seq_lens_cpu=lens.clone(), seq_lens_sum=sum(lengths),
                            req_to_token_pool=req_to_token_pool, spec_algorithm=SimpleNamespace(is_none=lambda: True))
    return runtime, batch


def on_the_wire(info):
    """customized_info as SGLang's scheduler -> tokenizer IPC delivers it (io_struct.wrap_as_pickle)."""
    return pickle.loads(pickle.dumps(info))


# (lengths, generated, evicted, dense): a steady decode step (3 due: padded to 4; one below its trigger, one dense
# opt-out), a step right after prefill (SnapKV cuts prompts of three lengths: three groups), one due request
SCENES = {
    "steady": ([TRIGGER, TRIGGER - 2, TRIGGER, TRIGGER, TRIGGER], [9, 5, 30, 4, 12], [5, 6, 40, 0, 0], {4}),
    "after-prefill": ([BUDGET + 3, BUDGET + 1, TRIGGER, BUDGET - 2, TRIGGER + 5], [1] * 5, [0] * 5, set()),
    "one": ([TRIGGER], [7], [3], set()),
}


@pytest.mark.parametrize("scene", SCENES)
@pytest.mark.parametrize("name", CONFIGS)
def test_batched_compaction_equals_the_per_request_loop(name, scene):
    cfg = CONFIGS[name]
    lengths, generated, evicted, dense = SCENES[scene]
    old_rt, old = world(cfg, lengths, generated, evicted, frozenset(dense))
    new_rt, new = world(cfg, lengths, generated, evicted, frozenset(dense))
    assert torch.equal(old_rt.rings, new_rt.rings)  # twins
    n_old = compact_batch_per_request(old_rt, old)
    n_new = new_rt.compact_batch(new)
    assert n_new == n_old > 0
    # kept slots, in token order, at the front of each row (the rest of every row untouched alike)
    assert torch.equal(new_rt.req_to_token, old_rt.req_to_token)
    # freed slots: the same ids in the same order (SGLang allocates from the front of the free list)
    assert torch.equal(new_rt.allocator.free_pages, old_rt.allocator.free_pages)
    assert torch.equal(new.seq_lens, old.seq_lens) and torch.equal(new.seq_lens_cpu, old.seq_lens_cpu)
    assert new.seq_lens_sum is None and old.seq_lens_sum is None
    for a, b in zip(old.reqs, new.reqs):
        assert (a.kv_committed_len, a.kv_allocated_len, evicted_count(a)) == \
            (b.kv_committed_len, b.kv_allocated_len, evicted_count(b))
        if b.customized_info is not None:
            assert any(isinstance(e, PendingEntry) for e in b.customized_info[EVICTIONS_INFO_KEY])
        assert on_the_wire(b.customized_info) == a.customized_info  # the records, as the client receives them


@pytest.mark.parametrize("name", ["rkv", "snapkv"])
def test_batched_compaction_in_memory_sized_calls_equals_the_loop(name):
    """Past its memory allowance a step compacts its due requests in several calls (a power of two each)."""
    cfg = CONFIGS[name]
    lengths, generated, evicted = [TRIGGER] * 5, [9] * 5, [1, 2, 3, 4, 5]
    old_rt, old = world(cfg, lengths, generated, evicted)
    new_rt, new = world(cfg, lengths, generated, evicted)
    per_request = L * TRIGGER * D * 4 * (HQ + 2 * HKV)
    new_rt.compaction_bytes = 3 * per_request
    assert new_rt.rows_per_call(TRIGGER) == 2
    calls = []
    original = new_rt.compactor.__call__
    new_rt.compactor = lambda rows, logical, n: (calls.append(rows.numel()), original(rows, logical, n))[1]
    assert compact_batch_per_request(old_rt, old) == new_rt.compact_batch(new) == 5
    assert calls == [2, 2, 1]
    assert torch.equal(new_rt.req_to_token, old_rt.req_to_token)
    assert torch.equal(new_rt.allocator.free_pages, old_rt.allocator.free_pages)
    assert [on_the_wire(r.customized_info) for r in new.reqs] == [r.customized_info for r in old.reqs]


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.parametrize("name", ["rkv", "snapkv"])
def test_batched_compaction_equals_the_loop_on_sglangs_pools(name):
    cfg = CONFIGS[name]
    lengths, generated, evicted, dense = SCENES["steady"]
    old_rt, old = world(cfg, lengths, generated, evicted, frozenset(dense), make_pools=sglang_pools)
    new_rt, new = world(cfg, lengths, generated, evicted, frozenset(dense), make_pools=sglang_pools)
    assert compact_batch_per_request(old_rt, old) == new_rt.compact_batch(new) == 3
    assert torch.equal(new_rt.req_to_token, old_rt.req_to_token)
    assert torch.equal(new_rt.allocator.free_pages, old_rt.allocator.free_pages)
    assert [on_the_wire(r.customized_info) for r in new.reqs] == [r.customized_info for r in old.reqs]


def test_batched_padding_repeats_a_due_request_and_changes_nothing():
    assert [bucket(c) for c in (1, 2, 3, 4, 5, 16, 17, 256)] == [1, 2, 4, 4, 8, 16, 32, 256]
    cfg = CONFIGS["rkv"]
    runtime, batch = world(cfg, [TRIGGER] * 3, [9] * 3, [2] * 3)
    rows = [r.req_pool_idx for r in batch.reqs]
    logical = [TRIGGER + 2] * 3
    alone = [runtime.compactor(torch.tensor([row]), torch.tensor([lg]), TRIGGER) for row, lg in zip(rows, logical)]
    _, again = world(cfg, [TRIGGER] * 3, [9] * 3, [2] * 3)
    padded = again.req_to_token_pool.slime_sparse_kv.compactor(torch.tensor(rows + rows[:1]),
                                                               torch.tensor(logical + logical[:1]), TRIGGER)
    assert torch.equal(runtime.req_to_token, again.req_to_token_pool.req_to_token)
    assert torch.equal(padded.freed[:3], torch.cat([c.freed for c in alone]))
    assert torch.equal(padded.freed[3], padded.freed[0]) and torch.equal(padded.packed[3], padded.packed[0])


# ----------------------------------------------------------------------------------------------------------------
# No host synchronisation
# ----------------------------------------------------------------------------------------------------------------
# KeyDiff's F.cosine_similarity turns its constant eps into a device scalar (aten.scalar_tensor: a fill with a value
# that never changes, so a graph may bake it in) under torch.no_grad, SGLang's default grad mode; under
# inference_mode, the embedded engine's, it does not. The guard cannot tell a constant from host data, so it is named.
EPS_LIFT = ("aten.scalar_tensor", "host data lifted into a tensor")


@pytest.mark.parametrize("name", CONFIGS)
def test_batched_compaction_is_capture_safe(name):
    """The device part on the meta device under CaptureGuard, in SGLang's grad mode: no host sync, no host data, no
    host tensor (after one unguarded warm-up, as a graph capture's)."""
    cfg = CONFIGS[name]
    runtime, batch = world(cfg, [TRIGGER] * 3, [9] * 3, [2] * 3, device="meta")
    table = torch.zeros(3, bucket(3), dtype=torch.int64, device="meta")
    with torch.no_grad():
        runtime.compact_on_device(table, TRIGGER, batch.seq_lens)
        with CaptureGuard("meta") as guard:
            out = runtime.compact_on_device(table, TRIGGER, batch.seq_lens)
    if cfg.method == "keydiff":
        assert guard.violations == [EPS_LIFT]
        guard.violations.clear()
    guard.check()
    assert out.freed.shape == (4, BUFFER) and out.packed.shape == (4, (TRIGGER + 7) // 8)


@pytest.mark.parametrize("name", ["rkv", "snapkv", "h2o"])
def test_batched_compaction_hook_never_reads_the_device(name):
    """The whole hook (trigger, table, compaction, allocator free, lengths, records) with every device tensor on the
    meta device, which holds no data: any host read of one (.item(), .tolist(), int(), a boolean-mask index,
    nonzero) would raise. The host side keeps only what it knew (lengths, Req fields)."""
    runtime, batch = world(CONFIGS[name], [TRIGGER, TRIGGER - 1, TRIGGER], [9, 9, 9], [2, 2, 2], device="meta")
    assert runtime.compact_batch(batch) == 2
    assert batch.seq_lens_cpu.tolist() == [BUDGET, TRIGGER - 1, BUDGET]
    assert [evicted_count(r) for r in batch.reqs] == [2 + BUFFER, 2, 2 + BUFFER]
    assert runtime.allocator.available_size() == 7 + 2 * BUFFER
    positions = runtime.logical_decode_positions(torch.zeros(3, dtype=torch.int64, device="meta"), batch.reqs)
    assert positions.device.type == "meta"


def test_batched_compaction_syncs_nothing_and_the_loop_does():
    """OpCounter on CPU, for the cost model's sync column: the per-request loop waits on the device (its host copies
    and mask gathers), the batched call never does. (Also: the counter can fail.)"""
    cfg = CONFIGS["rkv"]
    lengths, generated, evicted, dense = SCENES["steady"]
    old_rt, old = world(cfg, lengths, generated, evicted, frozenset(dense))
    new_rt, new = world(cfg, lengths, generated, evicted, frozenset(dense))
    with OpCounter() as loop:
        compact_batch_per_request(old_rt, old)
    with OpCounter() as batched:
        new_rt.compact_batch(new)
    assert loop.syncs >= 3 and batched.syncs == 0
