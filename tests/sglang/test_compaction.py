"""Compaction and position logic of the SGLang budgeted KV cache, on pools with SGLang's exact layout.

The decode-loop tests drive sglang_patches.runtime exactly as the hooks do inside SGLang (the batched compaction of
#37; its equality with the per-request one it replaced is tests/sglang/test_batched.py), with the steps SGLang
itself performs in between (allocation of the next slot at req_to_token[row, seq_len], +1 on every length,
freeing req_to_token[row, :kv_committed_len] when a request finishes: see the `contract` checks). The pools are
either layout-identical stand-ins (fast, default) or SGLang's own ReqToTokenPool / MHATokenToKVPool /
TokenToKVPoolAllocator imported on CPU from the pinned wheel (marker `sglang`, slow: run with
`python -m pytest -q -p no:cacheprovider -m sglang tests/sglang/test_compaction.py`).

References are independent of the code under test: the test keeps each request's logical token list itself and
calls slime_sparse.kv.compress_indices on keys/queries taken from its own tables, not from the pools.
"""
from __future__ import annotations

import base64
import json
import math
import pickle
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.sglang_pools import replica_pools as _replica_pools
from tests.helpers.sglang_pools import sglang_pools as _sglang_pools
from sglang_patches.compaction import (
    append_kept_count,
    shift_positions,
    window_order,
    write_decode_queries,
    write_extend_queries,
)
from sglang_patches.evictions import EVICTIONS_INFO_KEY, RETRACTED, NotRecordable, decode_evictions
from sglang_patches.runtime import (
    EVICTED_ATTR,
    KEPT_INFO_KEY,
    SparseKVRuntime,
    capture_queries,
    evicted_count,
    reset_request,
)
from sglang_patches.settings import DENSE_REQUEST_PARAM
from slime_sparse.kv import EvictionRecord, KVCompressConfig, compress_indices, should_compress, visible_positions

L, HQ, HKV, D = 2, 4, 2, 8  # layers, query heads, KV heads, head dim
MAX_LEN = 96


# ----------------------------------------------------------------------------------------------------------------
# Pure functions, hand-computed
# ----------------------------------------------------------------------------------------------------------------
def test_window_order_is_oldest_first():
    assert window_order(torch.tensor([10, 4]), 4, 4).tolist() == [[2, 3, 0, 1], [0, 1, 2, 3]]  # positions 6..9, 0..3
    assert window_order(torch.tensor([10]), 2, 4).tolist() == [[0, 1]]  # positions 8, 9


def wire(info):
    """customized_info as SGLang's scheduler -> tokenizer IPC delivers it (pickled), then as JSON over HTTP."""
    return json.loads(json.dumps(pickle.loads(pickle.dumps(info))))


def test_shift_positions_adds_evicted_per_request():
    out = shift_positions(torch.tensor([5, 7, 0], dtype=torch.int32), torch.tensor([3, 0, 9]))
    assert out.tolist() == [8, 7, 9] and out.dtype == torch.int32


def test_kept_history_pads_prefill_tokens_with_dense_counts():
    history: list[int] = []
    append_kept_count(history, prompt_len=10, n_output=1, cache_len=11)  # token 0 came from prefill
    assert history == [10, 11]
    append_kept_count(history, prompt_len=10, n_output=4, cache_len=7)  # two tokens produced outside decode
    assert history == [10, 11, 12, 13, 7]


def ring_queries(buf: torch.Tensor, row: int, logical_len: int) -> torch.Tensor:
    """The request's last min(window, logical_len) queries [HQ, w, D] in token order."""
    w = min(buf.shape[1], logical_len)
    return buf[row, window_order(torch.tensor([logical_len]), w, buf.shape[1])[0]].transpose(0, 1)


