"""Admission control under the KV budget: the slot-need arithmetic (default set) and SGLang's own PrefillAdder /
ScheduleBatch.check_decode_mem with our hooks installed by its HookRegistry (marker `sglang`, slow:
`python -m pytest -q -p no:cacheprovider -m sglang tests/sglang/test_admission.py`).

Reference for the arithmetic: a step-by-step simulation of one request's cache size under SGLang's bookkeeping
(prefill writes the prompt, each decode step writes one slot) and the eviction trigger, written here from the
README's rule, independently of slime_sparse.kv.schedule.
"""
from __future__ import annotations

import itertools
import pkgutil
from types import SimpleNamespace

import pytest

from sglang_patches import hooks
from sglang_patches.admission import (
    decode_reservation_after_prefill,
    remaining_slot_need,
    slots_freed_by_next_compaction,
)
from sglang_patches.hooks import HOOKS, around_check_decode_mem, around_running_request_offset
from sglang_patches.runtime import RUNTIME_ATTR
from sglang_patches.settings import DENSE_REQUEST_PARAM, ENV_VAR, encode_config
from slime_sparse.kv import KVCompressConfig


def kv(method: str, budget: int, buffer: int) -> KVCompressConfig:
    return KVCompressConfig(method=method, budget=budget, buffer=buffer, window=2, granularity="model")


def simulate_need(prompt_len: int, generated: int, cache_len: int, max_new: int, cfg: KVCompressConfig,
                  dense: bool) -> int:
    """Largest cache size the request reaches from now on, minus its size now (brute force, one step at a time)."""
    budget, cap = cfg.budget, cfg.budget + cfg.buffer
    compress = cfg.method != "none" and not dense
    now = cache_len
    sizes = [now]
    if cache_len == 0:  # (re)prefill of every token so far, which samples one more token
        cache_len = prompt_len + generated
        generated += 1
        sizes.append(cache_len)
    while generated < max_new:  # one decode step: maybe compact, then write the newest token's slot
        at_trigger = cache_len >= cap or (cfg.method == "snapkv" and generated == 1 and cache_len > budget)
        if compress and at_trigger:
            cache_len = budget
        cache_len += 1
        generated += 1
        sizes.append(cache_len)
    return max(sizes) - now


CONFIGS = [kv("rkv", 8, 3), kv("rkv", 6, 1), kv("snapkv", 8, 3), kv("snapkv", 10, 6), kv("streaming", 8, 2),
           kv("none", 8, 3)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.method}-B{c.budget}-b{c.buffer}")
def test_running_request_need_equals_brute_force(cfg):
    cap = cfg.budget + cfg.buffer
    for max_new, cache_len in itertools.product(range(1, 2 * cap + 4), range(1, 2 * cap + 3)):
        for generated in range(1, max_new + 1):
            for dense in (False, True):
                expected = simulate_need(5, generated, cache_len, max_new, cfg, dense)
                got = remaining_slot_need(5, generated, cache_len, max_new, cfg, dense)
                assert got == expected, (max_new, cache_len, generated, dense)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.method}-B{c.budget}-b{c.buffer}")
def test_pending_prefill_need_equals_brute_force(cfg):
    cap = cfg.budget + cfg.buffer
    for prompt_len, generated, max_new in itertools.product(range(1, 2 * cap + 3), range(4), range(0, 2 * cap + 4)):
        for dense in (False, True):
            expected = simulate_need(prompt_len, generated, 0, max_new, cfg, dense)
            assert remaining_slot_need(prompt_len, generated, 0, max_new, cfg, dense) == expected
            assert decode_reservation_after_prefill(prompt_len, generated, max_new, cfg, dense) == (
                expected - prompt_len - generated
            )


