"""The embedded engine's rows have one owner (rows.Rows), the scheduler hands out work orders, one trigger rule.

- Debug mode (`check_rows`, SLIME_SPARSE_CHECK_ROWS=1): after every decode window the host's row table and the
  device's fills, seen counts and stream counters agree, for every registered KV method, through continuous batching,
  shared prefills, chunked prefills, compressions, per-layer budgets and partial-rollout continuations; turning it on
  changes no token. A change applied to one side only (a compaction that clamps the fill differently on the host)
  is caught.
- The scheduler never calls the runner: a call is a sequence of work orders the engine's loop runs.
- `kv.should_compress` over an array of fills answers what it answers for each fill.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from slime_sparse.kv import METHODS, KVCompressConfig, should_compress
from slime_sparse.rollout import SamplingParams
from slime_sparse.rollout.embedded import EmbeddedEngine
from slime_sparse.rollout.embedded import orders
from slime_sparse.rollout.embedded.cache import BudgetKVCache
from slime_sparse.rollout.embedded.rows import RowMismatch, Rows
from slime_sparse.rollout.embedded.runner import ModelRunner
from slime_sparse.rollout.embedded.scheduler import Scheduler
from slime_sparse.rollout.embedded.step import DecodeState
from slime_sparse.rollout.partial import PartialSpec
from slime_sparse.utils.threads import torch_threads


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # tiny models gain nothing from intra-op threads on a shared box (test_rollout_embedded.py)
    with torch_threads(1):
        yield


def tiny_model():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=128)).eval()


# a 30-token prompt (chunked: longer than budget + buffer), groups of 2 samples (shared prefills), samples that stop
# at different lengths (retired rows, the last running row moved into their place), more sequences than rows
PROMPTS = [list(range(3, 33)), list(range(3, 33)), [5, 17, 3, 9, 40], [5, 17, 3, 9, 40], [11, 2], [7, 8, 1, 60, 61]]
SAMPLE = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=32, stop_token_ids=[4, 9], ignore_eos=True)


def kv_of(method: str, **extra) -> KVCompressConfig:
    if method == "none":
        return KVCompressConfig(method="none")
    return KVCompressConfig(method=method, budget=10, buffer=4, window=3, **extra)


def generate(kv, check: bool, prompts=PROMPTS, **kw):
    engine = EmbeddedEngine(tiny_model(), kv, max_batch_size=3, check_rows=check)
    return engine, engine.generate(prompts, SAMPLE, seed=5, **kw)


def counting_checks(monkeypatch) -> list[int]:
    """Count the checks that ran (the real check, called through)."""
    calls: list[int] = []
    check = Rows.check

    def counted(self, n):
        calls.append(n)
        check(self, n)

    monkeypatch.setattr(Rows, "check", counted)
    return calls


@pytest.mark.parametrize("method", ("none",) + tuple(m for m in METHODS if m != "none"))
def test_host_and_device_rows_agree_after_every_window_for_every_method(method, monkeypatch):
    kv = kv_of(method)
    _, plain = generate(kv, check=False)
    calls = counting_checks(monkeypatch)
    engine, checked = generate(kv, check=True)
    assert len(calls) >= SAMPLE.max_new_tokens  # a window per step on CPU, the whole call long
    assert [o.response_ids for o in checked] == [o.response_ids for o in plain]
    assert [o.logprobs for o in checked] == [o.logprobs for o in plain]
    assert len({len(o.response_ids) for o in checked}) > 1, "every sample ran as long: no row was retired and moved"
    if method != "none":
        assert engine.last_stats.compressions > 0 and any(o.kv.compressions for o in checked)


def test_rows_agree_under_per_layer_budgets_and_through_continuations(monkeypatch):
    """Pyramid budgets (layers of different fills) and partial rollouts: an aborted call, then its continuations
    (their prefill replays the record's compressions, `Rows.replay`, and resumes the stream, `Rows.resume`)."""
    calls = counting_checks(monkeypatch)
    kv = kv_of("h2o", budget_schedule="explicit", layer_budgets=(14, 8))
    groups = tuple(i // 2 for i in range(len(PROMPTS)))
    engine, outs = generate(kv, check=True, partial=PartialSpec(groups, 1))
    assert any(o.finish_reason == "abort" and o.kv.compressions for o in outs), "no sample was cut after compressing"
    for _ in range(6):
        todo = [i for i, o in enumerate(outs) if o.finish_reason == "abort"]
        if not todo:
            break
        more = engine.generate([PROMPTS[i] for i in todo], SAMPLE, seed=9, partial=PartialSpec(
            tuple(groups[i] for i in todo), 1, tuple(outs[i] for i in todo)))
        for i, o in zip(todo, more):
            outs[i] = o
    assert not any(o.finish_reason == "abort" for o in outs) and calls


@pytest.mark.parametrize("broken", ["compacted", "decoded"])
def test_a_change_applied_to_one_side_only_is_caught(broken, monkeypatch):
    """The issue's hazard: the host applies a compaction's fill (or a step's query count) differently from the
    device."""
    if broken == "compacted":
        monkeypatch.setattr(Rows, "compacted", lambda self, rows, budgets: None)  # the host keeps the old fill
    else:
        decoded = Rows.decoded

        def uncounted(self, bucket):  # a step whose query the host forgets to count (every fourth step)
            rows = decoded(self, bucket)
            self.table.seen[:bucket] -= int(self.table.seen[0] % 4 == 0)
            return rows

        monkeypatch.setattr(Rows, "decoded", uncounted)
    with pytest.raises(RowMismatch, match="host and device disagree"):  # prompts that compress while decoding only
        generate(kv_of("snapkv"), check=True, prompts=PROMPTS[2:])


def test_rows_change_both_sides():
    """Reset, park, share and move keep the host table and the cache equal; a device-only change is reported."""
    cache = BudgetKVCache(num_rows=4, num_layers=2, num_kv_heads=1, num_q_heads=1, head_dim=2, capacity=8, window=2,
                          record_queries=True, track_mass=False, device=torch.device("cpu"), dtype=torch.float32)
    rows = Rows(cache, DecodeState.allocate(4, 1, torch.device("cpu")), max_new_tokens=4, checked=True)
    for row in range(4):
        rows.park(row)
    rows.reset(0)
    rows.reset(1)
    cache.fill[:, 0] += 3  # what a prefill's forward does on the device ...
    cache.seen[0] += 3
    rows.prefilled(0, 3)  # ... and on the host
    rows.share(0, 1)
    rows.move(1, 2)
    rows.check(3)
    assert rows.table.fill[:, :3].tolist() == [[3, 3, 3], [3, 3, 3]] and rows.table.fill[0, 3] == 8
    cache.seen[2] += 1
    with pytest.raises(RowMismatch, match=r"rows \[2\]"):
        rows.check(3)


def test_the_scheduler_only_hands_out_work_orders(monkeypatch):
    """No runner in the scheduler; the engine's loop runs every order: prefills, first tokens, decode steps,
    compactions and readbacks, one decode order per counted decode forward."""
    assert "runner" not in Scheduler.__dataclass_fields__
    seen: list[object] = []
    run = ModelRunner.run
    monkeypatch.setattr(ModelRunner, "run", lambda self, order: (seen.append(order), run(self, order))[1])
    engine, _ = generate(kv_of("rkv"), check=False)
    kinds = [type(o) for o in seen]
    assert kinds[0] is orders.Prefill and kinds[-1] is orders.ReadTokens
    assert set(kinds) == {orders.Prefill, orders.SampleFirst, orders.Decode, orders.Compact, orders.ReadTokens}
    stats = engine.last_stats
    assert kinds.count(orders.Decode) + kinds.count(orders.Prefill) == stats.forwards
    assert kinds.count(orders.Compact) == stats.compaction_calls


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("first_decode", [False, True])
def test_one_trigger_rule_for_a_fill_and_for_an_array_of_fills(method, first_decode):
    for kv in (kv_of(method), KVCompressConfig(method=method, budget=10, buffer=2, window=2,
                                               budget_schedule="explicit", layer_budgets=(10, 6))):
        if method == "none":
            kv = KVCompressConfig(method="none")
        fills = np.arange(0, 40)
        due = should_compress(fills, kv, first_decode=first_decode)
        assert due.dtype == bool and due.shape == fills.shape
        assert due.tolist() == [should_compress(int(f), kv, first_decode=first_decode) for f in fills]
        assert due.any() == kv.enabled


def test_importing_the_contract_registers_no_attention():
    code = ("import slime_sparse.rollout.embedded.contract as c\n"
            "from transformers import AttentionInterface\n"
            "assert c.PROBE_ATTENTION not in AttentionInterface._global_mapping\n"
            "assert all(f.ok for f in c.check('qwen2'))\n"
            "assert c.PROBE_ATTENTION in AttentionInterface._global_mapping\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("method", METHODS)
def test_rows_agree_at_the_graphs_shapes_with_late_readback(method, monkeypatch):
    """On CPU, the shapes graphs run at: rows padded to a bucket (parked rows inside a step, spans rounded up) and the
    tokens read every 8 steps (rows run past their end until the host notices); checked after every window."""
    import slime_sparse.rollout.embedded.runner as runner_module
    from slime_sparse.rollout.embedded.step import decode_shapes

    calls = counting_checks(monkeypatch)
    monkeypatch.setattr(runner_module, "decode_shapes", lambda mode, rows: decode_shapes("cuda_graph", rows))
    outs = EmbeddedEngine(tiny_model(), kv_of(method), max_batch_size=8, readback_interval=8,
                          check_rows=True).generate(PROMPTS, SAMPLE, seed=5)
    assert any(n not in (1, 2, 4, 8) for n in calls), calls  # a window whose steps ran parked rows (buckets 1, 2, 4, 8)
    assert len({len(o.response_ids) for o in outs}) > 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["none", "rkv", "h2o"])
def test_rows_agree_under_cuda_graphs(method):
    """What only a GPU runs (tools/gpu_checks.sh): decode steps and compactions replayed from CUDA graphs (rows padded
    to a bucket: parked rows inside a step), the tokens read every 8 steps (the host two windows ahead of the
    device); the check after every window, and no token changed by it."""
    model = tiny_model().to("cuda")
    engines = [EmbeddedEngine(model, kv_of(method), device="cuda", step_mode="cuda_graph", max_batch_size=5,
                              readback_interval=8, check_rows=check) for check in (False, True)]
    plain, checked = (engine.generate(PROMPTS * 2, SAMPLE, seed=5) for engine in engines)
    assert [o.response_ids for o in checked] == [o.response_ids for o in plain]
    assert engines[1].captures > 0