def test_decode_and_extend_writes_leave_the_last_window_queries_in_order():
    window, rows = 4, 3
    buf = torch.zeros(rows, window, HQ, D)
    # extend: request in row 1 with 3 new tokens after a prefix of 4 (positions 4..6), row 2 with 6 tokens (0..5)
    q = torch.randn(9, HQ, D)
    positions = torch.tensor([4, 5, 6, 0, 1, 2, 3, 4, 5])
    write_extend_queries(buf, torch.tensor([1, 2]), positions, torch.tensor([7, 6]), torch.tensor([3, 6]), q)
    got2 = ring_queries(buf, row=2, logical_len=6)  # [HQ, 4, D]
    assert torch.equal(got2, q[5:9].transpose(0, 1))  # positions 2..5
    got1 = ring_queries(buf, row=1, logical_len=7)
    assert torch.equal(got1[:, 1:], q[0:3].transpose(0, 1))  # positions 4, 5, 6 (3 is from an earlier chunk)
    # decode: the next token of each request
    q_dec = torch.randn(2, HQ, D)
    write_decode_queries(buf, torch.tensor([1, 2]), torch.tensor([7, 6]), q_dec)
    got2 = ring_queries(buf, row=2, logical_len=7)
    assert torch.equal(got2, torch.cat([q[6:9], q_dec[1:]]).transpose(0, 1))
    # the extend's older tokens went to row 0, the padding row no request owns (decode padding writes there too)


# ----------------------------------------------------------------------------------------------------------------
# Pools: SGLang layout stand-ins, or SGLang's own classes
# ----------------------------------------------------------------------------------------------------------------
def replica_pools(rows: int, size: int):
    return _replica_pools(rows, size, L, HKV, D, MAX_LEN)


def sglang_pools(rows: int, size: int):
    return _sglang_pools(rows, size, L, HKV, D, MAX_LEN)


POOLS = [
    pytest.param(replica_pools, id="layout-replica"),
    pytest.param(sglang_pools, id="sglang-classes", marks=[pytest.mark.sglang, pytest.mark.slow]),
]


# ----------------------------------------------------------------------------------------------------------------
# A miniature of SGLang's decode loop around our hooks
# ----------------------------------------------------------------------------------------------------------------
class Mode:
    def __init__(self, name: str):
        self.name = name

    def is_decode(self) -> bool:
        return self.name == "decode"

    def is_extend(self) -> bool:
        return self.name == "extend"


@dataclass
class Tables:
    """What a toy model computes for the token at logical position p of a request: post-RoPE K, V and Q."""

    keys: torch.Tensor  # [n_req, L, MAX_LEN, HKV, D]
    values: torch.Tensor
    queries: torch.Tensor  # [n_req, L, MAX_LEN, HQ, D]

    @classmethod
    def random(cls, n_req: int, seed: int = 0) -> "Tables":
        g = torch.Generator().manual_seed(seed)
        shape = (n_req, L, MAX_LEN)
        return cls(torch.randn(*shape, HKV, D, generator=g), torch.randn(*shape, HKV, D, generator=g),
                   torch.randn(*shape, HQ, D, generator=g))


@dataclass
class Expected:
    """The test's own bookkeeping: which logical tokens each request's cache should hold."""

    logical: list[list[int]] = field(default_factory=list)
    events: list[list[tuple[int, list[int]]]] = field(default_factory=list)  # (tokens processed, logical kept)