def test_need_is_the_smaller_of_dense_need_and_budget_bound_by_hand():
    cfg = kv("rkv", 16, 4)  # cap 20
    assert remaining_slot_need(10, 5, 14, 100, cfg) == 6  # dense 95, bound 20 - 14
    assert remaining_slot_need(10, 5, 14, 8, cfg) == 3  # dense 3 < bound 6
    assert remaining_slot_need(10, 5, 14, 100, cfg, dense=True) == 95
    assert remaining_slot_need(10, 30, 20, 100, cfg) == 0  # at the trigger: back to 16, never above 20 again
    assert remaining_slot_need(30, 0, 0, 100, cfg) == 30  # a long prompt's prefill is its peak
    assert decode_reservation_after_prefill(10, 0, 100, cfg) == 10  # prefill 10, then up to 20
    assert decode_reservation_after_prefill(10, 0, 100, cfg, dense=True) == 99  # the last token is never cached
    snap = kv("snapkv", 16, 4)
    assert remaining_slot_need(18, 1, 18, 3, snap) == 0  # cut to 16 at the first decode step, 2 steps: 17, 18


def test_slots_freed_by_next_compaction():
    cfg = kv("rkv", 16, 4)
    assert slots_freed_by_next_compaction(20, 7, cfg) == 4
    assert slots_freed_by_next_compaction(19, 7, cfg) == 0
    assert slots_freed_by_next_compaction(20, 7, cfg, dense=True) == 0
    assert slots_freed_by_next_compaction(18, 1, kv("snapkv", 16, 4)) == 2  # prompt cut right after prefill
    assert slots_freed_by_next_compaction(18, 2, kv("snapkv", 16, 4)) == 0


def test_bad_input_names_the_field():
    cfg = kv("rkv", 16, 4)
    with pytest.raises(ValueError, match="cache_len=-1"):
        remaining_slot_need(10, 1, -1, 100, cfg)
    with pytest.raises(ValueError, match="max_new_tokens=-3"):
        remaining_slot_need(10, 1, 10, -3, cfg)
    with pytest.raises(ValueError, match="generated=0 with cache_len=7"):
        remaining_slot_need(10, 0, 7, 100, cfg)
    with pytest.raises(ValueError, match="prompt_len \\+ generated"):
        remaining_slot_need(0, 0, 0, 100, cfg)


# ----------------------------------------------------------------------------------------------------------------
# Hook bodies with stand-ins (default set)
# ----------------------------------------------------------------------------------------------------------------
CFG = kv("rkv", 16, 4)


def fake_req(generated: int, cache_len: int, max_new: int = 100, prompt_len: int = 10, dense: bool = False):
    custom = {DENSE_REQUEST_PARAM: True} if dense else None
    return SimpleNamespace(origin_input_ids=[0] * prompt_len, output_ids=[0] * generated, kv_committed_len=cache_len,
                           sampling_params=SimpleNamespace(max_new_tokens=max_new, custom_params=custom))


def attach(req_to_token_pool) -> None:
    """What after_alloc_memory_pool does to the process's ReqToTokenPool; the admission hooks read only the config."""
    setattr(req_to_token_pool, RUNTIME_ATTR, SimpleNamespace(cfg=CFG))


def detach(req_to_token_pool) -> None:
    delattr(req_to_token_pool, RUNTIME_ATTR)


def test_running_offset_hook_only_lowers_compressed_reservations():
    def sglang(adder, req):  # SGLang's formula with new_token_ratio 0.5
        return min(req.sampling_params.max_new_tokens - len(req.output_ids), 4096) * 0.5

    pool = SimpleNamespace()
    adder = SimpleNamespace(tree_cache=SimpleNamespace(req_to_token_pool=pool))
    attach(pool)
    assert around_running_request_offset(sglang, adder, fake_req(5, 14)) == 6  # min(47.5, 20 - 14)
    assert around_running_request_offset(sglang, adder, fake_req(5, 14, max_new=9)) == 2  # SGLang's 2 is smaller
    assert around_running_request_offset(sglang, adder, fake_req(5, 14, dense=True)) == 47.5
    detach(pool)
    assert around_running_request_offset(sglang, adder, fake_req(5, 14)) == 47.5


def test_decode_mem_hook_counts_slots_compaction_frees():
    reqs = [fake_req(9, 20), fake_req(9, 20), fake_req(9, 20, dense=True), fake_req(9, 12)]
    batch = SimpleNamespace(reqs=reqs, spec_algorithm=SimpleNamespace(is_none=lambda: True),
                            token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: 0),
                            new_tokens_required_next_decode=lambda sel=None: len(reqs if sel is None else sel),
                            req_to_token_pool=SimpleNamespace())
    attach(batch.req_to_token_pool)
    assert around_check_decode_mem(lambda b, selected_indices=None: False, batch)  # 0 free + 2 * 4 freed >= 4
    assert not around_check_decode_mem(lambda b, selected_indices=None: False, batch, selected_indices=[2, 3])
    detach(batch.req_to_token_pool)
    assert not around_check_decode_mem(lambda b, selected_indices=None: False, batch)


# ----------------------------------------------------------------------------------------------------------------
# SGLang's own PrefillAdder and ScheduleBatch with our hooks applied by its HookRegistry (marker `sglang`)
# ----------------------------------------------------------------------------------------------------------------
POOL = 400  # token slots in the allocator
RATIO = 0.5  # new_token_ratio


@pytest.fixture
def sglang_env(monkeypatch):
    """Import SGLang on CPU, apply every hook of ours through its HookRegistry, undo the patches afterwards."""
    from sglang_patches.source import activate_cpu_import_env, prepare_cpu_import_env

    activate_cpu_import_env(prepare_cpu_import_env())
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import get_context, reset_context

    from sglang_patches.plugin import register

    # PrefillAdder reads two context-parallel flags from the process-wide server args (a test-kit mock is allowed)
    get_context().set_server_args(SimpleNamespace(enable_dsa_prefill_context_parallel=False,
                                                  enable_prefill_context_parallel=False))

    for spec in HOOKS:  # monkeypatch puts the unhooked attributes back at teardown
        owner, name = spec.target.rsplit(".", 1)
        cls = pkgutil.resolve_name(owner)
        monkeypatch.setattr(cls, name, cls.__dict__[name])
    monkeypatch.setenv(ENV_VAR, encode_config(CFG))
    HookRegistry.reset()
    register()
    HookRegistry.apply_hooks()
    hooks.verify_hooks_applied()
    yield
    HookRegistry.reset()
    reset_context()


def sglang_request(rid: str, generated: int = 0, cache_len: int = 0, dense: bool = False, max_new: int = 100):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    custom = {DENSE_REQUEST_PARAM: True} if dense else None
    req = Req(rid, "", list(range(1, 11)), SamplingParams(max_new_tokens=max_new, custom_params=custom))  # 10 tokens
    req.output_ids = list(range(generated))
    req.kv_committed_len = req.kv_allocated_len = cache_len
    return req