class MiniScheduler:
    """dense: indices of requests sent with the per-request opt-out (custom_params), never compressed."""

    def __init__(self, cfg: KVCompressConfig, pools, tables: Tables, prompt_lens: list[int],
                 dense: frozenset[int] = frozenset(), stale_rings: bool = False):
        self.cfg, self.tables, self.dense = cfg, tables, dense
        self.req_to_token_pool, self.kv_pool, self.allocator = pools
        self.runtime = SparseKVRuntime.allocate(
            cfg, self.req_to_token_pool, self.kv_pool, self.allocator, num_q_heads=HQ, dtype=torch.float32
        ).attach()
        if stale_rings:  # what a server that served others (or resumed its memory) holds: never cleared, never read
            self.runtime.rings.normal_()
        self.size = self.allocator.available_size()
        self.reqs = [
            SimpleNamespace(rid=f"r{i}", origin_input_ids=list(range(n)), output_ids=[], req_pool_idx=i + 1,
                            kv_committed_len=0, kv_allocated_len=0, customized_info=None,
                            # as Req.__init__ stores /generate's custom_params (it adds "__req__")
                            sampling_params=SimpleNamespace(custom_params=(
                                {DENSE_REQUEST_PARAM: True, "__req__": None} if i in dense else None)))
            for i, n in enumerate(prompt_lens)
        ]
        self.expected = Expected([list(range(n)) for n in prompt_lens], [[] for _ in prompt_lens])
        self.positions_seen: list[list[int]] = [[] for _ in prompt_lens]
        self.attended: list[dict[int, list[int]]] = [{} for _ in prompt_lens]  # decode position -> tokens it read

    # SGLang's prefill: slots allocated, K/V written, queries captured by our RadixAttention hook
    def prefill(self) -> None:
        req_to_token = self.req_to_token_pool.req_to_token
        q_tokens, positions = [], []
        for i, req in enumerate(self.reqs):
            n = len(req.origin_input_ids)
            slots = self.allocator.alloc(n)
            req_to_token[req.req_pool_idx, :n] = slots.to(torch.int32)
            self._write_kv(i, slots, torch.arange(n))
            req.kv_committed_len = req.kv_allocated_len = n
            q_tokens.append(torch.arange(n))
            positions.append(torch.arange(n))
            req.output_ids.append(0)
        lens = torch.tensor([len(r.origin_input_ids) for r in self.reqs])
        rows = torch.tensor([r.req_pool_idx for r in self.reqs])
        fb = SimpleNamespace(forward_mode=Mode("extend"), req_pool_indices=rows, positions=torch.cat(positions),
                             seq_lens=lens, extend_seq_lens=lens)
        for layer in range(L):
            q = torch.cat([self.tables.queries[i, layer, q_tokens[i]] for i in range(len(self.reqs))])
            capture_queries(self.runtime.rings[layer], q.flatten(1), fb)

    def decode_step(self) -> SimpleNamespace:
        reqs = self.reqs
        lens = torch.tensor([r.kv_committed_len for r in reqs], dtype=torch.int64)
        batch = SimpleNamespace(reqs=reqs, seq_lens=lens.clone(), seq_lens_cpu=lens.clone(), seq_lens_sum=int(lens.sum()),
                                req_to_token_pool=self.req_to_token_pool)
        # hook, before SGLang's prepare_for_decode
        self.runtime.compact_batch(batch)
        self._expect_compaction(lens)
        # SGLang's prepare_for_decode (page_size 1, no overlap): new slot at req_to_token[row, seq_len], lengths + 1
        out = self.allocator.alloc(len(reqs))
        rows = torch.tensor([r.req_pool_idx for r in reqs])
        self.req_to_token_pool.req_to_token[rows, batch.seq_lens] = out.to(torch.int32)
        for r in reqs:
            r.kv_committed_len += 1
            r.kv_allocated_len += 1
        batch.seq_lens.add_(1)
        batch.seq_lens_cpu.add_(1)
        # hook, after it
        self.runtime.record_kept(batch)
        # ForwardBatch.init_new: clamp(seq_lens - 1), then our hook makes them logical
        positions = self.runtime.logical_decode_positions((batch.seq_lens - 1).clamp(min=0), reqs)
        for i, r in enumerate(reqs):
            p = int(positions[i])
            self.positions_seen[i].append(p)
            self.expected.logical[i].append(p)
            self.attended[i][p] = list(self.expected.logical[i])
            self._write_kv(i, out[i : i + 1], torch.tensor([p]))
        fb = SimpleNamespace(forward_mode=Mode("decode"), req_pool_indices=rows, positions=positions)
        for layer in range(L):
            q = torch.stack([self.tables.queries[i, layer, int(positions[i])] for i in range(len(reqs))])
            capture_queries(self.runtime.rings[layer], q.flatten(1), fb)
        for r in reqs:
            r.output_ids.append(0)
        return batch

    def finish_all(self) -> None:
        # ChunkCache.cache_finished_req: free req_to_token[row, :kv_committed_len]
        for r in self.reqs:
            self.allocator.free(self.req_to_token_pool.req_to_token[r.req_pool_idx, : r.kv_committed_len].long())

    def _write_kv(self, i: int, slots: torch.Tensor, logical: torch.Tensor) -> None:
        for layer in range(L):
            self.kv_pool.k_buffer[layer][slots] = self.tables.keys[i, layer, logical]
            self.kv_pool.v_buffer[layer][slots] = self.tables.values[i, layer, logical]

    def _expect_compaction(self, lens_before: torch.Tensor) -> None:
        """Independent reference: the same selection on the test's own tables and logical token lists."""
        for i, n in enumerate(lens_before.tolist()):
            if i in self.dense or not should_compress(n, self.cfg, first_decode=len(self.reqs[i].output_ids) == 1):
                continue
            held = torch.tensor(self.expected.logical[i])
            total = int(held[-1]) + 1
            window = list(range(max(0, total - self.cfg.window), total))
            keys = [self.tables.keys[i, layer, held].transpose(0, 1) for layer in range(L)]
            queries = [self.tables.queries[i, layer, window].transpose(0, 1) for layer in range(L)]
            kept = compress_indices(self.cfg, keys, queries)[0][0]
            self.expected.logical[i] = held[kept].tolist()
            self.expected.events[i].append((total, held[kept].tolist()))

    # invariants -------------------------------------------------------------------------------------------------
    def live_slots(self) -> list[torch.Tensor]:
        return [self.req_to_token_pool.req_to_token[r.req_pool_idx, : r.kv_committed_len].long() for r in self.reqs]

    def check_invariants(self) -> None:
        live = torch.cat(self.live_slots())
        free = self.allocator.free_pages
        everything = torch.cat([live, free])
        assert everything.numel() == self.size, "a slot leaked or was freed twice"
        assert torch.equal(everything.sort().values, torch.arange(1, self.size + 1)), "slot ids not conserved"
        for i, r in enumerate(self.reqs):
            slots = self.live_slots()[i]
            logical = torch.tensor(self.expected.logical[i])
            assert slots.numel() == logical.numel()
            for layer in range(L):  # the cache holds exactly the reference's tokens, in token order
                assert torch.equal(self.kv_pool.k_buffer[layer][slots], self.tables.keys[i, layer, logical])
            assert evicted_count(r) == int(logical[-1]) + 1 - logical.numel()


RKV = KVCompressConfig(method="rkv", budget=16, buffer=4, window=4, n_sink=2, granularity="model")
SNAP = KVCompressConfig(method="snapkv", budget=12, buffer=3, window=3, kernel_size=3, granularity="model")
# the newer methods and a preset, through the same plugin code (keys only; kvpress's conventions, window narrowed)
KEYDIFF = KVCompressConfig(method="keydiff", budget=12, buffer=4, window=2, granularity="model")
SNAP_KVPRESS = KVCompressConfig.from_preset("kvpress", method="snapkv", budget=12, buffer=3, window=3, kernel_size=3,
                                            granularity="model")


@pytest.mark.parametrize("make_pools", POOLS)
@pytest.mark.parametrize("cfg", [RKV, SNAP, KEYDIFF, SNAP_KVPRESS], ids=["rkv", "snapkv", "keydiff", "snapkv-kvpress"])
def test_decode_loop_compacts_like_the_reference_without_leaks(make_pools, cfg):
    prompt_lens = [5, 23, 14]  # below, above and between budget and budget + buffer
    sched = MiniScheduler(cfg, make_pools(rows=4, size=160), Tables.random(len(prompt_lens)), prompt_lens,
                          stale_rings=True)
    sched.prefill()
    sched.check_invariants()
    for _ in range(30):
        batch = sched.decode_step()
        sched.check_invariants()
        # physical lengths stay within B .. B + buffer once compression started; seq_lens mirror seq_lens_cpu
        assert torch.equal(batch.seq_lens, batch.seq_lens_cpu)
        for r, n in zip(sched.reqs, batch.seq_lens_cpu.tolist()):
            assert n == r.kv_committed_len == r.kv_allocated_len
            assert n <= cfg.budget + cfg.buffer
    for i, r in enumerate(sched.reqs):
        n0 = len(r.origin_input_ids)
        # positions given to RoPE are the logical indices n0, n0 + 1, ... whatever was evicted
        assert sched.positions_seen[i] == list(range(n0, n0 + 30))
        logical = sched.expected.logical[i]
        assert logical[: cfg.sinks] == list(range(cfg.sinks))  # sinks kept
        total = n0 + 30
        assert logical[-cfg.window :] == list(range(total - cfg.window, total))  # window kept
        assert evicted_count(r) > 0  # every request was compressed at least once in 30 steps
    sched.finish_all()
    assert sched.allocator.available_size() == sched.size  # back to full: nothing leaked
    assert torch.equal(sched.allocator.free_pages.sort().values, torch.arange(1, sched.size + 1))