def sglang_scene(running: list, rem_chunk_tokens: int | None = None):
    """An allocator of POOL slots (the running requests' caches taken from it), a ChunkCache, a decode batch."""
    import torch
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.chunk_cache import ChunkCache
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    kv_pool = MHATokenToKVPool(size=POOL, page_size=1, dtype=torch.float32, head_num=1, head_dim=2, layer_num=1,
                               device="cpu", enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(size=POOL, dtype=torch.float32, device="cpu", kvcache=kv_pool, need_sort=False)
    req_pool = ReqToTokenPool(size=64, max_context_len=256, device="cpu", enable_memory_saver=False)
    tree_cache = ChunkCache(CacheInitParams(disable=True, req_to_token_pool=req_pool,
                                            token_to_kv_pool_allocator=allocator, page_size=1))
    for req in running:
        assert allocator.alloc(req.kv_committed_len) is not None
    batch = ScheduleBatch.__new__(ScheduleBatch)  # only the fields admission and check_decode_mem read
    batch.reqs, batch.token_to_kv_pool_allocator, batch.tree_cache = running, allocator, tree_cache
    batch.spec_algorithm, batch.req_to_token_pool = SpeculativeAlgorithm.NONE, req_pool
    attach(req_pool)  # what after_alloc_memory_pool builds

    def new_adder() -> PrefillAdder:
        return PrefillAdder(page_size=1, tree_cache=tree_cache, token_to_kv_pool_allocator=allocator,
                            running_batch=batch, new_token_ratio=RATIO, rem_input_tokens=10_000,
                            rem_chunk_tokens=rem_chunk_tokens)

    return new_adder, batch, allocator, tree_cache, req_pool


def admit_all(adder, tree_cache, waiting: list) -> int:
    """The scheduler's loop over the waiting queue (get_new_batch_prefill): stop at the first refusal."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    admitted = 0
    for req in waiting:
        req.init_next_round_input(tree_cache)
        result = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
        if len(adder.can_run_list) > admitted:
            admitted += 1
        if result != AddReqResult.CONTINUE:
            break
    return admitted


def running_batch_reqs() -> list:
    # prompt 10, 5 generated, 14 cached, max_new_tokens 100: SGLang reserves min(95, CLIP) * 0.5 = 47.5 for each
    return [sglang_request("c1", 5, 14), sglang_request("c2", 5, 14), sglang_request("d", 5, 14, dense=True)]


@pytest.mark.sglang
@pytest.mark.slow
def test_running_compressed_requests_reserve_the_budget_bound(sglang_env):
    new_adder, *_, req_pool = sglang_scene(running_batch_reqs())
    # compressed: min(47.5, cap 20 - 14) = 6 each; dense opt-out: SGLang's 47.5
    assert new_adder().rem_total_token_offset == 6 + 6 + 47.5
    detach(req_pool)  # hooks inert: SGLang's own numbers
    assert new_adder().rem_total_token_offset == 3 * 47.5


@pytest.mark.sglang
@pytest.mark.slow
def test_more_requests_admitted_from_a_fixed_pool(sglang_env):
    running = running_batch_reqs()
    new_adder, _, allocator, tree_cache, req_pool = sglang_scene(running)
    assert allocator.available_size() == POOL - 42
    waiting = [sglang_request(f"w{i}") for i in range(30)]  # prompt 10, max_new_tokens 100

    # Unhooked: free 358 - 142.5 reserved = 215.5; each new request needs 10 + 100 + 1 (page) = 111 < what is
    # left, so the first fits (215.5 -> 104.5) and the second does not: 1 request.
    detach(req_pool)
    assert admit_all(new_adder(), tree_cache, waiting) == 1

    # Hooked: free 358 - 59.5 reserved = 298.5; each new request needs 10 + (20 - 10) + 1 = 21, admitted while
    # 21 < 298.5 - 21 k: k = 0..13, i.e. 14 requests (298.5 - 14 * 21 = 4.5 is left).
    attach(req_pool)
    adder = new_adder()
    assert admit_all(adder, tree_cache, waiting) == 14
    assert adder.rem_total_tokens == pytest.approx(4.5)

    # Dense-opted-out newcomers keep SGLang's 111 each (only the running requests' 59.5 is lowered):
    # 298.5 -> 187.5 -> 76.5 < 111, i.e. 2 requests.
    dense_waiting = [sglang_request(f"d{i}", dense=True) for i in range(5)]
    adder = new_adder()
    assert admit_all(adder, tree_cache, dense_waiting) == 2
    assert adder.rem_total_tokens == pytest.approx(298.5 - 2 * 111)


@pytest.mark.sglang
@pytest.mark.slow
def test_chunked_prompt_reserves_the_bound_only_with_its_last_chunk(sglang_env):
    new_adder, _, _, tree_cache, _ = sglang_scene([], rem_chunk_tokens=6)
    adder = new_adder()
    req = sglang_request("long")
    req.init_next_round_input(tree_cache)
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert adder.new_chunked_req is req
    assert adder.rem_total_token_offset == 6 + 1  # first chunk + page, no decode reservation (as SGLang)

    # next round: the rest of the prompt (4 tokens) completes it and reserves 10 more (up to cap 20), not 100
    req.prefix_indices = list(range(6))
    adder = new_adder()
    assert adder.add_chunked_req(req) is None
    assert adder.rem_total_token_offset == 4 + 10 + 1


@pytest.mark.sglang
@pytest.mark.slow
def test_decode_memory_check_counts_compaction(sglang_env):
    at_trigger = [sglang_request(f"t{i}", 9, 20) for i in range(3)]  # cache at cap: the next step frees 4 each
    dense = sglang_request("d", 9, 20, dense=True)
    _, batch, allocator, _, req_pool = sglang_scene(at_trigger + [dense])
    allocator.alloc(allocator.available_size())  # pool full: each request wants one slot for its next token
    assert batch.check_decode_mem()  # 0 free + 3 * 4 freed by compaction >= 4
    assert batch.check_decode_mem(selected_indices=[3, 0])  # 4 freed by t0 >= 2
    assert not batch.check_decode_mem(selected_indices=[3])  # the dense request frees nothing
    detach(req_pool)
    assert not batch.check_decode_mem()  # SGLang alone would retract