@pytest.mark.parametrize("make_pools", POOLS)
def test_attention_over_compacted_cache_equals_masked_dense_attention(make_pools):
    cfg = RKV
    sched = MiniScheduler(cfg, make_pools(rows=2, size=96), Tables.random(1, seed=3), [27])
    sched.prefill()
    for _ in range(9):
        sched.decode_step()
    req, t = sched.reqs[0], sched.tables
    slots = sched.live_slots()[0]
    kept_logical = torch.tensor(sched.expected.logical[0])
    total = int(kept_logical[-1]) + 1
    q_pos = total - 1
    group = HQ // HKV
    for layer in range(L):
        q = t.queries[0, layer, q_pos]  # [HQ, D]
        # compacted: what an attention kernel reads through req_to_token[row, :seq_len]
        k_c = sched.kv_pool.k_buffer[layer][slots].repeat_interleave(group, dim=1)  # [n, HQ, D]
        v_c = sched.kv_pool.v_buffer[layer][slots].repeat_interleave(group, dim=1)
        out_c = torch.einsum("hn,nhd->hd", torch.softmax(torch.einsum("hd,nhd->hn", q, k_c) / math.sqrt(D), -1), v_c)
        # dense over every logical token, masked to the kept set
        k_d = t.keys[0, layer, :total].repeat_interleave(group, dim=1)
        v_d = t.values[0, layer, :total].repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,nhd->hn", q, k_d) / math.sqrt(D)
        mask = torch.full((total,), float("-inf"))
        mask[kept_logical] = 0.0
        out_d = torch.einsum("hn,nhd->hd", torch.softmax(logits + mask, -1), v_d)
        torch.testing.assert_close(out_c, out_d, rtol=1e-5, atol=1e-6)
    assert slots.numel() < total  # something really was evicted


def test_kept_history_follows_the_budget_cycle():
    cfg = KVCompressConfig(method="streaming", budget=10, buffer=3, window=2, granularity="model")
    sched = MiniScheduler(cfg, replica_pools(rows=1, size=64), Tables.random(1), [6])
    sched.prefill()
    for _ in range(12):
        sched.decode_step()
    history = sched.reqs[0].customized_info[KEPT_INFO_KEY]
    # token 0 from prefill reads 6; decode tokens read 7, 8, ... until 13 = B + buffer would be reached, then
    # the cache is cut to B = 10 before the step and reads 11, and so on
    assert history == [6, 7, 8, 9, 10, 11, 12, 13, 11, 12, 13, 11, 12]
    assert len(history) == len(sched.reqs[0].output_ids)


def test_reset_request():
    req = SimpleNamespace(customized_info=None, output_ids=[0, 0, 0])
    setattr(req, EVICTED_ATTR, 7)
    reset_request(req)
    assert evicted_count(req) == 0
    # its next token comes from a dense re-prefill: said on the wire at that token's index
    assert req.customized_info[EVICTIONS_INFO_KEY] == [0, 0, 0, RETRACTED]
    reset_request(req)  # nothing evicted any more: nothing to say
    assert req.customized_info[EVICTIONS_INFO_KEY] == [0, 0, 0, RETRACTED]


@pytest.mark.parametrize("cfg", [RKV, SNAP, KEYDIFF, SNAP_KVPRESS], ids=["rkv", "snapkv", "keydiff", "snapkv-kvpress"])
def test_a_request_that_opts_out_keeps_its_whole_cache_beside_compressed_ones(cfg):
    """Dense evaluation on a compressing server: the flagged request is never compacted, its neighbour in the same
    batch is, and the pool stays consistent for both."""
    prompt_lens = [23, 23]
    sched = MiniScheduler(cfg, replica_pools(rows=3, size=160), Tables.random(2, seed=5), prompt_lens, dense={1})
    sched.prefill()
    for _ in range(20):
        sched.decode_step()
        sched.check_invariants()
    sparse, dense = sched.reqs
    total = 23 + 20
    assert dense.kv_committed_len == total and evicted_count(dense) == 0
    assert sched.expected.logical[1] == list(range(total))  # every token kept, in order
    assert sched.positions_seen[1] == list(range(23, total))
    assert dense.customized_info[KEPT_INFO_KEY] == list(range(23, total + 1))[: len(dense.output_ids)]
    assert evicted_count(sparse) > 0 and sparse.kv_committed_len <= cfg.budget + cfg.buffer
    sched.finish_all()
    assert sched.allocator.available_size() == sched.size


# ----------------------------------------------------------------------------------------------------------------
# Eviction events shipped in meta_info (sglang_patches.evictions) -> the learner's EvictionRecord
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make_pools", POOLS)
@pytest.mark.parametrize("cfg", [RKV, SNAP, KEYDIFF, SNAP_KVPRESS], ids=["rkv", "snapkv", "keydiff", "snapkv-kvpress"])
def test_shipped_evictions_are_what_the_compaction_kept_and_what_each_token_read(make_pools, cfg):
    prompt_lens = [5, 23, 14]  # snapkv cuts the 23-token prompt at the first decode step
    sched = MiniScheduler(cfg, make_pools(rows=4, size=160), Tables.random(len(prompt_lens), seed=7), prompt_lens)
    sched.prefill()
    # SGLang may stream entries [offset, output length) at any step: what it sent (or found missing) must stay so
    sent = [(0, []) for _ in prompt_lens]
    for _ in range(30):
        sched.decode_step()
        sched.check_invariants()
        for i, r in enumerate(sched.reqs):
            history = (r.customized_info or {}).get(EVICTIONS_INFO_KEY, [])
            n_sent, entries = sent[i]
            # no event written below an index already streamed (padding there only stands for "nothing")
            assert [e for e in history[:n_sent] if e] == entries
            sent[i] = (len(r.output_ids), [e for e in history[: len(r.output_ids)] if e])
    for i, r in enumerate(sched.reqs):
        meta = wire(r.customized_info)  # what meta_info carries over HTTP
        record = decode_evictions(meta[EVICTIONS_INFO_KEY])
        events = sched.expected.events[i]
        assert len(events) >= 2  # two compressions or more, with evictions in between
        # (a) the events are the reference's: tokens processed before each compression, logical positions kept
        assert record.starts.tolist() == [start for start, _ in events]
        assert record.kept_positions()[:, 0, 0].tolist() == [kept for _, kept in events]
        # (b) the same record the embedded engine builds from those events
        reference = EvictionRecord.from_events([(start, torch.tensor(kept).view(1, 1, -1)) for start, kept in events])
        assert record.shape == reference.shape == (1, 1, cfg.budget)
        assert torch.equal(record.starts, reference.starts) and torch.equal(record.keep_bits, reference.keep_bits)
        # (c) the learner's mask = what each token attended to: causal over the prompt (prefill), then the cache
        n0, total = prompt_lens[i], prompt_lens[i] + 30
        visible = visible_positions(record, total, layer=0)[0]
        for q in range(n0):
            assert visible[q].nonzero().flatten().tolist() == list(range(q + 1))
        for q in range(n0, total):
            assert visible[q].nonzero().flatten().tolist() == sched.attended[i][q], q


def test_a_dense_request_ships_no_record_and_a_retracted_one_none_it_can_misstate():
    sched = MiniScheduler(RKV, replica_pools(rows=3, size=160), Tables.random(2, seed=1), [23, 23], dense={1})
    sched.prefill()
    for _ in range(10):
        sched.decode_step()
    sparse, dense = sched.reqs
    assert EVICTIONS_INFO_KEY not in dense.customized_info
    entries = wire(sparse.customized_info)[EVICTIONS_INFO_KEY]
    assert decode_evictions(entries) is not None
    reset_request(sparse)  # SGLang retracts it: re-prefilled densely, so later tokens see everything again
    with pytest.raises(NotRecordable, match="retracted"):
        decode_evictions(wire(sparse.customized_info)[EVICTIONS_INFO_KEY])


def test_decoding_refuses_entries_the_plugin_cannot_have_sent():
    sched = MiniScheduler(RKV, replica_pools(rows=1, size=96), Tables.random(1, seed=2), [9])
    sched.prefill()
    for _ in range(24):
        sched.decode_step()
    entries = [e for e in wire(sched.reqs[0].customized_info)[EVICTIONS_INFO_KEY] if e]
    assert len(entries) >= 3
    with pytest.raises(ValueError, match="an event was lost"):
        decode_evictions(entries[:1] + entries[2:])
    start, held, bits = entries[0]
    with pytest.raises(ValueError, match="bits for"):
        decode_evictions([[start, held, base64.b64encode(base64.b64decode(bits) + b"\x00").decode()]] + entries[1:])
    with pytest.raises(ValueError, match=r"\[start, held, bits\]"):
        decode_evictions([[start, held]])
    assert decode_evictions([0, None, 0]) is None
